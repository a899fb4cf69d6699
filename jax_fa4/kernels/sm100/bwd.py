"""FlashAttention backward for Blackwell (sm_100a), main kernel, in CuTe-DSL: v1 of FA4's design.

Computes dK, dV and a float32 partial dQ reduce-added into dq_accum (call contract, dq_accum
layout and the deterministic mode in bwd_config.py; dq = dq_accum · scale is done in JAX).

Features: bf16/fp16, head dims 64, 96 and 128 (head dim 128's dense calls run the 2-CTA kernel,
bwd_2cta.py, which reuses this class's compute-warp pieces and epilogue; this kernel serves 128
in its varlen and segment-id modes), dynamic batch / sequence lengths / head counts, GQA/MQA
(query head h reads kv head h // (H / Hkv); GQA configs write float32 dK/dV per query head,
summed by the caller), key-length tail, bottom-right causal and
sliding-window masks with query-block skipping (only blocks that cut a boundary are masked),
softcap with its derivative, deterministic dQ order (semaphores), packed sequences (varlen) and
segment ids (both below, the 1-CTA kernel's modes).

Transposed formulation (FA4): one CTA owns a key block of 128 keys of one (batch, query head),
K and V resident in shared memory; it loops over the visited query blocks m of 128 rows:
    Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ             tcgen05 SS MMAs into TMEM (one TMEM lane per key)
    Pᵀ = exp2(Sᵀ·scale_log2 − lse)     compute warps, Pᵀ as 16-bit back into Sᵀ's columns
    dV += Pᵀ·dO                        TS MMA (A = Pᵀ from TMEM)
    dSᵀ = Pᵀ∘(dPᵀ − delta)[∘(1 − t²)]  compute warps, dS as 16-bit into shared memory
    dK += dSᵀ·Q, dQ_m = dS·K           SS MMAs; dQ_m lands in dPᵀ's TMEM columns
    dq_accum[m] += dQ_m                 reduce warps: TMEM → smem → TMA reduce-add (fp32)

Warps (512 threads): 0-3 dQ reduce; 4-11 compute (warpgroup w = query columns [64w, 64w+64) of
the tile; thread = key lane); 12 MMA (one elected thread; allocates TMEM); 13 load (TMA for K, V,
Q, dO; plain loads of -lse_log2 / -delta, and with segment ids the rows' ids, into shared
memory); 14-15 idle.

TMEM (columns, 512 allocated): dK [0, D), dV [D, 2D), Sᵀ [2D, 2D+128) with Pᵀ of warpgroup w in
its columns [64w, 64w+32) (so a warpgroup only overwrites Sᵀ columns it has read itself), dPᵀ
[2D+128, 2D+256) also holding dQ (128 lanes × D) once dS has been computed.

Synchronisation (raw mbarriers, one completion per query-block iteration; phase = iteration % 2):
  s_full   MMA → compute   tcgen05.commit after Sᵀ_j
  p_full   compute → MMA   256 arrivals, each after tcgen05.wait::st of its Pᵀ stores: Pᵀ_j
                           written and Sᵀ_j read (Sᵀ_{j+1} is issued after dV_j, in order)
  dp_full  MMA → compute   tcgen05.commit after dPᵀ_j
  ds_full  compute → MMA   256 arrivals after the dS stores + fence.proxy.async (also: dPᵀ_j read
                           with tcgen05.wait::ld, so dQ_j may overwrite its columns)
  ds_empty MMA → compute   tcgen05.commit after dK_j and dQ_j (they read dS_j)
  dq_full  MMA → reduce    tcgen05.commit after dQ_j
  dq_empty reduce → MMA    128 arrivals after tcgen05.wait::ld of dQ_j (dPᵀ_{j+1} may overwrite)
  dkv_full MMA → compute   tcgen05.commit after the last dK / dV MMA
  Q, dO, K/V: PipelineTmaUmma (transaction bytes; released by tcgen05.commit after their last
  reader: Q after dK_j, dO after dV_j). -lse / -delta: PipelineAsync (32 load threads → 256
  compute threads).
MMA order per iteration j: Sᵀ_j; [dQ_{j-1}, dK_{j-1}]; wait dq_empty_{j-1}; dPᵀ_j; wait p_full_j;
dV_j. TMEM: allocated by the MMA warp, permit relinquished right after, freed by it after every
TMEM user passed the dealloc barrier (each after its last tcgen05.wait::ld).

Varlen (``cfg.varlen``, the 1-CTA kernel; called by jax_fa4/backends/sm100.py with the Hopper
varlen backward's contract, varlen_bwd_config.varlen_attention_backward_signature): q, k, v, dout,
dk, dv are sequences packed as one batch entry; CTA (x, head) takes key block ``work[x, 1]`` of
sequence ``work[x, 0]``, whose offsets, lengths and first dq_accum tile are in the same work row.
Its loads are TMA views offset to the sequence's first row (the tile rows past the sequence are
the next sequence's, or padding the caller zeroed: keys past seqlen_k are masked, query rows past
seqlen_q get -lse = -inf and -delta = 0 as in the dense kernel, so P = dS = 0 there); query block
m reduce-adds into dq_accum tile ``work[x, 6] + m`` (no other sequence's); dK / dV are stored
row by row below seqlen_k. Spare work rows (lengths 0) and key blocks no query block sees run the
dense kernel's count = 0 path (every role skips its loop; zero dK / dV rows); the ZERO_PADDING
row's compute warps then write zero dK / dV to the rows outside every sequence. No barrier,
role or phase changes (tests/test_sm100_bwd_protocol.py models the varlen grid).

Segment ids (``cfg.segments``, the 1-CTA kernel, dense; called by jax_fa4/backends/sm100.py with
jax_fa4/segments.py's backward tables, bwd_config's segment-id contract): every role intersects
the mask's query-block range of its key block n with the table's [m_lo, m_hi) (the query blocks
with a row sharing an id with a key of n), so all agree on the count; a key block no query
shares an id with runs the count = 0 path (zero dK / dV). The load warp stages, with each
block's -lse / -delta, its rows' ids (seg_rows) and whether n lies outside the query block's
bulk (seg_tiles: the key blocks every row of it sees whole); in such a block the compute warps
mask every query column whose id is not the thread's key's (kv_ids, read once). In this
transposed layout a thread owns one key, so comparing ids costs one shared-memory read per
column where the forward's key span would cost two, and is exact on its own: the spans and the
compare-ids flag are not read. Not deterministic (bwd_config). No barrier, role or phase
changes (tests/test_sm100_bwd_protocol.py models the segment-id grid). The 2-CTA kernel's
segment-id mode (192/128, bwd_2cta.py) reuses the stages, the staging and the compare per CTA.

Head dims 128 and 192/128 dense run the 2-CTA kernel (bwd_2cta.py), 256 the split kernels
(bwd_split.py, which build on this module's pieces). Not yet (docs/kernels/sm100.md):
persistence / scheduler, overlap of the dQ TMEM drain with the next dPᵀ (the reduce warps hold
dPᵀ's columns until their last chunk load).
"""

from __future__ import annotations

import enum

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.cutlass_dsl import T, dsl_user_op

from jax_fa4.kernels.common.convert import cvt_pack_f32x2
from jax_fa4.kernels.common.layout import select_modes
from jax_fa4.kernels.common.scores import score_scales
from jax_fa4.kernels.common.rows import zero_padding_rows
from jax_fa4.kernels.common.views import seq_major, sequence
from jax_fa4.kernels.common.geometry import BwdBlocks, resolve_windows
from jax_fa4.kernels.segments_config import (SEG_BULK_HI, SEG_BULK_LO, SEG_KEY_M_HI,
                                             SEG_KEY_M_LO, SEG_ROW_ID)
from jax_fa4.kernels.sm100.bwd_config import Sm100BwdConfig
from jax_fa4.kernels.spec import PARAM_SCALE

_FLT_MIN_NORMAL = 1.1754943508222875e-38  # 2**-126
#: The varlen work list's sequence value of the item that zeroes dK / dV outside every sequence
#: (varlen_bwd_config.varlen_attention_backward_signature).
ZERO_PADDING = -2

