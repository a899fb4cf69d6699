"""Packed variable-length attention and segment ids, against per-sequence / per-segment runs
of ``jax_fa4.reference.attention`` (CPU)."""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import per_class
from conformance import normal
from extreme_cases import oracle, window_visible

import jax_fa4
from jax_fa4 import autodiff, backends, options, reference
from jax_fa4.api import flash_attention_varlen
from jax_fa4.backends import base, sm90

TOL = dict(atol=2e-5, rtol=2e-5)

# Per sequence (len_q, len_k): Sq < Sk, empty, length 1, Sq > Sk (rows without keys under
# causal), no keys at all. Repeated shapes keep the per-sequence compiles few.
LENS_Q = (3, 0, 1, 5, 3, 2)
LENS_K = (5, 4, 1, 3, 5, 0)
PAD_Q, PAD_K = 2, 3  # padding tokens after cu_seqlens[-1]


def _cu(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _packed(lens_q, lens_k, h, hkv, d, dv, seed, pad_q=PAD_Q, pad_k=PAD_K):
    rng = np.random.default_rng(seed)
    tq, tk = sum(lens_q) + pad_q, sum(lens_k) + pad_k

    def randn(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32))

    q, k, v = randn(tq, h, d), randn(tk, hkv, d), randn(tk, hkv, dv)
    sink = randn(h) * 2
    dout, dlse = randn(tq, h, dv), randn(h, tq)
    return q, k, v, sink, dout, dlse


def _oracle(q, k, v, sink, dout, dlse, *, window, softcap, softmax_scale):
    """(out, lse, (dq, dk, dv, dsink)) of one (B = 1) problem: the float64 oracle of
    tests/extreme_cases.py (NumPy: no XLA program per sequence length)."""
    scale = 1 / np.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    visible = window_visible(q.shape[1], k.shape[1], window)[None]
    return oracle(q, k, v, visible, scale, softcap, None if sink is None else np.asarray(sink),
                  dout=dout, dlse=dlse)


def per_sequence(q, k, v, lens_q, lens_k, sink=None, cotangents=None, **options):
    """(out, lse) and optionally (dq, dk, dv, dsink), by the oracle on each sequence alone;
    padding rows and key-less sequences filled in by hand."""
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    h, dv = q.shape[1], v.shape[2]
    q, k, v = (np.asarray(x) for x in (q, k, v))
    cotangents = None if cotangents is None else tuple(np.asarray(x) for x in cotangents)
    out = np.zeros((q.shape[0], h, dv), np.float32)
    lse = np.full((h, q.shape[0]), -np.inf, np.float32)
    grads = [np.zeros(x.shape, np.float32) for x in (q, k, v)] + [np.zeros(h, np.float32)]
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lq == 0:
            continue
        if lk == 0:  # no key: output 0; lse = sink (or -inf), d sink = sum of dlse
            if sink is not None:
                lse[:, qs] = np.asarray(sink)[:, None]
                if cotangents is not None:
                    grads[3] += np.asarray(cotangents[1][:, qs]).sum(axis=1)
            continue

        dout, dlse = ((np.zeros((lq, h, dv), np.float32), np.zeros((h, lq), np.float32))
                      if cotangents is None else (cotangents[0][qs], cotangents[1][:, qs]))
        o, l, (dq, dk, dv_, ds) = _oracle(q[qs][None], k[ks][None], v[ks][None], sink,
                                          dout[None], dlse[None], **options)
        out[qs], lse[:, qs] = o[0], l[0]
        grads[0][qs], grads[1][ks], grads[2][ks] = dq[0], dk[0], dv_[0]
        if sink is not None:
            grads[3] += np.asarray(ds)
    return out, lse, grads


def _assert_close(got, want, name):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert not np.isnan(got).any(), name
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=name)
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], err_msg=name, **TOL)


CASES = [  # (h, hkv, d, dv, kwargs, with_sink)
    (4, 2, 16, 8, dict(), False),
    (2, 1, 8, 8, dict(causal=True, softcap=2.0), True),
    (4, 4, 8, 16, dict(window_size=(3, 1), softmax_scale=0.5), True),
]


def _ref_options(kwargs):
    left, right = kwargs.get("window_size", (None, None))
    if kwargs.get("causal"):
        right = 0
    return dict(window=(left, right), softcap=kwargs.get("softcap", 0.0),
                softmax_scale=kwargs.get("softmax_scale"))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_per_sequence_reference(case):
    """Forward and gradients (q, k, v, sink; cotangents on out and lse) against each sequence
    run alone; lengths 0 and 1, Sq != Sk, padding, GQA / MQA, causal, window, softcap."""
    h, hkv, d, dv, kwargs, with_sink = case
    q, k, v, sink, dout, dlse = _packed(LENS_Q, LENS_K, h, hkv, d, dv, seed=0)
    sink = sink if with_sink else None
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)

    def f(q, k, v, s):
        return flash_attention_varlen(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K),
                                      learnable_sink=s, return_lse=True, **kwargs)

    (out, lse), vjp = jax.vjp(f, q, k, v, sink)
    want_out, want_lse, want_grads = per_sequence(q, k, v, LENS_Q, LENS_K, sink, (dout, dlse),
                                                  **_ref_options(kwargs))
    assert out.shape == (q.shape[0], h, dv) and out.dtype == q.dtype
    assert lse.shape == (h, q.shape[0]) and lse.dtype == jnp.float32
    _assert_close(out, want_out, "out")
    _assert_close(lse, want_lse, "lse")
    assert (np.asarray(out[-PAD_Q:]) == 0).all() and np.isneginf(lse[:, -PAD_Q:]).all()
    grads = vjp((dout, dlse))
    for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
        _assert_close(got, want, name)
    if with_sink:
        _assert_close(grads[3], want_grads[3], "dsink")


