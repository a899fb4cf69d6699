"""CPU-only checks of the arithmetic the sm100 forward kernel relies on (no compiler, no GPU).

* the software exp2 (``jax_fa4/kernels/common/exp2.py``) through its numpy twin, which performs the
  device function's float32 operations one for one (correctly rounded FMAs, round-down add);
* conditional softmax rescaling (FA4's threshold rule) against plain online softmax;
* the persistent tile order (``jax_fa4/kernels/sm100/tile_order.py``, the same arithmetic the
  kernel runs on Int32).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from jax_fa4.kernels.common.exp2 import (CLAMP_LO, POLY_COEFFS, exp2_sw_numpy, fma_f32)
from jax_fa4.kernels.sm100 import tile_order
from jax_fa4.kernels.sm100.fwd_config import RESCALE_THRESHOLD

# Bound on the software exp2's relative error for normal results (x >= -126).
# The degree-3 minimax polynomial for 2^f on [0,1) has a relative error of about 8.8e-5 ≈ 2^-13.5;
# float32 rounding in the three FMAs adds a few 2^-24. P is then rounded to bf16 (relative
# rounding error up to 2^-9 ≈ 2.0e-3) or fp16 (2^-11 ≈ 4.9e-4) before the P·V MMA, so the
# polynomial contributes at most 1/22 (bf16) resp. 1/5 (fp16) of the rounding error every kernel
# (and the low-precision reference of FA4's test rule, which allows 2× its error) already has.
# 2^-13 leaves a little margin over the measured figure while staying far inside that rule.
EXP2_REL_BOUND = 2.0 ** -13


def _f32(x):
    return np.asarray(x, np.float32)


# ---------------------------------------------------------------------------------------------
# software exp2
# ---------------------------------------------------------------------------------------------
def test_fma_f32_is_correctly_rounded():
    """The twin's FMA against exact rational arithmetic on random and tie-prone inputs."""
    from fractions import Fraction

    rng = np.random.default_rng(0)
    a = _f32(rng.uniform(-2, 2, 2000))
    b = _f32(rng.uniform(-2, 2, 2000))
    c = _f32(rng.uniform(-2, 2, 2000))
    # tie-prone: a·b with 25+ significant bits against c of a very different magnitude
    a[:500] = _f32(1 + 2.0 ** -12 * rng.integers(0, 4096, 500))
    b[:500] = _f32(1 + 2.0 ** -12 * rng.integers(0, 4096, 500))
    c[:500] = _f32(2.0 ** -30 * rng.choice([-1, 1], 500))
    got = fma_f32(a, b, c)
    for i in range(len(a)):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        want = np.float32(float(exact))  # float(Fraction) rounds correctly to f64 ...
        # ... and f64 -> f32 can double-round only at an f32 midpoint: compare to both neighbours
        cands = [want, np.nextafter(want, np.float32(-np.inf)),
                 np.nextafter(want, np.float32(np.inf))]
        best = min(cands, key=lambda v: (abs(Fraction(float(v)) - exact),
                                         int(np.asarray(v, np.float32).view(np.int32)) & 1))
        assert got[i] == best, (a[i], b[i], c[i], got[i], best)


def test_exp2_relative_error_over_softmax_range():
    """x in [-126, 10]: every input softmax feeds (x <= 0 with the true max, x <= 8 with a stale
    max kept by the conditional rescale) and a little beyond."""
    x = np.concatenate([
        np.linspace(-126.0, 10.0, 4_000_001, dtype=np.float64).astype(np.float32),
        # dense around integers (the range-reduction boundaries) and near 0
        (np.arange(-126, 11)[:, None] + np.array([-1e-6, -2e-7, 0.0, 2e-7, 1e-6])).ravel()
        .astype(np.float32),
        _f32(np.random.default_rng(1).uniform(-126, 10, 1_000_000)),
    ])
    x = x[x >= -126.0]
    got = exp2_sw_numpy(x).astype(np.float64)
    ref = np.exp2(x.astype(np.float64))
    rel = np.abs(got / ref - 1.0)
    worst = float(rel.max())
    print(f"\nsoftware exp2 (degree {len(POLY_COEFFS) - 1}): max relative error {worst:.3e} "
          f"= 2^{math.log2(worst):.2f} at x = {x[rel.argmax()]:.7g}, over {x.size} inputs")
    assert worst < EXP2_REL_BOUND
    assert np.all(np.isfinite(got)) and np.all(got > 0)


