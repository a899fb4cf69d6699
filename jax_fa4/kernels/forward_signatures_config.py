"""Forward-kernel signatures the GPU families share beyond :mod:`jax_fa4.kernels.spec`'s dense,
paged and varlen ones (a config module: importable without the compiler, no kernel imports).
"""

from __future__ import annotations

import dataclasses

from jax_fa4.kernels.segments_config import SEG_ROW_COLUMNS, SEG_TILE_COLUMNS
from jax_fa4.kernels.spec import KernelSignature, TensorArg, attention_forward_signature


def with_max_logits(sig: KernelSignature) -> KernelSignature:
    """``sig`` (a dense or segment-id forward's) with a third output after lse: max_logits
    (B, H, Sq) float32, each row's largest visible score (the configs' ``max_logits`` field)."""
    lse = next(arg for arg in sig.outputs if arg.name == "lse")
    return dataclasses.replace(
        sig, outputs=sig.outputs + (dataclasses.replace(lse, name="max_logits"),))


def segments_attention_forward_signature(dtype: str, head_dim: int, head_dim_v: int
                                         ) -> KernelSignature:
    """``fn(stream, q, k, v, params, seg_tiles, seg_rows, kv_ids, out, lse)`` of the forward
    kernels with segment ids: :func:`spec.attention_forward_signature`'s tensors plus
    seg_tiles (B, num_query_tiles, 8) int32, seg_rows (B, Sq, 4) int32 (columns SEG_*) and
    kv_ids (B, Sk) int32, the keys' segment ids (kernels/segments_config.py)."""
    base = attention_forward_signature(dtype, head_dim, head_dim_v)
    b, sq, _, _ = base.inputs[0].sample_shape
    sk = base.inputs[1].sample_shape[1]
    extra = (
        TensorArg("seg_tiles", "int32", (b, sq // 64, SEG_TILE_COLUMNS), (1, 1, SEG_TILE_COLUMNS)),
        TensorArg("seg_rows", "int32", (b, sq, SEG_ROW_COLUMNS), (1, 1, SEG_ROW_COLUMNS)),
        TensorArg("kv_ids", "int32", (b, sk), (1, 1)),
    )
    return dataclasses.replace(base, inputs=base.inputs + extra)
