"""The public attention API: validate and canonicalise once, then dispatch.

Dimension letters: B batch, Sq query length, Sk key length, H query heads, Hkv key/value heads
(H a multiple of Hkv: MHA when equal, GQA when between, MQA when Hkv = 1), D query/key head dim,
Dv value head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa4 import autodiff
from jax_fa4.dispatch import IMPLEMENTATIONS, resolve_implementation

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

Window = tuple[int | None, int | None]


@dataclass(frozen=True)
class AttentionOptions:
    """Canonical, hashable options of one attention call (what the autodiff rule closes over)."""

    softmax_scale: float
    window: Window  # (left, right); causal is (left, 0)
    softcap: float
    implementation: str  # resolved: "reference" | "sm90" | "sm100"
    forced: bool  # the caller named the implementation: no silent fallback
    deterministic: bool = False  # bitwise-reproducible gradients

    @property
    def causal(self) -> bool:
        return self.window[1] == 0


# -- input checks: one named function each, messages say what was expected and what came ------
def _check_array(name: str, x: Any) -> None:
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise TypeError(f"{name} must be a jax.Array (or numpy array), got {type(x).__name__}")


def _check_rank(name: str, x: Any, layout: str) -> None:
    if x.ndim != 4:
        raise ValueError(f"{name} must have rank 4 with layout {layout}, got shape {x.shape}")


def _check_dtypes(q: Any, k: Any, v: Any) -> None:
    if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"q must have dtype bfloat16, float16 or float32, got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")


def _check_shapes(q: Any, k: Any, v: Any) -> None:
    b, _, h, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {q.shape}, k {k.shape}, v {v.shape} "
                         "(expected the same B in dim 0)")
    if k.shape[3] != d:
        raise ValueError(f"k head_dim must equal q head_dim {d}: q {q.shape}, k {k.shape}")
    if v.shape[1] != k.shape[1] or v.shape[2] != k.shape[2]:
        raise ValueError(f"v must have k's (Sk, Hkv) = {k.shape[1:3]}, got v {v.shape}")
    hkv = k.shape[2]
    if hkv == 0 or h % hkv:
        raise ValueError(f"q heads H={h} must be a positive multiple of k/v heads Hkv={hkv}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if 0 in x.shape:
            raise ValueError(f"{name} must have no zero-sized dimension, got shape {x.shape}")


def _check_window(window_size: Any) -> Window:
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    out = []
    for side, w in zip(("left", "right"), window_size):
        if w is None:
            out.append(None)
            continue
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)):
            raise TypeError(f"window_size {side} must be None or an int, got {w!r}")
        if w < 0:
            raise ValueError(f"window_size {side} must be >= 0 or None (unbounded), got {w}")
        out.append(int(w))
    return out[0], out[1]


def _check_scalar(name: str, x: Any, *, allow_zero: bool) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must be a Python float, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x) or x < 0 or (x == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, "
                         f"got {x}")
    return x


def canonicalize(q: Any, k: Any, v: Any, *, softmax_scale: float | None, causal: bool,
                 window_size: Any, softcap: float, implementation: str | None,
                 deterministic: bool = False) -> AttentionOptions:
    """Validate the inputs and options of one call and return its canonical options."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_array(name, x)
    _check_rank("q", q, "(B, Sq, H, D)")
    _check_rank("k", k, "(B, Sk, Hkv, D)")
    _check_rank("v", v, "(B, Sk, Hkv, Dv)")
    _check_dtypes(q, k, v)
    _check_shapes(q, k, v)
    left, right = _check_window(window_size)
    for name, flag in (("causal", causal), ("deterministic", deterministic)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if causal:
        right = 0
    scale = (1.0 / math.sqrt(q.shape[3]) if softmax_scale is None
             else _check_scalar("softmax_scale", softmax_scale, allow_zero=False))
    cap = _check_scalar("softcap", softcap, allow_zero=True)
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    return AttentionOptions(scale, (left, right), cap, resolve_implementation(implementation),
                            forced=implementation is not None, deterministic=bool(deterministic))


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
    learnable_sink: jax.Array | None = None,
    segment_ids: Any = None,
    return_lse: bool = False,
    deterministic: bool = False,
    implementation: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Scaled dot-product attention, FlashAttention-4 semantics, differentiable.

    Args:
      q: queries ``(B, Sq, H, D)``; bfloat16 or float16 for the GPU kernels (float32 runs the
        reference).
      k: keys ``(B, Sk, Hkv, D)``, q's dtype; H must be a multiple of Hkv (GQA / MQA).
      v: values ``(B, Sk, Hkv, Dv)``, q's dtype.
      softmax_scale: multiplies ``q·k`` before the softmax; default ``1/sqrt(D)``.
      causal: mask keys after the query, aligned to the bottom right when ``Sq != Sk`` (query
        ``i`` sees keys up to ``i + Sk - Sq``). Same as ``window_size=(left, 0)``.
      window_size: ``(left, right)`` sliding window, each ``None`` (unbounded) or an int >= 0:
        query ``i`` sees keys ``j`` with ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``.
      softcap: if > 0, scores become ``softcap * tanh(scores / softcap)`` before the softmax.
      learnable_sink: optional ``(H,)`` floating logits (float32 recommended), one per query
        head, that join every row's softmax denominator with no value (FA4's attention sink):
        ``lse = logaddexp(lse_scores, sink)``; a row with no visible key then has lse = sink.
        Differentiable. The kernels run the attention and the sink joins their (out, lse)
        in float32 (its gradient too: ``jax_fa4.autodiff.attention_with_sink``).
      segment_ids: optional integer segment ids: one ``(B, S)`` array (self-attention,
        ``Sq == Sk``) or a pair ``(q_segment_ids (B, Sq), kv_segment_ids (B, Sk))``. Query
        ``i`` sees key ``j`` only if their ids are equal, on top of ``causal`` / ``window_size``
        (which keep their positions in the whole sequence). Runs the reference until the
        kernels take it; for packed variable-length batches see
        :func:`jax_fa4.flash_attention_varlen`.
      return_lse: also return the log-sum-exp of each row's scores (natural log, float32).
      deterministic: make the gradients bitwise reproducible from run to run. The default
        Hopper backward kernel reduce-adds dQ across key blocks in arrival order, so its dq is
        not; ``deterministic=True`` runs a kernel that adds them in a fixed order (0.7–1.05×
        the default kernel's speed on the H200, slowest without a mask at head dim 64). The
        sm100 backward kernel has the same ordered mode (compile-verified only).
      implementation: ``None`` picks the kernel for this GPU and falls back to the pure-JAX
        reference elsewhere; ``"reference"``, ``"sm90"`` or ``"sm100"`` force one (a forced
        kernel that cannot run raises an error saying why).

    Returns:
      ``out`` of shape ``(B, Sq, H, Dv)`` in q's dtype, and with ``return_lse`` also ``lse`` of
      shape ``(B, H, Sq)`` float32. Rows with no visible key give 0 and lse ``-inf``.

    Differentiable (``jax.grad``, also through ``lse``), and works under ``jax.jit``,
    ``jax.vmap`` (mapped axes are folded into the batch) and ``jax.export``.

    Backward: on Hopper (``implementation="sm90"``, the default there) the preprocess, main and
    dQ postprocess kernels; with ``"sm100"`` (opt-in: forced, or ``JAX_FA4_ENABLE_SM100=1``) the
    preprocess and the Blackwell backward kernel (head dims 64, 96, 128 with ``Dv == D`` and
    192 with ``Dv`` 128, the last two with 2-CTA MMAs; it compiles but has never run on
    hardware), else the reference's backward with a one-time ``RuntimeWarning`` naming the
    reason (e.g. head dim 256, which needs FA4's split 2-CTA kernels);
    elsewhere the preprocess (a kernel on GPUs) and the reference's explicit FlashAttention
    backward (also for calls the Hopper backward kernels do not cover).
    """
    opts = canonicalize(q, k, v, softmax_scale=softmax_scale, causal=causal,
                        window_size=window_size, softcap=softcap, implementation=implementation,
                        deterministic=deterministic)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if learnable_sink is None and segment_ids is None:
        out, lse = autodiff.attention(q, k, v, opts)
    elif segment_ids is None and opts.implementation != "reference":
        # the attention kernels, the sink joined in float32 around them (jax_fa4.autodiff)
        from jax_fa4 import varlen  # imports this module

        out, lse = autodiff.attention_with_sink(
            q, k, v, varlen.check_learnable_sink(learnable_sink, q.shape[2]), opts)
    else:  # the reference's custom_vjp until the kernels take segment ids
        from jax_fa4 import varlen  # imports this module

        out, lse = varlen.attention_with_extras(
            q, k, v, opts,
            learnable_sink=varlen.check_learnable_sink(learnable_sink, q.shape[2]),
            segment_ids=varlen.check_segment_ids(segment_ids, q, k))
    return (out, lse) if return_lse else out
