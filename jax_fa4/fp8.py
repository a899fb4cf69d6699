"""FP8 (e4m3) attention: the forward for prefill and inference, with descale factors.

``flash_attention(q, k, v, q_descale=..., k_descale=..., v_descale=...)`` with q, k, v in
``float8_e4m3fn`` computes the attention of the dequantised inputs ``x.astype(float32) ·
x_descale``: each descale is float32, one per (batch entry, kv head) — ``(B, Hkv)``, as
FlashAttention-3 takes them — or a scalar (broadcast); q's descale of kv head ``j`` applies to
the query heads of its group. The output is bfloat16 by default (``out_dtype``).

On Hopper the FP8 forward kernel runs (:class:`~jax_fa4.kernels.sm90.flash_fwd.
FlashAttentionForwardSm90` with ``FwdConfig.dtype == "float8_e4m3fn"``): e4m3 WGMMAs for Q·Kᵀ
and P·V, the q·k descale folded into the softmax scale and v's into the output's 1/Σ, P
rounded to e4m3 in registers. It takes q, k and v as stored, like the 16-bit kernel (V's
transpose into the K-major operand the e4m3 WGMMA reads happens in its shared memory).
Elsewhere the pure-JAX reference runs on the dequantised inputs in float32.

``flash_attention_paged`` takes an e4m3 KV cache (:func:`quantize_paged_cache`: one descale per
kv head, shared by every page and batch entry) with q in e4m3 or in bfloat16 / float16 / float32
(quantised by the call, :func:`quantize_grouped`); ``flash_attention_varlen`` packed e4m3 q, k,
v with one descale per (sequence, kv head) (:func:`dequantize_packed` is the rule).

Forward only: the gradient of an FP8 call raises (train in bfloat16; quantise for inference).
:func:`quantize` turns bfloat16 / float32 tensors into e4m3 with per-(batch, head) descales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: The FP8 dtype the kernels take.
FP8 = jnp.float8_e4m3fn
#: The largest finite e4m3 value.
E4M3_MAX = 448.0


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(x in float8_e4m3fn, descale (B, H) float32) of a (B, S, H, D) tensor, scaled per
    (batch entry, head) so that its largest magnitude maps to 448 (e4m3's largest value);
    ``x ≈ x_fp8.astype(float32) * descale[:, None, :, None]``. An all-zero head gets descale 1.
    For k and v, H is Hkv: their descales are what ``flash_attention`` takes; q's per query
    head must be reduced to one per kv head first (:func:`quantize_grouped`)."""
    x32 = jnp.asarray(x).astype(jnp.float32)
    if x32.ndim != 4:
        raise ValueError(f"x must have rank 4 with layout (B, S, H, D), got shape {x32.shape}")
    amax = jnp.max(jnp.abs(x32), axis=(1, 3))  # (B, H)
    descale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(jnp.float32)
    scaled = jnp.clip(x32 / descale[:, None, :, None], -E4M3_MAX, E4M3_MAX)
    return scaled.astype(FP8), descale


def quantize_grouped(q: jax.Array, num_kv_heads: int) -> tuple[jax.Array, jax.Array]:
    """:func:`quantize` for queries: one descale per (batch entry, kv head), shared by the
    H / Hkv query heads of each group (the kernels' and FlashAttention-3's convention)."""
    q = jnp.asarray(q)
    if q.ndim != 4:
        raise ValueError(f"q must have rank 4 with layout (B, Sq, H, D), got shape {q.shape}")
    b, s, h, d = q.shape
    if h % num_kv_heads:
        raise ValueError(f"q heads H={h} must be a multiple of num_kv_heads={num_kv_heads}")
    grouped = q.reshape(b, s, num_kv_heads, (h // num_kv_heads) * d)
    q8, descale = quantize(grouped)
    return q8.reshape(b, s, h, d), descale


def dequantize(x: jax.Array, descale: jax.Array) -> jax.Array:
    """x (B, S, H, D) in e4m3 -> float32 ``x · descale``, descale (B, Hkv) for H = g·Hkv heads
    (head h takes descale[:, h // g])."""
    b, _, h, _ = x.shape
    per_head = jnp.repeat(descale, h // descale.shape[1], axis=1)  # (B, H)
    return x.astype(jnp.float32) * per_head[:, None, :, None]


def dequantize_packed(x: jax.Array, descale: jax.Array, cu_seqlens: jax.Array) -> jax.Array:
    """Packed e4m3 tokens x (total, H, D) -> float32 ``x · descale`` (varlen), descale
    (num_sequences, Hkv): the tokens of sequence b, ``[cu_seqlens[b], cu_seqlens[b + 1])``,
    take row b (head h its kv head's, as :func:`dequantize`); the tokens outside every
    sequence take the nearest sequence's (they are never seen)."""
    seq = jnp.searchsorted(cu_seqlens, jnp.arange(x.shape[0]), side="right") - 1
    seq = jnp.clip(seq, 0, descale.shape[0] - 1)
    return dequantize(x[:, None], descale[seq])[:, 0]  # each token a batch entry of one


def quantize_paged_cache(k_cache: jax.Array, v_cache: jax.Array
                         ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(k_cache, v_cache in e4m3, k_descale (Hkv,), v_descale (Hkv,) float32) of a paged KV
    cache ``(num_pages, page_size, Hkv, D / Dv)``: one descale per kv head, shared by every
    page (so by every batch entry that owns one), mapping the head's largest magnitude over
    the whole cache to 448; ``cache ≈ cache_fp8.astype(float32) * descale[:, None]`` per head.
    What ``flash_attention_paged(q, k8, v8, page_table, seqused_k, k_descale=...,
    v_descale=...)`` takes.

    A serving stack quantises as it fills pages, with a scale fixed beforehand (from
    calibration, or this function on a representative cache): the call applies one descale
    per kv head to every page, so a page written later must be quantised with the same
    descale (``jnp.clip(x / descale[:, None], -448, 448).astype(float8_e4m3fn)``), never
    with a scale of its own; values beyond the calibrated range saturate at ±448."""
    out = []
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        cache = jnp.asarray(cache)
        if cache.ndim != 4:
            raise ValueError(f"{name} must have rank 4 with layout (num_pages, page_size, Hkv, "
                             f"D), got shape {cache.shape}")
        # the pages as one batch entry: quantize's (1, Hkv) descale is one per kv head
        pages, size, hkv, d = cache.shape
        c8, descale = quantize(cache.reshape(1, pages * size, hkv, d))
        out.append((c8.reshape(cache.shape), descale[0]))
    (k8, k_descale), (v8, v_descale) = out
    return k8, v8, k_descale, v_descale
