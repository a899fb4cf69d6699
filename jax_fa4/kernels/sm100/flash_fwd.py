"""FlashAttention forward for Blackwell (sm_100a), written in CuTe-DSL: v1 of the FA4 design.

Features: bf16/fp16, head dims from fwd_config.TUNING_TABLE (64, 96, 128, 192/128, 256), dynamic
batch / sequence lengths / head counts (one compile serves all), GQA/MQA (q head h reads kv head
h // (H // Hkv)), key-length tail mask, bottom-right aligned causal and sliding-window masks with
key-block skipping, softcap, lse output; software exp2 on the FMA pipe for a compile-time share
of each row (common/exp2.py), FA4's conditional rescaling, persistent CTAs (SM count from the
config) with heavy tiles first under causal / local masks (tile_order.py).

One CTA = 6 warps, persistent over work tiles of 128 query rows of one (batch, head):
  * warp 5, load: TMA of Q (one stage) and of K and V through ONE shared ring of `kv_stages`
    stages, in exactly the order the MMA warp consumes them: K0, K1, V0, K2, V1, …, V_last.
  * warp 4, MMA: allocates all 512 TMEM columns; issues tcgen05 MMAs from one elected thread:
    S_j = Q·K_jᵀ (SS) into TMEM buffer j % 2, and O += P_j·V_j (TS: P read from TMEM). Order per
    tile: S_0; then per j: S_{j+1}, PV_j. tcgen05 MMAs of one thread run in order, so a PV issued
    before the next S into the same buffer has read its P first.
  * warps 0–3, softmax + correction + epilogue (thread t owns query row t = TMEM lane t): load the
    S row from TMEM, softcap, mask, row max, conditional rescale decision, P = exp2(S·c − m·c)
    (MUFU and software exp2 mixed), P as 16-bit pairs into the upper half of the S buffer, then
    wait for the previous PV and rescale O in TMEM if some row of the warp needs it (warp vote),
    fence the TMEM stores, signal the MMA warp. Epilogue: O·(1/Σ) → swizzled shared memory →
    TMA store (one thread), lse from registers.

TMEM map (columns): S0 [0, tile_n), S1 [tile_n, 2·tile_n) (P_i at S_i + tile_n/2), O at 2·tile_n.

Synchronisation (raw mbarriers; phases from per-CTA counters carried across persistent tiles):
  s_full[b]  MMA → softmax   tcgen05.commit after S into buffer b (count 1)
  p_full[b]  softmax → MMA   all 128 softmax threads, each after its tcgen05.wait::st (count 128):
                             P_b written, O rescaled, S_b fully read
  o_full     MMA → softmax   tcgen05.commit after each PV (count 1); softmax waits every phase
  Q and the K/V ring: PipelineTmaUmma (TMA transaction bytes; released by tcgen05.commit).
  TMEM: allocated by the MMA warp, pointer published through shared memory + a named barrier;
  permit relinquished right after; freed by the MMA warp after all TMEM users (softmax warps,
  after their last tcgen05.wait::ld) and itself pass the dealloc named barrier.

Varlen (FwdConfig.varlen; spec.varlen_attention_forward_signature): q, k, v, out are packed
sequences viewed as one batch entry (1, total, H, ·). lse (batch, H, max_seqlen_q) sets the work
tiles: ceil(max_seqlen_q / 128) M tiles × H × (batch + 1), walked by the same persistent loop
(heavy tiles first under causal / local masks, ordered by M tile index, a proxy only: a
sequence's real length is read in the kernel). Every role derives the tile's sequence
(q_offset, k_offset, seqlen_q, seqlen_k) from cu_seqlens itself (tile_seq), so all three agree on
the tile's key-block count; a tile past its sequence's end has zero key blocks in every role (no
Q/K/V load, no MMA, no barrier traffic) and stores nothing. TMA loads start at the sequence's
offset (keys past it are masked as the key tail; queries past it are never stored). O is not
TMA-stored (a whole tile would overwrite the next sequence's rows): each softmax thread writes
its own row (its TMEM lane) from registers to global memory, 16 bytes per store, when the row is
below seqlen_q. The extra batch slice (batch == number of sequences) writes zeros to the packed
output rows outside every sequence (zero_padding_rows); its tiles have no key blocks either.

Missing relative to FA4 (see docs/perf-log-sm100.md): two Q tiles with ping-ponging softmax
warpgroups, a separate correction warpgroup and epilogue warp, 2-CTA MMA, the L2 head swizzle,
the "last quarter of P" early PV start, register reallocation.
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
from jax_fa4.kernels.common.layout import select_modes
from jax_fa4.kernels.common.views import dim_major, seq_major
from jax_fa4.kernels.sm100 import tile_order
from jax_fa4.kernels.sm100.fwd_config import FwdConfig

LOG2_E = math.log2(math.e)
LN2 = math.log(2.0)

SOFTMAX_WARPS = (0, 1, 2, 3)
MMA_WARP = 4
LOAD_WARP = 5


class Barrier(enum.IntEnum):
    # 0 is __syncthreads
    TMEM_ALLOC = 1  # softmax warps + MMA warp: TMEM pointer published
    TMEM_DEALLOC = 2  # softmax warps + MMA warp: every TMEM access done
    EPILOGUE = 3  # softmax warps: O staged in shared memory / previous TMA store drained


class FlashAttentionForwardSm100:
    def __init__(self, cfg: FwdConfig):
        cfg.validate()
        self.cfg = cfg
        self.dtype = cutlass.BFloat16 if cfg.dtype == "bfloat16" else cutlass.Float16
        self.is_bf16 = cfg.dtype == "bfloat16"
        self.paged = cfg.paged
        self.varlen = cfg.varlen
        self.hdim, self.hdimv = cfg.head_dim, cfg.head_dim_v
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.kv_stages = cfg.kv_stages
        self.is_causal = cfg.mask == "causal"
        self.is_local = cfg.mask == "local"
        self.has_softcap = cfg.has_softcap
        self.exp2_sw_per_32 = cfg.exp2_sw_per_32
        self.rescale_threshold = cfg.rescale_threshold
        self.num_threads = cfg.num_threads
        self.tmem_alloc_cols = cfg.tmem_alloc_columns()
        self.tmem_s_offset = (0, self.tile_n)
        self.tmem_p_offset = (self.tile_n // 2, self.tile_n + self.tile_n // 2)  # in 32-bit cols
        self.tmem_o_offset = 2 * self.tile_n
        self.o_chunk = 16  # O columns per TMEM load in the rescale and the epilogue
        assert self.hdimv % self.o_chunk == 0

    # ---------------------------------------------------------------------------------------------
    # Host side: views, layouts, TMA atoms, launch
    # ---------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, stream: cuda.CUstream, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mParams: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mPageTable: cute.Tensor | None = None, mSeqUsedK: cute.Tensor | None = None,
                 mCuSeqlensQ: cute.Tensor | None = None, mCuSeqlensK: cute.Tensor | None = None):
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
        for name, t in (("page_table", mPageTable), ("seqused_k", mSeqUsedK),
                        ("cu_seqlens_q", mCuSeqlensQ), ("cu_seqlens_k", mCuSeqlensK)):
            if const_expr(t is not None and t.element_type != Int32):
                raise TypeError(f"{name}: expected Int32, got {t.element_type}")
        D, Dv = self.hdim, self.hdimv
        mQ, mK = seq_major(mQ, D), seq_major(mK, D)
        mV, mO = dim_major(mV, Dv), seq_major(mO, Dv)
        mLSE = select_modes(mLSE, (2, 1, 0))  # (Sq, H, B); varlen: (max_seqlen_q, H, batch)

        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        cta_group = tcgen05.CtaGroup.ONE
        qk_tiler = (self.tile_m, self.tile_n, D)
        pv_tiler = (self.tile_m, Dv, self.tile_n)
        qk_mma = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32, cta_group, qk_tiler[:2])
        pv_mma = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, cta_group, pv_tiler[:2],
            tcgen05.OperandSource.TMEM)

        sQ_layout = sm100_utils.make_smem_layout_a(qk_mma, qk_tiler, self.dtype, 1)
        sK_layout = sm100_utils.make_smem_layout_b(qk_mma, qk_tiler, self.dtype, self.kv_stages)
        sV_layout0 = sm100_utils.make_smem_layout_b(pv_mma, pv_tiler, self.dtype, self.kv_stages)
        tP_layout = sm100_utils.make_smem_layout_a(pv_mma, pv_tiler, self.dtype, 1)
        # K and V share one ring: both get the stage stride of the larger tile
        k_tile = cute.cosize(cute.select(sK_layout, mode=[0, 1, 2]))
        v_tile = cute.cosize(cute.select(sV_layout0, mode=[0, 1, 2]))
        stage_elems = max(k_tile, v_tile)
        sK_layout = cute.append(cute.select(sK_layout, mode=[0, 1, 2]),
                                cute.make_layout(self.kv_stages, stride=stage_elems))
        sV_layout = cute.append(cute.select(sV_layout0, mode=[0, 1, 2]),
                                cute.make_layout(self.kv_stages, stride=stage_elems))
        sO_layout = sm100_utils.make_smem_layout_epi(
            self.dtype, utils.LayoutEnum.ROW_MAJOR, (self.tile_m, Dv), 1)

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

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            mbar_s_full: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_p_full: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_o_full: cute.struct.MemRange[cutlass.Int64, 1]
            tmem_holding_buf: Int32
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sO_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, stage_elems * self.kv_stages],
                                   1024]

        if const_expr(self.varlen):
            # the longest sequence and the batch come from lse; one more batch slice zeroes
            # the packed rows outside every sequence
            num_m_blocks = cute.ceil_div(mLSE.shape[0], self.tile_m)
            total = num_m_blocks * mQ.shape[2] * (mLSE.shape[2] + 1)
        else:
            num_m_blocks = cute.ceil_div(mQ.shape[0], self.tile_m)
            total = num_m_blocks * mQ.shape[2] * mQ.shape[3]
        grid = cutlass.min(total, self.cfg.num_sms)
        grid = cutlass.max(grid, 1)
        self.kernel(
            tma_Q, tma_K, tma_V, tma_O, mLSE, mParams, mPageTable, mSeqUsedK,
            mCuSeqlensQ, mCuSeqlensK, mO if const_expr(self.varlen) else None,
            tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O,
            sQ_layout, sK_layout, sV_layout, sO_layout, tP_layout,
            qk_mma, pv_mma, SharedStorage,
        ).launch(grid=[grid, 1, 1], block=[self.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=1)

    # ---------------------------------------------------------------------------------------------
    # Device side
    # ---------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, mParams: cute.Tensor, mPageTable: cute.Tensor | None,
               mSeqUsedK: cute.Tensor | None, mCuSeqlensQ: cute.Tensor | None,
               mCuSeqlensK: cute.Tensor | None, mO_gmem: cute.Tensor | None,
               tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
               tma_atom_O: cute.CopyAtom,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
               tP_layout: cute.ComposedLayout,
               qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == LOAD_WARP:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)

        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        pipeline_q = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, producer_group=one_thread,
            consumer_group=one_thread, tx_count=self.tx_bytes_q, defer_sync=True)
        pipeline_kv = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.mbar_kv.data_ptr(), num_stages=self.kv_stages,
            producer_group=one_thread, consumer_group=one_thread, tx_count=self.tx_bytes_k,
            defer_sync=True)
        s_full = storage.mbar_s_full.data_ptr()
        p_full = storage.mbar_p_full.data_ptr()
        o_full = storage.mbar_o_full.data_ptr()
        if warp_idx == 0:
            with cute.arch.elect_one():
                for b in range(2):
                    cute.arch.mbarrier_init(s_full + b, 1)
                    cute.arch.mbarrier_init(p_full + b, 32 * len(SOFTMAX_WARPS))
                cute.arch.mbarrier_init(o_full, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        tmem_users = 32 * (len(SOFTMAX_WARPS) + 1)
        tmem = utils.TmemAllocator(
            storage.tmem_holding_buf.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=int(Barrier.TMEM_ALLOC),
                                                       num_threads=tmem_users),
            allocator_warp_id=MMA_WARP)
        dealloc_barrier = pipeline.NamedBarrier(barrier_id=int(Barrier.TMEM_DEALLOC),
                                                num_threads=tmem_users)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = cute.make_tensor(cute.recast_ptr(cute.recast_ptr(sK.iterator, dtype=self.dtype),
                                              sV_layout.inner), sV_layout.outer)
        sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)

        # run-time scalars, identical in every role
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        num_heads, num_batch = mQ.shape[2], mQ.shape[3]
        qhead_per_kvhead = num_heads // mK.shape[2]
        window_left, window_right = self.windows(mParams, seqlen_q, seqlen_k)
        num_m_blocks = cute.ceil_div(seqlen_q, self.tile_m)
        # varlen: each role derives its tile's sequence from cu_seqlens (tile_seq); the grid is
        # lse's (max_seqlen_q, H, batch) plus the padding slice batch == batch count
        varlen = None
        if const_expr(self.varlen):
            num_m_blocks = cute.ceil_div(mLSE.shape[0], self.tile_m)
            num_batch = mLSE.shape[2] + 1
            varlen = (mCuSeqlensQ, mCuSeqlensK, mParams, mLSE.shape[2], mO_gmem)
        total_tiles = num_m_blocks * num_heads * num_batch
        bidx, _, _ = cute.arch.block_idx()
        grid_dim, _, _ = cute.arch.grid_dim()
        sched = (num_m_blocks, num_heads, num_batch, total_tiles, bidx, grid_dim)
        blk = (seqlen_q, seqlen_k, window_left, window_right)
        # paged: each role recomputes the lengths of its tile's batch entry (tile_blk)
        paged = (mPageTable, mSeqUsedK, mParams) if const_expr(self.paged) else None

        if warp_idx == LOAD_WARP:
            self.load_warp(mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
                           qk_mma, pv_mma, pipeline_q, pipeline_kv, sched, blk, qhead_per_kvhead,
                           paged, varlen)
        # (the MMA warp's branch comes last: it mutates the tiled MMAs' ACCUMULATE field)
        if warp_idx < len(SOFTMAX_WARPS):
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.softmax_warps(mO, mLSE, mParams, sO, tma_atom_O, qk_mma, pv_mma, tmem_ptr,
                               s_full, p_full, o_full, sched, blk, tidx, warp_idx, paged, varlen)
            cute.arch.fence_view_async_tmem_load()
            dealloc_barrier.arrive_and_wait()
        if warp_idx == MMA_WARP:
            tmem.allocate(self.tmem_alloc_cols)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            tmem.relinquish_alloc_permit()
            self.mma_warp(sQ, sK, sV, tP_layout, qk_mma, pv_mma, tmem_ptr, pipeline_q,
                          pipeline_kv, s_full, p_full, o_full, sched, blk, paged, varlen)
            dealloc_barrier.arrive_and_wait()
            tmem.free(tmem_ptr)

    # --- shared by the roles ------------------------------------------------------------------
    @cute.jit
    def windows(self, mParams: cute.Tensor, seqlen_q: Int32, seqlen_k: Int32):
        """(window_left, window_right) from params[2:4] (local masks; 0 otherwise): -1 (any
        negative) = unbounded, clamped to a bound that covers every key."""
        window_left, window_right = Int32(0), Int32(0)
        if const_expr(self.is_local):
            wl = Int32(mParams[2])
            wr = Int32(mParams[3])
            window_left = seqlen_k if wl < 0 or wl > seqlen_k else wl
            window_right = seqlen_q if wr < 0 or wr > seqlen_q else wr
        return window_left, window_right

    @cute.jit
    def tile_blk(self, blk: cutlass.Constexpr, paged: cutlass.Constexpr, batch: Int32):
        """The tile's (seqlen_q, seqlen_k, window_left, window_right): the call's, or (paged)
        with batch entry ``batch``'s key length seqused_k[batch]."""
        if const_expr(paged is None):
            return blk
        _, mSeqUsedK, mParams = paged
        seqlen_k = mSeqUsedK[batch]
        window_left, window_right = self.windows(mParams, blk[0], seqlen_k)
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
        seq = cutlass.max(cutlass.min(batch, num_seqs - 1), 0)
        q_offset, k_offset = mCuSeqlensQ[seq], mCuSeqlensK[seq]
        seqlen_q = mCuSeqlensQ[seq + 1] - q_offset
        seqlen_k = mCuSeqlensK[seq + 1] - k_offset
        if batch == num_seqs:
            seqlen_q = Int32(0)
            seqlen_k = Int32(0)
        window_left, window_right = self.windows(mParams, seqlen_q, seqlen_k)
        return q_offset, k_offset, (seqlen_q, seqlen_k, window_left, window_right)

    def sequence(self, mX: cute.Tensor, head, batch, offset=None, seq_mode: int = 0):
        """One head of one batch entry of a (S, D, H, B) tensor (``seq_mode`` 0) or a (D, S, H,
        B) one (1): ``mX[:, :, head, batch]``, or (varlen, packed as one batch entry) the rows
        from ``offset`` on."""
        if const_expr(offset is None):
            return mX[None, None, head, batch]
        coord = (offset, 0) if seq_mode == 0 else (0, offset)
        return cute.domain_offset(coord, mX[None, None, head, 0])

    @cute.jit
    def n_block_range(self, m_block: Int32, blk: cutlass.Constexpr):
        """[n_min, n_max): key blocks with at least one visible key for this M tile."""
        seqlen_q, seqlen_k, window_left, window_right = blk
        n_max = cute.ceil_div(seqlen_k, self.tile_n)
        n_min = Int32(0)
        if const_expr(self.is_causal or self.is_local):
            col_end = (m_block + 1) * self.tile_m + seqlen_k - seqlen_q  # exclusive, causal
            if const_expr(self.is_local):
                col_end = col_end + window_right
            n_max = cutlass.min(n_max, cutlass.max((col_end + self.tile_n - 1) // self.tile_n, 0))
        if const_expr(self.is_local):
            col_begin = m_block * self.tile_m + seqlen_k - seqlen_q - window_left
            n_min = cutlass.max(col_begin, 0) // self.tile_n
        if const_expr(self.varlen):
            # a tile past its sequence's end (or of the padding slice): no work in any role
            if m_block * self.tile_m >= seqlen_q:
                n_max = n_min
        return n_min, n_max

    def work_tile(self, idx: Int32, sched):
        num_m_blocks, num_heads, num_batch = sched[0], sched[1], sched[2]
        return tile_order.tile_coords(idx, num_m_blocks, num_heads, num_batch,
                                      self.is_causal or self.is_local)

    # --- load warp ---------------------------------------------------------------------------
    @cute.jit
    def load_warp(self, mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
                  qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, pipeline_q, pipeline_kv,
                  sched: cutlass.Constexpr, blk: cutlass.Constexpr, qhead_per_kvhead: Int32,
                  paged: cutlass.Constexpr = None, varlen: cutlass.Constexpr = None):
        D, Dv = self.hdim, self.hdimv
        qk_thr, pv_thr = qk_mma.get_slice(0), pv_mma.get_slice(0)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        one = cute.make_layout(1)
        total_tiles, bidx, grid_dim = sched[3], sched[4], sched[5]
        for idx in cutlass.range(bidx, total_tiles, grid_dim, unroll=1):
            m_block, head, batch = self.work_tile(idx, sched)
            head_kv = head // qhead_per_kvhead
            q_offset, k_offset, tblk = self.tile_seq(blk, paged, varlen, batch)
            n_min, n_max = self.n_block_range(m_block, tblk)
            gQ = cute.local_tile(self.sequence(mQ, head, batch, q_offset), (self.tile_m, D),
                                 (m_block, 0))
            # paged: K and V are the cache as one batch entry of tile_n-key tiles; key block n of
            # this batch entry is tile page_table[batch, n] (kv_tile); varlen: from k_offset on
            kv_batch = 0 if const_expr(self.paged) else batch
            gK = cute.local_tile(self.sequence(mK, head_kv, kv_batch, k_offset),
                                 (self.tile_n, D), (None, 0))
            gV = cute.local_tile(self.sequence(mV, head_kv, kv_batch, k_offset, seq_mode=1),
                                 (Dv, self.tile_n), (0, None))
            tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, one, cute.group_modes(sQ, 0, 3),
                                               cute.group_modes(qk_thr.partition_A(gQ), 0, 3))
            tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, one, cute.group_modes(sK, 0, 3),
                                               cute.group_modes(qk_thr.partition_B(gK), 0, 3))
            tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, one, cute.group_modes(sV, 0, 3),
                                               cute.group_modes(pv_thr.partition_B(gV), 0, 3))
            n_blocks = n_max - n_min
            if n_blocks > 0:
                pipeline_q.producer_acquire(q_state)
                cute.copy(tma_atom_Q, tQgQ, tQsQ[None, 0],
                          tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
                q_state.advance()
                # ring order = MMA order: K_0, then (K_{j+1}, V_j) for each j, V_last last
                pipeline_kv.producer_acquire(kv_state, expected_tx=self.tx_bytes_k)
                cute.copy(tma_atom_K, tKgK[None, self.kv_tile(paged, batch, n_max - 1)],
                          tKsK[None, kv_state.index],
                          tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))
                kv_state.advance()
                for j in cutlass.range(n_blocks, unroll=1):
                    n_block = n_max - 1 - j
                    if j + 1 < n_blocks:
                        k_tile = self.kv_tile(paged, batch, n_block - 1)
                        pipeline_kv.producer_acquire(kv_state, expected_tx=self.tx_bytes_k)
                        cute.copy(tma_atom_K, tKgK[None, k_tile], tKsK[None, kv_state.index],
                                  tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))
                        kv_state.advance()
                    v_tile = self.kv_tile(paged, batch, n_block)
                    pipeline_kv.producer_acquire(kv_state, expected_tx=self.tx_bytes_v)
                    cute.copy(tma_atom_V, tVgV[None, v_tile], tVsV[None, kv_state.index],
                              tma_bar_ptr=pipeline_kv.producer_get_barrier(kv_state))
                    kv_state.advance()

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
                 pv_mma: cute.TiledMma, tmem_ptr, pipeline_q, pipeline_kv, s_full, p_full, o_full,
                 sched: cutlass.Constexpr, blk: cutlass.Constexpr,
                 paged: cutlass.Constexpr = None, varlen: cutlass.Constexpr = None):
        qk_thr, pv_thr = qk_mma.get_slice(0), pv_mma.get_slice(0)
        tSrQ = qk_thr.make_fragment_A(sQ)
        tSrK = qk_thr.make_fragment_B(sK)
        tOrV = pv_thr.make_fragment_B(sV)
        tStS_fake = qk_thr.make_fragment_C(qk_thr.partition_shape_C((self.tile_m, self.tile_n)))
        tOtO_fake = pv_thr.make_fragment_C(pv_thr.partition_shape_C((self.tile_m, self.hdimv)))
        tStS = [cute.make_tensor(tmem_ptr + off, tStS_fake.layout) for off in self.tmem_s_offset]
        tOtO = cute.make_tensor(tmem_ptr + self.tmem_o_offset, tOtO_fake.layout)
        tOrP_fake = pv_thr.make_fragment_A(cute.make_tensor(tmem_ptr, tP_layout.outer))[
            None, None, None, 0]
        tOrP = [cute.make_tensor(cute.recast_ptr(tmem_ptr + off, dtype=tOrP_fake.element_type),
                                 tOrP_fake.layout) for off in self.tmem_p_offset]

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        s_count = Int32(0)  # S buffers used so far by this CTA (buffer = count % 2)
        total_tiles, bidx, grid_dim = sched[3], sched[4], sched[5]
        for idx in cutlass.range(bidx, total_tiles, grid_dim, unroll=1):
            m_block, head, batch = self.work_tile(idx, sched)
            n_min, n_max = self.n_block_range(m_block,
                                              self.tile_seq(blk, paged, varlen, batch)[2])
            n_blocks = n_max - n_min
            if n_blocks > 0:
                pipeline_q.consumer_wait(q_state)
                # S_0
                pipeline_kv.consumer_wait(kv_state)
                kv_state = self.gemm_qk(qk_mma, tSrQ, tSrK, tStS, s_full, s_count, pipeline_kv,
                                        kv_state)
                if n_blocks == 1:
                    pipeline_q.consumer_release(q_state)  # commit: after the tile's last QK
                s_count += 1
                for j in cutlass.range(n_blocks, unroll=1):
                    if j + 1 < n_blocks:
                        pipeline_kv.consumer_wait(kv_state)
                        kv_state = self.gemm_qk(qk_mma, tSrQ, tSrK, tStS, s_full, s_count,
                                                pipeline_kv, kv_state)
                        if j + 2 == n_blocks:
                            pipeline_q.consumer_release(q_state)
                        s_count += 1
                    # PV_j reads P_j from the buffer of S_j: wait until softmax wrote it
                    sj = s_count - 1 - (1 if j + 1 < n_blocks else 0)
                    cute.arch.mbarrier_wait(p_full + sj % 2, (sj // 2) % 2)
                    pipeline_kv.consumer_wait(kv_state)
                    for k in cutlass.range_constexpr(cute.size(tOrP[0], mode=[2])):
                        pv_mma.set(tcgen05.Field.ACCUMULATE, j > 0 or k > 0)
                        if sj % 2 == 0:
                            cute.gemm(pv_mma, tOtO, tOrP[0][None, None, k],
                                      tOrV[None, None, k, kv_state.index], tOtO)
                        else:
                            cute.gemm(pv_mma, tOtO, tOrP[1][None, None, k],
                                      tOrV[None, None, k, kv_state.index], tOtO)
                    with cute.arch.elect_one():
                        tcgen05.commit(o_full)
                    pipeline_kv.consumer_release(kv_state)
                    kv_state.advance()
                q_state.advance()

    @cute.jit
    def gemm_qk(self, qk_mma: cute.TiledMma, tSrQ, tSrK, tStS, s_full, s_count: Int32,
                pipeline_kv, kv_state):
        """S[s_count % 2] = Q·Kᵀ from the current ring stage; signal s_full; release the stage."""
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            qk_mma.set(tcgen05.Field.ACCUMULATE, k > 0)
            if s_count % 2 == 0:
                cute.gemm(qk_mma, tStS[0], tSrQ[None, None, k, 0],
                          tSrK[None, None, k, kv_state.index], tStS[0])
            else:
                cute.gemm(qk_mma, tStS[1], tSrQ[None, None, k, 0],
                          tSrK[None, None, k, kv_state.index], tStS[1])
        with cute.arch.elect_one():
            tcgen05.commit(s_full + s_count % 2)
        pipeline_kv.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    # --- softmax / correction / epilogue warps -----------------------------------------------
    @cute.jit
    def softmax_warps(self, mO, mLSE, mParams, sO, tma_atom_O, qk_mma: cute.TiledMma,
                      pv_mma: cute.TiledMma, tmem_ptr, s_full, p_full, o_full,
                      sched: cutlass.Constexpr, blk: cutlass.Constexpr, tidx: Int32,
                      warp_idx: Int32, paged: cutlass.Constexpr = None,
                      varlen: cutlass.Constexpr = None):
        qk_thr, pv_thr = qk_mma.get_slice(0), pv_mma.get_slice(0)
        tStS_fake = qk_thr.make_fragment_C(qk_thr.partition_shape_C((self.tile_m, self.tile_n)))
        tOtO_fake = pv_thr.make_fragment_C(pv_thr.partition_shape_C((self.tile_m, self.hdimv)))
        tStS0 = cute.make_tensor(tmem_ptr, tStS_fake.layout)
        tOtO = cute.make_tensor(tmem_ptr + self.tmem_o_offset, tOtO_fake.layout)
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS = qk_thr.partition_C(cS)

        # S row: tile_n fp32 columns per thread, 32x32b loads
        ld_s = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32),
            tStS0)
        thr_ld_s = ld_s.get_slice(tidx)
        tTtS = [cute.make_tensor(thr_ld_s.partition_S(tStS0).iterator + off,
                                 thr_ld_s.partition_S(tStS0).layout) for off in self.tmem_s_offset]
        tTcS = thr_ld_s.partition_D(tScS)
        # P: tile_n/2 32-bit columns (16-bit pairs) at the upper half of the S buffer
        p_cols = self.tile_n // 2
        tStP_layout = cute.composition(tStS0.layout, cute.make_layout((self.tile_m, p_cols)))
        tStP0 = cute.make_tensor(tmem_ptr, tStP_layout)
        st_p = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(p_cols // 2)),
                                Float32), tStP0)
        thr_st_p = st_p.get_slice(tidx)
        tTtP = [cute.make_tensor(thr_st_p.partition_D(tStP0).iterator + off,
                                 thr_st_p.partition_D(tStP0).layout) for off in self.tmem_p_offset]
        tScP = cute.make_tensor(tScS.iterator,
                                cute.composition(tScS.layout, cute.make_layout((self.tile_m, p_cols))))
        tTcP = thr_st_p.partition_S(tScP)
        # O: chunks of o_chunk columns
        tOtO_i = cute.logical_divide(tOtO, cute.make_layout((self.tile_m, self.o_chunk)))
        ld_o = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(self.o_chunk)),
                                Float32), tOtO_i[(None, None), 0])
        st_o = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(self.o_chunk)),
                                Float32), tOtO_i[(None, None), 0])
        thr_ld_o, thr_st_o = ld_o.get_slice(tidx), st_o.get_slice(tidx)
        tTtO_ld = thr_ld_o.partition_S(tOtO_i[(None, None), None])
        tTtO_st = thr_st_o.partition_D(tOtO_i[(None, None), None])
        num_o_chunks = self.hdimv // self.o_chunk
        # epilogue: TMEM -> registers -> swizzled smem, via the matching smem store atom
        cO = cute.make_identity_tensor((self.tile_m, self.hdimv))
        tOsO = pv_thr.partition_C(sO[None, None, 0])
        tOsO_i = cute.logical_divide(tOsO, cute.make_layout((self.tile_m, self.o_chunk)))
        tOcO_i = cute.logical_divide(pv_thr.partition_C(cO),
                                     cute.make_layout((self.tile_m, self.o_chunk)))
        tTsO = thr_ld_o.partition_D(tOsO_i[(None, None), None])
        tTcO = thr_ld_o.partition_D(tOcO_i[(None, None), None])
        smem_store = cute.make_tiled_copy_D(
            sm100_utils.get_smem_store_op(utils.LayoutEnum.ROW_MAJOR, self.dtype, Float32, ld_o),
            ld_o)
        if const_expr(self.varlen):
            # varlen: each thread stores its own row (the TMEM lane it loaded) to global memory
            gmem_store = cute.make_tiled_copy_D(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                    num_bits_per_copy=128), ld_o)

        scale = mParams[0]
        softcap_in_scale = Float32(0.0)
        if const_expr(self.has_softcap):
            softcap = mParams[1]
            softcap_in_scale = scale / softcap  # tanh(s·scale/softcap), then ·softcap·log2 e
            scale_log2 = softcap * LOG2_E
        else:
            scale_log2 = scale * LOG2_E

        epi_barrier = pipeline.NamedBarrier(barrier_id=int(Barrier.EPILOGUE),
                                            num_threads=32 * len(SOFTMAX_WARPS))
        s_count = Int32(0)
        pv_count = Int32(0)
        total_tiles, bidx, grid_dim = sched[3], sched[4], sched[5]
        for idx in cutlass.range(bidx, total_tiles, grid_dim, unroll=1):
            m_block, head, batch = self.work_tile(idx, sched)
            q_offset, _, tblk = self.tile_seq(blk, paged, varlen, batch)  # lengths and window
            n_min, n_max = self.n_block_range(m_block, tblk)
            n_blocks = n_max - n_min
            row = m_block * self.tile_m + tTcS[0][0]  # this thread's query row
            row_max = Float32(-math.inf)  # the max actually applied to P (conditional rescale)
            row_sum = Float32(0.0)
            for j in cutlass.range(n_blocks, unroll=1):
                n_block = n_max - 1 - j
                buf = s_count % 2
                cute.arch.mbarrier_wait(s_full + buf, (s_count // 2) % 2)
                tSrS = cute.make_rmem_tensor(tTcS.shape, Float32)
                if buf == 0:
                    cute.copy(ld_s, tTtS[0], tSrS)
                else:
                    cute.copy(ld_s, tTtS[1], tSrS)
                cute.arch.fence_view_async_tmem_load()
                row_max, row_sum, acc_scale, need = self.softmax_block(
                    tSrS, tTcS, row, n_block, row_max, row_sum, scale_log2, softcap_in_scale,
                    tblk)
                # P as 16-bit pairs into the upper half of this S buffer
                tPr = cute.make_rmem_tensor(tTcP.shape, Float32)
                tPr32 = cute.recast_tensor(tPr, Int32)
                for i in cutlass.range_constexpr(cute.size(tPr32)):
                    tPr32[i] = cvt_pack_f32x2(tSrS[2 * i], tSrS[2 * i + 1], self.is_bf16)
                if buf == 0:
                    cute.copy(st_p, tPr, tTtP[0])
                else:
                    cute.copy(st_p, tPr, tTtP[1])
                cute.arch.fence_view_async_tmem_store()
                if j > 0:
                    # O holds PV_{j-1} only once it completed; rescale it before PV_j is issued
                    cute.arch.mbarrier_wait(o_full, pv_count % 2)
                    pv_count += 1
                    if cute.arch.vote_any_sync(need):
                        self.rescale_o(ld_o, st_o, tTtO_ld, tTtO_st, tTcO, acc_scale,
                                       num_o_chunks)
                        cute.arch.fence_view_async_tmem_store()
                cute.arch.mbarrier_arrive(p_full + buf)
                s_count += 1
            # ---- epilogue ----
            if n_blocks > 0:
                cute.arch.mbarrier_wait(o_full, pv_count % 2)  # the last PV
                pv_count += 1
            empty = row_sum == 0.0 or row_sum != row_sum
            inv_sum = Float32(1.0) if empty else cute.arch.rcp_approx(row_sum)
            if const_expr(self.varlen):
                # this thread's row of the sequence's output tile (no shared-memory staging)
                mO_seq = self.sequence(varlen[4], head, 0, q_offset)
                tTgO = self.thread_rows(cute.local_tile(mO_seq, (self.tile_m, self.hdimv),
                                                        (m_block, 0)), pv_thr, thr_ld_o)
            else:
                # the previous tile's TMA store has finished reading sO
                if warp_idx == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                epi_barrier.arrive_and_wait()
            for c in cutlass.range_constexpr(num_o_chunks):
                tOr = cute.make_rmem_tensor(tTcO[None, 0, 0, c].shape, Float32)
                if n_blocks > 0:
                    cute.copy(ld_o, tTtO_ld[None, 0, 0, c], tOr)
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
                    cute.copy(smem_store, tOr16, tTsO[None, 0, 0, c])
            cute.arch.fence_view_async_tmem_load()  # O read: the next tile's PV may overwrite it
            if const_expr(not self.varlen):
                self.store_o_tma(mO, sO, tma_atom_O, epi_barrier, warp_idx, m_block, head, batch)
            if row < tblk[0]:
                lse = Float32(-math.inf)
                if not empty:
                    lse = (row_max * scale_log2 + cute.math.log2(row_sum, fastmath=True)) * LN2
                mLSE[row, head, batch] = lse
            if const_expr(self.varlen):
                if batch == varlen[3]:
                    zeros = cute.make_rmem_tensor(tTcO[None, 0, 0, 0].shape, self.dtype)
                    zeros.fill(0.0)
                    self.zero_padding_rows(varlen, head, m_block, sched[0], tTcS[0][0], zeros,
                                           gmem_store, pv_thr, thr_ld_o)
        if warp_idx == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def store_o_tma(self, mO, sO, tma_atom_O, epi_barrier, warp_idx: Int32, m_block: Int32,
                    head: Int32, batch: Int32):
        """Dense / paged epilogue: O staged in sO by all softmax threads -> one TMA store (rows
        past seqlen_q clipped by TMA)."""
        cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> TMA reads
        epi_barrier.arrive_and_wait()
        if warp_idx == 0:
            gO = cute.local_tile(mO[None, None, head, batch], (self.tile_m, self.hdimv),
                                 (m_block, 0))
            tOsO_tma, tOgO = cpasync.tma_partition(
                tma_atom_O, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                cute.group_modes(gO, 0, 2))
            with cute.arch.elect_one():
                cute.copy(tma_atom_O, tOsO_tma[None, 0], tOgO)
                cute.arch.cp_async_bulk_commit_group()

    def thread_rows(self, gO: cute.Tensor, pv_thr, thr_ld_o) -> cute.Tensor:
        """Varlen: this softmax thread's part of a (tile_m, Dv) global tile, in o_chunk-column
        chunks, as its epilogue TMEM loads hold it (thread t: row t): index [None, 0, 0, c]."""
        tOgO_i = cute.logical_divide(pv_thr.partition_C(gO),
                                     cute.make_layout((self.tile_m, self.o_chunk)))
        return thr_ld_o.partition_D(tOgO_i[(None, None), None])

    @cute.jit
    def zero_padding_rows(self, varlen: cutlass.Constexpr, head: Int32, m_block: Int32,
                          num_m_blocks: Int32, lane_row: Int32, zeros: cute.Tensor,
                          gmem_store: cute.TiledCopy, pv_thr, thr_ld_o):
        """Varlen, padding slice: write 0 to head ``head`` of the packed output rows outside
        every sequence, [0, cu_seqlens_q[0]) and [cu_seqlens_q[-1], total). The row tiles
        meeting those ranges are numbered 0, 1, ...; work tile ``m_block`` takes m_block,
        m_block + num_m_blocks, ...; thread ``lane_row`` writes that row of each (whole rows,
        ``zeros`` is one o_chunk)."""
        mCuSeqlensQ, _, _, num_seqs, mO_gmem = varlen
        total = mO_gmem.shape[0]
        first, last = mCuSeqlensQ[0], mCuSeqlensQ[num_seqs]
        head_tiles = cute.ceil_div(first, self.tile_m)  # tiles meeting [0, first)
        tail_begin = cutlass.max(last // self.tile_m, head_tiles)  # then [last, total)
        num_tiles = head_tiles + cute.ceil_div(total, self.tile_m) - tail_begin
        mO_h = mO_gmem[None, None, head, 0]
        i = m_block
        while i < num_tiles:
            tile = i if i < head_tiles else tail_begin + i - head_tiles
            row = tile * self.tile_m + lane_row
            if row < total and (row < first or row >= last):
                tTgO = self.thread_rows(cute.local_tile(mO_h, (self.tile_m, self.hdimv),
                                                        (tile, 0)), pv_thr, thr_ld_o)
                for c in cutlass.range_constexpr(self.hdimv // self.o_chunk):
                    cute.copy(gmem_store, zeros, tTgO[None, 0, 0, c])
            i += num_m_blocks

    @cute.jit
    def softmax_block(self, tSrS: cute.Tensor, tTcS: cute.Tensor, row: Int32, n_block: Int32,
                      row_max: Float32, row_sum: Float32, scale_log2: Float32,
                      softcap_in_scale: Float32, blk: cutlass.Constexpr):
        """One key block of one row, in registers: S -> P in place. Returns the new applied
        max, the new row sum, the factor O must be rescaled by and whether that is needed."""
        seqlen_q, seqlen_k, window_left, window_right = blk
        n = cute.size(tSrS)
        if const_expr(self.has_softcap):
            for i in cutlass.range_constexpr(n):
                tSrS[i] = cute.math.tanh(tSrS[i] * softcap_in_scale, fastmath=True)
        # masks: key-length tail always (cheap: one compare per element), causal / window
        col0 = n_block * self.tile_n
        right = seqlen_k - col0  # exclusive, relative to the block
        if const_expr(self.is_causal or self.is_local):
            diag = row + seqlen_k - seqlen_q - col0
            if const_expr(self.is_local):
                right = cutlass.min(right, diag + window_right + 1)
            else:
                right = cutlass.min(right, diag + 1)
        if const_expr(self.is_local):
            left = diag - window_left
            for i in cutlass.range_constexpr(n):
                c = tTcS[i][1]
                tSrS[i] = -Float32.inf if c >= right or c < left else tSrS[i]
        else:
            for i in cutlass.range_constexpr(n):
                tSrS[i] = -Float32.inf if tTcS[i][1] >= right else tSrS[i]
        # row max: 4 independent chains of 3-input max
        acc = [tSrS[i] for i in range(4)]
        for i in cutlass.range_constexpr(4, n, 8):
            for a in cutlass.range_constexpr(4):
                acc[a] = cute.arch.fmax(acc[a], cute.arch.fmax(tSrS[i + a], tSrS[i + 4 + a]))
        blk_max = cute.arch.fmax(cute.arch.fmax(acc[0], acc[1]), cute.arch.fmax(acc[2], acc[3]))
        m_new = cute.arch.fmax(row_max, blk_max)
        # conditional rescale: move the applied max only when it grew by more than the
        # threshold (log2 units); -inf -> finite is +inf (moves), -inf -> -inf is NaN (stays)
        need = m_new * scale_log2 - row_max * scale_log2 > self.rescale_threshold
        acc_scale = Float32(1.0)
        if need:
            acc_scale = cute.math.exp2(row_max * scale_log2 - m_new * scale_log2, fastmath=True)
            row_max = m_new
        m_safe = Float32(0.0) if row_max == -Float32.inf else row_max
        neg_m_scaled = -m_safe * scale_log2
        for i in cutlass.range_constexpr(0, n, 2):
            tSrS[i], tSrS[i + 1] = cute.arch.fma_packed_f32x2(
                (tSrS[i], tSrS[i + 1]), (scale_log2, scale_log2), (neg_m_scaled, neg_m_scaled))
        for i in cutlass.range_constexpr(0, n, 2):
            if const_expr(exp2_is_software(i, self.exp2_sw_per_32)):
                tSrS[i], tSrS[i + 1] = exp2_sw_x2(tSrS[i], tSrS[i + 1])
            else:
                tSrS[i] = cute.math.exp2(tSrS[i], fastmath=True)
                tSrS[i + 1] = cute.math.exp2(tSrS[i + 1], fastmath=True)
        sums = [(tSrS[0], tSrS[1]), (tSrS[2], tSrS[3])]
        for i in cutlass.range_constexpr(4, n, 4):
            for a in cutlass.range_constexpr(2):
                sums[a] = cute.arch.add_packed_f32x2(sums[a], (tSrS[i + 2 * a], tSrS[i + 2 * a + 1]))
        s2 = cute.arch.add_packed_f32x2(sums[0], sums[1])
        row_sum = row_sum * acc_scale + (s2[0] + s2[1])
        return row_max, row_sum, acc_scale, need

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


def make_launcher(cfg: FwdConfig):
    """The `@cute.jit` launcher ``fn(stream, q, k, v, params, out, lse)`` for this config,
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

    @cute.jit
    def sm100_fwd(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
                  params: cute.Tensor, out: cute.Tensor, lse: cute.Tensor):
        kernel(stream, q, k, v, params, out, lse)

    return sm100_fwd
