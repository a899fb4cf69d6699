"""Backward preprocess kernel (any arch >= sm_80; shipped for sm_90a and sm_100a).

For every (batch b, head h, query row s):

* ``delta[b, h, s] = sum_d out[b, s, h, d] * dout[b, s, h, d]`` accumulated in float32;
* ``lse_log2[b, h, s] = lse[b, h, s] * log2(e)``, +inf where ``lse`` is -inf (a row with no visible
  key), so the backward's ``exp2(score * scale_log2 - lse_log2)`` is exactly 0 for it, and a
  margin on huge rows so that P <= 1 there (preprocess_config.PreprocessConfig).

Layouts are the JAX row-major ones: ``out``/``dout`` (B, S, H, Dv), ``lse``/``delta``/``lse_log2``
(B, H, S). B, S and H are dynamic; Dv is fixed by the config.

Work split: a row's Dv elements are read as 16-byte vectors by ``threads_per_row`` consecutive lanes
(a power of two), which then reduce their partial sums with butterfly shuffles. A CTA of 128 threads
covers ``128 / threads_per_row`` rows of one (batch, head); the grid is (row blocks, H, B).

With ``zero_dq_accum`` the kernel also clears the dense backward's float32 ``dq_accum`` (B, H, N):
CTA ``r`` of a (batch, head) stores zeros to the r-th of the row blocks' equal shares of its N
floats, 16 bytes a store (PreprocessConfig).
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from jax_fa4.kernels.preprocess_config import (DQ_ACCUM_VECTOR, LSE_LOG2_MARGIN,
                                               LSE_LOG2_MARGIN_FROM, PreprocessConfig)
from jax_fa4.kernels.spec import LOG2_E

_NUM_THREADS = 128
_VEC_BYTES = 16


def _dtype(name: str) -> type[cutlass.Numeric]:
    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[name]


class BwdPreprocess:
    """``delta = rowsum(out * dout)`` and ``lse * log2(e)`` in one pass over ``out`` and
    ``dout``."""

    def __init__(self, config: PreprocessConfig):
        self.dtype = _dtype(config.dtype)
        self.head_dim_v = config.head_dim_v
        self.vec = _VEC_BYTES * 8 // self.dtype.width
        self.num_chunks = self.head_dim_v // self.vec
        # Largest power of two <= num_chunks, at most a warp: lanes sharing a row stay in one warp.
        self.threads_per_row = min(32, 1 << (self.num_chunks.bit_length() - 1))
        self.chunks_per_thread = -(-self.num_chunks // self.threads_per_row)
        self.rows_per_cta = _NUM_THREADS // self.threads_per_row
        self.zero_dq_accum = config.zero_dq_accum

    @cute.jit
    def __call__(
        self,
        stream: cuda.CUstream,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mDelta: cute.Tensor,
        mLSElog2: cute.Tensor,
        mDqAccum: cute.Tensor | None = None,
    ):
        if const_expr(mO.element_type != self.dtype or mdO.element_type != self.dtype):
            raise TypeError("out and dout must have the config's dtype")
        if const_expr(self.zero_dq_accum != (mDqAccum is not None)):
            raise TypeError("dq_accum is the output of a zero_dq_accum config, and only of it")
        seqlen = mO.shape[1]
        grid = (cute.ceil_div(seqlen, self.rows_per_cta), mO.shape[2], mO.shape[0])
        self.kernel(mO, mdO, mLSE, mDelta, mLSElog2, mDqAccum).launch(
            grid=grid, block=[_NUM_THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mDelta: cute.Tensor,
        mLSElog2: cute.Tensor,
        mDqAccum: cute.Tensor | None,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        row_block, head, batch = cute.arch.block_idx()
        seqlen = mO.shape[1]
        lane_in_row = tidx % self.threads_per_row
        row = row_block * self.rows_per_cta + tidx // self.threads_per_row

        acc = Float32(0.0)
        if row < seqlen:
            gO = mO[batch, row, head, None]
            gdO = mdO[batch, row, head, None]
            for i in cutlass.range_constexpr(self.chunks_per_thread):
                chunk = lane_in_row + i * self.threads_per_row
                if (const_expr((i + 1) * self.threads_per_row <= self.num_chunks)
                        or chunk < self.num_chunks):
                    o = cute.local_tile(gO, (self.vec,), (chunk,)).load().to(Float32)
                    do = cute.local_tile(gdO, (self.vec,), (chunk,)).load().to(Float32)
                    acc += (o * do).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        for k in cutlass.range_constexpr(int(math.log2(self.threads_per_row))):
            acc += cute.arch.shuffle_sync_bfly(acc, offset=self.threads_per_row >> (k + 1))
        if row < seqlen and lane_in_row == 0:
            mDelta[batch, head, row] = acc
            lse = mLSE[batch, head, row]
            lse_log2 = Float32(math.inf)
            if lse != Float32(-math.inf):
                lse_log2 = lse * Float32(LOG2_E)
                if abs(lse_log2) >= Float32(LSE_LOG2_MARGIN_FROM):
                    lse_log2 = lse_log2 + abs(lse_log2) * Float32(LSE_LOG2_MARGIN)
            mLSElog2[batch, head, row] = lse_log2
        if const_expr(self.zero_dq_accum):
            self.clear_share(mDqAccum[batch, head, None], row_block, tidx)

    @cute.jit
    def clear_share(self, gAccum: cute.Tensor, share: cutlass.Int32, tidx: cutlass.Int32):
        """Zeros to share ``share`` of the row blocks' equal shares of ``gAccum`` (N floats),
        one ``DQ_ACCUM_VECTOR``-float store per thread and step."""
        vectors = gAccum.shape[0] // DQ_ACCUM_VECTOR
        shares, _, _ = cute.arch.grid_dim()
        per_share = (vectors + shares - 1) // shares
        first = share * per_share
        end = cutlass.min(first + per_share, vectors)
        zeros = cute.make_rmem_tensor(DQ_ACCUM_VECTOR, Float32)
        zeros.fill(0.0)
        for i in cutlass.range(first + tidx, end, _NUM_THREADS, unroll=1):
            cute.autovec_copy(zeros, cute.local_tile(gAccum, (DQ_ACCUM_VECTOR,), (i,)))


def make_launcher(cfg: PreprocessConfig):
    """The `@cute.jit` launcher ``fn(stream, out, dout, lse, delta, lse_log2[, dq_accum])`` for
    this config (dq_accum: a ``zero_dq_accum`` config's third output)."""
    kernel = BwdPreprocess(cfg)
    if not cfg.zero_dq_accum:
        return kernel

    @cute.jit
    def preprocess_zero_dq_accum(stream: cuda.CUstream, out: cute.Tensor, dout: cute.Tensor,
                                 lse: cute.Tensor, delta: cute.Tensor, lse_log2: cute.Tensor,
                                 dq_accum: cute.Tensor):
        kernel(stream, out, dout, lse, delta, lse_log2, dq_accum)

    return preprocess_zero_dq_accum
