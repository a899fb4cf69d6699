"""``jax.nn.dot_product_attention`` on jax-fa4: the same signature, layout and results.

:func:`dot_product_attention` takes every argument of ``jax.nn.dot_product_attention`` and
gives what its XLA implementation gives, but runs :func:`jax_fa4.flash_attention` (the kernels
on Hopper, the pure-JAX reference elsewhere), with no ``(T, S)`` mask built:

* ``is_causal`` and ``local_window_size`` become the kernels' window. jax.nn aligns both to
  the top left (query ``t`` sees key ``s`` iff ``t - left <= s <= t + right``, and ``s <= t``
  when causal, whatever ``T`` and ``S``); :func:`jax_fa4.flash_attention` aligns to the bottom
  right, so the call drops the keys no query sees and the queries that see no key (those past
  ``S + left``) and shifts the window by the length difference that is left.
* ``query_seq_lengths`` / ``key_value_seq_lengths`` become segment ids: valid tokens id 0,
  padding queries and padding keys the reserved padding ids (``padding_segment_id``), so
  padding attends to nothing and is never seen, on the segment-id kernels.
* rows jax.nn masks whole get jax.nn's values, not FlashAttention's: a padding query
  (``t >= query_seq_lengths[b]``) gives 0; a valid query that sees no key (e.g.
  ``key_value_seq_lengths[b] == 0``, or a window past the keys) gives the mean of ``value``
  over all ``S`` keys, padding included (jax.nn's softmax over equal large negative logits),
  with its gradient (to ``value`` only); their residual is jax.nn's
  ``logsumexp`` of those logits, ``-0.7 * finfo(float32).max`` in the key's dtype (``-inf``
  in float16).
* an explicit ``bias`` or ``mask`` runs ``jax.nn.dot_product_attention``'s XLA implementation
  itself (pure JAX, O(T * S) memory per head), with a one-time ``RuntimeWarning``;
  ``on_mask="raise"`` makes it a ``ValueError`` instead.
* ``implementation="xla"`` / ``"cudnn"`` call ``jax.nn.dot_product_attention`` unchanged, and
  so do float64 and complex inputs (which neither the kernels nor the float32 reference take:
  jax.nn's XLA implementation runs them in their own dtype).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa4 import api, backends, options
from jax_fa4.backends.base import ImplementationUnavailableError

__all__ = ["dot_product_attention"]

_ON_MASK = ("fallback", "raise")
#: implementations that ``jax.nn.dot_product_attention`` itself runs
_JAX_IMPLEMENTATIONS = ("xla", "cudnn")
#: what jax.nn writes into masked logits (float32 softmax): ``-0.7 * finfo(float32).max``
_LARGE_NEGATIVE = float(np.float32(-0.7) * np.finfo(np.float32).max)
#: the segment ids of valid and padding tokens (padding becomes the reserved padding ids)
_VALID_ID, _PADDING_ID = 0, 1


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    on_mask: str = "fallback",
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``jax.nn.dot_product_attention`` on FlashAttention: same arguments, same results.

    Letters as in jax.nn: B batch, T query length, S key length, N query heads, K key/value
    heads (N a multiple of K: GQA / MQA), H head dim. See the module docstring for how each
    argument maps onto :func:`jax_fa4.flash_attention`.

    Args:
      query: ``(B, T, N, H)`` or ``(T, N, H)``; bfloat16 or float16 for the GPU kernels
        (float32 runs the reference).
      key: ``(B, S, K, H)`` or ``(S, K, H)`` (query's rank), query's dtype.
      value: key's shape and dtype.
      bias: optional, added to the logits (broadcastable to ``(B, N, T, S)``): runs jax.nn's
        XLA implementation (see ``on_mask``).
      mask: optional boolean, True where a logit takes part (broadcastable to
        ``(B, N, T, S)``): runs jax.nn's XLA implementation (see ``on_mask``).
      scale: multiplies the logits; default ``1/sqrt(H)``. A Python number > 0.
      is_causal: query ``t`` sees keys ``s <= t`` (top-left aligned, as in jax.nn).
      query_seq_lengths: int ``(B,)``: queries ``t >= query_seq_lengths[b]`` are padding:
        output 0 (as jax.nn: it zeroes them), no gradient.
      key_value_seq_lengths: int ``(B,)``: keys ``s >= key_value_seq_lengths[b]`` are never
        seen.
      local_window_size: ``(left, right)`` ints, or one int for ``(w, w)``: query ``t`` sees
        keys ``t - left <= s <= t + right`` (both bounds inclusive, top-left aligned).
      implementation: ``None`` (jax-fa4: the kernel for this GPU, else the reference),
        ``"reference"``, ``"sm90"`` or ``"sm100"`` (as in :func:`jax_fa4.flash_attention`),
        or ``"xla"`` / ``"cudnn"``: ``jax.nn.dot_product_attention`` runs the call unchanged.
      return_residual: also return the log-sum-exp of each row's scaled logits (natural log),
        ``(B, T, N)`` (``(T, N)`` for 3-dim inputs) in the key's dtype, without gradient.
      on_mask: the one argument jax.nn does not have: what an explicit ``bias`` or ``mask``
        does: ``"fallback"`` (default) runs jax.nn's XLA implementation with a one-time
        ``RuntimeWarning``, ``"raise"`` raises ``ValueError``.

    Returns:
      the output in query's shape and dtype, and with ``return_residual`` ``(output,
      residual)``. Padding queries give 0; a valid query that sees no key gives the mean of
      ``value`` over all S keys (the module docstring says why).

    Raises:
      TypeError / ValueError: an argument of the wrong type, shape or value (the message names
        it, what was expected and what came).
      ImplementationUnavailableError: a kernel implementation forced (``"sm90"``,
        ``"sm100"``) with a ``bias`` or ``mask``, or one that cannot serve the call.

    Differentiable (``jax.grad`` in query, key and value), and works under ``jax.jit``,
    ``jax.vmap`` and ``jax.export``.
    """
    if on_mask not in _ON_MASK:
        raise ValueError(f"on_mask must be one of {_ON_MASK}, got {on_mask!r}")
    if implementation in _JAX_IMPLEMENTATIONS:
        return jax.nn.dot_product_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, implementation=implementation,
            return_residual=return_residual)
    if implementation is not None and implementation not in backends.names():
        raise ValueError(f"implementation must be None or one of "
                         f"{(*backends.names(), *_JAX_IMPLEMENTATIONS)}, got {implementation!r}")
    if _other_float_dtype(query, implementation):
        # float64 / complex: jax.nn's XLA implementation, exactly its semantics (no kernel or
        # float32 reference takes them)
        return jax.nn.dot_product_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, implementation="xla",
            return_residual=return_residual)
    three_dim = _check_inputs(query, key, value)
    q, k, v = (x if x.ndim == 4 else x[None] for x in (query, key, value))
    b, t, _, h = q.shape
    s = k.shape[1]
    scale = _check_scale(scale, h)
    is_causal = options.check_flag("is_causal", is_causal)
    return_residual = options.check_flag("return_residual", return_residual)
    window = _check_window(local_window_size)
    q_len = _check_lengths("query_seq_lengths", query_seq_lengths, b)
    kv_len = _check_lengths("key_value_seq_lengths", key_value_seq_lengths, b)
    if bias is not None or mask is not None:
        _explicit_mask(implementation, on_mask)
        return jax.nn.dot_product_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=q_len, key_value_seq_lengths=kv_len, local_window_size=window,
            implementation="xla", return_residual=return_residual)
    left, right = window if window is not None else (None, None)
    if is_causal:
        right = 0 if right is None else min(right, 0)
    out, lse = _flash(q, k, v, scale, left, right, q_len, kv_len, implementation)
    sees = _rows_that_see(b, t, s, left, right, q_len, kv_len)
    if sees is not None:
        fill = _empty_row_value(v, q.shape[2])
        valid = (jnp.arange(t)[None, :] < q_len[:, None]) if q_len is not None else True
        out = jnp.where((valid & ~sees)[:, :, None, None], fill[:, None].astype(out.dtype), out)
    results = (out,)
    if return_residual:
        lse = jnp.swapaxes(lse, 1, 2)  # (B, N, T) -> jax.nn's (B, T, N)
        if sees is not None or q_len is not None:
            seen = sees if sees is not None else True
            if q_len is not None:
                seen = seen & (jnp.arange(t)[None, :] < q_len[:, None])
            lse = jnp.where(seen[:, :, None], lse, _LARGE_NEGATIVE)
        results += (jax.lax.stop_gradient(lse.astype(k.dtype)),)
    if three_dim:
        results = tuple(x[0] for x in results)
    return results if return_residual else results[0]


