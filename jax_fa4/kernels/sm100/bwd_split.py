"""FlashAttention backward for Blackwell (sm_100a) at head dims 192/192 and 256, in CuTe-DSL:
the split backward, a dK/dV kernel and a dQ kernel (call contracts and the TMEM arithmetic in
bwd_split_config.py). Compile-verified; never run on a Blackwell GPU in this project.

One class serves both parts with one warp layout and one barrier protocol. Each CTA keeps a
*resident* block of 128 rows in shared memory (its TMEM lanes) and walks the blocks of 64 rows
of the *streamed* operands that it sees:

  part   resident      streamed    lane   GEMM1 (SS)      GEMM2 (SS)       TS GEMMs (A in TMEM)
  dkdv   K, V (keys)   Q, dO       key    Sᵀ = K·Qᵀ       dPᵀ = V·dOᵀ      dV_c += Pᵀ·dO[:, c]
                                                                          dK_c += dSᵀ·Q[:, c]
  dq     Q, dO (rows)  K, V        query  S = Q·Kᵀ        dP = dO·Vᵀ       dQ += dS·K

dkdv: grid (parts·ceil(Sk/128), H, B) with parts = cfg.col_splits (the config's rule: 1 at
192/192, 2 at 256), CTA x takes key block x // parts and output column part c = x % parts
(columns [c·out_cols, (c + 1)·out_cols) of dK and dV: all 192 at 192/192, a half of 128 at 256);
every CTA computes the whole Sᵀ / dPᵀ (the contraction runs over all of D). dq: grid
(ceil(Sq/128), H, B), c = 0, all D columns of dQ. GEMM1 / GEMM2 per iteration: M = 128 lanes,
N = 64 streamed rows, K = D; the TS GEMMs: M = 128, N = out_cols (128, 192 or 256), K = 64,
B = the streamed buffer seen MN-major (N tile c).

Warps (384 threads): 0-7 compute (warpgroup w = streamed columns [32w, 32w + 32) of GEMM1 /
GEMM2; thread = TMEM lane), 8 MMA (one elected thread; allocates TMEM), 9 load (TMA for the four
operands; dkdv: the -lse_log2 / -delta rows of each Q block), 10-11 idle.

TMEM (bwd_split_config.tmem_offsets): the accumulators (dkdv: dK_c, dV_c; dq: dQ) from column 0,
then X = Sᵀ / S (64 columns) and Y = dPᵀ / dP (64). The compute warpgroup w stores 16-bit Pᵀ (dkdv)
in X's columns [32w, 32w + 16) and 16-bit dSᵀ / dS in Y's columns [32w, 32w + 16): columns it has
read itself.

Elementwise (compute warps): dkdv as the fused kernel (bwd.py's softmax_p / softmax_ds: -lse,
-delta per query column from shared memory, masks from ``BwdBlocks``); dq per row: -lse, -delta
of the thread's query row read once from global memory (rows past seqlen_q: -inf and 0, so
P = dS = 0), masks from ``Band.visible_cols``, P kept in registers (the dq part has no Pᵀ GEMM).

Synchronisation (raw mbarriers, one completion per iteration j; phase = j % 2):
  s_full   MMA → compute   commit after GEMM1_j
  p_full   compute → MMA   256 arrivals: X_j read (tcgen05.wait::ld) and, dkdv, Pᵀ_j stored
                           (tcgen05.wait::st)
  dp_full  MMA → compute   commit after GEMM2_j
  ds_full  compute → MMA   256 arrivals: Y_j read and dS_j stored (wait::st)
  acc_full MMA → compute   commit after the last TS GEMM (the epilogue's start)
  streamed operands: PipelineTmaUmma (S1 = Q / K with stream_stages, S2 = dO / V with
  other_stages; released by commits: S1_j after the TS GEMM that reads dS_j, S2_j after its last
  reader: dkdv the dV GEMM, dq GEMM2); resident: one PipelineTmaUmma stage, never released;
  dkdv stats: PipelineAsync (32 load threads → 256 compute threads), the stage of S1's.
MMA order, j = 0 … count (count + 1 passes):
  j < count:  wait S1_j;          GEMM1_j; commit s_full
  j > 0:      wait ds_full_{j−1}; dkdv: dK_c += dSᵀ_{j−1}·Q_{j−1}[:, c]; dq: dQ += dS_{j−1}·K_{j−1};
              release S1_{j−1}
  j < count:  wait S2_j;          GEMM2_j; commit dp_full; wait p_full_j;
              dkdv: dV_c += Pᵀ_j·dO_j[:, c];  release S2_j
  after:      count > 0: commit acc_full
Why no other barrier: GEMM1_{j+1} overwrites X after p_full_j (X_j read, and Pᵀ_j in X is read
by dV_j, issued before it: the tensor pipe runs one thread's MMAs in order); GEMM2_{j+1}
overwrites Y after ds_full_j and after the TS GEMM of dS_j (issued before it). The compute warps
store Pᵀ_{j+1} after s_full_{j+1} and dS_{j+1} after dp_full_{j+1}, commits that complete every
earlier MMA, dV_j and the TS GEMM of dS_j included. S1 needs two stages: GEMM1_{j+1} reads
S1_{j+1} while S1_j waits for its TS GEMM (tests/test_sm100_bwd_split_protocol.py).
TMEM: allocated by the MMA warp, permit relinquished, freed after every TMEM user passed the
dealloc barrier (after its last tcgen05.wait::ld).

Varlen (``cfg.varlen``; bwd_split_config.split_varlen_backward_signature): q, k, v, dout and the
outputs are sequences packed as one batch entry; CTA (x, head) takes work row x // col_splits
(dq: its offset and length columns hold k's before q's), whose sequence's lengths replace the
tensors' and whose offsets shift every TMA view and the statistics' rows. Tiles past the
sequence load the next sequence's rows or zeroed padding (rows past len_q: −∞ / 0 statistics;
keys past len_k: masked); outputs are stored below the sequence's length. Spare rows run
count = 0; the ZERO_PADDING row's first CTA zeroes the outputs' rows outside every sequence
after the dealloc barrier. No barrier, role or phase changes.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, tcgen05

from jax_fa4.kernels.common.convert import cvt_pack_f32x2
from jax_fa4.kernels.common.geometry import Band, BwdBlocks, FwdBlocks, resolve_windows
from jax_fa4.kernels.common.layout import select_modes
from jax_fa4.kernels.common.views import seq_major, sequence
from jax_fa4.kernels.common.rows import zero_padding_rows
from jax_fa4.kernels.sm100.bwd import (_FLT_MIN_NORMAL, ZERO_PADDING,
                                       FlashAttentionBackwardSm100, tmem_cols)
from jax_fa4.kernels.sm100.bwd_split_config import Sm100BwdSplitConfig
from jax_fa4.kernels.spec import PARAM_SCALE

COMPUTE_WARPS = tuple(range(8))
MMA_WARP = 8
LOAD_WARP = 9
#: named barriers (0 is __syncthreads)
TMEM_ALLOC_BARRIER, TMEM_DEALLOC_BARRIER = 1, 2


def sample_coords(extent: int) -> list[int]:
    """0, the powers of two below ``extent`` and each one less, and extent − 1: the corners of
    every mode of a layout built from power-of-two tiles (the layouts are affine per mode)."""
    out = {0, extent - 1}
    p = 1
    while p < extent:
        out |= {p, p - 1, min(2 * p - 1, extent - 1)}
        p *= 2
    return sorted(out)


def check_transposed_view(loaded: cute.ComposedLayout, view: cute.ComposedLayout, rows: int,
                          dim: int, n_tile: int, stages: int, what: str) -> None:
    """Trace time: raise ValueError unless element (row r, column d) of the K-major buffer
    ``loaded`` (the SS GEMMs' B operand: ((rows, 16), 1, dim / 16, stages) k-blocks, as the TMA
    fills it) and element (d, r) of its MN-major ``view`` (the TS GEMMs' B operand: ((n_tile,
    16), dim / n_tile, rows / 16, stages)) are the same shared-memory element, at sampled
    corners of every mode (both layouts share one swizzle, checked too)."""
    if str(loaded.inner) != str(view.inner):
        raise ValueError(f"{what}: the transposed view has another swizzle")
    for st in range(stages):
        for r in sample_coords(rows):
            for d in sample_coords(dim):
                a = cute.crd2idx(((r, d % 16), 0, d // 16, st), loaded.outer)
                b = cute.crd2idx(((d % n_tile, r % 16), d // n_tile, r // 16, st), view.outer)
                if a != b:
                    raise ValueError(f"{what}: element ({r}, {d}) of stage {st} is at {a} in "
                                     f"the loaded layout and at {b} in the transposed view")


class FlashAttentionBackwardSm100Split(FlashAttentionBackwardSm100):
    """Both kernels of the split backward; reuses the fused kernel's compute-warp pieces
    (load_wg_cols, softmax_p, softmax_ds, store_16bit, stage_stats, softmax_scales) with 64 query
    columns per block."""

    def __init__(self, cfg: Sm100BwdSplitConfig):  # (not the fused kernel's config)
        cfg.validate()
        self.cfg = cfg
        self.dkdv = cfg.part == "dkdv"
        self.dtype = cutlass.BFloat16 if cfg.dtype == "bfloat16" else cutlass.Float16
        self.is_bf16 = cfg.dtype == "bfloat16"
        self.hdim, self.hdimv = cfg.head_dim, cfg.head_dim_v
        self.out_cols = cfg.out_cols
        self.rows, self.cols = cfg.tile_rows, cfg.tile_cols
        # the fused kernel's names, read by its compute pieces (dkdv: keys × query columns)
        self.tile_n, self.tile_m = self.rows, self.cols
        self.stream_stages, self.other_stages = cfg.stream_stages, cfg.other_stages
        self.q_stages = self.stream_stages  # the stats stage follows S1's (stage_stats)
        self.is_causal = cfg.mask == "causal"
        self.is_local = cfg.mask == "local"
        self.has_softcap = cfg.has_softcap
        self.gqa = cfg.gqa
        self.tmem_alloc_cols = cfg.tmem_alloc_columns()
        off = cfg.tmem_offsets()
        self.tmem_s, self.tmem_dp = off["s"], off["dp"]
        self.tmem_acc = (off["dk"], off["dv"]) if self.dkdv else (off["dq"],)
        self.cols_per_wg = self.cols // 2
        self.p16_stride = self.cols_per_wg
        self.epi_chunk = 16

    # ---------------------------------------------------------------------------------------------
    # Host side
    # ---------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, stream: cuda.CUstream, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mdO: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor, mParams: cute.Tensor,
                 mOut0: cute.Tensor, mOut1: cute.Tensor | None = None,
                 mCuSeqlensQ: cute.Tensor | None = None, mCuSeqlensK: cute.Tensor | None = None,
                 mWork: cute.Tensor | None = None):
        if const_expr(self.cfg.varlen != (mWork is not None)):
            raise TypeError("cu_seqlens and work are passed exactly when the config is varlen")
        for name, t in (("cu_seqlens_q", mCuSeqlensQ), ("cu_seqlens_k", mCuSeqlensK),
                        ("work", mWork)):
            if const_expr(t is not None and t.element_type != Int32):
                raise TypeError(f"{name} must be int32")
        for name, t in (("q", mQ), ("k", mK), ("v", mV), ("dout", mdO)):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"{name}: expected {self.dtype}, got {t.element_type}")
        out_type = Float32 if self.gqa else self.dtype
        for t in (mOut0, mOut1):
            if const_expr(t is not None and t.element_type != out_type):
                raise TypeError(f"outputs must be {out_type}")
        if const_expr(self.dkdv != (mOut1 is not None)):
            raise TypeError("dkdv takes dk, dv; dq takes dq")
        for name, t in (("lse_log2", mLSE), ("delta", mDelta), ("params", mParams)):
            if const_expr(t.element_type != Float32):
                raise TypeError(f"{name} must be float32")
        D, Dv, rows, cols = self.hdim, self.hdimv, self.rows, self.cols
        dt = self.dtype
        mQ, mK, mdO, mV = seq_major(mQ, D), seq_major(mK, D), seq_major(mdO, Dv), seq_major(mV, Dv)
        mOut0 = seq_major(mOut0, D)
        if const_expr(self.dkdv):
            mOut1 = seq_major(mOut1, Dv)
        mLSE, mDelta = [select_modes(t, (2, 1, 0)) for t in (mLSE, mDelta)]  # (Sq, H, B)
        # resident (A of GEMM1 / GEMM2) and streamed (B) operands
        mR1, mR2, mS1, mS2 = (mK, mV, mQ, mdO) if const_expr(self.dkdv) else (mQ, mdO, mK, mV)

        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        cta = tcgen05.CtaGroup.ONE
        x_tiler = (rows, cols, D)  # GEMM1: Sᵀ = K·Qᵀ / S = Q·Kᵀ
        y_tiler = (rows, cols, Dv)  # GEMM2: dPᵀ = V·dOᵀ / dP = dO·Vᵀ
        o = self.out_cols
        x_mma = sm100_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, K_MAJOR, Float32, cta,
                                                   x_tiler[:2])
        y_mma = sm100_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, K_MAJOR, Float32, cta,
                                                   y_tiler[:2])
        # TS GEMMs: acc (rows × out_cols) += A (rows × cols, TMEM) · B (MN-major, N tile c)
        ts_mma = sm100_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, MN_MAJOR, Float32, cta,
                                                    (rows, o), tcgen05.OperandSource.TMEM)
        # dkdv: the dV GEMM's own MMA object (its ACCUMULATE field is set in another branch)
        ts2_mma = sm100_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, MN_MAJOR, Float32, cta,
                                                     (rows, o), tcgen05.OperandSource.TMEM)
        s1t_tiler = (rows, D, cols)  # B = S1ᵀ (D × cols): dK_c / dQ
        s2t_tiler = (rows, Dv, cols)  # B = S2ᵀ (Dv × cols): dV_c

        sR1_l = sm100_utils.make_smem_layout_a(x_mma, x_tiler, dt, 1)
        sS1_l = sm100_utils.make_smem_layout_b(x_mma, x_tiler, dt, self.stream_stages)
        sR2_l = sm100_utils.make_smem_layout_a(y_mma, y_tiler, dt, 1)
        sS2_l = sm100_utils.make_smem_layout_b(y_mma, y_tiler, dt, self.other_stages)
        sS1t_l = sm100_utils.make_smem_layout_b(ts_mma, s1t_tiler, dt, self.stream_stages)
        sS2t_l = sm100_utils.make_smem_layout_b(ts_mma, s2t_tiler, dt, self.other_stages)
        tA_l = sm100_utils.make_smem_layout_a(ts_mma, (rows, o, cols), dt, 1)  # 16-bit A in TMEM
        # the TS GEMMs read the streamed buffers as loaded, transposed (N tile c of MMA_N)
        check_transposed_view(sS1_l, sS1t_l, cols, D, o, self.stream_stages, "S1")
        check_transposed_view(sS2_l, sS2t_l, cols, Dv, o, self.other_stages, "S2")

        g2s = cpasync.CopyBulkTensorTileG2SOp(cta)
        tma_atom_R1, tma_R1 = cute.nvgpu.make_tiled_tma_atom_A(
            g2s, mR1, cute.select(sR1_l, mode=[0, 1, 2]), x_tiler, x_mma)
        tma_atom_S1, tma_S1 = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, mS1, cute.select(sS1_l, mode=[0, 1, 2]), x_tiler, x_mma)
        tma_atom_R2, tma_R2 = cute.nvgpu.make_tiled_tma_atom_A(
            g2s, mR2, cute.select(sR2_l, mode=[0, 1, 2]), y_tiler, y_mma)
        tma_atom_S2, tma_S2 = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, mS2, cute.select(sS2_l, mode=[0, 1, 2]), y_tiler, y_mma)
        self.tx_bytes_s1 = cute.size_in_bytes(dt, cute.select(sS1_l, mode=[0, 1, 2]))
        self.tx_bytes_s2 = cute.size_in_bytes(dt, cute.select(sS2_l, mode=[0, 1, 2]))
        self.tx_bytes_r = (cute.size_in_bytes(dt, cute.select(sR1_l, mode=[0, 1, 2]))
                           + cute.size_in_bytes(dt, cute.select(sR2_l, mode=[0, 1, 2])))
        stat_rows = cols * self.stream_stages  # (dkdv's -lse / -delta; unused by dq)

        @cute.struct
        class SharedStorage:
            mbar_r: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_s1: cute.struct.MemRange[cutlass.Int64, 2 * self.stream_stages]
            mbar_s2: cute.struct.MemRange[cutlass.Int64, 2 * self.other_stages]
            mbar_lse: cute.struct.MemRange[cutlass.Int64, 2 * self.stream_stages]
            mbar_sig: cute.struct.MemRange[cutlass.Int64, 5]
            tmem_holding_buf: Int32
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, stat_rows], 16]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, stat_rows], 16]
            sR1: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sR1_l)], 1024]
            sR2: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sR2_l)], 1024]
            sS1: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sS1_l)], 1024]
            sS2: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sS2_l)], 1024]

        grid = (cute.ceil_div(mR1.shape[0], rows) * self.cfg.col_splits, mQ.shape[2],
                mQ.shape[3])
        if const_expr(self.cfg.varlen):  # col_splits CTAs per (work row, query head)
            grid = (mWork.shape[0] * self.cfg.col_splits, mQ.shape[2], 1)
        self.kernel(
            tma_R1, tma_R2, tma_S1, tma_S2, mQ, mK, mOut0, mOut1, mLSE, mDelta, mParams,
            tma_atom_R1, tma_atom_R2, tma_atom_S1, tma_atom_S2,
            sR1_l, sR2_l, sS1_l, sS2_l, sS1t_l, sS2t_l, tA_l, x_mma, y_mma, ts_mma, ts2_mma,
            SharedStorage, mCuSeqlensQ if const_expr(not self.dkdv) else mCuSeqlensK, mWork,
        ).launch(grid=grid, block=[self.cfg.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=1)

    # ---------------------------------------------------------------------------------------------
    # Device side
    # ---------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mR1: cute.Tensor, mR2: cute.Tensor, mS1: cute.Tensor, mS2: cute.Tensor,
               mQ: cute.Tensor, mK: cute.Tensor, mOut0: cute.Tensor, mOut1: cute.Tensor | None,
               mLSE: cute.Tensor, mDelta: cute.Tensor, mParams: cute.Tensor,
               tma_atom_R1: cute.CopyAtom, tma_atom_R2: cute.CopyAtom,
               tma_atom_S1: cute.CopyAtom, tma_atom_S2: cute.CopyAtom,
               sR1_l: cute.ComposedLayout, sR2_l: cute.ComposedLayout,
               sS1_l: cute.ComposedLayout, sS2_l: cute.ComposedLayout,
               sS1t_l: cute.ComposedLayout, sS2t_l: cute.ComposedLayout,
               tA_l: cute.ComposedLayout, x_mma: cute.TiledMma, y_mma: cute.TiledMma,
               ts_mma: cute.TiledMma, ts2_mma: cute.TiledMma,
               SharedStorage: cutlass.Constexpr, mCuSeqlensOut: cute.Tensor | None,
               mWork: cute.Tensor | None):
        """One CTA: barriers and pipelines, the block range of its resident block, then the
        warp roles (module doc). Varlen: its work row's sequence, block, offsets and lengths;
        ``mCuSeqlensOut`` the boundaries of the outputs' sequences (the ZERO_PADDING row's)."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == LOAD_WARP:
            for atom in (tma_atom_R1, tma_atom_R2, tma_atom_S1, tma_atom_S2):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)

        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        num_compute = 32 * len(COMPUTE_WARPS)
        pipeline_r = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.mbar_r.data_ptr(), num_stages=1, producer_group=one_thread,
            consumer_group=one_thread, tx_count=self.tx_bytes_r, defer_sync=True)
        pipeline_s1 = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.mbar_s1.data_ptr(), num_stages=self.stream_stages,
            producer_group=one_thread, consumer_group=one_thread, tx_count=self.tx_bytes_s1,
            defer_sync=True)
        pipeline_s2 = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.mbar_s2.data_ptr(), num_stages=self.other_stages,
            producer_group=one_thread, consumer_group=one_thread, tx_count=self.tx_bytes_s2,
            defer_sync=True)
        pipeline_lse = pipeline.PipelineAsync.create(
            barrier_storage=storage.mbar_lse.data_ptr(), num_stages=self.stream_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_compute),
            defer_sync=True)
        sig = storage.mbar_sig.data_ptr()
        s_full, p_full, dp_full, ds_full, acc_full = sig, sig + 1, sig + 2, sig + 3, sig + 4
        if warp_idx == 0:
            with cute.arch.elect_one():
                for bar, count in ((s_full, 1), (p_full, num_compute), (dp_full, 1),
                                   (ds_full, num_compute), (acc_full, 1)):
                    cute.arch.mbarrier_init(bar, count)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        tmem_users = num_compute + 32
        tmem = utils.TmemAllocator(
            storage.tmem_holding_buf.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=TMEM_ALLOC_BARRIER,
                                                       num_threads=tmem_users),
            allocator_warp_id=MMA_WARP)
        dealloc_barrier = pipeline.NamedBarrier(barrier_id=TMEM_DEALLOC_BARRIER,
                                                num_threads=tmem_users)

        x, head, batch = cute.arch.block_idx()
        block, col_half = x // self.cfg.col_splits, x % self.cfg.col_splits
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        # varlen: the sequence's first rows in the packed q / k and its lengths from work row
        # `block` (dq: its columns 2-5 hold k's before q's, module doc of bwd_split_config)
        seq, q_off, k_off = None, None, None
        if const_expr(self.cfg.varlen):
            row = block
            batch = Int32(0)
            seq, block = mWork[row, 0], mWork[row, 1]
            if const_expr(self.dkdv):
                q_off, k_off, seqlen_q, seqlen_k = (mWork[row, 2], mWork[row, 3],
                                                    mWork[row, 4], mWork[row, 5])
            else:
                k_off, q_off, seqlen_k, seqlen_q = (mWork[row, 2], mWork[row, 3],
                                                    mWork[row, 4], mWork[row, 5])
        window_left, window_right = resolve_windows(mParams, seqlen_q, seqlen_k, self.is_local)
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        if const_expr(self.dkdv):
            blocks = BwdBlocks(self.cols, self.rows, self.is_causal, self.is_local, seqlen_q,
                               seqlen_k, window_left, window_right)
            s_min, s_max = blocks.m_block_range(block)
        else:
            blocks = FwdBlocks(self.rows, self.cols, self.is_causal, self.is_local, seqlen_q,
                               seqlen_k, window_left, window_right)
            s_min, s_max = blocks.n_block_range(block)
        count = cutlass.max(s_max - s_min, 0)

        if warp_idx < MMA_WARP:  # compute warps
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.compute_warps(mOut0, mOut1, mLSE, mDelta, mParams, storage, x_mma, tmem_ptr,
                               pipeline_lse, s_full, p_full, dp_full, ds_full, acc_full, head,
                               head_kv, batch, block, col_half, s_min, count, blocks, tidx,
                               warp_idx, q_off, k_off)
            cute.arch.fence_view_async_tmem_load()
            dealloc_barrier.arrive_and_wait()
            if const_expr(self.cfg.varlen):
                if seq == ZERO_PADDING and col_half == 0:  # (count = 0: no barrier touched)
                    head_out = head if const_expr(self.gqa or not self.dkdv) else head_kv
                    for mX in (mOut0, mOut1) if const_expr(self.dkdv) else (mOut0,):
                        zero_padding_rows(mX, mCuSeqlensOut, head_out, (self.rows, self.hdim),
                                          len(COMPUTE_WARPS) * 32, tidx, Int32(0), Int32(1))
        if warp_idx == LOAD_WARP:
            self.load_warp_split(mR1, mR2, mS1, mS2, mLSE, mDelta, storage, sR1_l, sR2_l, sS1_l,
                                 sS2_l, tma_atom_R1, tma_atom_R2, tma_atom_S1, tma_atom_S2,
                                 x_mma, y_mma, pipeline_r, pipeline_s1, pipeline_s2,
                                 pipeline_lse, head, head_kv, batch, block, s_min, count,
                                 seqlen_q, tidx, q_off, k_off)
        if warp_idx == MMA_WARP:
            tmem.allocate(self.tmem_alloc_cols)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            tmem.relinquish_alloc_permit()
            self.mma_warp_split(storage, sR1_l, sR2_l, sS1_l, sS2_l, sS1t_l, sS2t_l, tA_l,
                                x_mma, y_mma, ts_mma, ts2_mma, tmem_ptr, pipeline_r,
                                pipeline_s1, pipeline_s2, s_full, p_full, dp_full, ds_full,
                                acc_full, col_half, count)
            dealloc_barrier.arrive_and_wait()
            tmem.free(tmem_ptr)

    # --- load warp ---------------------------------------------------------------------------
    @cute.jit
    def load_warp_split(self, mR1, mR2, mS1, mS2, mLSE, mDelta, storage, sR1_l, sR2_l, sS1_l,
                        sS2_l, tma_atom_R1, tma_atom_R2, tma_atom_S1, tma_atom_S2,
                        x_mma: cute.TiledMma, y_mma: cute.TiledMma, pipeline_r, pipeline_s1,
                        pipeline_s2, pipeline_lse, head: Int32, head_kv: Int32, batch: Int32,
                        block: Int32, s_min: Int32, count: Int32, seqlen_q: Int32,
                        tidx: Int32, q_off: Int32 | None = None, k_off: Int32 | None = None):
        """The resident pair once, then S1, S2 (TMA) and, dkdv, -lse / -delta of each visited
        streamed block (varlen: TMA views from the sequence's first rows)."""
        D, Dv, rows, cols = self.hdim, self.hdimv, self.rows, self.cols
        head_r, head_s = (head_kv, head) if const_expr(self.dkdv) else (head, head_kv)
        r_off, s_off = (k_off, q_off) if const_expr(self.dkdv) else (q_off, k_off)
        x_thr, y_thr = x_mma.get_slice(0), y_mma.get_slice(0)
        one = cute.make_layout(1)
        sR1 = storage.sR1.get_tensor(sR1_l.outer, swizzle=sR1_l.inner)
        sR2 = storage.sR2.get_tensor(sR2_l.outer, swizzle=sR2_l.inner)
        sS1 = storage.sS1.get_tensor(sS1_l.outer, swizzle=sS1_l.inner)
        sS2 = storage.sS2.get_tensor(sS2_l.outer, swizzle=sS2_l.inner)
        sLSE = storage.sLSE.get_tensor(cute.make_layout((cols, self.stream_stages)))
        sDelta = storage.sDelta.get_tensor(cute.make_layout((cols, self.stream_stages)))
        gR1 = cute.local_tile(sequence(mR1, head_r, batch, r_off), (rows, D), (block, 0))
        gR2 = cute.local_tile(sequence(mR2, head_r, batch, r_off), (rows, Dv), (block, 0))
        gS1 = cute.local_tile(sequence(mS1, head_s, batch, s_off), (cols, D), (None, 0))
        gS2 = cute.local_tile(sequence(mS2, head_s, batch, s_off), (cols, Dv), (None, 0))
        tR1s, tR1g = cpasync.tma_partition(tma_atom_R1, 0, one, cute.group_modes(sR1, 0, 3),
                                           cute.group_modes(x_thr.partition_A(gR1), 0, 3))
        tR2s, tR2g = cpasync.tma_partition(tma_atom_R2, 0, one, cute.group_modes(sR2, 0, 3),
                                           cute.group_modes(y_thr.partition_A(gR2), 0, 3))
        tS1s, tS1g = cpasync.tma_partition(tma_atom_S1, 0, one, cute.group_modes(sS1, 0, 3),
                                           cute.group_modes(x_thr.partition_B(gS1), 0, 3))
        tS2s, tS2g = cpasync.tma_partition(tma_atom_S2, 0, one, cute.group_modes(sS2, 0, 3),
                                           cute.group_modes(y_thr.partition_B(gS2), 0, 3))
        s1_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                self.stream_stages)
        s2_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                self.other_stages)
        # (the whole warp calls the TMA pipeline / copy ops: they elect one thread inside)
        if count > 0:
            r_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipeline_r.producer_acquire(r_state)
            cute.copy(tma_atom_R1, tR1g, tR1s[None, 0],
                      tma_bar_ptr=pipeline_r.producer_get_barrier(r_state))
            cute.copy(tma_atom_R2, tR2g, tR2s[None, 0],
                      tma_bar_ptr=pipeline_r.producer_get_barrier(r_state))
        for j in cutlass.range(count, unroll=1):
            s_block = s_min + j
            self.tma_load(pipeline_s1, s1_state, tma_atom_S1, tS1g[None, s_block], tS1s)
            self.tma_load(pipeline_s2, s2_state, tma_atom_S2, tS2g[None, s_block], tS2s)
            if const_expr(self.dkdv):  # the stats stage follows the S1 (Q) stage
                self.stage_stats(mLSE, mDelta, sLSE, sDelta, pipeline_lse, s1_state, s_block,
                                 head, batch, seqlen_q, tidx % 32, q_off)
            s1_state.advance()
            s2_state.advance()

    # --- MMA warp ----------------------------------------------------------------------------
    @cute.jit
    def ts_gemm(self, acc: cute.Tensor, a_lo: cute.Tensor, a_hi: cute.Tensor, b: cute.Tensor,
                n_tile: Int32, stage: Int32, mma: cute.TiledMma, accumulate):
        """acc (+)= A·B[n_tile, stage] for a 16-bit TMEM A operand whose two warpgroups' halves
        sit in two views (gemm_ts_halves, with B's N tile chosen at run time)."""
        num_kb = cute.size(a_lo, mode=[2])
        acc_v = acc[None, 0, 0]  # one MMA tile: (MMA) views of acc, A and B
        for k in cutlass.range_constexpr(num_kb):
            mma.set(tcgen05.Field.ACCUMULATE, accumulate or k > 0)
            a = a_lo if const_expr(k < num_kb // 2) else a_hi
            cute.gemm(mma, acc_v, a[None, 0, k], b[None, n_tile, k, stage], acc_v)

    @cute.jit
    def ss_gemm(self, mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor,
                stage: Int32, full):
        """acc = A·B[stage] (the resident A, one stage), then a commit to ``full``."""
        for k in cutlass.range_constexpr(cute.size(a, mode=[2])):
            mma.set(tcgen05.Field.ACCUMULATE, k > 0)
            cute.gemm(mma, acc, a[None, None, k, 0], b[None, None, k, stage], acc)
        with cute.arch.elect_one():
            tcgen05.commit(full)

    @cute.jit
    def mma_warp_split(self, storage, sR1_l, sR2_l, sS1_l, sS2_l, sS1t_l, sS2t_l, tA_l,
                       x_mma: cute.TiledMma, y_mma: cute.TiledMma, ts_mma: cute.TiledMma,
                       ts2_mma: cute.TiledMma, tmem_ptr, pipeline_r, pipeline_s1, pipeline_s2,
                       s_full, p_full, dp_full, ds_full, acc_full, col_half: Int32,
                       count: Int32):
        """The MMA warp: GEMM1, the TS GEMM of the previous dS, GEMM2 and (dkdv) the dV GEMM
        of each iteration, in the module doc's order; then the commit to acc_full."""
        rows, cols, o = self.rows, self.cols, self.out_cols
        dt = self.dtype

        def view(buf, layout):
            return cute.make_tensor(cute.recast_ptr(buf.data_ptr(), layout.inner, dtype=dt),
                                    layout.outer)

        x_thr, y_thr, ts_thr = x_mma.get_slice(0), y_mma.get_slice(0), ts_mma.get_slice(0)
        tXrR1 = x_thr.make_fragment_A(view(storage.sR1, sR1_l))
        tXrS1 = x_thr.make_fragment_B(view(storage.sS1, sS1_l))
        tYrR2 = y_thr.make_fragment_A(view(storage.sR2, sR2_l))
        tYrS2 = y_thr.make_fragment_B(view(storage.sS2, sS2_l))
        tTrS1t = ts_thr.make_fragment_B(view(storage.sS1, sS1t_l))  # (MMA, N tiles, K, stage)
        tTrS2t = ts_thr.make_fragment_B(view(storage.sS2, sS2t_l))

        def acc(thr, shape, offset):
            fake = thr.make_fragment_C(thr.partition_shape_C(shape))
            return cute.make_tensor(tmem_ptr + offset, fake.layout)

        tXtX = acc(x_thr, (rows, cols), self.tmem_s)
        tYtY = acc(y_thr, (rows, cols), self.tmem_dp)
        tAcc = [acc(ts_thr, (rows, o), off) for off in self.tmem_acc]

        # 16-bit A operands in TMEM: warpgroup w's columns [32w, 32w + 16) of X (Pᵀ) or Y (dS)
        tA_fake = ts_thr.make_fragment_A(cute.make_tensor(tmem_ptr, tA_l.outer))[
            None, None, None, 0]

        def tmem_a(base):
            return [cute.make_tensor(cute.recast_ptr(tmem_ptr + base + off,
                                                     dtype=tA_fake.element_type), tA_fake.layout)
                    for off in (0, self.cols_per_wg // 2)]

        tP = tmem_a(self.tmem_s)
        tdS = tmem_a(self.tmem_dp)
        n_ds = col_half if const_expr(self.dkdv) else Int32(0)

        s1_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                self.stream_stages)
        s1_release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                  self.stream_stages)
        s2_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                self.other_stages)
        if count > 0:
            r_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipeline_r.consumer_wait(r_state)
        for j in cutlass.range(count + 1, unroll=1):
            if j < count:
                # GEMM1_j: Sᵀ = K·Q_jᵀ (dkdv) / S = Q·K_jᵀ (dq)
                pipeline_s1.consumer_wait(s1_state)
                self.ss_gemm(x_mma, tXtX, tXrR1, tXrS1, s1_state.index, s_full)
                s1_state.advance()
            if j > 0:
                # dS_{j-1} in TMEM (Y_{j-1} read): dK_c += dSᵀ·Q_{j-1}[:, c] / dQ += dS·K_{j-1}
                cute.arch.mbarrier_wait(ds_full, (j - 1) % 2)
                self.ts_gemm(tAcc[0], tdS[0], tdS[1], tTrS1t, n_ds, s1_release.index, ts_mma,
                             j > 1)
                pipeline_s1.consumer_release(s1_release)
                s1_release.advance()
            if j < count:
                # GEMM2_j: dPᵀ = V·dO_jᵀ (dkdv) / dP = dO·V_jᵀ (dq)
                pipeline_s2.consumer_wait(s2_state)
                self.ss_gemm(y_mma, tYtY, tYrR2, tYrS2, s2_state.index, dp_full)
                cute.arch.mbarrier_wait(p_full, j % 2)
                if const_expr(self.dkdv):
                    # dV_c += Pᵀ_j·dO_j[:, c]
                    self.ts_gemm(tAcc[1], tP[0], tP[1], tTrS2t, col_half, s2_state.index,
                                 ts2_mma, j > 0)
                pipeline_s2.consumer_release(s2_state)
                s2_state.advance()
        if count > 0:
            with cute.arch.elect_one():
                tcgen05.commit(acc_full)

    # --- compute warps -----------------------------------------------------------------------
    @cute.jit
    def compute_warps(self, mOut0, mOut1, mLSE, mDelta, mParams, storage, x_mma: cute.TiledMma,
                      tmem_ptr, pipeline_lse, s_full, p_full, dp_full, ds_full, acc_full,
                      head: Int32, head_kv: Int32, batch: Int32, block: Int32, col_half: Int32,
                      s_min: Int32, count: Int32, blocks, tidx: Int32, warp_idx: Int32,
                      q_off: Int32 | None = None, k_off: Int32 | None = None):
        """The compute warps: P and dS of each iteration (16-bit Pᵀ / dS into TMEM), then the
        epilogue (store_acc of each accumulator)."""
        rows, cols, cw = self.rows, self.cols, self.cols_per_wg
        wg = warp_idx // 4  # 0 or 1: streamed columns [cw·wg, cw·wg + cw)
        lane_row = tidx % 128  # this thread's resident row (TMEM lane)
        x_thr = x_mma.get_slice(0)
        acc_layout = x_thr.make_fragment_C(x_thr.partition_shape_C((rows, cols))).layout
        scale = mParams[PARAM_SCALE]
        scale_log2, tanh_in_scale, inv_scale_log2 = self.softmax_scales(mParams)
        row = block * rows + lane_row  # key (dkdv) or query row (dq)
        sLSE = storage.sLSE.get_tensor(cute.make_layout((cols, self.stream_stages)))
        sDelta = storage.sDelta.get_tensor(cute.make_layout((cols, self.stream_stages)))
        lse_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                 self.stream_stages)
        neg_lse, neg_delta = Float32(0.0), Float32(0.0)
        if const_expr(not self.dkdv):  # dq: this thread's query row's statistics
            # (clamped to row 0 too: a varlen spare row has seqlen_q = 0 and reads before its
            # loop, whatever it then selects)
            row_c = cutlass.max(cutlass.min(row, blocks.seqlen_q - 1), 0)
            if const_expr(q_off is not None):
                row_c = row_c + q_off
            neg_lse = -mLSE[row_c, head, batch] if row < blocks.seqlen_q else -Float32.inf
            neg_delta = -mDelta[row_c, head, batch] if row < blocks.seqlen_q else Float32(0.0)
        for j in cutlass.range(count, unroll=1):
            s_block = s_min + j
            if const_expr(self.dkdv):
                pipeline_lse.consumer_wait(lse_state)
            # ---- P = exp2(S·scale_log2 − lse) ----
            cute.arch.mbarrier_wait(s_full, j % 2)
            rP = cute.make_rmem_tensor((cw,), Float32)
            self.load_wg_cols(rP, tmem_ptr, acc_layout, self.tmem_s, wg, lane_row, 0, cw)
            rT = cute.make_rmem_tensor((cw,), Float32)  # dq softcap: tanh values
            if const_expr(self.dkdv):
                self.softmax_p(rP, tmem_ptr, acc_layout, blocks, s_block, block, row, wg,
                               lane_row, scale_log2, tanh_in_scale, sLSE, lse_state.index)
                self.store_16bit(rP, tmem_ptr, acc_layout, self.tmem_s, wg, lane_row)
                cute.arch.fence_view_async_tmem_store()
            else:
                self.softmax_p_rows(rP, rT, blocks, row, s_block, wg, scale_log2,
                                    tanh_in_scale, neg_lse)
            cute.arch.mbarrier_arrive(p_full)
            # ---- dS = P∘(dP − delta) [∘ (1 − t²)] ----
            cute.arch.mbarrier_wait(dp_full, j % 2)
            rdS = cute.make_rmem_tensor((cw,), self.dtype)
            if const_expr(self.dkdv):
                self.softmax_ds(rdS, rP, tmem_ptr, acc_layout, wg, lane_row, inv_scale_log2,
                                sLSE, sDelta, lse_state.index)
                pipeline_lse.consumer_release(lse_state)
                lse_state.advance()
            else:
                self.softmax_ds_rows(rdS, rP, rT, tmem_ptr, acc_layout, wg, lane_row,
                                     neg_delta)
            self.store_16bit(rdS, tmem_ptr, acc_layout, self.tmem_dp, wg, lane_row)
            cute.arch.fence_view_async_tmem_store()
            cute.arch.mbarrier_arrive(ds_full)

        # ---- epilogue ----
        if count > 0:
            cute.arch.mbarrier_wait(acc_full, 0)
        head_out = head if const_expr(self.gqa or not self.dkdv) else head_kv
        # the outputs' rows: the resident block's, below its sequence's length
        out_off, seqlen = (k_off, blocks.seqlen_k) if const_expr(self.dkdv) else (
            q_off, blocks.seqlen_q)
        if const_expr(self.dkdv):
            self.store_acc(mOut1, tmem_ptr, acc_layout, self.tmem_acc[1], None, head_out, batch,
                           block, col_half, count, row, lane_row, wg, out_off, seqlen)
        self.store_acc(mOut0, tmem_ptr, acc_layout, self.tmem_acc[0], scale, head_out, batch,
                       block, col_half, count, row, lane_row, wg, out_off, seqlen)

    @cute.jit
    def softmax_p_rows(self, rP: cute.Tensor, rT: cute.Tensor, blocks: FwdBlocks, row: Int32,
                       n_block: Int32, wg: Int32, scale_log2: Float32, tanh_in_scale: Float32,
                       neg_lse: Float32):
        """dq: rP (S of this thread's query row, the warpgroup's cw key columns) → P: [softcap
        (tanh values kept in rT),] masked (keys past seqlen_k, causal / window bounds), exp2."""
        cw = self.cols_per_wg
        lo, hi = Band.visible_cols(blocks, row, n_block)
        lo = lo - cw * wg
        hi = hi - cw * wg
        if const_expr(self.has_softcap):
            for i in cutlass.range_constexpr(cw):
                rT[i] = cute.math.tanh(rP[i] * tanh_in_scale, fastmath=True)
                rP[i] = rT[i]
        for i in cutlass.range_constexpr(cw):
            visible = i < hi
            if const_expr(self.is_local):
                visible = visible and i >= lo
            rP[i] = rP[i] if visible else -Float32.inf
        for i in cutlass.range_constexpr(0, cw, 2):
            rP[i], rP[i + 1] = cute.arch.fma_packed_f32x2(
                (rP[i], rP[i + 1]), (scale_log2, scale_log2), (neg_lse, neg_lse))
            rP[i] = cute.math.exp2(rP[i], fastmath=True)
            rP[i + 1] = cute.math.exp2(rP[i + 1], fastmath=True)

    @cute.jit
    def softmax_ds_rows(self, rdS: cute.Tensor, rP: cute.Tensor, rT: cute.Tensor, tmem_ptr,
                        acc_layout, wg: Int32, lane_row: Int32, neg_delta: Float32):
        """dq: rdS (16-bit) = P∘(dP − delta) [∘ (1 − t²)] for the warpgroup's cw key columns."""
        cw = self.cols_per_wg
        rdP = cute.make_rmem_tensor((cw,), Float32)
        self.load_wg_cols(rdP, tmem_ptr, acc_layout, self.tmem_dp, wg, lane_row, 0, cw)
        for i in cutlass.range_constexpr(0, cw, 2):
            rdP[i], rdP[i + 1] = cute.arch.add_packed_f32x2((rdP[i], rdP[i + 1]),
                                                            (neg_delta, neg_delta))
            rdP[i], rdP[i + 1] = cute.arch.mul_packed_f32x2((rdP[i], rdP[i + 1]),
                                                            (rP[i], rP[i + 1]))
        if const_expr(self.has_softcap):
            for i in cutlass.range_constexpr(cw):
                # P below the smallest normal float (masked, empty row): dS = 0 (as bwd.py)
                t = rT[i]
                rdP[i] = rdP[i] * (Float32(1.0) - t * t) if rP[i] >= Float32(_FLT_MIN_NORMAL) \
                    else Float32(0.0)
        rdS_i = cute.recast_tensor(rdS, Int32)
        for i in cutlass.range_constexpr(cw // 2):
            rdS_i[i] = cvt_pack_f32x2(rdP[2 * i], rdP[2 * i + 1], self.is_bf16)

    @cute.jit
    def store_acc(self, mX: cute.Tensor, tmem_ptr, acc_layout, base: int, scale, head: Int32,
                  batch: Int32, block: Int32, col_half: Int32, count: Int32, row: Int32,
                  lane_row: Int32, wg: Int32, out_off: Int32 | None, seqlen: Int32):
        """The accumulator at TMEM column ``base`` (out_cols columns; times ``scale`` unless
        None) → this thread's row of mX, columns [col_half·out_cols, +out_cols): warpgroup w the
        half [w·out_cols/2, +out_cols/2), in 16-column chunks; zeros when count = 0; rows past
        ``seqlen`` skipped (varlen: the sequence's rows from ``out_off`` on)."""
        o, ch = self.out_cols, self.epi_chunk
        half = o // 2
        out_type = Float32 if const_expr(self.gqa) else self.dtype
        ld = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(ch)), Float32),
            tmem_cols(tmem_ptr, acc_layout, 0, ch))
        thr_ld = ld.get_slice(lane_row)
        tTc = thr_ld.partition_D(cute.make_identity_tensor((128, ch)))
        gRow = cute.local_tile(sequence(mX, head, batch, out_off), (self.rows, o),
                               (block, col_half))[lane_row, None]
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
                if const_expr(scale is not None):
                    for i in cutlass.range_constexpr(ch):
                        r[i] = r[i] * scale
            else:
                r.fill(0.0)  # a resident block that sees nothing: zero gradients
            r_out = cute.make_rmem_tensor((ch,), out_type)
            if const_expr(self.gqa):
                for i in cutlass.range_constexpr(ch):
                    r_out[i] = r[i]
            else:
                r_out_i = cute.recast_tensor(r_out, Int32)
                for i in cutlass.range_constexpr(ch // 2):
                    r_out_i[i] = cvt_pack_f32x2(r[2 * i], r[2 * i + 1], self.is_bf16)
            if row < seqlen:
                cute.autovec_copy(r_out, cute.local_tile(gRow, (ch,), (wg * (half // ch) + c,)))


def make_launcher(cfg: Sm100BwdSplitConfig):
    """The `@cute.jit` launcher: ``fn(stream, q, k, v, dout, lse_log2, delta, params, dk, dv)``
    (part "dkdv") or ``fn(stream, q, k, v, dout, lse_log2, delta, params, dq)`` (part "dq");
    varlen configs take ``cu_seqlens_q, cu_seqlens_k, work`` after params
    (bwd_split_config.split_varlen_backward_signature)."""
    kernel = FlashAttentionBackwardSm100Split(cfg)

    if cfg.varlen and cfg.part == "dkdv":
        @cute.jit
        def sm100_bwd_dkdv_varlen(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                                  v: cute.Tensor, dout: cute.Tensor, lse_log2: cute.Tensor,
                                  delta: cute.Tensor, params: cute.Tensor,
                                  cu_seqlens_q: cute.Tensor, cu_seqlens_k: cute.Tensor,
                                  work: cute.Tensor, dk: cute.Tensor, dv: cute.Tensor):
            kernel(stream, q, k, v, dout, lse_log2, delta, params, dk, dv, cu_seqlens_q,
                   cu_seqlens_k, work)

        return sm100_bwd_dkdv_varlen

    if cfg.varlen:
        @cute.jit
        def sm100_bwd_dq_varlen(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                                v: cute.Tensor, dout: cute.Tensor, lse_log2: cute.Tensor,
                                delta: cute.Tensor, params: cute.Tensor,
                                cu_seqlens_q: cute.Tensor, cu_seqlens_k: cute.Tensor,
                                work: cute.Tensor, dq: cute.Tensor):
            kernel(stream, q, k, v, dout, lse_log2, delta, params, dq, None, cu_seqlens_q,
                   cu_seqlens_k, work)

        return sm100_bwd_dq_varlen

    if cfg.part == "dkdv":
        @cute.jit
        def sm100_bwd_dkdv(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                           v: cute.Tensor, dout: cute.Tensor, lse_log2: cute.Tensor,
                           delta: cute.Tensor, params: cute.Tensor, dk: cute.Tensor,
                           dv: cute.Tensor):
            kernel(stream, q, k, v, dout, lse_log2, delta, params, dk, dv)

        return sm100_bwd_dkdv

    @cute.jit
    def sm100_bwd_dq(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
                     dout: cute.Tensor, lse_log2: cute.Tensor, delta: cute.Tensor,
                     params: cute.Tensor, dq: cute.Tensor):
        kernel(stream, q, k, v, dout, lse_log2, delta, params, dq)

    return sm100_bwd_dq