def test_blocked_path_matches_per_sequence(monkeypatch):
    """The memory-light (key-blocked) form, forced with 4-key blocks, forward and gradients."""
    monkeypatch.setattr(base, "reference_block_k", lambda sq, sk: 4)
    h, hkv, d, dv, kwargs, _ = CASES[1]
    # Other padding than elsewhere: new total shapes, so no cached naive trace is reused.
    q, k, v, sink, dout, dlse = _packed(LENS_Q, LENS_K, h, hkv, d, dv, seed=1, pad_q=1, pad_k=1)

    def f(q, k, v, s):
        return flash_attention_varlen(q, k, v, _cu(LENS_Q), _cu(LENS_K), 8, 8,
                                      learnable_sink=s, return_lse=True, **kwargs)

    (out, lse), vjp = jax.vjp(f, q, k, v, sink)
    want_out, want_lse, want_grads = per_sequence(q, k, v, LENS_Q, LENS_K, sink, (dout, dlse),
                                                  **_ref_options(kwargs))
    _assert_close(out, want_out, "out")
    _assert_close(lse, want_lse, "lse")
    for name, got, want in zip(("dq", "dk", "dv", "dsink"), vjp((dout, dlse)), want_grads):
        _assert_close(got, want, name)


def test_new_lengths_do_not_retrace():
    """cu_seqlens are run-time values: same shapes, other lengths -> no new trace / compile."""
    h, hkv, d, dv, kwargs, _ = CASES[1]
    q, k, v, sink, *_ = _packed(LENS_Q, LENS_K, h, hkv, d, dv, seed=2)
    lens_a, lens_b = (LENS_Q, LENS_K), (LENS_Q[::-1], LENS_K[::-1])  # same totals
    traces = []

    @jax.jit
    def step(q, k, v, cu_q, cu_k):
        traces.append(None)  # runs once per trace
        return flash_attention_varlen(q, k, v, cu_q, cu_k, 8, 8, learnable_sink=sink, **kwargs)

    for lens_q, lens_k in (lens_a, lens_b, lens_a):
        out = step(q, k, v, jnp.asarray(_cu(lens_q)), jnp.asarray(_cu(lens_k)))
        want, _, _ = per_sequence(q, k, v, lens_q, lens_k, sink, **_ref_options(kwargs))
        _assert_close(out, want, f"out {lens_q} {lens_k}")
    assert len(traces) == 1

    # Eager calls with host (numpy) cu_seqlens: the inner jit is reused too.
    flash_attention_varlen(q, k, v, _cu(lens_a[0]), _cu(lens_a[1]), 8, 8, **kwargs)
    size = autodiff._varlen._cache_size()
    flash_attention_varlen(q, k, v, _cu(lens_b[0]), _cu(lens_b[1]), 8, 8, **kwargs)
    assert autodiff._varlen._cache_size() == size


def test_vmap_over_a_leading_axis():
    lens_q, lens_k = (3, 4), (4, 2)
    q, k, v, *_ = _packed(lens_q, lens_k, 2, 2, 8, 8, seed=3, pad_q=0, pad_k=0)
    qs, ks, vs = (jnp.stack([x, -x]) for x in (q, k, v))
    def f(q, k, v):
        return flash_attention_varlen(q, k, v, _cu(lens_q), _cu(lens_k), 4, 4, causal=True)

    out = jax.vmap(f)(qs, ks, vs)
    for i in range(2):
        np.testing.assert_allclose(out[i], f(qs[i], ks[i], vs[i]), **TOL)


def _bad(q, k, v, cu_q, cu_k, max_q=8, max_k=8, **kwargs):
    return flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


@pytest.mark.parametrize("mutate, exc, words", [
    (lambda a: {**a, "q": a["q"][None]}, ValueError, ["q", "rank 3", "(total_q, H, D)"]),
    (lambda a: {**a, "k": a["k"][..., :4]}, ValueError, ["k head_dim", "8"]),
    (lambda a: {**a, "v": a["v"][:3]}, ValueError, ["v", "(total_k, Hkv)"]),
    (lambda a: {**a, "q": a["q"][:, :3]}, ValueError, ["H=3", "Hkv=2"]),
    (lambda a: {**a, "k": a["k"].astype(jnp.bfloat16)}, TypeError, ["k", "float32"]),
    (lambda a: {**a, "cu_q": a["cu_q"].astype(np.int64)}, TypeError,
     ["cu_seqlens_q", "int32", "int64"]),
    (lambda a: {**a, "cu_k": a["cu_k"][:2]}, ValueError, ["cu_seqlens_q and cu_seqlens_k"]),
    (lambda a: {**a, "cu_q": a["cu_q"][:1]}, ValueError, ["cu_seqlens_q", "(batch + 1,)"]),
    (lambda a: {**a, "cu_q": a["cu_q"].tolist()}, TypeError, ["cu_seqlens_q", "list"]),
    (lambda a: {**a, "cu_q": np.array([0, 5, 3], np.int32)}, ValueError,
     ["cu_seqlens_q", "non-decreasing"]),
    (lambda a: {**a, "cu_k": np.array([0, 4, 99], np.int32)}, ValueError,
     ["cu_seqlens_k[-1] = 99", "exceeds"]),
    (lambda a: {**a, "max_q": 2}, ValueError, ["cu_seqlens_q", "length 4", "max_seqlen_q = 2"]),
    (lambda a: {**a, "max_k": jnp.int32(8)}, TypeError, ["max_seqlen_k", "static Python int"]),
    (lambda a: {**a, "max_k": -1}, ValueError, ["max_seqlen_k", ">= 0"]),
    (lambda a: {**a, "learnable_sink": jnp.zeros(3)}, ValueError, ["learnable_sink", "(4,)"]),
    (lambda a: {**a, "window_size": (-1, 0)}, ValueError, ["window_size left"]),
    (lambda a: {**a, "softcap": -1.0}, ValueError, ["softcap"]),
    (lambda a: {**a, "implementation": "sm90"}, jax_fa4.ImplementationUnavailableError,
     ["sm90", "varlen"]),
])
def test_bad_inputs_raise_clear_errors(mutate, exc, words):
    q, k, v, *_ = _packed((4, 2), (3, 4), 4, 2, 8, 8, seed=4, pad_q=0, pad_k=0)
    args = dict(q=q, k=k, v=v, cu_q=_cu((4, 2)), cu_k=_cu((3, 4)))
    with pytest.raises(exc) as info:
        _bad(**mutate(args))
    for w in words:
        assert w in str(info.value), (w, str(info.value))


