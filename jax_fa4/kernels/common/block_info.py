"""Which key blocks an M tile visits, and which of them need a mask.

Conventions (FA4's, bottom-right aligned): query row i sees key column j when
    i + (seqlen_k − seqlen_q) − window_left  <=  j  <=  i + (seqlen_k − seqlen_q) + window_right
and j < seqlen_k. Causal is window (unbounded, 0). Windows reach this code already resolved to
non-negative Int32 (an unbounded side is clamped to a value that covers every key), so every
bound here is plain integer arithmetic on Int32 with floor division (the DSL's `//` on Int32 is
floor division, so negative bounds round the right way).

Key blocks are visited from the highest index down: the first visited block carries the
key-length tail mask, then the blocks that cut the causal/right-window diagonal, then the bulk
(no mask), then the blocks that cut the left-window edge.
"""

import cutlass
from cutlass import Int32


def _ceil_div(x, n: int):
    return (x + (n - 1)) // n


class BlockInfo:
    def __init__(self, tile_m: int, tile_n: int, is_causal: bool, is_local: bool,
                 seqlen_q: Int32, seqlen_k: Int32, window_left=None, window_right=None):
        self.tile_m, self.tile_n = tile_m, tile_n
        self.is_causal, self.is_local = is_causal, is_local
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self.window_left, self.window_right = window_left, window_right

    def _diag_offset(self):
        return self.seqlen_k - self.seqlen_q

    def n_block_range(self, m_block: Int32):
        """[n_block_min, n_block_max): the key blocks with at least one visible key for this tile.
        Empty (n_block_max <= n_block_min) when no row of the tile sees any key."""
        n_block_max = _ceil_div(self.seqlen_k, self.tile_n)
        if self.is_causal or self.is_local:
            # last visible column of the tile's last row, exclusive
            col_end = (m_block + 1) * self.tile_m + self._diag_offset()
            if self.is_local:
                col_end = col_end + self.window_right
            n_block_max = cutlass.min(n_block_max, _ceil_div(col_end, self.tile_n))
        n_block_min = 0
        if self.is_local:
            col_begin = m_block * self.tile_m + self._diag_offset() - self.window_left
            n_block_min = cutlass.max(col_begin // self.tile_n, 0)
        return n_block_min, n_block_max

    def n_block_min_right_mask(self, m_block: Int32, n_block_min: Int32):
        """Blocks n >= this (below the first visited one) cut the causal / right-window diagonal.
        Block n needs no right mask iff (n+1)·tile_n − 1 <= first row's last visible column."""
        last_col_row0 = m_block * self.tile_m + self._diag_offset()
        if self.is_local:
            last_col_row0 = last_col_row0 + self.window_right
        return cutlass.max(n_block_min, (last_col_row0 + 1) // self.tile_n)

    def n_block_max_left_mask(self, m_block: Int32, n_block_min: Int32):
        """Blocks n < this cut the left-window edge. Block n needs no left mask iff
        n·tile_n >= the last row's first visible column."""
        if not self.is_local:
            return n_block_min
        first_col_last_row = ((m_block + 1) * self.tile_m - 1 + self._diag_offset()
                              - self.window_left)
        return cutlass.max(n_block_min, _ceil_div(first_col_last_row, self.tile_n))