def test_exp2_exact_points():
    """Integers (f = 0) are exact: p(0) = 1 and the exponent add is exact."""
    j = np.arange(-126, 11)
    np.testing.assert_array_equal(exp2_sw_numpy(_f32(j)), _f32(np.exp2(j.astype(np.float64))))


def test_exp2_very_negative_inputs():
    """x <= -127, -inf and NaN give exactly +0.0 (masked scores must contribute exactly 0: a fully
    masked row keeps a row sum of exactly 0); (-127, -126) gives tiny non-negative values, no NaN,
    no negative numbers, no wrapped exponents."""
    special = _f32([-np.inf, -1e30, -1000.0, -200.0, -128.0, -127.5, -127.0, np.nan])
    got = exp2_sw_numpy(special)
    assert np.all(got == 0.0) and not np.any(np.signbit(got))
    x = _f32(np.linspace(-127.0, -126.0, 10001))
    got = exp2_sw_numpy(x)
    assert np.all(np.isfinite(got)) and np.all(got >= 0.0) and np.all(got < 2.0 ** -126 * 1.0001)
    assert np.all(np.abs(got.astype(np.float64) - np.exp2(x.astype(np.float64))) < 2.0 ** -126)
    # monotone over the whole clamped range (no exponent wrap at the boundaries)
    x = _f32(np.linspace(-140.0, 10.0, 300001))
    assert np.all(np.diff(exp2_sw_numpy(x).astype(np.float64)) >= 0)
    assert CLAMP_LO == -127.0


def test_exp2_matches_rounded_polynomial_structure():
    """The twin is the documented arithmetic: j + f reconstructs x, p(f) in [1, 2)."""
    x = _f32(np.random.default_rng(2).uniform(-126, 10, 100000))
    f = x - np.floor(x)
    p = exp2_sw_numpy(f.astype(np.float32))
    assert np.all((p >= 1.0) & (p < 2.0))
    np.testing.assert_array_equal(exp2_sw_numpy(x),
                                  np.ldexp(exp2_sw_numpy(f), np.floor(x).astype(int)))


def test_exp2_tiny_negative_inputs_have_floor_minus_one():
    """Regression: for -2^-30 <= x < 0 (tiny negative normals and negative subnormals) the device's
    add.rm.f32(x, 2^23 + 2^22) is 2^23 + 2^22 - 1 (floor -1; no flush-to-zero in either form), so
    f = x + 1 rounds to 1 and the result is p(1)/2 ≈ 0.99991. An earlier twin emulated add.rm by
    a float64 sum rounded down, which rounds these x to 2^23 + 2^22 first and gave 1.0."""
    c0, c1, c2, c3 = (np.float32(c) for c in POLY_COEFFS)
    one = np.float32(1.0)
    p1_half = fma_f32(fma_f32(fma_f32(c3, one, c2), one, c1), one, c0) / np.float32(2.0)
    assert abs(float(p1_half) - 0.99991) < 1e-5
    x = np.concatenate([
        _f32([-(2.0 ** -30), -(2.0 ** -40), -1e-20, -(2.0 ** -126)]),
        -np.uint32([0x007FFFFF, 1]).view(np.float32),  # largest negative subnormal, -2^-149
    ])
    assert x[-1] == _f32(-(2.0 ** -149)) and np.all(x < 0)
    got = exp2_sw_numpy(x)
    np.testing.assert_array_equal(got.view(np.uint32), np.full(x.shape, p1_half).view(np.uint32))
    # +0.0 (and -0.0) have floor 0: p(0) = 1 exactly
    zeros = exp2_sw_numpy(_f32([0.0, -0.0]))
    np.testing.assert_array_equal(zeros.view(np.uint32), _f32([1.0, 1.0]).view(np.uint32))


