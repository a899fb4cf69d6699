"""The FP8 forward's V transpose (jax_fa4/kernels/sm90/v_transpose_plan.py) on the CPU, in NumPy:
the plan's lane addresses run through models of ``ldmatrix.x4.trans``, ``prmt`` and
``stmatrix.x4`` over both swizzled shared-memory layouts, for every (tile_n, Dv) an FP8 config
ships and a few more. Checked: every staged byte is read and every Vt byte written exactly once;
Vt's column l of each group of 32 keys holds key fwd_config.fp8_value_permutation()[l]; every
8-row phase of every warp instruction touches 8 distinct 16-byte bank groups (no bank
conflict); the kernel's split of each address into (lane base ^ X) + C holds; the varlen /
paged byte masks clear exactly the keys past the valid ones. Nothing compiles.
"""

from __future__ import annotations

import numpy as np
import pytest

from jax_fa4.kernels.sm90 import fwd_config
from jax_fa4.kernels.sm90.fwd_tuning import FP8_TUNING_TABLE
from jax_fa4.kernels.sm90.v_transpose_plan import (LANES, TRANSPOSE_WARPS, VTransposePlan,
                                                   smem_offset, swizzle_width)


def _shipped_tiles() -> set[tuple[int, int]]:
    """(tile_n, head_dim_v) of every shipped FP8 forward config."""
    return {(c.tile_n, c.head_dim_v) for c in fwd_config.shipped_configs() if c.fp8}


TILES = sorted(_shipped_tiles() | {(32, 64), (64, 64), (192, 128), (256, 256), (96, 256)})


def test_the_shipped_tiles_are_covered():
    """Every FP8 table row's tile (and the softcap key block) is among the checked ones."""
    want = {(t.tile_n, dv) for (_, dv), row in FP8_TUNING_TABLE.items() for t in row.values()}
    want |= {(n, dv) for (_, dv), n in fwd_config.FP8_SOFTCAP_TILE_N.items()}
    assert want <= _shipped_tiles() <= set(TILES)
    assert {(160, 64), (128, 64), (96, 128), (128, 128), (128, 256)} <= set(TILES)


def test_smem_offset_is_the_swizzled_layout():
    """The model's formula on a few hand-worked bytes (values read off CuTe's layouts: S<3,4,3>
    for 128-byte rows, S<1,4,3> for 32-byte atoms, S<2,4,3> for 64-byte rows)."""
    assert smem_offset(96, 128, 9, 37) + 12288 == 13493  # stage 1 of (96, 128)
    assert smem_offset(128, 96, 5, 70) == 8374
    assert [swizzle_width(c) for c in (64, 96, 128, 160, 256)] == [64, 32, 128, 32, 128]
    for rows, cols in ((160, 64), (128, 96), (128, 256)):  # a bijection onto the stage
        offsets = {smem_offset(rows, cols, r, c) for r in range(rows) for c in range(cols)}
        assert offsets == set(range(rows * cols))


