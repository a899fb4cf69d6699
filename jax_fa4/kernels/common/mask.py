"""Score masks on WGMMA accumulator fragments: key-length tail, causal, sliding window.

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
              mask_local: cutlass.Constexpr[bool]):
        """tScS / t0ScS: this thread's / thread 0's (row, col) coordinates of acc_S's elements."""
        s_mn = acc_view_mn(acc_S)
        c_mn = acc_view_mn(tScS)
        c0_mn = acc_view_mn(t0ScS)
        n_rows = cute.size(s_mn, mode=[0])
        n_cols = cute.size(s_mn, mode=[1])
        col_base = n_block * self.tile_n + c_mn[0, 0][1]  # this thread's first column, global
        if cutlass.const_expr(not mask_causal and not mask_local):
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
                right = diag + 1  # exclusive
                if cutlass.const_expr(mask_local):
                    right = diag + 1 + self.window_right
                if cutlass.const_expr(mask_seqlen):
                    right = cutlass.min(right, self.seqlen_k)
                right_rel = right - col_base
                if cutlass.const_expr(mask_local):
                    left_rel = diag - self.window_left - col_base  # inclusive
                    for c in cutlass.range_constexpr(n_cols):
                        col = c0_mn[0, c][1]
                        out = col >= right_rel or col < left_rel
                        s_mn[r, c] = -Float32.inf if out else s_mn[r, c]
                else:
                    for c in cutlass.range_constexpr(n_cols):
                        s_mn[r, c] = -Float32.inf if c0_mn[0, c][1] >= right_rel else s_mn[r, c]
