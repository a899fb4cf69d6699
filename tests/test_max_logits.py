"""Per-head max logits (``flash_attention(..., return_max_logits=True)``, QK-Clip) on the CPU.

The reference's per-row max (:func:`jax_fa4.reference.row_max_logits`) against a NumPy brute
force (windows, softcap, GQA, segment ids contiguous or not, padding ids no key has, odd and
mismatched lengths, several key blocks); the API's results (order, shapes, no gradient, same
out / lse / gradients as without); the Hopper route's configs and the max-logit output with the
forward kernels emulated (dense and segment ids); the sm100 route's configs (its emulated
numbers: tests/test_sm100_bwd_wiring.py). The Hopper kernels themselves:
tests/gpu/test_max_logits.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import backends, reference
from jax_fa4.backends import base
from jax_fa4.kernels.sm90 import fwd_config


def brute_force(q, k, scale, window, softcap, q_ids=None, kv_ids=None):
    """float64 (B, H, Sq) row max by loops over visible (i, j)."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    left, right = window
    out = np.full((b, h, sq), -np.inf)
    for i in range(sq):
        diag = i + sk - sq
        lo = 0 if left is None else max(0, diag - left)
        hi = sk - 1 if right is None else min(sk - 1, diag + right)
        for bb in range(b):
            js = np.arange(lo, hi + 1)
            if q_ids is not None:
                js = js[kv_ids[bb, js] == q_ids[bb, i]]
            if js.size == 0:
                continue
            for hh in range(h):
                s = k[bb, js, hh // (h // hkv)] @ q[bb, i, hh] * scale
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                out[bb, hh, i] = s.max()
    return out


def _qk(seed, b, sq, sk, h, hkv, d, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, sq, h, d)) * 2, dtype)
    k = jnp.asarray(rng.standard_normal((b, sk, hkv, d)), dtype)
    return q, k


@pytest.mark.parametrize("sq, sk, window, softcap, ids", [
    (37, 53, (None, None), 0.0, None),
    (53, 37, (None, 0), 0.0, None),
    (41, 41, (7, 3), 4.0, None),
    (60, 60, (None, 0), 0.0, "packed"),
    (45, 70, (None, None), 3.0, "random"),
    (50, 50, (None, None), 0.0, "padding"),
])
@pytest.mark.parametrize("block_k", [8, 512])
def test_reference_row_max_matches_brute_force(sq, sk, window, softcap, ids, block_k):
    q, k = _qk(sq * sk + block_k, 2, sq, sk, 4, 2, 16)
    rng = np.random.default_rng(sq + sk)
    q_ids = kv_ids = None
    if ids == "packed":
        q_ids = kv_ids = np.repeat(np.arange(4), [10, 25, 5, 20])[None].repeat(2, 0)
    elif ids == "random":
        q_ids, kv_ids = rng.integers(0, 3, (2, sq)), rng.integers(0, 3, (2, sk))
    elif ids == "padding":  # the last 12 tokens: queries -1, keys -2 (no key has -1)
        q_ids = np.repeat([0, 1, -1], [20, 18, 12])[None].repeat(2, 0)
        kv_ids = np.where(q_ids == -1, -2, q_ids)
    kw = {} if ids is None else dict(q_segment_ids=jnp.asarray(q_ids, jnp.int32),
                                     kv_segment_ids=jnp.asarray(kv_ids, jnp.int32))
    got = np.asarray(reference.row_max_logits(q, k, softmax_scale=0.3, window=window,
                                              softcap=softcap, block_k=block_k, **kw))
    want = brute_force(q, k, 0.3, window, softcap, q_ids, kv_ids)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5)
    if ids == "padding":
        assert np.isneginf(got[:, :, -12:]).all()


