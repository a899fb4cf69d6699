"""The segment-id tables of the forward kernels (jax_fa4.segments) against brute force.

The kernel's rule is simulated in NumPy from the tables alone (what FwdConfig.segments reads):
tile m visits key blocks [n_lo, n_hi) intersected with nothing else; a block in the bulk is
unmasked; every other visited block masks each row to its span [start, end), and, in a tile
flagged ``ids``, also every key whose id differs from the row's. That must equal
``q_ids[i] == kv_ids[j]`` exactly, and the bulk must never hold a pair with different ids.
The sm100 forward's rule on the same tables (work tiles of one or two 128-row Q tiles, no bulk:
tests/sm100_emulation.sm100_table_visible) must be exact too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import per_class

import jax_fa4
from jax_fa4 import backends, reference, segments
from jax_fa4.backends import base
from jax_fa4.kernels import segments_config as cols
from extreme_cases import oracle, window_visible


def packed_ids(rng, b, s, max_docs, pad_id=None):
    """(B, S) contiguous runs of increasing ids (packing), optionally ending in padding."""
    out = np.empty((b, s), np.int32)
    for row in range(b):
        cuts = np.sort(rng.choice(np.arange(1, s), size=rng.integers(0, max_docs), replace=False))
        ids = np.zeros(s, np.int32)
        for c in cuts:
            ids[c:] += 1
        if pad_id is not None:
            ids[s - rng.integers(0, s // 3 + 1):] = pad_id
        out[row] = ids
    return out


#: segments.row_spans as one program per shape (op by op, each operation compiles for each shape)
row_spans = jax.jit(segments.row_spans)


def simulate(q_ids, kv_ids, tile_m, tile_n):
    """(visible (B, Sq, Sk) by the kernel's rule from the tables, the tables)."""
    tiles, rows, kv = (np.asarray(x) for x in segments.forward_tables(q_ids, kv_ids, tile_m,
                                                                      tile_n))
    b, sq = q_ids.shape
    sk = kv_ids.shape[1]
    vis = np.zeros((b, sq, sk), bool)
    for bi in range(b):
        for m in range(tiles.shape[1]):
            t = tiles[bi, m]
            r = rows[bi, m * tile_m:(m + 1) * tile_m, :, None]  # (rows, columns, 1)
            for n in range(t[cols.SEG_N_LO], t[cols.SEG_N_HI]):
                keys = np.arange(n * tile_n, min((n + 1) * tile_n, sk))
                block = vis[bi, m * tile_m:(m + 1) * tile_m, n * tile_n:(n + 1) * tile_n]
                if t[cols.SEG_BULK_LO] <= n < t[cols.SEG_BULK_HI]:
                    block[:] = True
                    continue
                ok = (keys >= r[:, cols.SEG_ROW_START]) & (keys < r[:, cols.SEG_ROW_END])
                if t[cols.SEG_IDS]:
                    ok &= kv[bi, keys] == r[:, cols.SEG_ROW_ID]
                block[:] = ok
    return vis, tiles


def check(q_ids, kv_ids, tile_m, tile_n):
    vis, tiles = simulate(q_ids, kv_ids, tile_m, tile_n)
    expected = q_ids[:, :, None] == kv_ids[:, None, :]
    np.testing.assert_array_equal(vis, expected)
    # the bulk holds equal ids only; the visited range holds every visible pair
    for bi in range(q_ids.shape[0]):
        for m, t in enumerate(tiles[bi]):
            rows = slice(m * tile_m, (m + 1) * tile_m)
            lo, hi = t[cols.SEG_BULK_LO] * tile_n, t[cols.SEG_BULK_HI] * tile_n
            assert expected[bi, rows, lo:hi].all()
            seen = np.nonzero(expected[bi, rows].any(0))[0]
            if seen.size:
                assert t[cols.SEG_N_LO] <= seen[0] // tile_n
                assert seen[-1] // tile_n < t[cols.SEG_N_HI]
    return tiles


@pytest.mark.parametrize("seed, tile_m, tile_n", per_class(
    [(seed, *tile) for seed in range(3) for tile in ((128, 128), (64, 176), (192, 128))],
    key=lambda case: case[1:]))  # quick tier: one seed per tile shape
def test_packed_documents(seed, tile_m, tile_n):
    rng = np.random.default_rng(seed)
    s = int(rng.integers(300, 900))
    ids = packed_ids(rng, 3, s, max_docs=6)
    tiles = check(ids, ids, tile_m, tile_n)
    assert not tiles[..., cols.SEG_IDS].any()  # contiguous runs: spans only
    # long documents leave an unmasked bulk
    one = np.zeros((1, 1000), np.int32)
    t = check(one, one, tile_m, tile_n)
    assert (t[..., cols.SEG_BULK_HI] > t[..., cols.SEG_BULK_LO]).any()


@pytest.mark.parametrize("seed", per_class(range(4), key=lambda seed: 0))  # quick tier: one
def test_non_contiguous_ids_compare_key_by_key(seed):
    rng = np.random.default_rng(100 + seed)
    sq, sk = int(rng.integers(100, 500)), int(rng.integers(100, 500))
    q_ids = rng.integers(0, 4, (2, sq)).astype(np.int32)
    kv_ids = rng.integers(0, 5, (2, sk)).astype(np.int32)
    tiles = check(q_ids, kv_ids, 128, 128)
    assert tiles[..., cols.SEG_IDS].any()


def test_cross_attention_pairs_and_missing_ids():
    rng = np.random.default_rng(7)
    q_ids = packed_ids(rng, 2, 333, max_docs=4, pad_id=-1)  # -1: no key has it
    kv_ids = packed_ids(rng, 2, 517, max_docs=4, pad_id=-2)
    tiles = check(q_ids, kv_ids, 128, 128)
    # rows whose id no key has: empty spans
    start, end, contiguous = (np.asarray(x) for x in row_spans(q_ids, kv_ids))
    assert (start[q_ids == -1] == end[q_ids == -1]).all()
    assert contiguous[q_ids == -1].all()
    assert tiles.shape == (2, 3, cols.SEG_TILE_COLUMNS)


#: (tile_n, q_tiles): the quick tier runs one per work tile size (tile_n 128), --exhaustive the
#: 64-key blocks too (the same rule; tables whose key blocks are shorter than the query tiles:
#: test_packed_documents' 192 × 128)
@pytest.mark.parametrize("tile_n, q_tiles", per_class([(128, 2), (128, 1), (64, 1)],
                                                      key=lambda case: case[1]))
def test_sm100_rule_is_exact(tile_n, q_tiles):
    """The sm100 forward reads the tables built for its 128-row Q tiles: a work tile of
    ``q_tiles`` of them visits the union of their key-block ranges and masks every visited key
    to the row's span (and id, in flagged Q tiles), never skipping the mask for a bulk. Exact
    for packed documents (odd lengths: a last work tile with one Q tile), ids that are not one
    run, and cross attention with ids no key has."""
    from sm100_emulation import sm100_table_visible

    from jax_fa4.kernels.sm100.fwd_config import FwdConfig

    # jitted: one program per case (op by op, each operation compiles for each shape)
    visible_of = jax.jit(sm100_table_visible, static_argnums=(3, 4, 5, 6))
    rng = np.random.default_rng(11)
    packed = packed_ids(rng, 2, 421, max_docs=5)
    cases = [(packed, packed),
             (rng.integers(0, 3, (2, 300)).astype(np.int32),
              rng.integers(0, 4, (2, 250)).astype(np.int32)),
             (packed_ids(rng, 2, 333, max_docs=4, pad_id=-1),
              packed_ids(rng, 2, 517, max_docs=4, pad_id=-2))]
    for q_ids, kv_ids in cases:
        tiles, rows, kv = segments.forward_tables(q_ids, kv_ids, FwdConfig.tile_m, tile_n)
        visible = visible_of(tiles, rows, kv, q_ids.shape[1], kv_ids.shape[1], tile_n, q_tiles)
        np.testing.assert_array_equal(visible, q_ids[:, :, None] == kv_ids[:, None, :])


def test_row_spans_brute_force():
    rng = np.random.default_rng(11)
    q_ids = rng.integers(0, 6, (3, 57)).astype(np.int32)
    kv_ids = np.sort(rng.integers(0, 6, (3, 91)), axis=1).astype(np.int32)
    kv_ids[1] = rng.permutation(kv_ids[1])
    start, end, contiguous = (np.asarray(x) for x in row_spans(q_ids, kv_ids))
    for b in range(3):
        for i in range(57):
            hits = np.nonzero(kv_ids[b] == q_ids[b, i])[0]
            if hits.size == 0:
                assert (start[b, i], end[b, i], contiguous[b, i]) == (0, 0, True)
                continue
            assert (start[b, i], end[b, i]) == (hits[0], hits[-1] + 1)
            assert contiguous[b, i] == (hits.size == hits[-1] + 1 - hits[0])


# -- the API route on an emulated kernel -------------------------------------------------------
def _table_visible(config, tiles, rows, kv_ids, sq, sk):
    """(B, Sq, Sk) bool: the keys each query sees by the kernel's segment rule, from the
    tables alone (``simulate``'s rule, in JAX)."""
    i = jnp.arange(sq)[:, None]
    j = jnp.arange(sk)[None, :]
    t = tiles[:, i // config.tile_m, :]  # (B, Sq, 1, 8)
    n = j // config.tile_n
    visited = (n >= t[..., cols.SEG_N_LO]) & (n < t[..., cols.SEG_N_HI])
    bulk = (n >= t[..., cols.SEG_BULK_LO]) & (n < t[..., cols.SEG_BULK_HI])
    r = rows[:, :, None, :]
    span = (j >= r[..., cols.SEG_ROW_START]) & (j < r[..., cols.SEG_ROW_END])
    same = kv_ids[:, None, :] == r[..., cols.SEG_ROW_ID]
    return visited & (bulk | (span & ((t[..., cols.SEG_IDS] == 0) | same)))


def _masked_attention(q, k, v, visible, scale, softcap, sink):
    """float32 (out, lse, P, dP-ready pieces) of attention under a (B, Sq, Sk) mask, with the
    sink (H,) as one more logit of value 0: (out (B, Sq, H, Dv), lse (B, H, Sq), p (B, H, Sq,
    Sk))."""
    h, hkv = q.shape[2], k.shape[2]
    kr = jnp.repeat(k.astype(jnp.float32), h // hkv, axis=2)
    vr = jnp.repeat(v.astype(jnp.float32), h // hkv, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kr) * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(visible[:, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    if sink is not None:
        m = jnp.maximum(m, sink[None, :, None])
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(s - m[..., None])
    total = e.sum(-1) + (0.0 if sink is None else jnp.exp(sink[None, :, None] - m))
    p = e / jnp.where(total > 0, total, 1.0)[..., None]
    lse = jnp.where(total > 0, m + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vr), lse, p


def _row_max(q, k, visible, scale, softcap):
    """float32 (B, H, Sq): each row's largest visible score (the max_logits output)."""
    kr = jnp.repeat(k.astype(jnp.float32), q.shape[2] // k.shape[2], axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kr) * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    return jnp.where(visible[:, None], s, -jnp.inf).max(axis=-1)


def _emulated_segments_kernel(window, softcap, calls):
    """Stand-ins for the sm90 kernels with segment ids, reading the mask from their tables alone:
    the forward (forward_signatures_config.segments_attention_forward_signature: float32
    attention under the window and :func:`_table_visible`'s mask, the learnable sinks params
    carries past its 4 scalars joined), the backward main kernel
    (bwd_config.with_segment_tables: the table mask restricted to each key block's query-block
    range; dq written unscaled in row order into dq_accum, dk / dv per kv head or, GQA, float32
    per query head; sink_grad: the sink's share of the float32 output's rowsum) and its
    postprocess (dq_accum rows · scale); the preprocess by the reference's rule, with the
    dense backward's zeroed dq_accum (PreprocessConfig.zero_dq_accum)."""
    from jax_fa4.kernels.sm90.bwd_config import BwdConfig, BwdPostprocessConfig

    def forward(config, q, k, v, params, tiles, rows, kv_ids, out_shapes):
        assert config.segments and config.kernel_name == "sm90_fwd"
        sq, sk = q.shape[1], k.shape[1]
        visible = _table_visible(config, tiles, rows, kv_ids, sq, sk)
        visible &= reference.visible_mask(sq, sk, window)[None]
        sink = params[4:] if params.shape[0] > 4 else None
        out, lse, _ = _masked_attention(q, k, v, visible, params[0], softcap, sink)
        if not config.max_logits:
            return out.astype(out_shapes[0].dtype), lse
        return out.astype(out_shapes[0].dtype), lse, _row_max(q, k, visible, params[0], softcap)

    def main(config, q, k, v, dout, lse_log2, delta, params, dq_accum, tiles, keys, rows,
             kv_ids, out_shapes):
        assert config.segments and not config.swap_sdp
        b, sq, h, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        visible = _table_visible(config, tiles, rows, kv_ids, sq, sk)
        m_of = jnp.arange(sq)[:, None] // config.tile_m
        key_row = keys[:, jnp.arange(sk) // config.tile_n, :]  # (B, Sk, 8)
        visible &= ((m_of >= key_row[:, None, :, cols.SEG_KEY_M_LO])
                    & (m_of < key_row[:, None, :, cols.SEG_KEY_M_HI]))
        visible &= reference.visible_mask(sq, sk, window)[None]
        sink = params[4:] if config.sink_grad else None
        out32, lse, p = _masked_attention(q, k, v, visible, params[0], softcap, sink)
        # P from the lse the kernel is given, exp(s - lse_given), as the kernel computes it
        # (so a wrong lse shows in the gradients)
        given = jnp.where(jnp.isinf(lse_log2), -jnp.inf, lse_log2 / np.log2(np.e))
        empty = jnp.isneginf(lse) | jnp.isneginf(given)
        p = p * jnp.where(empty, 0.0, jnp.exp(lse - jnp.where(empty, 0.0, given)))[..., None]
        group = h // hkv
        kr = jnp.repeat(k.astype(jnp.float32), group, axis=2)
        vr = jnp.repeat(v.astype(jnp.float32), group, axis=2)
        do = dout.astype(jnp.float32)
        dp = jnp.einsum("bqhd,bkhd->bhqk", do, vr)
        ds = p * (dp - delta[..., None])
        if softcap:
            raw = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kr) * params[0]
            ds = ds * (1.0 - jnp.tanh(raw / softcap) ** 2)
        dq = jnp.einsum("bhqk,bkhd->bqhd", ds, kr)  # unscaled, as dq_accum holds it
        dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(jnp.float32)) * params[0]
        dv = jnp.einsum("bhqk,bqhd->bkhd", p, do)
        if not config.gqa:
            dk = dk.reshape(b, sk, hkv, group, d).sum(3)
            dv = dv.reshape(b, sk, hkv, group, -1).sum(3)
        sq_pad = dq_accum.shape[2] // d
        acc = jnp.zeros((b, h, sq_pad, d), jnp.float32).at[:, :, :sq].set(dq.transpose(0, 2, 1, 3))
        outs = [dq_accum + acc.reshape(dq_accum.shape), dk.astype(out_shapes[1].dtype),
                dv.astype(out_shapes[2].dtype)]
        if config.sink_grad:
            rows_sum = (out32 * do).sum(-1).transpose(0, 2, 1)  # (B, H, Sq)
            p_sink = jnp.where(jnp.isneginf(lse), 0.0,
                               jnp.exp(sink[None, :, None] - jnp.where(jnp.isneginf(lse), 0.0,
                                                                       lse)))
            outs.append(jnp.zeros(out_shapes[3].shape, jnp.float32).at[:, :, 0].set(
                (p_sink * rows_sum).sum(-1)))
        return tuple(outs)

    def kernel(config, arch, *args, out_shapes):
        assert arch == "sm_90a"
        calls.append(config)
        if config.kernel_name == "bwd_preprocess":  # the reference's rule, dq_accum's zeros
            delta, lse_log2 = base.REFERENCE_BACKEND.backward_preprocess(*args)
            return (delta, lse_log2, *([jnp.zeros(out_shapes[2].shape, jnp.float32)]
                                       if config.zero_dq_accum else []))
        if isinstance(config, BwdPostprocessConfig):
            dq_accum, params = args
            b, h, n = dq_accum.shape
            shape = out_shapes[0].shape
            dq = dq_accum.reshape(b, h, n // shape[3], shape[3])[:, :, :shape[1]] * params[0]
            return (dq.transpose(0, 2, 1, 3).astype(out_shapes[0].dtype),)
        if isinstance(config, BwdConfig):
            return main(config, *args, out_shapes)
        return forward(config, *args, out_shapes)
    return kernel


@pytest.mark.parametrize("kwargs, with_sink, ids_kind", [
    (dict(causal=True), False, "packed"),
    (dict(window_size=(40, 5), softcap=15.0), True, "packed"),
    (dict(), True, "random"),
], ids=["causal", "window-softcap-sink", "random-ids-sink"])
def test_kernel_route_with_an_emulated_kernel(kwargs, with_sink, ids_kind, monkeypatch):
    """implementation="sm90" with segment ids runs the segment-id forward and backward kernels
    on the tables jax_fa4.segments builds (the emulated kernels read the mask from them
    alone): the reference's forward and gradients, without the (Sq × Sk) mask reaching any
    kernel."""
    from jax_fa4.ffi import call

    rng = np.random.default_rng(len(repr(kwargs)))
    b, s, h, hkv, d = 2, 300, 4, 2, 64
    ids = packed_ids(rng, b, s, 5) if ids_kind == "packed" else rng.integers(
        0, 3, (b, s)).astype(np.int32)
    q, k, v, dout = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for shape in (
        (b, s, h, d), (b, s, hkv, d), (b, s, hkv, d), (b, s, h, d)))
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32) if with_sink else None
    window = (kwargs.get("window_size", (None, None))[0], 0) if kwargs.get("causal") else \
        kwargs.get("window_size", (None, None))
    calls = []
    monkeypatch.setattr(call, "call_kernel",
                        _emulated_segments_kernel(window, kwargs.get("softcap", 0.0), calls))

    def f(q, k, v, s):
        return jax_fa4.flash_attention(q, k, v, segment_ids=jnp.asarray(ids), learnable_sink=s,
                                       return_lse=True, implementation="sm90", **kwargs)

    (out, lse), vjp = jax.vjp(f, q, k, v, sink)
    got = (out, lse, *vjp((dout, jnp.zeros_like(lse))))
    mask = "causal" if kwargs.get("causal") else "local" if "window_size" in kwargs else "none"
    fwd = [c for c in calls if c.kernel_name == "sm90_fwd"]
    bwd = [c for c in calls if c.kernel_name == "sm90_bwd"]
    assert fwd and all(c == backends.get("sm90").make_segments(
        "bfloat16", d, d, mask, "softcap" in kwargs) for c in fwd), fwd
    assert bwd and all(c.segments and c.sink_grad == with_sink and c.gqa for c in bwd), bwd
    assert [c.kernel_name for c in calls].count("sm90_bwd_postprocess") == len(bwd)
    # the preprocess zero-fills the main kernel's dq_accum (PreprocessConfig.zero_dq_accum)
    assert [c.zero_dq_accum for c in calls if c.kernel_name == "bwd_preprocess"] == [True]
    # the reference's results: the float64 oracle of tests/extreme_cases.py (which the reference
    # is checked against), NumPy: no reference program compiled per case
    visible = window_visible(s, s, window)[None] & (ids[:, :, None] == ids[:, None, :])
    out, lse, grads = oracle(q, k, v, visible, 1 / np.sqrt(d), kwargs.get("softcap", 0.0),
                             sink, dout=dout)
    want = (out, lse, *grads)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "dsink"), got, want):
        if w is None:
            assert g is None, name
            continue
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w), err_msg=name)
        fin = np.isfinite(w)
        bound = 0.02 * max(1.0, float(np.abs(w[fin]).max()))
        assert float(np.abs(g[fin] - w[fin]).max()) <= bound, (name, np.abs(g - w).max())