# ---------------------------------------------------------------------------------------------
# conditional rescaling
# ---------------------------------------------------------------------------------------------
def online_softmax(score_blocks, v_blocks, scale_log2, threshold, exp2=np.exp2):
    """The kernel's per-row update in float32, one key block at a time.

    threshold = None: plain online softmax (rescale whenever the max grows).
    Otherwise FA4's rule: the applied max m only moves when the block max exceeds it by more than
    ``threshold`` in log2 units; P = exp2(s·c − m·c) then stays below 2^threshold, and the row sum
    and O use the same m, so the final O/Σ is unchanged. Returns (O/Σ, lse, max P, #rescales).
    """
    rows = score_blocks[0].shape[0]
    c = np.float32(scale_log2)
    m = np.full(rows, -np.inf, np.float32)  # the max actually applied
    row_sum = np.zeros(rows, np.float32)
    acc = np.zeros((rows, v_blocks[0].shape[1]), np.float32)
    p_max, rescales = np.float32(0), 0
    with np.errstate(invalid="ignore"):
        for s, v in zip(score_blocks, v_blocks):
            s = _f32(s)
            m_new = np.maximum(m, s.max(axis=1))
            grow = m_new * c - m * c  # +inf from -inf, NaN when both -inf (-> no rescale)
            need = grow > (0.0 if threshold is None else threshold)
            if threshold is None:
                need = need | (m_new > m)
            m_applied = np.where(need, m_new, m)
            acc_scale = np.where(need, np.exp2(m * c - m_applied * c),
                                 np.float32(1)).astype(np.float32)
            rescales += int(np.count_nonzero(need & np.isfinite(m)))
            m = m_applied
            m_safe = np.where(np.isneginf(m), np.float32(0), m)
            x = fma_f32(s, np.broadcast_to(c, s.shape), (-m_safe * c)[:, None])
            p = exp2(x).astype(np.float32)
            p_max = max(p_max, p.max())
            row_sum = row_sum * acc_scale + p.sum(axis=1, dtype=np.float32)
            acc = acc * acc_scale[:, None] + p @ _f32(v)
    empty = row_sum == 0
    out = np.where(empty[:, None], 0.0, acc / np.where(empty, 1, row_sum)[:, None])
    lse = np.where(empty, -np.inf, (m * c + np.log2(np.where(empty, 1, row_sum))) * math.log(2))
    return out.astype(np.float32), lse.astype(np.float32), p_max, rescales


def _blocks_with_jumps(rng, rows=64, n=128, blocks=8, jumps=(0.0, 3.0, 7.9, 8.1, 12.0, 40.0)):
    """Score blocks whose running max jumps, per row, by amounts below and above the threshold
    (in log2 units: the jump in raw score is jump / scale_log2)."""
    scale_log2 = 0.125 * math.log2(math.e)
    out = []
    base = np.zeros(rows)
    for b in range(blocks):
        s = rng.normal(0, 1.0, (rows, n))
        jump = np.array(jumps)[rng.integers(0, len(jumps), rows)] / scale_log2
        base = base + (jump if b else 0.0)
        s[np.arange(rows), rng.integers(0, n, rows)] = base + 2.0  # the block max
        out.append(_f32(s + base[:, None] - 3.0))
    return out, scale_log2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_conditional_rescale_equals_online_softmax(seed):
    rng = np.random.default_rng(seed)
    s_blocks, scale_log2 = _blocks_with_jumps(rng)
    v_blocks = [_f32(rng.normal(0, 1, (128, 64))) for _ in s_blocks]
    o_ref, lse_ref, _, n_plain = online_softmax(s_blocks, v_blocks, scale_log2, None)
    o_cond, lse_cond, p_max, n_cond = online_softmax(s_blocks, v_blocks, scale_log2,
                                                     RESCALE_THRESHOLD)
    # float32-rounding-level agreement (relative to the output's scale)
    np.testing.assert_allclose(o_cond, o_ref, rtol=0, atol=2e-6 * np.abs(o_ref).max())
    np.testing.assert_allclose(lse_cond, lse_ref, rtol=2e-6, atol=2e-6)
    # and both agree with exact softmax in float64
    s_all = np.concatenate(s_blocks, axis=1).astype(np.float64) * scale_log2 * math.log(2)
    w = np.exp(s_all - s_all.max(axis=1, keepdims=True))
    o_exact = (w / w.sum(axis=1, keepdims=True)) @ np.concatenate(v_blocks).astype(np.float64)
    np.testing.assert_allclose(o_cond, o_exact, atol=1e-5 * np.abs(o_exact).max())
    # P never exceeds 2^threshold (bf16/fp16-safe) and most rescales are skipped
    assert p_max <= 2.0 ** RESCALE_THRESHOLD
    assert n_cond < n_plain
    print(f"\nrescales: plain {n_plain}, conditional {n_cond}; max P = {p_max:.1f}")


