"""``jax_fa4.dot_product_attention`` on the Hopper kernels, on an H100/H200.

A padded batch (``query_seq_lengths`` / ``key_value_seq_lengths`` with causal masking, a
batch entry without keys among them) and a top-left local window with T != S, each under
``jax.jit``: the program holds exactly the forward kernel's custom call (no reference, no
(T, S) mask), and the output and residual agree with ``jax.nn.dot_product_attention``'s XLA
implementation (float32 inputs as the reference, FA4's rule against its bfloat16 run; rows
jax.nn masks whole, exactly its values).

Kernels needed in the cache: the segment-id forward (bf16, head dim 128, causal, GQA) and the
local-window forward (bf16, head dim 128, GQA) of the ``tests`` suite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from numerics import assert_fa4_close
from tests.gpu.test_sm90_fwd import _inputs, poison_device_memory

pytestmark = pytest.mark.gpu

KERNEL_CALL = "CuteDSLRT_NvJaxCutlassCall_v2"

#: name -> ((B, T, S, N, K, H), options, (query_seq_lengths, key_value_seq_lengths) or None)
CASES = {
    "padded-batch": ((3, 1000, 1000, 8, 2, 128), {"is_causal": True},
                     ([1000, 613, 1], [1000, 777, 0])),
    "window": ((2, 1536, 2048, 8, 2, 128), {"local_window_size": (256, 64)}, None),
}


def attend(case: str):
    """The GPU call of ``case``: ``(q, k, v, lengths) -> (output, residual)``, lengths a dict
    of the call's sequence-length arguments (empty without them)."""
    kw = CASES[case][1]

    def call(q, k, v, lengths):
        return jax_fa4.dot_product_attention(q, k, v, return_residual=True, **kw, **lengths)

    return call


def lengths(case: str, spec: bool = False) -> dict:
    """The call's sequence-length arguments (``jax.ShapeDtypeStruct`` with ``spec``)."""
    given = CASES[case][2]
    if given is None:
        return {}
    names = ("query_seq_lengths", "key_value_seq_lengths")
    return {name: (jax.ShapeDtypeStruct((len(x),), jnp.int32) if spec
                   else jnp.asarray(x, jnp.int32)) for name, x in zip(names, given)}


@pytest.mark.parametrize("case", CASES)
def test_lowers_to_kernels_and_matches_jax_nn(case):
    (b, t, s, n, kh, h), kw, _ = CASES[case]
    q, k, v = _inputs(len(case), b, t, s, n, kh, h, h, jnp.bfloat16)
    lens = lengths(case)
    fn = jax.jit(attend(case))
    assert fn.lower(q, k, v, lens).as_text().count(KERNEL_CALL) == 1
    poison_device_memory()
    out, res = jax.block_until_ready(fn(q, k, v, lens))

    def xla(dtype):
        with jax.default_matmul_precision("highest"):  # (float32: no TF32 products)
            return jax.nn.dot_product_attention(
                *(x.astype(dtype) for x in (q, k, v)), return_residual=True,
                implementation="xla", **kw, **lens)

    ref, ref_res = xla(jnp.float32)
    pt, _ = xla(jnp.bfloat16)
    assert_fa4_close(out, ref.astype(out.dtype), pt, name=f"{case} output")
    got_res, want_res = (np.asarray(x, np.float32) for x in (res, ref_res.astype(res.dtype)))
    masked = want_res < -1e30  # rows jax.nn masks whole: its large negative, exactly
    np.testing.assert_array_equal(got_res[masked], want_res[masked])
    np.testing.assert_allclose(got_res[~masked], want_res[~masked], rtol=2e-2, atol=2e-2)
