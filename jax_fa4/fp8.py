"""FP8 (e4m3) attention: the forward for prefill and inference, with descale factors.

``flash_attention(q, k, v, q_descale=..., k_descale=..., v_descale=...)`` with q, k, v in
``float8_e4m3fn`` computes the attention of the dequantised inputs ``x.astype(float32) ·
x_descale``: each descale is float32, one per (batch entry, kv head) — ``(B, Hkv)``, as
FlashAttention-3 takes them — or a scalar (broadcast); q's descale of kv head ``j`` applies to
the query heads of its group. The output is bfloat16 by default (``out_dtype``).

On Hopper the FP8 forward kernel runs (:class:`~jax_fa4.kernels.sm90.flash_fwd.
FlashAttentionForwardSm90` with ``FwdConfig.dtype == "float8_e4m3fn"``): e4m3 WGMMAs for Q·Kᵀ
and P·V, the q·k descale folded into the softmax scale and v's into the output's 1/Σ, P
rounded to e4m3 in registers. Its value operand must be K-major: :func:`kernel_values` passes v
transposed (keys contiguous), padded to a multiple of 32 keys and with each group of 32 keys
in the order the kernel's P fragment holds them (one XLA transpose of v per call). Elsewhere
the pure-JAX reference runs on the dequantised inputs in float32.

Forward only: the gradient of an FP8 call raises (train in bfloat16; quantise for inference).
:func:`quantize` turns bfloat16 / float32 tensors into e4m3 with per-(batch, head) descales.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa4.kernels.sm90.fwd_config import FP8_KEY_GROUP, fp8_value_permutation

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


#: fwd_config.fp8_value_permutation as an axis permutation: a group's source key
#: 16h + 8a + 2t + c, split as axes (h, a, t, c) of sizes (2, 2, 4, 2), goes to position
#: 16h + 4t + 2a + c, i.e. the axes in the order (h, t, a, c).
_GROUP_AXES = (2, 2, 4, 2)
_GROUP_ORDER = (0, 2, 1, 3)


@functools.cache
def _check_group_axes() -> None:
    """The axis form above reproduces fp8_value_permutation (checked once, on the host)."""
    keys = np.arange(FP8_KEY_GROUP).reshape(_GROUP_AXES).transpose(_GROUP_ORDER).reshape(-1)
    if tuple(keys) != fp8_value_permutation():
        raise AssertionError("fp8._GROUP_AXES/_GROUP_ORDER disagree with the kernel's "
                             "fp8_value_permutation")


def kernel_values(v: jax.Array) -> jax.Array:
    """v (B, Sk, Hkv, Dv) -> the FP8 kernel's vt (B, Hkv, Dv, Skp): keys padded with zeros to a
    multiple of 32, permuted within each group of 32 (fwd_config.fp8_value_permutation), and
    made the contiguous axis.

    Two XLA ops, kept apart by an optimization barrier: the permutation moves whole rows of
    Hkv·Dv bytes (coalesced on both sides), then a plain (keys, Hkv·Dv) transpose. As one op
    (or as a gather, the first version) XLA wrote the 1-byte elements one by one, several times
    slower (201-396 against 39-56 µs per call at S = 8k: value_transform_us in
    benchmarks/results/fp8-tiles-nvidia-h200-2026-12-03.json)."""
    _check_group_axes()
    b, sk, hkv, dv = v.shape
    group = FP8_KEY_GROUP
    skp = -(-sk // group) * group
    v = jnp.pad(v, ((0, 0), (0, skp - sk), (0, 0), (0, 0)))
    v = v.reshape(b, skp // group, *_GROUP_AXES, hkv, dv)
    v = v.transpose(0, 1, *(2 + i for i in _GROUP_ORDER), 6, 7).reshape(b, skp, hkv, dv)
    v = jax.lax.optimization_barrier(v)
    return v.transpose(0, 2, 3, 1)