def test_results_order_shapes_and_no_gradient():
    q, k = _qk(1, 2, 33, 33, 4, 2, 16)
    v = k
    out = jax_fa4.flash_attention(q, k, v, causal=True)
    out2, ml = jax_fa4.flash_attention(q, k, v, causal=True, return_max_logits=True)
    out3, lse3, ml3 = jax_fa4.flash_attention(q, k, v, causal=True, return_lse=True,
                                              return_max_logits=True)
    _, lse = jax_fa4.flash_attention(q, k, v, causal=True, return_lse=True)
    assert ml.shape == (2, 4) and ml.dtype == jnp.float32
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(out, out3)
    np.testing.assert_array_equal(lse, lse3)
    np.testing.assert_array_equal(ml, ml3)
    want = brute_force(q, k, 16 ** -0.5, (None, 0), 0.0).max(axis=-1)
    np.testing.assert_allclose(ml, want, rtol=1e-5)
    # a statistic: its gradient is zero, and asking for it leaves the others unchanged
    g = jax.grad(lambda q: jax_fa4.flash_attention(q, k, v, return_max_logits=True)[1].sum())(q)
    assert not np.asarray(g).any()
    ga = jax.grad(lambda q: jax_fa4.flash_attention(q, k, v).sum())(q)
    gb = jax.grad(lambda q: jax_fa4.flash_attention(q, k, v, return_max_logits=True)[0].sum())(q)
    np.testing.assert_array_equal(ga, gb)


def test_jit_vmap_sink_and_segment_ids():
    q, k = _qk(2, 2, 40, 40, 4, 4, 16)
    ids = jnp.asarray(np.repeat([3, 1, 3], [10, 20, 10])[None].repeat(2, 0), jnp.int32)
    sink = jnp.linspace(-1.0, 5.0, 4)  # never counts: larger than some rows' max
    f = jax.jit(lambda q, k: jax_fa4.flash_attention(q, k, k, segment_ids=ids,
                                                     learnable_sink=sink,
                                                     return_max_logits=True)[1])
    want = brute_force(q, k, 0.25, (None, None), 0.0, np.asarray(ids), np.asarray(ids))
    np.testing.assert_allclose(f(q, k), want.max(axis=-1), rtol=1e-5)
    stacked = jax.vmap(lambda q, k: jax_fa4.flash_attention(q, k, k, return_max_logits=True)[1])(
        jnp.stack([q, -q]), jnp.stack([k, k]))
    assert stacked.shape == (2, 2, 4)
    np.testing.assert_allclose(stacked[1], brute_force(-q, k, 0.25, (None, None), 0.0).max(-1),
                               rtol=1e-5)


def test_sm100_configs_and_reasons():
    """The sm100 forward writes max logits for dense and segment-id calls (the dense tuning
    plus the output); decode-shaped calls name their reason when forced."""
    from jax_fa4.kernels.sm100 import fwd_config as sm100_fwd_config

    sm100 = backends.get("sm100")
    cfg = sm100.make_forward("bfloat16", 128, 128, "local", True, max_logits=True)
    assert cfg == dataclasses.replace(sm100.make_forward("bfloat16", 128, 128, "local", True),
                                      max_logits=True)
    assert cfg in sm100_fwd_config.shipped_configs()
    assert [a.name for a in cfg.signature().outputs] == ["out", "lse", "max_logits"]
    seg = sm100.make_segments("float16", 64, 64, "causal", True, max_logits=True)
    assert seg == dataclasses.replace(sm100.make_forward("float16", 64, 64, "causal", True),
                                      segments=True, max_logits=True)
    assert seg in sm100_fwd_config.shipped_configs()
    assert [a.name for a in seg.signature().outputs] == ["out", "lse", "max_logits"]
    q, k = _qk(7, 2, 1, 4096, 8, 2, 64, jnp.bfloat16)
    with pytest.raises(base.ImplementationUnavailableError, match="decode-shaped"):
        jax_fa4.flash_attention(q, k, k, return_max_logits=True, implementation="sm100")


