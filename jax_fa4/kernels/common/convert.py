"""Packing float32 accumulators into 16-bit operands (bf16 / fp16), two per instruction.

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