def test_conditional_rescale_masked_rows_and_software_exp2():
    """Rows masked in some blocks or entirely (-inf scores): out 0 and lse -inf for empty rows,
    never NaN; the same with the software exp2 on every element."""
    rng = np.random.default_rng(5)
    s_blocks, scale_log2 = _blocks_with_jumps(rng, rows=8, blocks=4)
    s_blocks = [s.copy() for s in s_blocks]
    s_blocks[0][0] = -np.inf  # row 0: first block masked
    for s in s_blocks:
        s[1] = -np.inf  # row 1: nothing visible
    s_blocks[3][2, 64:] = -np.inf  # row 2: tail masked
    v_blocks = [_f32(rng.normal(0, 1, (128, 16))) for _ in s_blocks]
    o_ref, lse_ref, _, _ = online_softmax(s_blocks, v_blocks, scale_log2, None)
    for exp2 in (np.exp2, exp2_sw_numpy):
        o, lse, _, _ = online_softmax(s_blocks, v_blocks, scale_log2, RESCALE_THRESHOLD, exp2)
        assert not np.any(np.isnan(o)) and not np.any(np.isnan(lse))
        assert np.all(o[1] == 0) and lse[1] == -np.inf
        live = np.arange(8) != 1
        np.testing.assert_allclose(o[live], o_ref[live], atol=2e-4 * np.abs(o_ref).max())
        np.testing.assert_allclose(lse[live], lse_ref[live], rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# persistent tile order
# ---------------------------------------------------------------------------------------------
COMBOS = [(1, 1, 1, 148), (3, 2, 2, 4), (7, 5, 3, 148), (16, 4, 2, 132), (33, 3, 1, 7),
          (2, 64, 8, 148), (128, 1, 1, 148)]


@pytest.mark.parametrize("heavy_first", [False, True])
@pytest.mark.parametrize("m_blocks,heads,batch,num_sms", COMBOS)
def test_tile_order_covers_each_tile_once(m_blocks, heads, batch, num_sms, heavy_first):
    total = tile_order.num_tiles(m_blocks, heads, batch)
    grid = tile_order.grid_size(total, num_sms)
    assert 1 <= grid <= num_sms
    seen = []
    for cta in range(grid):
        for idx in tile_order.cta_work(cta, grid, total):
            m, h, b = tile_order.tile_coords(idx, m_blocks, heads, batch, heavy_first)
            assert 0 <= m < m_blocks and 0 <= h < heads and 0 <= b < batch
            seen.append((m, h, b))
    assert len(seen) == total == len(set(seen))


@pytest.mark.parametrize("m_blocks,heads,batch,num_sms", COMBOS)
def test_tile_order_heavy_first(m_blocks, heads, batch, num_sms):
    """Causal: work grows with m_block. Linear order is non-increasing in m_block, so each wave
    takes the heaviest tiles left and each CTA's sequence is non-increasing."""
    total = tile_order.num_tiles(m_blocks, heads, batch)
    ms = [tile_order.tile_coords(i, m_blocks, heads, batch, True)[0] for i in range(total)]
    assert all(a >= b for a, b in zip(ms, ms[1:]))
    assert ms[0] == m_blocks - 1
    grid = tile_order.grid_size(total, num_sms)
    for cta in range(grid):
        mine = [ms[i] for i in tile_order.cta_work(cta, grid, total)]
        assert all(a >= b for a, b in zip(mine, mine[1:]))
