"""Software exp2 on the FMA pipe (FA4's technique 1), arch-independent.

    2^x = 2^j · 2^f,   j = floor(x) (integer), f = x − j ∈ [0, 1)

* **Range reduction (Cody–Waite, one step, exact).** ``x`` is clamped to ≥ −127, then
  ``r = x + (2^23 + 2^22)`` is added *rounding toward −∞*: in [2^23, 2^24) the float spacing is 1,
  so ``r`` is exactly ``2^23 + 2^22 + floor(x)`` and ``floor(x)`` sits in the low mantissa bits of
  ``r``. ``j = r − (2^23 + 2^22)`` and ``f = x − j`` are then exact (no rounding at all), so the
  reduction adds no error.
* **2^f on [0, 1)** by a degree-3 polynomial, minimax for *relative* error with the constant term
  fixed at exactly 1 (FA4's coefficients), in Horner form: three FMAs (two packed FFMA2 per element
  pair in the device version).
* **Scaling by 2^j** without a multiply: ``(bits(r) << 23)`` is ``j << 23`` modulo 2^32 (the
  2^22 offset shifts out), and adding it to the bit pattern of ``p(f) ∈ [1, 2)`` adds ``j`` to the
  exponent field. The add is a signed 32-bit integer add (``add.s32``: ALU pipe, LEA in SASS),
  keeping the FMA pipe for the polynomial.

Edge cases (tested by ``tests/test_sm100_numerics.py`` on the numpy twin):
  * x ≤ −127 (including −inf, the masked scores): exactly +0.0 — p(0) = 1.0 exactly, and
    1.0's exponent 127 minus 127 is 0 with a zero mantissa. Fully masked rows therefore keep a row
    sum of exactly 0.
  * −127 < x < −126: a denormal bit pattern with absolute error < 2^-126 (MUFU ``ex2.approx.ftz``
    flushes these to 0; both are negligible against a softmax row sum ≥ 1).
  * NaN: the clamp (``max``, which returns the non-NaN operand) maps it to −127, i.e. +0.0.
  * Subnormal x is not flushed (the round-down add has no ``.ftz``, like the packed
    ``add.rm.f32x2``): a negative subnormal x has floor −1 and gives p(1)/2 ≈ 0.99991, both forms
    alike.
  * x must be < 128 (softmax feeds x ≤ 8 with the conditional rescale threshold 8).

This module holds the pure numpy twin (:func:`exp2_sw_numpy`, the exact same float32 operations
with correctly rounded FMAs, importable without the compiler) and, when nvidia-cutlass-dsl is
installed, the CuTe-DSL device functions :func:`exp2_sw` and :func:`exp2_sw_x2`. It is the one
module of ``common`` that imports without the compiler.
"""

from __future__ import annotations

import numpy as np

#: 2^f ≈ C0 + C1·f + C2·f² + C3·f³ on [0, 1): degree-3 minimax for relative error, C0 = 1 exactly.
#: All four are exact float32 values.
POLY_COEFFS = (1.0, 0.695146143436431884765625, 0.227564394474029541015625,
               0.077119089663028717041015625)
#: Inputs below this are clamped (the result is then exactly 0).
CLAMP_LO = -127.0
#: 2^23 + 2^22: adding it with round-down leaves floor(x) in the low mantissa bits.
ROUND_MAGIC = 12582912.0


def exp2_is_software(i: int, per_32: int) -> bool:
    """Whether element ``i`` of a thread's row segment uses the software exp2: a fixed
    compile-time pattern (the last ``per_32`` of every 32 elements), never dependent on masking.
    (sm100 applies it to element pairs (i, i+1) with ``per_32`` even.)"""
    return per_32 > 0 and (i % 32) >= 32 - per_32


# ---------------------------------------------------------------------------------------------
# numpy twin (exactly the device arithmetic)
# ---------------------------------------------------------------------------------------------
def fma_f32(a, b, c) -> np.ndarray:
    """Correctly rounded float32 fused multiply-add (round to nearest even), vectorised.

    a·b is exact in float64 (24 + 24 bits); the float64 sum s = fl64(a·b + c) carries an exact
    error e (TwoSum). Rounding s to float32 is the correct rounding of a·b + c except when s lies
    exactly on a float32 midpoint; then the sign of e breaks the tie (double-rounding fix).
    """
    a, b, c = (np.asarray(t, np.float32).astype(np.float64) for t in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)  # TwoSum: s + e == p + c exactly
    r = s.astype(np.float32)
    r64 = r.astype(np.float64)
    other = np.where(r64 > s, np.nextafter(r, np.float32(-np.inf)),
                     np.nextafter(r, np.float32(np.inf))).astype(np.float64)
    midpoint = (s != r64) & (np.abs(s - r64) == np.abs(s - other))
    # at a midpoint: the exact value is s + e; move toward it if it is on the other's side
    toward_other = midpoint & (((other > r64) & (e > 0)) | ((other < r64) & (e < 0)))
    return np.where(toward_other, other.astype(np.float32), r).astype(np.float32)


