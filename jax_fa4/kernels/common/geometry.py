"""Tile geometry of every attention kernel, each rule written once: which keys a query row sees,
where a batch entry's sequence lies, which key blocks a query tile visits (forward) and which
query blocks a key tile visits (backward), and which of those blocks need a mask.

Conventions (FA4's, bottom-right aligned): query row i sees key j iff j < seqlen_k and
    i + off − window_left  <=  j  <=  i + off + window_right,      off = seqlen_k − seqlen_q
(causal: window_right = 0, no left bound). Windows reach the block rules resolved by
:func:`resolve_windows`: an unbounded side (−1) or one wider than the sequence is clamped to
seqlen_k (left) or seqlen_q (right), so every bound is small Int32 arithmetic.

Every function uses only ``+ - * //``, :func:`_min` / :func:`_max` and :func:`_select`, so it
runs on Python ints (the CPU tests check each rule against brute force), on CuTe-DSL Int32 in
the kernels, and elementwise on arrays of the array API (``jax.numpy`` under ``jit``: the
backend's varlen work order, ``backends/sm90.py``); no import of the compiler until a DSL value
is met. A ``//`` whose dividend may be
negative only feeds a clamp or a comparison against a non-negative bound, where floor and
truncating division give the same outcome (the block ranges are written as the sm90 forward
always computed them: a rewrite of the same values changed that kernel's instruction schedule
and cost 8 % at head dim 96 causal).

Which kernel uses what: the forward kernels (sm90 and sm100) :class:`FwdBlocks` and
:meth:`Band.visible_cols` for their masks; the backward kernels :class:`BwdBlocks` (sm90 masks by
each row's visible key columns, the transposed sm100 tile by each key's visible query rows);
the sequence rules :func:`varlen_sequence`, :func:`packed_span` and :func:`paged_keys` wherever a
kernel finds its batch entry's rows.
"""

from __future__ import annotations

from jax_fa4.kernels.spec import PARAM_WINDOW_LEFT, PARAM_WINDOW_RIGHT


def _is_py(*values) -> bool:
    return all(isinstance(v, (bool, int)) for v in values)


def _array_namespace(*values):
    """The array-API namespace (``__array_namespace__``) of the first array among ``values``
    (e.g. ``jax.numpy``), or None: Python and CuTe-DSL values have none."""
    for v in values:
        namespace = getattr(v, "__array_namespace__", None)
        if namespace is not None:
            return namespace()
    return None


def _max(a, b):
    if _is_py(a, b):
        return a if a >= b else b
    xp = _array_namespace(a, b)
    if xp is not None:
        return xp.maximum(a, b)
    import cutlass

    return cutlass.max(a, b)


def _min(a, b):
    if _is_py(a, b):
        return a if a <= b else b
    xp = _array_namespace(a, b)
    if xp is not None:
        return xp.minimum(a, b)
    import cutlass

    return cutlass.min(a, b)


def _select(cond, if_true, if_false):
    """``if_true if cond else if_false``; a DSL condition selects at run time."""
    if isinstance(cond, bool):
        return if_true if cond else if_false
    xp = _array_namespace(cond, if_true, if_false)
    if xp is not None:
        return xp.where(cond, if_true, if_false)
    import cutlass

    return cutlass.Int32(cutlass.select_(cond, if_true, if_false))


def _or(a, b):
    if isinstance(a, bool) and isinstance(b, bool):
        return a or b
    xp = _array_namespace(a, b)
    if xp is not None:
        return xp.logical_or(a, b)
    import cutlass

    return cutlass.or_(a, b)


def _ceil_div(x, n: int):
    return (x + (n - 1)) // n


