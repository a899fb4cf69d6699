"""Ring attention (context parallelism in shard_map) against unsplit attention.

The 4-device checks run in a subprocess with simulated CPU devices
(``tests/multidevice_checks.py ring``); layout helpers, errors and the one-device ring run here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_fa4
from compiled import per_class
from conformance import normal
from jax_fa4.parallel import ring
from test_sharding import multidevice_suite


@pytest.fixture(scope="module")
def suite():
    return multidevice_suite("ring")


def _ring_class(case: str) -> str:
    """The quick tier runs one case per class (``--exhaustive``: all): the ring's layout
    (non-causal, causal zig-zag, causal contiguous), and segment ids on any layout."""
    if case.endswith("_segments"):
        return "segments"
    return case if case == "noncausal" else case.split("_")[1]


@pytest.mark.parametrize("case", per_class(["noncausal", "causal_zigzag", "causal_contiguous",
                                            "causal_zigzag_mqa_softcap", "causal_zigzag_segments",
                                            "noncausal_segments", "causal_contiguous_segments"],
                                           _ring_class))
def test_ring_matches_unsplit_attention_forward_and_gradients(suite, case):
    r = suite[case]
    assert "error" not in r, r.get("traceback")
    tol = 1e-5 * max(1.0, r["grad_scale"])
    assert r["out_err"] <= 1e-5 and r["lse_err"] <= 1e-5, r
    assert max(r["grad_errs"]) <= tol, r  # dq, dk, dv, with cotangents on out and lse
    assert "collective-permute" in r["collectives"] and "all-gather" not in r["collectives"]


def test_ring_bfloat16(suite):
    r = suite["noncausal_mha_bf16"]
    assert "error" not in r, r.get("traceback")
    # Same bf16 inputs, different summation order: bf16 rounding of the outputs (2^-8 rel).
    assert r["out_err"] <= 2e-2 and r["lse_err"] <= 1e-3, r
    assert max(r["grad_errs"]) <= 3e-2 * max(1.0, r["grad_scale"]), r


@pytest.mark.parametrize("case", ["kernel_trace", "kernel_trace_causal"])
def test_ring_gradients_through_the_kernels_keep_their_mesh_axes(suite, case):
    r = suite[case]
    assert "error" not in r, r.get("traceback")
    # every hop's backward runs preprocess, main and postprocess kernels (4 hops; causal hops
    # hold them in both cond branches); the forward's calls sit in the custom_vjp's own jaxpr
    assert r["kernel_calls"] >= 3 * 4, r


# -- layout helpers ----------------------------------------------------------------------------
def test_zigzag_gives_device_i_chunks_i_and_2n_minus_1_minus_i():
    n, s = 4, 16
    x = jnp.arange(s)
    z = ring.zigzag(x, n, axis=0)
    blocks = np.asarray(z).reshape(n, 2, s // (2 * n)) // (s // (2 * n))  # chunk ids
    for i in range(n):
        assert set(blocks[i, 0]) == {i} and set(blocks[i, 1]) == {2 * n - 1 - i}
    assert jnp.array_equal(ring.unzigzag(z, n, axis=0), x)


def test_zigzag_round_trip_on_the_sequence_axis():
    (x,) = normal("zigzag", [(2, 24, 3, 4)], jnp.float32)
    assert jnp.array_equal(ring.unzigzag(ring.zigzag(x, 3), 3), x)
    assert jax_fa4.zigzag is ring.zigzag and jax_fa4.unzigzag is ring.unzigzag


def test_zigzag_needs_a_multiple_of_two_n():
    with pytest.raises(ValueError, match="multiple of 2 \\* num_shards"):
        ring.zigzag_indices(10, 4)


# -- errors --------------------------------------------------------------------------------------
def _qkv(s=8, sk=None):
    return normal("ring", [(1, s, 2, 8), (1, sk or s, 2, 8), (1, sk or s, 2, 8)], jnp.float32)


@pytest.mark.parametrize("kwargs, qkv, words", [
    (dict(causal=True), _qkv(s=7), ["even", "7"]),
    (dict(causal=True), _qkv(s=8, sk=16), ["same local length", "8", "16"]),
    (dict(layout="striped"), _qkv(), ["layout", "'striped'"]),
    (dict(softcap=-1.0), _qkv(), ["softcap"]),
])
def test_bad_calls_raise_before_touching_the_ring(kwargs, qkv, words):
    with pytest.raises(ValueError) as info:
        ring.ring_attention(*qkv, axis_name="sp", **kwargs)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


# -- one device: the ring degenerates to flash_attention ----------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_one_device_ring_equals_flash_attention(causal):
    mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    q, k, v = _qkv(s=16)
    f = jax.jit(jax.shard_map(
        lambda q, k, v: jax_fa4.ring_attention(q, k, v, axis_name="sp", causal=causal),
        mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp")))
    assert jnp.allclose(f(q, k, v), jax_fa4.flash_attention(q, k, v, causal=causal), atol=1e-6)
    g = jax.jit(jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2)))(q, k, v)
    g0 = jax.grad(lambda q, k, v: jax_fa4.flash_attention(q, k, v, causal=causal).sum(),
                  argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g, g0):
        assert jnp.allclose(a, b, atol=1e-5)