# -- the call on flash_attention ---------------------------------------------------------------
def _flash(q, k, v, scale, left, right, q_len, kv_len, implementation):
    """``flash_attention`` over the queries and keys a top-left ``(left, right)`` window can
    pair, as ``(out (B, T, N, H), lse (B, N, T))``; queries cut off (they see no key) give 0
    and lse ``-inf``, as flash_attention's rows without a key do."""
    b, t, n, _ = q.shape
    s = k.shape[1]
    # Queries t >= S + left see no key; keys s > t' - 1 + right are seen by no query t < t'.
    t_run = t if left is None else min(t, s + left)
    s_run = s if right is None else min(s, t_run + right)
    if t_run <= 0 or s_run <= 0 or (left is not None and right is not None
                                    and left + right < 0):
        return (jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype),
                jnp.full((b, n, t), -jnp.inf, jnp.float32))
    # bottom-right alignment over (t_run, s_run): query t sees t + d - left' .. t + d + right'
    d = s_run - t_run
    window_size = (None if left is None else left + d, None if right is None else right - d)
    segment_ids = None
    if q_len is not None or kv_len is not None:
        segment_ids = (_ids(q_len, b, t_run), _ids(kv_len, b, s_run))
    out, lse = api.flash_attention(
        q[:, :t_run], k[:, :s_run], v[:, :s_run], softmax_scale=scale, window_size=window_size,
        segment_ids=segment_ids,
        padding_segment_id=_PADDING_ID if segment_ids is not None else None,
        return_lse=True, implementation=implementation)
    if t_run < t:
        out = jnp.pad(out, ((0, 0), (0, t - t_run), (0, 0), (0, 0)))
        lse = jnp.pad(lse, ((0, 0), (0, 0), (0, t - t_run)), constant_values=-jnp.inf)
    return out, lse