def exp2_sw_numpy(x) -> np.ndarray:
    """2^x, float32, computed with exactly the device function's float32 operations."""
    x = np.asarray(x, np.float32)
    xc = np.fmax(x, np.float32(CLAMP_LO))  # fmax: NaN -> the other operand, like max.f32
    # add.rm.f32(x, 2^23 + 2^22) is exactly 2^23 + 2^22 + floor(x) (the spacing there is 1);
    # a float64 sum would round tiny negative x to the magic itself before any round-down
    r = np.float32(ROUND_MAGIC) + np.floor(xc)
    j = r - np.float32(ROUND_MAGIC)  # exact
    f = xc - j  # exact, in [0, 1)
    c0, c1, c2, c3 = (np.float32(c) for c in POLY_COEFFS)
    p = fma_f32(fma_f32(fma_f32(c3, f, c2), f, c1), f, c0)
    shifted = (r.view(np.int32).astype(np.int64) << 23) & 0xFFFFFFFF  # shl.b32
    out = (p.view(np.int32).astype(np.int64) + shifted) & 0xFFFFFFFF  # add.s32 (wraps)
    return out.astype(np.uint32).view(np.float32)


# ---------------------------------------------------------------------------------------------
# device functions (CuTe-DSL)
# ---------------------------------------------------------------------------------------------
try:
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op
except ImportError:  # the numpy twin stays usable without the compiler
    cutlass = None

if cutlass is not None:

    @dsl_user_op
    def _add_round_down(x: Float32, y: Float32, *, loc=None, ip=None) -> Float32:
        return Float32(llvm.inline_asm(
            T.f32(), [Float32(x).ir_value(loc=loc, ip=ip), Float32(y).ir_value(loc=loc, ip=ip)],
            "add.rm.f32 $0, $1, $2;", "=f,f,f",
            has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc, ip=ip))

    @dsl_user_op
    def _scale_by_exponent(rounded: Float32, poly: Float32, *, loc=None, ip=None) -> Float32:
        """bits(poly) + (bits(rounded) << 23) as a signed integer add (ALU pipe)."""
        return Float32(llvm.inline_asm(
            T.f32(),
            [Float32(rounded).ir_value(loc=loc, ip=ip), Float32(poly).ir_value(loc=loc, ip=ip)],
            "{\n\t.reg .s32 r_i, p_i, e_i, o_i;\n\t"
            "mov.b32 r_i, $1;\n\tmov.b32 p_i, $2;\n\t"
            "shl.b32 e_i, r_i, 23;\n\tadd.s32 o_i, e_i, p_i;\n\tmov.b32 $0, o_i;\n\t}\n",
            "=f,f,f",
            has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc, ip=ip))

    @dsl_user_op
    def exp2_sw(x: Float32, *, loc=None, ip=None) -> Float32:
        """2^x on the FMA pipe (scalar form)."""
        xc = cute.arch.fmax(Float32(x), Float32(CLAMP_LO), loc=loc, ip=ip)
        r = _add_round_down(xc, Float32(ROUND_MAGIC), loc=loc, ip=ip)
        f = xc - (r - Float32(ROUND_MAGIC))
        c0, c1, c2, c3 = POLY_COEFFS
        p = Float32(c3)
        for c in (c2, c1, c0):
            p = cute.math.fma(p, f, Float32(c))  # one rounding, like the numpy twin
        return _scale_by_exponent(r, p, loc=loc, ip=ip)

    @dsl_user_op
    def exp2_sw_x2(x: Float32, y: Float32, *, loc=None, ip=None):
        """(2^x, 2^y) with packed f32x2 adds and FMAs (FFMA2 / FADD2 on sm_100)."""
        xc = cute.arch.fmax(Float32(x), Float32(CLAMP_LO), loc=loc, ip=ip)
        yc = cute.arch.fmax(Float32(y), Float32(CLAMP_LO), loc=loc, ip=ip)
        magic = (Float32(ROUND_MAGIC), Float32(ROUND_MAGIC))
        r = cute.arch.add_packed_f32x2((xc, yc), magic, rnd="rm", loc=loc, ip=ip)
        j = cute.arch.sub_packed_f32x2(r, magic, loc=loc, ip=ip)
        f = cute.arch.sub_packed_f32x2((xc, yc), j, loc=loc, ip=ip)
        c0, c1, c2, c3 = POLY_COEFFS
        p = (Float32(c3), Float32(c3))
        for c in (c2, c1, c0):
            p = cute.arch.fma_packed_f32x2(p, f, (Float32(c), Float32(c)), loc=loc, ip=ip)
        return (_scale_by_exponent(r[0], p[0], loc=loc, ip=ip),
                _scale_by_exponent(r[1], p[1], loc=loc, ip=ip))
