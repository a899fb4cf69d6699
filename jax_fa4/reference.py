"""Pure-JAX attention with FlashAttention-4 semantics: the test oracle and CPU fallback.

Dimension letters used throughout:

- ``B``: batch size.
- ``Sq``, ``Sk``: query and key/value sequence lengths.
- ``H``: query heads; ``Hkv``: key/value heads (``H`` a multiple of ``Hkv``; GQA/MQA).
- ``G = H // Hkv``: query heads per key/value head; query head ``h`` uses key/value head
  ``h // G``. Internally query heads are split as ``(Hkv, G)``.
- ``D``: head dim of queries and keys; ``Dv``: head dim of values and of the output.

Layouts: q ``(B, Sq, H, D)``, k ``(B, Sk, Hkv, D)``, v ``(B, Sk, Hkv, Dv)``,
out ``(B, Sq, H, Dv)``, lse ``(B, H, Sq)`` float32.

Semantics (FA4's):

- scores ``S = softmax_scale * q . k``, accumulated in float32;
- with ``softcap > 0``, ``S = softcap * tanh(S / softcap)``;
- ``window = (left, right)``, each ``None`` (unbounded) or an int >= 0: query ``i`` sees key
  ``j`` iff ``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (bottom-right alignment;
  causal is ``(None, 0)``), see :func:`visible_mask`;
- ``lse`` is the natural-log logsumexp of the visible scores of a row; a row with no
  visible key gets output 0 and ``lse = -inf`` (its gradients are 0), never NaN.

Optional extras (all functions, keyword-only, default off):

- ``learnable_sink`` ``(H,)``: one logit per query head that joins every row's softmax
  denominator with no value (not scaled, not capped, never masked):
  ``out_i = sum_j e^{s_ij} v_j / (sum_j e^{s_ij} + e^{sink})`` and
  ``lse_i = logaddexp(lse_scores_i, sink)``. A row with no visible key then gets output 0 and
  ``lse = sink``. Its gradient is ``d sink_h = -sum_{b,i} e^{sink_h - lse_bhi} delta_bhi``
  (see :func:`sink_gradient`); dq, dk, dv are unchanged given that lse.
- ``q_segment_ids`` ``(B, Sq)`` / ``kv_segment_ids`` ``(B, Sk)`` int: query ``i`` sees key ``j``
  only if their ids are equal, on top of the window rule.
- ``q_positions`` ``(B, Sq)`` / ``kv_positions`` ``(B, Sk)`` int: the positions the window rule
  compares (default ``i + Sk - Sq`` and ``j``, i.e. bottom-right alignment). Packed
  variable-length batches (:func:`jax_fa4.flash_attention_varlen`) use them to align each sequence
  on its own.

The masking rule lives in :func:`visible_mask` only.

Every matmul and reduction accumulates in float32 (``Precision.HIGHEST``, so no TF32 on GPU).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

__all__ = [
    "Window",
    "attention",
    "attention_backward",
    "attention_blocked",
    "sink_gradient",
    "sink_gradient_from_rows",
    "sink_probability",
    "visible_mask",
]

Window = tuple[int | None, int | None]
"""``(left, right)`` attention window; ``None`` is unbounded, causal is ``(None, 0)``."""

_HIGHEST = lax.Precision.HIGHEST


def visible_mask(
    sq: int,
    sk: int,
    window: Window,
    *,
    k_start: int | jax.Array = 0,
    num_k: int | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
) -> jax.Array:
    """Which keys each query sees: the one place where the masking rule lives.

    Query ``i`` sees key ``j`` iff ``j < sk`` and
    ``kpos_j >= qpos_i - left`` (when ``left`` is not None) and
    ``kpos_j <= qpos_i + right`` (when ``right`` is not None) and, with segment ids,
    ``q_segment_ids[i] == kv_segment_ids[j]``. The positions default to
    ``qpos_i = i + sk - sq`` and ``kpos_j = j`` (bottom-right alignment).

    Args:
        sq: number of queries ``Sq``.
        sk: number of keys ``Sk``.
        window: ``(left, right)``, each ``None`` (unbounded) or an int >= 0.
        k_start: index of the first key of the block to build (may be traced, e.g. inside
            a scan over key blocks).
        num_k: number of keys in the block (default ``sk``). Keys at index ``>= sk``
            (padding of the last block) are never visible.
        q_segment_ids: (B, Sq) int segment id of each query; given together with
            ``kv_segment_ids``.
        kv_segment_ids: (B, num_k) int segment id of each key of the block.
        q_positions: (B, Sq) int position of each query for the window rule.
        kv_positions: (B, num_k) int position of each key of the block for the window rule.

    Returns:
        bool array ``(sq, num_k)``, or ``(B, sq, num_k)`` when any of the per-batch arrays is
        given; entry ``[.., i, c]`` is whether query ``i`` sees key ``k_start + c``.

    Raises:
        ValueError: if a window bound is negative, or only one of the segment ids is given.
    """
    left, right = window
    for bound in window:
        if bound is not None and bound < 0:
            raise ValueError(f"window bounds must be None or >= 0, got {window}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    num_k = sk if num_k is None else num_k
    j = k_start + jnp.arange(num_k)[None, :]
    batched = any(x is not None for x in (q_segment_ids, q_positions, kv_positions))
    # Positions as (.., Sq, 1) and (.., 1, num_k); a leading batch dim when given per batch.
    qpos = (jnp.arange(sq)[:, None] + (sk - sq) if q_positions is None
            else q_positions[:, :, None])
    kpos = j if kv_positions is None else kv_positions[:, None, :]
    mask = j < sk
    if left is not None:
        mask = mask & (kpos >= qpos - left)
    if right is not None:
        mask = mask & (kpos <= qpos + right)
    if q_segment_ids is not None:
        mask = mask & (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])
    if batched:
        b = next(x.shape[0] for x in (q_segment_ids, q_positions, kv_positions) if x is not None)
        return jnp.broadcast_to(mask, (b, sq, num_k))
    return jnp.broadcast_to(mask, (sq, num_k))


def _mask_scores(s: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked scores (B, Hkv, G, Sq, n) from a mask (Sq, n) or (B, Sq, n): -inf where hidden."""
    if mask.ndim == 3:
        mask = mask[:, None, None]
    return jnp.where(mask, s, -jnp.inf)


