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
