"""Tile schedulers: which (m_block, head, batch) work tile a CTA computes.

v1: one tile per CTA (not persistent). Grid = (m_blocks, heads, batch). With ``longest_first``
(causal / local) the M order is reversed so the tiles with the most key blocks start first.
"""

import cutlass.cute as cute
from cutlass import Int32


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
