"""FlashAttention forward for Blackwell (sm_100a), written in CuTe-DSL: v2 of the FA4 design.

Features: bf16/fp16, head dims from fwd_tuning.TUNING_TABLE (64, 96, 128, 192/128, 192/192, 256),
dynamic batch / sequence lengths / head counts (one compile serves all), GQA/MQA (q head h reads kv
head h // (H // Hkv)), key-length tail mask, bottom-right aligned causal and sliding-window masks
with key-block skipping, softcap, lse output; software exp2 on the FMA pipe for a compile-time share
of each row (common/exp2.py), FA4's conditional rescaling done by a separate correction warpgroup,
persistent CTAs (SM count from the config) with heavy tiles first under causal / local masks
(tile_order.py); paged KV and packed (varlen) sequences; (dense) segment ids and each row's max
logit.

A CTA is persistent over work tiles of ``q_tiles`` × 128 query rows of one (batch, head). With
``q_tiles = 2`` (head dims 64–128) it has 16 warps:

  * warps 0–3 / 4–7: softmax of Q tile 0 / Q tile 1 (thread = query row = TMEM lane). The two
    warpgroups ping-pong: while one computes exponentials, the MMA warp runs the other tile's
    GEMMs. Per key block: wait S, load the row from TMEM, softcap, mask, row max, conditional
    rescale decision (the factor goes to the correction warpgroup through shared memory, signalled
    *before* the exponentials so the O rescale overlaps them), P = exp2(S·c − m·c) (MUFU and
    software exp2 mixed), P as 16-bit pairs into the upper half of the S buffer, signal the MMA
    warp. At the end of a tile: lse (and the max logit), and 1/Σ for the correction warpgroup.
  * warps 8–11: correction (thread = TMEM lane, both Q tiles). Per key block and Q tile: take the
    factor; once the previous P·V has completed, rescale that O tile in TMEM when some row of the
    warp needs it (warp vote); signal the MMA warp. Epilogue: O·(1/Σ) → 16-bit → swizzled shared
    memory → signal the epilogue warp (varlen: each thread stores its own row to global memory).
  * warp 12: MMA issue (one elected thread) and TMEM allocation (all 512 columns).
  * warp 13: epilogue, the TMA store of each staged O tile.
  * warp 14: TMA loads of Q0, Q1 and of K and V through ONE shared ring of ``kv_stages`` stages,
    in exactly the order the MMA warp consumes them: K0, V0, K1, V1, ….
  * warp 15: idle (its warpgroup lowers its registers with the MMA / epilogue / load warps).

MMA order per tile (q_tiles = 2; tcgen05 MMAs of one thread complete in order):
    S0 = Q0·K0ᵀ, S1 = Q1·K0ᵀ; for j ≥ 1: [P0 written + O0 rescaled] O0 += P0·V(j−1), S0 = Q0·Kjᵀ,
    [P1 + O1] O1 += P1·V(j−1), S1 = Q1·Kjᵀ; finally O0 += P0·V_last, O1 += P1·V_last.
A QK into S_t is issued after the PV that reads P_t (aliased in S_t), so it overwrites P only
after it was read; the commit signalling S_t also covers the previous PV into O_t.

With ``q_tiles = 1`` (head dims 192/128, 192/192 and 256, whose two O tiles would not fit in TMEM
next to two S buffers, or not in shared memory) the CTA has 12 warps (softmax 0–3, correction 4–7,
MMA 8, epilogue 9, load 10, idle 11), one Q tile, and S double-buffered per key block instead:
S_{j+1} is issued before PV_j so the tensor core computes the next scores while the softmax works
(ring order K0, K1, V0, K2, V1, …).

TMEM map (32-bit columns): S buffers at [0, tile_n) and [tile_n, 2·tile_n) (P_b at S_b + tile_n/2),
O tiles from 2·tile_n, head_dim_v columns each.

Synchronisation (raw mbarriers; phases from per-CTA counters carried across persistent tiles;
"slot" = S buffer: Q tile t with q_tiles = 2, the key block's parity with q_tiles = 1):
  s_full[b]     MMA → softmax      tcgen05.commit after S into buffer b (count 1)
  stats_full[b] softmax → corr.    rescale factor in sScale[b] written (count 128)
  p_full[b]     softmax+corr → MMA P_b stored and fenced, O rescaled and fenced (count 256)
  o_full[t]     MMA → corr.        tcgen05.commit after each P·V into O_t (count 1)
  sum_full[t]   softmax → corr.    1/Σ of tile t in sSum[t] (count 128)
  sum_empty[t]  corr. → softmax    sSum[t] read (count 128): softmax may run a tile ahead
  o_staged[t]   corr. → epilogue   O_t in sO[t], fenced for the async proxy (count 128)
  o_stored[t]   epilogue → corr.   the TMA store has read sO[t] (count 1)
  Q and the K/V ring: PipelineTmaUmma (TMA transaction bytes; released by tcgen05.commit).
  TMEM: allocated by the MMA warp, pointer published through shared memory + a named barrier;
  permit relinquished right after; freed by the MMA warp after all TMEM users (softmax and
  correction warps, after their last tcgen05.wait::ld) and itself pass the dealloc barrier.
Each producer can run at most one phase ahead of its consumer on every barrier (every chain is
closed by a wait in the other direction), which the parity waits require.

Varlen (FwdConfig.varlen; spec.varlen_attention_forward_signature): q, k, v, out are packed
sequences viewed as one batch entry (1, total, H, ·). lse (batch, H, max_seqlen_q) sets the work
tiles: ceil(max_seqlen_q / (128·q_tiles)) M tiles × H × (batch + 1), walked by the same persistent
loop. Every role derives the tile's sequence (q_offset, k_offset, seqlen_q, seqlen_k) from
cu_seqlens itself (tile_seq), so all agree on the tile's key-block count; a tile past its
sequence's end has zero key blocks in every role and stores nothing. O is not TMA-stored (a whole
tile would overwrite the next sequence's rows): each correction thread writes its own row from
registers, 16 bytes per store, when the row is below seqlen_q. The extra batch slice (batch ==
number of sequences) writes zeros to the packed output rows outside every sequence.

Max logits (FwdConfig.max_logits, dense): a third output (B, H, Sq) float32, each row's largest
visible logit. The max the softmax applies (R) lags the row's true max under conditional
rescaling, so each softmax thread keeps a second running max, of the scaled block maxima
(max(s)·scale_log2, after softcap and masks), and writes it divided by log2 e with lse: the
Hopper forward's rule and rounding (common/softmax.OnlineSoftmax.logits_max). No other role is
involved.

Segment ids (FwdConfig.segments, dense): jax_fa4/segments.py's three tables, built for 128-row Q
tiles (the TMEM lanes of one softmax warpgroup): per Q tile its key-block range [n_lo, n_hi)
((0, 0): no row sees a key) and a compare-ids flag, per row its key span [start, end) and id,
and the keys' ids. Every role intersects its work tile's key-block range with the union of the
work tile's Q tiles' ranges (segment_blocks: the same in every role, so all agree on the block
count; a tile with none stores O = 0, lse = -inf). The softmax, which masks every block anyway,
bounds each row's visible columns by its span as by a window, and in a flagged Q tile (ids that
are not one contiguous run) also masks every key whose id is not the row's, reading the ids from
global memory. The tables' bulk columns (blocks every row sees whole) are not read: no block goes
unmasked here. No barrier changes.

Missing relative to FA4 (see docs/kernels/sm100.md): 2-CTA MMA, the L2 head swizzle, the "last
quarter of P" early PV start, a dedicated hdim-256 kernel.
"""

from __future__ import annotations

import enum
import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, tcgen05

from jax_fa4.kernels.common.convert import cvt_pack_f32x2
from jax_fa4.kernels.common.exp2 import exp2_is_software, exp2_sw_x2
from jax_fa4.kernels.common.geometry import (FwdBlocks, paged_keys, resolve_windows,
                                             varlen_sequence)
from jax_fa4.kernels.common.layout import select_modes
from jax_fa4.kernels.common.scores import score_scales
from jax_fa4.kernels.common.softmax import exact_limit_log2
from jax_fa4.kernels.common.views import dim_major, seq_major, sequence
from jax_fa4.kernels.sm100 import tile_order
from jax_fa4.kernels.sm100.fwd_config import FwdConfig
from jax_fa4.kernels.segments_config import (SEG_IDS, SEG_N_HI, SEG_N_LO, SEG_ROW_END,
                                             SEG_ROW_ID, SEG_ROW_START)
from jax_fa4.kernels.spec import LN2, LOG2_E, PARAM_SCALE

LANES = 128  # TMEM lanes = query rows of one Q tile = threads of one warpgroup


class Barrier(enum.IntEnum):
    # 0 is __syncthreads
    TMEM_ALLOC = 1  # TMEM users: pointer published
    TMEM_DEALLOC = 2  # TMEM users: every TMEM access done