REDUCE_WARPS = (0, 1, 2, 3)
COMPUTE_WARPS = tuple(range(4, 12))
MMA_WARP = 12
LOAD_WARP = 13

# setmaxnreg per warpgroup: 4·reduce + 8·compute + 4·other = 2048 (64K registers / 32)
_REDUCE_REGS, _COMPUTE_REGS, _OTHER_REGS = 72, 160, 120


class Barrier(enum.IntEnum):
    # 0 is __syncthreads
    TMEM_ALLOC = 1  # reduce + compute + MMA warps: TMEM pointer published
    TMEM_DEALLOC = 2  # same threads: every TMEM access done
    REDUCE = 3  # the 4 reduce warps: dQ staging buffer free / written


@dsl_user_op
def ld_acquire_gpu(ptr: cute.Pointer, *, loc=None, ip=None) -> Int32:
    """ld.global.acquire.gpu of one int32 (the deterministic semaphore)."""
    return Int32(llvm.inline_asm(
        T.i32(), [ptr.toint(loc=loc, ip=ip).ir_value()],
        "ld.global.acquire.gpu.b32 $0, [$1];", "=r,l",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))


@dsl_user_op
def red_release_gpu_add(ptr: cute.Pointer, val: int, *, loc=None, ip=None) -> None:
    """red.release.gpu.global.add.s32 (publish the semaphore's next turn)."""
    llvm.inline_asm(
        None, [ptr.toint(loc=loc, ip=ip).ir_value(), Int32(val).ir_value(loc=loc, ip=ip)],
        "red.release.gpu.global.add.s32 [$0], $1;", "l,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)


def tmem_cols(tmem_ptr, acc_layout, col_offset: int, num_cols: int) -> cute.Tensor:
    """(128 lanes, num_cols) float32 view of TMEM at column ``col_offset`` (``acc_layout``: the
    fragment layout of a 128×(>= num_cols) float32 accumulator)."""
    return cute.make_tensor(tmem_ptr + col_offset,
                            cute.composition(acc_layout, cute.make_layout((128, num_cols))))


class FlashAttentionBackwardSm100:
    def __init__(self, cfg: Sm100BwdConfig):
        cfg.validate()
        self.cfg = cfg
        self.dtype = cutlass.BFloat16 if cfg.dtype == "bfloat16" else cutlass.Float16
        self.is_bf16 = cfg.dtype == "bfloat16"
        self.hdim, self.hdimv = cfg.head_dim, cfg.head_dim_v
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.q_stages, self.do_stages = cfg.q_stages, cfg.do_stages
        self.dq_cols, self.dq_stages = cfg.dq_cols, cfg.dq_stages
        self.is_causal = cfg.mask == "causal"
        self.is_local = cfg.mask == "local"
        self.has_softcap = cfg.has_softcap
        self.gqa = cfg.gqa
        self.deterministic = cfg.deterministic
        self.varlen = cfg.varlen
        self.segments = cfg.segments
        self.tmem_alloc_cols = cfg.tmem_alloc_columns()
        off = cfg.tmem_offsets()
        self.tmem_dk, self.tmem_dv, self.tmem_s = off["dk"], off["dv"], off["s"]
        self.tmem_dp, self.tmem_dq = off["dp"], off["dq"]
        self.cols_per_wg = self.tile_m // 2  # query columns of Sᵀ / dPᵀ per compute warpgroup
        self.epi_chunk = 16  # dK / dV columns per TMEM load in the epilogue
        # TMEM column of warpgroup 1's 16-bit Pᵀ / dSᵀ relative to warpgroup 0's: its own
        # Sᵀ / dPᵀ columns (no cross-warpgroup ordering needed; bwd_2cta's serial layout packs
        # them contiguously instead)
        self.p16_stride = self.cols_per_wg

    # ---------------------------------------------------------------------------------------------
    # Host side
    # ---------------------------------------------------------------------------------------------
    def input_views(self, mQ, mK, mV, mdO, mLSE, mDelta, mParams, mdQacc, mSem, mdK, mdV):
        """Check the operands' dtypes (trace time) and return the kernel's views: q/k/v/dout/dk/
        dv (S, D, H, B), lse_log2 / delta (S, H, B), dq_accum (Sq_pad, D, H, B) row-major,
        dq_semaphore (slots, H, B) when deterministic."""
        for name, t in (("q", mQ), ("k", mK), ("v", mV), ("dout", mdO)):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"{name}: expected {self.dtype}, got {t.element_type}")
        dkv_type = Float32 if self.gqa else self.dtype
        if const_expr(mdK.element_type != dkv_type or mdV.element_type != dkv_type):
            raise TypeError(f"dk, dv must be {dkv_type}")
        for name, t in (("lse_log2", mLSE), ("delta", mDelta), ("params", mParams),
                        ("dq_accum", mdQacc)):
            if const_expr(t.element_type != Float32):
                raise TypeError(f"{name} must be float32")
        D, Dv = self.hdim, self.hdimv
        mQ, mK, mdK = seq_major(mQ, D), seq_major(mK, D), seq_major(mdK, D)
        mV, mdO, mdV = seq_major(mV, Dv), seq_major(mdO, Dv), seq_major(mdV, Dv)
        mLSE, mDelta = [select_modes(t, (2, 1, 0)) for t in (mLSE, mDelta)]  # (Sq, H, B)
        # dq_accum (B, H, Sq_pad·D) -> (Sq_pad, D, H, B), row-major rows of D floats
        mdQacc = cute.make_tensor(mdQacc.iterator, cute.make_layout(
            (mdQacc.shape[2] // D, D, mdQacc.shape[1], mdQacc.shape[0]),
            stride=(D, 1, mdQacc.stride[1], mdQacc.stride[0])))
        if const_expr(self.deterministic):
            mSem = select_modes(mSem, (2, 1, 0))  # (slots, H, B)
        return mQ, mK, mV, mdO, mLSE, mDelta, mdQacc, mSem, mdK, mdV

    @cute.jit
    def __call__(self, stream: cuda.CUstream, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mdO: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor, mParams: cute.Tensor,
                 mdQacc: cute.Tensor, mSem: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                 mCuSeqlensK: cute.Tensor | None = None, mWork: cute.Tensor | None = None,
                 mSegTiles: cute.Tensor | None = None, mSegKeys: cute.Tensor | None = None,
                 mSegRows: cute.Tensor | None = None, mKvIds: cute.Tensor | None = None):
        if const_expr(self.varlen != (mWork is not None) or self.varlen != (
                mCuSeqlensK is not None)):
            raise TypeError("cu_seqlens_k and work are passed exactly when the config is varlen")
        segs = (mSegTiles, mSegKeys, mSegRows, mKvIds)
        if const_expr(any(self.segments != (t is not None) for t in segs)):
            raise TypeError("seg_tiles, seg_keys, seg_rows and kv_ids are passed exactly when "
                            "the config has segments")
        for name, t in (("cu_seqlens_k", mCuSeqlensK), ("work", mWork), ("seg_tiles", mSegTiles),
                        ("seg_keys", mSegKeys), ("seg_rows", mSegRows), ("kv_ids", mKvIds)):
            if const_expr(t is not None and t.element_type != Int32):
                raise TypeError(f"{name} must be int32")
        mQ, mK, mV, mdO, mLSE, mDelta, mdQacc, mSem, mdK, mdV = self.input_views(
            mQ, mK, mV, mdO, mLSE, mDelta, mParams, mdQacc, mSem, mdK, mdV)
        D, Dv, tm, tn = self.hdim, self.hdimv, self.tile_m, self.tile_n
        dt = self.dtype

        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        cta = tcgen05.CtaGroup.ONE
        st_tiler = (tn, tm, D)  # Sᵀ = K·Qᵀ
        dpt_tiler = (tn, tm, Dv)  # dPᵀ = V·dOᵀ
        dv_tiler = (tn, Dv, tm)  # dV += Pᵀ·dO
        dk_tiler = (tn, D, tm)  # dK += dSᵀ·Q
        dq_tiler = (tm, D, tn)  # dQ = dS·K
        st_mma = sm100_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, K_MAJOR, Float32, cta,
                                                    st_tiler[:2])
        dpt_mma = sm100_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, K_MAJOR, Float32, cta,
                                                     dpt_tiler[:2])
        dv_mma = sm100_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, MN_MAJOR, Float32, cta,
                                                    dv_tiler[:2], tcgen05.OperandSource.TMEM)
        dk_mma = sm100_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, MN_MAJOR, Float32, cta,
                                                    dk_tiler[:2])
        dq_mma = sm100_utils.make_trivial_tiled_mma(dt, dt, MN_MAJOR, MN_MAJOR, Float32, cta,
                                                    dq_tiler[:2])

        sK_l = sm100_utils.make_smem_layout_a(st_mma, st_tiler, dt, 1)
        sQ_l = sm100_utils.make_smem_layout_b(st_mma, st_tiler, dt, self.q_stages)
        sV_l = sm100_utils.make_smem_layout_a(dpt_mma, dpt_tiler, dt, 1)
        sdO_l = sm100_utils.make_smem_layout_b(dpt_mma, dpt_tiler, dt, self.do_stages)
        # the same buffers seen as the other GEMMs' operands (transposed views)
        sdOt_l = sm100_utils.make_smem_layout_b(dv_mma, dv_tiler, dt, self.do_stages)
        sQt_l = sm100_utils.make_smem_layout_b(dk_mma, dk_tiler, dt, self.q_stages)
        sKt_l = sm100_utils.make_smem_layout_b(dq_mma, dq_tiler, dt, 1)
        sdS_l = sm100_utils.make_smem_layout_a(dq_mma, dq_tiler, dt, 1)  # (tm, tn), m-major
        sdSt_l = sm100_utils.make_smem_layout_a(dk_mma, dk_tiler, dt, 1)  # (tn, tm), K-major
        tP_l = sm100_utils.make_smem_layout_a(dv_mma, dv_tiler, dt, 1)  # Pᵀ in TMEM
        for a, b, what in ((sdO_l, sdOt_l, "dO"), (sQ_l, sQt_l, "Q"), (sK_l, sKt_l, "K"),
                           (sdS_l, sdSt_l, "dS")):
            if const_expr(cute.cosize(a) != cute.cosize(b)):
                raise ValueError(f"{what}: transposed shared-memory view has another size")
        # dQ reduce staging: (tm, dq_cols) float32 tiles, K-major swizzled (TMA reduce source)
        sdQ_atom = sm100_utils.make_smem_layout_atom(
            sm100_utils.get_smem_layout_atom_ab(K_MAJOR, Float32, (tm, self.dq_cols)), Float32)
        sdQ_l = cute.tile_to_shape(sdQ_atom, (tm, self.dq_cols, self.dq_stages), order=(1, 0, 2))
        # segment ids: each staged query row's id and the block's mask flag, per lse stage
        # (bwd_config.segment_smem_bytes; placeholders without segment ids)
        seg_ids = tm * self.q_stages if const_expr(self.segments) else 4
        seg_flags = max(self.q_stages, 4) if const_expr(self.segments) else 4

        g2s = cpasync.CopyBulkTensorTileG2SOp(cta)
        tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_A(
            g2s, mK, cute.select(sK_l, mode=[0, 1, 2]), st_tiler, st_mma)
        tma_atom_Q, tma_Q = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, mQ, cute.select(sQ_l, mode=[0, 1, 2]), st_tiler, st_mma)
        tma_atom_V, tma_V = cute.nvgpu.make_tiled_tma_atom_A(
            g2s, mV, cute.select(sV_l, mode=[0, 1, 2]), dpt_tiler, dpt_mma)
        tma_atom_dO, tma_dO = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, mdO, cute.select(sdO_l, mode=[0, 1, 2]), dpt_tiler, dpt_mma)
        tma_atom_dQ, tma_dQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyReduceBulkTensorTileS2GOp(), mdQacc, cute.select(sdQ_l, mode=[0, 1]),
            (tm, self.dq_cols))

        self.tx_bytes_q = cute.size_in_bytes(dt, cute.select(sQ_l, mode=[0, 1, 2]))
        self.tx_bytes_do = cute.size_in_bytes(dt, cute.select(sdO_l, mode=[0, 1, 2]))
        self.tx_bytes_kv = (cute.size_in_bytes(dt, cute.select(sK_l, mode=[0, 1, 2]))
                            + cute.size_in_bytes(dt, cute.select(sV_l, mode=[0, 1, 2])))

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * self.do_stages]
            mbar_lse: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            mbar_sig: cute.struct.MemRange[cutlass.Int64, 8]
            tmem_holding_buf: Int32
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, tm * self.q_stages], 16]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, tm * self.q_stages], 16]
            sSegIds: cute.struct.Align[cute.struct.MemRange[Int32, seg_ids], 16]
            sSegMask: cute.struct.Align[cute.struct.MemRange[Int32, seg_flags], 16]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_l)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_l)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_l)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdO_l)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdS_l)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_l)], 1024]

        grid = (cute.ceil_div(mK.shape[0], tn), mQ.shape[2], mQ.shape[3])
        if const_expr(self.varlen):  # one CTA per (work item, query head)
            grid = (mWork.shape[0], mQ.shape[2], 1)
        self.kernel(
            tma_Q, tma_K, tma_V, tma_dO, tma_dQ, mdK, mdV, mLSE, mDelta, mParams, mSem,
            tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_dQ,
            sQ_l, sK_l, sV_l, sdO_l, sdOt_l, sQt_l, sKt_l, sdS_l, sdSt_l, sdQ_l, tP_l,
            st_mma, dpt_mma, dv_mma, dk_mma, dq_mma, SharedStorage, mCuSeqlensK, mWork,
            mSegTiles, mSegKeys, mSegRows, mKvIds,
        ).launch(grid=grid, block=[self.cfg.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=1)

    # ---------------------------------------------------------------------------------------------
    # Device side
    # ---------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mdQacc: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mLSE: cute.Tensor,
               mDelta: cute.Tensor, mParams: cute.Tensor, mSem: cute.Tensor,
               tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
               tma_atom_dO: cute.CopyAtom, tma_atom_dQ: cute.CopyAtom,
               sQ_l: cute.ComposedLayout, sK_l: cute.ComposedLayout, sV_l: cute.ComposedLayout,
               sdO_l: cute.ComposedLayout, sdOt_l: cute.ComposedLayout,
               sQt_l: cute.ComposedLayout, sKt_l: cute.ComposedLayout,
               sdS_l: cute.ComposedLayout, sdSt_l: cute.ComposedLayout,
               sdQ_l: cute.ComposedLayout, tP_l: cute.ComposedLayout,
               st_mma: cute.TiledMma, dpt_mma: cute.TiledMma, dv_mma: cute.TiledMma,
               dk_mma: cute.TiledMma, dq_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr,
               mCuSeqlensK: cute.Tensor | None, mWork: cute.Tensor | None,
               mSegTiles: cute.Tensor | None, mSegKeys: cute.Tensor | None,
               mSegRows: cute.Tensor | None, mKvIds: cute.Tensor | None):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == LOAD_WARP:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_dQ):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)

        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        pipeline_kv = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.mbar_kv.data_ptr(), num_stages=1, producer_group=one_thread,
            consumer_group=one_thread, tx_count=self.tx_bytes_kv, defer_sync=True)
        pipeline_q = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=self.q_stages,
            producer_group=one_thread, consumer_group=one_thread, tx_count=self.tx_bytes_q,
            defer_sync=True)
        pipeline_do = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.mbar_do.data_ptr(), num_stages=self.do_stages,
            producer_group=one_thread, consumer_group=one_thread, tx_count=self.tx_bytes_do,
            defer_sync=True)
        pipeline_lse = pipeline.PipelineAsync.create(
            barrier_storage=storage.mbar_lse.data_ptr(), num_stages=self.q_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     32 * len(COMPUTE_WARPS)),
            defer_sync=True)
        sig = storage.mbar_sig.data_ptr()
        s_full, p_full, dp_full, ds_full = sig, sig + 1, sig + 2, sig + 3
        ds_empty, dq_full, dq_empty, dkv_full = sig + 4, sig + 5, sig + 6, sig + 7
        num_compute = 32 * len(COMPUTE_WARPS)
        num_reduce = 32 * len(REDUCE_WARPS)
        if warp_idx == 0:
            with cute.arch.elect_one():
                for bar, count in ((s_full, 1), (p_full, num_compute), (dp_full, 1),
                                   (ds_full, num_compute), (ds_empty, 1), (dq_full, 1),
                                   (dq_empty, num_reduce), (dkv_full, 1)):
                    cute.arch.mbarrier_init(bar, count)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        tmem_users = num_compute + num_reduce + 32
        tmem = utils.TmemAllocator(
            storage.tmem_holding_buf.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=int(Barrier.TMEM_ALLOC),
                                                       num_threads=tmem_users),
            allocator_warp_id=MMA_WARP)
        dealloc_barrier = pipeline.NamedBarrier(barrier_id=int(Barrier.TMEM_DEALLOC),
                                                num_threads=tmem_users)

        sQ = storage.sQ.get_tensor(sQ_l.outer, swizzle=sQ_l.inner)
        sK = storage.sK.get_tensor(sK_l.outer, swizzle=sK_l.inner)
        sV = storage.sV.get_tensor(sV_l.outer, swizzle=sV_l.inner)
        sdO = storage.sdO.get_tensor(sdO_l.outer, swizzle=sdO_l.inner)
        sdS = storage.sdS.get_tensor(sdS_l.outer, swizzle=sdS_l.inner)
        sdQ = storage.sdQ.get_tensor(sdQ_l.outer, swizzle=sdQ_l.inner)
        sLSE = storage.sLSE.get_tensor(cute.make_layout((self.tile_m, self.q_stages)))
        sDelta = storage.sDelta.get_tensor(cute.make_layout((self.tile_m, self.q_stages)))

        # run-time scalars, identical in every role
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        # varlen: work row x = (sequence, key block, its rows' offsets in the packed q and k, its
        # lengths, its first dq_accum tile); one batch entry. Spare and padding rows: lengths 0.
        seq, q_offset, k_offset, dq_tile0 = None, None, None, None
        if const_expr(self.varlen):
            x, head, _ = cute.arch.block_idx()
            batch = Int32(0)
            seq, n_block = mWork[x, 0], mWork[x, 1]
            q_offset, k_offset = mWork[x, 2], mWork[x, 3]
            seqlen_q, seqlen_k = mWork[x, 4], mWork[x, 5]
            dq_tile0 = mWork[x, 6]
        else:
            n_block, head, batch = cute.arch.block_idx()
        window_left, window_right = resolve_windows(mParams, seqlen_q, seqlen_k, self.is_local)
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        blocks = BwdBlocks(self.tile_m, self.tile_n, self.is_causal, self.is_local,
                           seqlen_q, seqlen_k, window_left, window_right)
        m_min, m_max = blocks.m_block_range(n_block)
        # segment ids: only the query blocks the caller's table lists for this key block (a
        # row sharing an id with one of its keys lies in them), the same range in every role;
        # the load warp stages each block's row ids and whether the block is outside its query
        # tile's bulk, the compute warps mask there by id (stage_stats, softmax_p)
        load_segs, compute_segs = None, None
        if const_expr(self.segments):
            m_min = cutlass.max(m_min, mSegKeys[batch, n_block, SEG_KEY_M_LO])
            m_max = cutlass.min(m_max, mSegKeys[batch, n_block, SEG_KEY_M_HI])
            sSegIds, sSegMask = self.segment_stages(storage, self.q_stages)
            load_segs = (mSegTiles, mSegRows, sSegIds, sSegMask)
            compute_segs = (mKvIds, sSegIds, sSegMask)
        count = cutlass.max(m_max - m_min, 0)

        wg_idx = warp_idx // 4
        if wg_idx == 0:  # dQ reduce warps
            cute.arch.setmaxregister_decrease(_REDUCE_REGS)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.reduce_warps(mdQacc, mSem, sdQ, tma_atom_dQ, dq_mma, tmem_ptr, dq_full,
                              dq_empty, head, batch, n_block, m_min, count, blocks, tidx,
                              warp_idx, dq_tile0)
            cute.arch.fence_view_async_tmem_load()
            dealloc_barrier.arrive_and_wait()
        elif wg_idx < 3:  # compute warps
            cute.arch.setmaxregister_increase(_COMPUTE_REGS)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.compute_warps(mdK, mdV, mParams, sdS, sLSE, sDelta, st_mma, dk_mma, dv_mma,
                               tmem_ptr, pipeline_lse, s_full, p_full, dp_full, ds_full,
                               ds_empty, dkv_full, head, head_kv, batch, n_block, m_min, count,
                               blocks, tidx, warp_idx, k_offset, segs=compute_segs)
            cute.arch.fence_view_async_tmem_load()
            dealloc_barrier.arrive_and_wait()
            if const_expr(self.varlen):
                if seq == ZERO_PADDING:  # (count = 0: no TMEM, no barrier touched)
                    self.zero_padding_dkv(mdK, mdV, mCuSeqlensK, head, head_kv, tidx)
        else:
            cute.arch.setmaxregister_decrease(_OTHER_REGS)
            if warp_idx == LOAD_WARP:
                self.load_warp(mQ, mK, mV, mdO, mLSE, mDelta, sQ, sK, sV, sdO, sLSE, sDelta,
                               tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, st_mma, dpt_mma,
                               pipeline_kv, pipeline_q, pipeline_do, pipeline_lse, head,
                               head_kv, batch, n_block, m_min, count, seqlen_q, tidx, q_offset,
                               k_offset, segs=load_segs)
            if warp_idx == MMA_WARP:
                tmem.allocate(self.tmem_alloc_cols)
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(Float32)
                tmem.relinquish_alloc_permit()
                self.mma_warp(storage, sQ_l, sK_l, sV_l, sdO_l, sdOt_l, sQt_l, sKt_l, sdS_l,
                              sdSt_l, tP_l, st_mma, dpt_mma, dv_mma, dk_mma, dq_mma, tmem_ptr,
                              pipeline_kv, pipeline_q, pipeline_do, s_full, p_full, dp_full,
                              ds_full, ds_empty, dq_full, dq_empty, dkv_full, count)
                dealloc_barrier.arrive_and_wait()
                tmem.free(tmem_ptr)

    @cute.jit
    def gemm_ts_halves(self, mma: cute.TiledMma, acc: cute.Tensor, a_lo: cute.Tensor,
                       a_hi: cute.Tensor, b: cute.Tensor, stage: Int32, accumulate):
        """acc (+)= A·B[stage] for a TMEM A operand of 128 query columns (K) whose 16-bit
        halves sit in two views (query columns [0, 64): ``a_lo``'s k-blocks, [64, 128):
        ``a_hi``'s: each compute warpgroup's columns, see store_16bit); the first k-block
        overwrites acc unless ``accumulate``."""
        num_kb = cute.size(a_lo, mode=[2])
        for k in cutlass.range_constexpr(num_kb):
            mma.set(tcgen05.Field.ACCUMULATE, accumulate or k > 0)
            if const_expr(k < num_kb // 2):
                cute.gemm(mma, acc, a_lo[None, None, k], b[None, None, k, stage], acc)
            else:
                cute.gemm(mma, acc, a_hi[None, None, k], b[None, None, k, stage], acc)

    @cute.jit
    def tma_load(self, pipe, state, atom: cute.CopyAtom, src: cute.Tensor, dst: cute.Tensor):
        """Acquire ``state``'s stage of the TMA pipeline ``pipe`` and copy ``src`` into its slot
        of ``dst`` (the whole warp calls: the pipeline and the copy elect one thread inside)."""
        pipe.producer_acquire(state)
        cute.copy(atom, src, dst[None, state.index], tma_bar_ptr=pipe.producer_get_barrier(state))

    def segment_stages(self, storage, stages: int) -> tuple[cute.Tensor, cute.Tensor]:
        """The segment-id stages in shared memory (``sSegIds``, ``sSegMask`` of the kernel's
        storage): each staged query row's id (tile_m × ``stages``) and the block's mask flag
        (per stage), written by stage_stats, read by softmax_p."""
        return (storage.sSegIds.get_tensor(cute.make_layout((self.tile_m, stages))),
                storage.sSegMask.get_tensor(cute.make_layout(stages)))

    def segment_key(self, segs, batch: Int32, key: Int32, seqlen_k: Int32) -> tuple:
        """softmax_p's ``seg`` from the compute warps' ``segs`` (kv_ids, the id and flag
        stages): the stages and this thread's key id (the last key's past seqlen_k, which the
        tail mask hides)."""
        return (segs[1], segs[2], segs[0][batch, cutlass.min(key, seqlen_k - 1)])

    @cute.jit
    def stage_stats(self, mLSE: cute.Tensor, mDelta: cute.Tensor, sLSE: cute.Tensor,
                    sDelta: cute.Tensor, pipeline_lse, state, m_block: Int32, head: Int32,
                    batch: Int32, seqlen_q: Int32, lane: Int32, q_offset: Int32 | None = None,
                    seg: cutlass.Constexpr = None):
        """-lse_log2 and -delta of query block m_block's 128 rows into stage ``state`` (the load
        warp's 32 threads; rows past seqlen_q: -inf and 0, so that P = dS = 0 there without a
        row mask; varlen: the sequence's rows from ``q_offset`` on). ``seg`` (segment ids:
        seg_tiles, seg_rows, the id and flag stages, key block n): also each row's id and, by
        lane 0, whether key block n lies outside the query block's bulk (1: mask by id)."""
        tm = self.tile_m
        pipeline_lse.producer_acquire(state)
        for r in cutlass.range_constexpr(tm // 32):
            row = m_block * tm + r * 32 + lane
            row_c = cutlass.min(row, seqlen_q - 1)
            if const_expr(q_offset is not None):
                row_c = row_c + q_offset
            lse = mLSE[row_c, head, batch]
            dlt = mDelta[row_c, head, batch]
            sLSE[r * 32 + lane, state.index] = -lse if row < seqlen_q else -Float32.inf
            sDelta[r * 32 + lane, state.index] = -dlt if row < seqlen_q else Float32(0.0)
            if const_expr(seg is not None):
                seg[2][r * 32 + lane, state.index] = seg[1][batch, row_c, SEG_ROW_ID]
        if const_expr(seg is not None):
            if lane == 0:
                n_block = seg[4]
                outside = (n_block < seg[0][batch, m_block, SEG_BULK_LO]
                           or n_block >= seg[0][batch, m_block, SEG_BULK_HI])
                seg[3][state.index] = Int32(1) if outside else Int32(0)
        pipeline_lse.producer_commit(state)

    # --- load warp ---------------------------------------------------------------------------
    @cute.jit
    def load_warp(self, mQ, mK, mV, mdO, mLSE, mDelta, sQ, sK, sV, sdO, sLSE, sDelta,
                  tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, st_mma: cute.TiledMma,
                  dpt_mma: cute.TiledMma, pipeline_kv, pipeline_q, pipeline_do, pipeline_lse,
                  head: Int32, head_kv: Int32, batch: Int32, n_block: Int32, m_min: Int32,
                  count: Int32, seqlen_q: Int32, tidx: Int32, q_offset: Int32 | None = None,
                  k_offset: Int32 | None = None, segs: cutlass.Constexpr = None):
        """K, V once, then Q, dO (TMA) and -lse / -delta of each visited query block (varlen:
        TMA views from the sequence's first rows, ``q_offset`` / ``k_offset``; ``segs``:
        segment ids, their stages too, stage_stats)."""
        D, Dv, tm, tn = self.hdim, self.hdimv, self.tile_m, self.tile_n
        st_thr, dpt_thr = st_mma.get_slice(0), dpt_mma.get_slice(0)
        one = cute.make_layout(1)
        gK = cute.local_tile(sequence(mK, head_kv, batch, k_offset), (tn, D), (n_block, 0))
        gV = cute.local_tile(sequence(mV, head_kv, batch, k_offset), (tn, Dv), (n_block, 0))
        gQ = cute.local_tile(sequence(mQ, head, batch, q_offset), (tm, D), (None, 0))
        gdO = cute.local_tile(sequence(mdO, head, batch, q_offset), (tm, Dv), (None, 0))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, one, cute.group_modes(sK, 0, 3),
                                           cute.group_modes(st_thr.partition_A(gK), 0, 3))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, one, cute.group_modes(sV, 0, 3),
                                           cute.group_modes(dpt_thr.partition_A(gV), 0, 3))
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, one, cute.group_modes(sQ, 0, 3),
                                           cute.group_modes(st_thr.partition_B(gQ), 0, 3))
        tdOsdO, tdOgdO = cpasync.tma_partition(tma_atom_dO, 0, one, cute.group_modes(sdO, 0, 3),
                                               cute.group_modes(dpt_thr.partition_B(gdO), 0, 3))
        lane = tidx % 32
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                self.do_stages)
        # (the whole warp calls the TMA pipeline / copy ops: they elect one thread inside)
        if count > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipeline_kv.producer_acquire(kv_state)
            cute.copy(tma_atom_K, tKgK, tKsK[None, 0],
                      tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))
            cute.copy(tma_atom_V, tVgV, tVsV[None, 0],
                      tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))
        for j in cutlass.range(count, unroll=1):
            m_block = m_min + j
            self.tma_load(pipeline_q, q_state, tma_atom_Q, tQgQ[None, m_block], tQsQ)
            self.tma_load(pipeline_do, do_state, tma_atom_dO, tdOgdO[None, m_block], tdOsdO)
            # the lse stage follows the Q stage
            self.stage_stats(mLSE, mDelta, sLSE, sDelta, pipeline_lse, q_state, m_block, head,
                             batch, seqlen_q, lane, q_offset,
                             seg=None if const_expr(segs is None) else (*segs, n_block))
            q_state.advance()
            do_state.advance()

    # --- MMA warp ----------------------------------------------------------------------------
    @cute.jit
    def mma_warp(self, storage, sQ_l, sK_l, sV_l, sdO_l, sdOt_l, sQt_l, sKt_l, sdS_l, sdSt_l,
                 tP_l, st_mma: cute.TiledMma, dpt_mma: cute.TiledMma, dv_mma: cute.TiledMma,
                 dk_mma: cute.TiledMma, dq_mma: cute.TiledMma, tmem_ptr, pipeline_kv,
                 pipeline_q, pipeline_do, s_full, p_full, dp_full, ds_full, ds_empty, dq_full,
                 dq_empty, dkv_full, count: Int32):
        D, Dv, tm, tn = self.hdim, self.hdimv, self.tile_m, self.tile_n
        dt = self.dtype

        def view(buf, layout):
            return cute.make_tensor(cute.recast_ptr(buf.data_ptr(), layout.inner, dtype=dt),
                                    layout.outer)

        st_thr, dpt_thr = st_mma.get_slice(0), dpt_mma.get_slice(0)
        dv_thr, dk_thr, dq_thr = dv_mma.get_slice(0), dk_mma.get_slice(0), dq_mma.get_slice(0)
        tSrK = st_thr.make_fragment_A(view(storage.sK, sK_l))
        tSrQ = st_thr.make_fragment_B(view(storage.sQ, sQ_l))
        tPrV = dpt_thr.make_fragment_A(view(storage.sV, sV_l))
        tPrdO = dpt_thr.make_fragment_B(view(storage.sdO, sdO_l))
        tVrdOt = dv_thr.make_fragment_B(view(storage.sdO, sdOt_l))
        tKrdSt = dk_thr.make_fragment_A(view(storage.sdS, sdSt_l))
        tKrQt = dk_thr.make_fragment_B(view(storage.sQ, sQt_l))
        tQrdS = dq_thr.make_fragment_A(view(storage.sdS, sdS_l))
        tQrKt = dq_thr.make_fragment_B(view(storage.sK, sKt_l))

        def acc(thr, shape, offset):
            fake = thr.make_fragment_C(thr.partition_shape_C(shape))
            return cute.make_tensor(tmem_ptr + offset, fake.layout)

        tStS = acc(st_thr, (tn, tm), self.tmem_s)
        tPtP = acc(dpt_thr, (tn, tm), self.tmem_dp)
        tVtV = acc(dv_thr, (tn, Dv), self.tmem_dv)
        tKtK = acc(dk_thr, (tn, D), self.tmem_dk)
        tQtQ = acc(dq_thr, (tm, D), self.tmem_dq)
        # Pᵀ (16-bit) in TMEM: query columns [0, 64) at Sᵀ's 32-bit columns [0, 32), query
        # columns [64, 128) at [64, 96): two views, k-blocks split between them
        tVrP_fake = dv_thr.make_fragment_A(cute.make_tensor(tmem_ptr, tP_l.outer))[
            None, None, None, 0]
        tVrP = [cute.make_tensor(cute.recast_ptr(tmem_ptr + self.tmem_s + off,
                                                 dtype=tVrP_fake.element_type), tVrP_fake.layout)
                for off in (0, self.cols_per_wg // 2)]

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        q_release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                 self.q_stages)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                self.do_stages)
        if count > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipeline_kv.consumer_wait(kv_state)
        for j in cutlass.range(count + 1, unroll=1):
            if j < count:
                # Sᵀ_j = K·Q_jᵀ
                pipeline_q.consumer_wait(q_state)
                for k in cutlass.range_constexpr(cute.size(tSrK, mode=[2])):
                    st_mma.set(tcgen05.Field.ACCUMULATE, k > 0)
                    cute.gemm(st_mma, tStS, tSrK[None, None, k, 0],
                              tSrQ[None, None, k, q_state.index], tStS)
                with cute.arch.elect_one():
                    tcgen05.commit(s_full)
                q_state.advance()
            if j > 0:
                # dS_{j-1} ready (and dPᵀ_{j-1} read): dQ_{j-1} = dS·K over dPᵀ's columns,
                # dK += dSᵀ·Q_{j-1}
                cute.arch.mbarrier_wait(ds_full, (j - 1) % 2)
                for k in cutlass.range_constexpr(cute.size(tQrdS, mode=[2])):
                    dq_mma.set(tcgen05.Field.ACCUMULATE, k > 0)
                    cute.gemm(dq_mma, tQtQ, tQrdS[None, None, k, 0], tQrKt[None, None, k, 0],
                              tQtQ)
                with cute.arch.elect_one():
                    tcgen05.commit(dq_full)
                for k in cutlass.range_constexpr(cute.size(tKrdSt, mode=[2])):
                    dk_mma.set(tcgen05.Field.ACCUMULATE, j > 1 or k > 0)
                    cute.gemm(dk_mma, tKtK, tKrdSt[None, None, k, 0],
                              tKrQt[None, None, k, q_release.index], tKtK)
                with cute.arch.elect_one():
                    tcgen05.commit(ds_empty)
                pipeline_q.consumer_release(q_release)
                q_release.advance()
            if j < count:
                if j > 0:
                    # the reduce warps drained dQ_{j-1} from dPᵀ's columns
                    cute.arch.mbarrier_wait(dq_empty, (j - 1) % 2)
                # dPᵀ_j = V·dO_jᵀ
                pipeline_do.consumer_wait(do_state)
                for k in cutlass.range_constexpr(cute.size(tPrV, mode=[2])):
                    dpt_mma.set(tcgen05.Field.ACCUMULATE, k > 0)
                    cute.gemm(dpt_mma, tPtP, tPrV[None, None, k, 0],
                              tPrdO[None, None, k, do_state.index], tPtP)
                with cute.arch.elect_one():
                    tcgen05.commit(dp_full)
                # dV += Pᵀ_j·dO_j once Pᵀ_j is in TMEM
                cute.arch.mbarrier_wait(p_full, j % 2)
                self.gemm_ts_halves(dv_mma, tVtV, tVrP[0], tVrP[1], tVrdOt, do_state.index,
                                    j > 0)
                pipeline_do.consumer_release(do_state)
                do_state.advance()
        if count > 0:
            with cute.arch.elect_one():
                tcgen05.commit(dkv_full)

    # --- compute warps -----------------------------------------------------------------------
    @cute.jit
    def compute_warps(self, mdK, mdV, mParams, sdS, sLSE, sDelta, st_mma: cute.TiledMma,
                      dk_mma: cute.TiledMma, dv_mma: cute.TiledMma, tmem_ptr, pipeline_lse,
                      s_full, p_full, dp_full, ds_full, ds_empty, dkv_full, head: Int32,
                      head_kv: Int32, batch: Int32, n_block: Int32, m_min: Int32, count: Int32,
                      blocks: BwdBlocks, tidx: Int32, warp_idx: Int32,
                      k_offset: Int32 | None = None, segs: cutlass.Constexpr = None):
        """Pᵀ, dSᵀ of each visited query block, then the epilogue; ``segs`` (segment ids:
        kv_ids, the id and flag stages): this thread's key id is compared with each row's in
        the blocks flagged for it (softmax_p)."""
        tm, tn = self.tile_m, self.tile_n
        cw = self.cols_per_wg
        wg = (warp_idx - COMPUTE_WARPS[0]) // 4  # 0 or 1: query columns [cw·wg, cw·wg + cw)
        lane_row = tidx % 128  # this thread's key row (TMEM lane)
        st_thr = st_mma.get_slice(0)
        acc_layout = st_thr.make_fragment_C(st_thr.partition_shape_C((tn, tm))).layout
        scale = mParams[PARAM_SCALE]
        scale_log2, tanh_in_scale, inv_scale_log2 = self.softmax_scales(mParams)
        key = n_block * tn + lane_row
        seg = None
        if const_expr(segs is not None):
            seg = self.segment_key(segs, batch, key, blocks.seqlen_k)
        lse_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                 self.q_stages)
        for j in cutlass.range(count, unroll=1):
            m_block = m_min + j
            pipeline_lse.consumer_wait(lse_state)
            # ---- Pᵀ = exp2(Sᵀ·scale_log2 − lse) ----
            cute.arch.mbarrier_wait(s_full, j % 2)
            rP = cute.make_rmem_tensor((cw,), Float32)
            self.load_wg_cols(rP, tmem_ptr, acc_layout, self.tmem_s, wg, lane_row, 0, cw)
            self.softmax_p(rP, tmem_ptr, acc_layout, blocks, m_block, n_block, key, wg,
                           lane_row, scale_log2, tanh_in_scale, sLSE, lse_state.index, seg=seg)
            self.store_16bit(rP, tmem_ptr, acc_layout, self.tmem_s, wg, lane_row)
            cute.arch.fence_view_async_tmem_store()
            cute.arch.mbarrier_arrive(p_full)
            # ---- dSᵀ = Pᵀ∘(dPᵀ − delta) [∘ (1 − t²)] ----
            cute.arch.mbarrier_wait(dp_full, j % 2)
            rdS = cute.make_rmem_tensor((cw,), self.dtype)
            self.softmax_ds(rdS, rP, tmem_ptr, acc_layout, wg, lane_row, inv_scale_log2, sLSE,
                            sDelta, lse_state.index)
            pipeline_lse.consumer_release(lse_state)
            lse_state.advance()
            if j > 0:
                cute.arch.mbarrier_wait(ds_empty, (j - 1) % 2)  # dK / dQ_{j-1} read dS
            # dS (tm, tn) m-major: this thread's key column, this warpgroup's query rows
            sdS_col = sdS[None, None, None, 0]
            sdS_mn = cute.make_tensor(sdS_col.iterator, cute.composition(
                sdS_col.layout, cute.make_layout((tm, tn))))
            dst = cute.local_tile(sdS_mn[None, lane_row], (cw,), (wg,))
            cute.autovec_copy(rdS, dst)
            cute.arch.fence_proxy("async.shared", space="cta")  # st.shared -> UMMA reads
            cute.arch.mbarrier_arrive(ds_full)

        # ---- epilogue: dK · scale, dV -> global (rows past seqlen_k skipped) ----
        self.epilogue(mdK, mdV, tmem_ptr, acc_layout, dkv_full, scale, head, head_kv, batch,
                      n_block, count, key, lane_row, wg, k_offset, blocks.seqlen_k)

    @cute.jit
    def zero_padding_dkv(self, mdK: cute.Tensor, mdV: cute.Tensor, mCuSeqlensK: cute.Tensor,
                         head: Int32, head_kv: Int32, tidx: Int32):
        """Varlen, the ZERO_PADDING work item (the compute warps, after their count = 0
        epilogue): zero dK / dV of this CTA's head on the packed rows outside every sequence."""
        head_dkv = head if const_expr(self.gqa) else head_kv
        num = 32 * len(COMPUTE_WARPS)
        t = tidx - 32 * COMPUTE_WARPS[0]
        zero_padding_rows(mdK, mCuSeqlensK, head_dkv, (self.tile_n, self.hdim), num, t,
                          Int32(0), Int32(1))
        zero_padding_rows(mdV, mCuSeqlensK, head_dkv, (self.tile_n, self.hdimv), num, t,
                          Int32(0), Int32(1))

    # --- compute-warp pieces (shared with the 2-CTA kernel, bwd_2cta.py) ---------------------
    @cute.jit
    def softmax_scales(self, mParams: cute.Tensor):
        """(scale_log2, tanh_in_scale, inv_scale_log2) from params (the last two only with
        softcap: S = softcap·tanh(q·kᵀ·scale/softcap), so P = exp2(t·softcap·log2 e − lse))."""
        scales = score_scales(mParams[PARAM_SCALE], mParams, self.has_softcap, inverse=True)
        return scales.scale_log2, scales.tanh_in_scale, scales.inv_scale_log2

    @cute.jit
    def load_wg_cols(self, dst: cute.Tensor, tmem_ptr, acc_layout, base: int, wg: Int32,
                     lane_row: Int32, col: int, num: int):
        """dst[0 .. num) = this thread's lane of TMEM columns base + cw·wg + col … + num, in
        the order of the columns (32x32b loads of 32 columns; ends with tcgen05.wait::ld)."""
        cw = self.cols_per_wg
        ld32 = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32),
            tmem_cols(tmem_ptr, acc_layout, 0, 32))
        thr = ld32.get_slice(lane_row)
        # the column of each loaded value (the same for every lane: take lane 0's, static)
        tTc = ld32.get_slice(0).partition_D(cute.make_identity_tensor((128, 32)))
        for c in cutlass.range_constexpr(num // 32):
            rc = cute.make_rmem_tensor(tTc.shape, Float32)
            if wg == 0:
                cute.copy(ld32, thr.partition_S(
                    tmem_cols(tmem_ptr, acc_layout, base + col + 32 * c, 32)), rc)
            else:
                cute.copy(ld32, thr.partition_S(
                    tmem_cols(tmem_ptr, acc_layout, base + cw + col + 32 * c, 32)), rc)
            for i in cutlass.range_constexpr(32):
                dst[32 * c + tTc[i][1]] = rc[i]
        cute.arch.fence_view_async_tmem_load()

    @cute.jit
    def softmax_p(self, rP: cute.Tensor, tmem_ptr, acc_layout, blocks: BwdBlocks,
                  m_block: Int32, n_block: Int32, key: Int32, wg: Int32, lane_row: Int32,
                  scale_log2: Float32, tanh_in_scale: Float32, sLSE: cute.Tensor, stage: Int32,
                  seg: cutlass.Constexpr = None):
        """rP (Sᵀ of this thread's key and the warpgroup's cw query columns, loaded by the
        caller with load_wg_cols) → Pᵀ: [softcap,] masked (query-block skipping: only tiles
        ``blocks`` says are cut), exp2. ``seg`` (segment ids: the staged row ids and mask
        flags, this thread's key id): in a block flagged outside its query tile's bulk, a
        column whose row id is not the key's is masked too."""
        cw, tm = self.cols_per_wg, self.tile_m
        tail, cut_right, cut_left = BwdBlocks.mask_reasons(blocks, m_block, n_block)
        need_mask = tail or cut_right or cut_left
        if const_expr(seg is not None):
            need_mask = need_mask or seg[1][stage] != 0
        lo, hi = BwdBlocks.visible_rows(blocks, key, m_block)
        lo = lo - cw * wg
        hi = hi - cw * wg
        if key >= blocks.seqlen_k:
            lo = Int32(tm)
        col0 = cw * wg  # first query column of this warpgroup in the lse / delta rows
        if const_expr(self.has_softcap):
            for i in cutlass.range_constexpr(cw):
                rP[i] = cute.math.tanh(rP[i] * tanh_in_scale, fastmath=True)
        if need_mask:
            for i in cutlass.range_constexpr(cw):
                visible = i >= lo  # rP[i] is query column cw·wg + i (load_wg_cols)
                if const_expr(self.is_local):
                    visible = visible and i <= hi
                if const_expr(seg is not None):
                    visible = visible and seg[0][col0 + i, stage] == seg[2]
                rP[i] = rP[i] if visible else -Float32.inf
        for i in cutlass.range_constexpr(0, cw, 2):
            rP[i], rP[i + 1] = cute.arch.fma_packed_f32x2(
                (rP[i], rP[i + 1]), (scale_log2, scale_log2),
                (sLSE[col0 + i, stage], sLSE[col0 + i + 1, stage]))
            rP[i] = cute.math.exp2(rP[i], fastmath=True)
            rP[i + 1] = cute.math.exp2(rP[i + 1], fastmath=True)

    @cute.jit
    def store_16bit(self, r: cute.Tensor, tmem_ptr, acc_layout, base: int, wg: Int32,
                    lane_row: Int32):
        """Store r (cw values: float32, packed here to 16-bit pairs, or already 16-bit) in this
        thread's lane of TMEM columns base + p16_stride·wg … + cw/2 (p16_stride = cw: columns
        the warpgroup has read itself). The caller fences (tcgen05.wait::st) before
        signalling."""
        cw = self.cols_per_wg
        st = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(cw // 2)),
                                Float32), tmem_cols(tmem_ptr, acc_layout, 0, cw // 2))
        thr = st.get_slice(lane_row)
        r16 = cute.make_rmem_tensor(
            thr.partition_S(cute.make_identity_tensor((128, cw // 2))).shape, Float32)
        r16_i = cute.recast_tensor(r16, Int32)
        if const_expr(r.element_type == Float32):
            for i in cutlass.range_constexpr(cute.size(r16_i)):
                r16_i[i] = cvt_pack_f32x2(r[2 * i], r[2 * i + 1], self.is_bf16)
        else:
            r_i = cute.recast_tensor(r, Int32)
            for i in cutlass.range_constexpr(cute.size(r16_i)):
                r16_i[i] = r_i[i]
        if wg == 0:
            cute.copy(st, r16, thr.partition_D(tmem_cols(tmem_ptr, acc_layout, base, cw // 2)))
        else:
            cute.copy(st, r16, thr.partition_D(tmem_cols(
                tmem_ptr, acc_layout, base + self.p16_stride, cw // 2)))

    @cute.jit
    def softmax_ds(self, rdS: cute.Tensor, rP: cute.Tensor, tmem_ptr, acc_layout, wg: Int32,
                   lane_row: Int32, inv_scale_log2: Float32, sLSE: cute.Tensor,
                   sDelta: cute.Tensor, stage: Int32):
        """rdS (16-bit) = Pᵀ∘(dPᵀ − delta) [∘ (1 − t²)] for the warpgroup's cw query columns,
        dPᵀ loaded from TMEM in 32-column chunks (live registers: Pᵀ + one dPᵀ chunk)."""
        cw = self.cols_per_wg
        col0 = cw * wg
        rdS_i = cute.recast_tensor(rdS, Int32)
        for c in cutlass.range_constexpr(cw // 32):
            rdP = cute.make_rmem_tensor((32,), Float32)
            self.load_wg_cols(rdP, tmem_ptr, acc_layout, self.tmem_dp, wg, lane_row, 32 * c, 32)
            for i in cutlass.range_constexpr(0, 32, 2):
                q = 32 * c + i
                rdP[i], rdP[i + 1] = cute.arch.add_packed_f32x2(
                    (rdP[i], rdP[i + 1]), (sDelta[col0 + q, stage], sDelta[col0 + q + 1, stage]))
                rdP[i], rdP[i + 1] = cute.arch.mul_packed_f32x2((rdP[i], rdP[i + 1]),
                                                                (rP[q], rP[q + 1]))
            if const_expr(self.has_softcap):
                for i in cutlass.range_constexpr(32):
                    # tanh' = 1 − t², t recovered from P = exp2(t·scale_log2 − lse); P below
                    # the smallest normal float (masked, empty row) gives dS = 0
                    p = rP[32 * c + i]
                    t = (cute.math.log2(p, fastmath=True)
                         - sLSE[col0 + 32 * c + i, stage]) * inv_scale_log2
                    rdP[i] = rdP[i] * (Float32(1.0) - t * t) if p >= Float32(_FLT_MIN_NORMAL) \
                        else Float32(0.0)
            for i in cutlass.range_constexpr(16):
                rdS_i[16 * c + i] = cvt_pack_f32x2(rdP[2 * i], rdP[2 * i + 1], self.is_bf16)

    @cute.jit
    def epilogue(self, mdK, mdV, tmem_ptr, acc_layout, dkv_full, scale: Float32, head: Int32,
                 head_kv: Int32, batch: Int32, n_block: Int32, count: Int32, key: Int32,
                 lane_row: Int32, wg: Int32, k_offset: Int32 | None = None,
                 seqlen_k: Int32 | None = None):
        """dK · scale and dV of this thread's key row to global memory (rows past the keys
        skipped; varlen: the sequence's rows from ``k_offset`` on, below ``seqlen_k``)."""
        D, Dv, tn = self.hdim, self.hdimv, self.tile_n
        ch = self.epi_chunk
        head_dkv = head if const_expr(self.gqa) else head_kv
        out_type = Float32 if const_expr(self.gqa) else self.dtype
        ld = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(ch)), Float32),
            tmem_cols(tmem_ptr, acc_layout, 0, ch))
        thr_ld = ld.get_slice(lane_row)
        tTc = thr_ld.partition_D(cute.make_identity_tensor((128, ch)))
        if count > 0:
            cute.arch.mbarrier_wait(dkv_full, 0)
        for which in cutlass.range_constexpr(2):  # 0: dV, 1: dK
            width = Dv if which == 0 else D
            base = self.tmem_dv if which == 0 else self.tmem_dk
            mX = mdV if which == 0 else mdK
            half = width // 2
            gX = cute.local_tile(sequence(mX, head_dkv, batch, k_offset), (tn, width),
                                 (n_block, 0))
            row = gX[lane_row, None]
            for c in cutlass.range_constexpr(half // ch):
                r = cute.make_rmem_tensor(tTc.shape, Float32)
                if count > 0:
                    if wg == 0:
                        cute.copy(ld, thr_ld.partition_S(
                            tmem_cols(tmem_ptr, acc_layout, base + c * ch, ch)), r)
                    else:
                        cute.copy(ld, thr_ld.partition_S(
                            tmem_cols(tmem_ptr, acc_layout, base + half + c * ch, ch)), r)
                    cute.arch.fence_view_async_tmem_load()
                    if const_expr(which == 1):
                        for i in cutlass.range_constexpr(ch):
                            r[i] = r[i] * scale
                else:
                    r.fill(0.0)  # a key block no query sees: zero gradients
                r_out = cute.make_rmem_tensor((ch,), out_type)
                if const_expr(self.gqa):
                    for i in cutlass.range_constexpr(ch):
                        r_out[i] = r[i]
                else:
                    r_out_i = cute.recast_tensor(r_out, Int32)
                    for i in cutlass.range_constexpr(ch // 2):
                        r_out_i[i] = cvt_pack_f32x2(r[2 * i], r[2 * i + 1], self.is_bf16)
                if key < (mX.shape[0] if const_expr(k_offset is None) else seqlen_k):
                    dst = cute.local_tile(row, (ch,), (wg * (half // ch) + c,))
                    cute.autovec_copy(r_out, dst)

    # --- dQ reduce warps ---------------------------------------------------------------------
    @cute.jit
    def reduce_warps(self, mdQacc, mSem, sdQ, tma_atom_dQ, dq_mma: cute.TiledMma, tmem_ptr,
                     dq_full, dq_empty, head: Int32, batch: Int32, n_block: Int32, m_min: Int32,
                     count: Int32, blocks: BwdBlocks, tidx: Int32, warp_idx: Int32,
                     dq_tile0: Int32 | None = None):
        """dQ_j of each visited query block: TMEM → shared memory → TMA reduce-add into
        dq_accum's tile m_block (varlen: ``dq_tile0 + m_block``, the sequence's tiles)."""
        tm, D, nc = self.tile_m, self.hdim, self.dq_cols
        dq_thr = dq_mma.get_slice(0)
        acc_layout = dq_thr.make_fragment_C(dq_thr.partition_shape_C((tm, D))).layout
        ld = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(nc)), Float32),
            tmem_cols(tmem_ptr, acc_layout, 0, nc))
        thr_ld = ld.get_slice(tidx)
        tTc = thr_ld.partition_D(cute.make_identity_tensor((tm, nc)))
        tTsdQ = thr_ld.partition_D(sdQ)  # (regs, 1, 1, stages)
        gdQ = cute.local_tile(mdQacc[None, None, head, batch], (tm, nc), (None, None))
        tdQsdQ, tdQgdQ = cpasync.tma_partition(tma_atom_dQ, 0, cute.make_layout(1),
                                               cute.group_modes(sdQ, 0, 2),
                                               cute.group_modes(gdQ, 0, 2))
        reduce_barrier = pipeline.NamedBarrier(barrier_id=int(Barrier.REDUCE),
                                               num_threads=32 * len(REDUCE_WARPS))
        num_chunks = D // nc
        stage = Int32(0)
        for j in cutlass.range(count, unroll=1):
            m_block = m_min + j
            dq_tile = m_block if const_expr(dq_tile0 is None) else dq_tile0 + m_block
            cute.arch.mbarrier_wait(dq_full, j % 2)
            for c in cutlass.range_constexpr(num_chunks):
                r = cute.make_rmem_tensor(tTc.shape, Float32)
                cute.copy(ld, thr_ld.partition_S(
                    tmem_cols(tmem_ptr, acc_layout, self.tmem_dq + c * nc, nc)), r)
                cute.arch.fence_view_async_tmem_load()
                if const_expr(c == num_chunks - 1):
                    cute.arch.mbarrier_arrive(dq_empty)  # dPᵀ's columns free for dPᵀ_{j+1}
                # staging buffer `stage` free: the reduce-add that last read it has finished
                if warp_idx == 0:
                    cute.arch.cp_async_bulk_wait_group(self.dq_stages - 1, read=True)
                reduce_barrier.arrive_and_wait()
                cute.autovec_copy(r, tTsdQ[None, 0, 0, stage])
                cute.arch.fence_proxy("async.shared", space="cta")  # st.shared -> TMA reads
                reduce_barrier.arrive_and_wait()
                if warp_idx == 0:
                    # one thread (elect.sync: the same lane every time) acquires the turn,
                    # issues the reduce-adds, waits for them and releases the turn
                    with cute.arch.elect_one():
                        if const_expr(self.deterministic and c == 0):
                            # wait for this key block's turn on query block m_block
                            turn = BwdBlocks.dq_rank(blocks, m_block, n_block)
                            sem_ptr = mSem[None, head, batch].iterator + m_block
                            seen = ld_acquire_gpu(sem_ptr)
                            while seen != turn:
                                seen = ld_acquire_gpu(sem_ptr)
                        cute.copy(tma_atom_dQ, tdQsdQ[None, stage], tdQgdQ[None, dq_tile, c])
                        cute.arch.cp_async_bulk_commit_group()
                        if const_expr(self.deterministic and c == num_chunks - 1):
                            # every reduce-add of this block performed (writes, not only the
                            # shared-memory reads), then publish the next key block's turn
                            cute.arch.cp_async_bulk_wait_group(0, read=False)
                            red_release_gpu_add(mSem[None, head, batch].iterator + m_block, 1)
                stage = (stage + 1) % self.dq_stages
        if warp_idx == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
