"""FlashAttention backward for Hopper (sm_90a), main kernel, written in CuTe-DSL.

Computes dK, dV and a float32 partial dQ (see bwd_config.py for the call contract and the
dq_accum layout; bwd_postprocess.py turns dq_accum into dq).

Features: bf16/fp16, head dims from bwd_tuning.TUNING_TABLE, dynamic batch / sequence lengths /
head counts (one compile serves all), GQA/MQA (query head h reads kv head h // (H / Hkv); GQA
configs write float32 dK/dV per query head, group_heads configs one CTA per kv head that walks
its group's query heads and writes dK/dV per kv head), key-length tail, bottom-right aligned
causal and sliding-window masks with query-block skipping (a block is masked only when it cuts a
boundary), softcap with its derivative.

Structure (one CTA = one block of tile_n keys of one (batch, query head); not persistent):
  * warpgroup 0 = producer: gives registers back (setmaxnreg).
      warp 0 issues the TMA loads: K and V once (one mbarrier), then Q[m] and dO[m] for every
      visited query block m through two `stages`-deep PipelineTmaAsync pipelines.
      warp 1 is the dQ warp: per query block it waits (named barrier DQ_FULL) for both MMA
      warpgroups' dQ chunks in shared memory, reduce-adds each into dq_accum with one
      `cp.reduce.async.bulk.add.f32`, and hands the buffers back (DQ_EMPTY) once read.
  * warpgroups 1, 2 = MMA (consumers), per query block m:
      S = Q·Kᵀ, dP = dO·Vᵀ (WGMMA, operands in shared memory; dP overlaps the exp of S)
      P = exp2(S·scale_log2 − lse_log2)
          [softcap: S ← tanh(S·scale/softcap), scale_log2 ← softcap·log2 e]
      P ← 0 outside the mask (only on blocks that cut a boundary)
      dS = P∘(dP − delta) [∘ (1 − tanh²)]
      P, dS → 16 bits → shared memory (stmatrix), fence, one named barrier for both warpgroups
      dV += Pᵀ·dO, dQ = dS·K, dK += dSᵀ·Q (WGMMA, all operands in shared memory)
      dQ: each warpgroup writes its accumulator fragment to its own shared-memory buffer in
      fragment order (16-byte stores, conflict-free) and signals the dQ warp; it never waits on
      global memory.
    lse_log2 and delta are read from global memory by each thread for its own rows, one query
    block ahead (requested once the current block's dS is computed, so the load latency hides
    under the dV / dQ / dK GEMMs; rows past seqlen_q read as lse = +inf, delta = 0, so P = dS = 0
    there: no row mask is ever needed). ``cfg.stats_smem``: warp 2 of the producer warpgroup
    loads them instead (cp.async into a shared-memory stage per Q stage, ``load_stats``), and
    the MMA threads read their rows from there (``read_stats``).
  * epilogue: dK ·= softmax_scale; dtype configs: convert, stmatrix into K's / V's shared memory,
    TMA store (rows past seqlen_k clipped by TMA); GQA configs: float32 stores from registers.
    A key block that no query sees (local window) writes zeros.

Deterministic mode (``cfg.deterministic``): the key blocks reduce-add into each query block's dQ
in a fixed order. A per-query-block int32 counter in global memory holds "the last key block that
added + 1"; before its adds the dQ warp spins (ld.acquire.gpu) until the counter shows its
predecessor, and publishes itself (st.release.gpu) once the adds have completed, one query block
later so that the completion latency overlaps the next block's work. The key blocks visiting a
query block form a contiguous range; the order is ascending (predecessor n − 1), except under a
causal mask: descending (predecessor n + 1) with the grid launched from the last key block down,
which is the order in which a causal schedule reaches each query block anyway. Either way a key
block only waits on key blocks of the same (head, batch) launched before it: no deadlock.

``cfg.swap_sdp`` (the head dim 128 row, with ``stats_smem``): the S / dP GEMMs computed
transposed, so that Pᵀ and dSᵀ stay in registers as the A operands of the dV / dK GEMMs
(``swapped_loop``).
``cfg.dq_red`` (with swap_sdp, the head dim 128 row): each MMA thread adds its dQ fragment into
dq_accum itself (``red.global.add.v4.f32``); no dQ buffer, dQ warp, stores, fence or barriers
per block.
Unmasked, non-deterministic, non-swapped kernels walk their query blocks from a start that
depends on the key block (``rotate``), so that lockstep key blocks add into different dQ blocks.

Varlen (``cfg.varlen``, called by jax_fa4/backends/sm90.py): q, k, v, dout, dk, dv are sequences
packed as one batch entry. CTA (x, head) takes key block ``work[x, 1]`` of sequence ``work[x, 0]``
(the caller lists the work items, and so chooses their launch order); the sequence's offsets,
lengths and first dq_accum tile come in the same work row (one round of loads; cu_seqlens_k is read
only by the item that zeroes the padding keys), its loads from TMA views offset to its first row
(rows past its end are the next sequence's: the key tail is masked and the query rows past seqlen_q
have P = dS = 0 as above); its query block m reduce-adds into dq_accum tile ``(cu_seqlens_q[b] +
b·tile_m) // tile_m + m``, which no other sequence touches; dK / dV of a key block inside the
sequence are TMA-stored from the sequence's first row on, those of its last, partial block row by
row below seqlen_k (16-byte pieces: a whole-tile TMA store would overwrite the next sequence's
rows).

``cfg.sink_grad`` (a learnable sink; params carries σ_h for every query head): before each
block's dS, every MMA thread adds Σ_rows e^{σ − lse_row}·Σ_cols P·dP of its elements to its own
running sum in shared memory (no register stays live across blocks: the MMA warpgroups have
none to spare), and at the end the CTA writes the sum of its 256 sums, in a fixed order, to
sink_part[batch, head, x]. Σ_j P_ij·dP_ij = dO_i·O_i with O as the forward accumulated it in
float32, so the caller's d sink (jax_fa4/autodiff.py) no longer takes the 16-bit output's
error through delta. The plain loop only (BwdConfig.validate).

Not yet: persistence.
"""

from __future__ import annotations

import enum
import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from jax_fa4.kernels.common.geometry import BwdBlocks, resolve_windows
from jax_fa4.kernels.common.convert import convert_f32_pairs
from jax_fa4.kernels.common.layout import (acc_view_as_a_operand, acc_view_mn, select_modes,
                                            transpose_mn)
from jax_fa4.kernels.common.operands import check_backward_operands
from jax_fa4.kernels.common.scores import score_scales
from jax_fa4.kernels.common.rows import store_rows, zero_padding_rows, zero_rows_from
from jax_fa4.kernels.common.views import seq_major, sequence
from jax_fa4.kernels.sm90.bwd_common import dq_fragment_view, make_tiled_mma_dq
from jax_fa4.kernels.sm90.common import make_smem_layout, wgmma
from jax_fa4.kernels.segments_config import (SEG_BULK_HI, SEG_BULK_LO, SEG_IDS, SEG_KEY_M_HI,
                                            SEG_KEY_M_LO, SEG_ROW_END, SEG_ROW_ID, SEG_ROW_START)
from jax_fa4.kernels.sm90.bwd_config import BwdConfig, sink_smem_floats
from jax_fa4.kernels.spec import LOG2_E, PARAM_SCALE, PARAM_SINKS

_FLT_MIN_NORMAL = 1.1754943508222875e-38  # 2**-126


class NamedBarrier(enum.IntEnum):
    # 0 is __syncthreads
    PDS = 1  # both MMA warpgroups: P / dS written (and the previous P / dS buffers free)
    DQ_FULL_WG0 = 2  # one per MMA warpgroup (+ the dQ warp): its dQ chunk is in shared memory
    DQ_FULL_WG1 = 3
    EPILOGUE = 4  # both MMA warpgroups: K / V shared memory free, then dK / dV written
    DQ_EMPTY_WG0 = 5  # one per MMA warpgroup (+ the dQ warp): its dQ buffer has been read
    DQ_EMPTY_WG1 = 6
    ZERO_TAIL_WG0 = 7  # varlen, one per MMA warpgroup: its zeroed tail rows are written
    ZERO_TAIL_WG1 = 8
    SINK_SUM = 9  # sink_grad: both MMA warpgroups' per-warp partial sums are in shared memory
    SEG_IDS = 10  # segments: the key block's ids are in shared memory


_MMA_REGS, _PRODUCER_REGS = 240, 24
#: The varlen work list's sequence value of the item that zeroes dK / dV outside every sequence
#: (bwd_config.varlen_attention_backward_signature).
ZERO_PADDING = -2


# ------------------------------------------------------------------------------------------------
# small device helpers (backward-only)
# ------------------------------------------------------------------------------------------------
@dsl_user_op
def bulk_reduce_add_f32(smem_ptr: cute.Pointer, gmem_ptr: cute.Pointer, num_bytes: int,
                        *, loc=None, ip=None) -> None:
    """gmem[0:num_bytes] += smem[0:num_bytes] (float32), one bulk async op (bulk_group)."""
    llvm.inline_asm(
        None,
        [gmem_ptr.llvm_ptr, smem_ptr.toint(loc=loc, ip=ip).ir_value(),
         Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip,
    )


@dsl_user_op
def red_add_v4_f32(gmem_ptr: cute.Pointer, a: Float32, b: Float32, c: Float32, d: Float32,
                   *, loc=None, ip=None) -> None:
    """gmem[0:4] += (a, b, c, d) (float32, 16-byte aligned): one ``red.global.add.v4.f32``."""
    llvm.inline_asm(
        None,
        [gmem_ptr.llvm_ptr] + [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)],
        "red.global.add.v4.f32 [$0], {$1, $2, $3, $4};",
        "l,f,f,f,f",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip,
    )


