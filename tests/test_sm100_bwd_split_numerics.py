"""CPU emulation of the sm100 split backward's arithmetic, tile by tile (no compiler, no GPU).

``emulate_dkdv`` and ``emulate_dq`` perform what each CTA of jax_fa4/kernels/sm100/bwd_split.py
computes, in its order and with its rules: the resident and streamed tiles as the TMA loads them
(rows past the sequence zero), the visited blocks from the kernels' own geometry
(``BwdBlocks.m_block_range`` with 64-row query blocks for dK/dV, ``FwdBlocks.n_block_range`` with
64-key blocks for dQ), −lse / −delta staging (−∞ and 0 past Sq), the masks (dK/dV: the fused
kernel's ``softmax_p``, only on blocks ``mask_reasons`` flags, from ``visible_rows``; dQ: every
block, from ``visible_cols``), softcap with tanh and 1 − t² (dK/dV recovering t from P as the
fused ``softmax_ds`` does; dQ keeping t), P and dS rounded to the input dtype before the TS
GEMMs, float32 accumulation, each dK/dV CTA's output column part (the config's ``col_splits``:
halves at 256, all columns at 192/192), the scales, the row bounds of the stores, GQA per query
head. Its gradients must match the float64 oracle's (tests/extreme_cases.py) within the
16-bit roundings' error: a wrong block range, mask bound, column part or scale shows here.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from compiled import per_class
from extreme_cases import oracle, window_visible

from jax_fa4.kernels.common.geometry import BwdBlocks, FwdBlocks, clamp_windows
from jax_fa4.kernels.sm100.bwd_split_config import Sm100BwdSplitConfig

ROWS, COLS = Sm100BwdSplitConfig.tile_rows, Sm100BwdSplitConfig.tile_cols
FLT_MIN_NORMAL = 2.0 ** -126
LOG2_E = math.log2(math.e)


def _round(x: np.ndarray, dtype) -> np.ndarray:
    """float32 → the input dtype → float32 (what a 16-bit store and an MMA read do)."""
    return np.asarray(np.asarray(x, np.float32).astype(dtype), np.float32)


def _tile(x: np.ndarray, start: int, rows: int) -> np.ndarray:
    """Rows [start, start + rows) of x (S, D), zero past S (the TMA's out-of-bounds fill)."""
    out = np.zeros((rows, x.shape[1]), np.float32)
    part = x[start:start + rows]
    out[:len(part)] = part
    return out


class Problem:
    """One (batch entry, query head) of a launch: float32 views of the 16-bit inputs and the
    preprocess's statistics, the kernels' scalars and block geometry."""

    def __init__(self, q, k, v, dout, lse_log2, delta, scale, softcap, mask, window,
                 lengths: tuple[int, int] | None = None):
        """``lengths`` (varlen): the sequence's (len_q, len_k) when q / dout and k / v are the
        packed tensors from its first row on (the tiles then load the next sequences' rows)."""
        self.q, self.k, self.v, self.dout = q, k, v, dout
        self.lse_log2, self.delta = lse_log2, delta
        self.sq, self.sk = (q.shape[0], k.shape[0]) if lengths is None else lengths
        self.scale, self.softcap, self.mask = scale, softcap, mask
        wl, wr = (-1 if w is None else w for w in window)
        self.wl, self.wr = clamp_windows(wl, wr, self.sq, self.sk) if mask == "local" else (0, 0)
        # score_scales: with softcap P = exp2(t·softcap·log2 e − lse), t = tanh(s·scale/softcap)
        self.scale_log2 = softcap * LOG2_E if softcap else scale * LOG2_E
        self.tanh_in = scale / softcap if softcap else 0.0
        # stage_stats / the dq kernel's row statistics: rows past Sq get −∞ and 0
        rows = np.arange(self.sq + ROWS)
        inside = rows < self.sq
        self.neg_lse = np.where(inside, -np.pad(lse_log2[:self.sq], (0, ROWS)), -np.inf)
        self.neg_delta = np.where(inside, -np.pad(delta[:self.sq], (0, ROWS)), 0.0)

    def blocks(self, cls, tile_m, tile_n):
        return cls(tile_m, tile_n, self.mask == "causal", self.mask == "local", self.sq, self.sk,
                   self.wl, self.wr)


def emulate_dkdv(p: Problem, dtype) -> tuple[np.ndarray, np.ndarray]:
    """dK, dV (Sk, D) float32 of the dK/dV kernel: CTA (n, c) writes columns [o·c, o·c + o) of
    o = out_cols (its config's column parts: 2 at 256, 1 at 192/192)."""
    d = p.q.shape[1]
    cfg = Sm100BwdSplitConfig.make("dkdv", "bfloat16", d)
    o = cfg.out_cols
    blocks = p.blocks(BwdBlocks, COLS, ROWS)
    dk, dv = np.zeros((p.sk, d), np.float32), np.zeros((p.sk, d), np.float32)
    for n in range(-(-p.sk // ROWS)):
        m_min, m_max = blocks.m_block_range(n)
        k_t, v_t = _tile(p.k, n * ROWS, ROWS), _tile(p.v, n * ROWS, ROWS)
        keys = n * ROWS + np.arange(ROWS)
        for c in range(cfg.col_splits):
            cols = slice(o * c, o * (c + 1))
            acc_dk = np.zeros((ROWS, o), np.float32)
            acc_dv = np.zeros((ROWS, o), np.float32)
            for m in range(m_min, max(m_max, m_min)):
                q_t, do_t = _tile(p.q, m * COLS, COLS), _tile(p.dout, m * COLS, COLS)
                neg_lse = p.neg_lse[m * COLS:(m + 1) * COLS]
                neg_delta = p.neg_delta[m * COLS:(m + 1) * COLS]
                st = k_t @ q_t.T  # (keys, query columns)
                if p.softcap:
                    st = np.tanh(st * p.tanh_in)
                if any(blocks.mask_reasons(m, n)):  # softmax_p: only the flagged blocks
                    i = np.arange(COLS)
                    for r, key in enumerate(keys):
                        lo, hi = blocks.visible_rows(int(key), m)
                        if key >= p.sk:
                            lo = COLS
                        visible = i >= lo
                        if p.mask == "local":
                            visible &= i <= hi
                        st[r] = np.where(visible, st[r], -np.inf)
                pt = np.exp2(st * p.scale_log2 + neg_lse[None])
                acc_dv += _round(pt, dtype) @ do_t[:, cols]  # dV_c += Pᵀ·dO[:, c]
                dpt = v_t @ do_t.T
                ds = pt * (dpt + neg_delta[None])
                if p.softcap:  # softmax_ds: t recovered from P
                    with np.errstate(divide="ignore", invalid="ignore"):
                        t = (np.log2(pt) - neg_lse[None]) / p.scale_log2
                        ds = np.where(pt >= FLT_MIN_NORMAL, ds * (1.0 - t * t), 0.0)
                acc_dk += _round(ds, dtype) @ q_t[:, cols]  # dK_c += dSᵀ·Q[:, c]
            valid = keys < p.sk
            dk[keys[valid], cols] = (acc_dk * p.scale)[valid]
            dv[keys[valid], cols] = acc_dv[valid]
    return dk, dv


def emulate_dq(p: Problem, dtype) -> np.ndarray:
    """dQ (Sq, D) float32 of the dQ kernel (before the store's cast)."""
    d = p.q.shape[1]
    blocks = p.blocks(FwdBlocks, ROWS, COLS)
    dq = np.zeros((p.sq, d), np.float32)
    for m in range(-(-p.sq // ROWS)):
        n_min, n_max = blocks.n_block_range(m)
        q_t, do_t = _tile(p.q, m * ROWS, ROWS), _tile(p.dout, m * ROWS, ROWS)
        rows = m * ROWS + np.arange(ROWS)
        neg_lse = p.neg_lse[rows][:, None]
        neg_delta = p.neg_delta[rows][:, None]
        acc = np.zeros((ROWS, d), np.float32)
        for n in range(n_min, max(n_max, n_min)):
            k_t, v_t = _tile(p.k, n * COLS, COLS), _tile(p.v, n * COLS, COLS)
            s = q_t @ k_t.T  # (query rows, key columns)
            t = np.tanh(s * p.tanh_in) if p.softcap else None  # kept for dS
            x = t.copy() if p.softcap else s
            i = np.arange(COLS)
            for r, row in enumerate(rows):  # softmax_p_rows: every block
                lo, hi = blocks.visible_cols(int(row), n)
                visible = i < hi
                if p.mask == "local":
                    visible &= i >= lo
                x[r] = np.where(visible, x[r], -np.inf)
            pr = np.exp2(x * p.scale_log2 + neg_lse)
            dp = do_t @ v_t.T
            ds = (dp + neg_delta) * pr
            if p.softcap:  # softmax_ds_rows: the kept tanh values
                ds = np.where(pr >= FLT_MIN_NORMAL, ds * (1.0 - t * t), 0.0)
            acc += _round(ds, dtype) @ k_t  # dQ += dS·K
        valid = rows < p.sq
        dq[rows[valid]] = (acc * p.scale)[valid]
    return dq


CASES = [  # (b, sq, sk, h, hkv, mask, window, softcap, scale)
    (1, 150, 200, 2, 2, "none", (None, None), 0.0, None),
    (1, 200, 130, 2, 1, "causal", (None, 0), 0.0, 0.2),
    (2, 130, 260, 2, 2, "causal", (None, 0), 3.0, None),
    (1, 190, 170, 4, 2, "local", (40, 17), 0.0, None),
    (1, 100, 300, 2, 1, "local", (150, 0), 2.0, 0.1),
    (1, 70, 40, 2, 2, "local", (5, 3), 0.0, None),  # rows that see no key (lse = −∞)
]


#: (case, head dim): the quick tier runs every case at 256 (dK/dV in two column halves) and one
#: at 192 (all columns in one part: the same blocks, masks and scales); --exhaustive all
SPLIT_CASES = per_class([(case, d) for d in (256, 192) for case in CASES],
                        key=lambda param: param if param[1] == 256 else param[1])


@pytest.mark.parametrize("case, d", SPLIT_CASES, ids=str)
def test_split_arithmetic_matches_the_reference(case, d):
    b, sq, sk, h, hkv, mask, window, softcap, scale = case
    dtype = ml_dtypes.bfloat16
    rng = np.random.default_rng(sq * 1000 + sk)
    q, k, v, dout = (_round(rng.standard_normal(shape), dtype) for shape in
                     ((b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, h, d)))
    scale = 1 / math.sqrt(d) if scale is None else scale
    # the float64 oracle's out, lse (B, H, Sq) and gradients (NumPy: no XLA program per shape)
    visible = np.broadcast_to(window_visible(sq, sk, window), (b, sq, sk))
    out, lse, want = oracle(q, k, v, visible, scale, softcap, dout=dout)
    out, lse = out.astype(np.float32), lse.astype(np.float32)
    delta = np.einsum("bshd,bshd->bhs", out, dout)
    # the preprocess: rows that saw no key get lse_log2 = +∞
    lse_log2 = np.where(np.isneginf(lse), np.inf, lse * LOG2_E)
    got = [np.zeros(x.shape, np.float32) for x in (q, k, v)]
    g = h // hkv
    for bi in range(b):
        for hi in range(h):
            hk = hi // g
            p = Problem(q[bi, :, hi], k[bi, :, hk], v[bi, :, hk], dout[bi, :, hi],
                        lse_log2[bi, hi], delta[bi, hi], scale, softcap, mask, window)
            got[0][bi, :, hi] = _round(emulate_dq(p, dtype), dtype)
            dk, dv = emulate_dkdv(p, dtype)  # GQA: per query head, summed over the group
            got[1][bi, :, hk] += dk
            got[2][bi, :, hk] += dv
    for name, x, w in zip("qkv", got, want):
        w = np.asarray(w, np.float32)
        assert np.isfinite(x).all(), name
        np.testing.assert_allclose(x, w, atol=2e-2 * np.abs(w).max(), rtol=0, err_msg=name)


@pytest.mark.parametrize("d", per_class([256, 192], key=lambda d: 0))  # quick tier: 256
def test_split_varlen_arithmetic_matches_the_reference(d):
    """Varlen: each sequence's CTAs read the packed tensors from its first row, so their tiles
    load the next sequences' rows (and the zeroed padding after the last); masks and the −∞
    statistics keep those rows out: the gradients equal each sequence's own reference's."""
    dtype = ml_dtypes.bfloat16
    h, scale, opts_mask = 2, 1 / math.sqrt(d), "causal"
    lens = [(70, 150), (130, 40), (1, 9), (90, 90)]
    pad = 128  # the backend zeroes these rows after the last sequence
    tq, tk = sum(q for q, _ in lens), sum(k for _, k in lens)
    rng = np.random.default_rng(7)
    q, dout = (_round(rng.standard_normal((tq + pad, h, d)), dtype) for _ in range(2))
    k, v = (_round(rng.standard_normal((tk + pad, h, d)), dtype) for _ in range(2))
    for x, t in ((q, tq), (dout, tq), (k, tk), (v, tk)):
        x[t:] = 0.0
    oq = ok = 0
    for len_q, len_k in lens:
        sl = [x[None, o:o + n] for x, o, n in ((q, oq, len_q), (k, ok, len_k), (v, ok, len_k),
                                                 (dout, oq, len_q))]
        out, lse, want = oracle(*sl[:3], window_visible(len_q, len_k, (None, 0))[None], scale,
                                dout=sl[3])
        out, lse = out.astype(np.float32), lse.astype(np.float32)
        delta = np.einsum("bshd,bshd->bhs", out, sl[3])
        lse_log2 = np.where(np.isneginf(lse), np.inf, lse * LOG2_E)
        for hi in range(h):
            p = Problem(q[oq:, hi], k[ok:, hi], v[ok:, hi], dout[oq:, hi], lse_log2[0, hi],
                        delta[0, hi], scale, 0.0, opts_mask, (None, 0), (len_q, len_k))
            got = (_round(emulate_dq(p, dtype), dtype), *emulate_dkdv(p, dtype))
            for name, x, w in zip("qkv", got, want):
                w = np.asarray(w, np.float32)[0, :, hi]
                np.testing.assert_allclose(x, w, atol=2e-2 * np.abs(w).max() + 1e-6, rtol=0,
                                           err_msg=f"{name} of sequence {(len_q, len_k)}")
        oq, ok = oq + len_q, ok + len_k
