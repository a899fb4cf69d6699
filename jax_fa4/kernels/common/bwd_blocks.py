"""Block arithmetic of the backward kernels (sm90 and sm100): one implementation for the kernels
and the CPU tests.

Conventions (FA4's, bottom-right aligned): query row i sees key j iff j < seqlen_k and
    i + off − window_left  <=  j  <=  i + off + window_right,      off = seqlen_k − seqlen_q
(causal: window_right = 0, no left bound). Windows arrive clamped to [0, seqlen_k] (left) and
[0, seqlen_q] (right), so an unbounded side covers every key / query. The sm100 kernel's tile
is transposed (one key per TMEM lane, query rows along the columns) and masks by each key's
visible query rows (``visible_rows``); the sm90 kernel masks by each row's visible key columns
(``visible_cols``).

Every function uses only ``+ - * //`` and :func:`_min` / :func:`_max`, so it runs on Python ints
(tests) and on CuTe-DSL Int32 (kernel). Every ``//`` has a non-negative dividend, so truncating
and floor division agree.
"""

from __future__ import annotations


def _max(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a if a >= b else b
    import cutlass

    return cutlass.max(a, b)


def _min(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a if a <= b else b
    import cutlass

    return cutlass.min(a, b)


class BwdBlocks:
    def __init__(self, tile_m: int, tile_n: int, is_causal: bool, is_local: bool,
                 seqlen_q, seqlen_k, window_left, window_right):
        self.tile_m, self.tile_n = tile_m, tile_n
        self.is_causal, self.is_local = is_causal, is_local
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self.window_left, self.window_right = window_left, window_right
        self.off = seqlen_k - seqlen_q

    def num_m_blocks(self):
        return (self.seqlen_q + self.tile_m - 1) // self.tile_m

    def m_block_range(self, n_block):
        """[m_min, m_max): query blocks with a row that sees a key of block n_block (empty when
        m_max <= m_min)."""
        tm = self.tile_m
        m_max = self.num_m_blocks()
        m_min = n_block * 0
        if self.is_causal or self.is_local:
            first_row = n_block * self.tile_n - self.off - self.window_right
            m_min = _max(first_row, 0) // tm
        if self.is_local:
            last_row = (n_block + 1) * self.tile_n - 1 + self.window_left - self.off
            m_max = _min(m_max, _max(last_row + tm, 0) // tm)
        return m_min, m_max

    def dq_rank(self, m_block, n_block):
        """Deterministic order of the dQ reduce-adds into query block m_block: the number of key
        blocks below n_block that visit m_block (the visiting key blocks are contiguous)."""
        n_first = m_block * 0
        if self.is_local:
            n_first = _max(m_block * self.tile_m + self.off - self.window_left, 0) // self.tile_n
        return n_block - n_first

    def kv_tail(self, n_block):
        """Key block n_block holds keys past seqlen_k (only the last one can)."""
        return (n_block + 1) * self.tile_n > self.seqlen_k

    def mask_reasons(self, m_block, n_block):
        """(key tail, cuts the right diagonal, cuts the left window edge) of block (m_block,
        n_block): the block needs a mask iff any is true (the kernel ORs them in jit code; each
        is False when its mask kind is off). Conservative: extra masking is harmless."""
        tm, tn = self.tile_m, self.tile_n
        tail = self.kv_tail(n_block)
        right = tail if not (self.is_causal or self.is_local) else (
            (n_block + 1) * tn - 1 > m_block * tm + self.off + self.window_right)
        left = tail if not self.is_local else (
            n_block * tn < (m_block + 1) * tm - 1 + self.off - self.window_left)
        return tail, right, left

    def visible_rows(self, key, m_block):
        """[lo, hi] (inclusive, relative to the block's first row) of the query rows that see
        `key` (key < seqlen_k; the kernel masks keys past seqlen_k separately). Unbounded sides
        give values outside [0, tile_m)."""
        row0 = m_block * self.tile_m
        lo = row0 * 0 - 1
        hi = row0 * 0 + self.tile_m
        if self.is_causal or self.is_local:
            lo = key - self.off - self.window_right - row0
        if self.is_local:
            hi = key - self.off + self.window_left - row0
        return lo, hi

    def visible_cols(self, row, n_block):
        """[lo, hi): the key columns of block n_block, relative to the block, that query ``row``
        sees (keys past seqlen_k excluded; no left bound unless local: lo is then meaningless)."""
        col0 = n_block * self.tile_n
        hi = self.seqlen_k - col0
        if self.is_causal or self.is_local:
            hi = _min(hi, row + self.off + self.window_right + 1 - col0)
        lo = row * 0
        if self.is_local:
            lo = row + self.off - self.window_left - col0
        return lo, hi