def test_hopper_configs_and_shipping():
    sm90 = backends.get("sm90")
    cfg = sm90.make_forward("bfloat16", 128, 128, "causal", False, max_logits=True)
    # the dense tuning with the output
    assert cfg == dataclasses.replace(sm90.make_forward("bfloat16", 128, 128, "causal", False),
                                      max_logits=True)
    assert cfg.signature().outputs[-1].name == "max_logits"
    seg = sm90.make_segments("float16", 64, 64, "causal", True, max_logits=True)
    assert seg.segments and seg.max_logits and seg.tile_m == fwd_config.SEGMENTS_MAX_TILE_M
    # the table's 192-row tile where it fits (no softcap, no max logits)
    assert sm90.make_segments("bfloat16", 64, 64, "none", False).tile_m == 192
    shipped = fwd_config.shipped_configs()
    dense = [c for c in shipped  # (the FP8 forward has no max-logit configs)
             if not (c.segments or c.varlen or c.paged or c.qo_head_major or c.fp8)]
    assert sum(c.max_logits for c in dense) * 2 == len(dense)
    assert sum(c.max_logits for c in shipped if c.segments) * 2 == sum(
        c.segments for c in shipped)
    with pytest.raises(ValueError, match="max logits"):
        fwd_config.FwdConfig.make("bfloat16", 128, 128, "none", varlen=True, num_sms=0,
                                  max_logits=True)


def _emulated_dense_forward(calls):
    """call_kernel for the sm90 dense forward (softmax_scale 0.125): the reference's
    (out, lse) and, for a max-logit config, the reference's row max (the kernel's output
    contract)."""

    def call_kernel(config, arch, q, k, v, params, *, out_shapes):
        assert config.kernel_name == "sm90_fwd" and arch == "sm_90a"
        calls.append(config)
        assert len(out_shapes) == len(config.signature().outputs)
        window = {"none": (None, None), "causal": (None, 0)}[config.mask]
        # (params is traced here; the test's calls all use softmax_scale=0.125)
        out, lse = reference.attention(q, k, v, window=window, softmax_scale=0.125)
        outs = (out.astype(out_shapes[0].dtype), lse)
        if config.max_logits:
            outs += (reference.row_max_logits(q, k, window=window, softmax_scale=0.125),)
        return outs

    return call_kernel


def test_hopper_dense_route_with_an_emulated_kernel(monkeypatch):
    from jax_fa4.ffi import call

    calls = []
    monkeypatch.setattr(call, "call_kernel", _emulated_dense_forward(calls))
    q, k = _qk(5, 2, 300, 300, 4, 2, 64, jnp.bfloat16)
    out, ml = jax.jit(lambda q, k: jax_fa4.flash_attention(
        q, k, k, causal=True, softmax_scale=0.125, return_max_logits=True,
        implementation="sm90"))(q, k)
    assert calls and all(c.max_logits for c in calls)
    want = brute_force(q, k, 0.125, (None, 0), 0.0).max(axis=-1)
    np.testing.assert_allclose(ml, want, rtol=1e-5)
    calls.clear()
    jax.jit(lambda q, k: jax_fa4.flash_attention(q, k, k, causal=True, softmax_scale=0.125,
                                                 implementation="sm90"))(q, k)
    assert calls and not any(c.max_logits for c in calls)


def test_hopper_segments_route_with_an_emulated_kernel(monkeypatch):
    from test_segments import _emulated_segments_kernel

    from jax_fa4.ffi import call

    calls = []
    monkeypatch.setattr(call, "call_kernel", _emulated_segments_kernel((None, 0), 0.0, calls))
    q, k = _qk(6, 2, 300, 300, 4, 2, 64, jnp.bfloat16)
    ids = np.repeat([0, 1, 2, 1], [70, 90, 100, 40])[None].repeat(2, 0).astype(np.int32)
    ml = jax.jit(lambda q, k: jax_fa4.flash_attention(
        q, k, k, causal=True, segment_ids=jnp.asarray(ids), return_max_logits=True,
        implementation="sm90")[1])(q, k)
    assert calls and all(c.segments and c.max_logits for c in calls)
    want = brute_force(q, k, 64 ** -0.5, (None, 0), 0.0, ids, ids).max(axis=-1)
    np.testing.assert_allclose(ml, want, rtol=1e-4)


def test_decode_shaped_calls_name_the_reason_when_forced():
    """The decode-shaped kernels (few query rows per key) do not write max logits: a forced
    Hopper call says so; the default runs the reference for such calls."""
    q, k = _qk(7, 2, 1, 4096, 8, 2, 64, jnp.bfloat16)
    with pytest.raises(base.ImplementationUnavailableError, match="decode-shaped"):
        jax_fa4.flash_attention(q, k, k, return_max_logits=True, implementation="sm90")