def _bank_groups_distinct(rows: list[int]) -> bool:
    """One 8-row phase of an ldmatrix / stmatrix: 16-byte rows in 8 distinct 16-byte bank
    groups (addresses 16-byte aligned)."""
    assert all(r % 16 == 0 for r in rows)
    return len({(r // 16) % 8 for r in rows}) == 8


def _ldmatrix_x4_trans(memory: np.ndarray, rows: list[int]) -> list[list[list[int]]]:
    """Registers [lane][matrix] (4 bytes each, low byte first) of ldmatrix.x4.trans.b16 with
    lane L addressing row L % 8 of matrix L // 8: lane t = 4r + c gets, per matrix, the 16-bit
    elements (row 2c, column r) and (row 2c + 1, column r)."""
    out = []
    for t in range(LANES):
        r, c = t // 4, t % 4
        regs = []
        for m in range(4):
            lo, hi = rows[8 * m + 2 * c], rows[8 * m + 2 * c + 1]
            regs.append([memory[lo + 2 * r], memory[lo + 2 * r + 1],
                         memory[hi + 2 * r], memory[hi + 2 * r + 1]])
        out.append(regs)
    return out


def _prmt(a: list[int], b: list[int], selector: int) -> list[int]:
    both = a + b
    return [both[(selector >> (4 * i)) & 7] for i in range(4)]


def _stmatrix_x4(memory: np.ndarray, rows: list[int], regs: list[list[list[int]]]) -> None:
    """stmatrix.x4.b16: row ρ of matrix j (at lane 8j + ρ's address) takes register j of lanes
    4ρ .. 4ρ + 3, in that order."""
    for j in range(4):
        for rho in range(8):
            for c in range(4):
                memory[rows[8 * j + rho] + 4 * c: rows[8 * j + rho] + 4 * c + 4] = \
                    regs[4 * rho + c][j]


@pytest.mark.parametrize("tile_n, dv", TILES)
def test_plan_transposes_permutes_and_has_no_bank_conflict(tile_n, dv):
    plan = VTransposePlan(tile_n, dv)
    size = tile_n * dv
    # staged[offset of (key, dim)] = the source index key·Dv + dim (int32 "bytes")
    staged = np.full(size, -1, np.int64)
    for key in range(tile_n):
        for dim in range(dv):
            staged[smem_offset(tile_n, dv, key, dim)] = key * dv + dim
    vt = np.full(size, -1, np.int64)
    read_count, write_count = np.zeros(size, int), np.zeros(size, int)
    for warp in range(TRANSPOSE_WARPS):
        for c in range(plan.chunks):
            for o in range(plan.half_pairs):
                reads = [plan.read_offset(warp, c, o, lane) for lane in range(LANES)]
                writes = [plan.write_offset(warp, c, o, lane) for lane in range(LANES)]
                for m in range(4):
                    assert _bank_groups_distinct(reads[8 * m: 8 * m + 8]), (warp, c, o, m)
                    assert _bank_groups_distinct(writes[8 * m: 8 * m + 8]), (warp, c, o, m)
                for r in reads:
                    read_count[r: r + 16] += 1
                for w in writes:
                    write_count[w: w + 16] += 1
                loaded = _ldmatrix_x4_trans(staged, reads)
                words = []
                for lane in range(LANES):
                    first, second = plan.selectors(lane)
                    r = loaded[lane]
                    words.append([_prmt(r[0], r[1], first), _prmt(r[0], r[1], second),
                                  _prmt(r[2], r[3], first), _prmt(r[2], r[3], second)])
                _stmatrix_x4(vt, writes, words)
                # the kernel's address arithmetic: (lane base ^ X) + C
                x_read, c_read = plan.read_step(c, o)
                x_write, c_write = plan.write_step(c, o)
                for lane in range(LANES):
                    assert reads[lane] == (plan.read_base(warp, lane) ^ x_read) + c_read
                    assert writes[lane] == (plan.write_base(warp, lane) ^ x_write) + c_write
                assert x_read == plan.read_step(c, 0)[0]
    assert (read_count == 1).all() and (write_count == 1).all()
    perm = fwd_config.fp8_value_permutation()
    group = fwd_config.FP8_KEY_GROUP
    for dim in range(dv):
        for col in range(tile_n):
            key = group * (col // group) + perm[col % group]
            assert vt[smem_offset(dv, tile_n, dim, col)] == key * dv + dim, (dim, col)


def test_write_xors_vanish_on_32_byte_atoms():
    """Where a Vt row's swizzle atom is 32 bytes (tile_n 96, 160), no stmatrix address needs
    an XOR: the key-half pairs step whole atoms."""
    for tile_n in (96, 160):
        plan = VTransposePlan(tile_n, 128)
        assert all(plan.write_step(c, o)[0] == 0 for c in range(plan.chunks)
                   for o in range(plan.half_pairs))


def test_plan_refuses_what_it_cannot_split():
    with pytest.raises(ValueError, match="tile_n a multiple of 32 and head_dim_v of 64"):
        VTransposePlan(128, 96)
    with pytest.raises(ValueError, match="tile_n a multiple of 32"):
        VTransposePlan(80, 128)


@pytest.mark.parametrize("tile_n, dv", [(128, 64), (128, 128), (96, 128), (128, 256)])
def test_key_masks_clear_exactly_the_keys_past_the_valid_ones(tile_n, dv):
    """The varlen / paged transpose of the highest key block (v_transpose.VTransposer.stage's
    keys_left): each lane ANDs its words with VTransposePlan.key_mask before stmatrix; in the
    model every Vt column of a key >= valid is zero and every other holds its key (NaN in the
    staged rows past the keys cannot reach the operand), for every valid in [0, tile_n]."""
    plan = VTransposePlan(tile_n, dv)
    perm = fwd_config.fp8_value_permutation()
    group = fwd_config.FP8_KEY_GROUP
    staged = np.full(tile_n * dv, -1, np.int64)
    for key in range(tile_n):
        for dim in range(dv):
            staged[smem_offset(tile_n, dv, key, dim)] = 1 + key * dv + dim  # 0: cleared
    for valid in sorted({0, 1, 2, 7, 8, 9, 10, 17, 31, 32, 33, tile_n - 1, tile_n}):
        vt = np.full(tile_n * dv, -1, np.int64)
        for warp in range(TRANSPOSE_WARPS):
            for c in range(plan.chunks):
                for o in range(plan.half_pairs):
                    reads = [plan.read_offset(warp, c, o, lane) for lane in range(LANES)]
                    writes = [plan.write_offset(warp, c, o, lane) for lane in range(LANES)]
                    loaded = _ldmatrix_x4_trans(staged, reads)
                    words = []
                    for lane in range(LANES):
                        first, second = plan.selectors(lane)
                        r = loaded[lane]
                        masks = [plan.key_mask(lane, o, p, valid) for p in (0, 1)]
                        lane_words = [_prmt(r[0], r[1], first), _prmt(r[0], r[1], second),
                                      _prmt(r[2], r[3], first), _prmt(r[2], r[3], second)]
                        words.append([[b if (masks[i // 2] >> (8 * j)) & 0xFF else 0
                                       for j, b in enumerate(w)]
                                      for i, w in enumerate(lane_words)])
                    _stmatrix_x4(vt, writes, words)
        for dim in range(dv):
            for col in range(tile_n):
                key = group * (col // group) + perm[col % group]
                want = 1 + key * dv + dim if key < valid else 0
                assert vt[smem_offset(dv, tile_n, dim, col)] == want, (valid, dim, col)


def test_key_mask_thresholds():
    """Byte j of a pair's words is key first + 2·(lane % 4) + (0, 1, 8, 9)[j]."""
    plan = VTransposePlan(128, 64)
    assert plan.mask_thresholds(1, 1) == (48, 49, 56, 57)
    assert plan.key_mask(lane=6, o=0, pair=0, valid=4) == 0  # keys 4, 5, 12, 13
    assert plan.key_mask(lane=6, o=0, pair=0, valid=5) == 0x00FF
    assert plan.key_mask(lane=6, o=0, pair=0, valid=6) == 0xFFFF
    assert plan.key_mask(lane=6, o=0, pair=0, valid=13) == 0xFFFFFF
    assert plan.key_mask(lane=1, o=1, pair=0, valid=128) == 0xFFFFFFFF