@dsl_user_op
def spin_until_equal(ptr: cute.Pointer, expected: Int32, *, loc=None, ip=None) -> None:
    """Poll an int32 in global memory with ``ld.acquire.gpu`` until it equals ``expected``.
    One asm block (its loop is invisible to LLVM, which otherwise keeps more values live across
    the enclosing m-block loop and pushes the tightest variants into spills)."""
    llvm.inline_asm(
        None, [ptr.llvm_ptr, Int32(expected).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .pred p;\n\t.reg .s32 v;\n"
        "SPIN_UNTIL_EQUAL:\n\t"
        "ld.acquire.gpu.global.s32 v, [$0];\n\t"
        "setp.ne.s32 p, v, $1;\n\t"
        "@p bra SPIN_UNTIL_EQUAL;\n}\n",
        "l,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)


@dsl_user_op
def st_release_gpu_s32(ptr: cute.Pointer, value: Int32, *, loc=None, ip=None) -> None:
    """``st.release.gpu`` of one int32 to global memory."""
    llvm.inline_asm(
        None, [ptr.llvm_ptr, Int32(value).ir_value(loc=loc, ip=ip)],
        "st.release.gpu.global.s32 [$0], $1;", "l,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)


@dsl_user_op
def thread_idx_x_again(*, loc=None, ip=None) -> Int32:
    """``%tid.x``, read anew: an asm read with side effects, which LLVM may not merge with the
    kernel's first read, so a value derived from the thread index before a long loop need not
    stay live (or spill) to be used after it."""
    return Int32(llvm.inline_asm(
        T.i32(), [], "mov.u32 $0, %tid.x;", "=r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))


# ------------------------------------------------------------------------------------------------
# the kernel
# ------------------------------------------------------------------------------------------------
class FlashAttentionBackwardSm90:
    def __init__(self, cfg: BwdConfig):
        cfg.validate()
        self.cfg = cfg
        self.dtype = cutlass.BFloat16 if cfg.dtype == "bfloat16" else cutlass.Float16
        self.is_bf16 = cfg.dtype == "bfloat16"
        self.hdim, self.hdimv = cfg.head_dim, cfg.head_dim_v
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.stages, self.pds_stages = cfg.stages, cfg.pds_stages
        self.is_causal = cfg.mask == "causal"
        self.is_local = cfg.mask == "local"
        self.has_softcap = cfg.has_softcap
        self.gqa = cfg.gqa
        self.swap = cfg.swap_sdp
        self.deterministic = cfg.deterministic
        self.varlen = cfg.varlen
        self.sink_grad = cfg.sink_grad  # (bwd_config.BwdConfig)
        self.segments = cfg.segments  # (bwd_config.BwdConfig)
        self.group_heads = cfg.group_heads  # (bwd_config.BwdConfig)
        # deterministic + causal: dQ adds in descending key-block order, key blocks launched
        # from the last one down. A causal key block's first query block is the diagonal one,
        # so the higher key block n+1 reaches each query block two (tile_n / tile_m) steps
        # before n does: the order matches the schedule and nobody waits. Ascending order (the
        # only deadlock-free one in launch order otherwise) makes a wavefront there.
        self.descending = cfg.deterministic and cfg.mask == "causal"
        self.reverse_launch = cfg.reverse_launch or self.descending
        # unmasked, not deterministic: key block n visits the query blocks from n on (mod their
        # count), so that the key blocks of a head, which run in lockstep, reduce-add into
        # different dQ blocks at any time instead of all into the same one (masked kernels
        # start each key block at its own first query block already).
        # (Not with swap_sdp: its two extra loop registers spill there at hdim 128 with GQA.)
        self.rotate = cfg.mask == "none" and not cfg.deterministic and not cfg.swap_sdp
        self.stats_smem = cfg.stats_smem  # (bwd_config.BwdConfig)
        self.dq_red = cfg.dq_red  # (bwd_config.BwdConfig)
        self.wg_fragments = cfg.wg_fragments  # (bwd_config.BwdConfig)
        self.stats_padded = cfg.stats_padded  # (bwd_config.BwdConfig)
        self.dq_elems = 4 if cfg.dq_red else cfg.tile_m * cfg.head_dim  # (dq_red: no dQ buffer)
        self.num_mma_threads = 256
        self.num_threads = cfg.num_threads
        lay = cfg.wg_layouts()
        self.wg_sdp, self.wg_dkv, self.wg_dq = lay["sdp"], lay["dkv"], lay["dq"]
        # floats of acc_dQ per thread and per warpgroup
        self.dq_regs = self.tile_m * self.hdim // self.num_mma_threads
        self.dq_wg_elems = 128 * self.dq_regs

    # ---------------------------------------------------------------------------------------------
    # Host side
    # ---------------------------------------------------------------------------------------------
    def _tiled_mmas(self):
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        dt = self.dtype
        (sm, sn), (km, kn) = self.wg_sdp, self.wg_dkv
        if self.swap:
            # Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ (one 64-key slice per warpgroup); dV += Pᵀ·dO and
            # dK += dSᵀ·Q with A = Pᵀ / dSᵀ from registers; dQ = dS·K with A = the transposed
            # view of dSᵀ in shared memory (MN-major). dQ's accumulator layout is that of
            # make_tiled_mma_dq (the postprocess depends on it).
            rmem = warpgroup.OperandSource.RMEM
            mma_sdp = sm90_utils.make_trivial_tiled_mma(dt, dt, K, K, Float32, (sm, sn, 1),
                                                        (64, self.tile_m // sn))
            mma_dk = sm90_utils.make_trivial_tiled_mma(dt, dt, K, MN, Float32, (km, kn, 1),
                                                       (64, self.hdim // kn), a_source=rmem)
            mma_dv = sm90_utils.make_trivial_tiled_mma(dt, dt, K, MN, Float32, (km, kn, 1),
                                                       (64, self.hdimv // kn), a_source=rmem)
            mma_dq = sm90_utils.make_trivial_tiled_mma(dt, dt, MN, MN, Float32, (1, 2, 1),
                                                       (64, self.hdim // 2))
            return mma_sdp, mma_dk, mma_dv, mma_dq
        mma_sdp = sm90_utils.make_trivial_tiled_mma(dt, dt, K, K, Float32, (sm, sn, 1),
                                                    (64, self.tile_n // sn))
        mma_dk = sm90_utils.make_trivial_tiled_mma(dt, dt, MN, MN, Float32, (km, kn, 1),
                                                   (64, self.hdim // kn))
        mma_dv = sm90_utils.make_trivial_tiled_mma(dt, dt, MN, MN, Float32, (km, kn, 1),
                                                   (64, self.hdimv // kn))
        mma_dq = make_tiled_mma_dq(dt, self.tile_m, self.hdim)
        return mma_sdp, mma_dk, mma_dv, mma_dq

    def _smem_layouts(self):
        dt, tm, tn, D, Dv = self.dtype, self.tile_m, self.tile_n, self.hdim, self.hdimv
        kn = self.wg_dkv[1]
        qn = self.wg_dq[1]
        sQ = make_smem_layout(dt, tm, D, D // kn, self.stages)  # also dK's B operand (MN-major)
        sdO = make_smem_layout(dt, tm, Dv, Dv // kn, self.stages)  # also dV's B operand
        sK = make_smem_layout(dt, tn, D, D // qn)  # also dQ's B operand (MN-major)
        # V's swizzle atom must tile each warpgroup's dV columns (the epilogue stores dV through
        # sV with the dV GEMM's layout): as wide as V's row when Dv / kn is a multiple of the
        # 64-column atom, else Dv / kn wide (192: 96-column slices of 32-column atoms)
        sV = make_smem_layout(dt, tn, Dv, Dv if (Dv // kn) % 64 == 0 else Dv // kn)
        # P / dS: written along tile_n by the S/dP warpgroups, read transposed (M = tile_n slices)
        # by the dK/dV GEMMs and K-major by the dQ GEMM
        if self.swap:
            # dSᵀ (keys × queries), read as dQ's MN-major A operand (all 64 queries per
            # warpgroup); P stays in registers
            return sQ, sdO, sK, sV, make_smem_layout(dt, tn, tm, tm, self.pds_stages)
        mms = math.gcd(tn // self.wg_sdp[1], tn // self.wg_dkv[0])
        sPdS = make_smem_layout(dt, tm, tn, mms, self.pds_stages)
        return sQ, sdO, sK, sV, sPdS

    @cute.jit
    def __call__(self, stream: cuda.CUstream, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mdO: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor, mParams: cute.Tensor,
                 mdQacc: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                 mdQsem: cute.Tensor | None = None, mCuSeqlensQ: cute.Tensor | None = None,
                 mCuSeqlensK: cute.Tensor | None = None, mWork: cute.Tensor | None = None,
                 mSinkPart: cute.Tensor | None = None, mSegTiles: cute.Tensor | None = None,
                 mSegKeys: cute.Tensor | None = None, mSegRows: cute.Tensor | None = None,
                 mKvIds: cute.Tensor | None = None):
        segs = (mSegTiles, mSegKeys, mSegRows, mKvIds)
        if const_expr(any(self.segments != (t is not None) for t in segs)):
            raise TypeError("seg_tiles, seg_keys, seg_rows and kv_ids are passed exactly when "
                            "the config has segments")
        if const_expr(self.segments and any(t.element_type != Int32 for t in segs)):
            raise TypeError("the segment tables must be int32")
        if const_expr(self.sink_grad != (mSinkPart is not None)):
            raise TypeError("sink_part is passed exactly when the config is sink_grad")
        if const_expr(mSinkPart is not None and mSinkPart.element_type != Float32):
            raise TypeError("sink_part must be float32")
        if const_expr(self.deterministic != (mdQsem is not None)):
            raise TypeError("dq_sem is passed exactly when the config is deterministic")
        if const_expr(any(self.varlen != (t is not None)
                          for t in (mCuSeqlensQ, mCuSeqlensK, mWork))):
            raise TypeError("cu_seqlens_q, cu_seqlens_k and work are passed exactly when the "
                            "config is varlen")
        for name, t in (("cu_seqlens_q", mCuSeqlensQ), ("cu_seqlens_k", mCuSeqlensK),
                        ("work", mWork)):
            if const_expr(t is not None and t.element_type != Int32):
                raise TypeError(f"{name} must be int32")
        if const_expr(mdQsem is not None and mdQsem.element_type != Int32):
            raise TypeError("dq_sem must be int32")
        check_backward_operands(self.dtype, self.gqa, mQ, mK, mV, mdO, mLSE, mDelta, mParams,
                                mdQacc, mdK, mdV)
        D, Dv = self.hdim, self.hdimv
        mQ, mK, mdK = seq_major(mQ, D), seq_major(mK, D), seq_major(mdK, D)
        mV, mdO, mdV = seq_major(mV, Dv), seq_major(mdO, Dv), seq_major(mdV, Dv)
        mLSE, mDelta, mdQacc = [select_modes(t, (2, 1, 0)) for t in (mLSE, mDelta, mdQacc)]
        if const_expr(mdQsem is not None):
            mdQsem = select_modes(mdQsem, (2, 1, 0))  # (m_blocks, H, B)
        if const_expr(mSinkPart is not None):
            mSinkPart = select_modes(mSinkPart, (2, 1, 0))  # (X, H, B)

        mma_sdp, mma_dk, mma_dv, mma_dq = self._tiled_mmas()
        sQ_layout, sdO_layout, sK_layout, sV_layout, sPdS_layout = self._smem_layouts()

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            g2s, mQ, cute.select(sQ_layout, mode=[0, 1]), (self.tile_m, D))
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(
            g2s, mdO, cute.select(sdO_layout, mode=[0, 1]), (self.tile_m, Dv))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(g2s, mK, sK_layout, (self.tile_n, D))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(g2s, mV, sV_layout, (self.tile_n, Dv))
        tma_atom_dK, tma_dK, tma_atom_dV, tma_dV = None, mdK, None, mdV
        if const_expr(not self.gqa):
            s2g = cpasync.CopyBulkTensorTileS2GOp()
            tma_atom_dK, tma_dK = cpasync.make_tiled_tma_atom(s2g, mdK, sK_layout, (self.tile_n, D))
            tma_atom_dV, tma_dV = cpasync.make_tiled_tma_atom(s2g, mdV, sV_layout,
                                                              (self.tile_n, Dv))

        self.tx_bytes_q = self.tile_m * D * self.dtype.width // 8
        self.tx_bytes_do = self.tile_m * Dv * self.dtype.width // 8
        self.tx_bytes_kv = self.tile_n * (D + Dv) * self.dtype.width // 8

        p_elems = 64 if self.swap else cute.cosize(sPdS_layout)  # (swap: P in registers)
        # stats_smem's buffers (else a few unused bytes in the barriers' 1 KB in front of sQ)
        stats_stages = self.stages if self.stats_smem else 1
        stats_elems = stats_stages * self.tile_m if self.stats_smem else 4
        dq_elems = self.dq_elems
        sink_elems = sink_smem_floats(self.num_mma_threads) if self.sink_grad else 4
        kv_id_elems = self.tile_n if self.segments else 4

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            mbar_stats: cute.struct.MemRange[cutlass.Int64, 2 * stats_stages]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, stats_elems], 16]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, stats_elems], 16]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, p_elems], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPdS_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, dq_elems], 1024]
            sSink: cute.struct.Align[cute.struct.MemRange[Float32, sink_elems], 16]
            sKvIds: cute.struct.Align[cute.struct.MemRange[Int32, kv_id_elems], 16]

        # one CTA per (key block, query head, batch); group_heads: per kv head
        heads = mK.shape[2] if const_expr(self.group_heads) else mQ.shape[2]
        grid = (cute.ceil_div(mK.shape[0], self.tile_n), heads, mQ.shape[3])
        mdK_rows, mdV_rows = None, None  # varlen, 16-bit dK / dV: the tensors for row stores
        if const_expr(self.varlen):  # one CTA per (work item, query head)
            grid = (mWork.shape[0], mQ.shape[2], 1)
            if const_expr(not self.gqa):
                mdK_rows, mdV_rows = mdK, mdV
        self.kernel(
            tma_Q, tma_K, tma_V, tma_dO, tma_dK, tma_dV, mLSE, mDelta, mParams, mdQacc,
            tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_dK, tma_atom_dV,
            sQ_layout, sdO_layout, sK_layout, sV_layout, sPdS_layout,
            mma_sdp, mma_dk, mma_dv, mma_dq, SharedStorage, mdQsem,
            mCuSeqlensQ, mCuSeqlensK, mWork, mdK_rows, mdV_rows, mSinkPart,
            mSegTiles, mSegKeys, mSegRows, mKvIds,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ---------------------------------------------------------------------------------------------
    # Device side
    # ---------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mdK: cute.Tensor, mdV: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor,
               mParams: cute.Tensor, mdQacc: cute.Tensor,
               tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
               tma_atom_dO: cute.CopyAtom, tma_atom_dK, tma_atom_dV,
               sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sPdS_layout: cute.ComposedLayout,
               mma_sdp: cute.TiledMma, mma_dk: cute.TiledMma, mma_dv: cute.TiledMma,
               mma_dq: cute.TiledMma, SharedStorage: cutlass.Constexpr,
               mdQsem: cute.Tensor | None, mCuSeqlensQ: cute.Tensor | None,
               mCuSeqlensK: cute.Tensor | None, mWork: cute.Tensor | None,
               mdK_rows: cute.Tensor | None, mdV_rows: cute.Tensor | None,
               mSinkPart: cute.Tensor | None, mSegTiles: cute.Tensor | None,
               mSegKeys: cute.Tensor | None, mSegRows: cute.Tensor | None,
               mKvIds: cute.Tensor | None):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO):
                cpasync.prefetch_descriptor(atom)
            if const_expr(not self.gqa):
                cpasync.prefetch_descriptor(tma_atom_dK)
                cpasync.prefetch_descriptor(tma_atom_dV)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        tma_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        mma_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads // 32)
        pipeline_kv = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_kv.data_ptr(), num_stages=1, producer_group=tma_thread,
            consumer_group=mma_warps, tx_count=self.tx_bytes_kv, defer_sync=True)
        pipeline_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=self.stages,
            producer_group=tma_thread, consumer_group=mma_warps, tx_count=self.tx_bytes_q,
            defer_sync=True)
        pipeline_do = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_do.data_ptr(), num_stages=self.stages,
            producer_group=tma_thread, consumer_group=mma_warps, tx_count=self.tx_bytes_do,
            defer_sync=True)
        pipeline_stats, sLSE, sDelta = None, None, None
        if const_expr(self.stats_smem):
            pipeline_stats = pipeline.PipelineCpAsync.create(
                barrier_storage=storage.mbar_stats.data_ptr(), num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         self.num_mma_threads),
                defer_sync=True)
            stats_layout = cute.make_layout((self.tile_m, self.stages))
            sLSE = storage.sLSE.get_tensor(stats_layout)
            sDelta = storage.sDelta.get_tensor(stats_layout)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sP = None
        if const_expr(not self.swap):
            sP = storage.sP.get_tensor(sPdS_layout.outer, swizzle=sPdS_layout.inner)
        sdS = storage.sdS.get_tensor(sPdS_layout.outer, swizzle=sPdS_layout.inner)
        sdQ = storage.sdQ.get_tensor(cute.make_layout(self.dq_elems))
        sSink = None
        if const_expr(self.sink_grad):
            sSink = storage.sSink.get_tensor(
                cute.make_layout(sink_smem_floats(self.num_mma_threads)))

        # Run-time scalars. Windows: -1 (any negative) = unbounded, clamped to a bound that covers
        # every key / query so that all block arithmetic stays small and in Int32.
        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        x_block = None  # sink_grad: this CTA's column of sink_part
        # varlen: work row x = (sequence, key block, its rows' offsets in the packed q and k,
        # its lengths, its first dq_accum tile) (one batch entry: batch = 0 below); spare and
        # padding rows have lengths 0. Seven independent loads: one round trip.
        q_offset, k_offset, dq_tile0, seq = None, None, None, None
        if const_expr(self.varlen):
            # the grid is (work rows, heads, 1): batch is the constant 0, not a register (reading
            # blockIdx.z kept one more value live into the producer's 24 registers: a spill)
            x, head, _ = cute.arch.block_idx()
            x_block = x
            batch = Int32(0)
            seq, n_block = mWork[x, 0], mWork[x, 1]
            q_offset, k_offset = mWork[x, 2], mWork[x, 3]
            seqlen_q, seqlen_k = mWork[x, 4], mWork[x, 5]
            # the sequence's first dq_accum tile: its blocks never share a tile with another's
            dq_tile0 = mWork[x, 6]
        window_left, window_right = resolve_windows(mParams, seqlen_q, seqlen_k, self.is_local)

        if const_expr(not self.varlen):
            n_block, head, batch = cute.arch.block_idx()
            x_block = n_block
        if const_expr(self.reverse_launch):
            # key blocks launch from the last one down (deterministic causal: each then waits
            # only on earlier launches)
            n_block = (seqlen_k + self.tile_n - 1) // self.tile_n - 1 - n_block
        group, head, head_kv, head_dkv = self.cta_heads(head, mQ.shape[2], mK.shape[2])
        block_info = BwdBlocks(self.tile_m, self.tile_n, self.is_causal, self.is_local,
                                  seqlen_q, seqlen_k, window_left, window_right)
        m_block_min, m_block_max = block_info.m_block_range(n_block)
        segs = None
        if const_expr(self.segments):
            # the query blocks with a row that shares an id with this key block (the caller's
            # table); a block outside its query tile's bulk is masked (mma, mask_p)
            m_block_min = cutlass.max(m_block_min, mSegKeys[batch, n_block, SEG_KEY_M_LO])
            m_block_max = cutlass.min(m_block_max, mSegKeys[batch, n_block, SEG_KEY_M_HI])
            segs = (mSegTiles, mSegRows, mKvIds,
                    storage.sKvIds.get_tensor(cute.make_layout(self.tile_n)))

        if warp_idx < 4:  # producer warpgroup
            cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
            if warp_idx == 0:
                self.load(mQ, mK, mV, mdO, sQ, sK, sV, sdO, tma_atom_Q, tma_atom_K, tma_atom_V,
                          tma_atom_dO, pipeline_kv, pipeline_q, pipeline_do,
                          n_block, head, head_kv, batch, m_block_min, m_block_max,
                          q_offset, k_offset, group)
            if const_expr(not self.dq_red):  # (dq_red: the MMA threads add dQ themselves)
                if warp_idx == 1:
                    self.store_dq(mdQacc, sdQ, mdQsem, n_block, head, batch, m_block_min,
                                  m_block_max, block_info, dq_tile0, group)
            if const_expr(self.stats_smem):
                if warp_idx == 2:
                    self.load_stats(mLSE, mDelta, sLSE, sDelta, pipeline_stats, n_block, head,
                                    batch, m_block_min, m_block_max, seqlen_q, group)
        else:  # MMA warpgroups
            cute.arch.setmaxregister_increase(_MMA_REGS)
            self.mma(mdK, mdV, mLSE, mDelta, mParams, sQ, sK, sV, sdO, sP, sdS, sdQ,
                     tma_atom_dK, tma_atom_dV, mma_sdp, mma_dk, mma_dv, mma_dq,
                     pipeline_kv, pipeline_q, pipeline_do, tidx - 128,
                     n_block, head, head_dkv, batch, m_block_min, m_block_max,
                     seqlen_q, seqlen_k, block_info, q_offset, k_offset, mdK_rows, mdV_rows,
                     seq, mCuSeqlensK, pipeline_stats, sLSE, sDelta, mdQacc,
                     (mSinkPart, sSink, x_block) if const_expr(self.sink_grad) else None,
                     segs, group)

    @cute.jit
    def load(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
             sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, sdO: cute.Tensor,
             tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
             tma_atom_dO: cute.CopyAtom, pipeline_kv, pipeline_q, pipeline_do,
             n_block: Int32, head: Int32, head_kv: Int32, batch: Int32,
             m_block_min: Int32, m_block_max: Int32, q_offset=None, k_offset=None, group=None):
        """The TMA warp: K and V of the key block once, then Q and dO of every visited query
        block (of ``head``, or with ``group`` of the group's query heads in turn)."""
        gK = cute.local_tile(sequence(mK, head_kv, batch, k_offset), (self.tile_n, self.hdim),
                             (n_block, 0))
        gV = cute.local_tile(sequence(mV, head_kv, batch, k_offset), (self.tile_n, self.hdimv),
                             (n_block, 0))
        one = cute.make_layout(1)
        tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, one, cute.group_modes(sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, one, cute.group_modes(sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))
        if m_block_max > m_block_min:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipeline_kv.producer_acquire(kv_state)
            cute.copy(tma_atom_K, tKgK, tKsK,
                      tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))
            cute.copy(tma_atom_V, tVgV, tVsV,
                      tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            if const_expr(group is None):
                self.load_head(mQ, mdO, sQ, sdO, tma_atom_Q, tma_atom_dO, pipeline_q,
                               pipeline_do, state, n_block, head, batch, m_block_min,
                               m_block_max, q_offset)
            else:
                for g in cutlass.range(group, unroll=1):
                    state = self.load_head(mQ, mdO, sQ, sdO, tma_atom_Q, tma_atom_dO, pipeline_q,
                                           pipeline_do, state, n_block, head + g, batch,
                                           m_block_min, m_block_max, q_offset)

    @cute.jit
    def load_head(self, mQ: cute.Tensor, mdO: cute.Tensor, sQ: cute.Tensor, sdO: cute.Tensor,
                  tma_atom_Q: cute.CopyAtom, tma_atom_dO: cute.CopyAtom, pipeline_q,
                  pipeline_do, state, n_block: Int32, head: Int32, batch: Int32,
                  m_block_min: Int32, m_block_max: Int32, q_offset=None):
        """Q and dO of query head ``head``'s visited query blocks into the pipelines' stages;
        returns the pipeline state after them."""
        gQ = cute.local_tile(sequence(mQ, head, batch, q_offset), (self.tile_m, self.hdim),
                             (None, 0))
        gdO = cute.local_tile(sequence(mdO, head, batch, q_offset), (self.tile_m, self.hdimv),
                              (None, 0))
        one = cute.make_layout(1)
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, one, cute.group_modes(sQ, 0, 2),
                                           cute.group_modes(gQ, 0, 2))
        tdOsdO, tdOgdO = cpasync.tma_partition(tma_atom_dO, 0, one, cute.group_modes(sdO, 0, 2),
                                               cute.group_modes(gdO, 0, 2))
        start = self.first_visit(n_block, m_block_min, m_block_max)
        for it in cutlass.range(m_block_min, m_block_max, unroll=1):
            m_block = self.m_block_at(it, start, m_block_min, m_block_max)
            pipeline_q.producer_acquire(state)
            cute.copy(tma_atom_Q, tQgQ[None, m_block], tQsQ[None, state.index],
                      tma_bar_ptr=pipeline_q.producer_get_barrier(state))
            pipeline_do.producer_acquire(state)
            cute.copy(tma_atom_dO, tdOgdO[None, m_block], tdOsdO[None, state.index],
                      tma_bar_ptr=pipeline_do.producer_get_barrier(state))
            state.advance()
        return state

    @cute.jit
    def store_dq(self, mdQacc: cute.Tensor, sdQ: cute.Tensor, mdQsem: cute.Tensor | None,
                 n_block: Int32, head: Int32, batch: Int32, m_block_min: Int32,
                 m_block_max: Int32, block_info: BwdBlocks, dq_tile0=None, group=None):
        """The dQ warp (warp 1 of the producer warpgroup): ``store_dq_head`` for ``head``, or
        with ``group`` (group_heads) for the group's query heads in turn, the hand-over
        running on from one head's last block to the next head's first."""
        if const_expr(group is None):
            self.store_dq_head(mdQacc, sdQ, mdQsem, n_block, head, batch, m_block_min,
                               m_block_max, block_info, dq_tile0)
        else:
            for g in cutlass.range(group, unroll=1):
                # the buffers go back after this head's last block too, unless it is the last
                more = cutlass.min(group - 1 - g, 1)
                self.store_dq_head(mdQacc, sdQ, mdQsem, n_block, head + g, batch, m_block_min,
                                   m_block_max, block_info, None, m_block_max + more)

    @cute.jit
    def store_dq_head(self, mdQacc: cute.Tensor, sdQ: cute.Tensor, mdQsem: cute.Tensor | None,
                      n_block: Int32, head: Int32, batch: Int32, m_block_min: Int32,
                      m_block_max: Int32, block_info: BwdBlocks, dq_tile0=None,
                      hand_back_end=None):
        """The dQ warp (warp 1 of the producer warpgroup). Per visited query block: wait until
        both MMA warpgroups have put their dQ chunk in shared memory, reduce-add the two chunks
        into dq_accum (one ``cp.reduce.async.bulk`` each, issued by lane 0), and hand the buffers
        back once the bulk copies have read them. The MMA warpgroups never wait on global memory.

        Deterministic: before the adds, spin until the query block's counter shows this key
        block's predecessor; publish this key block one query block later, once the adds are
        complete (``wait_group 1``), so that the completion latency overlaps the next block.

        Varlen: query block m of the sequence is dq_accum tile ``dq_tile0 + m``.
        ``hand_back_end`` (group_heads): the buffers go back after loop position ``it`` while
        ``it + 1`` is below it (default m_block_max: not after the last block)."""
        gdQacc = mdQacc[None, head, batch]
        lane = cute.arch.lane_idx()
        bar_threads = 128 + 32
        start = self.first_visit(n_block, m_block_min, m_block_max)
        for it in cutlass.range(m_block_min, m_block_max, unroll=1):
            m_block = self.m_block_at(it, start, m_block_min, m_block_max)
            for wg in cutlass.range_constexpr(2):
                cute.arch.barrier(barrier_id=int(NamedBarrier.DQ_FULL_WG0) + wg,
                                  number_of_threads=bar_threads)
            if lane == 0:
                if const_expr(self.deterministic):
                    sem = cute.local_tile(mdQsem[None, head, batch], (1,), (m_block,)).iterator
                    spin_until_equal(sem, self.dq_turn(block_info, m_block, n_block))
                    cute.arch.fence_proxy("async.global")  # acquire -> bulk reduce
                for wg in cutlass.range_constexpr(2):
                    sdQ_wg = cute.local_tile(sdQ, (self.dq_wg_elems,), (wg,))
                    tile = m_block if const_expr(dq_tile0 is None) else dq_tile0 + m_block
                    gdQ_chunk = cute.local_tile(gdQacc, (self.dq_wg_elems,), (tile * 2 + wg,))
                    bulk_reduce_add_f32(sdQ_wg.iterator, gdQ_chunk.iterator,
                                        self.dq_wg_elems * 4)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.sync_warp()
            more_blocks = it + 1 < m_block_max
            if const_expr(hand_back_end is not None):
                more_blocks = it + 1 < hand_back_end
            if more_blocks:  # (no MMA warpgroup waits after the last block)
                for wg in cutlass.range_constexpr(2):
                    cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.DQ_EMPTY_WG0) + wg,
                                             number_of_threads=bar_threads)
            if const_expr(self.deterministic):
                if lane == 0 and it > m_block_min:  # (deterministic: no rotation: m − 1 done)
                    cute.arch.cp_async_bulk_wait_group(1)  # the previous block's adds are done
                    cute.arch.fence_proxy("async.global")
                    prev = cute.local_tile(mdQsem[None, head, batch], (1,), (m_block - 1,))
                    st_release_gpu_s32(prev.iterator, n_block + 1)
        if const_expr(self.deterministic):
            if lane == 0 and m_block_max > m_block_min:
                cute.arch.cp_async_bulk_wait_group(0)
                cute.arch.fence_proxy("async.global")
                last = cute.local_tile(mdQsem[None, head, batch], (1,), (m_block_max - 1,))
                st_release_gpu_s32(last.iterator, n_block + 1)

    @cute.jit
    def load_stats(self, mLSE: cute.Tensor, mDelta: cute.Tensor, sLSE: cute.Tensor,
                   sDelta: cute.Tensor, pipeline_stats, n_block: Int32, head: Int32,
                   batch: Int32, m_block_min: Int32, m_block_max: Int32, seqlen_q: Int32,
                   group=None):
        """The stats warp (warp 2 of the producer warpgroup, ``stats_smem``): per visited query
        block, in the MMA warpgroups' order, lse_log2 and delta of its tile_m rows into the
        stage's shared-memory rows (4-byte ``cp.async``, one row per lane and round; rows past
        seqlen_q read row seqlen_q − 1, which the readers replace: see read_stats), completion
        signalled on the stage's mbarrier (``cp.async.mbarrier.arrive.noinc``). With ``group``
        (group_heads): the group's query heads in turn."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        if const_expr(group is None):
            self.load_stats_head(mLSE, mDelta, sLSE, sDelta, pipeline_stats, state, n_block,
                                 head, batch, m_block_min, m_block_max, seqlen_q)
        else:
            for g in cutlass.range(group, unroll=1):
                state = self.load_stats_head(mLSE, mDelta, sLSE, sDelta, pipeline_stats, state,
                                             n_block, head + g, batch, m_block_min, m_block_max,
                                             seqlen_q)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)  # (nothing left in flight when the warp exits)

    @cute.jit
    def load_stats_head(self, mLSE: cute.Tensor, mDelta: cute.Tensor, sLSE: cute.Tensor,
                        sDelta: cute.Tensor, pipeline_stats, state, n_block: Int32, head: Int32,
                        batch: Int32, m_block_min: Int32, m_block_max: Int32, seqlen_q: Int32):
        """``load_stats`` for query head ``head``; returns the pipeline state after it."""
        lane = cute.arch.lane_idx()
        gLSE, gDelta = mLSE[None, head, batch], mDelta[None, head, batch]
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
        start = self.first_visit(n_block, m_block_min, m_block_max)
        for it in cutlass.range(m_block_min, m_block_max, unroll=1):
            m_block = self.m_block_at(it, start, m_block_min, m_block_max)
            pipeline_stats.producer_acquire(state)
            for r in cutlass.range_constexpr(self.tile_m // 32):
                t = r * 32 + lane
                row = m_block * self.tile_m + t  # (stats_padded: rows up to Sq_pad exist)
                if const_expr(not self.stats_padded):
                    row = cutlass.min(row, seqlen_q - 1)
                for g, s in ((gLSE, sLSE), (gDelta, sDelta)):
                    cute.copy(atom, cute.local_tile(g, (1,), (row,)),
                              cute.local_tile(s[None, state.index], (1,), (t,)))
            pipeline_stats.producer_commit(state)
            state.advance()
        return state

    @cute.jit
    def read_stats(self, sX: cute.Tensor, x: cute.Tensor, outside: Float32, tScS_mn: cute.Tensor,
                   m_block: Int32, seqlen_q: Int32, stage: Int32,
                   per_col: cutlass.Constexpr[bool]):
        """``stats_smem``: this thread's rows' (``per_col``: columns') lse_log2 or delta (``sX``)
        of query block m_block from the stage's shared memory into ``x``; queries past seqlen_q
        get ``outside`` (+inf for lse_log2, 0 for delta: P = dS = 0 there). lse_log2 is read
        before the exp, delta only once dP is ready, so that both are never live at once (the
        swapped loop's 16 columns each)."""
        for i in cutlass.range_constexpr(cute.size(x)):
            t = tScS_mn[0, i][1] if const_expr(per_col) else tScS_mn[i, 0][0]
            if const_expr(self.stats_padded):  # rows past seqlen_q hold +inf / 0 already
                x[i] = sX[t, stage]
            else:
                v = sX[t, stage]
                x[i] = v if m_block * self.tile_m + t < seqlen_q else outside

    @cute.jit
    def load_row_stats(self, mLSE: cute.Tensor, mDelta: cute.Tensor, lse: cute.Tensor,
                       dpsum: cute.Tensor, tScS_mn: cute.Tensor, m_block: Int32,
                       seqlen_q: Int32, head: Int32, batch: Int32, q_offset=None):
        """lse_log2 and delta of this thread's rows of query block ``m_block`` into ``lse``,
        ``dpsum`` (rows past seqlen_q: +inf and 0, so P = dS = 0 there; the loads stay in
        bounds)."""
        for r in cutlass.range_constexpr(cute.size(lse)):
            row = m_block * self.tile_m + tScS_mn[r, 0][0]
            row_c = cutlass.min(row, seqlen_q - 1)
            if const_expr(q_offset is not None):
                row_c = row_c + q_offset
            lse_v = mLSE[row_c, head, batch]
            dpsum_v = mDelta[row_c, head, batch]
            lse[r] = lse_v if row < seqlen_q else Float32.inf
            dpsum[r] = dpsum_v if row < seqlen_q else Float32(0.0)

    @cute.jit
    def first_visit(self, n_block: Int32, m_block_min: Int32, m_block_max: Int32) -> Int32:
        """How far into its query-block range [m_block_min, m_block_max) key block n_block
        starts (see ``rotate``; 0 without)."""
        start = Int32(0)
        if const_expr(self.rotate):
            count = m_block_max - m_block_min
            start = n_block % count if count > 0 else Int32(0)
        return start

    @cute.jit
    def m_block_at(self, it: Int32, start: Int32, m_block_min: Int32, m_block_max: Int32
                   ) -> Int32:
        """The query block visited at loop position ``it`` (in [m_block_min, m_block_max)):
        ``it`` itself, or under ``rotate`` the range walked from ``start`` on, wrapping."""
        m_block = it
        if const_expr(self.rotate):
            m_block = it + start
            m_block = m_block - (m_block_max - m_block_min) if m_block >= m_block_max else m_block
        return m_block

    @cute.jit
    def dq_turn(self, block_info: BwdBlocks, m_block: Int32, n_block: Int32) -> Int32:
        """The counter value of query block m_block at which key block n_block may add: its
        predecessor's id + 1, or 0 for the first adder. Adders go in ascending key-block order
        (descending under a causal mask, see ``descending``); the key blocks that visit a query
        block form a contiguous range, so the predecessor is n_block ∓ 1 if that one visits it."""
        prev = n_block + 1 if const_expr(self.descending) else n_block - 1
        prev_min, prev_max = BwdBlocks.m_block_range(block_info, prev)
        n_blocks = (block_info.seqlen_k + self.tile_n - 1) // self.tile_n
        has_prev = prev >= 0 and prev < n_blocks and prev_min <= m_block and m_block < prev_max
        return prev + 1 if has_prev else Int32(0)

    @cute.jit
    def mma(self, mdK: cute.Tensor, mdV: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor,
            mParams: cute.Tensor,
            sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, sdO: cute.Tensor, sP: cute.Tensor,
            sdS: cute.Tensor, sdQ: cute.Tensor, tma_atom_dK, tma_atom_dV,
            mma_sdp: cute.TiledMma, mma_dk: cute.TiledMma, mma_dv: cute.TiledMma,
            mma_dq: cute.TiledMma, pipeline_kv, pipeline_q, pipeline_do, tidx: Int32,
            n_block: Int32, head: Int32, head_dkv: Int32, batch: Int32,
            m_block_min: Int32, m_block_max: Int32, seqlen_q: Int32, seqlen_k: Int32,
            block_info: BwdBlocks, q_offset=None, k_offset=None, mdK_rows=None,
            mdV_rows=None, seq=None, mCuSeqlensK=None, pipeline_stats=None, sLSE=None,
            sDelta=None, mdQacc=None, sink=None, segs=None, group=None):
        """The MMA warpgroups: dK and dV of key block n_block over its query blocks (of query
        head ``head``, or with ``group`` (group_heads) of the ``group`` query heads from
        ``head`` on), then the epilogue."""
        tm, tn, D, Dv = self.tile_m, self.tile_n, self.hdim, self.hdimv
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        tidx_in_wg = tidx % 128
        thr_sdp = mma_sdp.get_slice(tidx)
        thr_dk = mma_dk.get_slice(tidx)
        thr_dv = mma_dv.get_slice(tidx)
        thr_dq = mma_dq.get_slice(tidx)
        # the slices the operand fragments (shared-memory descriptors) come from: each
        # thread's, or its warpgroup's (BwdConfig.wg_fragments)
        opd_sdp, opd_dk, opd_dv, opd_dq = thr_sdp, thr_dk, thr_dv, thr_dq
        if const_expr(self.wg_fragments):
            first = wg_idx * 128
            opd_sdp, opd_dk = mma_sdp.get_slice(first), mma_dk.get_slice(first)
            opd_dv, opd_dq = mma_dv.get_slice(first), mma_dq.get_slice(first)

        # operand fragments (shared-memory descriptors)
        tdVrdOt = opd_dv.make_fragment_B(opd_dv.partition_B(transpose_mn(sdO)))
        tdKrQt = opd_dk.make_fragment_B(opd_dk.partition_B(transpose_mn(sQ)))
        tdQrKt = opd_dq.make_fragment_B(opd_dq.partition_B(transpose_mn(sK)))
        if const_expr(self.swap):  # Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ; dQ reads dSᵀ transposed
            tSrQ = opd_sdp.make_fragment_B(opd_sdp.partition_B(sQ))
            tSrK = opd_sdp.make_fragment_A(opd_sdp.partition_A(sK))
            tdPrdO = opd_sdp.make_fragment_B(opd_sdp.partition_B(sdO))
            tdPrV = opd_sdp.make_fragment_A(opd_sdp.partition_A(sV))
            tdQrdS = opd_dq.make_fragment_A(opd_dq.partition_A(transpose_mn(sdS)))
            tdVrPt, tdKrdSt = None, None  # (Pᵀ, dSᵀ from registers)
        else:
            tSrQ = opd_sdp.make_fragment_A(opd_sdp.partition_A(sQ))
            tSrK = opd_sdp.make_fragment_B(opd_sdp.partition_B(sK))
            tdPrdO = opd_sdp.make_fragment_A(opd_sdp.partition_A(sdO))
            tdPrV = opd_sdp.make_fragment_B(opd_sdp.partition_B(sV))
            tdVrPt = opd_dv.make_fragment_A(opd_dv.partition_A(transpose_mn(sP)))
            tdKrdSt = opd_dk.make_fragment_A(opd_dk.partition_A(transpose_mn(sdS)))
            tdQrdS = opd_dq.make_fragment_A(opd_dq.partition_A(sdS))

        acc_dK = cute.make_rmem_tensor(thr_dk.partition_shape_C((tn, D)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_dv.partition_shape_C((tn, Dv)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        s_tile = (tn, tm) if const_expr(self.swap) else (tm, tn)
        acc_S_shape = thr_sdp.partition_shape_C(s_tile)
        acc_dQ_shape = thr_dq.partition_shape_C((tm, D))

        # (row, col) of each S (swap: Sᵀ, (key, query)) element of this thread, within the tile
        tScS = thr_sdp.partition_C(cute.make_identity_tensor(s_tile))
        tScS_mn = acc_view_mn(tScS)

        # P / dS register -> shared memory (stmatrix)
        st_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        st_thr = cute.make_tiled_copy_C(st_atom, mma_sdp).get_slice(tidx)
        tdSsdS = st_thr.partition_D(sdS)
        tPsP = None
        if const_expr(not self.swap):
            tPsP = st_thr.partition_D(sP)

        # this warpgroup's dQ buffer (the dQ warp adds it to dq_accum), or with dq_red this
        # thread's floats of every query block's chunk in dq_accum: (4, dq_regs / 4, m_block),
        # dq_fragment_view's order
        tdQsdQ, tdQgdQ = None, None
        if const_expr(self.dq_red):
            if const_expr(group is None):  # (group_heads: per head, in the loop below)
                tdQgdQ = self.dq_red_view(mdQacc, head, batch, wg_idx, tidx_in_wg)
        else:
            sdQ_wg = cute.local_tile(sdQ, (self.dq_wg_elems,), (wg_idx,))
            tdQsdQ = dq_fragment_view(sdQ_wg, self.dq_regs, tidx_in_wg)

        scale = mParams[PARAM_SCALE]
        scales = score_scales(scale, mParams, self.has_softcap, inverse=True)
        scale_log2, tanh_in_scale = scales.scale_log2, scales.tanh_in_scale
        inv_scale_log2 = scales.inv_scale_log2
        kv_tail = BwdBlocks.kv_tail(block_info, n_block)  # only the last key block has a tail
        # sink_grad: Σ over this thread's (row, key) elements of e^{σ − lse_row}·P·dP, kept in
        # shared memory (sink[1][tidx]), and σ·log2 e there too (every thread writes the same
        # value and reads it after its own write: no barrier)
        sink_acc = None
        if const_expr(self.sink_grad):
            sink_acc = (sink[1], tidx)
            sink[1][tidx] = Float32(0.0)
            sink[1][self.num_mma_threads + self.num_mma_threads // 32] = (
                mParams[PARAM_SINKS + head] * LOG2_E)

        if const_expr(segs is not None):
            # the key block's ids into shared memory once (mask_p compares against them)
            kv_ids, sKvIds = segs[2], segs[3]
            if tidx < tn:
                sKvIds[tidx] = kv_ids[batch, cutlass.min(n_block * tn + tidx, seqlen_k - 1)]
            cute.arch.barrier(barrier_id=int(NamedBarrier.SEG_IDS),
                              number_of_threads=self.num_mma_threads)
        if m_block_max > m_block_min:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipeline_kv.consumer_wait(kv_state)
            if const_expr(self.varlen):
                self.zero_tail_rows((sK, sV), seqlen_k - n_block * tn, wg_idx, tidx_in_wg)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            loop = self.swapped_loop if const_expr(self.swap) else self.plain_loop
            frags = (tSrQ, tSrK, tdPrdO, tdPrV, tdVrPt, tdKrdSt, tdQrdS, tdQrKt, tdVrdOt, tdKrQt)
            mmas = (mma_sdp, mma_dk, mma_dv, mma_dq)
            scales3 = (scale_log2, tanh_in_scale, inv_scale_log2)
            # (group_heads: one loop over the group's query heads' blocks in turn, dK / dV
            # accumulating over all of them)
            loop(mLSE, mDelta, frags, acc_dK, acc_dV, acc_S_shape, acc_dQ_shape, tScS_mn,
                 st_thr, tPsP, tdSsdS, tdQsdQ, mmas, pipeline_q, pipeline_do, state, wg_idx,
                 tidx_in_wg, n_block, head, batch, m_block_min, m_block_max, seqlen_q,
                 seqlen_k, block_info, kv_tail, scales3, sQ, sdO, q_offset, pipeline_stats,
                 sLSE, sDelta, tdQgdQ, sink_acc, segs, group, mdQacc)


        if const_expr(self.sink_grad):
            self.store_sink_part(sink, head, batch, tidx)

        # ---- epilogue: dK, dV ----
        for i in cutlass.range_constexpr(cute.size(acc_dK)):
            acc_dK[i] = acc_dK[i] * scale
        if const_expr(self.gqa):
            # (the thread's fragment coordinates from a fresh read of its index: the segment-id
            # kernels at head dim 128 with a window and softcap spilled the one kept across the
            # loop)
            tidx = thread_idx_x_again() - 128
            thr_dk = mma_dk.get_slice(tidx)
            thr_dv = mma_dv.get_slice(tidx)
            if const_expr(self.varlen):
                if seq == ZERO_PADDING:
                    zero_padding_rows(mdK, mCuSeqlensK, head_dkv, (tn, D), self.num_mma_threads,
                                      tidx, Int32(0), Int32(1))
                    zero_padding_rows(mdV, mCuSeqlensK, head_dkv, (tn, Dv), self.num_mma_threads,
                                      tidx, Int32(0), Int32(1))
                else:
                    self.store_dkv_f32(acc_dK, mdK, thr_dk, (tn, D), n_block, head_dkv, batch,
                                       seqlen_k, k_offset)
                    self.store_dkv_f32(acc_dV, mdV, thr_dv, (tn, Dv), n_block, head_dkv, batch,
                                       seqlen_k, k_offset)
            else:
                self.store_dkv_f32(acc_dK, mdK, thr_dk, (tn, D), n_block, head_dkv, batch,
                                   seqlen_k)
                self.store_dkv_f32(acc_dV, mdV, thr_dv, (tn, Dv), n_block, head_dkv, batch,
                                   seqlen_k)
        else:
            rdK = cute.make_rmem_tensor(acc_dK.layout, self.dtype)
            convert_f32_pairs(acc_dK, rdK, self.is_bf16)
            rdV = cute.make_rmem_tensor(acc_dV.layout, self.dtype)
            convert_f32_pairs(acc_dV, rdV, self.is_bf16)
            # both warpgroups are done reading K and V (last dQ / dP GEMMs) before overwriting
            epi_barrier = int(NamedBarrier.EPILOGUE)
            cute.arch.barrier(barrier_id=epi_barrier, number_of_threads=self.num_mma_threads)
            for acc16, mma_x, s_x in ((rdK, mma_dk, sK), (rdV, mma_dv, sV)):
                st = cute.make_tiled_copy_C(st_atom, mma_x).get_slice(tidx)
                cute.copy(st, st.retile(acc16), st.partition_D(s_x))
            if const_expr(self.varlen):
                # packed dK / dV: a key block inside the sequence is TMA-stored from the
                # sequence's first row on; in its last, partial block the rows past the sequence
                # belong to the next one: 16-byte row pieces below seqlen_k instead
                rows = seqlen_k - n_block * tn
                if seq == ZERO_PADDING:
                    zero_padding_rows(mdK_rows, mCuSeqlensK, head_dkv, (tn, D),
                                      self.num_mma_threads, tidx, Int32(0), Int32(1))
                    zero_padding_rows(mdV_rows, mCuSeqlensK, head_dkv, (tn, Dv),
                                      self.num_mma_threads, tidx, Int32(0), Int32(1))
                elif rows >= tn:
                    self.store_dkv_tma(sK, sV, mdK, mdV, tma_atom_dK, tma_atom_dV, tidx,
                                       n_block, head_dkv, batch, k_offset)
                else:
                    cute.arch.barrier(barrier_id=epi_barrier,
                                      number_of_threads=self.num_mma_threads)
                    for s_x, m_x, dim in ((sK, mdK_rows, D), (sV, mdV_rows, Dv)):
                        g_x = cute.local_tile(sequence(m_x, head_dkv, batch, k_offset),
                                              (tn, dim), (n_block, 0))
                        store_rows(s_x, g_x, rows, self.num_mma_threads, tidx)
            else:
                self.store_dkv_tma(sK, sV, mdK, mdV, tma_atom_dK, tma_atom_dV, tidx, n_block,
                                   head_dkv, batch)

    @cute.jit
    def zero_tail_rows(self, tiles: cutlass.Constexpr, valid: Int32, wg_idx: Int32,
                       tidx_in_wg: Int32):
        """Varlen: if the (rows, dim) shared-memory ``tiles`` (K and V of the key block, or Q
        and dO of a query block) hold rows past their sequence (``valid`` rows are inside),
        write zeros over those: they are the next sequence's or padding tokens, which may hold
        NaN or Inf, and P = dS = 0 there does not cancel a NaN in Pᵀ·dO, dSᵀ·Q or dS·K. Each
        MMA warpgroup zeroes them itself (the same zeros: the warpgroups' writes may overlap),
        fences them for its WGMMA reads and syncs its 128 threads; a Q / dO stage is released
        only after both warpgroups' GEMMs, so the producer's next TMA load follows."""
        rows = cute.size(tiles[0], mode=[0])
        if valid < rows:
            for s_x in tiles:
                zero_rows_from(s_x, valid, 128, tidx_in_wg)
            cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> WGMMA reads
            cute.arch.barrier(barrier_id=int(NamedBarrier.ZERO_TAIL_WG0) + wg_idx,
                              number_of_threads=128)

    @cute.jit
    def store_dkv_tma(self, sK: cute.Tensor, sV: cute.Tensor, mdK: cute.Tensor,
                      mdV: cute.Tensor, tma_atom_dK, tma_atom_dV, tidx: Int32, n_block: Int32,
                      head_dkv: Int32, batch: Int32, k_offset=None):
        """TMA-store the dK / dV tiles from K's / V's shared memory (rows past seqlen_k clipped
        by TMA; varlen: into the packed tensors from the sequence's row ``k_offset`` on)."""
        tn, D, Dv = self.tile_n, self.hdim, self.hdimv
        cute.arch.fence_proxy("async.shared", space="cta")  # st.shared -> TMA store
        cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE),
                          number_of_threads=self.num_mma_threads)
        if tidx < 32:
            one = cute.make_layout(1)
            gdK = cute.local_tile(sequence(mdK, head_dkv, batch, k_offset), (tn, D), (n_block, 0))
            gdV = cute.local_tile(sequence(mdV, head_dkv, batch, k_offset), (tn, Dv),
                                  (n_block, 0))
            tsK, tgdK = cpasync.tma_partition(tma_atom_dK, 0, one, cute.group_modes(sK, 0, 2),
                                              cute.group_modes(gdK, 0, 2))
            tsV, tgdV = cpasync.tma_partition(tma_atom_dV, 0, one, cute.group_modes(sV, 0, 2),
                                              cute.group_modes(gdV, 0, 2))
            cute.copy(tma_atom_dK, tsK, tgdK)
            cute.copy(tma_atom_dV, tsV, tgdV)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def plain_loop(self, mLSE: cute.Tensor, mDelta: cute.Tensor, frags, acc_dK: cute.Tensor,
                   acc_dV: cute.Tensor, acc_S_shape: cutlass.Constexpr,
                   acc_dQ_shape: cutlass.Constexpr, tScS_mn: cute.Tensor, st_thr, tPsP,
                   tdSsdS: cute.Tensor, tdQsdQ, mmas, pipeline_q, pipeline_do, state,
                   wg_idx: Int32, tidx_in_wg: Int32, n_block: Int32, head: Int32, batch: Int32,
                   m_block_min: Int32, m_block_max: Int32, seqlen_q: Int32, seqlen_k: Int32,
                   block_info: BwdBlocks, kv_tail, scales3, sQ: cute.Tensor, sdO: cute.Tensor,
                   q_offset=None, pipeline_stats=None, sLSE=None, sDelta=None, tdQgdQ=None,
                   sink_acc=None, segs=None, group=None, mdQacc=None):
        """The query-block loop of the plain configs (S, dP with M = queries; P and dS through
        shared memory), for query head ``head``; returns the Q / dO pipeline state after it.
        ``group`` (group_heads): one loop over the blocks of the ``group`` query heads from
        ``head`` on, in turn (``head_at``), dQ into ``mdQacc``'s head of each block."""
        tm = self.tile_m
        (tSrQ, tSrK, tdPrdO, tdPrV, tdVrPt, tdKrdSt, tdQrdS, tdQrKt, tdVrdOt, tdKrQt) = frags
        mma_sdp, mma_dk, mma_dv, mma_dq = mmas
        scale_log2, tanh_in_scale, inv_scale_log2 = scales3
        num_rows = cute.size(tScS_mn, mode=[0])
        pds_barrier = int(NamedBarrier.PDS)
        start = self.first_visit(n_block, m_block_min, m_block_max)
        # the rows' lse_log2 and delta, loaded one query block ahead: the next block's
        # are requested once this one's dS is computed, so their global-memory latency
        # hides under the dV / dQ / dK GEMMs instead of stalling the next softmax
        lse = cute.make_rmem_tensor(num_rows, Float32)
        dpsum = cute.make_rmem_tensor(num_rows, Float32)
        if const_expr(not self.stats_smem):
            self.load_row_stats(
                mLSE, mDelta, lse, dpsum, tScS_mn,
                self.m_block_at(m_block_min, start, m_block_min, m_block_max),
                seqlen_q, head, batch, q_offset)
        for it in cutlass.range(m_block_min, self.loop_end(m_block_min, m_block_max, group),
                                unroll=1):
            pos, head_it = self.head_at(it, head, m_block_min, m_block_max, group)
            m_block = self.m_block_at(pos, start, m_block_min, m_block_max)
            pds_idx = (it - m_block_min) % self.pds_stages

            # segment ids: this thread's rows' key spans, read before the GEMMs
            # (fewer values live then) for mask_p
            seg_span = None
            if const_expr(segs is not None):
                seg_span = self.row_spans(segs, tScS_mn, m_block, n_block, batch,
                                          seqlen_q)
            # S = Q·Kᵀ and dP = dO·Vᵀ
            pipeline_q.consumer_wait(state)
            if const_expr(self.varlen):
                if seqlen_q - m_block * tm < tm:  # the sequence's last query block
                    pipeline_do.consumer_wait(state)
                    self.zero_tail_rows((sQ[None, None, state.index],
                                         sdO[None, None, state.index]),
                                        seqlen_q - m_block * tm, wg_idx, tidx_in_wg)
            acc_S = cute.make_rmem_tensor(acc_S_shape, Float32)
            wgmma(mma_sdp, acc_S, tSrQ[None, None, None, state.index], tSrK, zero_init=True)
            pipeline_do.consumer_wait(state)
            acc_dP = cute.make_rmem_tensor(acc_S_shape, Float32)
            wgmma(mma_sdp, acc_dP, tdPrdO[None, None, None, state.index], tdPrV,
                  zero_init=True)
            if const_expr(self.stats_smem):  # (under the S GEMM)
                pipeline_stats.consumer_wait(state)
                self.read_stats(sLSE, lse, Float32.inf, tScS_mn, m_block, seqlen_q,
                                state.index, per_col=False)

            need_mask = self.block_needs_mask(block_info, m_block, n_block, kv_tail)
            if const_expr(segs is not None):
                tiles = segs[0]
                need_mask = need_mask or (
                    n_block < tiles[batch, m_block, SEG_BULK_LO]
                    or n_block >= tiles[batch, m_block, SEG_BULK_HI])

            s_mn = acc_view_mn(acc_S)
            dp_mn = acc_view_mn(acc_dP)
            warpgroup.wait_group(1)  # S is ready, dP may still run
            self.scores_to_p(s_mn, lse, scale_log2, tanh_in_scale, per_col=False)
            if need_mask:
                self.mask_p(s_mn, tScS_mn, m_block, n_block, block_info,
                            segs=None if const_expr(segs is None) else
                            (*segs, batch, seqlen_q, seqlen_k, seg_span))

            # P -> shared memory (the previous iteration's readers are done: see PDS)
            if const_expr(self.pds_stages == 1):
                cute.arch.barrier(barrier_id=pds_barrier,
                                  number_of_threads=self.num_mma_threads)
            rP = cute.make_rmem_tensor(acc_S.layout, self.dtype)
            convert_f32_pairs(acc_S, rP, self.is_bf16)
            cute.copy(st_thr, st_thr.retile(rP), tPsP[None, None, None, pds_idx])

            # dS = P∘(dP − delta) [∘ (1 − tanh²)]
            warpgroup.wait_group(0)
            if const_expr(self.stats_smem):
                self.read_stats(sDelta, dpsum, Float32(0.0), tScS_mn, m_block, seqlen_q,
                                state.index, per_col=False)
            if const_expr(self.sink_grad):
                self.add_sink_terms(sink_acc, s_mn, dp_mn, lse)
            self.dp_to_ds(s_mn, dp_mn, lse, dpsum, inv_scale_log2, per_col=False)
            if const_expr(self.stats_smem):
                pipeline_stats.consumer_release(state)
            else:
                # the next query block's stats (past the last one: any block, unused)
                pos1, head1 = self.head_at(it + 1, head, m_block_min, m_block_max, group)
                self.load_row_stats(
                    mLSE, mDelta, lse, dpsum, tScS_mn,
                    self.m_block_at(pos1, start, m_block_min, m_block_max),
                    seqlen_q, head1, batch, q_offset)
            rdS = cute.make_rmem_tensor(acc_dP.layout, self.dtype)
            convert_f32_pairs(acc_dP, rdS, self.is_bf16)
            cute.copy(st_thr, st_thr.retile(rdS), tdSsdS[None, None, None, pds_idx])

            cute.arch.fence_proxy("async.shared", space="cta")  # st.shared -> WGMMA reads
            cute.arch.barrier(barrier_id=pds_barrier,
                              number_of_threads=self.num_mma_threads)

            # dV += Pᵀ·dO, dQ = dS·K, dK += dSᵀ·Q
            wgmma(mma_dv, acc_dV, tdVrPt[None, None, None, pds_idx],
                  tdVrdOt[None, None, None, state.index], zero_init=False)
            acc_dQ = cute.make_rmem_tensor(acc_dQ_shape, Float32)
            wgmma(mma_dq, acc_dQ, tdQrdS[None, None, None, pds_idx], tdQrKt, zero_init=True)
            wgmma(mma_dk, acc_dK, tdKrdSt[None, None, None, pds_idx],
                  tdKrQt[None, None, None, state.index], zero_init=False)
            warpgroup.wait_group(1)  # dV and dQ done
            pipeline_do.consumer_release(state)

            dq_view = tdQgdQ  # (group_heads: this block's head's)
            if const_expr(group is not None and self.dq_red):
                dq_view = self.dq_red_view(mdQacc, head_it, batch, wg_idx, tidx_in_wg)
            self.hand_dq_over(acc_dQ, tdQsdQ, wg_idx, it > m_block_min, dq_view, m_block)
            warpgroup.wait_group(0)  # dK done
            pipeline_q.consumer_release(state)
            state.advance()
        return state

    @cute.jit
    def swapped_loop(self, mLSE: cute.Tensor, mDelta: cute.Tensor, frags, acc_dK: cute.Tensor,
                     acc_dV: cute.Tensor, acc_S_shape: cutlass.Constexpr,
                     acc_dQ_shape: cutlass.Constexpr, tScS_mn: cute.Tensor, st_thr, tPsP,
                     tdSsdS: cute.Tensor, tdQsdQ, mmas, pipeline_q, pipeline_do, state,
                     wg_idx: Int32, tidx_in_wg: Int32, n_block: Int32, head: Int32, batch: Int32,
                     m_block_min: Int32, m_block_max: Int32, seqlen_q: Int32, seqlen_k: Int32,
                     block_info: BwdBlocks, kv_tail, scales3, sQ: cute.Tensor, sdO: cute.Tensor,
                     q_offset=None, pipeline_stats=None, sLSE=None, sDelta=None, tdQgdQ=None,
                     sink_acc=None, segs=None, group=None, mdQacc=None):
        """The query-block loop of ``swap_sdp`` configs (see BwdConfig.swap_sdp). This
        warpgroup holds Sᵀ / dPᵀ for its 64 keys × all tile_m queries; per query block:

            Sᵀ, dPᵀ (WGMMA) → Pᵀ = exp2(Sᵀ·scale_log2 − lse) [mask] → dV += Pᵀ·dO, A = Pᵀ in
            registers, issued before dS is computed → dSᵀ = Pᵀ∘(dPᵀ − delta) → dSᵀ to shared
            memory (for dQ) and, as registers, A of dK += dSᵀ·Q → dQ = dS·K.

        lse and delta belong to the query columns: each thread loads the 16 of its columns.
        Same arguments and result as ``plain_loop`` (tPsP, sQ, sdO, q_offset, sink_acc, segs
        and seqlen_k unused: no varlen, sink_grad or segment ids here)."""
        tm = self.tile_m
        (tSrQ, tSrK, tdPrdO, tdPrV, _, _, tdQrdS, tdQrKt, tdVrdOt, tdKrQt) = frags
        mma_sdp, mma_dk, mma_dv, mma_dq = mmas
        scale_log2, tanh_in_scale, inv_scale_log2 = scales3
        num_cols = cute.size(tScS_mn, mode=[1])
        pds_barrier = int(NamedBarrier.PDS)
        start = self.first_visit(n_block, m_block_min, m_block_max)
        for it in cutlass.range(m_block_min, self.loop_end(m_block_min, m_block_max, group),
                                unroll=1):
            pos, head_it = self.head_at(it, head, m_block_min, m_block_max, group)
            gLSE, gDelta = mLSE[None, head_it, batch], mDelta[None, head_it, batch]
            m_block = self.m_block_at(pos, start, m_block_min, m_block_max)
            pds_idx = (it - m_block_min) % self.pds_stages
            # the columns' lse_log2 and delta (queries past seqlen_q: +inf and 0: P = dS = 0)
            lse = cute.make_rmem_tensor(num_cols, Float32)
            dpsum = cute.make_rmem_tensor(num_cols, Float32)
            if const_expr(not self.stats_smem):
                # (predicated loads at constant offsets from one address: no per-column clamp,
                # which costs a 64-bit address per column and spills)
                for c in cutlass.range_constexpr(num_cols):
                    row = m_block * tm + tScS_mn[0, c][1]
                    lse[c] = Float32.inf
                    dpsum[c] = Float32(0.0)
                    if row < seqlen_q:
                        lse[c] = gLSE[row]
                        dpsum[c] = gDelta[row]

            # Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ
            pipeline_q.consumer_wait(state)
            acc_S = cute.make_rmem_tensor(acc_S_shape, Float32)
            wgmma(mma_sdp, acc_S, tSrK, tSrQ[None, None, None, state.index], zero_init=True)
            pipeline_do.consumer_wait(state)
            acc_dP = cute.make_rmem_tensor(acc_S_shape, Float32)
            wgmma(mma_sdp, acc_dP, tdPrV, tdPrdO[None, None, None, state.index], zero_init=True)
            if const_expr(self.stats_smem):  # (under the Sᵀ GEMM)
                pipeline_stats.consumer_wait(state)
                self.read_stats(sLSE, lse, Float32.inf, tScS_mn, m_block, seqlen_q,
                                state.index, per_col=True)

            need_mask = self.block_needs_mask(block_info, m_block, n_block, kv_tail)

            s_mn = acc_view_mn(acc_S)
            dp_mn = acc_view_mn(acc_dP)
            warpgroup.wait_group(1)  # Sᵀ is ready, dPᵀ may still run
            self.scores_to_p(s_mn, lse, scale_log2, tanh_in_scale, per_col=True)
            if need_mask:
                self.mask_p(s_mn, tScS_mn, m_block, n_block, block_info, transposed=True)

            # dV += Pᵀ·dO, Pᵀ from registers: runs under the dS arithmetic below
            rP = cute.make_rmem_tensor(acc_S.layout, self.dtype)
            convert_f32_pairs(acc_S, rP, self.is_bf16)
            wgmma(mma_dv, acc_dV, acc_view_as_a_operand(rP),
                  tdVrdOt[None, None, None, state.index], zero_init=False)

            # dSᵀ = Pᵀ∘(dPᵀ − delta) [∘ (1 − tanh²)]
            warpgroup.wait_group(1)  # dPᵀ is ready, dV may still run
            if const_expr(self.stats_smem):
                self.read_stats(sDelta, dpsum, Float32(0.0), tScS_mn, m_block, seqlen_q,
                                state.index, per_col=True)
            self.dp_to_ds(s_mn, dp_mn, lse, dpsum, inv_scale_log2, per_col=True)
            if const_expr(self.stats_smem):
                pipeline_stats.consumer_release(state)
            rdS = cute.make_rmem_tensor(acc_dP.layout, self.dtype)
            convert_f32_pairs(acc_dP, rdS, self.is_bf16)
            # dSᵀ -> shared memory (one buffer: both warpgroups' previous dQ GEMMs are done)
            if const_expr(self.pds_stages == 1):
                cute.arch.barrier(barrier_id=pds_barrier, number_of_threads=self.num_mma_threads)
            cute.copy(st_thr, st_thr.retile(rdS), tdSsdS[None, None, None, pds_idx])
            cute.arch.fence_proxy("async.shared", space="cta")  # st.shared -> WGMMA reads
            cute.arch.barrier(barrier_id=pds_barrier, number_of_threads=self.num_mma_threads)

            # dQ = dS·K (both warpgroups' dSᵀ from shared memory), dK += dSᵀ·Q (registers)
            acc_dQ = cute.make_rmem_tensor(acc_dQ_shape, Float32)
            wgmma(mma_dq, acc_dQ, tdQrdS[None, None, None, pds_idx], tdQrKt, zero_init=True)
            wgmma(mma_dk, acc_dK, acc_view_as_a_operand(rdS),
                  tdKrQt[None, None, None, state.index], zero_init=False)
            warpgroup.wait_group(1)  # dV and dQ done
            pipeline_do.consumer_release(state)
            dq_view = tdQgdQ  # (group_heads: this block's head's)
            if const_expr(group is not None and self.dq_red):
                dq_view = self.dq_red_view(mdQacc, head_it, batch, wg_idx, tidx_in_wg)
            self.hand_dq_over(acc_dQ, tdQsdQ, wg_idx, it > m_block_min, dq_view, m_block)
            warpgroup.wait_group(0)  # dK done
            pipeline_q.consumer_release(state)
            state.advance()
        return state

    @cute.jit
    def block_needs_mask(self, block_info: BwdBlocks, m_block: Int32, n_block: Int32, kv_tail):
        """Block (m_block, n_block) cuts the key tail or a causal / window edge."""
        need_mask = kv_tail
        if const_expr(self.is_causal or self.is_local):
            _, cut_right, cut_left = BwdBlocks.mask_reasons(block_info, m_block, n_block)
            need_mask = need_mask or cut_right
            if const_expr(self.is_local):
                need_mask = need_mask or cut_left
        return need_mask

    @cute.jit
    def scores_to_p(self, s_mn: cute.Tensor, lse: cute.Tensor, scale_log2: Float32,
                    tanh_in_scale: Float32, per_col: cutlass.Constexpr[bool]):
        """S ← P = exp2(S·scale_log2 − lse) [S ← tanh(S·scale/softcap) first], in place. lse is
        per row of s_mn, or per column (``per_col``: s_mn is Sᵀ)."""
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                x = s_mn[r, c]
                if const_expr(self.has_softcap):
                    x = cute.math.tanh(x * tanh_in_scale, fastmath=True)
                s_mn[r, c] = cute.math.exp2(x * scale_log2 - lse[c if const_expr(per_col) else r],
                                            fastmath=True)

    @cute.jit
    def add_sink_terms(self, sink_acc: cutlass.Constexpr, p_mn: cute.Tensor, dp_mn: cute.Tensor,
                       lse: cute.Tensor):
        """This thread's running sum (``sink_acc`` = (shared-memory sums, tidx)) += Σ_i
        e^{σ − lse_i}·Σ_j P_ij·dP_ij over its elements of the block (the plain loop's rows i are
        query rows; BwdConfig keeps sink_grad off the swapped loop). A query row past seqlen_q
        or with no key has lse = +inf: weight 0 and P = 0. e^{σ − lse} = exp2(σ·log2 e −
        lse_log2), the sink's softmax weight in the row. Nothing stays live across blocks:
        σ·log2 e and the sum are read from shared memory here (every register of the MMA
        warpgroups is taken: a loop-carried sum spilled, and so did reading σ from params)."""
        s_sums, tidx = sink_acc
        sink_log2 = s_sums[self.num_mma_threads + self.num_mma_threads // 32]
        n_r, n_c = cute.size(p_mn, mode=[0]), cute.size(p_mn, mode=[1])
        total = Float32(0.0)
        for r in cutlass.range_constexpr(n_r):
            part = p_mn[r, 0] * dp_mn[r, 0]
            for c in cutlass.range_constexpr(1, n_c):
                part = p_mn[r, c] * dp_mn[r, c] + part
            total = cute.math.exp2(sink_log2 - lse[r], fastmath=True) * part + total
        s_sums[tidx] = s_sums[tidx] + total

    @cute.jit
    def store_sink_part(self, sink: cutlass.Constexpr, head: Int32, batch: Int32,
                        tidx: Int32):
        """sink_part[x, head, batch] = the sum of the MMA threads' running sums, in a fixed order
        (warp shuffles, then warp 0..7 in turn): deterministic. Every CTA writes its entry (0 if
        it visits no query block)."""
        mSinkPart, sSink, x_block = sink
        value = sSink[tidx]
        for i in cutlass.range_constexpr(5):
            value = value + cute.arch.shuffle_sync_bfly(value, offset=16 >> i)
        lane = tidx % 32
        warp = tidx // 32
        n = self.num_mma_threads
        if lane == 0:
            sSink[n + warp] = value
        cute.arch.barrier(barrier_id=int(NamedBarrier.SINK_SUM),
                          number_of_threads=self.num_mma_threads)
        if tidx == 0:
            total = sSink[n]
            for w in cutlass.range_constexpr(1, n // 32):
                total = total + sSink[n + w]
            mSinkPart[x_block, head, batch] = total

    @cute.jit
    def dp_to_ds(self, p_mn: cute.Tensor, dp_mn: cute.Tensor, lse: cute.Tensor,
                 dpsum: cute.Tensor, inv_scale_log2, per_col: cutlass.Constexpr[bool]):
        """dP ← dS = P∘(dP − delta) [∘ (1 − tanh²)], in place; stats per row or column as in
        scores_to_p."""
        for r in cutlass.range_constexpr(cute.size(p_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(p_mn, mode=[1])):
                i = c if const_expr(per_col) else r
                p = p_mn[r, c]
                ds = p * (dp_mn[r, c] - dpsum[i])
                if const_expr(self.has_softcap):
                    # tanh' = 1 − t², t recovered from P = exp2(t·scale_log2 − lse) (no extra
                    # live registers). P below the smallest normal float (0 when masked or on an
                    # empty row) gives dS = 0 (its log2 may be -inf / NaN).
                    t = (cute.math.log2(p, fastmath=True) + lse[i]) * inv_scale_log2
                    ds = (ds * (Float32(1.0) - t * t) if p >= Float32(_FLT_MIN_NORMAL)
                          else Float32(0.0))
                dp_mn[r, c] = ds

    @cute.jit
    def loop_end(self, m_block_min: Int32, m_block_max: Int32, group=None) -> Int32:
        """End of the query-block loop's positions: m_block_max, or with ``group``
        (group_heads) past the blocks of all its query heads (one run of positions each)."""
        end = m_block_max
        if const_expr(group is not None):
            end = m_block_min + (m_block_max - m_block_min) * group
        return end

    @cute.jit
    def cta_heads(self, y: Int32, num_heads: Int32, num_kv_heads: Int32) -> tuple:
        """(group, head, head_kv, head_dkv) of a CTA whose grid y is ``y``: the query head
        (group None), or with group_heads the kv head, ``head`` then the group's first query head
        and ``group`` its query heads per kv head, walked in turn by every role (:meth:`head_at`).
        ``head_dkv``: the head of dK / dV's outputs (per query head with ``gqa``)."""
        group = None
        if const_expr(self.group_heads):
            group = num_heads // num_kv_heads
            head_kv = y
            head = head_kv * group
        else:
            head = y
            head_kv = head // (num_heads // num_kv_heads)
        head_dkv = head if const_expr(self.gqa) else head_kv
        return group, head, head_kv, head_dkv

    def head_at(self, it: Int32, head: Int32, m_block_min: Int32, m_block_max: Int32,
                group=None) -> tuple:
        """(loop position within its head's run of [m_block_min, m_block_max), query head) of
        loop position ``it``: (it, head), or with ``group`` the ``it // visits``-th head after
        ``head`` (one loop over all the heads' blocks: the P / dS buffer parity, the dQ
        hand-over and the statistics look-ahead run on across heads as within one). Past the
        end: the last head's positions go on (the look-ahead reads in bounds, unused)."""
        pos, head_it = it, head
        if const_expr(group is not None):
            visits = m_block_max - m_block_min
            # (clamped: the plain loop's look-ahead past the last block stays in the last head)
            g = cutlass.min((it - m_block_min) // visits, group - 1)
            pos = it - g * visits
            head_it = head + g
        return pos, head_it

    @cute.jit
    def dq_red_view(self, mdQacc: cute.Tensor, head: Int32, batch: Int32, wg_idx: Int32,
                    tidx_in_wg: Int32) -> cute.Tensor:
        """dq_red: this thread's floats of every query block's chunk of head ``head`` in
        dq_accum, (4, dq_regs / 4, m_block) in dq_fragment_view's order."""
        gdQacc = mdQacc[None, head, batch]
        return cute.make_tensor(
            gdQacc.iterator + (wg_idx * self.dq_wg_elems + tidx_in_wg * 4),
            cute.make_layout((4, self.dq_regs // 4, gdQacc.shape[0] // (2 * self.dq_wg_elems)),
                             stride=(1, 512, 2 * self.dq_wg_elems)))

    @cute.jit
    def hand_dq_over(self, acc_dQ: cute.Tensor, tdQsdQ, wg_idx: Int32, not_first,
                     tdQgdQ=None, m_block=None):
        """dQ fragment -> this warpgroup's shared-memory buffer (once the dQ warp has read the
        previous one) -> the dQ warp; with dq_red, straight into dq_accum instead (one
        ``red.global.add.v4.f32`` per 4 floats, fire and forget: no shared memory, no wait)."""
        if const_expr(self.dq_red):
            view = tdQgdQ[None, None, m_block]
            for c in cutlass.range_constexpr(self.dq_regs // 4):
                red_add_v4_f32(view[None, c].iterator, acc_dQ[4 * c], acc_dQ[4 * c + 1],
                               acc_dQ[4 * c + 2], acc_dQ[4 * c + 3])
        else:
            if not_first:
                cute.arch.barrier(barrier_id=int(NamedBarrier.DQ_EMPTY_WG0) + wg_idx,
                                  number_of_threads=128 + 32)
            dq_flat = cute.make_tensor(acc_dQ.iterator, cute.make_layout((4, self.dq_regs // 4)))
            cute.autovec_copy(dq_flat, tdQsdQ)
            cute.arch.fence_proxy("async.shared", space="cta")  # st.shared -> bulk copy
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.DQ_FULL_WG0) + wg_idx,
                                     number_of_threads=128 + 32)

    @cute.jit
    def row_spans(self, segs: cutlass.Constexpr, tScS_mn: cute.Tensor, m_block: Int32,
                  n_block: Int32, batch: Int32, seqlen_q: Int32) -> cute.Tensor:
        """(3, rows): this thread's rows' key spans [start, end) relative to key block n_block,
        and their ids (segment ids, mask_p): read before the block's GEMMs, when fewer values
        are live than in mask_p (loading them there spilled)."""
        rows = segs[1]
        n_rows = cute.size(tScS_mn, mode=[0])
        span = cute.make_rmem_tensor((3, n_rows), Int32)
        col0 = n_block * self.tile_n
        for i in cutlass.range_constexpr(n_rows):
            r = cutlass.min(m_block * self.tile_m + tScS_mn[i, 0][0], seqlen_q - 1)
            span[0, i] = rows[batch, r, SEG_ROW_START] - col0
            span[1, i] = rows[batch, r, SEG_ROW_END] - col0
            span[2, i] = rows[batch, r, SEG_ROW_ID]
        return span

    @cute.jit
    def mask_p(self, p_mn: cute.Tensor, c_mn: cute.Tensor, m_block: Int32, n_block: Int32,
               block_info: BwdBlocks, transposed: cutlass.Constexpr[bool] = False,
               segs: cutlass.Constexpr = None):
        """P ← 0 where row m_block·tm + r does not see key n_block·tn + c (rows past seqlen_q
        already have P = 0). ``transposed``: p_mn is Pᵀ (rows = keys, columns = queries).
        ``segs`` (segment ids, not transposed): (seg_tiles, seg_rows, kv_ids, the key block's
        ids in shared memory, batch, seqlen_q, seqlen_k, row_spans' (3, rows)): each row also
        sees only its key span, and in a tile flagged for ids only the keys of its id."""
        q_mode, k_mode = (1, 0) if const_expr(transposed) else (0, 1)
        has_segs = segs is not None
        compare_ids = Int32(0)
        if const_expr(has_segs):
            tiles, _, _, sKvIds, batch, _, _, span = segs
            compare_ids = tiles[batch, m_block, SEG_IDS]
        for i in cutlass.range_constexpr(cute.size(p_mn, mode=[q_mode])):
            row = m_block * self.tile_m + c_mn[(0, i) if const_expr(transposed) else (i, 0)][q_mode]
            lo, hi = BwdBlocks.visible_cols(block_info, row, n_block)
            if const_expr(has_segs):
                hi = cutlass.min(hi, span[1, i])
                lo = cutlass.max(lo, span[0, i]) if const_expr(self.is_local) else span[0, i]
            for j in cutlass.range_constexpr(cute.size(p_mn, mode=[k_mode])):
                idx = (j, i) if const_expr(transposed) else (i, j)
                col = c_mn[idx][k_mode]
                visible = col < hi
                if const_expr(self.is_local or has_segs):
                    visible = visible and col >= lo
                p_mn[idx] = p_mn[idx] if visible else Float32(0.0)
        if const_expr(has_segs):
            if compare_ids != 0:  # (ids that are not contiguous runs)
                for j in cutlass.range_constexpr(cute.size(p_mn, mode=[1])):
                    key_id = sKvIds[c_mn[(0, j)][1]]
                    for i in cutlass.range_constexpr(cute.size(p_mn, mode=[0])):
                        p_mn[i, j] = p_mn[i, j] if key_id == span[2, i] else Float32(0.0)

    @cute.jit
    def store_dkv_f32(self, acc: cute.Tensor, mX: cute.Tensor, thr_mma, tile: cutlass.Constexpr,
                      n_block: Int32, head: Int32, batch: Int32, seqlen_k: Int32,
                      k_offset=None):
        """float32 dK / dV straight from registers (GQA configs), rows past seqlen_k skipped
        (varlen: the sequence's rows from k_offset on)."""
        gX = cute.local_tile(sequence(mX, head, batch, k_offset), tile, (n_block, 0))
        tXgX = thr_mma.partition_C(gX)
        tXcX = thr_mma.partition_C(cute.make_identity_tensor(tile))
        row_limit = seqlen_k - n_block * self.tile_n
        for i in cutlass.range_constexpr(cute.size(acc)):
            if tXcX[i][0] < row_limit:
                tXgX[i] = acc[i]


def make_launcher(cfg: BwdConfig):
    """The `@cute.jit` launcher ``fn(stream, q, k, v, dout, lse_log2, delta, params, dq_accum,
    [dq_sem | seg_tiles, seg_keys, seg_rows, kv_ids,] dk, dv [, sink_part])`` for this config
    (dq_accum and dq_sem are updated in place; dq_sem only for deterministic configs, the
    segment tables only with segments)."""
    kernel = FlashAttentionBackwardSm90(cfg)

    if cfg.varlen:
        @cute.jit
        def sm90_bwd_varlen(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                            v: cute.Tensor, dout: cute.Tensor, lse_log2: cute.Tensor,
                            delta: cute.Tensor, params: cute.Tensor, dq_accum: cute.Tensor,
                            cu_seqlens_q: cute.Tensor, cu_seqlens_k: cute.Tensor,
                            work: cute.Tensor, dk: cute.Tensor, dv: cute.Tensor):
            kernel(stream, q, k, v, dout, lse_log2, delta, params, dq_accum, dk, dv, None,
                   cu_seqlens_q, cu_seqlens_k, work)

        @cute.jit
        def sm90_bwd_varlen_sink(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                                 v: cute.Tensor, dout: cute.Tensor, lse_log2: cute.Tensor,
                                 delta: cute.Tensor, params: cute.Tensor, dq_accum: cute.Tensor,
                                 cu_seqlens_q: cute.Tensor, cu_seqlens_k: cute.Tensor,
                                 work: cute.Tensor, dk: cute.Tensor, dv: cute.Tensor,
                                 sink_part: cute.Tensor):
            kernel(stream, q, k, v, dout, lse_log2, delta, params, dq_accum, dk, dv, None,
                   cu_seqlens_q, cu_seqlens_k, work, sink_part)

        return sm90_bwd_varlen_sink if cfg.sink_grad else sm90_bwd_varlen

    if cfg.deterministic:
        @cute.jit
        def sm90_bwd_deterministic(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                                   v: cute.Tensor, dout: cute.Tensor, lse_log2: cute.Tensor,
                                   delta: cute.Tensor, params: cute.Tensor,
                                   dq_accum: cute.Tensor, dq_sem: cute.Tensor, dk: cute.Tensor,
                                   dv: cute.Tensor):
            kernel(stream, q, k, v, dout, lse_log2, delta, params, dq_accum, dk, dv, dq_sem)

        @cute.jit
        def sm90_bwd_deterministic_sink(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                                        v: cute.Tensor, dout: cute.Tensor, lse_log2: cute.Tensor,
                                        delta: cute.Tensor, params: cute.Tensor,
                                        dq_accum: cute.Tensor, dq_sem: cute.Tensor,
                                        dk: cute.Tensor, dv: cute.Tensor,
                                        sink_part: cute.Tensor):
            kernel(stream, q, k, v, dout, lse_log2, delta, params, dq_accum, dk, dv, dq_sem,
                   mSinkPart=sink_part)

        return sm90_bwd_deterministic_sink if cfg.sink_grad else sm90_bwd_deterministic

    if cfg.segments:
        @cute.jit
        def sm90_bwd_segments(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                              v: cute.Tensor, dout: cute.Tensor, lse_log2: cute.Tensor,
                              delta: cute.Tensor, params: cute.Tensor, dq_accum: cute.Tensor,
                              seg_tiles: cute.Tensor, seg_keys: cute.Tensor,
                              seg_rows: cute.Tensor, kv_ids: cute.Tensor, dk: cute.Tensor,
                              dv: cute.Tensor):
            kernel(stream, q, k, v, dout, lse_log2, delta, params, dq_accum, dk, dv,
                   mSegTiles=seg_tiles, mSegKeys=seg_keys, mSegRows=seg_rows, mKvIds=kv_ids)

        @cute.jit
        def sm90_bwd_segments_sink(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                                   v: cute.Tensor, dout: cute.Tensor, lse_log2: cute.Tensor,
                                   delta: cute.Tensor, params: cute.Tensor,
                                   dq_accum: cute.Tensor, seg_tiles: cute.Tensor,
                                   seg_keys: cute.Tensor, seg_rows: cute.Tensor,
                                   kv_ids: cute.Tensor, dk: cute.Tensor, dv: cute.Tensor,
                                   sink_part: cute.Tensor):
            kernel(stream, q, k, v, dout, lse_log2, delta, params, dq_accum, dk, dv,
                   mSinkPart=sink_part, mSegTiles=seg_tiles, mSegKeys=seg_keys,
                   mSegRows=seg_rows, mKvIds=kv_ids)

        return sm90_bwd_segments_sink if cfg.sink_grad else sm90_bwd_segments

    @cute.jit
    def sm90_bwd(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
                 dout: cute.Tensor, lse_log2: cute.Tensor, delta: cute.Tensor,
                 params: cute.Tensor, dq_accum: cute.Tensor, dk: cute.Tensor, dv: cute.Tensor):
        kernel(stream, q, k, v, dout, lse_log2, delta, params, dq_accum, dk, dv)

    @cute.jit
    def sm90_bwd_sink(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
                      dout: cute.Tensor, lse_log2: cute.Tensor, delta: cute.Tensor,
                      params: cute.Tensor, dq_accum: cute.Tensor, dk: cute.Tensor,
                      dv: cute.Tensor, sink_part: cute.Tensor):
        kernel(stream, q, k, v, dout, lse_log2, delta, params, dq_accum, dk, dv,
               mSinkPart=sink_part)

    return sm90_bwd_sink if cfg.sink_grad else sm90_bwd
