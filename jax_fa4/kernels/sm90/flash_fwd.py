"""FlashAttention forward for Hopper (sm_90a), written in CuTe-DSL.

Features: bf16/fp16, head dims from fwd_tuning.TUNING_TABLE (64, 96, 128, 192 with dv 128 or 192,
256), dynamic batch / sequence lengths / head counts (one compile serves all), GQA/MQA (q head h
reads kv head h // (H // Hkv)), key-length tail mask, bottom-right aligned causal and sliding
window masks with key-block skipping (only boundary blocks are masked), softcap, lse output,
learnable sinks (``params`` of length 4 + H carries one logit per query head: each row's softmax
starts from it, OnlineSoftmax.reset_with_sink, so the output is rounded once).

Structure (one CTA = one tile of tile_m query rows of one (batch, head); not persistent):
  * warpgroup 0 = producer. It gives registers back (setmaxnreg); its warp 0 issues the TMA loads:
    Q once, then K[n], V[n] for the visited key blocks, highest n first, through mbarrier
    pipelines (PipelineTmaAsync: Q one stage, K and V `stages` stages each; FP8: its four warps
    also transpose V, see below).
  * warpgroups 1..W = consumers, 64 query rows each (tile_m = 64·W). Per key block:
      S = Q·Kᵀ (WGMMA, both operands in shared memory) → [softcap] → [mask] → online softmax
      (exp2 with scale·log2 e folded into one FFMA) → P converted to 16 bits in registers →
      O = O·rescale + P·V (WGMMA with P as the register A operand).
  * epilogue: O /= Σ, converted, written with stmatrix into Q's shared memory (Q is dead by then),
    fenced, then TMA-stored by one warp (rows past seqlen_q are clipped by TMA); lse is written
    from registers by the threads owning accumulator column 0.

Tuning options (FwdConfig; the v1 defaults leave them off and generate v1's exact SASS):
  * intra_wg_overlap (default on): S_j and P_{j-1}·V_{j-1} issued back to back, softmax of S_j
    while the PV GEMM runs;
  * pingpong: named barriers make the consumer warpgroups issue their GEMMs in turn (2- or 3-way),
    so one warpgroup's softmax runs under the others' GEMMs;
  * tile_m = 192: 3 consumer warpgroups (registers 160 / 32 after setmaxnreg);
  * rescale_threshold: FA4's conditional O rescaling (common/softmax.py);
  * num_sms: persistent grid of that many CTAs walking the tiles (common/tile_scheduler.py);
    O is staged in a buffer of its own where it fits (FwdConfig.own_o_buffer; run_persistent);
    dynamic_tiles: the CTAs claim their tiles from a zeroed global counter (run_persistent).

Paged KV (FwdConfig.paged, not persistent): K and V are a cache of tiles viewed as one batch entry
(1, tiles·tile_n, Hkv, ·); key block n of batch entry b is the cache tile page_table[b, n], read
by the producer warp one block ahead of its load (V reuses K's entry), and batch entry b has
seqused_k[b] keys, clamped to [0, the table row's keys] (the key-length tail mask and the
causal/window alignment use that length).

Segment ids (FwdConfig.segments, one tile per CTA or persistent): three tables from
jax_fa4/segments.py: per query tile its key-block range and unmasked bulk (the range is
intersected with the mask's, tile_blocks; the blocks outside the bulk are masked), per row its
key span [start, end) and id (a per-row window, AttentionMask.apply), and the keys' ids,
compared key by key only in tiles flagged as holding an id that is not one contiguous run.

Varlen (FwdConfig.varlen, not persistent): q, k, v, out are packed sequences viewed as one batch
entry (1, total, H, ·); CTA (m, h, b) reads sequence b's rows [cu_seqlens[b], cu_seqlens[b + 1])
through TMA from that offset (rows past the sequence are loaded but masked as the key tail, or
never stored), a tile past the sequence's end does nothing, and O is TMA-stored for a tile
inside the sequence, row by row below seqlen_q (16-byte pieces from the shared-memory tile) for
its last, partial tile, where a TMA store would overwrite the next sequence. lse is
(batch, H, max_seqlen_q): its shape sets the grid, plus one batch slice whose CTAs write 0 to
the packed rows outside every sequence (zero_padding_rows).

Padding isolation (varlen and paged): in the highest key block, the rows of V's stage past the
keys (the next sequence, padding tokens, a page's unused slots) are zeroed before the P·V GEMM
reads them (zero_v_rows_past_keys, common/rows.py): P is 0 there, but 0·NaN is not. FP8 clears
them in the producer's transpose instead: each lane knows which keys its bytes hold, and ANDs
the words of the keys past the sequence with a byte mask before stmatrix (transpose_tail;
v_transpose.VTransposer.stage's keys_left), with no shared-memory pass or barrier.

FP8 (FwdConfig.dtype "float8_e4m3fn", docs/fp8.md): e4m3 q, k and v, as the 16-bit kernel takes
them; descale (B, Hkv, 2) folds q·k's into the softmax scale and v's into each row's 1/Σ; O is
bfloat16, staged in Q's buffer (sized for it), or float32 from the accumulators (out_f32, as the
16-bit decode tiles). Dense, decode (head-major), paged (head-major) and varlen calls (not segment
ids, max logits, persistent or two CTAs per SM), overlapped mainloop, exact row max only
(fwd_config.FwdConfig.validate_fp8); paged: warp 0 reads each block's page-table entries as it
issues the block's loads (load_kv_fp8), varlen: the 16-bit kernel's sequence offsets and epilogue,
the descale row of the padding rows' batch slice clamped to the last sequence's. e4m3 WGMMAs read
both operands K-major, and P (convert_p_e4m3) holds each group of 32 keys in a permuted order (the
accumulator's values packed as they lie), so V's operand is (Dv, tile_n), keys contiguous, column l
of each group of 32 holding key fwd_config.fp8_value_permutation()[l]. V gets there in the kernel:
warp 0 TMA-loads each V block as stored into a staging buffer (FwdConfig.v_staging_stages stages, a
PipelineTmaAsync whose consumers are the producer warps), and all four producer warps transpose it
into sV with ldmatrix.trans / prmt / stmatrix (v_transpose.py; its lane addresses and their bank-
conflict freedom: v_transpose_plan.py), fence the writes for the WGMMA's async proxy and arrive on
sV's full barrier (a PipelineAsync whose consumers, every consumer thread, release it as for 16-bit
V). With two staging stages a block is transposed after the next one's load is issued, with one
(head dim 256) after its own. Keys past seqlen_k read zeros (TMA fills rows out of bounds) and are
masked in S, so P·V adds 0 there: no padding of the key count.

Decode shapes reach this kernel rewritten by jax_fa4/backends/decode.py (GQA packing, split-KV),
in the decode tile's configs (fwd_config.decode_config / paged_config, and FP8's
fp8_decode_config / fp8_paged_config): 64 rows, often two CTAs per SM
(ctas_per_sm), and q / out head-major, (B, H, S, D) (qo_head_major: one query token's packed
rows are then a free reshape of the caller's q and out). Split-KV chunks take out_f32: O is
stored in float32 straight from the accumulators (8-byte stores, rows below seqlen_q), so the
merge of the splits rounds to 16 bits once.
"""

from __future__ import annotations

import enum

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

from jax_fa4.kernels.common.convert import convert_f32_pairs, convert_p_e4m3
from jax_fa4.kernels.common.geometry import (FwdBlocks, paged_keys, resolve_windows,
                                             varlen_sequence)
from jax_fa4.kernels.common.layout import (acc_view_as_a_operand, acc_view_mn, select_modes,
                                           transpose_mn)
from jax_fa4.kernels.common.mask import AttentionMask
from jax_fa4.kernels.common.rows import store_rows, zero_padding_rows, zero_rows_from
from jax_fa4.kernels.common.scores import score_scales
from jax_fa4.kernels.common.softmax import OnlineSoftmax, rescale_rows, rescale_rows_if_needed
from jax_fa4.kernels.common.tile_scheduler import PersistentTileScheduler, SingleTileScheduler
from jax_fa4.kernels.common.views import seq_major, sequence
from jax_fa4.kernels.segments_config import (SEG_BULK_HI, SEG_BULK_LO, SEG_IDS, SEG_N_HI,
                                            SEG_N_LO, SEG_ROW_END, SEG_ROW_ID, SEG_ROW_START)
from jax_fa4.kernels.sm90.common import make_smem_layout, wgmma
from jax_fa4.kernels.sm90.fwd_config import FP8_DTYPE, FwdConfig
from jax_fa4.kernels.sm90.v_transpose import VTransposer, check_layouts, lane_idx_here
from jax_fa4.kernels.sm90.v_transpose_plan import TRANSPOSE_WARPS, VTransposePlan
from jax_fa4.kernels.spec import LOG2_E, NUM_PARAMS, PARAM_SCALE, PARAM_SINKS

# Dynamic tiles (FwdConfig.dynamic_tiles): slots of the shared-memory ring that hands each claimed
# tile index from the producer warp to the consumer warpgroups
TILE_SLOTS = 2


class NamedBarrier(enum.IntEnum):
    # 0 is __syncthreads
    EPILOGUE = 1
    # ping-pong: consumer warpgroup w syncs on PINGPONG_WG0 + w (2, 3, 4), 2 × 128 threads
    PINGPONG_WG0 = 2
    # varlen / paged: consumer warpgroup w's zeroed V rows are written before its P·V GEMM
    # (5, 6, 7), 128 threads
    ZERO_TAIL_WG0 = 5


