"""The launcher of the Blackwell (sm_100a) attention backward: the 1-CTA kernel (bwd.py) or the
2-CTA one (bwd_2cta.py, which extends it), as the config's ``two_cta`` says."""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass.cute as cute

from jax_fa4.kernels.sm100.bwd import FlashAttentionBackwardSm100
from jax_fa4.kernels.sm100.bwd_2cta import FlashAttentionBackwardSm100TwoCta
from jax_fa4.kernels.sm100.bwd_config import Sm100BwdConfig


def make_launcher(cfg: Sm100BwdConfig):
    """The `@cute.jit` launcher ``fn(stream, q, k, v, dout, lse_log2, delta, params, dq_accum,
    [dq_semaphore,] dk, dv)`` for this config (dq_accum / dq_semaphore updated in place): the
    2-CTA kernel (bwd_2cta.py) for ``two_cta`` configs, else the 1-CTA one (bwd.py); varlen
    configs: ``fn(stream, q, k, v, dout, lse_log2, delta, params, dq_accum, cu_seqlens_q,
    cu_seqlens_k, work, dk, dv)``; segment-id configs: ``fn(stream, q, k, v, dout, lse_log2,
    delta, params, dq_accum, seg_tiles, seg_keys, seg_rows, kv_ids, dk, dv)``."""
    kernel = (FlashAttentionBackwardSm100TwoCta if cfg.two_cta
              else FlashAttentionBackwardSm100)(cfg)

    if cfg.varlen:  # varlen_bwd_config.varlen_attention_backward_signature
        @cute.jit
        def sm100_bwd_varlen(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                             v: cute.Tensor, dout: cute.Tensor, lse_log2: cute.Tensor,
                             delta: cute.Tensor, params: cute.Tensor, dq_accum: cute.Tensor,
                             cu_seqlens_q: cute.Tensor, cu_seqlens_k: cute.Tensor,
                             work: cute.Tensor, dk: cute.Tensor, dv: cute.Tensor):
            # (cu_seqlens_q: the work rows carry the query offsets and lengths)
            kernel(stream, q, k, v, dout, lse_log2, delta, params, dq_accum, params, dk, dv,
                   cu_seqlens_k, work)

        return sm100_bwd_varlen

    if cfg.segments:  # segments_config.with_segment_tables
        @cute.jit
        def sm100_bwd_segments(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                               v: cute.Tensor, dout: cute.Tensor, lse_log2: cute.Tensor,
                               delta: cute.Tensor, params: cute.Tensor, dq_accum: cute.Tensor,
                               seg_tiles: cute.Tensor, seg_keys: cute.Tensor,
                               seg_rows: cute.Tensor, kv_ids: cute.Tensor, dk: cute.Tensor,
                               dv: cute.Tensor):
            kernel(stream, q, k, v, dout, lse_log2, delta, params, dq_accum, params, dk, dv,
                   mSegTiles=seg_tiles, mSegKeys=seg_keys, mSegRows=seg_rows, mKvIds=kv_ids)

        return sm100_bwd_segments

    if cfg.deterministic:
        @cute.jit
        def sm100_bwd_det(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor,
                          v: cute.Tensor, dout: cute.Tensor, lse_log2: cute.Tensor,
                          delta: cute.Tensor, params: cute.Tensor, dq_accum: cute.Tensor,
                          dq_semaphore: cute.Tensor, dk: cute.Tensor, dv: cute.Tensor):
            kernel(stream, q, k, v, dout, lse_log2, delta, params, dq_accum, dq_semaphore, dk,
                   dv)

        return sm100_bwd_det

    @cute.jit
    def sm100_bwd(stream: cuda.CUstream, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
                  dout: cute.Tensor, lse_log2: cute.Tensor, delta: cute.Tensor,
                  params: cute.Tensor, dq_accum: cute.Tensor, dk: cute.Tensor, dv: cute.Tensor):
        kernel(stream, q, k, v, dout, lse_log2, delta, params, dq_accum, params, dk, dv)

    return sm100_bwd
