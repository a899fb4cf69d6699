"""Backward postprocess for Hopper (sm_90a): dq = dq_accum · softmax_scale, in the input dtype.

dq_accum (B, H, Sq_pad·D) float32 holds, per (b, h) and query block m of tile_m rows, the dQ
accumulators of the main kernel's two dQ warpgroups in WGMMA fragment order (bwd_config.py).
This kernel rebuilds the same tiled MMA (bwd_common.make_tiled_mma_dq) so that thread t of a
256-thread CTA loads exactly the registers thread t of the main kernel's MMA warpgroups
reduce-added (16-byte, fully coalesced loads), scales them, converts them to 16 bits, writes them
to shared memory in tile order with stmatrix and TMA-stores the (tile_m, D) tile into dq
(B, Sq, H, D); TMA clips the rows past seqlen_q. Grid: (ceil(Sq / tile_m), H, B).

Call: ``fn(stream, dq_accum, params, dq)``; params float32 (4,), params[PARAM_SCALE] =
softmax_scale.

Varlen (``cfg.varlen``): ``fn(stream, dq_accum, params, cu_seqlens_q, tile_seq, dq)``, dq packed
(1, total_q, H, D). Grid (tiles + 1, H): CTA t < tiles converts dq_accum tile t into rows of the
sequence ``tile_seq[t]`` owns it (nothing if -1): its query block m = t − the sequence's first
tile, TMA-stored when the block lies inside the sequence, else stored row by row below its end
(the rows after belong to the next sequence); CTA t = tiles writes zeros to the rows outside
every sequence.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from jax_fa4.kernels.common.convert import convert_f32_pairs
from jax_fa4.kernels.common.geometry import packed_span
from jax_fa4.kernels.common.layout import select_modes
from jax_fa4.kernels.common.rows import store_rows, zero_padding_rows
from jax_fa4.kernels.common.views import sequence
from jax_fa4.kernels.sm90.bwd_common import dq_fragment_view, make_tiled_mma_dq
from jax_fa4.kernels.sm90.common import make_smem_layout
from jax_fa4.kernels.sm90.bwd_config import BwdPostprocessConfig
from jax_fa4.kernels.spec import PARAM_SCALE

_NUM_THREADS = 256


class BwdPostprocessSm90:
    def __init__(self, cfg: BwdPostprocessConfig):
        cfg.validate()
        self.dtype = cutlass.BFloat16 if cfg.dtype == "bfloat16" else cutlass.Float16
        self.is_bf16 = cfg.dtype == "bfloat16"
        self.hdim, self.tile_m = cfg.head_dim, cfg.tile_m
        self.varlen = cfg.varlen
        self.dq_regs = self.tile_m * self.hdim // _NUM_THREADS
        self.dq_wg_elems = 128 * self.dq_regs

    @cute.jit
    def __call__(self, stream: cuda.CUstream, mdQacc: cute.Tensor, mParams: cute.Tensor,
                 mdQ: cute.Tensor, mCuSeqlensQ: cute.Tensor | None = None,
                 mTileSeq: cute.Tensor | None = None):
        if const_expr(self.varlen != (mCuSeqlensQ is not None) or
                      self.varlen != (mTileSeq is not None)):
            raise TypeError("cu_seqlens_q and tile_seq are passed exactly when the config is "
                            "varlen")
        if const_expr(mdQ.element_type != self.dtype):
            raise TypeError(f"dq: expected {self.dtype}, got {mdQ.element_type}")
        if const_expr(mdQacc.element_type != Float32 or mParams.element_type != Float32):
            raise TypeError("dq_accum and params must be float32")
        D = self.hdim
        mdQ = cute.make_tensor(mdQ.iterator, cute.make_layout(
            (mdQ.shape[1], D, mdQ.shape[2], mdQ.shape[0]),
            stride=(mdQ.stride[1], 1, mdQ.stride[2], mdQ.stride[0])))  # (Sq, D, H, B)
        mdQacc = select_modes(mdQacc, (2, 1, 0))  # (L, H, B)
        mma_dq = make_tiled_mma_dq(self.dtype, self.tile_m, D)
        # swizzle atom no wider than one warpgroup's column slice (stmatrix partitions by it)
        wg_n = 1 if self.tile_m == 128 else 2
        sdQ_layout = make_smem_layout(self.dtype, self.tile_m, D, D // wg_n)
        tma_atom, tma_dQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mdQ, sdQ_layout, (self.tile_m, D))

        @cute.struct
        class SharedStorage:
            sdQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdQ_layout)], 1024]

        grid = (cute.ceil_div(mdQ.shape[0], self.tile_m), mdQ.shape[2], mdQ.shape[3])
        if const_expr(self.varlen):  # every dq_accum tile, and one CTA for the padding rows
            grid = (mTileSeq.shape[0] + 1, mdQ.shape[2], 1)
        self.kernel(mdQacc, mParams, tma_dQ, tma_atom, sdQ_layout, mma_dq, SharedStorage,
                    mdQ if const_expr(self.varlen) else None, mCuSeqlensQ, mTileSeq).launch(
            grid=grid, block=[_NUM_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdQacc: cute.Tensor, mParams: cute.Tensor, mdQ: cute.Tensor,
               tma_atom: cute.CopyAtom, sdQ_layout: cute.ComposedLayout, mma_dq: cute.TiledMma,
               SharedStorage: cutlass.Constexpr, mdQ_rows: cute.Tensor | None,
               mCuSeqlensQ: cute.Tensor | None, mTileSeq: cute.Tensor | None):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        if const_expr(self.varlen):
            num_tiles = mTileSeq.shape[0]
            if m_block == num_tiles:
                zero_padding_rows(mdQ_rows, mCuSeqlensQ, head, (self.tile_m, self.hdim),
                                  _NUM_THREADS, tidx, Int32(0), Int32(1))
            else:
                seq = mTileSeq[m_block]
                if seq >= 0:
                    self.convert(mdQacc, mParams, mdQ, tma_atom, sdQ_layout, mma_dq,
                                 SharedStorage, tidx, m_block, head, batch, mdQ_rows,
                                 mCuSeqlensQ, seq)
        else:
            self.convert(mdQacc, mParams, mdQ, tma_atom, sdQ_layout, mma_dq, SharedStorage,
                         tidx, m_block, head, batch)

    @cute.jit
    def convert(self, mdQacc: cute.Tensor, mParams: cute.Tensor, mdQ: cute.Tensor,
                tma_atom: cute.CopyAtom, sdQ_layout: cute.ComposedLayout, mma_dq: cute.TiledMma,
                SharedStorage: cutlass.Constexpr, tidx: Int32, m_block: Int32, head: Int32,
                batch: Int32, mdQ_rows: cute.Tensor | None = None,
                mCuSeqlensQ: cute.Tensor | None = None, seq=None):
        """dq_accum tile m_block -> dq. Varlen (``mdQ_rows``, the packed dq, given): the tile is
        query block m_block − (its first tile) of sequence ``seq``."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom)
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)

        thr_mma = mma_dq.get_slice(tidx)
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.hdim)), Float32)
        acc_flat = cute.make_tensor(acc.iterator, cute.make_layout((4, self.dq_regs // 4)))
        wg_idx = tidx // 128
        chunk = cute.local_tile(mdQacc[None, head, batch], (self.dq_wg_elems,),
                                (m_block * 2 + wg_idx,))
        cute.autovec_copy(dq_fragment_view(chunk, self.dq_regs, tidx % 128), acc_flat)
        scale = mParams[PARAM_SCALE]
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = acc[i] * scale
        r16 = cute.make_rmem_tensor(acc.layout, self.dtype)
        convert_f32_pairs(acc, r16, self.is_bf16)

        st_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        st = cute.make_tiled_copy_C(st_atom, mma_dq).get_slice(tidx)
        cute.copy(st, st.retile(r16), st.partition_D(sdQ))
        cute.arch.fence_proxy("async.shared", space="cta")  # st.shared -> TMA store
        cute.arch.sync_threads()
        if const_expr(mdQ_rows is not None):
            q_offset, seqlen_q = packed_span(mCuSeqlensQ, seq)
            m_local = m_block - (q_offset + seq * self.tile_m) // self.tile_m
            rows = seqlen_q - m_local * self.tile_m
            if rows < self.tile_m:  # the sequence's last, partial block: row stores
                gdQ = cute.local_tile(sequence(mdQ_rows, head, 0, q_offset),
                                      (self.tile_m, self.hdim), (m_local, 0))
                store_rows(sdQ, gdQ, rows, _NUM_THREADS, tidx)
            else:
                self.store_tile(sdQ, mdQ, tma_atom, warp_idx, m_local, head, batch, q_offset)
        else:
            self.store_tile(sdQ, mdQ, tma_atom, warp_idx, m_block, head, batch)

    @cute.jit
    def store_tile(self, sdQ: cute.Tensor, mdQ: cute.Tensor, tma_atom: cute.CopyAtom,
                   warp_idx: Int32, m_block: Int32, head: Int32, batch: Int32, q_offset=None):
        """TMA-store the dq tile (rows past seqlen_q clipped by TMA; varlen: from the sequence's
        row ``q_offset`` on) by warp 0."""
        if warp_idx == 0:
            gdQ = cute.local_tile(sequence(mdQ, head, batch, q_offset),
                                  (self.tile_m, self.hdim), (m_block, 0))
            tsdQ, tgdQ = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1),
                                               cute.group_modes(sdQ, 0, 2),
                                               cute.group_modes(gdQ, 0, 2))
            cute.copy(tma_atom, tsdQ, tgdQ)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)


def make_launcher(cfg: BwdPostprocessConfig):
    """The `@cute.jit` launcher ``fn(stream, dq_accum, params, dq)`` for this config."""
    kernel = BwdPostprocessSm90(cfg)

    if cfg.varlen:
        @cute.jit
        def sm90_bwd_postprocess_varlen(stream: cuda.CUstream, dq_accum: cute.Tensor,
                                        params: cute.Tensor, cu_seqlens_q: cute.Tensor,
                                        tile_seq: cute.Tensor, dq: cute.Tensor):
            kernel(stream, dq_accum, params, dq, cu_seqlens_q, tile_seq)

        return sm90_bwd_postprocess_varlen

    @cute.jit
    def sm90_bwd_postprocess(stream: cuda.CUstream, dq_accum: cute.Tensor, params: cute.Tensor,
                             dq: cute.Tensor):
        kernel(stream, dq_accum, params, dq)

    return sm90_bwd_postprocess