def pipeline_state_at(stages: int, position: Int32, producer: bool) -> pipeline.PipelineState:
    """The state of a pipeline of ``stages`` stages after ``position`` advances from its start
    (a producer's phase starts at 1, a consumer's at 0)."""
    return pipeline.PipelineState(stages, position, position % stages,
                                  ((position // stages) % 2) ^ int(producer))


class FlashAttentionForwardSm90:
    def __init__(self, cfg: FwdConfig):
        cfg.validate()
        self.cfg = cfg
        # FP8 (cfg.fp8): e4m3 q, k, v, bfloat16 out; V staged as loaded, then transposed
        self.fp8 = cfg.fp8
        self.v_staging = cfg.v_staging_stages
        self.v_plan = VTransposePlan(cfg.tile_n, cfg.head_dim_v) if cfg.fp8 else None
        self.dtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16,
                      FP8_DTYPE: cutlass.Float8E4M3FN}[cfg.dtype]
        self.out_dtype = cutlass.BFloat16 if self.fp8 else self.dtype
        self.is_bf16 = self.out_dtype == cutlass.BFloat16
        self.hdim, self.hdimv = cfg.head_dim, cfg.head_dim_v
        self.tile_m, self.tile_n, self.stages = cfg.tile_m, cfg.tile_n, cfg.stages
        self.is_causal = cfg.mask == "causal"
        self.is_local = cfg.mask == "local"
        self.has_softcap = cfg.has_softcap
        self.overlap = cfg.intra_wg_overlap
        self.num_mma_wg = cfg.num_mma_warpgroups
        self.num_mma_threads = 128 * self.num_mma_wg
        self.num_threads = cfg.num_threads
        self.mma_regs, self.producer_regs = cfg.register_split()
        self.pingpong = cfg.pingpong
        self.persistent = cfg.num_sms > 0
        self.num_sms = cfg.num_sms
        # persistent: O staged in its own buffer (the next tile's Q loads under this tile's
        # epilogue, the O store drains under the next mainloop), where it fits
        self.own_o = cfg.own_o_buffer
        # persistent: tiles claimed from a global counter instead of a fixed stride
        self.dynamic = cfg.dynamic_tiles
        self.rescale_threshold = float(cfg.rescale_threshold)
        self.rescale_skip = cfg.rescale_skip
        self.paged = cfg.paged
        self.varlen = cfg.varlen
        self.out_f32 = cfg.out_f32
        self.segments = cfg.segments
        # K/V rows past the keys are loaded from memory the caller does not promise to be finite
        # (the next sequence or padding tokens; a page's unused slots): V's must be zeroed, as
        # P = 0 there does not cancel a NaN or Inf in P·V (scores are masked by selection). The
        # 16-bit consumers zero them in V's stage; FP8's producer warps clear them in registers
        # as they transpose the block (v_transpose.VTransposer.stage's keys_left)
        self.zero_v_tail = (cfg.varlen or cfg.paged) and not cfg.fp8
        self.mask_v_tail = (cfg.varlen or cfg.paged) and cfg.fp8

    # ---------------------------------------------------------------------------------------------
    # Host side: views, layouts, TMA atoms, launch
    # ---------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, stream: cuda.CUstream, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mParams: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mPageTable: cute.Tensor | None = None, mSeqUsedK: cute.Tensor | None = None,
                 mCuSeqlensQ: cute.Tensor | None = None, mCuSeqlensK: cute.Tensor | None = None,
                 mSegTiles: cute.Tensor | None = None, mSegRows: cute.Tensor | None = None,
                 mKvIds: cute.Tensor | None = None, mMaxLogits: cute.Tensor | None = None,
                 mDescale: cute.Tensor | None = None, mTileCounter: cute.Tensor | None = None):
        for name, t in (("q", mQ), ("k", mK), ("v", mV), ("out", mO)):
            expected = self.dtype
            if const_expr(name == "out"):
                expected = Float32 if const_expr(self.out_f32) else self.out_dtype
            if const_expr(t.element_type != expected):
                raise TypeError(f"{name}: expected {expected}, got {t.element_type}")
        if const_expr(mLSE.element_type != Float32 or mParams.element_type != Float32):
            raise TypeError("lse and params must be float32")
        if const_expr(self.fp8 != (mDescale is not None)):
            raise TypeError("descale is given exactly when the config is FP8")
        if const_expr(mDescale is not None and mDescale.element_type != Float32):
            raise TypeError(f"descale: expected Float32, got {mDescale.element_type}")
        if const_expr(self.cfg.max_logits != (mMaxLogits is not None)):
            raise TypeError("max_logits is given exactly when the config has max logits")
        if const_expr(mMaxLogits is not None and mMaxLogits.element_type != Float32):
            raise TypeError(f"max_logits: expected Float32, got {mMaxLogits.element_type}")
        if const_expr(self.paged != (mPageTable is not None) or
                      self.paged != (mSeqUsedK is not None)):
            raise TypeError("page_table and seqused_k are given exactly when the config is paged")
        if const_expr(self.varlen != (mCuSeqlensQ is not None) or
                      self.varlen != (mCuSeqlensK is not None)):
            raise TypeError("cu_seqlens_q and cu_seqlens_k are given exactly when the config is "
                            "varlen")
        if const_expr(self.segments != (mSegTiles is not None) or
                      self.segments != (mSegRows is not None) or
                      self.segments != (mKvIds is not None)):
            raise TypeError("seg_tiles, seg_rows and kv_ids are given exactly when the config "
                            "has segments")
        if const_expr(self.dynamic != (mTileCounter is not None)):
            raise TypeError("tile_counter is given exactly when the config has dynamic tiles")
        if const_expr(mTileCounter is not None and mTileCounter.element_type != Int32):
            raise TypeError(f"tile_counter: expected Int32, got {mTileCounter.element_type}")
        if const_expr(self.paged or self.varlen or self.segments):
            for name, t in (("page_table", mPageTable), ("seqused_k", mSeqUsedK),
                            ("cu_seqlens_q", mCuSeqlensQ), ("cu_seqlens_k", mCuSeqlensK),
                            ("seg_tiles", mSegTiles), ("seg_rows", mSegRows),
                            ("kv_ids", mKvIds)):
                if const_expr(t is None):
                    continue
                if const_expr(t.element_type != Int32):
                    raise TypeError(f"{name}: expected Int32, got {t.element_type}")
        D, Dv = self.hdim, self.hdimv
        mQ, mK = self.qo_view(mQ, D), seq_major(mK, D)
        mV, mO = seq_major(mV, Dv), self.qo_view(mO, Dv)
        mLSE = select_modes(mLSE, (2, 1, 0))  # (Sq, H, B); varlen: (max_seqlen_q, H, batch)
        if const_expr(mMaxLogits is not None):
            mMaxLogits = select_modes(mMaxLogits, (2, 1, 0))  # (Sq, H, B) like lse

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            Float32, (self.num_mma_wg, 1, 1), (64, self.tile_n))
        # V is the P·V GEMM's B operand: MN-major (V as stored) for 16-bit types; FP8 WGMMAs
        # read both operands K-major: the producer warps transpose V into sV (keys contiguous)
        v_major = cute.nvgpu.OperandMajorMode.K if const_expr(self.fp8) else \
            cute.nvgpu.OperandMajorMode.MN
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, v_major,
            Float32, (self.num_mma_wg, 1, 1), (64, Dv), a_source=warpgroup.OperandSource.RMEM)

        sQ_layout = make_smem_layout(self.dtype, self.tile_m, D)
        sK_layout = make_smem_layout(self.dtype, self.tile_n, D, stages=self.stages)
        v_tile = (Dv, self.tile_n) if const_expr(self.fp8) else (self.tile_n, Dv)
        sV_layout = make_smem_layout(self.dtype, *v_tile, stages=self.stages)
        sO_layout = make_smem_layout(self.out_dtype, self.tile_m, Dv)
        # FP8: TMA stages V as stored, (tile_n, Dv), for the producer warps' transpose
        sVstaged_layout = None
        if const_expr(self.fp8):
            sVstaged_layout = make_smem_layout(self.dtype, self.tile_n, Dv,
                                               stages=self.v_staging)
            check_layouts(self.v_plan, sVstaged_layout, sV_layout, self.v_staging, self.stages)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(g2s, mQ, sQ_layout, (self.tile_m, D))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            g2s, mK, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, D))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
            g2s, mV, cute.select(sVstaged_layout if const_expr(self.fp8) else sV_layout,
                                 mode=[0, 1]), (self.tile_n, Dv))
        if const_expr(self.out_f32):  # stored from registers (mma's epilogue)
            tma_atom_O, tma_O = None, mO
        else:
            tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, sO_layout, (self.tile_m, Dv))

        self.tx_bytes_q = self.tile_m * D * self.dtype.width // 8
        self.tx_bytes_k = self.tile_n * D * self.dtype.width // 8
        self.tx_bytes_v = self.tile_n * Dv * self.dtype.width // 8

        q_elems = cute.cosize(sQ_layout)
        if const_expr(self.fp8):
            q_elems = max(q_elems, cute.cosize(sO_layout) * self.out_dtype.width // 8)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            if const_expr(self.fp8):  # V's staging stages (full + empty)
                mbar_v_staged: cute.struct.MemRange[cutlass.Int64, 2 * self.v_staging]
            if const_expr(self.dynamic):  # the claimed tile indices' ring (full + empty)
                mbar_tile: cute.struct.MemRange[cutlass.Int64, 2 * TILE_SLOTS]
                tile_idx: cute.struct.MemRange[Int32, TILE_SLOTS]
            # Q's buffer is O's staging buffer too (FP8: 16-bit O, larger than Q), unless O has
            # its own (own_o, below)
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, q_elems], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            if const_expr(self.fp8):
                sVstaged: cute.struct.Align[
                    cute.struct.MemRange[self.dtype, cute.cosize(sVstaged_layout)], 1024]
            if const_expr(self.own_o):
                sO: cute.struct.Align[cute.struct.MemRange[self.out_dtype,
                                                           cute.cosize(sO_layout)], 1024]

        # varlen: q is (1, total_q, H, D) and the batch and the longest sequence come from lse
        num_m_blocks = cute.ceil_div(mLSE.shape[0] if const_expr(self.varlen) else mQ.shape[0],
                                     self.tile_m)
        if const_expr(self.varlen):
            # one more batch slice: its CTAs write the zeros of the tokens outside every sequence
            grid = SingleTileScheduler.grid_shape(num_m_blocks, mQ.shape[2], mLSE.shape[2] + 1)
        elif const_expr(self.persistent):
            grid = PersistentTileScheduler.grid_shape(self.num_sms, num_m_blocks, mQ.shape[2],
                                                      mQ.shape[3])
        else:
            grid = SingleTileScheduler.grid_shape(num_m_blocks, mQ.shape[2], mQ.shape[3])
        self.kernel(
            tma_Q, tma_K, tma_V, tma_O, mO if const_expr(self.varlen) else None, mLSE, mParams,
            mPageTable, mSeqUsedK, mCuSeqlensQ, mCuSeqlensK, mSegTiles, mSegRows, mKvIds,
            mMaxLogits, mDescale, mTileCounter, tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O,
            sQ_layout, sK_layout, sV_layout, sO_layout, sVstaged_layout,
            tiled_mma_qk, tiled_mma_pv, SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=self.cfg.ctas_per_sm,
                 # two CTAs per SM: ask for the largest shared-memory carveout (given here, the
                 # DSL would otherwise query the GPU for it while compiling)
                 preferred_smem_carveout=100 if const_expr(self.cfg.ctas_per_sm > 1) else None)

    def v_blocks(self, mV: cute.Tensor, head_kv, batch, k_offset=None) -> cute.Tensor:
        """One kv head's V as tiles of tile_n keys, the key block the last mode."""
        return cute.local_tile(sequence(mV, head_kv, batch, k_offset),
                               (self.tile_n, self.hdimv), (None, 0))

    def qo_view(self, t: cute.Tensor, d: int) -> cute.Tensor:
        """q or out as the kernel's (S, D, H, B) view: from (B, S, H, D), or from (B, H, S, D)
        when the config is head-major (FwdConfig.qo_head_major)."""
        if const_expr(not self.cfg.qo_head_major):
            return seq_major(t, d)
        layout = cute.make_layout((t.shape[2], d, t.shape[1], t.shape[0]),
                                  stride=(t.stride[2], 1, t.stride[1], t.stride[0]))
        return cute.make_tensor(t.iterator, layout)

    # ---------------------------------------------------------------------------------------------
    # Device side
    # ---------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mO_gmem: cute.Tensor | None, mLSE: cute.Tensor, mParams: cute.Tensor,
               mPageTable: cute.Tensor | None, mSeqUsedK: cute.Tensor | None,
               mCuSeqlensQ: cute.Tensor | None, mCuSeqlensK: cute.Tensor | None,
               mSegTiles: cute.Tensor | None, mSegRows: cute.Tensor | None,
               mKvIds: cute.Tensor | None, mMaxLogits: cute.Tensor | None,
               mDescale: cute.Tensor | None, mTileCounter: cute.Tensor | None,
               tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
               tma_atom_O: cute.CopyAtom,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
               sVstaged_layout: cute.ComposedLayout | None,
               tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
               SharedStorage: cutlass.Constexpr):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                if const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        tma_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # PipelineTmaAsync releases with one elected lane per consumer warp
        mma_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads // 32)
        # persistent: Q's buffer is released once per tile: with O in Q's buffer by the warp
        # that TMA-stores O, after the store has read it; with O's own buffer (own_o) by every
        # consumer warp once its GEMMs are done
        q_consumers = tma_thread if const_expr(self.persistent and not self.own_o) else mma_warps
        pipeline_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, producer_group=tma_thread,
            consumer_group=q_consumers, tx_count=self.tx_bytes_q, defer_sync=True)
        pipeline_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.stages,
            producer_group=tma_thread, consumer_group=mma_warps, tx_count=self.tx_bytes_k,
            defer_sync=True)
        pipeline_v_staged = None
        if const_expr(self.fp8):
            # V as stored -> (TMA) the staging stages -> the producer warps transpose it (each
            # warp's lane 0 releases a stage) -> sV -> the consumers (every thread releases)
            pipeline_v_staged = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_v_staged.data_ptr(), num_stages=self.v_staging,
                producer_group=tma_thread,
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, TRANSPOSE_WARPS),
                tx_count=self.tx_bytes_v, defer_sync=True)
            pipeline_v = pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         32 * TRANSPOSE_WARPS),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         self.num_mma_threads),
                defer_sync=True)
        else:
            pipeline_v = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.stages,
                producer_group=tma_thread, consumer_group=mma_warps, tx_count=self.tx_bytes_v,
                defer_sync=True)
        tile_ring = None
        if const_expr(self.dynamic):
            # the producer warp's lane 0 publishes each claimed tile index; every consumer thread
            # releases its slot after reading it (its release orders its own read)
            pipeline_tile = pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar_tile.data_ptr(), num_stages=TILE_SLOTS,
                producer_group=tma_thread,
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         self.num_mma_threads),
                defer_sync=True)
            tile_ring = (mTileCounter, pipeline_tile,
                         storage.tile_idx.get_tensor(cute.make_layout(TILE_SLOTS)))
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        if const_expr(self.own_o):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        else:
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner,
                                       dtype=self.out_dtype)  # reuses Q's buffer

        seqlen_q = mQ.shape[0]
        if const_expr(self.persistent):
            seqlen_k = mK.shape[0]
            window_left, window_right = resolve_windows(mParams, seqlen_q, seqlen_k, self.is_local)
            self.run_persistent(mQ, mK, mV, mO, mLSE, mParams, sQ, sK, sV, sO,
                                tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O,
                                tiled_mma_qk, tiled_mma_pv, pipeline_q, pipeline_k, pipeline_v,
                                warp_idx, tidx, seqlen_q, seqlen_k, window_left, window_right,
                                mMaxLogits, tile_ring,
                                segments=((mSegTiles, mSegRows, mKvIds)
                                          if const_expr(self.segments) else None))
        else:
            # varlen: the grid covers the longest sequence (lse is (batch, H, max_seqlen_q))
            rows = mLSE.shape[0] if const_expr(self.varlen) else seqlen_q
            scheduler = SingleTileScheduler(cute.ceil_div(rows, self.tile_m),
                                            longest_first=self.is_causal or self.is_local)
            m_block, head, batch = scheduler.work_tile()
            head_kv = head // (mQ.shape[2] // mK.shape[2])
            # varlen: sequence `batch` is rows [cu[batch], cu[batch + 1]) of the packed q / k / v;
            # paged: the batch entry's keys are its first seqused_k[batch] (whole pages of the
            # cache); dense: all of K
            q_offset, k_offset = None, None
            if const_expr(self.varlen):
                # the last batch slice (batch == number of sequences) only zeroes the padding
                # tokens (zero_padding_rows): it runs as an empty sequence
                q_offset, k_offset, seqlen_q, seqlen_k = varlen_sequence(
                    mCuSeqlensQ, mCuSeqlensK, batch, mCuSeqlensQ.shape[0] - 1)
            elif const_expr(self.paged):
                seqlen_k = paged_keys(mSeqUsedK, batch, mPageTable.shape[1] * self.tile_n)
            else:
                seqlen_k = mK.shape[0]
            window_left, window_right = resolve_windows(mParams, seqlen_q, seqlen_k, self.is_local)
            block_info = FwdBlocks(self.tile_m, self.tile_n, self.is_causal, self.is_local,
                                   seqlen_q, seqlen_k, window_left, window_right)
            n_block_min, n_block_max = self.tile_blocks(
                block_info, m_block, batch,
                (mSegTiles, mSegRows, mKvIds) if const_expr(self.segments) else None,
                past_end_empty=self.varlen)

            if warp_idx < 4:  # producer warpgroup
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if const_expr(self.fp8):
                    sVstaged = storage.sVstaged.get_tensor(sVstaged_layout.outer,
                                                           swizzle=sVstaged_layout.inner)
                    self.load_fp8(mQ, mK, mV, sQ, sK, sVstaged, tma_atom_Q, tma_atom_K,
                                  tma_atom_V, pipeline_q, pipeline_k, pipeline_v_staged,
                                  pipeline_v, storage.sVstaged.data_ptr(), storage.sV.data_ptr(),
                                  m_block, head, head_kv, batch, n_block_min, n_block_max,
                                  warp_idx, mPageTable, q_offset, k_offset,
                                  seqlen_k if const_expr(self.mask_v_tail) else None)
                else:
                    if warp_idx == 0:
                        self.load(mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
                                  pipeline_q, pipeline_k, pipeline_v, mPageTable,
                                  m_block, head, head_kv, batch, n_block_min, n_block_max,
                                  q_offset, k_offset)
            else:  # consumer warpgroups
                cute.arch.setmaxregister_increase(self.mma_regs)
                scale = mParams[PARAM_SCALE]
                out_scale = None
                if const_expr(self.fp8):  # dequantisation: q·k's into the scale, v's into O's
                    # (varlen: the padding rows' batch slice, past the sequences, reads the last
                    # sequence's descales and computes nothing)
                    d_batch = cutlass.min(batch, mDescale.shape[0] - 1) if const_expr(
                        self.varlen) else batch
                    scale = scale * mDescale[d_batch, head_kv, 0]
                    out_scale = mDescale[d_batch, head_kv, 1]
                scales = score_scales(scale, mParams, self.has_softcap)
                mask = AttentionMask(self.tile_m, self.tile_n, seqlen_q, seqlen_k,
                                     window_left, window_right)
                wg_idx = (warp_idx - 4) // 4  # consumer warpgroup 0..W-1 (warp-uniform)
                if const_expr(self.pingpong):
                    self.pingpong_init(wg_idx)
                self.mma(mO, mLSE, sQ, sK, sV, sO, tma_atom_O, tiled_mma_qk, tiled_mma_pv,
                         pipeline_q, pipeline_k, pipeline_v, tidx - 128, warp_idx - 4,
                         scales.scale_log2, scales.tanh_in_scale, mask, block_info,
                         m_block, head, batch, n_block_min, n_block_max, seqlen_q, wg_idx,
                         self.sink_log2(mParams, head),
                         varlen_out=(mO_gmem, q_offset) if const_expr(self.varlen) else None,
                         segments=((mSegTiles, mSegRows, mKvIds) if const_expr(self.segments)
                                   else None),
                         max_logits=mMaxLogits, out_scale=out_scale)
                if const_expr(self.varlen):
                    if batch == mCuSeqlensQ.shape[0] - 1:
                        zero_padding_rows(mO_gmem, mCuSeqlensQ, head,
                                          (self.tile_m, self.hdimv), self.num_mma_threads,
                                          tidx - 128, m_block,
                                          cute.ceil_div(mLSE.shape[0], self.tile_m))

    # --- persistent scheduling (num_sms > 0) -----------------------------------------------------
    # The grid is min(num_sms, tiles) CTAs; the producer warp and the consumer warpgroups walk the
    # same tile sequence (PersistentTileScheduler), carrying their pipeline states from tile to
    # tile, so the producer prefetches the next tile's K/V during this tile's epilogue. Where O
    # has its own staging buffer (own_o) the consumer warps release Q's stage as their epilogue
    # starts, so the next Q loads under it too, and the TMA store of O is waited for only before
    # the next tile's epilogue overwrites the buffer (and before the CTA exits). Otherwise Q's
    # buffer doubles as O's: the consumer warp that TMA-stores O releases Q's stage once the
    # store has read it, and only then may the producer load the next tile's Q. Q is loaded (and
    # released) for every tile, even one without visible keys, so the two sides stay in step.
    # The tiles a CTA computes: c, c + grid, c + 2·grid, ... (static), or (dynamic_tiles, the
    # ``tile_ring``) c first, then whichever linear tile the producer warp claims from the global
    # counter as it starts loading each tile (one atomic add, plus the grid size: the first
    # `grid` tiles are the CTAs' first ones). It hands each claimed index to the consumer
    # warpgroups through a ring of TILE_SLOTS shared-memory slots, once it has issued that
    # tile's loads (the atomic's latency hides under them); the consumers read it as they finish
    # the tile. An index >= num_tiles ends both loops. The order of the linear tiles is the same
    # either way; only their assignment to CTAs follows which CTA is free first.
    @cute.jit
    def run_persistent(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                       mLSE: cute.Tensor, mParams: cute.Tensor, sQ: cute.Tensor, sK: cute.Tensor,
                       sV: cute.Tensor, sO: cute.Tensor, tma_atom_Q: cute.CopyAtom,
                       tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
                       tma_atom_O: cute.CopyAtom, tiled_mma_qk: cute.TiledMma,
                       tiled_mma_pv: cute.TiledMma, pipeline_q, pipeline_k, pipeline_v,
                       warp_idx: Int32, tidx: Int32, seqlen_q: Int32, seqlen_k: Int32,
                       window_left, window_right, mMaxLogits: cute.Tensor | None = None,
                       tile_ring=None, segments=None):
        """The persistent kernel's tile loops; ``tile_ring`` (dynamic_tiles): (the global
        counter, the PipelineAsync of the index ring, its TILE_SLOTS int32 slots);
        ``segments`` (segment ids): the (seg_tiles, seg_rows, kv_ids) tables, whose key-block
        range of each tile both sides clip theirs to (:meth:`tile_blocks`)."""
        num_heads = mQ.shape[2]
        group = num_heads // mK.shape[2]
        num_m_blocks = cute.ceil_div(seqlen_q, self.tile_m)
        batch_size = mQ.shape[3]
        longest_first = self.is_causal or self.is_local
        num_tiles = PersistentTileScheduler.num_tiles(num_m_blocks, num_heads, batch_size)
        t_first, t_stride = PersistentTileScheduler.first_and_stride()
        kv_kb = cutlass.max(seqlen_k * (self.hdim + self.hdimv) // 512, 1)  # K+V of a kv head
        heads_per_section = PersistentTileScheduler.section_pairs(
            num_m_blocks, group, kv_kb, t_stride, longest_first)
        # (Python helper objects such as FwdBlocks / AttentionMask are built inside the run-time
        # tile loops: a loop may carry only DSL values.)
        if warp_idx < 4:  # producer warpgroup
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                       self.stages)
                v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                       self.stages)
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                if const_expr(self.dynamic):
                    tile_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                              TILE_SLOTS)
                t = t_first
                while t < num_tiles:
                    m_block, head, batch = PersistentTileScheduler.tile(
                        t, num_m_blocks, num_heads, batch_size, heads_per_section, longest_first)
                    if const_expr(self.dynamic):
                        claimed = self.claim_tile(tile_ring[0])  # read after the loads
                    block_info = FwdBlocks(self.tile_m, self.tile_n, self.is_causal,
                                           self.is_local, seqlen_q, seqlen_k, window_left,
                                           window_right)
                    n_block_min, n_block_max = self.tile_blocks(block_info, m_block, batch,
                                                                segments)
                    k_state, v_state, q_state = self.load_tile(
                        mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
                        pipeline_q, pipeline_k, pipeline_v, m_block, head, head // group, batch,
                        n_block_min, n_block_max, k_state, v_state, q_state)
                    if const_expr(self.dynamic):
                        t, tile_state = self.publish_tile(tile_ring, tile_state, claimed,
                                                          t_stride)
                    else:
                        t += t_stride
        else:  # consumer warpgroups
            cute.arch.setmaxregister_increase(self.mma_regs)
            scales = score_scales(mParams[PARAM_SCALE], mParams, self.has_softcap)
            wg_idx = (warp_idx - 4) // 4
            if const_expr(self.pingpong):
                self.pingpong_init(wg_idx)  # once: every tile leaves one arrival pending
            k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            if const_expr(self.dynamic):
                tile_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                          TILE_SLOTS)
            t = t_first
            while t < num_tiles:
                m_block, head, batch = PersistentTileScheduler.tile(
                    t, num_m_blocks, num_heads, batch_size, heads_per_section, longest_first)
                block_info = FwdBlocks(self.tile_m, self.tile_n, self.is_causal, self.is_local,
                                       seqlen_q, seqlen_k, window_left, window_right)
                mask = AttentionMask(self.tile_m, self.tile_n, seqlen_q, seqlen_k,
                                     window_left, window_right)
                n_block_min, n_block_max = self.tile_blocks(block_info, m_block, batch, segments)
                k_state, v_state, q_state = self.mma(
                    mO, mLSE, sQ, sK, sV, sO, tma_atom_O, tiled_mma_qk, tiled_mma_pv,
                    pipeline_q, pipeline_k, pipeline_v, tidx - 128, warp_idx - 4,
                    scales.scale_log2, scales.tanh_in_scale, mask, block_info,
                    m_block, head, batch, n_block_min, n_block_max, seqlen_q, wg_idx,
                    self.sink_log2(mParams, head), (k_state, v_state, q_state),
                    segments=segments, max_logits=mMaxLogits)
                if const_expr(self.dynamic):
                    t, tile_state = self.next_tile(tile_ring, tile_state)
                else:
                    t += t_stride
            if const_expr(self.own_o):
                if warp_idx == 4:  # (the warp that stores O) its last store has read sO
                    cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def tile_blocks(self, block_info: FwdBlocks, m_block: Int32, batch: Int32, segments=None,
                    past_end_empty: cutlass.Constexpr[bool] = False):
        """(n_block_min, n_block_max) of a tile: the mask's range (FwdBlocks.n_block_range),
        clipped with segment ids to the key blocks some row of the tile shares an id with (the
        caller's table)."""
        n_block_min, n_block_max = block_info.n_block_range(m_block,
                                                            past_end_empty=past_end_empty)
        if const_expr(segments is not None):
            tiles = segments[0]
            n_block_min = cutlass.max(n_block_min, tiles[batch, m_block, SEG_N_LO])
            n_block_max = cutlass.min(n_block_max, tiles[batch, m_block, SEG_N_HI])
        return n_block_min, n_block_max

    @cute.jit
    def claim_tile(self, mTileCounter: cute.Tensor) -> Int32:
        """Dynamic tiles, the producer warp: lane 0's atomic add on the counter (its old value:
        the claim; 0 in the other lanes). Only :meth:`publish_tile` reads it, so the atomic's
        round trip runs under the tile's loads."""
        claimed = Int32(0)
        if cute.arch.lane_idx() == 0:
            claimed = cute.arch.atomic_add(mTileCounter.iterator, Int32(1), sem="relaxed",
                                           scope="gpu")
        return claimed

    @cute.jit
    def publish_tile(self, tile_ring: cutlass.Constexpr, tile_state, claimed: Int32,
                     grid: Int32):
        """Dynamic tiles, the producer warp: the claimed tile (lane 0's ``claimed`` plus the
        grid size: the counter starts at 0 and the grid's first tiles are the CTAs' first ones)
        broadcast to the warp and, by lane 0 (the ring's producer is one thread), written into
        the ring's next slot for the consumer warpgroups. Returns (the tile, the ring's
        state)."""
        _, pipeline_tile, sTileIdx = tile_ring
        t = cute.arch.shuffle_sync(claimed, 0) + grid
        pipeline_tile.producer_acquire(tile_state)
        if cute.arch.lane_idx() == 0:
            sTileIdx[tile_state.index] = t
            pipeline_tile.producer_commit(tile_state)
        tile_state.advance()
        return t, tile_state

    @cute.jit
    def next_tile(self, tile_ring: cutlass.Constexpr, tile_state):
        """Dynamic tiles, a consumer thread: the next tile index from the ring (each thread
        releases the slot after its own read)."""
        _, pipeline_tile, sTileIdx = tile_ring
        pipeline_tile.consumer_wait(tile_state)
        t = sTileIdx[tile_state.index]
        pipeline_tile.consumer_release(tile_state)
        tile_state.advance()
        return t, tile_state

    def tma_tiles(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                  sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                  tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom,
                  tma_atom_V: cute.CopyAtom, m_block: Int32, head: Int32, head_kv: Int32,
                  batch: Int32, q_offset=None, k_offset=None) -> tuple:
        """The TMA partitions ((smem, gmem) of Q's tile, of K's and V's key blocks, the block
        the last mode) of one tile (persistent and FP8 producers): varlen from the sequence's
        rows ``q_offset`` / ``k_offset`` on, paged with K and V the whole cache as one batch
        entry (a block's cache tile from the page table: :meth:`kv_tile`)."""
        gQ = cute.local_tile(sequence(mQ, head, batch, q_offset), (self.tile_m, self.hdim),
                             (m_block, 0))
        kv_batch = 0 if const_expr(self.paged) else batch
        gK = cute.local_tile(sequence(mK, head_kv, kv_batch, k_offset), (self.tile_n, self.hdim),
                             (None, 0))
        gV = self.v_blocks(mV, head_kv, kv_batch, k_offset)
        one = cute.make_layout(1)
        return tuple(cpasync.tma_partition(atom, 0, one, cute.group_modes(smem, 0, 2),
                                           cute.group_modes(gmem, 0, 2))
                     for atom, smem, gmem in ((tma_atom_Q, sQ, gQ), (tma_atom_K, sK, gK),
                                              (tma_atom_V, sV, gV)))

    @cute.jit
    def load_tile(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                  sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                  tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
                  pipeline_q, pipeline_k, pipeline_v,
                  m_block: Int32, head: Int32, head_kv: Int32, batch: Int32,
                  n_block_min: Int32, n_block_max: Int32, k_state, v_state, q_state):
        """The producer's part of one tile (persistent): `load`'s order, states carried."""
        (tQsQ, tQgQ), (tKsK, tKgK), (tVsV, tVgV) = self.tma_tiles(
            mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V, m_block, head, head_kv,
            batch)
        if n_block_max > n_block_min:
            # K first: it need not wait for the previous tile's epilogue to free Q's buffer
            pipeline_k.producer_acquire(k_state)
            cute.copy(tma_atom_K, tKgK[None, n_block_max - 1], tKsK[None, k_state.index],
                      tma_bar_ptr=pipeline_k.producer_get_barrier(k_state))
            k_state.advance()
        pipeline_q.producer_acquire(q_state)
        cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
        q_state.advance()
        if n_block_max > n_block_min:
            if const_expr(not self.overlap):
                pipeline_v.producer_acquire(v_state)
                cute.copy(tma_atom_V, tVgV[None, n_block_max - 1], tVsV[None, v_state.index],
                          tma_bar_ptr=pipeline_v.producer_get_barrier(v_state))
                v_state.advance()
            for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                n_block = n_block_max - 2 - i
                pipeline_k.producer_acquire(k_state)
                cute.copy(tma_atom_K, tKgK[None, n_block], tKsK[None, k_state.index],
                          tma_bar_ptr=pipeline_k.producer_get_barrier(k_state))
                k_state.advance()
                n_block_v = n_block + 1 if const_expr(self.overlap) else n_block
                pipeline_v.producer_acquire(v_state)
                cute.copy(tma_atom_V, tVgV[None, n_block_v], tVsV[None, v_state.index],
                          tma_bar_ptr=pipeline_v.producer_get_barrier(v_state))
                v_state.advance()
            if const_expr(self.overlap):
                pipeline_v.producer_acquire(v_state)
                cute.copy(tma_atom_V, tVgV[None, n_block_min], tVsV[None, v_state.index],
                          tma_bar_ptr=pipeline_v.producer_get_barrier(v_state))
                v_state.advance()
        return k_state, v_state, q_state

    # --- ping-pong between the consumer warpgroups (FA3/FA4 "warp scheduler barriers") ----------
    # Warpgroup w issues its GEMMs of a key block only after warpgroup w-1 (cyclically) issued its
    # own: it syncs on barrier PINGPONG_WG0 + w (its 128 threads + 128 arrivals of the previous
    # warpgroup) before the QK GEMM and arrives on the next warpgroup's barrier right after issuing
    # the PV GEMM. The GEMMs of the warpgroups thus reach the tensor cores in turn, so one
    # warpgroup's softmax runs under the other's GEMMs. Only the loop blocks are fenced (not the
    # first block's QK GEMM nor the last PV GEMM); every warpgroup does the same number of
    # sync/arrive pairs per tile (same key-block range), and warpgroup 0 pre-arrives once.
    def _pingpong_threads(self) -> int:
        return 2 * 128

    @cute.jit
    def pingpong_init(self, wg_idx: Int32):
        if wg_idx == 0:
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.PINGPONG_WG0),
                                     number_of_threads=self._pingpong_threads())

    def pingpong_sync(self, wg_idx):
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=int(NamedBarrier.PINGPONG_WG0) + wg_idx,
                              number_of_threads=self._pingpong_threads())

    def pingpong_arrive(self, wg_idx):
        if const_expr(self.pingpong):
            if const_expr(self.num_mma_wg == 2):
                next_wg = 1 - wg_idx
            else:
                next_wg = (wg_idx + 1) % self.num_mma_wg
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.PINGPONG_WG0) + next_wg,
                                     number_of_threads=self._pingpong_threads())

    @cute.jit
    def load(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
             sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
             tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
             pipeline_q, pipeline_k, pipeline_v, mPageTable: cute.Tensor | None,
             m_block: Int32, head: Int32, head_kv: Int32, batch: Int32,
             n_block_min: Int32, n_block_max: Int32, q_offset=None, k_offset=None):
        gQ = cute.local_tile(sequence(mQ, head, batch, q_offset), (self.tile_m, self.hdim),
                             (m_block, 0))
        # paged: K and V are the whole cache as one batch entry, (1, pages·page_size, Hkv, ·), and
        # key block n of this batch entry is the cache's tile page_table[batch, n] (kv_tile)
        kv_batch = 0 if const_expr(self.paged) else batch
        gK = cute.local_tile(sequence(mK, head_kv, kv_batch, k_offset),
                             (self.tile_n, self.hdim), (None, 0))
        gV = self.v_blocks(mV, head_kv, kv_batch, k_offset)
        one = cute.make_layout(1)
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, one, cute.group_modes(sQ, 0, 2),
                                           cute.group_modes(gQ, 0, 2))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, one, cute.group_modes(sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, one, cute.group_modes(sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))
        if n_block_max > n_block_min:
            # K and V have their own pipelines and states; both are loaded in the order the
            # consumers use them (highest key block first). With intra-warpgroup overlap V runs
            # one block behind K: K[hi], Q, (K[n-1], V[n])..., V[lo].
            k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipeline_k.producer_acquire(k_state)
            k_tile = self.kv_tile(mPageTable, batch, n_block_max - 1)
            cute.copy(tma_atom_K, tKgK[None, k_tile], tKsK[None, k_state.index],
                      tma_bar_ptr=pipeline_k.producer_get_barrier(k_state))
            k_state.advance()
            pipeline_q.producer_acquire(q_state)
            cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
            if const_expr(not self.overlap):
                pipeline_v.producer_acquire(v_state)
                cute.copy(tma_atom_V, tVgV[None, k_tile], tVsV[None, v_state.index],
                          tma_bar_ptr=pipeline_v.producer_get_barrier(v_state))
                v_state.advance()
            if const_expr(self.paged and self.overlap):
                # paged: each block's page-table entry is loaded one block ahead (its latency
                # hides behind a whole block's wait), and V[n + 1] reuses K[n + 1]'s entry
                v_tile = k_tile
                k_tile = self.kv_tile(mPageTable, batch,
                                      cutlass.max(n_block_max - 2, n_block_min))
                for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                    n_block = n_block_max - 2 - i
                    next_tile = self.kv_tile(mPageTable, batch,
                                             cutlass.max(n_block - 1, n_block_min))
                    pipeline_k.producer_acquire(k_state)
                    cute.copy(tma_atom_K, tKgK[None, k_tile], tKsK[None, k_state.index],
                              tma_bar_ptr=pipeline_k.producer_get_barrier(k_state))
                    k_state.advance()
                    pipeline_v.producer_acquire(v_state)
                    cute.copy(tma_atom_V, tVgV[None, v_tile], tVsV[None, v_state.index],
                              tma_bar_ptr=pipeline_v.producer_get_barrier(v_state))
                    v_state.advance()
                    v_tile = k_tile
                    k_tile = next_tile
                pipeline_v.producer_acquire(v_state)
                cute.copy(tma_atom_V, tVgV[None, v_tile], tVsV[None, v_state.index],
                          tma_bar_ptr=pipeline_v.producer_get_barrier(v_state))
            else:
                for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                    n_block = n_block_max - 2 - i
                    k_tile = self.kv_tile(mPageTable, batch, n_block)  # (load before the wait)
                    n_block_v = n_block + 1 if const_expr(self.overlap) else n_block
                    v_tile = self.kv_tile(mPageTable, batch, n_block_v)
                    pipeline_k.producer_acquire(k_state)
                    cute.copy(tma_atom_K, tKgK[None, k_tile], tKsK[None, k_state.index],
                              tma_bar_ptr=pipeline_k.producer_get_barrier(k_state))
                    k_state.advance()
                    pipeline_v.producer_acquire(v_state)
                    cute.copy(tma_atom_V, tVgV[None, v_tile], tVsV[None, v_state.index],
                              tma_bar_ptr=pipeline_v.producer_get_barrier(v_state))
                    v_state.advance()
                if const_expr(self.overlap):
                    pipeline_v.producer_acquire(v_state)
                    v_tile = self.kv_tile(mPageTable, batch, n_block_min)
                    cute.copy(tma_atom_V, tVgV[None, v_tile], tVsV[None, v_state.index],
                              tma_bar_ptr=pipeline_v.producer_get_barrier(v_state))

    @cute.jit
    def load_fp8(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 sQ: cute.Tensor, sK: cute.Tensor, sVstaged: cute.Tensor,
                 tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
                 pipeline_q, pipeline_k, pipeline_v_staged, pipeline_v,
                 staged_ptr: cute.Pointer, vt_ptr: cute.Pointer,
                 m_block: Int32, head: Int32, head_kv: Int32, batch: Int32,
                 n_block_min: Int32, n_block_max: Int32, warp_idx: Int32,
                 mPageTable: cute.Tensor | None = None, q_offset=None, k_offset=None,
                 seqlen_k: Int32 | None = None):
        """FP8, the producer warpgroup's four warps: warp 0 issues the TMA loads in `load`'s
        overlapped order, K[hi], Q, (K[n], V[n + 1])..., V[lo], V into the staging stages as
        stored; every warp transposes its share of each staged V tile into sV, in the consumers'
        order (:meth:`transpose_v`). With two staging stages the transpose of a block follows the
        load of the next one, so warp 0 never waits for the landing of the V it just issued
        before its next loads; with one (head dim 256) it follows the block's own load.
        Varlen: the sequence's rows from ``q_offset`` / ``k_offset`` on. Paged: K and V are the
        cache as one batch entry and each block's cache tile comes from ``mPageTable``'s row,
        read by warp 0 as it issues the block's load (:meth:`load_kv_fp8`: K's and V's entries
        each; carried through the loop, as the 16-bit producer carries them, they spilled the
        24-register producer's transposes to local memory). ``seqlen_k`` (varlen, paged): the
        keys, so that the transpose of the highest block clears V's rows past them
        (:meth:`transpose_tail`)."""
        (tQsQ, tQgQ), (tKsK, tKgK), (tVsV, tVgV) = self.tma_tiles(
            mQ, mK, mV, sQ, sK, sVstaged, tma_atom_Q, tma_atom_K, tma_atom_V, m_block, head,
            head_kv, batch, q_offset, k_offset)
        lag = self.v_staging - 1  # V loads issued ahead of the transposes
        if n_block_max > n_block_min:
            # every pipeline position follows from the block's place in the sequence (the
            # states are rebuilt from it: fewer live registers within the producer's 24)
            num_blocks = n_block_max - n_block_min
            # varlen / paged: the lane bases are rebuilt for each block (:meth:`transpose_v`),
            # as the page-table entries and the highest block's key count take their registers
            transposer = warp_idx if const_expr(self.mask_v_tail) else VTransposer(
                self.v_plan, warp_idx, cute.arch.lane_idx())
            addrs = (staged_ptr.toint(), vt_ptr.toint())
            # the keys of the highest block (varlen / paged: fewer than tile_n where the
            # sequence ends inside it)
            valid = None
            if const_expr(seqlen_k is not None):
                valid = seqlen_k - (n_block_max - 1) * self.tile_n
            # paged: the batch entry's row of the page table
            table = mPageTable[batch, None] if const_expr(self.paged) else None
            if warp_idx == 0:
                k_tile = table[n_block_max - 1] if const_expr(self.paged) else n_block_max - 1
                k_state = pipeline_state_at(self.stages, Int32(0), producer=True)
                pipeline_k.producer_acquire(k_state)
                cute.copy(tma_atom_K, tKgK[None, k_tile], tKsK[None, k_state.index],
                          tma_bar_ptr=pipeline_k.producer_get_barrier(k_state))
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                pipeline_q.producer_acquire(q_state)
                cute.copy(tma_atom_Q, tQgQ, tQsQ,
                          tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
            kv = (tma_atom_K, tma_atom_V, tKgK, tKsK, tVgV, tVsV, pipeline_k, pipeline_v_staged)
            # (paged: warp 0 reads each block's page-table entries as it issues its loads,
            # load_kv_fp8; no entry is carried through the loop, whose transposes leave the
            # 24-register producer no room for one)
            for i in cutlass.range(num_blocks - 1, unroll=1):
                n_block = n_block_max - 2 - i
                if warp_idx == 0:
                    self.load_kv_fp8(kv, i, n_block, n_block + 1, table)
                if i >= lag:
                    self.transpose_v(transposer, pipeline_v_staged, pipeline_v, i - lag, addrs,
                                     valid)
            if warp_idx == 0:
                v_tile = table[n_block_min] if const_expr(self.paged) else n_block_min
                v_state = pipeline_state_at(self.v_staging, num_blocks - 1, producer=True)
                pipeline_v_staged.producer_acquire(v_state)
                cute.copy(tma_atom_V, tVgV[None, v_tile], tVsV[None, v_state.index],
                          tma_bar_ptr=pipeline_v_staged.producer_get_barrier(v_state))
            if const_expr(lag > 0):  # the block before the last, if any
                if num_blocks > 1:
                    self.transpose_v(transposer, pipeline_v_staged, pipeline_v, num_blocks - 2,
                                     addrs, valid)
            self.transpose_v(transposer, pipeline_v_staged, pipeline_v, num_blocks - 1, addrs,
                             valid)

    def load_kv_fp8(self, kv: tuple, i: Int32, k_tile: Int32, v_tile: Int32,
                    table: cute.Tensor | None = None) -> None:
        """FP8, warp 0, iteration ``i`` of :meth:`load_fp8`'s loop: K's block ``k_tile`` into K
        stage position i + 1, V's block ``v_tile`` into staging position i (paged: the cache
        tiles of those blocks, from the batch entry's page-table row ``table``)."""
        tma_atom_K, tma_atom_V, tKgK, tKsK, tVgV, tVsV, pipeline_k, pipeline_v_staged = kv
        if const_expr(table is not None):
            k_tile, v_tile = table[k_tile], table[v_tile]
        k_state = pipeline_state_at(self.stages, i + 1, producer=True)
        pipeline_k.producer_acquire(k_state)
        cute.copy(tma_atom_K, tKgK[None, k_tile], tKsK[None, k_state.index],
                  tma_bar_ptr=pipeline_k.producer_get_barrier(k_state))
        v_state = pipeline_state_at(self.v_staging, i, producer=True)
        pipeline_v_staged.producer_acquire(v_state)
        cute.copy(tma_atom_V, tVgV[None, v_tile], tVsV[None, v_state.index],
                  tma_bar_ptr=pipeline_v_staged.producer_get_barrier(v_state))

    def transpose_v(self, transposer, pipeline_v_staged, pipeline_v,
                    position: Int32, addrs: tuple, valid: Int32 | None = None) -> None:
        """FP8, one producer thread, the V block at ``position`` of the sequence: wait for its
        staged tile and a free sV stage, transpose this warp's share (v_transpose.VTransposer),
        fence the writes for the P·V WGMMA (async proxy), mark the sV stage full (every producer
        thread arrives) and free the staging stage (each warp's lane 0). ``addrs``: the shared
        addresses of the staging buffer and sV. ``transposer``: the thread's VTransposer, or
        (varlen / paged) its warp index, the VTransposer then built here. ``valid`` (varlen /
        paged): the highest block's keys (:meth:`transpose_tail`)."""
        stage_bytes = self.tile_n * self.hdimv
        staged_state = pipeline_state_at(self.v_staging, position, producer=False)
        vt_state = pipeline_state_at(self.stages, position, producer=True)
        pipeline_v_staged.consumer_wait(staged_state)
        pipeline_v.producer_acquire(vt_state)
        staged = addrs[0] + staged_state.index * stage_bytes
        vt = addrs[1] + vt_state.index * stage_bytes
        if const_expr(valid is None):
            transposer.stage(staged, vt)
        else:
            self.transpose_tail(VTransposer(self.v_plan, transposer, lane_idx_here()),
                                staged, vt, position, valid)
        cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> WGMMA reads
        pipeline_v.producer_commit(vt_state)
        pipeline_v_staged.consumer_release(staged_state)

    @cute.jit
    def transpose_tail(self, transposer: cutlass.Constexpr, staged: Int32, vt: Int32,
                       position: Int32, valid: Int32):
        """Varlen / paged FP8: the transpose of the block at ``position``, with the bytes of
        the keys past the sequence cleared in registers where it is the highest block
        (position 0) and holds fewer than tile_n keys; every other block as a dense call's.
        The rows past the keys (the next sequence, a page's unused slots) may hold NaN, which
        P = 0 would not cancel in P·V; no shared-memory pass, no barrier. ``valid``: the
        highest block's keys."""
        limit = Int32(cutlass.select_(position == 0, valid, Int32(self.tile_n)))
        # (VTransposer.stage(transposer, ...): a method call on the object would make the
        # DSL carry it through the run-time `if` as a value)
        if limit < self.tile_n:
            VTransposer.stage(transposer, staged, vt,
                              limit - VTransposePlan.lane_key(lane_idx_here()))
        else:
            VTransposer.stage(transposer, staged, vt)

    @cute.jit
    def sink_log2(self, mParams: cute.Tensor, head: Int32) -> Float32:
        """σ·log2 e of query head ``head``'s learnable sink: params[PARAM_SINKS + head] when params
        carries sinks (length NUM_PARAMS + H), else -inf (no sink)."""
        sink = -Float32.inf
        if mParams.shape[0] > NUM_PARAMS:
            sink = mParams[PARAM_SINKS + head] * LOG2_E
        return sink

    @cute.jit
    def kv_tile(self, mPageTable: cute.Tensor | None, batch: Int32, n_block: Int32):
        """The K/V tile holding key block ``n_block`` of ``batch``: the block itself (dense), or
        the cache tile the page table names (paged; a page of k·tile_n keys is k table entries)."""
        if const_expr(self.paged):
            return mPageTable[batch, n_block]
        return n_block

    @cute.jit
    def mma(self, mO: cute.Tensor, mLSE: cute.Tensor, sQ: cute.Tensor, sK: cute.Tensor,
            sV: cute.Tensor, sO: cute.Tensor, tma_atom_O: cute.CopyAtom,
            tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
            pipeline_q, pipeline_k, pipeline_v, tidx: Int32, warp_idx: Int32,
            scale_log2: Float32, tanh_in_scale, mask: AttentionMask, block_info: FwdBlocks,
            m_block: Int32, head: Int32, batch: Int32, n_block_min: Int32, n_block_max: Int32,
            seqlen_q: Int32, wg_idx: Int32, sink_log2: Float32,
            states: cutlass.Constexpr = None, varlen_out=None, segments=None,
            max_logits: cute.Tensor | None = None, out_scale: Float32 | None = None):
        """One tile's mainloop and epilogue. ``sink_log2``: the rows' learnable sink times
        log2 e (-inf: none). ``states`` (persistent scheduling): the consumer's
        (k, v, q) pipeline states carried from the previous tile; returned advanced.
        ``varlen_out`` (varlen): (the packed output in global memory, the sequence's first row),
        for the row-predicated store. ``segments`` (segment ids): the (seg_tiles, seg_rows,
        kv_ids) tables of FwdConfig.segments. ``max_logits`` (FwdConfig.max_logits): the
        (Sq, H, B) float32 output of each row's largest visible score. ``out_scale`` (FP8):
        v's descale, multiplied into each row's 1/Σ."""
        persistent = states is not None
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        tSrQ = thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ))
        tSrK = thr_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sK))
        # (Dv, keys) as the B operand: FP8's sV is V transposed already
        sVt = sV if const_expr(self.fp8) else transpose_mn(sV)
        tOrVt = thr_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sVt))
        acc_O = cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((self.tile_m, self.hdimv)),
                                      Float32)
        tOrP = thr_mma_pv.make_fragment_A(
            thr_mma_pv.partition_shape_A((self.tile_m, self.tile_n)))
        acc_S_shape = thr_mma_qk.partition_shape_C((self.tile_m, self.tile_n))
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS = thr_mma_qk.partition_C(cS)
        t0ScS = tiled_mma_qk.get_slice(0).partition_C(cS)

        num_rows = cute.size(acc_view_mn(acc_O), mode=[0])
        softmax = OnlineSoftmax(scale_log2, num_rows, self.rescale_threshold,
                                p_is_bf16=self.is_bf16, track_max=max_logits is not None,
                                rescale_skip=self.rescale_skip)
        softmax.reset_with_sink(sink_log2)
        row_scale = cute.make_rmem_tensor(num_rows, Float32)
        segs = None
        if const_expr(segments is not None):
            segs = self.segment_rows(segments, tScS, m_block, batch, seqlen_q, num_rows)

        ctx = dict(tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv, tSrQ=tSrQ, tSrK=tSrK,
                   tOrVt=tOrVt, acc_O=acc_O, tOrP=tOrP, acc_S_shape=acc_S_shape, tScS=tScS,
                   t0ScS=t0ScS, softmax=softmax, row_scale=row_scale, mask=mask,
                   tanh_in_scale=tanh_in_scale, pipeline_k=pipeline_k,
                   pipeline_v=pipeline_v, m_block=m_block, wg_idx=wg_idx, sV=sV, tidx=tidx,
                   segs=segs)
        masked = self.is_causal or self.is_local or self.segments
        # block boundaries between the mask regions (see mma loop below): blocks >= n_lo_right
        # cut the causal / right-window diagonal, blocks < n_lo_bulk the left-window edge
        if const_expr(self.is_causal or self.is_local):
            n_lo_right = block_info.n_block_min_right_mask(m_block, n_block_min)
        else:
            n_lo_right = n_block_max
        n_lo_bulk = block_info.n_block_max_left_mask(m_block, n_block_min)
        if const_expr(segments is not None):
            # segment ids: every block outside the tile's bulk is masked too
            tiles = segments[0]
            n_lo_right = cutlass.max(
                cutlass.min(n_lo_right, tiles[batch, m_block, SEG_BULK_HI]), n_block_min)
            n_lo_bulk = cutlass.max(n_lo_bulk, tiles[batch, m_block, SEG_BULK_LO])

        if const_expr(persistent):
            k_state, v_state, q_state = states
        else:
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        if n_block_max > n_block_min:
            pipeline_q.consumer_wait(q_state)
            block = self.overlap_block if const_expr(self.overlap) else self.serial_block
            # 1) the highest block: key-length tail + causal/window mask, starts the softmax
            if const_expr(self.overlap):
                acc_O.fill(0.0)  # every PV GEMM accumulates
                k_state = self.first_half_block(ctx, k_state, v_state, n_block_max - 1, masked)
            else:
                k_state, v_state = self.serial_block(ctx, k_state, v_state, n_block_max - 1,
                                                     True, True, masked)
            n_hi = n_block_max - 1
            # 2) blocks cutting the causal / right-window diagonal
            if const_expr(masked):
                for i in cutlass.range(n_hi - n_lo_right, unroll=1):
                    k_state, v_state = block(ctx, k_state, v_state, n_hi - 1 - i, False, False,
                                             True)
                n_hi = cutlass.min(n_hi, n_lo_right)
            # 3) the bulk, unmasked
            for i in cutlass.range(n_hi - n_lo_bulk, unroll=1):
                k_state, v_state = block(ctx, k_state, v_state, n_hi - 1 - i, False, False, False)
            # 4) blocks cutting the left-window edge (or below the segments' bulk)
            if const_expr(self.is_local or self.segments):
                n_hi = cutlass.min(n_hi, n_lo_bulk)
                for i in cutlass.range(n_hi - n_block_min, unroll=1):
                    k_state, v_state = block(ctx, k_state, v_state, n_hi - 1 - i, False, False,
                                             True)
            # 5) the last block's P·V
            if const_expr(self.overlap):
                v_state = self.last_half_block(ctx, v_state)
        else:
            acc_O.fill(0.0)  # no visible key in the whole tile: O = 0, lse = -inf
            if const_expr(persistent):
                pipeline_q.consumer_wait(q_state)  # Q is loaded for every tile (see run_persistent)
        if const_expr(self.own_o):
            # every GEMM that read this tile's Q is done: the producer may load the next one
            pipeline_q.consumer_release(q_state)

        # ---- epilogue ----
        lse = cute.make_rmem_tensor(num_rows, Float32)
        softmax.finalize(row_scale, lse)
        row_logits = None
        if const_expr(max_logits is not None):
            row_logits = cute.make_rmem_tensor(num_rows, Float32)
            for r in cutlass.range_constexpr(num_rows):
                row_logits[r] = softmax.logits_max(r)
        if const_expr(out_scale is not None):
            for r in cutlass.range_constexpr(num_rows):
                row_scale[r] = row_scale[r] * out_scale
        rescale_rows(acc_O, row_scale)

        # lse from registers: the 4 threads of a row quad hold the same value; column-0 owners write
        cO = cute.make_identity_tensor((self.tile_m, self.hdimv))
        tOcO = thr_mma_pv.partition_C(cO)
        tOcO_mn = acc_view_mn(tOcO)
        if tOcO_mn[0, 0][1] == 0:
            for r in cutlass.range_constexpr(num_rows):
                row = m_block * self.tile_m + tOcO_mn[r, 0][0]
                if row < seqlen_q:
                    mLSE[row, head, batch] = lse[r]
                    if const_expr(max_logits is not None):
                        max_logits[row, head, batch] = row_logits[r]
        if const_expr(self.out_f32):
            # float32 out straight from the accumulators, rows below seqlen_q (each thread's
            # column pairs are 8 contiguous bytes; the tile is small: decode shapes)
            gO = cute.local_tile(sequence(mO, head, batch), (self.tile_m, self.hdimv),
                                 (m_block, 0))
            tOgO = thr_mma_pv.partition_C(gO)
            for i in cutlass.range_constexpr(cute.size(acc_O)):
                if m_block * self.tile_m + tOcO[i][0] < seqlen_q:
                    tOgO[i] = acc_O[i]
        else:
            rO = cute.make_rmem_tensor(acc_O.layout, self.out_dtype)
            convert_f32_pairs(acc_O, rO, self.is_bf16)

            # every consumer warpgroup has finished its QK GEMMs (they read sQ) before O
            # overwrites it; own_o: the previous tile's TMA store has read O's buffer
            if const_expr(self.own_o):
                if warp_idx == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE),
                              number_of_threads=self.num_mma_threads)
            smem_copy_atom = cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                self.out_dtype)
            smem_thr_copy = cute.make_tiled_copy_C(smem_copy_atom, tiled_mma_pv).get_slice(tidx)
            cute.copy(smem_thr_copy, smem_thr_copy.retile(rO), smem_thr_copy.partition_D(sO))
            if const_expr(varlen_out is not None):
                # packed output: a tile inside the sequence is TMA-stored from the sequence's
                # first row on; in the last, partial tile the rows past the sequence belong to
                # the next one, so every consumer thread stores 16-byte row pieces below
                # seqlen_q instead
                mO_gmem, q_offset = varlen_out
                rows = seqlen_q - m_block * self.tile_m
                if rows >= self.tile_m:
                    self.store_tile_tma(sO, mO, tma_atom_O, pipeline_q, q_state, warp_idx,
                                        m_block, head, batch, persistent, q_offset)
                else:
                    cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE),
                                      number_of_threads=self.num_mma_threads)
                    gO = cute.local_tile(sequence(mO_gmem, head, 0, q_offset),
                                         (self.tile_m, self.hdimv), (m_block, 0))
                    store_rows(sO, gO, rows, self.num_mma_threads, tidx)
            else:
                self.store_tile_tma(sO, mO, tma_atom_O, pipeline_q, q_state, warp_idx, m_block,
                                    head, batch, persistent)
        if const_expr(persistent):
            q_state.advance()
            return k_state, v_state, q_state

    @cute.jit
    def segment_rows(self, segments: cutlass.Constexpr, tScS: cute.Tensor, m_block: Int32,
                     batch: Int32, seqlen_q: Int32, num_rows: cutlass.Constexpr[int]):
        """The mask's segment tables for this thread's rows (AttentionMask.apply's ``segs``):
        each row's key span and id in registers (rows past seqlen_q read the last row's), the
        batch entry's key ids, and the tile's compare-ids flag."""
        tiles, rows, kv_ids = segments
        c_mn = acc_view_mn(tScS)
        start = cute.make_rmem_tensor(num_rows, Int32)
        end = cute.make_rmem_tensor(num_rows, Int32)
        row_id = cute.make_rmem_tensor(num_rows, Int32)
        for r in cutlass.range_constexpr(num_rows):
            row = cutlass.min(m_block * self.tile_m + c_mn[r, 0][0], seqlen_q - 1)
            start[r] = rows[batch, row, SEG_ROW_START]
            end[r] = rows[batch, row, SEG_ROW_END]
            row_id[r] = rows[batch, row, SEG_ROW_ID]
        return start, end, row_id, kv_ids[batch, None], tiles[batch, m_block, SEG_IDS]

    @cute.jit
    def store_tile_tma(self, sO: cute.Tensor, mO: cute.Tensor, tma_atom_O: cute.CopyAtom,
                       pipeline_q, q_state, warp_idx: Int32, m_block: Int32, head: Int32,
                       batch: Int32, persistent: cutlass.Constexpr[bool], q_offset=None):
        """TMA-store the O tile (rows past seqlen_q are clipped by TMA) by consumer warp 0
        (varlen: into the packed output from the sequence's row ``q_offset`` on)."""
        cute.arch.fence_proxy("async.shared", space="cta")  # generic-proxy writes -> TMA reads
        if warp_idx == 0:
            cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE),
                              number_of_threads=self.num_mma_threads)
            gO = cute.local_tile(sequence(mO, head, batch, q_offset),
                                 (self.tile_m, self.hdimv), (m_block, 0))
            tOsO, tOgO = cpasync.tma_partition(tma_atom_O, 0, cute.make_layout(1),
                                               cute.group_modes(sO, 0, 2),
                                               cute.group_modes(gO, 0, 2))
            cute.copy(tma_atom_O, tOsO, tOgO)
            cute.arch.cp_async_bulk_commit_group()
            if const_expr(not self.own_o):  # (own_o: waited for before sO's next use)
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            if const_expr(persistent and not self.own_o):
                pipeline_q.consumer_release(q_state)  # the store has read sO = sQ: Q may reload
        else:
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.EPILOGUE),
                                     number_of_threads=self.num_mma_threads)

    # --- per key block -----------------------------------------------------------------------
    @cute.jit
    def convert_p(self, acc_S: cute.Tensor, tOrP: cute.Tensor):
        """P (f32, the QK accumulator) into the P·V GEMM's register operand: 16-bit pairs, or
        (FP8) e4m3 quads in the permuted key order V's rows follow."""
        if const_expr(self.fp8):
            convert_p_e4m3(acc_S, tOrP)
        else:
            convert_f32_pairs(acc_view_as_a_operand(acc_S), tOrP, self.is_bf16)

    @cute.jit
    def scores(self, ctx: cutlass.Constexpr, acc_S: cute.Tensor, n_block: Int32,
               mask_seqlen: cutlass.Constexpr[bool], mask_diag: cutlass.Constexpr[bool]):
        """S in registers -> softcap transform (if any) -> masks."""
        if const_expr(self.has_softcap):
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                acc_S[i] = cute.math.tanh(acc_S[i] * ctx["tanh_in_scale"], fastmath=True)
        if const_expr(mask_seqlen or mask_diag):
            ctx["mask"].apply(acc_S, ctx["tScS"], ctx["t0ScS"], ctx["m_block"], n_block,
                              mask_seqlen, mask_diag and self.is_causal,
                              mask_diag and self.is_local,
                              ctx["segs"] if const_expr(mask_diag) else None)

    @cute.jit
    def serial_block(self, ctx: cutlass.Constexpr, k_state, v_state, n_block: Int32,
                     is_first: cutlass.Constexpr[bool], mask_seqlen: cutlass.Constexpr[bool],
                     mask_diag: cutlass.Constexpr[bool]):
        """No overlap: S = Q·Kᵀ, wait, softmax, O = O·rescale + P·V, wait."""
        pipeline_k, pipeline_v = ctx["pipeline_k"], ctx["pipeline_v"]
        acc_O, tOrP = ctx["acc_O"], ctx["tOrP"]
        softmax, row_scale = ctx["softmax"], ctx["row_scale"]
        pipeline_k.consumer_wait(k_state)
        acc_S = cute.make_rmem_tensor(ctx["acc_S_shape"], Float32)
        wgmma(ctx["tiled_mma_qk"], acc_S, ctx["tSrQ"], ctx["tSrK"][None, None, None, k_state.index],
              zero_init=True)
        warpgroup.wait_group(0)
        pipeline_k.consumer_release(k_state)
        k_state.advance()
        self.scores(ctx, acc_S, n_block, mask_seqlen, mask_diag)
        softmax.step(acc_S, row_scale, False)  # (the sink state is the first block's past)
        self.convert_p(acc_S, tOrP)
        if const_expr(not is_first):
            self.rescale_O(acc_O, row_scale)
        if const_expr(is_first and self.zero_v_tail):
            self.zero_v_rows_past_keys(ctx, v_state, n_block)
        pipeline_v.consumer_wait(v_state)
        wgmma(ctx["tiled_mma_pv"], acc_O, tOrP, ctx["tOrVt"][None, None, None, v_state.index],
              zero_init=is_first)
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(v_state)
        v_state.advance()
        return k_state, v_state

    @cute.jit
    def first_half_block(self, ctx: cutlass.Constexpr, k_state, v_state, n_block: Int32,
                         mask_diag: cutlass.Constexpr[bool]):
        """Overlap, first block: S_0 = Q·K_0ᵀ, tail/diagonal masks, softmax start, P_0 in
        registers (varlen / paged: V_0's rows past the keys zeroed, ``v_state`` its stage)."""
        pipeline_k = ctx["pipeline_k"]
        pipeline_k.consumer_wait(k_state)
        acc_S = cute.make_rmem_tensor(ctx["acc_S_shape"], Float32)
        wgmma(ctx["tiled_mma_qk"], acc_S, ctx["tSrQ"], ctx["tSrK"][None, None, None, k_state.index],
              zero_init=True)
        warpgroup.wait_group(0)
        pipeline_k.consumer_release(k_state)
        k_state.advance()
        self.scores(ctx, acc_S, n_block, True, mask_diag)
        ctx["softmax"].step(acc_S, ctx["row_scale"], False)  # (after the sink state)
        self.convert_p(acc_S, ctx["tOrP"])
        if const_expr(self.zero_v_tail):
            self.zero_v_rows_past_keys(ctx, v_state, n_block)
        return k_state

    @cute.jit
    def zero_v_rows_past_keys(self, ctx: cutlass.Constexpr, v_state, n_block: Int32):
        """Varlen / paged, the highest key block: if it holds rows past the keys (the next
        sequence, padding tokens, a page's unused slots), write zeros over them in V's stage
        before this warpgroup's P·V GEMM reads it. Each consumer warpgroup zeroes the rows
        itself (the same zeros: the warpgroups' writes may overlap), fences them for the
        GEMM's async-proxy reads and syncs its 128 threads; the stage is released only after
        every warpgroup's GEMM, so the producer's next TMA load follows these writes."""
        valid = ctx["mask"].seqlen_k - n_block * self.tile_n
        if valid < self.tile_n:
            ctx["pipeline_v"].consumer_wait(v_state)
            sV = ctx["sV"][None, None, v_state.index]  # (tile_n, Dv)
            zero_rows_from(sV, valid, 128, ctx["tidx"] % 128)
            cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> WGMMA reads
            cute.arch.barrier(barrier_id=int(NamedBarrier.ZERO_TAIL_WG0) + ctx["wg_idx"],
                              number_of_threads=128)

    @cute.jit
    def overlap_block(self, ctx: cutlass.Constexpr, k_state, v_state, n_block: Int32,
                      is_first: cutlass.Constexpr[bool], mask_seqlen: cutlass.Constexpr[bool],
                      mask_diag: cutlass.Constexpr[bool]):
        """Overlap, block j: issue S_j = Q·K_jᵀ and O += P_{j-1}·V_{j-1}; softmax S_j while the PV
        GEMM runs; then P_j (overwrites P_{j-1} only after its GEMM completed) and O rescale."""
        pipeline_k, pipeline_v = ctx["pipeline_k"], ctx["pipeline_v"]
        acc_O, tOrP = ctx["acc_O"], ctx["tOrP"]
        softmax, row_scale = ctx["softmax"], ctx["row_scale"]
        pipeline_k.consumer_wait(k_state)
        self.pingpong_sync(ctx["wg_idx"])  # our turn to issue GEMMs
        acc_S = cute.make_rmem_tensor(ctx["acc_S_shape"], Float32)
        wgmma(ctx["tiled_mma_qk"], acc_S, ctx["tSrQ"], ctx["tSrK"][None, None, None, k_state.index],
              zero_init=True)
        pipeline_v.consumer_wait(v_state)
        wgmma(ctx["tiled_mma_pv"], acc_O, tOrP, ctx["tOrVt"][None, None, None, v_state.index],
              zero_init=False)
        self.pingpong_arrive(ctx["wg_idx"])  # the next warpgroup may issue
        warpgroup.wait_group(1)  # S_j done (PV still running)
        pipeline_k.consumer_release(k_state)
        k_state.advance()
        self.scores(ctx, acc_S, n_block, mask_seqlen, mask_diag)
        softmax.step(acc_S, row_scale, False)
        # (ptxas hoists this wait above the exponentials, into the row max's shuffle latency;
        # pinning them before it measured 5 % slower at bf16 hdim 128 and no faster for FP8:
        # benchmarks/results/fwd-exp-pin-ab-nvidia-h200-2026-12-03.json)
        warpgroup.wait_group(0)  # PV done: P_{j-1} and V_{j-1} are free, O is final for j-1
        pipeline_v.consumer_release(v_state)
        v_state.advance()
        self.convert_p(acc_S, tOrP)
        self.rescale_O(acc_O, row_scale)
        return k_state, v_state

    def rescale_O(self, acc_O: cute.Tensor, row_scale: cute.Tensor):
        if const_expr(self.rescale_threshold > 0.0 or self.rescale_skip):
            rescale_rows_if_needed(acc_O, row_scale)  # skipped when no row of the warp needs it
        else:
            rescale_rows(acc_O, row_scale)

    @cute.jit
    def last_half_block(self, ctx: cutlass.Constexpr, v_state):
        """Overlap, after the last block: O += P_last·V_last."""
        pipeline_v = ctx["pipeline_v"]
        pipeline_v.consumer_wait(v_state)
        wgmma(ctx["tiled_mma_pv"], ctx["acc_O"], ctx["tOrP"],
              ctx["tOrVt"][None, None, None, v_state.index], zero_init=False)
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(v_state)
        v_state.advance()  # (used by the next tile when persistent)
        return v_state