# -- segment ids (flash_attention's segment_ids option) ------------------------------------------
def _segment_inputs(b, sq, sk, h, hkv, d, seed):
    rng = np.random.default_rng(seed)

    def randn(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32))

    return randn(b, sq, h, d), randn(b, sk, hkv, d), randn(b, sk, hkv, d), randn(b, sq, h, d), \
        randn(b, h, sq)


def _core(q, k, v, segment_ids, **kwargs):
    opts = options.canonicalize(q, k, v, softmax_scale=None, causal=kwargs.get("causal", False),
                            window_size=kwargs.get("window_size", (None, None)),
                            softcap=kwargs.get("softcap", 0.0), implementation=None)
    return autodiff.attention_with_extras(q, k, v, opts,
                                          segment_ids=options.check_segment_ids(segment_ids, q, k))


def test_packed_segments_match_per_segment_reference():
    """Self-attention over contiguous segments (packed documents): each segment alone, forward
    and gradients, through the naive and blocked reference and the differentiable core."""
    bounds = [(0, 5, 10, 11, 16), (0, 1, 6, 11, 16)]  # segment edges per row: lengths 1 and 5
    b, s, h, hkv, d = 2, 16, 4, 2, 8
    kwargs = dict(causal=True, window_size=(3, None), softcap=3.0)
    ids = np.zeros((b, s), np.int32)
    for row, edges in enumerate(bounds):
        for n, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
            ids[row, lo:hi] = 10 * n + 3  # any int ids
    q, k, v, dout, dlse = _segment_inputs(b, s, s, h, hkv, d, seed=5)
    opts = _ref_options(kwargs)
    q_, k_, v_, dout_, dlse_ = (np.asarray(x) for x in (q, k, v, dout, dlse))

    want_out = np.zeros(q.shape, np.float32)
    want_lse = np.zeros((b, h, s), np.float32)
    want = [np.zeros(x.shape, np.float32) for x in (q, k, v)]
    for row, edges in enumerate(bounds):
        for lo, hi in zip(edges[:-1], edges[1:]):
            sl = (slice(row, row + 1), slice(lo, hi))
            o, l, grads = _oracle(q_[sl], k_[sl], v_[sl], None, dout_[sl],
                                  dlse_[row:row + 1, :, lo:hi], **opts)
            want_out[sl], want_lse[row, :, lo:hi] = o, l[0]
            for w, g in zip(want, grads):
                w[sl] = g

    seg = dict(q_segment_ids=jnp.asarray(ids), kv_segment_ids=jnp.asarray(ids))
    for name, (out, lse) in (
        ("naive", reference.attention(q, k, v, **opts, **seg)),
        ("blocked", reference.attention_blocked(q, k, v, block_k=8, **opts, **seg)),
    ):
        _assert_close(out, want_out, f"{name} out")
        _assert_close(lse, want_lse, f"{name} lse")
    (out, lse), vjp = jax.vjp(lambda q, k, v: _core(q, k, v, jnp.asarray(ids), **kwargs),
                              q, k, v)
    _assert_close(out, want_out, "core out")
    for name, got, w in zip(("dq", "dk", "dv"), vjp((dout, dlse)), want):
        _assert_close(got, w, f"core {name}")
    delta = jnp.einsum("bqhd,bqhd->bhq", out, dout, precision="highest") - dlse
    grads = reference.attention_backward(q, k, v, out, lse, dout, delta=delta, block_k=8,
                                         **opts, **seg)
    for name, got, w in zip(("dq", "dk", "dv"), grads, want):
        _assert_close(got, w, f"blocked backward {name}")


def test_arbitrary_segments_match_per_row_oracle():
    """Interleaved ids and Sq != Sk: a float64 per-row loop, window on whole-sequence positions."""
    b, sq, sk, h, hkv, d = 2, 7, 10, 2, 1, 8
    rng = np.random.default_rng(6)
    q_ids = rng.integers(0, 3, (b, sq)).astype(np.int32)
    kv_ids = rng.integers(0, 3, (b, sk)).astype(np.int32)
    q_ids[0, 0] = 7  # an id no key has: 0 output, lse -inf
    q, k, v, _, _ = _segment_inputs(b, sq, sk, h, hkv, d, seed=7)
    window = (4, 2)
    out, lse = _core(q, k, v, (q_ids, kv_ids), window_size=window)

    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    for bb in range(b):
        for i in range(sq):
            diag = i + sk - sq
            keys = [j for j in range(sk) if kv_ids[bb, j] == q_ids[bb, i]
                    and diag - window[0] <= j <= diag + window[1]]
            for hh in range(h):
                if not keys:
                    assert np.isneginf(lse[bb, hh, i]) and (np.asarray(out[bb, i, hh]) == 0).all()
                    continue
                s = q64[bb, i, hh] @ k64[bb, keys, 0].T / np.sqrt(d)
                m = s.max()
                p = np.exp(s - m)
                np.testing.assert_allclose(out[bb, i, hh], p @ v64[bb, keys, 0] / p.sum(), **TOL)
                np.testing.assert_allclose(lse[bb, hh, i], m + np.log(p.sum()), **TOL)


