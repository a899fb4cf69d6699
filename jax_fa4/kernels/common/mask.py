"""Score masks on WGMMA accumulator fragments: key-length tail, causal, sliding window, segment
ids (each row's key span, and key-by-key ids where a row's id is not one run of the keys).

Columns are compared with thread 0's (compile-time) column coordinates against a per-thread,
per-row limit from which this thread's own column offset was subtracted once, so the inner loop
is one integer compare and one select per element. See geometry.py for the conventions.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from jax_fa4.kernels.common.layout import acc_view_mn


class AttentionMask:
    def __init__(self, tile_m: int, tile_n: int, seqlen_q: Int32, seqlen_k: Int32,
                 window_left=None, window_right=None):
        self.tile_m, self.tile_n = tile_m, tile_n
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self.window_left, self.window_right = window_left, window_right

    @cute.jit
    def apply(self, acc_S: cute.Tensor, tScS: cute.Tensor, t0ScS: cute.Tensor,
              m_block: Int32, n_block: Int32,
              mask_seqlen: cutlass.Constexpr[bool], mask_causal: cutlass.Constexpr[bool],
              mask_local: cutlass.Constexpr[bool], segs: cutlass.Constexpr = None):
        """tScS / t0ScS: this thread's / thread 0's (row, col) coordinates of acc_S's elements.

        ``segs`` (segment ids): (span_start, span_end, row_id, kv_ids, compare_ids): this
        thread's rows' key spans [start, end) and ids (register tensors), the batch entry's key
        ids (Sk,) in global memory, and a tile-uniform Int32: columns outside a row's span are
        masked like a window, and where ``compare_ids`` is not 0 also every key whose id is not
        the row's (ids that are not one contiguous run of the keys)."""
        s_mn = acc_view_mn(acc_S)
        c_mn = acc_view_mn(tScS)
        c0_mn = acc_view_mn(t0ScS)
        n_rows = cute.size(s_mn, mode=[0])
        n_cols = cute.size(s_mn, mode=[1])
        col_base = n_block * self.tile_n + c_mn[0, 0][1]  # this thread's first column, global
        has_segs = segs is not None
        if cutlass.const_expr(not mask_causal and not mask_local and not has_segs):
            if cutlass.const_expr(mask_seqlen):
                limit = self.seqlen_k - col_base
                for c in cutlass.range_constexpr(n_cols):
                    oob = c0_mn[0, c][1] >= limit
                    for r in cutlass.range_constexpr(n_rows):
                        s_mn[r, c] = -Float32.inf if oob else s_mn[r, c]
        else:
            for r in cutlass.range_constexpr(n_rows):
                row = m_block * self.tile_m + c_mn[r, 0][0]
                diag = row + self.seqlen_k - self.seqlen_q  # last visible column when causal
                right = self.seqlen_k  # exclusive
                if cutlass.const_expr(mask_causal):
                    right = diag + 1
                if cutlass.const_expr(mask_local):
                    right = diag + 1 + self.window_right
                if cutlass.const_expr(mask_seqlen and (mask_causal or mask_local)):
                    right = cutlass.min(right, self.seqlen_k)
                if cutlass.const_expr(has_segs):
                    right = cutlass.min(right, segs[1][r])
                right_rel = right - col_base
                if cutlass.const_expr(mask_local or has_segs):
                    # the first visible column, inclusive
                    if cutlass.const_expr(mask_local and has_segs):
                        left = cutlass.max(diag - self.window_left, segs[0][r])
                    elif cutlass.const_expr(mask_local):
                        left = diag - self.window_left
                    else:
                        left = segs[0][r]
                    left_rel = left - col_base
                    for c in cutlass.range_constexpr(n_cols):
                        col = c0_mn[0, c][1]
                        out = col >= right_rel or col < left_rel
                        s_mn[r, c] = -Float32.inf if out else s_mn[r, c]
                else:
                    for c in cutlass.range_constexpr(n_cols):
                        s_mn[r, c] = -Float32.inf if c0_mn[0, c][1] >= right_rel else s_mn[r, c]
            if cutlass.const_expr(has_segs):
                row_id, kv_ids, compare_ids = segs[2], segs[3], segs[4]
                if compare_ids != 0:
                    last = self.seqlen_k - 1
                    for c in cutlass.range_constexpr(n_cols):
                        key_id = kv_ids[cutlass.min(col_base + c0_mn[0, c][1], last)]
                        for r in cutlass.range_constexpr(n_rows):
                            s_mn[r, c] = -Float32.inf if key_id != row_id[r] else s_mn[r, c]