def make_launcher(cfg: FwdConfig):
    """The `@cute.jit` launcher ``fn(stream, q, k, v, params, out, lse)`` for this config,
    ``fn(stream, q, k_cache, v_cache, params, page_table, seqused_k, out, lse)`` when it is paged,
    ``fn(stream, q, k, v, params, cu_seqlens_q, cu_seqlens_k, out, lse)`` when it is varlen,
    ``fn(stream, q, k, v, params, seg_tiles, seg_rows, kv_ids, out, lse)`` with segment ids,
    ``fn(stream, q, k, v, params, tile_counter, out, lse)`` with dynamic tiles (after the
    segment tables with segment ids),
    ``fn(stream, q, k, v, params, descale, out, lse)`` when it is FP8 (paged or varlen FP8:
    the descale follows seqused_k or cu_seqlens_k);
    with max logits (FwdConfig.max_logits) a ``max_logits`` output follows lse."""
    kernel = FlashAttentionForwardSm90(cfg)
    if cfg.fp8 and cfg.paged:
        @cute.jit
        def sm90_fwd_fp8_paged(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                               v: cute.Tensor, params: cute.Tensor, page_table: cute.Tensor,
                               seqused_k: cute.Tensor, descale: cute.Tensor, out: cute.Tensor,
                               lse: cute.Tensor):
            kernel(stream, q, k, v, params, out, lse, page_table, seqused_k, mDescale=descale)

        return sm90_fwd_fp8_paged
    if cfg.fp8 and cfg.varlen:
        @cute.jit
        def sm90_fwd_fp8_varlen(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                                v: cute.Tensor, params: cute.Tensor, cu_seqlens_q: cute.Tensor,
                                cu_seqlens_k: cute.Tensor, descale: cute.Tensor,
                                out: cute.Tensor, lse: cute.Tensor):
            kernel(stream, q, k, v, params, out, lse, mCuSeqlensQ=cu_seqlens_q,
                   mCuSeqlensK=cu_seqlens_k, mDescale=descale)

        return sm90_fwd_fp8_varlen
    if cfg.fp8:
        @cute.jit
        def sm90_fwd_fp8(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                         v: cute.Tensor, params: cute.Tensor, descale: cute.Tensor,
                         out: cute.Tensor, lse: cute.Tensor):
            kernel(stream, q, k, v, params, out, lse, mDescale=descale)

        return sm90_fwd_fp8
    if cfg.paged:
        @cute.jit
        def sm90_fwd_paged(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                           v: cute.Tensor, params: cute.Tensor, page_table: cute.Tensor,
                           seqused_k: cute.Tensor, out: cute.Tensor, lse: cute.Tensor):
            kernel(stream, q, k, v, params, out, lse, page_table, seqused_k)

        return sm90_fwd_paged
    if cfg.varlen:
        @cute.jit
        def sm90_fwd_varlen(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                            v: cute.Tensor, params: cute.Tensor, cu_seqlens_q: cute.Tensor,
                            cu_seqlens_k: cute.Tensor, out: cute.Tensor, lse: cute.Tensor):
            kernel(stream, q, k, v, params, out, lse, mCuSeqlensQ=cu_seqlens_q,
                   mCuSeqlensK=cu_seqlens_k)

        return sm90_fwd_varlen
    if cfg.segments and cfg.max_logits:
        @cute.jit
        def sm90_fwd_segments_max_logits(
                stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
                params: cute.Tensor, seg_tiles: cute.Tensor, seg_rows: cute.Tensor,
                kv_ids: cute.Tensor, out: cute.Tensor, lse: cute.Tensor, max_logits: cute.Tensor):
            kernel(stream, q, k, v, params, out, lse, mSegTiles=seg_tiles, mSegRows=seg_rows,
                   mKvIds=kv_ids, mMaxLogits=max_logits)

        return sm90_fwd_segments_max_logits
    if cfg.max_logits:
        @cute.jit
        def sm90_fwd_max_logits(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                                v: cute.Tensor, params: cute.Tensor, out: cute.Tensor,
                                lse: cute.Tensor, max_logits: cute.Tensor):
            kernel(stream, q, k, v, params, out, lse, mMaxLogits=max_logits)

        return sm90_fwd_max_logits
    if cfg.segments and cfg.dynamic_tiles:
        @cute.jit
        def sm90_fwd_segments_dynamic(
                stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
                params: cute.Tensor, seg_tiles: cute.Tensor, seg_rows: cute.Tensor,
                kv_ids: cute.Tensor, tile_counter: cute.Tensor, out: cute.Tensor,
                lse: cute.Tensor):
            kernel(stream, q, k, v, params, out, lse, mSegTiles=seg_tiles, mSegRows=seg_rows,
                   mKvIds=kv_ids, mTileCounter=tile_counter)

        return sm90_fwd_segments_dynamic
    if cfg.segments:
        @cute.jit
        def sm90_fwd_segments(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                              v: cute.Tensor, params: cute.Tensor, seg_tiles: cute.Tensor,
                              seg_rows: cute.Tensor, kv_ids: cute.Tensor, out: cute.Tensor,
                              lse: cute.Tensor):
            kernel(stream, q, k, v, params, out, lse, mSegTiles=seg_tiles, mSegRows=seg_rows,
                   mKvIds=kv_ids)

        return sm90_fwd_segments
    if cfg.dynamic_tiles:
        @cute.jit
        def sm90_fwd_dynamic(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                             v: cute.Tensor, params: cute.Tensor, tile_counter: cute.Tensor,
                             out: cute.Tensor, lse: cute.Tensor):
            kernel(stream, q, k, v, params, out, lse, mTileCounter=tile_counter)

        return sm90_fwd_dynamic

    @cute.jit
    def sm90_fwd(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
                 params: cute.Tensor, out: cute.Tensor, lse: cute.Tensor):
        kernel(stream, q, k, v, params, out, lse)

    return sm90_fwd