def _seen_queries(mask: jax.Array) -> jax.Array:
    """Whether each query sees at least one key: (Sq,) from a mask (Sq, n), (B, Sq) from
    (B, Sq, n)."""
    return jnp.any(mask, axis=-1)


def _seen_keys(mask: jax.Array) -> jax.Array:
    """Whether at least one query sees each key: (n,) from a mask (Sq, n), (B, n) from
    (B, Sq, n)."""
    return jnp.any(mask, axis=-2)


def _zero_unseen(x: jax.Array, seen: jax.Array, token_axis: int = 1) -> jax.Array:
    """``x`` with the tokens that ``seen`` (``(S,)`` or ``(B, S)``, bool) marks False set to 0.

    Padding tokens (varlen tokens outside every sequence, paged slots past ``seqused_k``,
    unused pages) may hold NaN or Inf. Their scores are masked to -inf, but a masked token
    still enters the products: ``P·V``, ``dS·K``, ``dSᵀ·Q``, ``Pᵀ·dO`` and ``dO·Vᵀ`` multiply
    its values by an exact 0, and ``0·NaN`` is NaN. A ``jnp.where`` on the loaded values (not a
    multiplication by the mask) keeps them out of every product; the result is unchanged for
    finite padding (those products were exact zeros), and under ``jax.grad`` the zeroed tokens
    get a zero gradient.

    Args:
        x: an array with the tokens along ``token_axis`` (and the batch first, when ``seen`` is
            per batch entry).
        seen: :func:`_seen_queries` or :func:`_seen_keys` of the mask.
        token_axis: the axis of ``x`` that ``seen`` indexes.
    """
    seen = seen if seen.ndim == 2 else seen[None]
    shape = [seen.shape[0]] + [1] * (x.ndim - 1)
    shape[token_axis] = seen.shape[1]
    return jnp.where(seen.reshape(shape), x, jnp.zeros((), x.dtype))