class FlashAttentionForwardSm100:
    def __init__(self, cfg: FwdConfig):
        cfg.validate()
        self.cfg = cfg
        self.dtype = cutlass.BFloat16 if cfg.dtype == "bfloat16" else cutlass.Float16
        self.is_bf16 = cfg.dtype == "bfloat16"
        self.paged = cfg.paged
        self.varlen = cfg.varlen
        self.max_logits = cfg.max_logits
        self.segments = cfg.segments
        self.hdim, self.hdimv = cfg.head_dim, cfg.head_dim_v
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.q_tiles = cfg.q_tiles
        self.cta_rows = self.q_tiles * self.tile_m  # query rows of one work tile
        self.kv_stages = cfg.kv_stages
        self.is_causal = cfg.mask == "causal"
        self.is_local = cfg.mask == "local"
        self.has_softcap = cfg.has_softcap
        self.exp2_sw_per_32 = cfg.exp2_sw_per_32
        self.rescale_threshold = cfg.rescale_threshold
        self.num_threads = cfg.num_threads
        self.tmem_alloc_cols = cfg.tmem_alloc_columns()
        self.tmem_o_offset = 2 * self.tile_n  # O_t at tmem_o_offset + t·head_dim_v
        self.o_chunk = 16  # O columns per TMEM load in the rescale and the epilogue
        assert self.hdimv % self.o_chunk == 0
        # warp roles (module docstring)
        self.mma_warp_idx = 4 * (self.q_tiles + 1)
        self.epilogue_warp_idx = self.mma_warp_idx + 1
        self.load_warp_idx = self.mma_warp_idx + 2
        self.softmax_regs, self.correction_regs, self.other_regs = cfg.registers()

    # ---------------------------------------------------------------------------------------------
    # Host side: views, layouts, TMA atoms, launch
    # ---------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, stream: cuda.CUstream, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mParams: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mPageTable: cute.Tensor | None = None, mSeqUsedK: cute.Tensor | None = None,
                 mCuSeqlensQ: cute.Tensor | None = None, mCuSeqlensK: cute.Tensor | None = None,
                 mMaxLogits: cute.Tensor | None = None, mSegTiles: cute.Tensor | None = None,
                 mSegRows: cute.Tensor | None = None, mKvIds: cute.Tensor | None = None):
        for name, t in (("q", mQ), ("k", mK), ("v", mV), ("out", mO)):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"{name}: expected {self.dtype}, got {t.element_type}")
        if const_expr(mLSE.element_type != Float32 or mParams.element_type != Float32):
            raise TypeError("lse and params must be float32")
        if const_expr(self.paged != (mPageTable is not None) or
                      self.paged != (mSeqUsedK is not None)):
            raise TypeError("page_table and seqused_k are given exactly when the config is paged")
        if const_expr(self.varlen != (mCuSeqlensQ is not None) or
                      self.varlen != (mCuSeqlensK is not None)):
            raise TypeError("cu_seqlens_q and cu_seqlens_k are given exactly when the config is "
                            "varlen")
        if const_expr(self.max_logits != (mMaxLogits is not None)):
            raise TypeError("max_logits is given exactly when the config has max logits")
        if const_expr(mMaxLogits is not None and mMaxLogits.element_type != Float32):
            raise TypeError(f"max_logits: expected Float32, got {mMaxLogits.element_type}")
        if const_expr(self.segments != (mSegTiles is not None) or
                      self.segments != (mSegRows is not None) or
                      self.segments != (mKvIds is not None)):
            raise TypeError("seg_tiles, seg_rows and kv_ids are given exactly when the config "
                            "has segments")
        for name, t in (("page_table", mPageTable), ("seqused_k", mSeqUsedK),
                        ("cu_seqlens_q", mCuSeqlensQ), ("cu_seqlens_k", mCuSeqlensK),
                        ("seg_tiles", mSegTiles), ("seg_rows", mSegRows), ("kv_ids", mKvIds)):
            if const_expr(t is not None and t.element_type != Int32):
                raise TypeError(f"{name}: expected Int32, got {t.element_type}")
        D, Dv = self.hdim, self.hdimv
        mQ, mK = seq_major(mQ, D), seq_major(mK, D)
        mV, mO = dim_major(mV, Dv), seq_major(mO, Dv)
        mLSE = select_modes(mLSE, (2, 1, 0))  # (Sq, H, B); varlen: (max_seqlen_q, H, batch)
        if const_expr(mMaxLogits is not None):
            mMaxLogits = select_modes(mMaxLogits, (2, 1, 0))  # (Sq, H, B), as lse

        cta_group = tcgen05.CtaGroup.ONE
        qk_tiler = (self.tile_m, self.tile_n, D)
        pv_tiler = (self.tile_m, Dv, self.tile_n)
        qk_mma, pv_mma, tP_layout = self.make_mmas()

        sQ_layout = sm100_utils.make_smem_layout_a(qk_mma, qk_tiler, self.dtype, self.q_tiles)
        sK_layout = sm100_utils.make_smem_layout_b(qk_mma, qk_tiler, self.dtype, self.kv_stages)
        sV_layout0 = sm100_utils.make_smem_layout_b(pv_mma, pv_tiler, self.dtype, self.kv_stages)
        # K and V share one ring: both get the stage stride of the larger tile
        k_tile = cute.cosize(cute.select(sK_layout, mode=[0, 1, 2]))
        v_tile = cute.cosize(cute.select(sV_layout0, mode=[0, 1, 2]))
        stage_elems = max(k_tile, v_tile)
        sK_layout = cute.append(cute.select(sK_layout, mode=[0, 1, 2]),
                                cute.make_layout(self.kv_stages, stride=stage_elems))
        sV_layout = cute.append(cute.select(sV_layout0, mode=[0, 1, 2]),
                                cute.make_layout(self.kv_stages, stride=stage_elems))
        sO_layout = sm100_utils.make_smem_layout_epi(
            self.dtype, utils.LayoutEnum.ROW_MAJOR, (self.tile_m, Dv), self.q_tiles)

        g2s = cpasync.CopyBulkTensorTileG2SOp(cta_group)
        tma_atom_Q, tma_Q = cute.nvgpu.make_tiled_tma_atom_A(
            g2s, mQ, cute.select(sQ_layout, mode=[0, 1, 2]), qk_tiler, qk_mma)
        tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, mK, cute.select(sK_layout, mode=[0, 1, 2]), qk_tiler, qk_mma)
        tma_atom_V, tma_V = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, mV, cute.select(sV_layout, mode=[0, 1, 2]), pv_tiler, pv_mma)
        tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, cute.select(sO_layout, mode=[0, 1]),
            (self.tile_m, Dv))

        self.tx_bytes_q = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1, 2]))
        self.tx_bytes_k = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1, 2]))
        self.tx_bytes_v = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1, 2]))

        q_tiles = self.q_tiles

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * q_tiles]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            mbar_s_full: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_stats_full: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_p_full: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_o_full: cute.struct.MemRange[cutlass.Int64, q_tiles]
            mbar_sum_full: cute.struct.MemRange[cutlass.Int64, q_tiles]
            mbar_sum_empty: cute.struct.MemRange[cutlass.Int64, q_tiles]
            mbar_o_staged: cute.struct.MemRange[cutlass.Int64, q_tiles]
            mbar_o_stored: cute.struct.MemRange[cutlass.Int64, q_tiles]
            tmem_holding_buf: Int32
            sScale: cute.struct.MemRange[Float32, 2 * LANES]  # per S buffer: rescale factors
            sSum: cute.struct.MemRange[Float32, q_tiles * LANES]  # per Q tile: 1/Σ
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sO_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, stage_elems * self.kv_stages],
                                   1024]

        if const_expr(SharedStorage.__sizeof__() != self.cfg.smem_bytes()):
            # FwdConfig.validate checks smem_bytes against the limit: keep them in step
            raise AssertionError(f"shared storage {SharedStorage.__sizeof__()} B != "
                                 f"FwdConfig.smem_bytes() {self.cfg.smem_bytes()} B")
        if const_expr(self.varlen):
            # the longest sequence and the batch come from lse; one more batch slice zeroes
            # the packed rows outside every sequence
            num_m_blocks = cute.ceil_div(mLSE.shape[0], self.cta_rows)
            total = num_m_blocks * mQ.shape[2] * (mLSE.shape[2] + 1)
        else:
            num_m_blocks = cute.ceil_div(mQ.shape[0], self.cta_rows)
            total = num_m_blocks * mQ.shape[2] * mQ.shape[3]
        grid = cutlass.min(total, self.cfg.num_sms)
        grid = cutlass.max(grid, 1)
        self.kernel(
            tma_Q, tma_K, tma_V, tma_O, mLSE, mParams, mPageTable, mSeqUsedK,
            mCuSeqlensQ, mCuSeqlensK, mO if const_expr(self.varlen) else None, mMaxLogits,
            mSegTiles, mSegRows, mKvIds, tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O,
            sQ_layout, sK_layout, sV_layout, sO_layout, tP_layout,
            qk_mma, pv_mma, SharedStorage,
        ).launch(grid=[grid, 1, 1], block=[self.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=1)

    def make_mmas(self):
        """(S = Q·Kᵀ MMA (both operands from shared memory), O += P·V MMA (P from TMEM), the
        layout of P as the A operand of the latter)."""
        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        cta_group = tcgen05.CtaGroup.ONE
        qk_mma = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32, cta_group,
            (self.tile_m, self.tile_n))
        pv_mma = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, cta_group,
            (self.tile_m, self.hdimv), tcgen05.OperandSource.TMEM)
        tP_layout = sm100_utils.make_smem_layout_a(
            pv_mma, (self.tile_m, self.hdimv, self.tile_n), self.dtype, 1)
        return qk_mma, pv_mma, tP_layout

    def softmax_tmem_copies(self, qk_mma: cute.TiledMma, tmem_ptr, lane):
        """A softmax thread's TMEM copies: (S row load, its source at S buffer 0, the score
        coordinates of its registers, p_io = (P chunk store, its destination at P of buffer 0,
        the P coordinates of its registers, chunk width in 32-bit columns))."""
        qk_thr = qk_mma.get_slice(0)
        tStS_fake = qk_thr.make_fragment_C(qk_thr.partition_shape_C((self.tile_m, self.tile_n)))
        tStS0 = cute.make_tensor(tmem_ptr, tStS_fake.layout)
        tScS = qk_thr.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        # S row: tile_n fp32 columns per thread, 32x32b loads
        ld_s = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32),
            tStS0)
        thr_ld_s = ld_s.get_slice(lane)
        tTtS0 = thr_ld_s.partition_S(tStS0)
        tTcS = thr_ld_s.partition_D(tScS)
        # P: tile_n/2 32-bit columns (16-bit pairs) at the upper half of the S buffer, stored
        # in chunks of p_chunk columns (2·p_chunk scores) as they are computed
        p_cols, p_chunk = self.tile_n // 2, 16
        tStP = cute.make_tensor(tmem_ptr, cute.composition(
            tStS0.layout, cute.make_layout((self.tile_m, p_cols))))
        tStP_i = cute.logical_divide(tStP, cute.make_layout((self.tile_m, p_chunk)))
        st_p = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(p_chunk)),
                                Float32), tStP_i[(None, None), 0])
        thr_st_p = st_p.get_slice(lane)
        tTtP0 = thr_st_p.partition_D(tStP_i[(None, None), None])
        cP_i = cute.logical_divide(cute.make_identity_tensor((self.tile_m, p_cols)),
                                   cute.make_layout((self.tile_m, p_chunk)))
        tTcP = thr_st_p.partition_S(cP_i[(None, None), None])
        return ld_s, tTtS0, tTcS, (st_p, tTtP0, tTcP, p_chunk)

    def o_tmem_copies(self, pv_mma: cute.TiledMma, tmem_ptr, lane):
        """A correction thread's TMEM copies of O in o_chunk-column chunks: (load, store, the
        load's thread slice, per O tile the load source and the store destination, the O
        coordinates of its registers); index [None, 0, 0, chunk]."""
        pv_thr = pv_mma.get_slice(0)
        tOtO_fake = pv_thr.make_fragment_C(pv_thr.partition_shape_C((self.tile_m, self.hdimv)))
        tOtO = cute.make_tensor(tmem_ptr + self.tmem_o_offset, tOtO_fake.layout)
        tOtO_i = cute.logical_divide(tOtO, cute.make_layout((self.tile_m, self.o_chunk)))
        ld_o = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(self.o_chunk)),
                                Float32), tOtO_i[(None, None), 0])
        st_o = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(self.o_chunk)),
                                Float32), tOtO_i[(None, None), 0])
        thr_ld_o, thr_st_o = ld_o.get_slice(lane), st_o.get_slice(lane)
        tTtO_ld0 = thr_ld_o.partition_S(tOtO_i[(None, None), None])
        tTtO_st0 = thr_st_o.partition_D(tOtO_i[(None, None), None])
        # O tile t: the same partition, head_dim_v columns further
        tTtO_ld = [cute.make_tensor(tTtO_ld0.iterator + t * self.hdimv, tTtO_ld0.layout)
                   for t in range(self.q_tiles)]
        tTtO_st = [cute.make_tensor(tTtO_st0.iterator + t * self.hdimv, tTtO_st0.layout)
                   for t in range(self.q_tiles)]
        cO = cute.make_identity_tensor((self.tile_m, self.hdimv))
        tOcO_i = cute.logical_divide(pv_thr.partition_C(cO),
                                     cute.make_layout((self.tile_m, self.o_chunk)))
        tTcO = thr_ld_o.partition_D(tOcO_i[(None, None), None])
        return ld_o, st_o, thr_ld_o, tTtO_ld, tTtO_st, tTcO

    def pv_operand_a(self, pv_mma: cute.TiledMma, tP_layout: cute.ComposedLayout, tmem_ptr):
        """P of each S buffer as the A operand of O += P·V: 16-bit pairs in the upper half of
        the buffer's columns."""
        pv_thr = pv_mma.get_slice(0)
        tOrP_fake = pv_thr.make_fragment_A(cute.make_tensor(tmem_ptr, tP_layout.outer))[
            None, None, None, 0]
        return [cute.make_tensor(cute.recast_ptr(tmem_ptr + b * self.tile_n + self.tile_n // 2,
                                                 dtype=tOrP_fake.element_type),
                                 tOrP_fake.layout) for b in range(2)]

    def thread_role(self):
        """(TMEM lane = row within a Q tile, warpgroup) of this thread, read after the role's
        register reallocation (values live across setmaxnreg are spilled by ptxas)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        return tidx % LANES, warp_idx >> 2

    # ---------------------------------------------------------------------------------------------
    # Device side
    # ---------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, mParams: cute.Tensor, mPageTable: cute.Tensor | None,
               mSeqUsedK: cute.Tensor | None, mCuSeqlensQ: cute.Tensor | None,
               mCuSeqlensK: cute.Tensor | None, mO_gmem: cute.Tensor | None,
               mMaxLogits: cute.Tensor | None, mSegTiles: cute.Tensor | None,
               mSegRows: cute.Tensor | None, mKvIds: cute.Tensor | None,
               tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
               tma_atom_O: cute.CopyAtom,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
               tP_layout: cute.ComposedLayout,
               qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.load_warp_idx:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)

        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        pipeline_q = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=self.q_tiles,
            producer_group=one_thread, consumer_group=one_thread, tx_count=self.tx_bytes_q,
            defer_sync=True)
        pipeline_kv = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.mbar_kv.data_ptr(), num_stages=self.kv_stages,
            producer_group=one_thread, consumer_group=one_thread, tx_count=self.tx_bytes_k,
            defer_sync=True)
        bars = dict(s_full=storage.mbar_s_full.data_ptr(),
                    stats_full=storage.mbar_stats_full.data_ptr(),
                    p_full=storage.mbar_p_full.data_ptr(),
                    o_full=storage.mbar_o_full.data_ptr(),
                    sum_full=storage.mbar_sum_full.data_ptr(),
                    sum_empty=storage.mbar_sum_empty.data_ptr(),
                    o_staged=storage.mbar_o_staged.data_ptr(),
                    o_stored=storage.mbar_o_stored.data_ptr())
        if warp_idx == 0:
            with cute.arch.elect_one():
                for b in range(2):
                    cute.arch.mbarrier_init(bars["s_full"] + b, 1)
                    cute.arch.mbarrier_init(bars["stats_full"] + b, LANES)
                    cute.arch.mbarrier_init(bars["p_full"] + b, 2 * LANES)
                for t in range(self.q_tiles):
                    cute.arch.mbarrier_init(bars["o_full"] + t, 1)
                    cute.arch.mbarrier_init(bars["sum_full"] + t, LANES)
                    cute.arch.mbarrier_init(bars["sum_empty"] + t, LANES)
                    cute.arch.mbarrier_init(bars["o_staged"] + t, LANES)
                    cute.arch.mbarrier_init(bars["o_stored"] + t, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        tmem_users = 32 * (4 * (self.q_tiles + 1) + 1)  # softmax, correction, MMA warps
        tmem = utils.TmemAllocator(
            storage.tmem_holding_buf.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=int(Barrier.TMEM_ALLOC),
                                                       num_threads=tmem_users),
            allocator_warp_id=self.mma_warp_idx)
        dealloc_barrier = pipeline.NamedBarrier(barrier_id=int(Barrier.TMEM_DEALLOC),
                                                num_threads=tmem_users)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = cute.make_tensor(cute.recast_ptr(cute.recast_ptr(sK.iterator, dtype=self.dtype),
                                              sV_layout.inner), sV_layout.outer)
        sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        sScale = storage.sScale.get_tensor(cute.make_layout((LANES, 2)))
        sSum = storage.sSum.get_tensor(cute.make_layout((LANES, self.q_tiles)))

        scalar_args = (mQ, mK, mLSE, mParams, mPageTable, mSeqUsedK, mCuSeqlensQ, mCuSeqlensK,
                       mO_gmem)
        # segment ids: the tables (segment_blocks in every role, the row spans in the softmax)
        segs = (mSegTiles, mSegRows, mKvIds) if const_expr(self.segments) else None
        if warp_idx < 4 * self.q_tiles:
            cute.arch.setmaxregister_increase(self.softmax_regs)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            sched, blk, paged, varlen, _ = self.scalars(*scalar_args)
            lane, t = self.thread_role()
            self.softmax_wg(mLSE, mParams, qk_mma, tmem_ptr, sScale, sSum, bars, sched, blk,
                            t, lane, paged, varlen, mMaxLogits, segs)
            cute.arch.fence_view_async_tmem_load()
            dealloc_barrier.arrive_and_wait()
        elif warp_idx < 4 * (self.q_tiles + 1):
            cute.arch.setmaxregister_decrease(self.correction_regs)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            sched, blk, paged, varlen, _ = self.scalars(*scalar_args)
            lane, _ = self.thread_role()
            self.correction_wg_loop(pv_mma, tmem_ptr, sO, sScale, sSum, bars, sched, blk, lane,
                                    paged, varlen, segs)
            cute.arch.fence_view_async_tmem_load()
            dealloc_barrier.arrive_and_wait()
        else:
            cute.arch.setmaxregister_decrease(self.other_regs)
            sched, blk, paged, varlen, qhead_per_kvhead = self.scalars(*scalar_args)
            if warp_idx == self.load_warp_idx:
                self.load_warp(mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
                               qk_mma, pv_mma, pipeline_q, pipeline_kv, sched, blk,
                               qhead_per_kvhead, paged, varlen, segs)
            if warp_idx == self.epilogue_warp_idx:
                if const_expr(not self.varlen):
                    self.epilogue_warp(mO, sO, tma_atom_O, bars, sched)
            # (the MMA warp's branch comes last: it mutates the tiled MMAs' ACCUMULATE field)
            if warp_idx == self.mma_warp_idx:
                tmem.allocate(self.tmem_alloc_cols)
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(Float32)
                tmem.relinquish_alloc_permit()
                self.mma_warp(sQ, sK, sV, tP_layout, qk_mma, pv_mma, tmem_ptr, pipeline_q,
                              pipeline_kv, bars, sched, blk, paged, varlen, segs)
                dealloc_barrier.arrive_and_wait()
                tmem.free(tmem_ptr)

    @cute.jit
    def scalars(self, mQ: cute.Tensor, mK: cute.Tensor, mLSE: cute.Tensor, mParams: cute.Tensor,
                mPageTable, mSeqUsedK, mCuSeqlensQ, mCuSeqlensK, mO_gmem):
        """Run-time scalars, identical in every role: (sched, blk, paged, varlen,
        qhead_per_kvhead). Each role computes them after its register reallocation (values
        live across setmaxnreg are spilled to local memory by ptxas)."""
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        num_heads, num_batch = mQ.shape[2], mQ.shape[3]
        qhead_per_kvhead = num_heads // mK.shape[2]
        window_left, window_right = resolve_windows(mParams, seqlen_q, seqlen_k, self.is_local)
        num_m_blocks = cute.ceil_div(seqlen_q, self.cta_rows)
        # varlen: each role derives its tile's sequence from cu_seqlens (tile_seq); the grid is
        # lse's (max_seqlen_q, H, batch) plus the padding slice batch == batch count
        varlen = None
        if const_expr(self.varlen):
            num_m_blocks = cute.ceil_div(mLSE.shape[0], self.cta_rows)
            num_batch = mLSE.shape[2] + 1
            varlen = (mCuSeqlensQ, mCuSeqlensK, mParams, mLSE.shape[2], mO_gmem)
        total_tiles = num_m_blocks * num_heads * num_batch
        bidx, _, _ = cute.arch.block_idx()
        grid_dim, _, _ = cute.arch.grid_dim()
        sched = (num_m_blocks, num_heads, num_batch, total_tiles, bidx, grid_dim)
        blk = (seqlen_q, seqlen_k, window_left, window_right)
        # paged: each role recomputes the lengths of its tile's batch entry (tile_blk)
        paged = (mPageTable, mSeqUsedK, mParams) if const_expr(self.paged) else None
        return sched, blk, paged, varlen, qhead_per_kvhead

    # --- shared by the roles ------------------------------------------------------------------
    def slot(self, t, count: Int32):
        """(S buffer, its barriers' phase parity) of Q tile ``t``'s ``count``-th key block (counted
        over this CTA's tiles): q_tiles = 2: buffer t, phase count % 2; q_tiles = 1: buffers
        alternate per key block."""
        if const_expr(self.q_tiles == 2):
            return t, count % 2
        return count % 2, (count // 2) % 2

    @cute.jit
    def tile_blk(self, blk: cutlass.Constexpr, paged: cutlass.Constexpr, batch: Int32):
        """The tile's (seqlen_q, seqlen_k, window_left, window_right): the call's, or (paged)
        with batch entry ``batch``'s key count (seqused_k[batch], at most its page-table row's
        keys)."""
        if const_expr(paged is None):
            return blk
        mPageTable, mSeqUsedK, mParams = paged
        seqlen_k = paged_keys(mSeqUsedK, batch, mPageTable.shape[1] * self.tile_n)
        window_left, window_right = resolve_windows(mParams, blk[0], seqlen_k, self.is_local)
        return blk[0], seqlen_k, window_left, window_right

    @cute.jit
    def tile_seq(self, blk: cutlass.Constexpr, paged: cutlass.Constexpr,
                 varlen: cutlass.Constexpr, batch: Int32):
        """(q_offset, k_offset, the tile's blk) of batch entry ``batch``. Dense and paged: no
        offsets (None) and tile_blk. Varlen: sequence ``batch``'s first packed query and key
        rows and its lengths from cu_seqlens; the padding slice (batch == number of sequences)
        is an empty sequence."""
        if const_expr(varlen is None):
            return None, None, self.tile_blk(blk, paged, batch)
        mCuSeqlensQ, mCuSeqlensK, mParams, num_seqs, _ = varlen
        q_offset, k_offset, seqlen_q, seqlen_k = varlen_sequence(mCuSeqlensQ, mCuSeqlensK,
                                                                 batch, num_seqs)
        window_left, window_right = resolve_windows(mParams, seqlen_q, seqlen_k, self.is_local)
        return q_offset, k_offset, (seqlen_q, seqlen_k, window_left, window_right)

    def band(self, blk: cutlass.Constexpr) -> FwdBlocks:
        """The tile geometry of ``blk``: work tiles of ``cta_rows`` query rows (all ``q_tiles``
        Q tiles visit the same key blocks; rows mask the rest)."""
        seqlen_q, seqlen_k, window_left, window_right = blk
        return FwdBlocks(self.cta_rows, self.tile_n, self.is_causal, self.is_local, seqlen_q,
                         seqlen_k, window_left, window_right)

    def n_block_range(self, m_block: Int32, blk: cutlass.Constexpr):
        """[n_min, n_max): key blocks with at least one visible key for some row of work tile
        ``m_block`` (varlen: none for a tile past its sequence's end, in every role). An empty
        range has n_max == n_min: every role advances its block counter by n_max − n_min."""
        n_min, n_max = self.band(blk).n_block_range(m_block, past_end_empty=self.varlen)
        if const_expr(self.is_causal or self.is_local):  # (unmasked: n_max >= 0 = n_min)
            n_max = cutlass.max(n_max, n_min)
        return n_min, n_max

    def work_tile(self, idx: Int32, sched):
        num_m_blocks, num_heads, num_batch = sched[0], sched[1], sched[2]
        return tile_order.tile_coords(idx, num_m_blocks, num_heads, num_batch,
                                      self.is_causal or self.is_local)

    @cute.jit
    def tile_blocks(self, idx: Int32, sched: cutlass.Constexpr, blk: cutlass.Constexpr,
                    paged: cutlass.Constexpr, varlen: cutlass.Constexpr,
                    segs: cutlass.Constexpr = None):
        """(m_block, head, batch, q_offset, k_offset, the tile's blk, n_min, n_max) of work
        index ``idx``: the same in every role."""
        m_block, head, batch = self.work_tile(idx, sched)
        q_offset, k_offset, tblk = self.tile_seq(blk, paged, varlen, batch)
        n_min, n_max = self.n_block_range(m_block, tblk)
        if const_expr(segs is not None):
            n_min, n_max = self.segment_blocks(segs[0], m_block, batch, n_min, n_max)
        return m_block, head, batch, q_offset, k_offset, tblk, n_min, n_max

    @cute.jit
    def segment_blocks(self, seg_tiles: cute.Tensor, m_block: Int32, batch: Int32,
                       n_min: Int32, n_max: Int32):
        """[n_min, n_max) intersected with the key blocks some row of work tile ``m_block``
        sees by its segment id: the union of its Q tiles' [n_lo, n_hi) in seg_tiles (one entry
        per 128-row Q tile; (0, 0) when no row of the Q tile sees a key, and no entry for a
        second Q tile past the queries). Empty: n_max == n_min."""
        first = m_block * self.q_tiles
        lo = seg_tiles[batch, first, SEG_N_LO]
        hi = seg_tiles[batch, first, SEG_N_HI]
        if const_expr(self.q_tiles == 2):
            if first + 1 < seg_tiles.shape[1]:
                lo1 = seg_tiles[batch, first + 1, SEG_N_LO]
                hi1 = seg_tiles[batch, first + 1, SEG_N_HI]
                if hi1 > 0:
                    lo = lo1 if hi == 0 else cutlass.min(lo, lo1)
                    hi = cutlass.max(hi, hi1)
        n_min = cutlass.max(n_min, lo)
        return n_min, cutlass.max(cutlass.min(n_max, hi), n_min)

    # --- load warp ---------------------------------------------------------------------------
    @cute.jit
    def load_warp(self, mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
                  qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, pipeline_q, pipeline_kv,
                  sched: cutlass.Constexpr, blk: cutlass.Constexpr, qhead_per_kvhead: Int32,
                  paged: cutlass.Constexpr = None, varlen: cutlass.Constexpr = None,
                  segs: cutlass.Constexpr = None):
        D, Dv = self.hdim, self.hdimv
        qk_thr, pv_thr = qk_mma.get_slice(0), pv_mma.get_slice(0)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_tiles)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        one = cute.make_layout(1)
        total_tiles, bidx, grid_dim = sched[3], sched[4], sched[5]
        for idx in cutlass.range(bidx, total_tiles, grid_dim, unroll=1):
            m_block, head, batch, q_offset, k_offset, _, n_min, n_max = self.tile_blocks(
                idx, sched, blk, paged, varlen, segs)
            head_kv = head // qhead_per_kvhead
            gQ = cute.local_tile(sequence(mQ, head, batch, q_offset), (self.tile_m, D),
                                 (None, 0))
            # paged: K and V are the cache as one batch entry of tile_n-key tiles; key block n of
            # this batch entry is tile page_table[batch, n] (kv_tile); varlen: from k_offset on
            kv_batch = 0 if const_expr(self.paged) else batch
            gK = cute.local_tile(sequence(mK, head_kv, kv_batch, k_offset),
                                 (self.tile_n, D), (None, 0))
            gV = cute.local_tile(sequence(mV, head_kv, kv_batch, k_offset, seq_mode=1),
                                 (Dv, self.tile_n), (0, None))
            tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, one, cute.group_modes(sQ, 0, 3),
                                               cute.group_modes(qk_thr.partition_A(gQ), 0, 3))
            tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, one, cute.group_modes(sK, 0, 3),
                                               cute.group_modes(qk_thr.partition_B(gK), 0, 3))
            tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, one, cute.group_modes(sV, 0, 3),
                                               cute.group_modes(pv_thr.partition_B(gV), 0, 3))
            n_blocks = n_max - n_min
            if n_blocks > 0:
                for t in cutlass.range_constexpr(self.q_tiles):
                    # Q tile t = query rows [(m_block·q_tiles + t)·128, +128) into Q stage t
                    pipeline_q.producer_acquire(q_state)
                    cute.copy(tma_atom_Q, tQgQ[None, m_block * self.q_tiles + t],
                              tQsQ[None, q_state.index],
                              tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
                    q_state.advance()
                    if t == 0:
                        kv_state = self.load_kv(tma_atom_K, tKgK, tKsK, self.tx_bytes_k,
                                                self.kv_tile(paged, batch, n_max - 1),
                                                pipeline_kv, kv_state)
                # ring order = MMA order. q_tiles = 2: K_0, then (V_j, K_{j+1}) for each j;
                # q_tiles = 1: K_0, then (K_{j+1}, V_j) for each j
                for j in cutlass.range(n_blocks, unroll=1):
                    n_block = n_max - 1 - j
                    if const_expr(self.q_tiles == 2):
                        kv_state = self.load_kv(tma_atom_V, tVgV, tVsV, self.tx_bytes_v,
                                                self.kv_tile(paged, batch, n_block),
                                                pipeline_kv, kv_state)
                    if j + 1 < n_blocks:
                        kv_state = self.load_kv(tma_atom_K, tKgK, tKsK, self.tx_bytes_k,
                                                self.kv_tile(paged, batch, n_block - 1),
                                                pipeline_kv, kv_state)
                    if const_expr(self.q_tiles == 1):
                        kv_state = self.load_kv(tma_atom_V, tVgV, tVsV, self.tx_bytes_v,
                                                self.kv_tile(paged, batch, n_block),
                                                pipeline_kv, kv_state)

    @cute.jit
    def load_kv(self, tma_atom, tXgX, tXsX, tx_bytes: cutlass.Constexpr, tile: Int32,
                pipeline_kv, kv_state):
        """One K or V tile into the next ring stage."""
        pipeline_kv.producer_acquire(kv_state, expected_tx=tx_bytes)
        cute.copy(tma_atom, tXgX[None, tile], tXsX[None, kv_state.index],
                  tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))
        kv_state.advance()
        return kv_state

    @cute.jit
    def kv_tile(self, paged: cutlass.Constexpr, batch: Int32, n_block: Int32):
        """The K/V tile of key block ``n_block`` of ``batch``: itself, or (paged) the cache tile
        the page table names."""
        if const_expr(paged is None):
            return n_block
        return paged[0][batch, n_block]

    # --- MMA warp ----------------------------------------------------------------------------
    @cute.jit
    def mma_warp(self, sQ, sK, sV, tP_layout: cute.ComposedLayout, qk_mma: cute.TiledMma,
                 pv_mma: cute.TiledMma, tmem_ptr, pipeline_q, pipeline_kv, bars,
                 sched: cutlass.Constexpr, blk: cutlass.Constexpr,
                 paged: cutlass.Constexpr = None, varlen: cutlass.Constexpr = None,
                 segs: cutlass.Constexpr = None):
        qk_thr, pv_thr = qk_mma.get_slice(0), pv_mma.get_slice(0)
        tSrQ = qk_thr.make_fragment_A(sQ)
        tSrK = qk_thr.make_fragment_B(sK)
        tOrV = pv_thr.make_fragment_B(sV)
        tStS_fake = qk_thr.make_fragment_C(qk_thr.partition_shape_C((self.tile_m, self.tile_n)))
        tOtO_fake = pv_thr.make_fragment_C(pv_thr.partition_shape_C((self.tile_m, self.hdimv)))
        tStS = [cute.make_tensor(tmem_ptr + b * self.tile_n, tStS_fake.layout) for b in range(2)]
        tOtO = [cute.make_tensor(tmem_ptr + self.tmem_o_offset + t * self.hdimv,
                                 tOtO_fake.layout) for t in range(self.q_tiles)]
        tOrP = self.pv_operand_a(pv_mma, tP_layout, tmem_ptr)
        frags = (tSrQ, tSrK, tOrV, tStS, tOtO, tOrP)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_tiles)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        count = Int32(0)  # key blocks processed by this CTA (slot phases)
        total_tiles, bidx, grid_dim = sched[3], sched[4], sched[5]
        for idx in cutlass.range(bidx, total_tiles, grid_dim, unroll=1):
            n_min, n_max = self.tile_blocks(idx, sched, blk, paged, varlen, segs)[6:]
            n_blocks = n_max - n_min
            if n_blocks > 0:
                if const_expr(self.q_tiles == 2):
                    q_state, kv_state = self.mma_tile_pingpong(
                        qk_mma, pv_mma, frags, pipeline_q, pipeline_kv, q_state, kv_state, bars,
                        count, n_blocks)
                else:
                    q_state, kv_state = self.mma_tile_single(
                        qk_mma, pv_mma, frags, pipeline_q, pipeline_kv, q_state, kv_state, bars,
                        count, n_blocks)
                count += n_blocks

    @cute.jit
    def gemm_qk(self, qk_mma: cute.TiledMma, frags, q_stage, buf, kv_index: Int32, s_full):
        """S[buf] = Q[q_stage]·Kᵀ from ring stage ``kv_index``; commit to s_full[buf]."""
        tSrQ, tSrK, _, tStS, _, _ = frags
        for b in cutlass.range_constexpr(2):
            if buf == b:
                for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                    qk_mma.set(tcgen05.Field.ACCUMULATE, k > 0)
                    cute.gemm(qk_mma, tStS[b], tSrQ[None, None, k, q_stage],
                              tSrK[None, None, k, kv_index], tStS[b])
        with cute.arch.elect_one():
            tcgen05.commit(s_full + buf)

    @cute.jit
    def gemm_pv(self, pv_mma: cute.TiledMma, frags, o_tile: cutlass.Constexpr, buf,
                kv_index: Int32, accumulate, o_full):
        """O[o_tile] (+)= P[buf]·V from ring stage ``kv_index`` (P read from TMEM); commit to
        o_full[o_tile]."""
        _, _, tOrV, _, tOtO, tOrP = frags
        for b in cutlass.range_constexpr(2):
            if buf == b:
                for k in cutlass.range_constexpr(cute.size(tOrP[0], mode=[2])):
                    pv_mma.set(tcgen05.Field.ACCUMULATE, accumulate or k > 0)
                    cute.gemm(pv_mma, tOtO[o_tile], tOrP[b][None, None, k],
                              tOrV[None, None, k, kv_index], tOtO[o_tile])
        with cute.arch.elect_one():
            tcgen05.commit(o_full + o_tile)

    @cute.jit
    def mma_tile_pingpong(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, frags,
                          pipeline_q, pipeline_kv, q_state, kv_state, bars, count: Int32,
                          n_blocks: Int32):
        """One work tile, two Q tiles: S0, S1; per block PV0, S0, PV1, S1; PV0, PV1."""
        s_full, p_full, o_full = bars["s_full"], bars["p_full"], bars["o_full"]
        q_states = [q_state.clone()]
        q_state.advance()
        q_states.append(q_state.clone())
        q_state.advance()
        # S0 as soon as Q0 and K0 have landed, then S1 (the load order is Q0, K0, Q1)
        pipeline_q.consumer_wait(q_states[0])
        pipeline_kv.consumer_wait(kv_state)  # K_0
        self.gemm_qk(qk_mma, frags, q_states[0].index, 0, kv_state.index, s_full)
        pipeline_q.consumer_wait(q_states[1])
        self.gemm_qk(qk_mma, frags, q_states[1].index, 1, kv_state.index, s_full)
        pipeline_kv.consumer_release(kv_state)
        kv_state.advance()
        if n_blocks == 1:
            for t in cutlass.range_constexpr(2):
                pipeline_q.consumer_release(q_states[t])  # commit: after the tile's last QK
        for j in cutlass.range(1, n_blocks, unroll=1):
            v_state = kv_state.clone()
            pipeline_kv.consumer_wait(v_state)  # V_{j-1}
            kv_state.advance()
            pipeline_kv.consumer_wait(kv_state)  # K_j
            for t in cutlass.range_constexpr(2):
                # P_t written and O_t rescaled (softmax + correction); PV_t reads P_t before
                # the next QK into the same buffer overwrites it (in-order MMAs)
                cute.arch.mbarrier_wait(p_full + t, (count + j - 1) % 2)
                self.gemm_pv(pv_mma, frags, t, t, v_state.index, j > 1, o_full)
                # (Q's stage as a run-time index: the 2 × k-block shared-memory descriptors
                # of both Q tiles are then recomputed per use, not hoisted into registers)
                self.gemm_qk(qk_mma, frags, q_states[t].index, t, kv_state.index, s_full)
            pipeline_kv.consumer_release(v_state)
            pipeline_kv.consumer_release(kv_state)
            kv_state.advance()
            if j + 1 == n_blocks:
                for t in cutlass.range_constexpr(2):
                    pipeline_q.consumer_release(q_states[t])
        pipeline_kv.consumer_wait(kv_state)  # V_last
        for t in cutlass.range_constexpr(2):
            cute.arch.mbarrier_wait(p_full + t, (count + n_blocks - 1) % 2)
            self.gemm_pv(pv_mma, frags, t, t, kv_state.index, n_blocks > 1, o_full)
        pipeline_kv.consumer_release(kv_state)
        kv_state.advance()
        return q_state, kv_state

    @cute.jit
    def mma_tile_single(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, frags,
                        pipeline_q, pipeline_kv, q_state, kv_state, bars, count: Int32,
                        n_blocks: Int32):
        """One work tile, one Q tile, S double-buffered: S_0; per block S_{j+1}, PV_j."""
        s_full, p_full, o_full = bars["s_full"], bars["p_full"], bars["o_full"]
        pipeline_q.consumer_wait(q_state)
        pipeline_kv.consumer_wait(kv_state)  # K_0
        self.gemm_qk(qk_mma, frags, 0, count % 2, kv_state.index, s_full)
        pipeline_kv.consumer_release(kv_state)
        kv_state.advance()
        if n_blocks == 1:
            pipeline_q.consumer_release(q_state)
        for j in cutlass.range(n_blocks, unroll=1):
            if j + 1 < n_blocks:
                pipeline_kv.consumer_wait(kv_state)  # K_{j+1}
                self.gemm_qk(qk_mma, frags, 0, (count + j + 1) % 2, kv_state.index, s_full)
                pipeline_kv.consumer_release(kv_state)
                kv_state.advance()
                if j + 2 == n_blocks:
                    pipeline_q.consumer_release(q_state)
            buf, phase = self.slot(0, count + j)
            cute.arch.mbarrier_wait(p_full + buf, phase)
            pipeline_kv.consumer_wait(kv_state)  # V_j
            self.gemm_pv(pv_mma, frags, 0, buf, kv_state.index, j > 0, o_full)
            pipeline_kv.consumer_release(kv_state)
            kv_state.advance()
        q_state.advance()
        return q_state, kv_state

    # --- softmax warpgroups ------------------------------------------------------------------
    @cute.jit
    def softmax_wg(self, mLSE, mParams, qk_mma: cute.TiledMma, tmem_ptr, sScale, sSum, bars,
                   sched: cutlass.Constexpr, blk: cutlass.Constexpr, t: Int32, lane: Int32,
                   paged: cutlass.Constexpr = None, varlen: cutlass.Constexpr = None,
                   mMaxLogits: cute.Tensor | None = None, segs: cutlass.Constexpr = None):
        """Softmax of Q tile ``t`` (0 with q_tiles = 1); with ``mMaxLogits`` (Sq, H, B) each
        row's max logit too; ``segs``: the segment-id tables (seg_tiles, seg_rows, kv_ids)."""
        ld_s, tTtS0, tTcS, p_io = self.softmax_tmem_copies(qk_mma, tmem_ptr, lane)

        scales = score_scales(mParams[PARAM_SCALE], mParams, self.has_softcap)
        scale_log2, tanh_in_scale = scales.scale_log2, scales.tanh_in_scale

        s_full, stats_full, p_full = bars["s_full"], bars["stats_full"], bars["p_full"]
        sum_full, sum_empty = bars["sum_full"], bars["sum_empty"]
        count = Int32(0)  # key blocks processed by this CTA (slot phases)
        sums = Int32(0)  # tiles whose 1/Σ went to the correction warpgroup
        total_tiles, bidx, grid_dim = sched[3], sched[4], sched[5]
        for idx in cutlass.range(bidx, total_tiles, grid_dim, unroll=1):
            m_block, head, batch, _, _, tblk, n_min, n_max = self.tile_blocks(
                idx, sched, blk, paged, varlen, segs)
            n_blocks = n_max - n_min
            row = (m_block * self.q_tiles + t) * self.tile_m + tTcS[0][0]  # this thread's row
            seg = None
            other_id = None
            if const_expr(segs is not None):
                seg = self.segment_row(segs, m_block * self.q_tiles + t, row, batch, tblk)
                other_id = cute.make_rmem_tensor(self.tile_n // 32, Int32)
            # the scaled max actually applied to P, R = round(m·scale_log2) (conditional
            # rescale); every use is R itself, so its rounding cancels (common/softmax.py)
            row_max = Float32(-math.inf)
            row_sum = Float32(0.0)
            # max logits: the true running scaled max, never stale (-inf: no visible key yet)
            seen_max = Float32(-math.inf)
            for j in cutlass.range(n_blocks, unroll=1):
                n_block = n_max - 1 - j
                buf, phase = self.slot(t, count + j)
                if const_expr(segs is not None):
                    self.segment_id_bits(seg, n_block, tblk, other_id)
                cute.arch.mbarrier_wait(s_full + buf, phase)
                tSrS = cute.make_rmem_tensor(tTcS.shape, Float32)
                cute.copy(ld_s, cute.make_tensor(tTtS0.iterator + buf * self.tile_n,
                                                 tTtS0.layout), tSrS)
                cute.arch.fence_view_async_tmem_load()
                row_max, acc_scale, blk_max = self.row_max_step(
                    tSrS, tTcS, row, n_block, row_max, scale_log2, tanh_in_scale, tblk, seg,
                    other_id)
                if const_expr(mMaxLogits is not None):
                    seen_max = cute.arch.fmax(seen_max, blk_max)
                # the factor goes to the correction warpgroup before the exponentials, so the
                # O rescale overlaps them (read there only for j > 0)
                sScale[lane, buf] = acc_scale
                cute.arch.mbarrier_arrive(stats_full + buf)
                # P = exp2(...) as 16-bit pairs into the upper half of this S buffer
                row_sum = self.exponentiate(tSrS, row_max, row_sum, acc_scale, scale_log2,
                                            p_io, buf)
                cute.arch.fence_view_async_tmem_store()
                cute.arch.mbarrier_arrive(p_full + buf)
            count += n_blocks
            empty = row_sum == 0.0 or row_sum != row_sum
            # past the one-FFMA exponent's exact range: NaN output and lse (common/softmax.py)
            broken = cute.arch.fmax(row_max, -row_max) >= Float32(exact_limit_log2(self.is_bf16))
            broken = broken and row_max != -Float32.inf
            if n_blocks > 0:
                # 1/Σ for the epilogue (1 for rows with no visible key: O stays 0)
                cute.arch.mbarrier_wait(sum_empty + t, (sums + 1) % 2)
                inv = Float32(1.0) if empty else cute.arch.rcp_approx(row_sum)
                sSum[lane, t] = Float32.nan if broken else inv
                cute.arch.mbarrier_arrive(sum_full + t)
                sums += 1
            if row < tblk[0]:
                lse = Float32(-math.inf)
                if not empty:
                    lse = (row_max + cute.math.log2(row_sum, fastmath=True)) * LN2
                mLSE[row, head, batch] = Float32.nan if broken else lse
                if const_expr(mMaxLogits is not None):
                    mMaxLogits[row, head, batch] = seen_max * Float32(1.0 / LOG2_E)

    @cute.jit
    def segment_row(self, segs: cutlass.Constexpr, q_tile: Int32, row: Int32, batch: Int32,
                    blk: cutlass.Constexpr):
        """A softmax thread's segment data for its row of Q tile ``q_tile``: (key span start,
        end, the row's id, the batch entry's key ids, the Q tile's compare-ids flag). A row
        past seqlen_q reads the last row's (it is never written), a second Q tile past the
        queries the last Q tile's flag."""
        seg_tiles, seg_rows, kv_ids = segs
        r = cutlass.min(row, blk[0] - 1)
        flag = seg_tiles[batch, cutlass.min(q_tile, seg_tiles.shape[1] - 1), SEG_IDS]
        return (seg_rows[batch, r, SEG_ROW_START], seg_rows[batch, r, SEG_ROW_END],
                seg_rows[batch, r, SEG_ROW_ID], kv_ids[batch, None], flag)

    @cute.jit
    def segment_id_bits(self, seg: cutlass.Constexpr, n_block: Int32, blk: cutlass.Constexpr,
                        other_id: cute.Tensor):
        """The keys of block ``n_block`` that row_max_step masks for their id, as bits (key c:
        bit c % 32 of word c // 32): with the Q tile's compare flag set those whose id is not
        the row's, read one at a time in a run-time loop; else none. Called before the scores
        are loaded, so the reads overlap the wait for S and only the words stay live
        (comparing the ids against the loaded scores spilled). Keys past seqlen_k read the
        last key's id (the tail mask has them)."""
        row_id, kv_ids, compare_ids = seg[2], seg[3], seg[4]
        other_id.fill(0)
        if compare_ids != 0:
            col0 = n_block * self.tile_n
            last = blk[1] - 1
            for w in cutlass.range_constexpr(self.tile_n // 32):
                word = Int32(0)
                for b in cutlass.range(32, unroll=4):
                    key_id = kv_ids[cutlass.min(col0 + w * 32 + b, last)]
                    word = word if key_id == row_id else (word | (Int32(1) << b))
                other_id[w] = word

    @cute.jit
    def row_max_step(self, tSrS: cute.Tensor, tTcS: cute.Tensor, row: Int32, n_block: Int32,
                     row_max: Float32, scale_log2: Float32, tanh_in_scale: Float32,
                     blk: cutlass.Constexpr, seg: cutlass.Constexpr = None,
                     other_id: cute.Tensor | None = None):
        """Softcap and mask one key block of one row in place; return the new applied scaled
        max, the factor O and the row sum must be rescaled by (1.0 when the conditional
        rescale keeps the old max) and the block's scaled max (-inf: no visible key). ``seg``
        (segment ids, segment_row): the row's key span bounds its columns like a window, and
        every key whose bit in ``other_id`` (segment_id_bits) is set is masked."""
        n = cute.size(tSrS)
        if const_expr(self.has_softcap):
            for i in cutlass.range_constexpr(n):
                tSrS[i] = cute.math.tanh(tSrS[i] * tanh_in_scale, fastmath=True)
        # masks: key-length tail always (cheap: one compare per element), causal / window;
        # visible columns [left, right) relative to the block
        left, right = self.band(blk).visible_cols(row, n_block)
        if const_expr(seg is not None):
            # the row's key span [start, end), relative to the block
            col0 = n_block * self.tile_n
            right = cutlass.min(right, seg[1] - col0)
            if const_expr(self.is_local):
                left = cutlass.max(left, seg[0] - col0)
            else:
                left = seg[0] - col0
        if const_expr(self.is_local or seg is not None):
            # visible: left <= c < right, i.e. both c − left and right − 1 − c are >= 0: one
            # sign test of their bitwise or (two compares per score kept too many predicates
            # live and the softmax spilled; an unsigned compare was rewritten by the compiler).
            # Segment ids: the key's other-id bit shifted into the sign joins the or (a
            # separate, branched pass over the scores spilled). Register i holds key i of the
            # block (test_tmem_fragment_maps).
            last = right - 1
            for i in cutlass.range_constexpr(n):
                c = tTcS[i][1]
                hidden = (c - left) | (last - c)
                if const_expr(seg is not None):
                    hidden = hidden | (other_id[i // 32] << (31 - i % 32))
                tSrS[i] = -Float32.inf if hidden < 0 else tSrS[i]
        else:
            for i in cutlass.range_constexpr(n):
                tSrS[i] = -Float32.inf if tTcS[i][1] >= right else tSrS[i]
        # row max: 4 independent chains of 3-input max
        acc = [tSrS[i] for i in range(4)]
        for i in cutlass.range_constexpr(4, n, 8):
            for a in cutlass.range_constexpr(4):
                acc[a] = cute.arch.fmax(acc[a], cute.arch.fmax(tSrS[i + a], tSrS[i + 4 + a]))
        blk_max = cute.arch.fmax(cute.arch.fmax(acc[0], acc[1]), cute.arch.fmax(acc[2], acc[3]))
        blk_max = blk_max * scale_log2
        m_new = cute.arch.fmax(row_max, blk_max)
        # conditional rescale: move the applied max only when it grew by more than the
        # threshold (log2 units); -inf -> finite is +inf (moves), -inf -> -inf is NaN (stays)
        need = m_new - row_max > self.rescale_threshold
        acc_scale = Float32(1.0)
        if need:
            acc_scale = cute.math.exp2(row_max - m_new, fastmath=True)
            row_max = m_new
        return row_max, acc_scale, blk_max

    @cute.jit
    def exponentiate(self, tSrS: cute.Tensor, row_max: Float32, row_sum: Float32,
                     acc_scale: Float32, scale_log2: Float32, p_io: cutlass.Constexpr, buf):
        """P = exp2(S·c − R) (MUFU and the software exp2 by the config's share), converted to
        16-bit pairs and stored to TMEM (P of S buffer ``buf``) chunk by chunk, so a chunk's
        registers die as soon as it is stored; return the rescaled row sum plus this block's."""
        st_p, tTtP0, tTcP, p_chunk = p_io
        tTtP = cute.make_tensor(tTtP0.iterator + buf * self.tile_n + self.tile_n // 2,
                                tTtP0.layout)
        n = cute.size(tSrS)
        neg_m_scaled = Float32(0.0) if row_max == -Float32.inf else -row_max
        sums = [(Float32(0.0), Float32(0.0)), (Float32(0.0), Float32(0.0))]
        per_chunk = 2 * p_chunk  # scores per P chunk
        for c in cutlass.range_constexpr(n // per_chunk):
            base = c * per_chunk
            for i in cutlass.range_constexpr(base, base + per_chunk, 2):
                tSrS[i], tSrS[i + 1] = cute.arch.fma_packed_f32x2(
                    (tSrS[i], tSrS[i + 1]), (scale_log2, scale_log2),
                    (neg_m_scaled, neg_m_scaled))
            for i in cutlass.range_constexpr(base, base + per_chunk, 2):
                if const_expr(exp2_is_software(i, self.exp2_sw_per_32)):
                    tSrS[i], tSrS[i + 1] = exp2_sw_x2(tSrS[i], tSrS[i + 1])
                else:
                    tSrS[i] = cute.math.exp2(tSrS[i], fastmath=True)
                    tSrS[i + 1] = cute.math.exp2(tSrS[i + 1], fastmath=True)
            for i in cutlass.range_constexpr(base, base + per_chunk, 4):
                for a in cutlass.range_constexpr(2):
                    sums[a] = cute.arch.add_packed_f32x2(sums[a],
                                                         (tSrS[i + 2 * a], tSrS[i + 2 * a + 1]))
            tPr = cute.make_rmem_tensor(tTcP[None, 0, 0, c].shape, Float32)
            tPr32 = cute.recast_tensor(tPr, Int32)
            for i in cutlass.range_constexpr(cute.size(tPr32)):
                tPr32[i] = cvt_pack_f32x2(tSrS[base + 2 * i], tSrS[base + 2 * i + 1],
                                          self.is_bf16)
            cute.copy(st_p, tPr, tTtP[None, 0, 0, c])
        s2 = cute.arch.add_packed_f32x2(sums[0], sums[1])
        return row_sum * acc_scale + (s2[0] + s2[1])

    # --- correction warpgroup ----------------------------------------------------------------
    @cute.jit
    def correction_wg_loop(self, pv_mma: cute.TiledMma, tmem_ptr, sO, sScale, sSum, bars,
                           sched: cutlass.Constexpr, blk: cutlass.Constexpr, lane: Int32,
                           paged: cutlass.Constexpr = None, varlen: cutlass.Constexpr = None,
                           segs: cutlass.Constexpr = None):
        """O rescales between key blocks and the epilogue, for every Q tile of the CTA."""
        pv_thr = pv_mma.get_slice(0)
        ld_o, st_o, thr_ld_o, tTtO_ld, tTtO_st, tTcO = self.o_tmem_copies(pv_mma, tmem_ptr,
                                                                          lane)
        # epilogue: TMEM -> registers -> swizzled smem, via the matching smem store atom
        tTsO = [thr_ld_o.partition_D(cute.logical_divide(
                    pv_thr.partition_C(sO[None, None, t]),
                    cute.make_layout((self.tile_m, self.o_chunk)))[(None, None), None])
                for t in range(self.q_tiles)]
        smem_store = cute.make_tiled_copy_D(
            sm100_utils.get_smem_store_op(utils.LayoutEnum.ROW_MAJOR, self.dtype, Float32, ld_o),
            ld_o)
        if const_expr(self.varlen):
            # varlen: each thread stores its own row (the TMEM lane it loaded) to global memory
            gmem_store = cute.make_tiled_copy_D(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                    num_bits_per_copy=128), ld_o)
        num_o_chunks = self.hdimv // self.o_chunk
        lane_row = tTcO[0][0]  # this thread's row within a Q tile (its TMEM lane)

        stats_full, p_full, o_full = bars["stats_full"], bars["p_full"], bars["o_full"]
        sum_full, sum_empty = bars["sum_full"], bars["sum_empty"]
        o_staged, o_stored = bars["o_staged"], bars["o_stored"]
        count = Int32(0)  # key blocks processed by this CTA (slot phases)
        pvs = Int32(0)  # P·V commits per O tile waited for so far
        sums = Int32(0)  # tiles with a 1/Σ from the softmax
        tiles = Int32(0)  # work tiles done (o_staged / o_stored phases)
        total_tiles, bidx, grid_dim = sched[3], sched[4], sched[5]
        for idx in cutlass.range(bidx, total_tiles, grid_dim, unroll=1):
            m_block, head, batch, q_offset, _, tblk, n_min, n_max = self.tile_blocks(
                idx, sched, blk, paged, varlen, segs)
            n_blocks = n_max - n_min
            for j in cutlass.range(n_blocks, unroll=1):
                for t in cutlass.range_constexpr(self.q_tiles):
                    buf, phase = self.slot(t, count + j)
                    cute.arch.mbarrier_wait(stats_full + buf, phase)
                    if j > 0:
                        acc_scale = sScale[lane, buf]
                        # O_t holds P·V of the previous block only once that has completed
                        cute.arch.mbarrier_wait(o_full + t, pvs % 2)
                        if cute.arch.vote_any_sync(acc_scale != 1.0):
                            self.rescale_o(ld_o, st_o, tTtO_ld[t], tTtO_st[t], tTcO, acc_scale,
                                           num_o_chunks)
                            cute.arch.fence_view_async_tmem_store()
                    cute.arch.mbarrier_arrive(p_full + buf)
                if j > 0:
                    pvs += 1
            count += n_blocks
            # ---- epilogue ----
            for t in cutlass.range_constexpr(self.q_tiles):
                inv_sum = Float32(1.0)
                if n_blocks > 0:
                    cute.arch.mbarrier_wait(sum_full + t, sums % 2)
                    inv_sum = sSum[lane, t]
                    cute.arch.mbarrier_arrive(sum_empty + t)
                    cute.arch.mbarrier_wait(o_full + t, pvs % 2)  # the tile's last P·V
                row = (m_block * self.q_tiles + t) * self.tile_m + lane_row
                if const_expr(self.varlen):
                    # this thread's row of the sequence's output tile (no shared-memory staging)
                    mO_seq = sequence(varlen[4], head, 0, q_offset)
                    tTgO = self.thread_rows(cute.local_tile(
                        mO_seq, (self.tile_m, self.hdimv), (m_block * self.q_tiles + t, 0)),
                        pv_thr, thr_ld_o)
                else:
                    # the previous tile's TMA store has finished reading sO[t]
                    cute.arch.mbarrier_wait(o_stored + t, (tiles + 1) % 2)
                for c in cutlass.range_constexpr(num_o_chunks):
                    tOr = cute.make_rmem_tensor(tTcO[None, 0, 0, c].shape, Float32)
                    if n_blocks > 0:
                        cute.copy(ld_o, tTtO_ld[t][None, 0, 0, c], tOr)
                        cute.arch.fence_view_async_tmem_load()
                        for i in cutlass.range_constexpr(0, cute.size(tOr), 2):
                            tOr[i], tOr[i + 1] = cute.arch.mul_packed_f32x2(
                                (tOr[i], tOr[i + 1]), (inv_sum, inv_sum))
                    else:
                        tOr.fill(0.0)
                    tOr16 = cute.make_rmem_tensor(tOr.shape, self.dtype)
                    tOr16.store(tOr.load().to(self.dtype))
                    if const_expr(self.varlen):
                        if row < tblk[0]:  # rows past the sequence belong to the next one
                            cute.copy(gmem_store, tOr16, tTgO[None, 0, 0, c])
                    else:
                        cute.copy(smem_store, tOr16, tTsO[t][None, 0, 0, c])
                if const_expr(not self.varlen):
                    cute.arch.fence_proxy("async.shared", space="cta")  # -> the TMA store
                    cute.arch.mbarrier_arrive(o_staged + t)
            # O read: the next tile's first P·V (no accumulate) may overwrite it
            cute.arch.fence_view_async_tmem_load()
            if n_blocks > 0:
                pvs += 1
                sums += 1
            tiles += 1
            if const_expr(self.varlen):
                if batch == varlen[3]:
                    zeros = cute.make_rmem_tensor(tTcO[None, 0, 0, 0].shape, self.dtype)
                    zeros.fill(0.0)
                    for t in cutlass.range_constexpr(self.q_tiles):
                        self.zero_padding_rows(varlen, head, m_block * self.q_tiles + t,
                                               sched[0] * self.q_tiles, lane_row, zeros,
                                               gmem_store, pv_thr, thr_ld_o)

    @cute.jit
    def rescale_o(self, ld_o, st_o, tTtO_ld, tTtO_st, tTcO, acc_scale: Float32,
                  num_o_chunks: cutlass.Constexpr[int]):
        for c in cutlass.range_constexpr(num_o_chunks):
            tOr = cute.make_rmem_tensor(tTcO[None, 0, 0, c].shape, Float32)
            cute.copy(ld_o, tTtO_ld[None, 0, 0, c], tOr)
            cute.arch.fence_view_async_tmem_load()
            for i in cutlass.range_constexpr(0, cute.size(tOr), 2):
                tOr[i], tOr[i + 1] = cute.arch.mul_packed_f32x2((tOr[i], tOr[i + 1]),
                                                                (acc_scale, acc_scale))
            cute.copy(st_o, tOr, tTtO_st[None, 0, 0, c])

    def thread_rows(self, gO: cute.Tensor, pv_thr, thr_ld_o) -> cute.Tensor:
        """Varlen: this correction thread's part of a (tile_m, Dv) global tile, in o_chunk-column
        chunks, as its epilogue TMEM loads hold it (thread t: row t): index [None, 0, 0, c]."""
        tOgO_i = cute.logical_divide(pv_thr.partition_C(gO),
                                     cute.make_layout((self.tile_m, self.o_chunk)))
        return thr_ld_o.partition_D(tOgO_i[(None, None), None])

    @cute.jit
    def zero_padding_rows(self, varlen: cutlass.Constexpr, head: Int32, first_tile: Int32,
                          tile_step: Int32, lane_row: Int32, zeros: cute.Tensor,
                          gmem_store: cute.TiledCopy, pv_thr, thr_ld_o):
        """Varlen, padding slice: write 0 to head ``head`` of the packed output rows outside
        every sequence, [0, cu_seqlens_q[0]) and [cu_seqlens_q[-1], total). The 128-row tiles
        meeting those ranges are numbered 0, 1, ...; this call takes first_tile, first_tile +
        tile_step, ...; thread ``lane_row`` writes that row of each (whole rows, ``zeros`` is
        one o_chunk)."""
        mCuSeqlensQ, _, _, num_seqs, mO_gmem = varlen
        total = mO_gmem.shape[0]
        first, last = mCuSeqlensQ[0], mCuSeqlensQ[num_seqs]
        head_tiles = cute.ceil_div(first, self.tile_m)  # tiles meeting [0, first)
        tail_begin = cutlass.max(last // self.tile_m, head_tiles)  # then [last, total)
        num_tiles = head_tiles + cute.ceil_div(total, self.tile_m) - tail_begin
        mO_h = mO_gmem[None, None, head, 0]
        i = first_tile
        while i < num_tiles:
            tile = i if i < head_tiles else tail_begin + i - head_tiles
            row = tile * self.tile_m + lane_row
            if row < total and (row < first or row >= last):
                tTgO = self.thread_rows(cute.local_tile(mO_h, (self.tile_m, self.hdimv),
                                                        (tile, 0)), pv_thr, thr_ld_o)
                for c in cutlass.range_constexpr(self.hdimv // self.o_chunk):
                    cute.copy(gmem_store, zeros, tTgO[None, 0, 0, c])
            i += tile_step

    # --- epilogue warp -----------------------------------------------------------------------
    @cute.jit
    def epilogue_warp(self, mO, sO, tma_atom_O, bars, sched: cutlass.Constexpr):
        """Dense / paged: the TMA store of each O tile the correction warpgroup staged in sO
        (rows past seqlen_q clipped by TMA)."""
        o_staged, o_stored = bars["o_staged"], bars["o_stored"]
        tiles = Int32(0)
        total_tiles, bidx, grid_dim = sched[3], sched[4], sched[5]
        for idx in cutlass.range(bidx, total_tiles, grid_dim, unroll=1):
            m_block, head, batch = self.work_tile(idx, sched)
            gO = cute.local_tile(mO[None, None, head, batch], (self.tile_m, self.hdimv),
                                 (None, 0))
            tOsO, tOgO = cpasync.tma_partition(
                tma_atom_O, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                cute.group_modes(gO, 0, 2))
            for t in cutlass.range_constexpr(self.q_tiles):
                cute.arch.mbarrier_wait(o_staged + t, tiles % 2)
                with cute.arch.elect_one():
                    cute.copy(tma_atom_O, tOsO[None, t], tOgO[None, m_block * self.q_tiles + t])
                    cute.arch.cp_async_bulk_commit_group()
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                    cute.arch.mbarrier_arrive(o_stored + t)
            tiles += 1
        with cute.arch.elect_one():
            cute.arch.cp_async_bulk_wait_group(0, read=False)


def make_launcher(cfg: FwdConfig):
    """The `@cute.jit` launcher ``fn(stream, q, k, v, params, out, lse)`` for this config (with
    ``max_logits`` after lse for a max-logits config; with ``seg_tiles, seg_rows, kv_ids`` after
    params for a segments config),
    ``fn(stream, q, k_cache, v_cache, params, page_table, seqused_k, out, lse)`` when it is paged
    (spec.paged_attention_forward_signature), or ``fn(stream, q, k, v, params, cu_seqlens_q,
    cu_seqlens_k, out, lse)`` when it is varlen (spec.varlen_attention_forward_signature)."""
    kernel = FlashAttentionForwardSm100(cfg)
    if cfg.paged:
        @cute.jit
        def sm100_fwd_paged(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                            v: cute.Tensor, params: cute.Tensor, page_table: cute.Tensor,
                            seqused_k: cute.Tensor, out: cute.Tensor, lse: cute.Tensor):
            kernel(stream, q, k, v, params, out, lse, page_table, seqused_k)

        return sm100_fwd_paged
    if cfg.varlen:
        @cute.jit
        def sm100_fwd_varlen(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                             v: cute.Tensor, params: cute.Tensor, cu_seqlens_q: cute.Tensor,
                             cu_seqlens_k: cute.Tensor, out: cute.Tensor, lse: cute.Tensor):
            kernel(stream, q, k, v, params, out, lse, mCuSeqlensQ=cu_seqlens_q,
                   mCuSeqlensK=cu_seqlens_k)

        return sm100_fwd_varlen
    if cfg.segments and cfg.max_logits:
        @cute.jit
        def sm100_fwd_segments_max_logits(
                stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
                params: cute.Tensor, seg_tiles: cute.Tensor, seg_rows: cute.Tensor,
                kv_ids: cute.Tensor, out: cute.Tensor, lse: cute.Tensor, max_logits: cute.Tensor):
            kernel(stream, q, k, v, params, out, lse, mMaxLogits=max_logits, mSegTiles=seg_tiles,
                   mSegRows=seg_rows, mKvIds=kv_ids)

        return sm100_fwd_segments_max_logits
    if cfg.segments:
        @cute.jit
        def sm100_fwd_segments(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                               v: cute.Tensor, params: cute.Tensor, seg_tiles: cute.Tensor,
                               seg_rows: cute.Tensor, kv_ids: cute.Tensor, out: cute.Tensor,
                               lse: cute.Tensor):
            kernel(stream, q, k, v, params, out, lse, mSegTiles=seg_tiles, mSegRows=seg_rows,
                   mKvIds=kv_ids)

        return sm100_fwd_segments
    if cfg.max_logits:
        @cute.jit
        def sm100_fwd_max_logits(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                                 v: cute.Tensor, params: cute.Tensor, out: cute.Tensor,
                                 lse: cute.Tensor, max_logits: cute.Tensor):
            kernel(stream, q, k, v, params, out, lse, mMaxLogits=max_logits)

        return sm100_fwd_max_logits

    @cute.jit
    def sm100_fwd(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
                  params: cute.Tensor, out: cute.Tensor, lse: cute.Tensor):
        kernel(stream, q, k, v, params, out, lse)

    return sm100_fwd