# --------------------------------------------------------------------------------------------
# windows and sequences
# --------------------------------------------------------------------------------------------
def resolve_windows(params, seqlen_q, seqlen_k, is_local: bool):
    """(window_left, window_right) of a local mask from ``params[PARAM_WINDOW_LEFT]`` and
    ``params[PARAM_WINDOW_RIGHT]`` (-1, any negative, =
    unbounded; converted to Int32 in a kernel), each clamped to the side's length (seqlen_k,
    seqlen_q) when unbounded or wider; (0, 0) for the other masks, which never read them."""
    if not is_local:
        return 0, 0
    wl, wr = params[PARAM_WINDOW_LEFT], params[PARAM_WINDOW_RIGHT]
    if not _is_py(wl, wr):
        from cutlass import Int32

        wl, wr = Int32(wl), Int32(wr)
    return clamp_windows(wl, wr, seqlen_q, seqlen_k)


def clamp_windows(window_left, window_right, seqlen_q, seqlen_k):
    """(window_left, window_right) with an unbounded side (negative) or one wider than the
    sequence clamped to seqlen_k (left) or seqlen_q (right): :func:`resolve_windows`' rule."""
    wl = _select(_or(window_left < 0, window_left > seqlen_k), seqlen_k, window_left)
    wr = _select(_or(window_right < 0, window_right > seqlen_q), seqlen_q, window_right)
    return wl, wr


def packed_span(cu_seqlens, seq):
    """(first row, length) of sequence ``seq`` of a packed (varlen) batch."""
    offset = cu_seqlens[seq]
    return offset, cu_seqlens[seq + 1] - offset


def varlen_sequence(cu_seqlens_q, cu_seqlens_k, batch, num_seqs):
    """(q_offset, k_offset, seqlen_q, seqlen_k) of batch entry ``batch`` of a varlen grid, which
    has one slice per sequence plus a last one (``batch == num_seqs``) that only zeroes the
    padding rows: that slice reads sequence num_seqs − 1's offsets and has lengths 0."""
    seq = _max(_min(batch, num_seqs - 1), 0)
    q_offset, seqlen_q = packed_span(cu_seqlens_q, seq)
    k_offset, seqlen_k = packed_span(cu_seqlens_k, seq)
    padding = batch == num_seqs
    return q_offset, k_offset, _select(padding, 0, seqlen_q), _select(padding, 0, seqlen_k)


def paged_keys(seqused_k, batch, capacity):
    """Batch entry ``batch``'s key count of a paged cache: ``seqused_k[batch]`` clipped to
    [0, capacity], the keys its page-table row can hold (a caller need not clip)."""
    return _max(_min(seqused_k[batch], capacity), 0)


# --------------------------------------------------------------------------------------------
# the visibility band and the block rules
# --------------------------------------------------------------------------------------------
class Band:
    """The keys each query row sees (module doc), for tiles of tile_m query rows and tile_n
    keys."""

    def __init__(self, tile_m: int, tile_n: int, is_causal: bool, is_local: bool,
                 seqlen_q, seqlen_k, window_left, window_right):
        self.tile_m, self.tile_n = tile_m, tile_n
        self.is_causal, self.is_local = is_causal, is_local
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self.window_left, self.window_right = window_left, window_right
        self.off = seqlen_k - seqlen_q

    @property
    def banded(self) -> bool:
        """Rows see keys only up to a diagonal (causal or local)."""
        return self.is_causal or self.is_local

    def kv_tail(self, n_block):
        """Key block n_block holds keys past seqlen_k (only the last one can)."""
        return (n_block + 1) * self.tile_n > self.seqlen_k

    def visible_cols(self, row, n_block):
        """[lo, hi): the key columns of block n_block, relative to the block, that query ``row``
        sees (keys past seqlen_k excluded; no left bound unless local: lo is then meaningless)."""
        col0 = n_block * self.tile_n
        hi = self.seqlen_k - col0
        if self.banded:
            hi = _min(hi, row + self.off + self.window_right + 1 - col0)
        lo = row * 0
        if self.is_local:
            lo = row + self.off - self.window_left - col0
        return lo, hi

    def visible_rows(self, key, m_block):
        """[lo, hi] (inclusive, relative to the block's first row) of the query rows that see
        `key` (key < seqlen_k; keys past seqlen_k are masked separately). Unbounded sides give
        values outside [0, tile_m)."""
        row0 = m_block * self.tile_m
        lo = row0 * 0 - 1
        hi = row0 * 0 + self.tile_m
        if self.banded:
            lo = key - self.off - self.window_right - row0
        if self.is_local:
            hi = key - self.off + self.window_left - row0
        return lo, hi


