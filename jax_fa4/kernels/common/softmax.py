"""Online softmax over WGMMA accumulator fragments, in registers.

Scores arrive raw (unscaled); ``scale_log2`` (softmax_scale·log2 e, or softcap·log2 e when a
softcap transform ran first) is folded into one FFMA per element before the hardware ``ex2``.
Each thread owns whole row-segments; the row max is reduced across the 4 threads (a quad) that
share a row, the row sum stays per thread until ``finalize``.

The running max is kept scaled, R = round(m·scale_log2) in log2 units, and every use of it is
R itself: each element's exponent is the one FFMA s·scale_log2 − R, the O-rescale factor
exp2(R_old − R_new) and lse = (R + log2 Σ)·ln 2. The softmax is invariant to the shift, so the
rounding of m·scale_log2 cancels: the result stays exact while the row's largest P,
2^(m·scale_log2 − R) with the exponent at most half an ulp of R, stays well inside the range
of P's 16-bit type and of float32: |R| < ``exact_limit_log2`` (2^31 with bf16 P, largest P
2^±64; 2^27 with fp16 P, 2^±8), scores up to ~1.7e10 (bf16) or ~1e9 (fp16) at head dim 128 and
the default scale. Past it ``finalize`` writes NaN to the row's lse and output: never a silently
wrong or zero row. (Before, the elements subtracted round(m_new·scale_log2) while O was
rescaled by exp2((m_old − m_new)·scale_log2), so key blocks could disagree by up to an ulp of R:
an error of the order of float32's own rounding of such scores, but with no single shift there
was no exact range to state, and rows past it came out as inf, 0 or wrong values.)

Fully masked rows: a row max of -inf is replaced by 0 before exponentiating, so P = 0, the sum
stays 0, and ``finalize`` returns a scale of 0 (O = 0) and lse = -inf. Never NaN. With a
learnable sink (``reset_with_sink``) the sum starts at 1 at max σ: such a row gives O = 0 and
lse = σ.

Conditional rescaling (FA4's, ``rescale_threshold > 0``): when a row's running max grows by at most
``rescale_threshold`` (in log2 units of the scaled scores, i.e. ``(m_new - m_old)·scale_log2``), the
stale max is kept: P = exp2(s·scale_log2 − m_old·scale_log2) is then at most 2^threshold (256 for
8.0: no overflow in fp32 sums, bf16/fp16 P or the fp32 O accumulator), the row's O-rescale factor is
exactly 1.0, and ``rescale_rows_if_needed`` skips the O multiply when no row of the warp needs it.
The max stored is the one actually applied, so ``finalize`` (1/Σ and lse) stays exact.
``rescale_skip`` keeps only the skip: the max stays exact, a row whose max did not grow gets the
factor 1.0 exactly, and a warp none of whose rows' max grew skips its O multiply (the FP8
forward, where a stale max would round each row's largest P to e4m3).

Partial software exp2 (``exp2_sw_per_32 > 0``): of every 32 elements of a thread's row segment,
the last ``exp2_sw_per_32`` are exponentiated by the FMA-pipe polynomial of common/exp2.py
(relative error < 2^-13.4) instead of MUFU ``ex2`` (16 per clock per SM against 128 FMAs). On
Hopper it measured slower at every share tried (16-bit hdim 64:
benchmarks/results/fwd-variants-d64-nvidia-h200-2026-11-30.json; FP8:
fp8-tuning-nvidia-h200-2026-12-03.json; docs/kernels/sm90-forward.md): off by default.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from jax_fa4.kernels.common.exp2 import exp2_is_software, exp2_sw
from jax_fa4.kernels.common.layout import acc_view_mn
from jax_fa4.kernels.spec import LN2, LOG2_E


def exact_limit_log2(is_bf16: bool) -> float:
    """The largest |scaled row max| (log2 units) the one-FFMA exponent is exact for, by P's
    16-bit type (see the module docstring); rows past it are written as NaN."""
    return 2.0 ** 31 if is_bf16 else 2.0 ** 27


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
        vals = [op(vals[j], vals[j + 1]) if j + 1 < len(vals) else vals[j]
                for j in range(0, len(vals), 2)]
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

    def __init__(self, scale_log2: Float32, num_rows: int, rescale_threshold: float = 0.0,
                 exp2_sw_per_32: int = 0, p_is_bf16: bool = True, track_max: bool = False,
                 rescale_skip: bool = False):
        self.scale_log2 = scale_log2
        # track_max: also keep each row's true running scaled max (no sink, never stale) for
        # the max-logit output (logits_max)
        self.track_max = bool(track_max)
        self.seen_max = cute.make_rmem_tensor(num_rows, Float32) if track_max else None
        self.exact_limit = exact_limit_log2(p_is_bf16)
        self.num_rows = num_rows
        self.rescale_threshold = float(rescale_threshold)  # 0: rescale whenever the max grows
        # exact max, but a row whose max did not grow gets the factor 1.0 exactly (not
        # ex2(0)), so rescale_rows_if_needed may skip a warp's O multiply
        self.rescale_skip = bool(rescale_skip)
        self.exp2_sw_per_32 = int(exp2_sw_per_32)  # 0: every exp2 on MUFU
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)

    def reset(self) -> None:
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)
        if cutlass.const_expr(self.track_max):
            self.seen_max.fill(-Float32.inf)

    @cute.jit
    def reset_with_sink(self, sink_log2: Float32) -> None:
        """Start every row from a learnable sink: a key of logit σ (``sink_log2`` = σ·log2 e;
        -inf for none) and value 0, as if already seen: the scaled max is σ·log2 e and the sum
        is e^{σ − σ} = 1, spread over the quad's 4 threads (``finalize`` adds them). Every
        block then runs the non-first step (``step(..., is_first=False)``), which joins the
        sink's term; with no sink that step is exact as well (the stale sum 0 scales to 0)."""
        part = Float32(0.0) if sink_log2 == -Float32.inf else Float32(0.25)
        for r in cutlass.range_constexpr(self.num_rows):
            self.row_max[r] = sink_log2
            self.row_sum[r] = part
        if cutlass.const_expr(self.track_max):
            self.seen_max.fill(-Float32.inf)

    def step(self, acc_S: cute.Tensor, row_scale: cute.Tensor, is_first: bool):
        """P = exp2(S·scale_log2 − R) in place; row_scale = factor to rescale O by."""
        if self.rescale_threshold > 0.0 and not is_first:
            self.step_thresholded(acc_S, row_scale)
        else:
            self.step_always(acc_S, row_scale, is_first)

    @cute.jit
    def block_max_scaled(self, s_mn: cute.Tensor, r: cutlass.Constexpr[int]) -> Float32:
        """The scaled max of row r of this block over the quad: round(max(s)·scale_log2)
        (rounding is monotone, so the running max of these is the scaled running max)."""
        return quad_allreduce_max(row_max_local(s_mn[r, None], None, False)) * self.scale_log2

    @cute.jit
    def block_max(self, s_mn: cute.Tensor, r: cutlass.Constexpr[int]) -> Float32:
        """block_max_scaled, also folded into the row's true running max when tracked."""
        m = self.block_max_scaled(s_mn, r)
        if cutlass.const_expr(self.track_max):
            self.seen_max[r] = cute.arch.fmax(self.seen_max[r], m)
        return m

    @cute.jit
    def logits_max(self, r: cutlass.Constexpr[int]) -> Float32:
        """Row r's largest score seen, in natural logit units: scaled max / log2 e (-inf if
        none)."""
        return self.seen_max[r] * Float32(1.0 / LOG2_E)

    @cute.jit
    def step_always(self, acc_S: cute.Tensor, row_scale: cute.Tensor,
                    is_first: cutlass.Constexpr[bool]):
        """The v1 step: the max applied is always the running max (rescale whenever it grows)."""
        s_mn = acc_view_mn(acc_S)
        n_cols = cute.size(s_mn, mode=[1])
        for r in cutlass.range_constexpr(self.num_rows):
            r_prev = self.row_max[r]
            r_new = self.block_max(s_mn, r)
            if cutlass.const_expr(not is_first):
                r_new = cute.arch.fmax(r_new, r_prev)
            self.row_max[r] = r_new
            r_safe = Float32(0.0) if r_new == -Float32.inf else r_new
            self.exp2_row(s_mn, r, n_cols, -r_safe)
            p_sum = row_sum_local(s_mn[r, None])
            if cutlass.const_expr(is_first):
                row_scale[r] = Float32(1.0)
                self.row_sum[r] = p_sum
            else:
                # r_prev = -inf (nothing seen yet) gives exp2(-inf) = 0: correct, the sum was 0.
                scale = cute.math.exp2(r_prev - r_safe, fastmath=True)
                if cutlass.const_expr(self.rescale_skip):
                    scale = Float32(1.0) if r_prev == r_safe else scale
                row_scale[r] = scale
                self.row_sum[r] = self.row_sum[r] * scale + p_sum

    @cute.jit
    def step_thresholded(self, acc_S: cute.Tensor, row_scale: cute.Tensor):
        """A non-first step with conditional rescaling: keep the stale max R_old unless
        R_new − R_old > rescale_threshold; row_scale is then exactly 1.0."""
        s_mn = acc_view_mn(acc_S)
        n_cols = cute.size(s_mn, mode=[1])
        for r in cutlass.range_constexpr(self.num_rows):
            r_prev = self.row_max[r]
            r_new = cute.arch.fmax(self.block_max(s_mn, r), r_prev)
            r_safe = Float32(0.0) if r_new == -Float32.inf else r_new
            # <= 0; -inf when nothing was seen before (r_prev = -inf): then always rescale (by 0)
            diff = r_prev - r_safe
            keep = diff >= Float32(-self.rescale_threshold)
            r_used = r_prev if keep else r_safe
            self.row_max[r] = r_prev if keep else r_new
            self.exp2_row(s_mn, r, n_cols, -r_used)
            p_sum = row_sum_local(s_mn[r, None])
            scale = Float32(1.0) if keep else cute.math.exp2(diff, fastmath=True)
            row_scale[r] = scale
            self.row_sum[r] = self.row_sum[r] * scale + p_sum

    @cute.jit
    def exp2_row(self, s_mn: cute.Tensor, r: cutlass.Constexpr[int],
                 n_cols: cutlass.Constexpr[int], neg_r: Float32):
        """s_mn[r, :] = exp2(s·scale_log2 − R), MUFU or the FMA-pipe polynomial."""
        for c in cutlass.range_constexpr(n_cols):
            x = s_mn[r, c] * self.scale_log2 + neg_r
            if cutlass.const_expr(exp2_is_software(c, self.exp2_sw_per_32)):
                s_mn[r, c] = exp2_sw(x)
            else:
                s_mn[r, c] = cute.math.exp2(x, fastmath=True)

    @cute.jit
    def finalize(self, row_scale: cute.Tensor, lse: cute.Tensor):
        """row_scale = 1/Σ (0 for empty rows); lse = (R + log2 Σ)·ln 2, -inf for empty rows.
        A row past the exact range (|R| ≥ ``exact_limit``, R not -inf) gets NaN for both: its
        output and lse are NaN, never silently wrong."""
        for r in cutlass.range_constexpr(self.num_rows):
            total = quad_allreduce_sum(self.row_sum[r])
            r_max = self.row_max[r]
            empty = total == Float32(0.0)
            broken = cute.arch.fmax(r_max, -r_max) >= Float32(self.exact_limit)
            broken = broken and r_max != -Float32.inf
            scale = Float32(0.0) if empty else cute.arch.rcp_approx(total)
            lse_r = -Float32.inf if empty else (r_max + cute.math.log2(total, fastmath=True)) * LN2
            row_scale[r] = Float32.nan if broken else scale
            lse[r] = Float32.nan if broken else lse_r


@cute.jit
def rescale_rows(acc: cute.Tensor, row_scale: cute.Tensor):
    acc_mn = acc_view_mn(acc)
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
            acc_mn[r, c] = acc_mn[r, c] * row_scale[r]


@cute.jit
def rescale_rows_if_needed(acc: cute.Tensor, row_scale: cute.Tensor):
    """rescale_rows, skipped when no row of the warp has a factor other than 1.0 (conditional
    rescaling: factors are exactly 1.0 when skipped, else < 2^-threshold, so min < 1 detects it)."""
    smallest = row_scale[0]
    for r in cutlass.range_constexpr(1, cute.size(row_scale)):
        smallest = cutlass.min(smallest, row_scale[r])
    if cute.arch.vote_any_sync(smallest < Float32(1.0)):
        rescale_rows(acc, row_scale)
