"""CPU stand-ins for the sm100 dense kernels, written to their documented call contracts.

``emulated_call_kernel(options, calls)`` replaces ``jax_fa4.ffi.call.call_kernel``: the sm100
forward (with each row's max logit for a ``max_logits`` config; with segment ids the mask
:func:`sm100_table_visible` reads from the tables alone) and the preprocess are the reference;
the sm100 backward
(``jax_fa4/kernels/sm100/bwd_config.py``) returns dq_accum as the kernel leaves it (row-major
(Sq_pad, D) per (b, h), unscaled, the rows past Sq NaN so that the caller must drop them) and, for
GQA configs, dK / dV per *query* head in float32. With them the sm100 route's JAX side
(jax_fa4.backends.sm100 and kernel, autodiff, sharding) runs on the CPU and must give the
reference's numbers. Shared by tests/test_sm100_bwd_wiring.py and tests/multidevice_checks.py.
The split backward at head dims 192/192 and 256 (``sm100_bwd_split``: a dK/dV and a dQ kernel)
follows
bwd_split_config.py: dk / dv as the fused kernel's, dq scaled in the input dtype; its varlen
configs the packed layout above, each output zero outside every sequence.

Varlen backward configs (``varlen``; the varlen forward's stand-in is tests/test_varlen.py's
``_emulated_varlen_kernel``) follow varlen_bwd_config.varlen_attention_backward_signature with the
sm100 dq_accum rows (sequence b's query row i at row ``first_tile(b)·128 + i`` of (R, D) per
head, unscaled, the rows of its tiles past its end NaN) and zero dK / dV outside every sequence;
the work list has one row per ``config.work_tile_n`` keys of a sequence (a 2-CTA config's: a
pair's 256). Like the kernel, they multiply by zero the rows past each sequence that its last
tiles load (q, dout: 128 rows; k, v: the work item's ``work_tile_n``), so a NaN or an Inf the
caller leaves there reaches that sequence's gradients.

Segment-id backward configs (``segments``; segments_config.with_segment_tables) read the mask
from their tables as the kernel does (:func:`sm100_backward_visible`: each key block's query-block
range, the query blocks' bulk, the rows' and keys' ids; not the spans nor the compare-ids flag),
so a table the kernel would misread gives other gradients; dq_accum and dK / dV as the dense
configs'. The 2-CTA kernel's segment-id configs (192/128) read the same 128-key tables, but each
key block visits its pair's range: the union of key blocks 2p and 2p + 1's (bwd_2cta.py), the
bulk and the ids per 128-key block as the 1-CTA kernel.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jax_fa4 import reference
from jax_fa4.backends import base
from jax_fa4.kernels import segments_config as cols
from jax_fa4.kernels.sm100.fwd_config import FwdConfig


def sm100_table_visible(tiles, rows, kv_ids, sq: int, sk: int, tile_n: int, q_tiles: int):
    """(B, Sq, Sk) bool: the keys each query sees by the sm100 forward's segment rule, from the
    tables of jax_fa4.segments.forward_tables (built for FwdConfig.tile_m-row Q tiles) alone:
    a query's work tile (q_tiles Q tiles) visits the union of its Q tiles' key-block ranges
    (segment_blocks; a Q tile past the table has none), and every visited key is masked to the
    row's span and, in a Q tile flagged ``ids``, to the row's id; the bulk is not read."""
    tile_m = FwdConfig.tile_m
    n_tiles = tiles.shape[1]
    q_tile = jnp.arange(sq) // tile_m
    first = q_tile // q_tiles * q_tiles
    lo, hi = tiles[:, first, cols.SEG_N_LO], tiles[:, first, cols.SEG_N_HI]  # (B, Sq)
    if q_tiles == 2:
        second = jnp.minimum(first + 1, n_tiles - 1)
        lo1, hi1 = tiles[:, second, cols.SEG_N_LO], tiles[:, second, cols.SEG_N_HI]
        joins = (first + 1 < n_tiles) & (hi1 > 0)
        lo = jnp.where(joins, jnp.where(hi == 0, lo1, jnp.minimum(lo, lo1)), lo)
        hi = jnp.where(joins, jnp.maximum(hi, hi1), hi)
    keys = jnp.arange(sk)
    n = keys // tile_n
    visited = (n >= lo[..., None]) & (n < hi[..., None])
    span = ((keys >= rows[..., cols.SEG_ROW_START, None])
            & (keys < rows[..., cols.SEG_ROW_END, None]))
    same = kv_ids[:, None, :] == rows[..., cols.SEG_ROW_ID, None]
    flagged = tiles[:, q_tile, cols.SEG_IDS] != 0
    return visited & span & (~flagged[..., None] | same)


def pair_key_ranges(keys):
    """The seg_keys table (B, Nb, 8) with each key block's [m_lo, m_hi) replaced by its 2-CTA
    pair's (bwd_2cta.pair_segment_range): the envelope of blocks 2p and 2p + 1's ranges, an
    empty one ignored (a block past the last has none); lo >= hi when both are empty."""
    n_blocks = keys.shape[1]
    first = jnp.arange(n_blocks) // 2 * 2
    second = jnp.minimum(first + 1, n_blocks - 1)
    lo = [keys[:, x, cols.SEG_KEY_M_LO] for x in (first, second)]
    hi = [keys[:, x, cols.SEG_KEY_M_HI] for x in (first, second)]
    has = [hi[0] > lo[0], (hi[1] > lo[1]) & (first + 1 < n_blocks)]
    none = jnp.iinfo(jnp.int32).max
    pair_lo = jnp.minimum(*(jnp.where(h, x, none) for h, x in zip(has, lo)))
    pair_hi = jnp.maximum(*(jnp.where(h, x, 0) for h, x in zip(has, hi)))
    return keys.at[..., cols.SEG_KEY_M_LO].set(pair_lo).at[..., cols.SEG_KEY_M_HI].set(pair_hi)


def sm100_backward_visible(tiles, keys, rows, kv_ids, sq: int, sk: int, tile_m: int,
                           tile_n: int, two_cta: bool = False):
    """(B, Sq, Sk) bool: the (query, key) pairs the sm100 backward with segment ids leaves
    visible, from the tables of jax_fa4.segments.backward_tables alone, read as the kernel reads
    them (jax_fa4/kernels/sm100/bwd.py): key block n's CTA visits the query blocks [m_lo, m_hi)
    of its seg_keys row (``two_cta``: of its pair's, :func:`pair_key_ranges`); a visited query
    block whose bulk (seg_tiles) holds n is not masked, any other compares the row's id
    (seg_rows' SEG_ROW_ID) with the key's (kv_ids)."""
    m = jnp.arange(sq) // tile_m
    n = jnp.arange(sk) // tile_n
    if two_cta:
        keys = pair_key_ranges(keys)
    key_rows = keys[:, n][:, None]  # (B, 1, Sk, 8)
    visited = ((m[:, None] >= key_rows[..., cols.SEG_KEY_M_LO])
               & (m[:, None] < key_rows[..., cols.SEG_KEY_M_HI]))
    tile_rows = tiles[:, m][:, :, None]  # (B, Sq, 1, 8)
    bulk = (n >= tile_rows[..., cols.SEG_BULK_LO]) & (n < tile_rows[..., cols.SEG_BULK_HI])
    same = rows[:, :, None, cols.SEG_ROW_ID] == kv_ids[:, None, :]
    return visited & (bulk | same)


def _segments_backward(config, inputs, out_shapes, ref_options: dict, scale: float) -> tuple:
    """(dq_accum, dk, dv) of the sm100 backward with segment ids: float32 gradients under the
    config's mask kind and :func:`sm100_backward_visible`'s mask, P from the lse_log2 and dS
    from the delta it is given; dq_accum, dK / dV laid out as the dense configs'. 2-CTA
    configs (192/128 only): the pairs' ranges."""
    q, k, v, dout, lse_log2, delta, _, dq_accum, tiles, keys, rows, kv_ids = inputs
    assert not (config.deterministic or config.varlen), config
    assert not config.two_cta or (config.head_dim, config.head_dim_v) == (192, 128), config
    b, sq, h, d = q.shape
    sk = k.shape[1]
    tm, tn = config.tile_m, config.tile_n
    assert tiles.shape[:2] == (b, -(-sq // tm)) and keys.shape[:2] == (b, -(-sk // tn))
    assert rows.shape[:2] == (b, sq) and kv_ids.shape == (b, sk)
    visible = sm100_backward_visible(tiles, keys, rows, kv_ids, sq, sk, tm, tn, config.two_cta)
    visible &= reference.visible_mask(sq, sk, ref_options["window"])[None]
    if config.gqa:  # per query head: k and v repeated over each group
        g = h // k.shape[2]
        k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    hkv = k.shape[2]
    lse = jnp.where(jnp.isinf(lse_log2), -jnp.inf, lse_log2 / math.log2(math.e))
    grouped = [x.astype(jnp.float32).reshape(b, sq, hkv, h // hkv, -1) for x in (q, dout)]
    stats = [x.reshape(b, hkv, h // hkv, sq) for x in (lse, delta)]
    dq, dk, dv = reference._backward_block(
        *grouped, *stats, k.astype(jnp.float32), v.astype(jnp.float32), visible, scale,
        ref_options["softcap"])
    # dq_accum: unscaled rows (B, H, Sq_pad, D), those past Sq NaN (the caller drops them)
    sq_pad = dq_accum.shape[2] // d
    acc = jnp.pad((dq.reshape(b, sq, h, d) / scale).transpose(0, 2, 1, 3),
                  ((0, 0), (0, 0), (0, sq_pad - sq), (0, 0)), constant_values=jnp.nan)
    return (dq_accum + acc.reshape(dq_accum.shape), dk.astype(out_shapes[1].dtype),
            dv.astype(out_shapes[2].dtype))


def _segments_forward(config, q, k, v, tiles, rows, kv_ids, options: dict) -> tuple:
    """(out float32, lse[, max_logits]) of the sm100 forward with segment ids: attention under
    the config's mask kind and the tables' mask (:func:`sm100_table_visible`)."""
    from test_segments import _masked_attention, _row_max

    sq, sk = q.shape[1], k.shape[1]
    visible = sm100_table_visible(tiles, rows, kv_ids, sq, sk, config.tile_n, config.q_tiles)
    visible &= reference.visible_mask(sq, sk, options["window"])[None]
    scale, softcap = options["softmax_scale"], options["softcap"]
    out, lse, _ = _masked_attention(q, k, v, visible, scale, softcap, None)
    if not config.max_logits:
        return out, lse
    return out, lse, _row_max(q, k, visible, scale, softcap)


def _check_signature(config, inputs, out_shapes) -> None:
    """What the real call_kernel checks before binding: operand count, ranks, dtypes, aliases."""
    sig = config.signature()
    assert len(inputs) == len(sig.inputs) and len(out_shapes) == len(sig.outputs), config
    for arg, x in zip(sig.inputs, inputs):
        assert x.ndim == arg.rank and jnp.dtype(x.dtype) == jnp.dtype(arg.dtype), (arg, x.shape)
    for i, o in sig.aliases:
        assert inputs[i].shape == tuple(out_shapes[o].shape), (i, o)


def _tail_poison(x, cu, tile: int):
    """(batch,) float32: 0 · the sum of the rows of packed x (total, ...) past each sequence
    that its last tile loads (NaN iff one of them holds a NaN or an Inf), as the kernel's
    products with the masked P / dS = 0 would make of them."""
    t = jnp.arange(x.shape[0], dtype=jnp.int32)
    lens = cu[1:] - cu[:-1]
    tile_end = cu[:-1] + -(-lens // tile) * tile
    rows = jnp.sum(x.astype(jnp.float32).reshape(x.shape[0], -1), axis=1)
    loaded = (t[None] >= cu[1:, None]) & (t[None] < tile_end[:, None])
    return 0.0 * jnp.sum(jnp.where(loaded, rows[None], 0.0), axis=1)


def _varlen_backward(config, inputs, out_shapes, ref_options, scale):
    from jax_fa4.backends import sm90

    q, k, v, dout, lse_log2, delta, _, dq_accum, cu_q, cu_k, work = inputs
    tn = config.work_tile_n  # keys per work item: a CTA's, or a 2-CTA pair's
    assert work.shape == (sm90.work_items(k.shape[1], cu_q.shape[0] - 1, tn), 8)
    _, total_q, h, d = q.shape
    tm = config.tile_m
    seg = base.varlen_segments(cu_q, cu_k, total_q, k.shape[1])
    if config.gqa:  # per query head: k and v repeated over each group
        g = h // k.shape[2]
        k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    lse = jnp.where(jnp.isinf(lse_log2), -jnp.inf, lse_log2 / math.log2(math.e))
    f32 = [x.astype(jnp.float32) for x in (q, k, v, dout)]
    # the kernel's rows past seqlen: P = dS = 0 (lse -inf, delta 0 there), times their values
    q_in = seg.q_segment_ids[..., None, None] >= 0
    k_in = seg.kv_segment_ids[..., None, None] >= 0
    f32 = [jnp.where(m, x, 0.0) for m, x in zip((q_in, k_in, k_in, q_in), f32)]
    dq, dk, dv = reference.attention_backward(
        f32[0], f32[1], f32[2], jnp.zeros(dout.shape, jnp.float32), lse, f32[3],
        delta=jnp.where(seg.q_segment_ids[:, None] >= 0, delta, 0.0), **ref_options,
        **seg._asdict())
    poison = (_tail_poison(q[0], cu_q, tm) + _tail_poison(dout[0], cu_q, tm)
              + _tail_poison(inputs[1][0], cu_k, tn) + _tail_poison(inputs[2][0], cu_k, tn))
    # (a sequence without query rows or without keys loads no tile)
    poison = jnp.where((cu_q[1:] > cu_q[:-1]) & (cu_k[1:] > cu_k[:-1]), poison, 0.0)
    t, sq, valid, start, _ = base.token_layout(cu_q, total_q)
    tk, sk, valid_k, _, _ = base.token_layout(cu_k, k.shape[1])
    dq = dq[0] + jnp.where(valid, poison[sq], 0.0)[:, None, None]
    dk, dv = (x[0] + jnp.where(valid_k, poison[sk], 0.0)[:, None, None] for x in (dk, dv))
    # dq_accum rows (H, R, D): sequence b's row i at first_tile(b)·tm + i; its tiles' rows past
    # its end NaN
    rows = dq_accum.shape[2] // d
    first = sm90.first_tiles(cu_q, tm)
    r = jnp.arange(rows, dtype=jnp.int32)
    owner = sm90.tile_owners(cu_q, rows // tm, tm)[r // tm]
    lens = cu_q[1:] - cu_q[:-1]
    past = (owner >= 0) & (r - first[jnp.maximum(owner, 0)] * tm >= lens[jnp.maximum(owner, 0)])
    acc = jnp.where(past[None, :, None], jnp.nan, 0.0) * jnp.ones((h, rows, d), jnp.float32)
    acc = acc.at[:, jnp.where(valid, first[sq] * tm + t - start, rows)].set(
        (dq / scale).transpose(1, 0, 2), mode="drop")
    return (dq_accum + acc.reshape(dq_accum.shape), dk[None].astype(out_shapes[1].dtype),
            dv[None].astype(out_shapes[2].dtype))


def _split_backward(config, inputs, out_shapes, ref_options):
    """The split backward's contract (bwd_split_config.py): part "dkdv" returns dk (scaled) and
    dv, per kv head in the input dtype or, GQA configs, float32 per query head; part "dq" the
    scaled dq in the input dtype (written once: no accumulator). The dQ kernel reads kv head
    h // (H / Hkv) itself."""
    q, k, v, dout, lse_log2, delta, _ = inputs
    h, hkv = q.shape[2], k.shape[2]
    if config.part == "dkdv" and config.gqa:  # per query head: k and v repeated over each group
        k, v = jnp.repeat(k, h // hkv, axis=2), jnp.repeat(v, h // hkv, axis=2)
    else:
        assert config.part == "dq" or h == hkv, config
    lse = jnp.where(jnp.isinf(lse_log2), -jnp.inf, lse_log2 / math.log2(math.e))
    f32 = [x.astype(jnp.float32) for x in (q, k, v, dout)]
    dq, dk, dv = reference.attention_backward(
        f32[0], f32[1], f32[2], jnp.zeros(dout.shape, jnp.float32), lse, f32[3], delta=delta,
        **ref_options)
    if config.part == "dq":
        return (dq.astype(out_shapes[0].dtype),)
    return dk.astype(out_shapes[0].dtype), dv.astype(out_shapes[1].dtype)


def _split_varlen_backward(config, inputs, out_shapes, ref_options):
    """The varlen split backward's contract (bwd_split_config.split_varlen_backward_signature):
    dK/dV part on the key blocks' work list, dQ part on the query blocks' (q and k swapped);
    dq scaled in the input dtype, every output zero outside every sequence. Like the kernels,
    the rows past a sequence that its last 64-row streamed tiles load (q and dout for dK / dV,
    k and v for dQ) reach its gradients multiplied by zero (NaN iff one is not finite)."""
    from jax_fa4.backends import sm90

    q, k, v, dout, lse_log2, delta, _, cu_q, cu_k, work = inputs
    _, total_q, h, d = q.shape
    total_k, batch = k.shape[1], cu_q.shape[0] - 1
    rows, cols = config.tile_rows, config.tile_cols
    resident = total_k if config.part == "dkdv" else total_q
    assert work.shape == (sm90.work_items(resident, batch, rows), 8), work.shape
    seg = base.varlen_segments(cu_q, cu_k, total_q, total_k)
    if config.gqa:  # per query head: k and v repeated over each group
        g = h // k.shape[2]
        k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    lse = jnp.where(jnp.isinf(lse_log2), -jnp.inf, lse_log2 / math.log2(math.e))
    q_in = seg.q_segment_ids[..., None, None] >= 0
    k_in = seg.kv_segment_ids[..., None, None] >= 0
    f32 = [jnp.where(m, x.astype(jnp.float32), 0.0)
           for m, x in zip((q_in, k_in, k_in, q_in), (q, k, v, dout))]
    dq, dk, dv = reference.attention_backward(
        f32[0], f32[1], f32[2], jnp.zeros(dout.shape, jnp.float32), lse, f32[3],
        delta=jnp.where(seg.q_segment_ids[:, None] >= 0, delta, 0.0), **ref_options,
        **seg._asdict())
    if config.part == "dkdv":
        poison = _tail_poison(q[0], cu_q, cols) + _tail_poison(dout[0], cu_q, cols)
    else:
        poison = _tail_poison(inputs[1][0], cu_k, cols) + _tail_poison(inputs[2][0], cu_k, cols)
    poison = jnp.where((cu_q[1:] > cu_q[:-1]) & (cu_k[1:] > cu_k[:-1]), poison, 0.0)
    if config.part == "dq":
        _, sq, valid, _, _ = base.token_layout(cu_q, total_q)
        dq = jnp.where(valid[:, None, None], dq[0] + poison[sq][:, None, None], 0.0)
        return (dq[None].astype(out_shapes[0].dtype),)
    _, sk, valid_k, _, _ = base.token_layout(cu_k, total_k)
    dk, dv = (jnp.where(valid_k[:, None, None], x[0] + poison[sk][:, None, None], 0.0)
              for x in (dk, dv))
    return dk[None].astype(out_shapes[0].dtype), dv[None].astype(out_shapes[1].dtype)


def emulated_call_kernel(options: dict, calls: list):
    """A call_kernel for the sm100 forward, the preprocess and the sm100 backward. ``options``:
    the reference's ``softmax_scale`` (a float), ``softcap`` and ``window`` (used by configs of
    mask kind "local"; "none" and "causal" configs have their own); every call appends
    ``(config, arch, input shapes)`` to ``calls``."""
    scale = options["softmax_scale"]

    def reference_options(config):
        window = {"none": (None, None), "causal": (None, 0)}.get(config.mask, options["window"])
        return dict(options, window=window)

    def call_kernel(config, arch, *inputs, out_shapes):
        _check_signature(config, inputs, out_shapes)
        calls.append((config, arch, tuple(tuple(x.shape) for x in inputs)))
        name = config.kernel_name
        if name == "sm100_bwd" and config.segments:
            assert arch == "sm_100a", arch
            return _segments_backward(config, inputs, out_shapes, reference_options(config),
                                      scale)
        if name == "sm100_bwd" and config.varlen:
            assert arch == "sm_100a" and not config.deterministic, (arch, config)
            return _varlen_backward(config, inputs, out_shapes, reference_options(config),
                                    scale)
        if name == "sm100_fwd" and config.segments:
            q, k, v, _, tiles, rows, kv_ids = inputs
            out, *stats = _segments_forward(config, q, k, v, tiles, rows, kv_ids,
                                            reference_options(config))
            return (out.astype(out_shapes[0].dtype), *stats)
        if name == "sm100_fwd":
            q, k, v, _ = inputs
            opts = reference_options(config)
            out, lse = reference.attention(q, k, v, **opts)
            if not config.max_logits:
                return out.astype(out_shapes[0].dtype), lse
            row_max = reference.row_max_logits(q, k, **{key: opts[key] for key in (
                "softmax_scale", "window", "softcap")})
            return out.astype(out_shapes[0].dtype), lse, row_max
        if name == "bwd_preprocess":
            out, dout, lse = inputs
            lse_log2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * math.log2(math.e))
            accum = ((jnp.zeros(out_shapes[2].shape, jnp.float32),) if config.zero_dq_accum
                     else ())
            return base.reference_delta(out, dout), lse_log2, *accum
        if name == "sm100_bwd_split":
            assert arch == "sm_100a", arch
            if config.varlen:
                return _split_varlen_backward(config, inputs, out_shapes,
                                              reference_options(config))
            return _split_backward(config, inputs, out_shapes, reference_options(config))
        assert name == "sm100_bwd" and arch == "sm_100a", (name, arch)
        q, k, v, dout, lse_log2, delta, _, dq_accum = inputs[:8]
        b, sq, h, d = q.shape
        sq_pad = -(-sq // config.tile_m) * config.tile_m
        assert dq_accum.shape == (b, h, sq_pad * d)
        if config.deterministic:
            assert inputs[8].shape == (b, h, sq_pad // config.tile_m * config.semaphore_slots)
        g = h // k.shape[2]
        if config.gqa:  # per query head: k and v repeated over each group
            k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
        lse = jnp.where(jnp.isinf(lse_log2), -jnp.inf, lse_log2 / math.log2(math.e))
        f32 = [x.astype(jnp.float32) for x in (q, k, v, dout)]
        dq, dk, dv = reference.attention_backward(
            f32[0], f32[1], f32[2], jnp.zeros(dout.shape, jnp.float32), lse, f32[3],
            delta=delta, **reference_options(config))
        rows = (dq / scale).transpose(0, 2, 1, 3)  # (B, H, Sq, D), unscaled
        rows = jnp.concatenate([rows, jnp.full((b, h, sq_pad - sq, d), jnp.nan)], axis=2)
        outs = (dq_accum + rows.reshape(dq_accum.shape), dk.astype(out_shapes[1].dtype),
                dv.astype(out_shapes[2].dtype))
        return outs + ((inputs[8] + 1,) if config.deterministic else ())

    return call_kernel