class FwdBlocks(Band):
    """The key blocks a tile of tile_m query rows visits, from the highest index down: the first
    visited block carries the key-length tail mask, then the blocks that cut the causal /
    right-window diagonal, then the bulk (no mask), then the blocks that cut the left-window
    edge."""

    def n_block_range(self, m_block, past_end_empty: bool = False):
        """[n_block_min, n_block_max): the key blocks with at least one visible key for some row
        of tile ``m_block`` (empty, n_block_max <= n_block_min, when no row sees a key);
        ``past_end_empty`` (varlen grids, which cover the longest sequence): a tile starting
        past seqlen_q visits nothing."""
        n_block_max = _ceil_div(self.seqlen_k, self.tile_n)
        if self.banded:
            # the tile's last row's last visible column, exclusive
            col_end = (m_block + 1) * self.tile_m + self.off
            if self.is_local:
                col_end = col_end + self.window_right
            n_block_max = _min(n_block_max, _ceil_div(col_end, self.tile_n))
        n_block_min = 0
        if self.is_local:
            col_begin = m_block * self.tile_m + self.off - self.window_left
            n_block_min = _max(col_begin // self.tile_n, 0)
        if past_end_empty:
            n_block_max = _select(m_block * self.tile_m >= self.seqlen_q, n_block_min,
                                  n_block_max)
        return n_block_min, n_block_max

    def n_block_min_right_mask(self, m_block, n_block_min):
        """Blocks n >= this (below the first visited one) cut the causal / right-window diagonal.
        Block n needs no right mask iff (n+1)·tile_n − 1 <= first row's last visible column."""
        last_col_row0 = m_block * self.tile_m + self.off
        if self.is_local:
            last_col_row0 = last_col_row0 + self.window_right
        return _max(n_block_min, (last_col_row0 + 1) // self.tile_n)

    def n_block_max_left_mask(self, m_block, n_block_min):
        """Blocks n < this cut the left-window edge. Block n needs no left mask iff
        n·tile_n >= the last row's first visible column."""
        if not self.is_local:
            return n_block_min
        first_col_last_row = ((m_block + 1) * self.tile_m - 1 + self.off
                              - self.window_left)
        return _max(n_block_min, _ceil_div(first_col_last_row, self.tile_n))


class BwdBlocks(Band):
    """The query blocks a key block visits, their mask reasons and the deterministic dQ order."""

    def num_m_blocks(self):
        return _ceil_div(self.seqlen_q, self.tile_m)

    def m_block_range(self, n_block):
        """[m_min, m_max): query blocks with a row that sees a key of block n_block (empty when
        m_max <= m_min)."""
        tm = self.tile_m
        m_max = self.num_m_blocks()
        m_min = n_block * 0
        if self.banded:
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

    def mask_reasons(self, m_block, n_block):
        """(key tail, cuts the right diagonal, cuts the left window edge) of block (m_block,
        n_block): the block needs a mask iff any is true (the kernel ORs them in jit code; each
        is False when its mask kind is off). Conservative: extra masking is harmless."""
        tm, tn = self.tile_m, self.tile_n
        tail = self.kv_tail(n_block)
        right = tail if not self.banded else (
            (n_block + 1) * tn - 1 > m_block * tm + self.off + self.window_right)
        left = tail if not self.is_local else (
            n_block * tn < (m_block + 1) * tm - 1 + self.off - self.window_left)
        return tail, right, left