def _ids(lengths: jax.Array | None, b: int, length: int) -> jax.Array:
    """(B, length) int32 segment ids: valid tokens ``_VALID_ID``, padding ``_PADDING_ID``."""
    if lengths is None:
        return jnp.full((b, length), _VALID_ID, jnp.int32)
    pad = jnp.arange(length, dtype=jnp.int32)[None, :] >= lengths[:, None]
    return jnp.where(pad, _PADDING_ID, _VALID_ID).astype(jnp.int32)


def _rows_that_see(b: int, t: int, s: int, left: int | None, right: int | None,
                   q_len: jax.Array | None, kv_len: jax.Array | None) -> jax.Array | None:
    """(B, T) bool: whether query t sees at least one key (top-left window, key lengths),
    padding queries aside; None when every query does (known from the static shapes)."""
    rows = np.arange(t)
    lo = np.zeros(t, np.int64) if left is None else np.maximum(rows - left, 0)
    hi = np.full(t, s - 1, np.int64) if right is None else np.minimum(rows + right, s - 1)
    if kv_len is None:
        sees = lo <= hi
        return None if sees.all() else jnp.broadcast_to(jnp.asarray(sees), (b, t))
    hi = jnp.minimum(jnp.asarray(hi, jnp.int32)[None, :], kv_len[:, None] - 1)
    return jnp.asarray(lo, jnp.int32)[None, :] <= hi


