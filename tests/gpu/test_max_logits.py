"""Per-head max logits from the Hopper forward kernel (``FwdConfig.max_logits``), on an H200.

``jax_fa4.flash_attention(..., return_max_logits=True, implementation="sm90")`` under
``jax.jit`` against :func:`jax_fa4.reference.row_max_logits` (float32 from the same inputs):
dense calls (persistent and one-tile-per-CTA configs: every mask kind, softcap, GQA, a sink,
odd and mismatched lengths, both dtypes, head dims 64 and 128) and segment-id calls (packed
and non-contiguous ids, a query id no key has: ``-inf``), in NaN-poisoned memory. The out and
lse of the same call still pass FA4's rule (the tracking changes nothing else), and the
gradient of a call that asks for max logits equals that of one that does not.

Kernels needed in the cache: the shipped max-logit forward configs (dense and segment ids).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import reference
from tests.gpu.test_segments import packed
from tests.gpu.test_sm90_fwd import _inputs, check_forward, poison_device_memory

pytestmark = pytest.mark.gpu

#: |kernel - reference| allowed, relative to max(1, |reference|): the kernel's scores are the
#: tensor cores' float32 sums of 16-bit products (another order than the reference's), times
#: scale·log2 e and back (two float32 roundings)
RTOL = 2e-5


def _check(got, q, k, name, **kw):
    want = np.asarray(reference.row_max_logits(q, k, **kw).max(axis=-1))
    got = np.asarray(got)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=name)
    fin = np.isfinite(want)
    assert np.isfinite(got[fin]).all(), name
    err = np.abs(got[fin] - want[fin]) / np.maximum(1.0, np.abs(want[fin]))
    assert err.size == 0 or err.max() <= RTOL, (name, float(err.max()))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq, sk, h, hkv, causal, window, softcap, sink", [
    (1000, 1000, 4, 4, False, (None, None), 0.0, False),
    (777, 1201, 8, 2, True, (None, None), 0.0, True),
    (1500, 900, 4, 1, False, (200, 17), 0.0, False),
    (640, 640, 4, 2, True, (None, None), 30.0, False),
    (333, 4000, 4, 4, False, (None, None), 5.0, True),
])
def test_dense(dtype, d, sq, sk, h, hkv, causal, window, softcap, sink):
    seed = zlib.crc32(repr((sq, sk, h, d, causal, window, softcap, sink)).encode())
    q, k, v = _inputs(seed, 2, sq, sk, h, hkv, d, d, dtype)
    q = q * 3  # scores spread wider than N(0, 1)'s: a max that stands out per row
    sinks = jax.random.normal(jax.random.key(seed + 1), (h,), jnp.float32) if sink else None
    kw = dict(causal=causal, window_size=window, softcap=softcap)

    def kernel(q, k, v, s):
        return jax_fa4.flash_attention(q, k, v, learnable_sink=s, return_lse=True,
                                       return_max_logits=True, implementation="sm90", **kw)

    poison_device_memory()
    out, lse, max_logits = jax.block_until_ready(jax.jit(kernel)(q, k, v, sinks))
    name = f"dense {jnp.dtype(dtype).name} d={d} sq={sq} sk={sk} {kw} sink={sink}"
    window_ref = (window[0], 0) if causal else window
    _check(max_logits, q, k, name, window=window_ref, softcap=softcap)
    ref = dict(window=window_ref, softcap=softcap, learnable_sink=sinks)
    check_forward(out, lse, reference.attention(q, k, v, **ref),
                  reference.attention(q, k, v, compute_dtype=dtype, **ref), softcap, name)


@pytest.mark.parametrize("ids_kind, causal, softcap", [
    ("packed", False, 0.0), ("packed", True, 0.0), ("packed", True, 20.0),
    ("random", False, 0.0), ("unmatched", False, 0.0),
])
def test_segments(ids_kind, causal, softcap):
    rng = np.random.default_rng(zlib.crc32(ids_kind.encode()) + causal)
    b, s, h, hkv, d = 2, 1537, 4, 2, 128
    q_ids = packed(rng, b, s, 6) if ids_kind != "random" else rng.integers(
        0, 3, (b, s)).astype(np.int32)
    kv_ids = q_ids.copy()
    if ids_kind == "unmatched":  # the first document's queries find no key with their id
        kv_ids = np.where(kv_ids == kv_ids[:, :1], -7, kv_ids)
    q, k, v = _inputs(int(rng.integers(1 << 30)), b, s, s, h, hkv, d, d, jnp.bfloat16)
    ids = (jnp.asarray(q_ids), jnp.asarray(kv_ids))

    def kernel(q, k, v):
        return jax_fa4.flash_attention(q, k, v, causal=causal, softcap=softcap,
                                       segment_ids=ids, return_max_logits=True,
                                       implementation="sm90")

    poison_device_memory()
    _, max_logits = jax.block_until_ready(jax.jit(kernel)(q, k, v))
    _check(max_logits, q, k, f"segments {ids_kind} causal={causal} softcap={softcap}",
           window=(None, 0) if causal else (None, None), softcap=softcap,
           q_segment_ids=ids[0], kv_segment_ids=ids[1])
    if ids_kind == "unmatched":
        assert np.isfinite(np.asarray(max_logits)).all()  # other documents remain


def test_gradient_is_unchanged():
    """Asking for max logits leaves the forward's out and every gradient as they were (the
    deterministic backward, so the two runs can be compared bit for bit)."""
    q, k, v = _inputs(11, 2, 1024, 1024, 4, 2, 128, 128, jnp.bfloat16)

    def loss(q, k, v, with_max):
        res = jax_fa4.flash_attention(q, k, v, causal=True, return_max_logits=with_max,
                                      deterministic=True, implementation="sm90")
        out = res[0] if with_max else res
        return jnp.sum(out.astype(jnp.float32) ** 2)

    grads = [jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, k, v, m)
             for m in (False, True)]
    for a, b in zip(*grads):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
