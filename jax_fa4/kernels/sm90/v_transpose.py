"""The FP8 forward's V transpose in shared memory, device side: one staged (tile_n, Dv) e4m3 tile
into the P·V WGMMA's K-major, key-permuted (Dv, tile_n) operand, by the producer warpgroup's four
warps with ``ldmatrix.x4.trans`` / ``prmt`` / ``stmatrix.x4`` (the plan and its reasoning:
v_transpose_plan.py). Varlen and paged calls clear, in the highest key block, the bytes of the keys
past the sequence in registers (:meth:`VTransposer.stage`'s ``keys_left``)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from jax_fa4.kernels.sm90.v_transpose_plan import (SELECT_EVEN_DIM, SELECT_ODD_DIM,
                                                   VTransposePlan, smem_offset)


@dsl_user_op
def ldmatrix_x4_trans(addr: Int32, offset: int, *, loc=None, ip=None) -> tuple:
    """``ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16`` from the shared address ``addr +
    offset`` (this lane's row of the four matrices): four 32-bit registers."""
    words = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4), [Int32(addr).ir_value(loc=loc, ip=ip)],
        f"ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{$0, $1, $2, $3}}, [$4+{offset}];",
        "=r,=r,=r,=r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)
    return tuple(Int32(llvm.extractvalue(T.i32(), words, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def stmatrix_x4(addr: Int32, offset: int, words: tuple, *, loc=None, ip=None) -> None:
    """``stmatrix.sync.aligned.m8n8.x4.shared.b16`` of four 32-bit registers to the shared
    address ``addr + offset`` (this lane's row of the four matrices)."""
    llvm.inline_asm(
        None, [Int32(addr).ir_value(loc=loc, ip=ip),
               *(Int32(w).ir_value(loc=loc, ip=ip) for w in words)],
        f"stmatrix.sync.aligned.m8n8.x4.shared.b16 [$0+{offset}], {{$1, $2, $3, $4}};",
        "r,r,r,r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)


@dsl_user_op
def lane_idx_here(*, loc=None, ip=None) -> Int32:
    """The lane index, read where it is used (``mov`` from ``%laneid`` as a volatile asm):
    ptxas neither hoists it nor what is computed from it out of a loop, so values derived from
    it (the varlen / paged transposer's lane bases) take no register through the loop."""
    return Int32(llvm.inline_asm(T.i32(), [], "mov.u32 $0, %laneid;", "=r",
                                 has_side_effects=True, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def byte_perm(a: Int32, b: Int32, selector: Int32, *, loc=None, ip=None) -> Int32:
    """``prmt.b32``: byte i of the result is byte (selector >> 4i) & 7 of (b:a), a the low
    word."""
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(x).ir_value(loc=loc, ip=ip) for x in (a, b, selector)],
        "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))


def check_layouts(plan: VTransposePlan, staged: cute.ComposedLayout, vt: cute.ComposedLayout,
                  staged_stages: int, vt_stages: int) -> None:
    """Trace time: the CuTe layouts of the staging buffer (tile_n, Dv) and of Vt (Dv, tile_n)
    place every 16-byte chunk where v_transpose_plan.smem_offset says (the plan's addresses
    assume it), and their stages are contiguous and 1024-byte multiples (the lane bases' XOR
    needs the stage base's low 10 bits clear)."""
    for layout, rows, cols, stages in ((staged, plan.tile_n, plan.head_dim_v, staged_stages),
                                       (vt, plan.head_dim_v, plan.tile_n, vt_stages)):
        if (rows * cols) % 1024:
            raise ValueError(f"a ({rows}, {cols}) stage is not a multiple of 1024 bytes")
        for stage in range(stages):
            for row in range(rows):
                for col in range(0, cols, 16):
                    want = stage * rows * cols + smem_offset(rows, cols, row, col)
                    if layout((row, col, stage)) != want:
                        raise ValueError(f"({rows}, {cols}) layout: ({row}, {col}, {stage}) at "
                                         f"{layout((row, col, stage))}, the plan says {want}")


class VTransposer:
    """One producer thread's part of every V transpose: its lane bases and prmt selectors
    (computed once, from the warp and lane), and :meth:`stage`, one staged tile."""

    def __init__(self, plan: VTransposePlan, warp: Int32, lane: Int32):
        self.plan = plan
        self.read_base = plan.read_base(warp, lane)
        self.write_base = plan.write_base(warp, lane)
        # lanes 0..15 keep (even dim, odd dim), lanes 16..31 swap them (v_transpose_plan)
        self.select_first = SELECT_EVEN_DIM + (lane >> 4) * (SELECT_ODD_DIM - SELECT_EVEN_DIM)
        self.select_second = self.select_first ^ (SELECT_EVEN_DIM ^ SELECT_ODD_DIM)

    def stage(self, staged_addr: Int32, vt_addr: Int32, keys_left: Int32 | None = None) -> None:
        """Transpose the staged tile at shared address ``staged_addr`` into the Vt stage at
        ``vt_addr`` (both 1024-byte aligned): this warp's Dv / 64 · tile_n / 32 ldmatrix,
        4·that prmt and as many stmatrix (unrolled at trace time; an XOR constant of 0 costs
        no instruction). ``keys_left`` (varlen / paged, a block holding keys past the
        sequence): the block's valid keys minus this lane's ``plan.lane_key``; the bytes of
        the keys past them are cleared in the words before stmatrix (one AND mask per pair
        of a key-half pair, from four selects: :meth:`VTransposePlan.key_mask`)."""
        plan = self.plan
        read = staged_addr + self.read_base
        write = vt_addr + self.write_base
        # one chunk's reads share an XOR, one key-half pair's writes another: the pairs outside,
        # so that a single XORed write address is live at a time (the producer has 24 registers)
        read_c = [read ^ x if x else read for x in (plan.read_step(c, 0)[0]
                                                     for c in range(plan.chunks))]
        for o in range(plan.half_pairs):
            x_write, _ = plan.write_step(0, o)
            write_o = write ^ x_write if x_write else write
            masks = None
            if keys_left is not None:  # (the same for every chunk of the key-half pair)
                masks = [self.key_mask(keys_left, plan.mask_thresholds(o, p)) for p in (0, 1)]
            for c in range(plan.chunks):
                x_read, off_read = plan.read_step(c, o)
                x, off_write = plan.write_step(c, o)
                assert (x_read, x) == (plan.read_step(c, 0)[0], x_write), \
                    "a chunk's reads and a key-half pair's writes differ by offsets only"
                r0, r1, r2, r3 = ldmatrix_x4_trans(read_c[c], off_read)
                words = (byte_perm(r0, r1, self.select_first),
                         byte_perm(r0, r1, self.select_second),
                         byte_perm(r2, r3, self.select_first),
                         byte_perm(r2, r3, self.select_second))
                if masks is not None:
                    words = tuple(w & masks[i // 2] for i, w in enumerate(words))
                stmatrix_x4(write_o, off_write, words)

    @staticmethod
    def key_mask(keys_left: Int32, thresholds: tuple[int, ...]) -> Int32:
        """The AND mask of a pair's words: byte j kept iff ``keys_left > thresholds[j]``."""
        mask = Int32(0)
        for j, threshold in enumerate(thresholds):
            byte = Int32((0xFF << (8 * j)) - (1 << 32 if j == 3 else 0))  # (as a signed int32)
            mask = mask | Int32(cutlass.select_(keys_left > threshold, byte, Int32(0)))
        return mask
