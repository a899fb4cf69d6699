"""The persistent forward's tile order (``common/tile_scheduler.PersistentTileScheduler``), on
Python ints: every tile exactly once, unmasked tiles pair by pair, causal / local sections
longest first, two waves long and within the L2 budget."""

from __future__ import annotations

import itertools

import pytest

from jax_fa4.kernels.common.tile_scheduler import L2_SECTION_KB, PersistentTileScheduler as P

GRID = 132


def order(m_blocks, heads, batch, group, seqlen_k, head_dim, longest_first, grid=GRID):
    kv_kb = max(seqlen_k * 2 * head_dim // 512, 1)
    sec = P.section_pairs(m_blocks, group, kv_kb, grid, longest_first)
    n = P.num_tiles(m_blocks, heads, batch)
    return sec, [P.tile(t, m_blocks, heads, batch, sec, longest_first) for t in range(n)]


# (m_blocks, heads, batch, group, seqlen_k, head_dim): 2k and 8k rows at 128-row tiles, GQA,
# one tile, more pairs than tiles, a section cut by the L2 budget (128k keys)
SHAPES = [(16, 16, 8, 1, 2048, 128), (64, 16, 2, 4, 8192, 128), (11, 8, 16, 2, 2048, 64),
          (1, 1, 1, 1, 100, 64), (3, 32, 5, 8, 300, 128), (1024, 8, 1, 1, 131072, 128),
          (7, 6, 3, 3, 900, 256)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("longest_first", [False, True])
def test_every_tile_once(shape, longest_first):
    m_blocks, heads, batch = shape[:3]
    _, tiles = order(*shape, longest_first)
    assert sorted(tiles) == sorted(itertools.product(range(m_blocks), range(heads), range(batch)))


@pytest.mark.parametrize("shape", SHAPES)
def test_unmasked_pair_by_pair(shape):
    """Unmasked: the tiles of one kv head's query heads run together (each M block for every
    head of the group), as the one-tile grid launches them: the CTAs in flight share few K/V."""
    m_blocks, heads, batch, group = shape[:4]
    _, tiles = order(*shape, longest_first=False)
    kv = [(b, h // group) for _, h, b in tiles]
    assert kv == sorted(kv)  # each kv head's tiles contiguous, in (batch, kv head) order
    for start in range(0, len(tiles), m_blocks * group):
        ms = [m for m, _, _ in tiles[start:start + m_blocks * group]]
        assert ms == sorted(ms)


@pytest.mark.parametrize("shape", SHAPES)
def test_causal_sections(shape):
    """Causal / local: each section runs its M blocks from the highest down, holds whole GQA
    groups, fills two waves of CTAs unless its K/V would pass the L2 budget, and no more."""
    m_blocks, heads, batch, group, seqlen_k, head_dim = shape
    sec, tiles = order(*shape, longest_first=True)
    kv_kb = max(seqlen_k * 2 * head_dim // 512, 1)
    assert sec % group == 0
    assert sec // group * kv_kb <= max(L2_SECTION_KB, kv_kb)
    if sec // group * kv_kb + kv_kb <= L2_SECTION_KB:
        assert sec * m_blocks >= 2 * GRID or sec >= heads * batch
    assert sec == group or (sec - group) * m_blocks < 2 * GRID  # the fewest groups that do
    per_section = sec * m_blocks
    for start in range(0, len(tiles), per_section):
        ms = [m for m, _, _ in tiles[start:start + per_section]]
        assert ms == sorted(ms, reverse=True)