@pytest.mark.parametrize("implementation, dtype, words", [
    ("sm90", jnp.float32, "bfloat16 or float16"),
    ("sm100", jnp.float32, "bfloat16 or float16"),
])
def test_a_forced_kernel_that_cannot_serve_says_why(implementation, dtype, words):
    q = jnp.ones((1, 64, 2, 64), dtype)
    ids = jnp.zeros((1, 64), jnp.int32)
    with pytest.raises(jax_fa4.ImplementationUnavailableError, match=words):
        jax_fa4.flash_attention(q, q, q, segment_ids=ids, implementation=implementation)


def test_padding_segment_id_attends_to_nothing():
    """padding_segment_id=0 (the JAX trainers' convention): padding queries get out 0, lse
    -inf and zero, finite gradients; no other query sees padding keys, which get zero
    gradients; the rest equals the call with padding given two distinct unused ids."""
    rng = np.random.default_rng(3)
    b, s, h, d = 2, 50, 2, 16
    ids = np.repeat([1, 2, 0], [20, 22, 8])[None].repeat(b, 0).astype(np.int32)
    q, k, v = (jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32) for _ in range(3))
    k = k.at[:, -8:].set(1e4)  # padding keys that would dominate any softmax they entered

    def f(q, k, v, **kw):
        out, lse = jax_fa4.flash_attention(q, k, v, causal=True, return_lse=True, **kw)
        return out, lse

    out, lse = f(q, k, v, segment_ids=jnp.asarray(ids), padding_segment_id=0)
    assert not np.asarray(out[:, -8:]).any() and np.isneginf(np.asarray(lse[:, :, -8:])).all()
    distinct = (jnp.asarray(np.where(ids == 0, -1, ids)), jnp.asarray(np.where(ids == 0, -2, ids)))
    want, want_lse = f(q, k, v, segment_ids=distinct)
    np.testing.assert_allclose(out, want, atol=1e-6)
    np.testing.assert_array_equal(lse, want_lse)
    grads = jax.grad(lambda q, k, v: f(q, k, v, segment_ids=jnp.asarray(ids),
                                       padding_segment_id=0)[0].sum(), argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert np.isfinite(np.asarray(g)).all() and not np.asarray(g[:, -8:]).any()
    with pytest.raises(ValueError, match="padding_segment_id needs segment_ids"):
        jax_fa4.flash_attention(q, k, v, padding_segment_id=0)


# -- the sort-free tables of self-attention (Sq == Sk) ------------------------------------------
@pytest.mark.parametrize("tile_m, tile_n", [(128, 128), (64, 176)])
def test_sort_free_tables_for_packed_rows_padding_and_other_ids(tile_m, tile_n):
    """Sq == Sk: packed rows (runs of increasing ids, padding ids from padding_segment_id at
    the end or in between) get exact spans and no flag; rows whose ids come back after another
    run, random ids and rows whose query and key ids differ stay exact (simulated kernel rule =
    brute force) through the flagged key-by-key path."""
    from jax_fa4.segments import PADDING_KV_ID, PADDING_Q_ID

    rng = np.random.default_rng(tile_n)
    s = 700
    packed = packed_ids(rng, 4, s, max_docs=7)
    q_pad, kv_pad = packed.copy(), packed.copy()
    q_pad[1, 500:], kv_pad[1, 500:] = PADDING_Q_ID, PADDING_KV_ID  # padding at the end
    q_pad[2, 160:] += 100  # a new document after padding in between
    kv_pad[2, 160:] += 100
    q_pad[2, 100:160], kv_pad[2, 100:160] = PADDING_Q_ID, PADDING_KV_ID
    tiles = check(q_pad, kv_pad, tile_m, tile_n)
    assert not tiles[..., cols.SEG_IDS].any(), "packed rows must not compare ids"
    back = packed.copy()
    back[3, 600:650] = back[3, 0] - 1  # an id below an earlier one: maybe new, not one run
    back[0] = np.repeat([0, 1, 0], [200, 200, 300])  # the first document's id comes back
    tiles = check(back, back, tile_m, tile_n)
    assert tiles[[0, 3], ..., cols.SEG_IDS].any(axis=-1).all()
    assert not tiles[1:3, ..., cols.SEG_IDS].any()
    rand = rng.integers(0, 4, (2, s)).astype(np.int32)
    check(rand, rand, tile_m, tile_n)
    other = packed[:2].copy()
    other_kv = np.where(other == other[:, :1], -7, other)  # the first document has no keys
    check(other, other_kv, tile_m, tile_n)


def test_self_attention_tables_have_no_sort():
    """The forward and backward tables of Sq == Sk calls hold no sort (XLA's sorts cost about
    0.15 ms per call on the GPU)."""
    import re

    def primitives(jaxpr) -> set[str]:
        return set(re.findall(r"= (\w+)\[", str(jaxpr)))

    ids = jnp.zeros((2, 1024), jnp.int32)
    for fn in (segments.forward_tables, segments.backward_tables):
        used = primitives(jax.make_jaxpr(lambda i: fn(i, i, 128, 128))(ids))
        assert not used & {"sort", "while"}, (fn.__name__, used)
    cross = primitives(jax.make_jaxpr(lambda q, k: segments.forward_tables(q, k, 128, 128))(
        ids, jnp.zeros((2, 900), jnp.int32)))
    assert "sort" in cross and "while" not in cross
