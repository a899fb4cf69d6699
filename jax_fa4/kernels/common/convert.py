"""Packing float32 accumulators into MMA operands: 16-bit (bf16 / fp16), two per instruction,
and e4m3 (the FP8 forward's P), four per 32-bit register.

The generic element-wise conversion does not vectorise; ``cvt.rn.{bf16x2,f16x2}.f32`` converts a
pair into one 32-bit register, which is what an MMA operand fragment holds.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def cvt_pack_f32x2(a: Float32, b: Float32, to_bf16: bool, *, loc=None, ip=None) -> Int32:
    """Two f32 -> one 32-bit register holding (a, b) as bf16x2 / f16x2 (a in the low half)."""
    kind = "bf16x2" if to_bf16 else "f16x2"
    return Int32(llvm.inline_asm(
        T.i32(),
        [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{kind}.f32 $0, $2, $1;",
        "=r,f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip,
    ))


@cute.jit
def convert_f32_pairs(src: cute.Tensor, dst: cute.Tensor, to_bf16: cutlass.Constexpr[bool]):
    """dst (16-bit, compact) <- src (f32), element i <-> element i, two at a time."""
    dst32 = cute.recast_tensor(dst, Int32)
    for i in cutlass.range_constexpr(cute.size(dst32)):
        dst32[i] = cvt_pack_f32x2(src[2 * i], src[2 * i + 1], to_bf16)


@dsl_user_op
def cvt_pack_e4m3x4(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None,
                    ip=None) -> Int32:
    """Four f32 -> one 32-bit register of e4m3 bytes (a, b, c, d) from the low byte up, rounded
    to nearest, saturated to ±448."""
    args = [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)]
    return Int32(llvm.inline_asm(
        T.i32(), args,
        "{\n.reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"  # the first operand goes to the high byte
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
        "mov.b32 $0, {lo, hi};\n}",
        "=r,f,f,f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip,
    ))


@cute.jit
def convert_p_e4m3(acc: cute.Tensor, dst: cute.Tensor):
    """dst (the e4m3 register-A fragment ((4, 2, 2), M, K) of a P·V WGMMA) <- acc (the QK
    accumulator ((2, 2, V), M, 1), f32), packing the values as they lie: word (r, h) of K step
    kk (32 keys) takes the column pairs of the accumulator's 8-column groups 4kk + 2h and
    4kk + 2h + 1 at row half r. The operand's key order is thus permuted within each group of
    32 keys (fwd_config.fp8_value_permutation, which V's rows must follow)."""
    dst32 = cute.recast_tensor(dst, Int32)
    v = cute.size(acc, mode=[0]) // 4  # 8-column groups
    m = cute.size(acc, mode=[1])
    k_steps = v // 4
    assert cute.size(dst32) == 4 * m * k_steps, "P's fragment does not match the accumulator"
    for mi in cutlass.range_constexpr(m):
        for kk in cutlass.range_constexpr(k_steps):
            for h in cutlass.range_constexpr(2):
                for r in cutlass.range_constexpr(2):
                    g = 4 * kk + 2 * h  # first of the two 8-column groups
                    base = 2 * r + 4 * v * mi
                    dst32[r + 2 * h + 4 * mi + 4 * m * kk] = cvt_pack_e4m3x4(
                        acc[base + 4 * g], acc[base + 4 * g + 1],
                        acc[base + 4 * (g + 1)], acc[base + 4 * (g + 1) + 1])