def test_segment_ids_checks():
    q, k, v, _, _ = _segment_inputs(1, 4, 6, 2, 2, 8, seed=8)
    ok = (np.zeros((1, 4), np.int32), np.zeros((1, 6), np.int32))
    assert [x.dtype for x in options.check_segment_ids(ok, q, k)] == [jnp.int32] * 2
    with pytest.raises(ValueError, match="single segment_ids array needs Sq == Sk"):
        options.check_segment_ids(ok[0], q, k)
    with pytest.raises(ValueError, match=r"kv_segment_ids must have shape \(B, Sk\) = \(1, 6\)"):
        options.check_segment_ids((ok[0], ok[0]), q, k)
    with pytest.raises(TypeError, match="q_segment_ids must have an integer dtype"):
        options.check_segment_ids((ok[0].astype(np.float32), ok[1]), q, k)
    with pytest.raises(ValueError, match="a pair"):
        options.check_segment_ids((ok[0],), q, k)
    with pytest.raises(ValueError, match="given together"):
        reference.visible_mask(4, 6, (None, None), q_segment_ids=jnp.asarray(ok[0]))


@pytest.mark.skipif("segment_ids" not in inspect.signature(jax_fa4.flash_attention).parameters,
                    reason="flash_attention has no segment_ids yet")
def test_flash_attention_segment_ids():
    q, k, v, dout, _ = _segment_inputs(2, 8, 8, 2, 2, 8, seed=9)
    ids = jnp.asarray(np.repeat(np.array([[0, 1], [2, 2]], np.int32), 4, axis=1))
    f = jax.jit(lambda q, k, v: jax_fa4.flash_attention(q, k, v, causal=True, segment_ids=ids))
    out, vjp = jax.vjp(f, q, k, v)
    want, want_vjp = jax.vjp(lambda q, k, v: _core(q, k, v, ids, causal=True)[0], q, k, v)
    np.testing.assert_allclose(out, want, **TOL)
    for got, w in zip(vjp(dout), want_vjp(dout)):
        np.testing.assert_allclose(got, w, **TOL)


# --- the kernel route, with the varlen forward kernel's contract emulated on the CPU ------------
def _emulated_varlen_kernel(options, implementation="sm90", calls=None):
    """A stand-in for the ``implementation``'s varlen forward kernel
    (spec.varlen_attention_forward_signature): the reference on the packed batch, out 0 at the
    tokens outside every sequence, lse scattered into (batch, H, max_seqlen_q) (NaN where the
    kernel writes nothing); the learnable sinks params carries past its 4 scalars join the
    softmax. Each call's config is appended to ``calls``."""
    def kernel(config, arch, q, k, v, params, cu_q, cu_k, *, out_shapes):
        assert config.varlen and q.shape[0] == 1
        assert (config.kernel_name, arch) == (f"{implementation}_fwd",
                                              backends.get(implementation).arch)
        assert params.shape in ((4,), (4 + q.shape[2],)), params.shape
        if calls is not None:
            calls.append(config)
        seg = base.varlen_segments(cu_q, cu_k, q.shape[1], k.shape[1])
        sink = params[4:] if params.shape[0] > 4 else None
        out, lse = reference.attention(q, k, v, **options, **seg._asdict(),
                                       learnable_sink=sink)
        t, seq, valid, start, _ = base.token_layout(cu_q, q.shape[1])
        out = jnp.where(valid[None, :, None, None], out, 0).astype(out_shapes[0].dtype)
        lse_pad = jnp.full(out_shapes[1].shape, jnp.nan, jnp.float32)
        rows = jnp.where(valid, t - start, out_shapes[1].shape[2])  # invalid: dropped
        lse_pad = lse_pad.at[seq, :, rows].set(lse[0].T, mode="drop")
        return out, lse_pad
    return kernel


