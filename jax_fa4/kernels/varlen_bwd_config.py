"""The call contract of the varlen attention backward main kernels, shared by the Hopper
(``sm90/bwd_config.py``) and Blackwell (``sm100/bwd_config.py``) families, so that one work list
and one caller-side layout serve both: packed sequences, cu_seqlens, the caller's work list of
(sequence, key block) items. No compiler import (a config module)."""

from __future__ import annotations

from jax_fa4.kernels.spec import NUM_PARAMS, KernelSignature, TensorArg

#: Columns of a varlen backward work row (varlen_attention_backward_signature).
WORK_COLUMNS = 8


def varlen_attention_backward_signature(dtype: str, head_dim: int, head_dim_v: int,
                                        tile_m: int, gqa: bool) -> KernelSignature:
    """``fn(stream, q, k, v, dout, lse_log2, delta, params, dq_accum, cu_seqlens_q, cu_seqlens_k,
    work, dk, dv)`` of the varlen backward main kernels (nothing batched: ``jax.vmap`` is refused).

    q (1, total_q, H, D), k (1, total_k, Hkv, D), v (1, total_k, Hkv, Dv), dout (1, total_q, H,
    Dv): the sequences packed as one batch entry; lse_log2, delta (1, H, total_q) float32 (the
    preprocess of the packed out / dout); cu_seqlens_q / _k (batch + 1,) int32 the sequence
    boundaries. dq_accum (1, H, R·D) float32, input 7 aliased to output 0: sequence b's query
    block m owns tile row ``(cu_seqlens_q[b] + b·tile_m) // tile_m + m`` (the sequences' blocks
    never share a tile); R = (total_q // tile_m + batch)·tile_m rows suffice. work (W, 8) int32:
    CTA x takes work row x = (sequence b, key block n, cu_seqlens_q[b], cu_seqlens_k[b],
    seqlen_q(b), seqlen_k(b), b's first dq_accum tile, 0) (one row holds everything the CTA
    needs before its first load: a single round of independent loads, no dependent
    cu_seqlens read); sequence -1: nothing to do (lengths 0), -2 (the kernels' ZERO_PADDING):
    write zeros to the dk / dv rows outside every sequence (it reads cu_seqlens_k); its shape
    sets the grid (W, H). dk, dv (1, total_k, Hkv, ·) in ``dtype``, or float32 per query head
    (1, total_k, H, ·) when ``gqa``."""
    d, dv, tm = head_dim, head_dim_v, tile_m
    tq, tk, h, hkv, b, w = 300, 400, 4, 2, 3, 8
    hdk = h if gqa else hkv
    dkv_dtype = "float32" if gqa else dtype
    accum = TensorArg("dq_accum", "float32", (1, h, (tq // tm + b) * tm * d), (1, 1, tm * d),
                      batched=False)
    packed = lambda name, dt, t, hh, x: TensorArg(name, dt, (1, t, hh, x), (1, 1, 1, x),  # noqa
                                                  batched=False)
    inputs = (
        packed("q", dtype, tq, h, d), packed("k", dtype, tk, hkv, d),
        packed("v", dtype, tk, hkv, dv), packed("dout", dtype, tq, h, dv),
        TensorArg("lse_log2", "float32", (1, h, tq), (1, 1, 1), batched=False),
        TensorArg("delta", "float32", (1, h, tq), (1, 1, 1), batched=False),
        TensorArg("params", "float32", (NUM_PARAMS,), (NUM_PARAMS,), batched=False),
        accum,
        TensorArg("cu_seqlens_q", "int32", (b + 1,), (1,), batched=False),
        TensorArg("cu_seqlens_k", "int32", (b + 1,), (1,), batched=False),
        TensorArg("work", "int32", (w, WORK_COLUMNS), (1, WORK_COLUMNS), batched=False),
    )
    outputs = (accum, packed("dk", dkv_dtype, tk, hdk, d), packed("dv", dkv_dtype, tk, hdk, dv))
    return KernelSignature(inputs=inputs, outputs=outputs, aliases=((7, 0),))
