"""Tile schedulers: which (m_block, head, batch) work tiles a CTA computes.

``SingleTileScheduler`` (v1): one tile per CTA (not persistent). Grid = (m_blocks, heads, batch).
With ``longest_first`` (causal / local) the M order is reversed so the tiles with the most key
blocks start first. ``PersistentTileScheduler``: a fixed grid of SM-count CTAs loops over tiles
(statically; with ``FwdConfig.dynamic_tiles`` the sm90 forward assigns the same linear tiles
from a global counter instead, sm90/flash_fwd.py ``run_persistent``).
"""

import cutlass.cute as cute
from cutlass import Int32

#: K+V bytes (KB) of the (batch, head) pairs of one causal / local section of the persistent
#: order (H200 L2: 60 MB; an H100's: 50 MB)
L2_SECTION_KB = 48 * 1024


class SingleTileScheduler:
    def __init__(self, num_m_blocks: Int32, longest_first: bool):
        self.num_m_blocks = num_m_blocks
        self.longest_first = longest_first

    @staticmethod
    def grid_shape(num_m_blocks, num_heads, batch):
        return (num_m_blocks, num_heads, batch)

    def work_tile(self):
        bx, by, bz = cute.arch.block_idx()
        m_block = self.num_m_blocks - 1 - bx if self.longest_first else bx
        return m_block, by, bz


class PersistentTileScheduler:
    """A fixed grid of ``num_ctas`` CTAs (the SM count, given as configuration, never queried)
    walks the work tiles: CTA c computes tiles c, c + grid, c + 2·grid, ...

    Tile order (the linear index t): the (batch, head) pairs are cut into sections of
    ``section`` consecutive pairs (:meth:`section_pairs`); sections run one after the other;
    within a section the M blocks run from the heaviest (highest, with ``longest_first``:
    causal / local) down, and for each M block every pair of the section. Unmasked tiles all
    cost the same, so a section is one kv head's query heads: their tiles run together (as the
    one-tile grid launches a pair's), and the CTAs in flight read the K/V of a few kv heads,
    each block by many CTAs at once (L2 reuse). Under a causal or local mask a section spans
    enough pairs for two waves of CTAs, so the long tiles of each section start first (less
    tail) while the section's K/V still fits in L2.

    Stateless on purpose (static methods on plain Int32 values): the kernel's run-time loops
    carry only DSL values. The methods also take Python ints (``tests/test_tile_scheduler.py``
    checks the order on them).
    """

    @staticmethod
    def grid_shape(num_ctas: int, num_m_blocks, num_heads, batch):
        import cutlass

        return (cutlass.min(num_m_blocks * num_heads * batch, Int32(num_ctas)), 1, 1)

    @staticmethod
    def first_and_stride():
        bx, _, _ = cute.arch.block_idx()
        gx, _, _ = cute.arch.grid_dim()
        return Int32(bx), Int32(gx)

    @staticmethod
    def num_tiles(num_m_blocks, num_heads, batch):
        return num_m_blocks * num_heads * batch

    @staticmethod
    def section_pairs(num_m_blocks, group, kv_kb, grid, longest_first: bool):
        """(batch, head) pairs per section: ``group`` (the query heads of one kv head) for
        unmasked tiles; with ``longest_first``, the fewest whole groups whose tiles fill two
        waves of the ``grid`` CTAs, at most as many as keep the section's K+V (``kv_kb`` KB per
        kv head) within ``L2_SECTION_KB``."""
        import cutlass

        sec = group
        if longest_first:
            groups = cutlass.max((2 * grid + num_m_blocks * group - 1) // (num_m_blocks * group), 1)
            sec = cutlass.min(groups, cutlass.max(L2_SECTION_KB // kv_kb, 1)) * group
        return sec

    @staticmethod
    def tile(t, num_m_blocks, num_heads, batch, heads_per_section, longest_first: bool):
        """(m_block, head, batch) of linear tile t (0 <= t < num_tiles)."""
        import cutlass

        num_pairs = num_heads * batch
        sec = cutlass.min(heads_per_section, num_pairs)
        tiles_per_section = sec * num_m_blocks
        section = t // tiles_per_section
        r = t - section * tiles_per_section
        sec_start = section * sec
        sec_len = cutlass.min(sec, num_pairs - sec_start)
        m_idx = r // sec_len
        pair = sec_start + (r - m_idx * sec_len)
        m_block = num_m_blocks - 1 - m_idx if longest_first else m_idx
        b = pair // num_heads
        return m_block, pair - b * num_heads, b