def _check_extras(
    q: jax.Array,
    k: jax.Array,
    learnable_sink: jax.Array | None,
    segments: tuple[jax.Array | None, ...],
) -> None:
    """Shapes of the optional sink (H,) and of the per-batch segment ids / positions."""
    b, sq, h, _ = q.shape
    sk = k.shape[1]
    if learnable_sink is not None and learnable_sink.shape != (h,):
        raise ValueError(f"learnable_sink must have shape (H,) = ({h},), "
                         f"got {learnable_sink.shape}")
    q_ids, kv_ids, q_pos, kv_pos = segments
    if (q_ids is None) != (kv_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    for name, x, shape in (("q_segment_ids", q_ids, (b, sq)), ("kv_segment_ids", kv_ids, (b, sk)),
                           ("q_positions", q_pos, (b, sq)), ("kv_positions", kv_pos, (b, sk))):
        if x is not None and x.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {x.shape}")


def _grouped_sink(learnable_sink: jax.Array, hkv: int) -> jax.Array:
    """(H,) -> float32 (1, Hkv, G, 1), broadcasting against row statistics (B, Hkv, G, Sq)."""
    return learnable_sink.astype(jnp.float32).reshape(1, hkv, -1, 1)


def _check_inputs(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be 4-D, got {q.shape}, {k.shape}, {v.shape}")
    if k.shape[:3] != v.shape[:3] or k.shape[0] != q.shape[0]:
        raise ValueError(f"batch/seqlen/heads mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"q and k head dims differ: {q.shape[3]} != {k.shape[3]}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} not a multiple of kv heads {k.shape[2]}")


def _scale(softmax_scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale


def _group(x: jax.Array, hkv: int) -> jax.Array:
    """(B, S, H, X) -> (B, S, Hkv, G, X)."""
    b, s, h, rest = x.shape
    return x.reshape(b, s, hkv, h // hkv, rest)


def _scores(
    q: jax.Array, k: jax.Array, softmax_scale: float, softcap: float, dtype: DTypeLike
) -> jax.Array:
    """Scaled, capped scores in ``dtype``, (B, Hkv, G, Sq, Sk).

    q (B, Sq, Hkv, G, D) and k (B, Sk, Hkv, D) are already in ``dtype``. The product
    accumulates in float32 and each step rounds to ``dtype`` (a no-op for float32), like a
    naive framework implementation.
    """
    s = jnp.einsum(
        "bqhgd,bkhd->bhgqk",
        q * softmax_scale,
        k,
        preferred_element_type=jnp.float32,
        precision=_HIGHEST,
    ).astype(dtype)
    if softcap > 0:
        s = softcap * jnp.tanh(s / softcap)
    return s


def _safe_max(m: jax.Array) -> jax.Array:
    """Row max to subtract before exp: 0 for rows with no visible key (max = -inf)."""
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _finish(m: jax.Array, l: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(normaliser, lse) from the applied row max ``m`` and ``l = sum exp(s - m)``.

    Rows with ``l == 0`` (no visible key) get normaliser 1 (so the output stays 0) and
    ``lse = -inf``; the inner ``where`` keeps log's gradient finite there.
    """
    has_key = l > 0
    l_safe = jnp.where(has_key, l, 1.0)
    return l_safe, jnp.where(has_key, m + jnp.log(l_safe), -jnp.inf)


def _ungroup_lse(lse: jax.Array) -> jax.Array:
    """(B, Hkv, G, Sq) -> (B, H, Sq)."""
    b, hkv, g, sq = lse.shape
    return lse.reshape(b, hkv * g, sq)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "window", "softcap", "compute_dtype"))
def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    softmax_scale: float | None = None,
    window: Window = (None, None),
    softcap: float = 0.0,
    compute_dtype: DTypeLike = jnp.float32,
    learnable_sink: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Naive attention: materialises the (Sq, Sk) score matrix of every head.

    With ``compute_dtype=float32`` (default) this is the float32 oracle, whatever the input
    dtype. With a 16-bit ``compute_dtype`` it is FA4's "pt" baseline: inputs, scaled
    queries, scores (and softcap steps) and probabilities are rounded to ``compute_dtype``
    as a naive PyTorch implementation would (matmuls and the softmax itself still
    accumulate in float32, as the GPU libraries do).

    Args:
        q: queries (B, Sq, H, D).
        k: keys (B, Sk, Hkv, D).
        v: values (B, Sk, Hkv, Dv).
        softmax_scale: score scale; ``None`` means ``1 / sqrt(D)``.
        window: ``(left, right)`` window, see :func:`visible_mask`; causal is ``(None, 0)``.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)``.
        compute_dtype: dtype of the intermediate tensors (see above).
        learnable_sink: optional (H,) logit per query head joining each row's denominator
            (float32 arithmetic; see the module docstring).
        q_segment_ids, kv_segment_ids: optional (B, Sq) / (B, Sk) int segment ids, see
            :func:`visible_mask`.
        q_positions, kv_positions: optional (B, Sq) / (B, Sk) int positions for the window
            rule, see :func:`visible_mask`.

    Returns:
        ``(out, lse)``: out (B, Sq, H, Dv) in q's dtype, lse (B, H, Sq) float32 (natural
        log; ``-inf`` and zero output for rows with no visible key; ``lse = sink`` there with
        a sink).
    """
    _check_inputs(q, k, v)
    segments = (q_segment_ids, kv_segment_ids, q_positions, kv_positions)
    _check_extras(q, k, learnable_sink, segments)
    b, sq, h, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    scale = _scale(softmax_scale, d)
    mask = visible_mask(sq, sk, window, **_segment_kwargs(segments))
    # Tokens no query / key sees (padding) may hold NaN / Inf: zeroed before any product.
    q = _zero_unseen(q, _seen_queries(mask))
    k, v = (_zero_unseen(x, _seen_keys(mask)) for x in (k, v))
    s = _scores(
        _group(q.astype(compute_dtype), hkv), k.astype(compute_dtype), scale, softcap, compute_dtype
    ).astype(jnp.float32)
    s = _mask_scores(s, mask)
    row_max = jnp.max(s, axis=-1)
    if learnable_sink is not None:
        sink = _grouped_sink(learnable_sink, hkv)
        row_max = jnp.maximum(row_max, sink)
    # Softmax is invariant to the subtracted max: no gradient through it.
    m = _safe_max(lax.stop_gradient(row_max))
    e = jnp.exp(s - m[..., None])
    l = jnp.sum(e, axis=-1)
    if learnable_sink is not None:
        l = l + jnp.exp(sink - m)
    l_safe, lse = _finish(m, l)
    p = (e / l_safe[..., None]).astype(compute_dtype)
    out = jnp.einsum(
        "bhgqk,bkhd->bqhgd",
        p,
        v.astype(compute_dtype),
        preferred_element_type=jnp.float32,
        precision=_HIGHEST,
    )
    return out.reshape(b, sq, h, dv).astype(q.dtype), _ungroup_lse(lse)


def _segment_kwargs(segments: tuple[jax.Array | None, ...]) -> dict:
    """visible_mask's keyword arguments for the full (unblocked) key range."""
    q_ids, kv_ids, q_pos, kv_pos = segments
    return dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids, q_positions=q_pos,
                kv_positions=kv_pos)


def _aux_blocks(x: jax.Array | None, block_k: int) -> jax.Array | None:
    """Per-key ints (B, Sk) -> (n, B, block_k), padded like :func:`_key_blocks` (None stays)."""
    if x is None:
        return None
    b, sk = x.shape
    n = -(-sk // block_k)
    x = jnp.pad(x, ((0, 0), (0, n * block_k - sk)))
    return x.reshape(b, n, block_k).swapaxes(0, 1)


def _block_mask(sq: int, sk: int, window: Window, start, block_k: int, q_ids, q_pos,
                kv_ids_block, kv_pos_block) -> jax.Array:
    """visible_mask of one block of keys with the block's slices of the per-key arrays."""
    return visible_mask(sq, sk, window, k_start=start, num_k=block_k, q_segment_ids=q_ids,
                        kv_segment_ids=kv_ids_block, q_positions=q_pos,
                        kv_positions=kv_pos_block)


def _online_init(b: int, hkv: int, g: int, sq: int, dv: int) -> tuple[jax.Array, ...]:
    """Online-softmax carry (running max, running sum, output accumulator), float32."""
    return (
        jnp.full((b, hkv, g, sq), -jnp.inf, jnp.float32),
        jnp.zeros((b, hkv, g, sq), jnp.float32),
        jnp.zeros((b, hkv, g, sq, dv), jnp.float32),
    )


def _online_update(carry, qg, kb, vb, mask, scale: float, softcap: float):
    """One block of keys into the online-softmax carry (all float32).

    qg (B, Sq, Hkv, G, D), kb (B, n, Hkv, D), vb (B, n, Hkv, Dv), mask (Sq, n) or (B, Sq, n).
    """
    m, l, acc = carry  # m: running max, -inf while a row has seen no visible key
    # Tokens unseen in this block (padding) may hold NaN / Inf: zeroed before any product.
    qg = _zero_unseen(qg, _seen_queries(mask))
    kb, vb = (_zero_unseen(x, _seen_keys(mask)) for x in (kb, vb))
    s = _mask_scores(_scores(qg, kb, scale, softcap, jnp.float32), mask)
    m_new = lax.stop_gradient(jnp.maximum(m, jnp.max(s, axis=-1)))
    m_applied = _safe_max(m_new)
    alpha = jnp.exp(m - m_applied)  # 0 while m = -inf (l and acc are still 0)
    e = jnp.exp(s - m_applied[..., None])
    l = alpha * l + jnp.sum(e, axis=-1)
    acc = alpha[..., None] * acc + jnp.einsum(
        "bhgqk,bkhd->bhgqd", e, vb, preferred_element_type=jnp.float32, precision=_HIGHEST
    )
    return m_new, l, acc


def _online_finish(carry, learnable_sink: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(out (B, Sq, Hkv, G, Dv) float32, lse (B, Hkv, G, Sq)) from the final carry.

    The sink joins the denominator here, as one more (value-less) key.
    """
    m, l, acc = carry
    m_applied = _safe_max(m)
    if learnable_sink is not None:
        sink = _grouped_sink(learnable_sink, m.shape[1])
        m_applied = _safe_max(lax.stop_gradient(jnp.maximum(m, sink)))
        alpha = jnp.exp(m - m_applied)  # 0 where m = -inf
        l = alpha * l + jnp.exp(sink - m_applied)
        acc = alpha[..., None] * acc
    l_safe, lse = _finish(m_applied, l)
    return (acc / l_safe[..., None]).transpose(0, 3, 1, 2, 4), lse


def _key_blocks(x: jax.Array, block_k: int) -> jax.Array:
    """(B, Sk, Hkv, X) -> (n, B, block_k, Hkv, X), zero-padding Sk up to n * block_k."""
    b, sk, hkv, rest = x.shape
    n = -(-sk // block_k)
    x = jnp.pad(x, ((0, 0), (0, n * block_k - sk), (0, 0), (0, 0)))
    return x.reshape(b, n, block_k, hkv, rest).swapaxes(0, 1)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "window", "softcap", "block_k"))
def row_max_logits(
    q: jax.Array,
    k: jax.Array,
    *,
    softmax_scale: float | None = None,
    window: Window = (None, None),
    softcap: float = 0.0,
    block_k: int = 512,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
) -> jax.Array:
    """Each row's largest visible score, float32 (B, H, Sq): ``max_j s_ij`` over the keys the
    window and segment rules leave visible (``-inf`` where none), with ``s`` the scaled
    (and capped, ``softcap * tanh(s / softcap)``) score computed in float32 from the inputs.
    A learnable sink is not a score and never counts. What QK-Clip / MuonClip monitor: the
    per-head max logit is ``row_max_logits(...).max(axis=-1)``. A ``lax.scan`` over blocks of
    ``block_k`` keys (O(B * H * Sq * block_k) memory); no gradient flows through it."""
    _check_extras(q, k, None, (q_segment_ids, kv_segment_ids, q_positions, kv_positions))
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = _scale(softmax_scale, d)
    block_k = max(1, min(block_k, sk))
    qg = _group(lax.stop_gradient(q).astype(jnp.float32), hkv)
    k_blocks = _key_blocks(lax.stop_gradient(k).astype(jnp.float32), block_k)
    starts = jnp.arange(k_blocks.shape[0]) * block_k
    kv_aux = (_aux_blocks(kv_segment_ids, block_k), _aux_blocks(kv_positions, block_k))

    def step(m, block):
        kb, start, (kv_ids, kv_pos) = block
        mask = _block_mask(sq, sk, window, start, block_k, q_segment_ids, q_positions,
                           kv_ids, kv_pos)
        s = _mask_scores(_scores(qg, kb, scale, softcap, jnp.float32), mask)
        return jnp.maximum(m, jnp.max(s, axis=-1)), None

    m, _ = lax.scan(step, jnp.full((b, hkv, h // hkv, sq), -jnp.inf, jnp.float32),
                    (k_blocks, starts, kv_aux))
    return _ungroup_lse(m)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "window", "softcap", "block_k"))
def attention_blocked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    softmax_scale: float | None = None,
    window: Window = (None, None),
    softcap: float = 0.0,
    block_k: int = 512,
    learnable_sink: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Memory-light attention: online softmax in float32 over blocks of ``block_k`` keys.

    A ``lax.scan`` over key blocks keeps a running row max, running row sum and a rescaled
    output accumulator; Sk is padded up to a multiple of ``block_k`` with masked keys. The
    score block takes O(B * H * Sq * block_k) memory instead of O(B * H * Sq * Sk).
    Differentiable with ``jax.grad`` (each step is rematerialised, so the saved residuals
    are only the carries); the library itself uses :func:`attention_backward`.

    Args:
        q: queries (B, Sq, H, D).
        k: keys (B, Sk, Hkv, D).
        v: values (B, Sk, Hkv, Dv).
        softmax_scale: score scale; ``None`` means ``1 / sqrt(D)``.
        window: ``(left, right)`` window, see :func:`visible_mask`; causal is ``(None, 0)``.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)``.
        block_k: keys per block (capped at Sk).
        learnable_sink, q_segment_ids, kv_segment_ids, q_positions, kv_positions: as in
            :func:`attention`.

    Returns:
        ``(out, lse)`` as :func:`attention`: out (B, Sq, H, Dv) in q's dtype, lse (B, H, Sq)
        float32; equal to :func:`attention` up to float32 rounding.
    """
    _check_inputs(q, k, v)
    _check_extras(q, k, learnable_sink, (q_segment_ids, kv_segment_ids, q_positions, kv_positions))
    if block_k < 1:
        raise ValueError(f"block_k must be >= 1, got {block_k}")
    b, sq, h, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    scale = _scale(softmax_scale, d)
    block_k = min(block_k, sk)
    qg = _group(q.astype(jnp.float32), hkv)
    k_blocks = _key_blocks(k.astype(jnp.float32), block_k)
    v_blocks = _key_blocks(v.astype(jnp.float32), block_k)
    starts = jnp.arange(k_blocks.shape[0]) * block_k
    kv_aux = (_aux_blocks(kv_segment_ids, block_k), _aux_blocks(kv_positions, block_k))

    @jax.checkpoint
    def step(carry, block):
        kb, vb, start, (kv_ids, kv_pos) = block
        mask = _block_mask(sq, sk, window, start, block_k, q_segment_ids, q_positions,
                           kv_ids, kv_pos)
        return _online_update(carry, qg, kb, vb, mask, scale, softcap), None

    carry, _ = lax.scan(step, _online_init(b, hkv, h // hkv, sq, dv),
                        (k_blocks, v_blocks, starts, kv_aux))
    out, lse = _online_finish(carry, learnable_sink)  # out (B, Sq, Hkv, G, Dv)
    return out.reshape(b, sq, h, dv).astype(q.dtype), _ungroup_lse(lse)


def _backward_block(
    qg: jax.Array,
    dog: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    kb: jax.Array,
    vb: jax.Array,
    mask: jax.Array,
    scale: float,
    softcap: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradient contributions of one block of keys, all float32.

    qg (B, Sq, Hkv, G, D), dog (B, Sq, Hkv, G, Dv), lse and delta (B, Hkv, G, Sq),
    kb (B, n, Hkv, D), vb (B, n, Hkv, Dv), mask (Sq, n) or (B, Sq, n).
    Returns dq's contribution (B, Sq, Hkv, G, D), dk (B, n, Hkv, D), dv (B, n, Hkv, Dv).
    """

    def mm(spec, x, y):
        return jnp.einsum(spec, x, y, preferred_element_type=jnp.float32, precision=_HIGHEST)

    # Tokens unseen in this block (padding) may hold NaN / Inf in q, k, v, dO (and so delta):
    # zeroed before any product, so P = 0 there meets no 0·NaN.
    seen_q, seen_k = _seen_queries(mask), _seen_keys(mask)
    qg, dog = _zero_unseen(qg, seen_q), _zero_unseen(dog, seen_q)
    delta = _zero_unseen(delta, seen_q, token_axis=3)
    kb, vb = _zero_unseen(kb, seen_k), _zero_unseen(vb, seen_k)
    s = _scores(qg, kb, scale, softcap, jnp.float32)
    # A row with no visible key has lse = -inf; using +inf instead makes its P row
    # exp(s - inf) = 0, and masked scores are -inf, so P has no NaN.
    lse_safe = jnp.where(jnp.isneginf(lse), jnp.inf, lse)
    # P <= 1 exactly; with huge scores (~1e7 and up) the float32 lse is rounded by whole units
    # and a recomputed score may exceed it: exp(+large) = inf without the clamp (the kernels'
    # preprocess gives lse_log2 a margin there for the same reason)
    p = jnp.exp(jnp.minimum(_mask_scores(s, mask) - lse_safe[..., None], 0.0))
    dv = mm("bhgqk,bqhgd->bkhd", p, dog)  # sums the G query heads of each kv head
    dp = mm("bqhgd,bkhd->bhgqk", dog, vb)
    ds = p * (dp - delta[..., None])
    if softcap > 0:
        ds = ds * (1.0 - jnp.square(s / softcap))  # tanh' at the capped score
    dq = mm("bhgqk,bkhd->bqhgd", ds, kb) * scale
    dk = mm("bhgqk,bqhgd->bkhd", ds, qg) * scale
    return dq, dk, dv


@functools.partial(jax.jit, static_argnames=("softmax_scale", "window", "softcap", "block_k"))
def attention_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    *,
    delta: jax.Array | None = None,
    softmax_scale: float | None = None,
    window: Window = (None, None),
    softcap: float = 0.0,
    block_k: int | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """FlashAttention backward from the saved forward results ``(out, lse)``.

    With S the (scaled, capped) scores: ``P = exp(S - lse)`` (0 where masked and on rows
    with ``lse = -inf``), ``dV = P^T dO``, ``dP = dO V^T``, ``delta = rowsum(dO * O)``,
    ``dS = P * (dP - delta)``, times ``1 - (S / softcap)^2`` with softcap, then
    ``dQ = dS K * softmax_scale`` and ``dK = dS^T Q * softmax_scale``. Under GQA/MQA dK and
    dV sum the contributions of each group's query heads. All arithmetic is float32.

    Args:
        q: queries (B, Sq, H, D).
        k: keys (B, Sk, Hkv, D).
        v: values (B, Sk, Hkv, Dv).
        out: forward output (B, Sq, H, Dv).
        lse: forward logsumexp (B, H, Sq), float32.
        dout: gradient of the output (B, Sq, H, Dv).
        delta: ``rowsum(dout * out)`` (B, H, Sq) float32, e.g. from a GPU kernel;
            computed here when ``None``.
        softmax_scale: score scale; ``None`` means ``1 / sqrt(D)``.
        window: ``(left, right)`` window, see :func:`visible_mask`; causal is ``(None, 0)``.
        softcap: if > 0, scores were ``softcap * tanh(scores / softcap)``.
        block_k: ``None`` materialises the (Sq, Sk) matrices; an int scans over blocks of
            that many keys (O(B * H * Sq * block_k) memory; dq is accumulated across
            blocks, dk and dv are produced block by block).
        q_segment_ids, kv_segment_ids, q_positions, kv_positions: the forward's, see
            :func:`visible_mask`.

    A learnable sink needs no argument here: it is already in ``lse`` (so in ``P``); its own
    gradient comes from :func:`sink_gradient`.

    Returns:
        ``(dq, dk, dv)`` in the dtypes of q, k and v.
    """
    _check_inputs(q, k, v)
    segments = (q_segment_ids, kv_segment_ids, q_positions, kv_positions)
    _check_extras(q, k, None, segments)
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    scale = _scale(softmax_scale, d)
    qg = _group(q.astype(jnp.float32), hkv)
    dog = _group(dout.astype(jnp.float32), hkv)
    if delta is None:
        delta = jnp.einsum(
            "bqhd,bqhd->bhq", dout.astype(jnp.float32), out.astype(jnp.float32), precision=_HIGHEST
        )
    lse = lse.astype(jnp.float32).reshape(b, hkv, g, sq)
    delta = delta.astype(jnp.float32).reshape(b, hkv, g, sq)
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)

    if block_k is None:
        mask = visible_mask(sq, sk, window, **_segment_kwargs(segments))
        dq, dk, dv = _backward_block(qg, dog, lse, delta, k32, v32, mask, scale, softcap)
    else:
        if block_k < 1:
            raise ValueError(f"block_k must be >= 1, got {block_k}")
        block_k = min(block_k, sk)

        def step(dq_acc, block):
            kb, vb, start, (kv_ids, kv_pos) = block
            mask = _block_mask(sq, sk, window, start, block_k, q_segment_ids, q_positions,
                               kv_ids, kv_pos)
            dq_b, dk_b, dv_b = _backward_block(qg, dog, lse, delta, kb, vb, mask, scale, softcap)
            return dq_acc + dq_b, (dk_b, dv_b)

        k_blocks = _key_blocks(k32, block_k)
        starts = jnp.arange(k_blocks.shape[0]) * block_k
        kv_aux = (_aux_blocks(kv_segment_ids, block_k), _aux_blocks(kv_positions, block_k))
        dq, (dk, dv) = lax.scan(
            step, jnp.zeros_like(qg), (k_blocks, _key_blocks(v32, block_k), starts, kv_aux)
        )

        def unblock(x):  # (n, B, block_k, Hkv, X) -> (B, Sk, Hkv, X)
            x = x.swapaxes(0, 1)
            return x.reshape(b, -1, *x.shape[3:])[:, :sk]

        dk, dv = unblock(dk), unblock(dv)

    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def sink_probability(learnable_sink: jax.Array, lse: jax.Array) -> jax.Array:
    """``P_sink = e^{sink - lse}``, the sink's softmax weight in each row, float32 of lse's
    shape (..., H, S); 0 on rows with ``lse = -inf`` (no sink and no visible key).
    ``learnable_sink``: (H,), or lse's leading dims and H (one sink per batch entry)."""
    lse = lse.astype(jnp.float32)
    empty = jnp.isneginf(lse)
    sink = learnable_sink.astype(jnp.float32)[..., None]
    return jnp.where(empty, 0.0, jnp.exp(sink - jnp.where(empty, 0.0, lse)))


@jax.jit
def sink_gradient_from_rows(learnable_sink: jax.Array, lse: jax.Array, sink_rows: jax.Array,
                            dlse: jax.Array | None) -> jax.Array:
    """:func:`sink_gradient` with the output's share given as ``sink_rows`` (..., H) float32,
    ``sum_i P_sink_i * rowsum(dout * out)_i`` over the rows of each leading index (what a
    backward kernel sums from its float32 view of the output, ``sum_j P_ij dP_ij``), and the
    lse cotangent ``dlse`` (lse's shape, or None) separately:

        ``d sink_h = -sum sink_rows[..., h] + sum_{b, i} P_sink[b, h, i] * dlse[b, h, i]``

    Rows with ``lse = -inf`` contribute 0 (their dlse is selected out)."""
    heads = lse.shape[-2]
    d = -sink_rows.astype(jnp.float32).reshape(-1, heads).sum(axis=0)
    if dlse is not None:
        empty = jnp.isneginf(lse)
        share = jnp.where(empty, 0.0, sink_probability(learnable_sink, lse)
                          * dlse.astype(jnp.float32))
        d = d + share.reshape(-1, heads, lse.shape[-1]).sum(axis=(0, 2))
    return d.astype(learnable_sink.dtype)


@jax.jit
def sink_gradient(learnable_sink: jax.Array, lse: jax.Array, delta: jax.Array) -> jax.Array:
    """Gradient of the learnable sink, ``(H,)`` in ``learnable_sink``'s dtype.

    With ``P_sink = e^{sink - lse}`` (the sink's softmax weight in a row):
    ``d out / d sink = -P_sink * out`` and ``d lse / d sink = P_sink``, so a row contributes
    ``P_sink * (dlse - rowsum(dout * out))`` and

        ``d sink_h = -sum_{b, i} P_sink[b, h, i] * delta[b, h, i]``

    with ``delta = rowsum(dout * out) - dlse`` (exactly the ``delta`` that
    :func:`attention_backward` takes when lse has a cotangent). Rows with ``lse = -inf`` (only
    possible without a finite sink) contribute 0.

    Args:
        learnable_sink: (H,) the forward's sink logits.
        lse: (B, H, Sq) float32, the forward's lse (which includes the sink); any number of
            leading dims before ``H`` is summed over likewise, e.g. ``(H, total)`` for varlen.
        delta: ``rowsum(dout * out) - dlse``, lse's shape, float32.
    """
    heads = lse.shape[-2]
    empty = jnp.isneginf(lse)
    p_sink = sink_probability(learnable_sink, lse)
    # (selected, not multiplied by 0: such a row's delta may be NaN, e.g. a varlen padding
    # token's, whose cotangent may hold anything)
    d = -jnp.where(empty, 0.0, p_sink * delta.astype(jnp.float32))
    d = d.reshape(-1, heads, d.shape[-1]).sum(axis=(0, 2))
    return d.astype(learnable_sink.dtype)