def _emulated_varlen_backward(options, called):
    """Stand-ins for the sm90 varlen backward main kernel
    (bwd_config.varlen_attention_backward_signature) and its postprocess: the reference's packed
    backward, written where the kernels write. dq_accum gets each token's unscaled dQ at its
    sequence's tile row; dk / dv only the rows of the key blocks the work list names and, with
    its ZERO_PADDING item, zeros outside every sequence (NaN elsewhere, as unwritten memory),
    per query head under GQA (the whole group's sum in the
    group's first head, zeros in the others); the postprocess scales dq_accum back into rows."""
    from jax_fa4.kernels.sm90.bwd_config import BwdConfig, BwdPostprocessConfig

    def postprocess(config, dq_accum, params, cu_q, tile_seq, out_shape):
        """Tile t's rows go to sequence tile_seq[t]'s rows of its query block; padding rows 0;
        rows no tile names stay NaN."""
        assert config.varlen
        _, h, n = dq_accum.shape
        tm, d = config.tile_m, config.head_dim
        acc = dq_accum.reshape(h, n // (tm * d), tm, d) * params[0]
        total = out_shape.shape[1]
        t, seq, valid, start, _ = base.token_layout(cu_q, total)
        owner = tile_seq[None, :] == seq[:, None]  # (token, tile): the tile's sequence
        first = jnp.argmax(owner, axis=1)  # the sequence's first tile
        named = valid & owner.any(axis=1)
        local = t - start
        tile = jnp.clip(first + local // tm, 0, tile_seq.shape[0] - 1)
        named &= tile_seq[tile] == seq
        rows = acc[:, tile, local % tm].transpose(1, 0, 2)  # (token, H, D)
        dq = jnp.where(named[:, None, None], rows, jnp.where(valid[:, None, None], jnp.nan, 0))
        return dq[None].astype(out_shape.dtype)

    def main(config, q, k, v, dout, lse_log2, delta, params, dq_accum, cu_q, cu_k, work,
             out_shapes):
        tq, tk, h, hkv = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
        seg = base.varlen_segments(cu_q, cu_k, tq, tk)
        lse = jnp.where(jnp.isinf(lse_log2), -jnp.inf, lse_log2 / np.log2(np.e))
        dq, dk, dv = reference.attention_backward(
            q, k, v, jnp.zeros(dout.shape, dout.dtype), lse, dout, delta=delta, **options,
            **seg._asdict())
        t, seq, valid, start, _ = base.token_layout(cu_q, tq)
        row = (start + seq * config.tile_m) // config.tile_m * config.tile_m + t - start
        acc = dq_accum.reshape(h, -1, config.head_dim)
        acc = acc.at[:, jnp.where(valid, row, acc.shape[1])].add(
            (dq[0] / params[0]).transpose(1, 0, 2), mode="drop")
        # key rows of the listed work items
        nb = max(tk // config.tile_n + 1, 1)
        listed = jnp.zeros((cu_k.shape[0] - 1, nb), bool).at[
            jnp.where(work[:, 0] >= 0, work[:, 0], cu_k.shape[0]), work[:, 1]].set(
                True, mode="drop")
        tk_, seq_k, valid_k, start_k, _ = base.token_layout(cu_k, tk)
        written = valid_k & listed[seq_k, (tk_ - start_k) // config.tile_n]
        zeroed = ~valid_k & (work[:, 0] == sm90.ZERO_PADDING).any()  # the padding item
        outs = []
        for g in (dk, dv):
            g = g[0]
            if config.gqa:
                g = jnp.zeros((tk, hkv, h // hkv, g.shape[-1]), jnp.float32).at[:, :, 0].set(g)
                g = g.reshape(tk, h, -1)
            g = jnp.where(written[:, None, None], g, jnp.where(zeroed[:, None, None], 0, jnp.nan))
            outs.append(g[None].astype(out_shapes[len(outs) + 1].dtype))
        if config.sink_grad:
            # the sink's share of the float32 output's rowsum, all in work row 0's entry
            out32, _ = reference.attention(
                q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                **options, **seg._asdict(), learnable_sink=params[4:])
            rows = (out32 * dout.astype(jnp.float32)).sum(-1)[0].T  # (H, total_q)
            p_sink = jnp.where(jnp.isneginf(lse[0]), 0.0,
                               jnp.exp(params[4:, None] - jnp.where(jnp.isneginf(lse[0]), 0.0,
                                                                    lse[0])))
            part = jnp.zeros(out_shapes[3].shape, jnp.float32).at[0, :, 0].set(
                (p_sink * rows).sum(-1))
            outs.append(part)
        return acc.reshape(dq_accum.shape), *outs

    def kernel(config, arch, *args, out_shapes):
        called.append(config)
        if isinstance(config, BwdPostprocessConfig):
            return (postprocess(config, *args, out_shapes[0]),)
        assert isinstance(config, BwdConfig) and config.varlen and arch == "sm_90a"
        return main(config, *args, out_shapes)
    return kernel


KERNEL_CASES = [  # (h, hkv, d, dv, kwargs, with_sink): head dims the kernels ship
    (4, 2, 64, 64, dict(), False),
    (2, 1, 128, 128, dict(causal=True, softcap=2.0), True),
    (4, 4, 192, 128, dict(window_size=(3, 1), softmax_scale=0.5), True),
]


@pytest.mark.parametrize("case, implementation", per_class(  # quick tier: one case per backend
    [(c, impl) for i in (2, 1, 0) for impl in ("sm90", "sm100") for c in KERNEL_CASES[i:i + 1]],
    key=lambda case: case[1]), ids=str)
def test_kernel_route_with_an_emulated_kernel(case, implementation, monkeypatch):
    """implementation="sm90" / "sm100" runs that architecture's varlen kernel route (lse
    gathered from the padded layout, padding rows zeroed, the sink joined; the backward by the
    varlen backward chain: dq rows gathered from their tiles, GQA groups summed, padding tokens
    zeroed; sm100 at head dim 192/128 by the 2-CTA kernel's varlen mode, on a work list of
    256-key pair spans): the reference's forward and gradients (each sequence's, by
    :func:`per_sequence`)."""
    import math

    from sm100_emulation import emulated_call_kernel

    from jax_fa4.ffi import call

    h, hkv, d, dv, kwargs, with_sink = case
    calls = []
    forward = _emulated_varlen_kernel(_ref_options(kwargs), implementation, calls)
    called = []
    backward = _emulated_varlen_backward(_ref_options(kwargs), called)
    if implementation == "sm100":  # the preprocess and the sm100 varlen backward (contract)
        opts100 = dict(_ref_options(kwargs))
        opts100["softmax_scale"] = opts100["softmax_scale"] or 1 / math.sqrt(d)
        emulated = emulated_call_kernel(opts100, [])
        backward = lambda config, *a, **kw: (called.append(config)  # noqa: E731
                                             or emulated(config, *a, **kw))
    monkeypatch.setattr(call, "call_kernel", lambda config, *a, **kw: (
        forward if config.kernel_name.endswith("_fwd") else backward)(config, *a, **kw))
    monkeypatch.setattr(backends.get("sm90"), "backward_preprocess",
                        base.REFERENCE_BACKEND.backward_preprocess)
    q, k, v, sink, dout, dlse = _packed(LENS_Q, LENS_K, h, hkv, d, dv, seed=4)
    q, k, v, dout = (x.astype(jnp.bfloat16) for x in (q, k, v, dout))
    sink = sink if with_sink else None
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)

    def f(q, k, v, s):
        return flash_attention_varlen(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K),
                                      learnable_sink=s, return_lse=True,
                                      implementation=implementation, **kwargs)

    (out, lse), vjp = jax.vjp(f, q, k, v, sink)
    grads = vjp((dout, dlse))
    want_config = backends.get(implementation).varlen_config(
        q, v, options.options(q.shape[-1], softmax_scale=kwargs.get("softmax_scale"),
                              causal=kwargs.get("causal", False),
                              window_size=kwargs.get("window_size", (None, None)),
                              softcap=kwargs.get("softcap", 0.0), implementation=implementation),
        max(LENS_Q))
    assert calls and all(c == want_config for c in calls), calls  # (traced per custom_vjp rule)
    if implementation == "sm90":
        assert [c.kernel_name for c in called] == ["sm90_bwd", "sm90_bwd_postprocess"]
        assert called[0].gqa == (h != hkv)
    else:
        assert [c.kernel_name for c in called] == ["bwd_preprocess", "sm100_bwd"]
        assert called[1].varlen and called[1].gqa == (h != hkv)
        assert called[1].two_cta == (d == 192)  # 192/128: the 2-CTA kernel's varlen mode
    # the reference's numbers (the float64 oracle's on each sequence, as the reference route
    # gives them: test_matches_per_sequence_reference): the emulated kernel computes what the
    # reference does, so everything around it must give the same numbers
    want_out, want_lse, want_grads = per_sequence(q, k, v, LENS_Q, LENS_K, sink, (dout, dlse),
                                                  **_ref_options(kwargs))
    want_grads = want_grads[:3] + [want_grads[3] if with_sink else None]
    assert not np.isnan(np.asarray(out, np.float32)).any()
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv", "dsink"),
                               (out, lse, *grads), (want_out, want_lse, *want_grads)):
        if want is None:
            assert got is None, name
            continue
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=name)
        fin = np.isfinite(np.asarray(want, np.float32))
        # a sink is joined around the kernel in float32 on its bfloat16 out (one rounding more
        # than the reference's), which the gradients' dP - delta cancellation amplifies
        got, want = np.asarray(got, np.float32)[fin], np.asarray(want, np.float32)[fin]
        bound = (0.04 if with_sink else 0.01) * max(1.0, float(np.abs(want).max()))
        assert float(np.abs(got - want).max()) <= bound, (name, np.abs(got - want).max())


def test_kernel_config_per_architecture():
    """Hopper: its varlen config (not persistent); Blackwell: the sm100 table's config with
    varlen=True (persistent, never paged); the reference: none; unsupported kinds: the reason,
    naming the architecture's kernel, and a forced implementation raises it."""
    q = jnp.zeros((10, 4, 128), jnp.bfloat16)
    opts = options.options(q.shape[-1], softmax_scale=None, causal=True, window_size=(None, None),
                           softcap=1.5, implementation=None)
    impl = lambda name: dataclasses.replace(opts, implementation=name)  # noqa: E731
    sm90 = backends.get("sm90").varlen_config(q, q, impl("sm90"), 8)
    sm100 = backends.get("sm100").varlen_config(q, q, impl("sm100"), 8)
    assert (sm90.kernel_name, sm90.varlen, sm90.num_sms) == ("sm90_fwd", True, 0)
    assert (sm100.kernel_name, sm100.varlen, sm100.paged) == ("sm100_fwd", True, False)
    assert (sm100.mask, sm100.has_softcap, sm100.head_dim, sm100.dtype) == (
        "causal", True, 128, "bfloat16")
    from jax_fa4.kernels.sm100.fwd_config import shipped_configs

    assert sm100 in shipped_configs() and sm100.num_sms > 0
    assert "max_seqlen_q is 0" in backends.get("sm100").varlen_config(q, q, impl("sm100"), 0)
    q192 = jnp.zeros((10, 4, 192), jnp.bfloat16)  # 192/192: a row of both tables
    assert backends.get("sm90").varlen_config(q192, q192, impl("sm90"), 8).varlen
    assert backends.get("sm100").varlen_config(q192, q192, impl("sm100"), 8).varlen
    q160 = jnp.zeros((10, 4, 160), jnp.bfloat16)  # a head dim no table has
    why = backends.get("sm100").varlen_config(q160, q160, impl("sm100"), 8)
    assert isinstance(why, str) and "sm100 forward" in why and "160/160" in why
    cu = np.array([0, 4, 10], np.int32)
    with pytest.raises(jax_fa4.ImplementationUnavailableError, match="160/160"):
        flash_attention_varlen(q160, q160, q160, cu, cu, 6, 6, implementation="sm100")


# --- the varlen backward kernel's work list and dq_accum layout (brute force) ------------------
def _random_lengths(rng, batch, max_len):
    lens = rng.integers(0, max_len + 1, batch)
    lens[rng.integers(0, batch)] = 0  # always an empty sequence
    return lens


#: (launch order, window): the quick tier runs heavy_first, whose order the window's costs set,
#: with each mask kind, and the sequence order (the same list for every window) with one;
#: --exhaustive every pair
WORK_TABLE_CASES = per_class(
    [(order, window) for order in ("heavy_first", "sequence")
     for window in ((None, None), (None, 0), (70, 3))],
    key=lambda case: case if case[0] == "heavy_first" else case[0])


@pytest.mark.parametrize("order, window", WORK_TABLE_CASES, ids=str)
def test_work_table_lists_every_key_block_once(order, window):
    """Every key block of every sequence is one row of the work list, with its sequence's
    offsets, lengths and first dq tile (spare rows (-1, 0, …) after them, the ZERO_PADDING item
    last), within the bound work_items gives; heavy_first puts the blocks with the most query
    blocks to visit first."""
    from jax_fa4.kernels.common.geometry import BwdBlocks
    from jax_fa4.kernels.sm90.bwd_config import WORK_COLUMNS

    rng = np.random.default_rng(7)
    tm, tn = 64, 128
    # jitted: one compile per trial (op by op, every op of the table compiles for each shape)
    table_of = jax.jit(sm90.work_table, static_argnums=(2, 3, 4, 5, 6))
    visited = jax.jit(sm90.visited_query_blocks, static_argnums=(3, 4, 5))
    for _trial in range(6):
        batch = int(rng.integers(1, 7))
        lens_q, lens_k = _random_lengths(rng, batch, 400), _random_lengths(rng, batch, 600)
        total_k = int(lens_k.sum()) + int(rng.integers(0, 50))
        n = sm90.work_items(total_k, batch, tn)
        table = np.asarray(table_of(jnp.asarray(_cu(lens_q)), jnp.asarray(_cu(lens_k)), n, tm,
                                    tn, window, order))
        assert table.shape == (n, WORK_COLUMNS) and table.dtype == np.int32
        cu_q, cu_k = _cu(lens_q), _cu(lens_k)
        want = [(b, j, cu_q[b], cu_k[b], lens_q[b], lens_k[b], (cu_q[b] + b * tm) // tm, 0)
                for b in range(batch) for j in range(-(-int(lens_k[b]) // tn))]
        rows = table[table[:, 0] >= 0]
        assert sorted(map(tuple, rows.tolist())) == sorted(tuple(map(int, w)) for w in want)
        # spare rows, then the padding item
        assert (table[len(rows):-1] == [-1, 0, 0, 0, 0, 0, 0, 0]).all()
        assert table[-1].tolist() == [sm90.ZERO_PADDING] + [0] * 7
        used = rows[:, :2]
        left, right = window

        def cost(b, j):
            lq, lk = int(lens_q[b]), int(lens_k[b])
            wl = lk if left is None else min(left, lk)
            wr = lq if right is None else min(right, lq)
            lo, hi = BwdBlocks(tm, tn, window == (None, 0), left is not None, lq, lk, wl,
                               wr).m_block_range(j)
            return max(hi - lo, 0)

        costs = [cost(b, j) for b, j in used.tolist()]
        if order == "heavy_first":
            assert costs == sorted(costs, reverse=True), costs
        else:  # sequence by sequence, each from its last key block down
            assert used.tolist() == sorted(used.tolist(), key=lambda r: (r[0], -r[1]))
        got = visited(jnp.asarray(lens_q[used[:, 0]]), jnp.asarray(lens_k[used[:, 0]]),
                      jnp.asarray(used[:, 1]), tm, tn, window)
        assert np.asarray(got).tolist() == costs


@pytest.mark.parametrize("tile_m", per_class([64, 128], key=lambda tile_m: 0))  # quick: 64
def test_dq_accum_tiles_of_sequences_are_disjoint(tile_m):
    """Sequence b's query blocks start at tile (cu_q[b] + b·tile_m) // tile_m: no two sequences
    share a tile, all fit in dq_accum_rows, and tile_owners names each tile's sequence."""
    rng = np.random.default_rng(8)
    # one compile per batch size: every trial asks for the same number of tiles (more than any
    # trial's dq_accum holds; the tiles past it belong to no sequence)
    num_tiles = 40
    owners = jax.jit(sm90.tile_owners, static_argnums=(1, 2))
    for _trial in range(200):
        batch = int(rng.integers(1, 9))
        lens = _random_lengths(rng, batch, 3 * tile_m)
        cu = _cu(lens)
        total = int(cu[-1]) + int(rng.integers(0, tile_m))
        owner = {}
        for b in range(batch):
            first = (cu[b] + b * tile_m) // tile_m
            for tile in range(first, first + -(-int(lens[b]) // tile_m)):
                assert tile not in owner, (lens, b, owner.get(tile))
                owner[tile] = b
        rows = sm90.dq_accum_rows(total, batch, tile_m)
        assert rows % tile_m == 0 and all((t + 1) * tile_m <= rows for t in owner)
        assert rows // tile_m <= num_tiles
        got = np.asarray(owners(jnp.asarray(cu), num_tiles, tile_m))
        assert got.tolist() == [owner.get(t, -1) for t in range(num_tiles)], (lens, got)


# -- bad cu_seqlens values: refused wherever they are known at the call ----------------------------
@pytest.mark.parametrize("which, cu, words", [
    ("cu_q", [0, 5, 3], ["cu_seqlens_q[2]=3 < cu_seqlens_q[1]=5", "non-decreasing"]),
    ("cu_k", [0, 4, 99], ["cu_seqlens_k[-1] = 99", "exceeds the number of packed tokens 7"]),
    ("cu_k", [0, -1, 7], ["cu_seqlens_k[1]=-1 < cu_seqlens_k[0]=0", "non-decreasing"]),
    ("cu_q", [-3, 0, 6], ["cu_seqlens_q[0]=-3 is negative", ">= 0"]),
    ("cu_q", [0, 4, 6], ["cu_seqlens_q has a sequence of length 4 > max_seqlen_q = 3",
                         "cu_seqlens_q[1]=4"]),
])
@pytest.mark.parametrize("as_device_array", [False, True])
def test_bad_cu_seqlens_name_the_index(which, cu, words, as_device_array):
    """numpy and concrete jax.Array metadata alike (an eager call knows the values): the error
    names the argument, the index and the rule broken. (A first entry above 0 is allowed: the
    tokens before it are padding.)"""
    q, k, v, *_ = _packed((4, 2), (3, 4), 4, 2, 8, 8, seed=4, pad_q=0, pad_k=0)
    args = dict(q=q, k=k, v=v, cu_q=_cu((4, 2)), cu_k=_cu((3, 4)),
                max_q=3 if cu == [0, 4, 6] else 8)
    args[which] = (jnp.asarray if as_device_array else np.asarray)(np.array(cu, np.int32))
    with pytest.raises(ValueError) as info:
        _bad(**args)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


@pytest.mark.parametrize("which, cu, words", [
    ("cu_q", [0, 5, 3], ["cu_seqlens_q[2]=3 < cu_seqlens_q[1]=5", "non-decreasing"]),
    ("cu_k", [0, 4, 99], ["cu_seqlens_k[-1] = 99", "exceeds the number of packed tokens 7"]),
    ("cu_q", [-3, 0, 6], ["cu_seqlens_q[0]=-3 is negative"]),
    ("cu_q", [0, 4, 6], ["cu_seqlens_q has a sequence of length 4 > max_seqlen_q = 3"]),
])
def test_validate_checks_traced_cu_seqlens(which, cu, words):
    """validate=True: under jit the same rule and message, raised when the program runs; good
    values pass and give the unvalidated call's output."""
    q, k, v, *_ = _packed((4, 2), (3, 4), 4, 2, 8, 8, seed=4, pad_q=0, pad_k=0)
    max_q = 3 if cu == [0, 4, 6] else 8

    def call(cu_q, cu_k, validate=True):
        return flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, 8, implementation="reference",
                                      validate=validate)

    run = jax.jit(call)
    good = dict(cu_q=jnp.asarray(_cu((4, 2))), cu_k=jnp.asarray(_cu((3, 4))))
    if max_q == 8:
        np.testing.assert_array_equal(
            np.asarray(run(**good)),
            np.asarray(jax.jit(functools.partial(call, validate=False))(**good)))
    bad = dict(good, **{which: jnp.asarray(np.array(cu, np.int32))})
    with pytest.raises(Exception) as info:
        jax.block_until_ready(run(**bad))
    for w in words:
        assert w in str(info.value), (w, str(info.value)[-500:])
    with pytest.raises(TypeError, match="validate must be a bool"):
        flash_attention_varlen(q, k, v, good["cu_q"], good["cu_k"], 8, 8, validate="yes")


def test_traced_cu_seqlens_are_not_checked():
    """Under jit the values are unknown: no error (the kernels clamp; the result is unspecified),
    while the same values given eagerly are refused."""
    q, k, v, *_ = _packed((4, 2), (3, 4), 4, 2, 8, 8, seed=4, pad_q=0, pad_k=0)
    bad_q = jnp.asarray([0, 5, 3], jnp.int32)
    jitted = jax.jit(lambda cu_q: _bad(q, k, v, cu_q, jnp.asarray(_cu((3, 4)))))
    assert jitted(bad_q).shape == q.shape
    with pytest.raises(ValueError, match="non-decreasing"):
        _bad(q, k, v, bad_q, jnp.asarray(_cu((3, 4))))


@pytest.mark.parametrize("cu, total, max_len, want", [
    ([0, 3, 3, 10], 12, 8, [0, 3, 3, 10]),  # valid: unchanged
    ([2, 5, 9], 12, 8, [2, 5, 9]),  # leading padding is legal
    ([0, 5, 3, 10], 12, 8, [0, 5, 5, 10]),  # decreasing: that sequence becomes empty
    ([-4, 5, 30], 12, 8, [0, 5, 12]),  # outside [0, total]: clipped
    ([0, 11, 12], 12, 4, [0, 4, 5]),  # lengths capped at max_seqlen, the rest moves down
    ([-(2 ** 31), 2 ** 31 - 1], 7, 100, [0, 7]),
])
def test_traced_cu_seqlens_are_clamped_into_the_buffers(cu, total, max_len, want):
    """Every varlen path runs with base.clamp_cu_seqlens's metadata: the identity on valid
    values; bad traced values (unchecked under jit) end up in [0, total], non-decreasing, each
    length at most max_seqlen, so no kernel index leaves its buffer."""
    got = jax.jit(base.clamp_cu_seqlens, static_argnums=(1, 2))(
        jnp.asarray(cu, jnp.int32), total, max_len)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, want)


def test_bad_traced_cu_seqlens_run_as_their_clamped_form():
    """Under jit (no call-time check) a call with bad cu_seqlens equals the call with the
    clamped metadata, and stays finite."""
    q, k, v = normal("clamped cu_seqlens", [(12, 2, 8)] * 3, jnp.float32)
    bad_q, bad_k = jnp.asarray([0, 9, 4, 40], jnp.int32), jnp.asarray([-3, 2, 11, 12], jnp.int32)
    f = jax.jit(lambda cq, ck: jax_fa4.flash_attention_varlen(q, k, v, cq, ck, 6, 6,
                                                              return_lse=True))
    out, lse = f(bad_q, bad_k)
    # (jitted: one program, not one per operation)
    clamp = jax.jit(functools.partial(base.clamp_cu_seqlens, total=12, max_seqlen=6))
    want_out, want_lse = f(clamp(bad_q), clamp(bad_k))
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)