def _empty_row_value(v: jax.Array, n: int) -> jax.Array:
    """(B, N, H): what jax.nn gives a valid query that sees no key: its softmax over S equal
    logits, ``1/S`` in the value's dtype, times each key head's values, summed over S."""
    b, s, kh, h = v.shape
    p = jnp.asarray(1.0 / s, jnp.float32).astype(v.dtype).astype(jnp.float32)
    mean = jnp.sum(v.astype(jnp.float32), axis=1) * p  # (B, K, H)
    return jnp.repeat(mean, n // kh, axis=1)  # query head i reads key head i // (N / K)


# -- checks ------------------------------------------------------------------------------------
def _other_float_dtype(query: Any, implementation: str | None) -> bool:
    """Whether ``query`` is float64 or complex (jax.nn takes them; our kernels and float32
    reference do not), with no kernel forced (a forced kernel raises)."""
    if not options.is_array(query) or jnp.dtype(query.dtype) in options.SUPPORTED_DTYPES:
        return False
    if not (jnp.issubdtype(query.dtype, jnp.floating)
            or jnp.issubdtype(query.dtype, jnp.complexfloating)):
        return False  # integers and the like: refused by the checks
    if implementation not in (None, backends.REFERENCE):
        raise ImplementationUnavailableError(
            f"implementation={implementation!r} takes bfloat16 or float16 inputs, got "
            f"{query.dtype}: pass implementation=None or 'reference' (jax.nn's XLA "
            "implementation then runs it in its own dtype)")
    return True


def _check_inputs(query: Any, key: Any, value: Any) -> bool:
    """query ``(B, T, N, H)``, key and value ``(B, S, K, H)`` (or all without B), one dtype;
    returns whether they come without the batch axis."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        options.check_array(name, x)
    if query.ndim not in (3, 4):
        raise ValueError(f"query must have shape (B, T, N, H) or (T, N, H), got {query.shape}")
    layout = "(B, S, K, H)" if query.ndim == 4 else "(S, K, H)"
    for name, x in (("key", key), ("value", value)):
        if x.ndim != query.ndim:
            raise ValueError(f"{name} must have query's rank {query.ndim}, {layout}, got shape "
                             f"{x.shape}")
    if jnp.dtype(query.dtype) not in options.SUPPORTED_DTYPES:
        raise TypeError(f"query must have a floating dtype (bfloat16, float16 or float32 for "
                        f"our attention; float64 and complex run jax.nn's XLA implementation), "
                        f"got {query.dtype}")
    for name, x in (("key", key), ("value", value)):
        if x.dtype != query.dtype:
            raise TypeError(f"{name} must have query's dtype {query.dtype}, got {x.dtype}")
    if value.shape != key.shape:
        raise ValueError(f"value must have key's shape {key.shape}, got {value.shape}")
    lead = query.ndim - 3  # 1 with the batch axis
    if query.shape[:lead] != key.shape[:lead] or query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key must have the same batch size and head dim H: query "
                         f"{query.shape}, key {key.shape}")
    n, kh = query.shape[-2], key.shape[-2]
    if n % kh:
        raise ValueError(f"query heads N={n} must be a multiple of key/value heads K={kh}")
    for name, x in (("query", query), ("key", key), ("value", value)):
        options.check_nonempty(name, x)
    return query.ndim == 3


def _check_scale(scale: Any, head_dim: int) -> float:
    if scale is None:
        return 1.0 / float(np.sqrt(head_dim))
    return options.check_scalar("scale", scale, allow_zero=False)


def _check_window(window: Any) -> tuple[int, int] | None:
    """jax.nn's ``local_window_size``: None, an int w for ``(w, w)``, or ``(left, right)``."""
    if window is None:
        return None
    pair = (window, window) if not isinstance(window, (tuple, list)) else window
    if len(pair) != 2 or any(isinstance(w, bool) or not isinstance(w, (int, np.integer))
                             for w in pair):
        raise TypeError(f"local_window_size must be None, an int or a pair of ints (left, "
                        f"right), got {window!r}")
    return int(pair[0]), int(pair[1])


def _check_lengths(name: str, lengths: Any, b: int) -> jax.Array | None:
    if lengths is None:
        return None
    if not options.is_array(lengths):
        raise TypeError(f"{name} must be an int32 array of shape (B,) = ({b},), got "
                        f"{type(lengths).__name__}")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype (int32), got {lengths.dtype}")
    if lengths.shape != (b,):
        raise ValueError(f"{name} must have shape (B,) = ({b},), got {lengths.shape}")
    return jnp.asarray(lengths, jnp.int32)


def _explicit_mask(implementation: str | None, on_mask: str) -> None:
    """A ``bias`` or ``mask`` came: raise (``on_mask="raise"``, or a forced kernel), else say
    once that jax.nn's XLA implementation runs it."""
    if on_mask == "raise":
        raise ValueError(
            "jax_fa4.dot_product_attention got an explicit mask/bias and on_mask='raise': "
            "express the mask as is_causal=True, local_window_size or query_seq_lengths / "
            "key_value_seq_lengths, or use on_mask='fallback' (jax.nn's XLA implementation)")
    if implementation not in (None, backends.REFERENCE):
        raise ImplementationUnavailableError(
            f"implementation={implementation!r} cannot take an explicit bias or mask (the "
            "kernels build no (T, S) mask): pass implementation=None or 'reference' to run "
            "jax.nn's XLA implementation, or express the mask as is_causal, local_window_size "
            "or sequence lengths")
    _warn_mask_fallback()


@functools.cache
def _warn_mask_fallback() -> None:
    warnings.warn(
        "jax_fa4.dot_product_attention: an explicit bias or mask runs "
        "jax.nn.dot_product_attention's XLA implementation (no kernel, O(T * S) memory per "
        "head); express the mask as is_causal, local_window_size or sequence lengths to stay "
        "on the kernels, or pass on_mask='raise' to make this an error.",
        RuntimeWarning, stacklevel=3)
