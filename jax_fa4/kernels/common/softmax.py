"""Online softmax over WGMMA accumulator fragments, in registers.

Scores arrive raw (unscaled); ``scale_log2`` (softmax_scale·log2 e, or softcap·log2 e when a
softcap transform ran first) is folded into one FFMA per element before the hardware ``ex2``.
Each thread owns whole row-segments; the row max is reduced across the 4 threads (a quad) that
share a row, the row sum stays per thread until ``finalize``.

Fully masked rows: a row max of -inf is replaced by 0 before exponentiating, so P = 0, the sum
stays 0, and ``finalize`` returns a scale of 0 (O = 0) and lse = -inf. Never NaN.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from jax_fa4.kernels.common.layout import acc_view_mn

LN2 = math.log(2.0)


@cute.jit
def quad_allreduce_max(x: Float32) -> Float32:
    for i in cutlass.range_constexpr(2):
        x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1 << i))
    return x


@cute.jit
def quad_allreduce_sum(x: Float32) -> Float32:
    for i in cutlass.range_constexpr(2):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << i)
    return x


def _tree(vals, op):
    """Reduce a Python list of DSL scalars pairwise (trace-time helper, no AST rewriting)."""
    while len(vals) > 1:
        vals = [op(vals[j], vals[j + 1]) if j + 1 < len(vals) else vals[j] for j in range(0, len(vals), 2)]
    return vals[0]


def row_max_local(row: cute.Tensor, init, use_init: bool):
    """Max of a register row with 4 independent fmax chains, then a tree."""
    n = cute.size(row)
    acc = [row[i] for i in range(min(4, n))]
    for i in range(4, n):
        acc[i % 4] = cute.arch.fmax(acc[i % 4], row[i])
    res = _tree(acc, cute.arch.fmax)
    return cute.arch.fmax(res, init) if use_init else res


def row_sum_local(row: cute.Tensor):
    n = cute.size(row)
    acc = [row[i] for i in range(min(4, n))]
    for i in range(4, n):
        acc[i % 4] = acc[i % 4] + row[i]
    return _tree(acc, lambda a, b: a + b)


class OnlineSoftmax:
    """Running row max / row sum for the rows one thread owns.

    ``num_rows`` is the number of accumulator rows per thread (2 per 64-row WGMMA atom).
    """

    def __init__(self, scale_log2: Float32, num_rows: int):
        self.scale_log2 = scale_log2
        self.num_rows = num_rows
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)

    def reset(self) -> None:
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def step(self, acc_S: cute.Tensor, row_scale: cute.Tensor, is_first: cutlass.Constexpr[bool]):
        """P = exp2(S·scale_log2 − m·scale_log2) in place; row_scale = factor to rescale O by."""
        s_mn = acc_view_mn(acc_S)
        n_cols = cute.size(s_mn, mode=[1])
        for r in cutlass.range_constexpr(self.num_rows):
            m_prev = self.row_max[r]
            m_new = row_max_local(s_mn[r, None], m_prev, not is_first)
            m_new = quad_allreduce_max(m_new)
            self.row_max[r] = m_new
            m_safe = Float32(0.0) if m_new == -Float32.inf else m_new
            neg_m_scaled = -m_safe * self.scale_log2
            for c in cutlass.range_constexpr(n_cols):
                s_mn[r, c] = cute.math.exp2(s_mn[r, c] * self.scale_log2 + neg_m_scaled, fastmath=True)
            p_sum = row_sum_local(s_mn[r, None])
            if cutlass.const_expr(is_first):
                row_scale[r] = Float32(1.0)
                self.row_sum[r] = p_sum
            else:
                # m_prev = -inf (nothing seen yet) gives exp2(-inf) = 0: correct, the sum was 0.
                scale = cute.math.exp2((m_prev - m_safe) * self.scale_log2, fastmath=True)
                row_scale[r] = scale
                self.row_sum[r] = self.row_sum[r] * scale + p_sum

    @cute.jit
    def finalize(self, row_scale: cute.Tensor, lse: cute.Tensor):
        """row_scale = 1/Σ (0 for empty rows); lse = ln Σ + m·scale (natural log), -inf if Σ = 0."""
        for r in cutlass.range_constexpr(self.num_rows):
            total = quad_allreduce_sum(self.row_sum[r])
            empty = total == Float32(0.0)
            row_scale[r] = Float32(0.0) if empty else cute.arch.rcp_approx(total)
            m_scaled = self.row_max[r] * self.scale_log2
            lse[r] = -Float32.inf if empty else (m_scaled + cute.math.log2(total, fastmath=True)) * LN2


@cute.jit
def rescale_rows(acc: cute.Tensor, row_scale: cute.Tensor):
    acc_mn = acc_view_mn(acc)
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
            acc_mn[r, c] = acc_mn[r, c] * row_scale[r]
