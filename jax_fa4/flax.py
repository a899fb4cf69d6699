"""Flax layers on :func:`jax_fa4.flash_attention`: NNX, Linen, and an ``attention_fn``.

- :class:`MultiHeadAttention`: ``flax.nnx.MultiHeadAttention`` (same constructor, call and
  parameters, so checkpoints are interchangeable) whose attention runs jax-fa4, plus the options
  ``causal``, ``window_size``, ``softcap``, ``softmax_scale``, ``implementation`` and
  ``on_mask``. ``num_kv_heads`` < ``num_heads`` gives GQA/MQA.
- :class:`LinenMultiHeadAttention`: the Linen equivalent, with the parameter names of
  ``flax.linen.MultiHeadDotProductAttention`` (``query``, ``key``, ``value``, ``out``) and the
  same extra options, ``num_kv_heads`` included.
- :func:`attention_fn` / :class:`AttentionFn`: a drop-in for ``flax.nnx.dot_product_attention``
  to pass as ``attention_fn=`` to Flax's own modules.

Packed rows: both modules take ``segment_ids=`` per call (one ``[batch..., length]`` int array
for self-attention, or a ``(q_segment_ids, kv_segment_ids)`` pair), as
:func:`jax_fa4.flash_attention` does: tokens attend only within their segment, on the kernels
(forward and backward) on Hopper. Padding: ``padding_segment_id=`` (constructor, e.g. 0)
names the padding id, whose tokens then attend to nothing (output 0); see
:func:`jax_fa4.flash_attention`. ``AttentionFn`` takes ``segment_ids=`` as a keyword too.

QK-Clip / MuonClip: ``sow_max_logits=True`` (constructor) makes each call store the per-(batch,
head) max logit, float32 ``[batch..., num_heads]`` (``return_max_logits`` of
:func:`jax_fa4.flash_attention`): NNX in ``nnx.Intermediate`` as ``max_logits``, Linen in
the ``intermediates`` collection as ``max_logits``.

What FlashAttention cannot do, and what happens instead:

- attention dropout (``dropout_rate > 0`` and not deterministic): ``NotImplementedError``;
  put dropout on the attention output or the residual instead.
- ``sow_weights=True`` (``module`` given): ``ValueError``; the weights never exist.
- an explicit ``mask`` or ``bias``: with ``on_mask="fallback"`` (default) the call runs a
  pure-JAX masked attention (float32 softmax, no kernel, O(Sq * Sk) memory) that honours the mask
  and the bias together with ``causal``/``window_size``/``softcap``; bias is added to the
  (capped) scores, and rows whose keys are all masked give 0 (FlashAttention's rule, where
  ``jax.nn.dot_product_attention`` would give a uniform average). With ``on_mask="raise"`` a mask
  or bias raises ``ValueError``. To stay on the kernel, express the mask as options:
  ``causal=True`` / ``is_causal=True`` instead of ``nnx.make_causal_mask``, ``window_size`` for
  local attention. Autoregressive decoding (``decode=True``) uses the fallback, since the cache
  brings an occupancy mask; with ``causal=True`` that is exact (one query, bottom-right aligned),
  a ``window_size`` is refused there.
- ``precision``: ignored; scores and softmax always accumulate in float32.
- ``input_positions`` (RoPE in Flax's attention_fn protocol): ``TypeError``; apply RoPE to
  q and k before the call.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jax_fa4 import api, options, reference

__all__ = ["AttentionFn", "LinenMultiHeadAttention", "MultiHeadAttention", "attention_fn"]

_ON_MASK = ("fallback", "raise")


@dataclasses.dataclass(frozen=True)
class AttentionFn:
    """An ``attention_fn`` for Flax attention modules with jax-fa4's options bound.

    Call contract: that of ``flax.nnx.dot_product_attention``: ``(query, key, value, bias=None,
    mask=None, broadcast_dropout=True, dropout_rng=None, dropout_rate=0.0, deterministic=False,
    dtype=None, precision=None, module=None, promote_dtype=None, is_causal=False)`` with query
    ``[batch..., q_length, num_heads, head_dim]`` and key/value
    ``[batch..., kv_length, num_kv_heads, head_dim]``; returns
    ``[batch..., q_length, num_heads, v_head_dim]``. See the module docstring for what is
    refused and for the mask/bias fallback.

    Attributes:
      causal: causal masking (also switched on per call by ``is_causal=True``).
      window_size: ``(left, right)`` sliding window, as in :func:`jax_fa4.flash_attention`.
      softcap: score soft-capping, as in :func:`jax_fa4.flash_attention`.
      softmax_scale: default ``1/sqrt(head_dim)``.
      implementation: as in :func:`jax_fa4.flash_attention`.
      on_mask: ``"fallback"`` (pure-JAX masked attention) or ``"raise"`` for a mask or bias.
      padding_segment_id: the id of padding tokens in ``segment_ids`` (e.g. 0), which then
        attend to nothing (as in :func:`jax_fa4.flash_attention`).
    """

    causal: bool = False
    window_size: tuple[int | None, int | None] = (None, None)
    softcap: float = 0.0
    softmax_scale: float | None = None
    implementation: str | None = None
    on_mask: str = "fallback"
    padding_segment_id: int | None = None

    def __post_init__(self):
        if self.on_mask not in _ON_MASK:
            raise ValueError(f"on_mask must be one of {_ON_MASK}, got {self.on_mask!r}")
        object.__setattr__(self, "window_size", tuple(self.window_size))

    def __call__(
        self,
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        bias: jax.Array | None = None,
        mask: jax.Array | None = None,
        broadcast_dropout: bool = True,
        dropout_rng: jax.Array | None = None,
        dropout_rate: float = 0.0,
        deterministic: bool = False,
        dtype: Any = None,
        precision: Any = None,
        module: Any = None,
        promote_dtype: Callable | None = None,
        is_causal: bool = False,
        segment_ids: Any = None,
        on_max_logits: Callable[[jax.Array], Any] | None = None,
        **unsupported: Any,
    ) -> jax.Array:
        """The attention output (see the class docstring). ``segment_ids``: ``[batch...,
        length]`` ints (self-attention) or a ``(q_segment_ids, kv_segment_ids)`` pair, as in
        :func:`jax_fa4.flash_attention` (not with an explicit mask or bias).
        ``on_max_logits``: called with the per-(batch, head) max logits ``[batch...,
        num_heads]`` float32 (QK-Clip; the modules' ``sow_max_logits``)."""
        del broadcast_dropout, dropout_rng, precision
        if unsupported:
            raise TypeError(
                f"jax_fa4.flax.attention_fn got unsupported arguments {sorted(unsupported)}"
                + ("; apply RoPE to q and k before attention" if "input_positions" in unsupported
                   else ""))
        if dropout_rate > 0 and not deterministic:
            raise NotImplementedError(
                f"jax_fa4 attention has no attention-probability dropout (dropout_rate="
                f"{dropout_rate}, deterministic=False): use dropout_rate=0.0 (dropout on the "
                "attention output or residual instead), or deterministic=True")
        if module is not None:
            raise ValueError("sow_weights=True needs the attention weights, which "
                             "FlashAttention never materialises; use jax.nn.dot_product_attention"
                             " (Flax's default attention_fn) to inspect them")
        query, key, value = _promote(query, key, value, dtype, promote_dtype)
        lead = _check_batch_dims(query, key, value)
        q, k, v = (x.reshape(math.prod(lead), *x.shape[-3:]) for x in (query, key, value))
        causal = bool(self.causal or is_causal)
        if mask is None and bias is None:
            res = api.flash_attention(q, k, v, softmax_scale=self.softmax_scale, causal=causal,
                                      window_size=self.window_size, softcap=self.softcap,
                                      segment_ids=_flat_ids(segment_ids, lead, q, k),
                                      padding_segment_id=(self.padding_segment_id
                                                          if segment_ids is not None else None),
                                      implementation=self.implementation,
                                      return_max_logits=on_max_logits is not None)
            out = res
            if on_max_logits is not None:
                out, max_logits = res
                on_max_logits(max_logits.reshape(*query.shape[:-3], max_logits.shape[-1]))
        elif segment_ids is not None or on_max_logits is not None:
            raise ValueError("segment_ids and max logits are not taken together with an "
                             "explicit mask or bias: fold the mask into segment ids, causal or "
                             "window_size")
        elif self.on_mask == "raise":
            raise ValueError(
                "jax_fa4 attention got an explicit mask/bias and on_mask='raise': express the "
                "mask as causal=True / is_causal=True or window_size, or use on_mask='fallback'"
                " (pure-JAX masked attention)")
        else:
            # Validates the options exactly as the kernel path would.
            opts = options.canonicalize(q, k, v, softmax_scale=self.softmax_scale,
                                        causal=causal, window_size=self.window_size,
                                        softcap=self.softcap, implementation="reference")
            out = _masked_attention(q, k, v, _flat(bias, lead, q, k), _flat(mask, lead, q, k),
                                    opts)
        return out.reshape(*query.shape[:-3], *out.shape[1:])


attention_fn = AttentionFn()
"""jax-fa4's attention with default options, for ``attention_fn=`` of Flax's modules:
``nnx.MultiHeadAttention(..., attention_fn=jax_fa4.flax.attention_fn)`` (pass
``is_causal=True`` to the module's call for causal attention) or
``nn.MultiHeadDotProductAttention(..., attention_fn=jax_fa4.flax.attention_fn)``. Use
``AttentionFn(causal=..., window_size=..., softcap=...)`` for other options."""


# -- helpers -----------------------------------------------------------------------------------
def _promote(query, key, value, dtype, promote_dtype):
    if promote_dtype is not None:
        return promote_dtype((query, key, value), dtype=dtype)
    dtype = dtype if dtype is not None else jnp.result_type(query, key, value)
    return tuple(jnp.asarray(x, dtype) for x in (query, key, value))


def _check_batch_dims(query, key, value) -> tuple[int, ...]:
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim < 3:
            raise ValueError(f"{name} must be [batch..., length, heads, head_dim], got shape "
                             f"{x.shape}")
    lead = query.shape[:-3]
    if key.shape[:-3] != lead or value.shape[:-3] != lead:
        raise ValueError(f"query, key and value must have the same batch dims: {query.shape}, "
                         f"{key.shape}, {value.shape}")
    return lead if lead else (1,)


def _call_extras(segment_ids, decode: bool, sow_max_logits: bool,
                 sow: Callable[[jax.Array], Any]) -> dict:
    """The keyword arguments a module's call adds to its :class:`AttentionFn`: this call's
    ``segment_ids`` (refused with ``decode=True``) and, with ``sow_max_logits``, ``sow`` as the
    max logits' receiver."""
    extra: dict = {}
    if segment_ids is not None:
        if decode:
            raise ValueError("segment_ids are not supported with decode=True")
        extra["segment_ids"] = segment_ids
    if sow_max_logits:
        extra["on_max_logits"] = sow
    return extra


def _flat_ids(segment_ids, lead, q, k):
    """``[batch..., length]`` segment ids (or a (q, kv) pair of them) with the batch dims
    folded, as the folded q / k have them."""
    if segment_ids is None:
        return None
    pair = isinstance(segment_ids, (tuple, list))
    q_ids, kv_ids = segment_ids if pair else (segment_ids, segment_ids)
    out = []
    for name, ids, length in (("q_segment_ids", q_ids, q.shape[1]),
                              ("kv_segment_ids", kv_ids, k.shape[1])):
        ids = jnp.asarray(ids)
        if ids.shape != (*lead, length) and not (lead == (1,) and ids.shape == (length,)):
            raise ValueError(f"segment_ids: {name} must have shape {(*lead, length)} "
                             f"(batch dims, length), got {ids.shape}")
        out.append(ids.reshape(math.prod(lead), length))
    return tuple(out)


def _flat(x, lead, q, k):
    """A mask or bias broadcastable to ``[batch..., H, Sq, Sk]`` as ``(B, H, Sq, Sk)``."""
    if x is None:
        return None
    full = (*lead, q.shape[2], q.shape[1], k.shape[1])
    if x.ndim > len(full):
        raise ValueError(f"mask/bias of shape {x.shape} does not broadcast to {full}")
    x = jnp.broadcast_to(x, full)
    return x.reshape(math.prod(lead), *full[-3:])


def _masked_attention(q, k, v, bias, mask, opts) -> jax.Array:
    """Pure-JAX attention with an explicit mask and bias: float32 scores and softmax."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    hi = lax.Precision.HIGHEST
    qg = q.astype(jnp.float32).reshape(b, sq, hkv, h // hkv, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg * opts.softmax_scale, k.astype(jnp.float32),
                   precision=hi).reshape(b, h, sq, sk)
    if opts.softcap > 0:
        s = opts.softcap * jnp.tanh(s / opts.softcap)
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    visible = reference.visible_mask(sq, sk, opts.window)[None, None]
    if mask is not None:
        visible = visible & mask.astype(bool)
    s = jnp.where(visible, s, -jnp.inf)
    m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(total > 0, total, 1.0)  # rows with no visible key: 0
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p.reshape(b, hkv, h // hkv, sq, sk),
                     v.astype(jnp.float32), precision=hi)
    return out.reshape(b, sq, h, v.shape[3]).astype(q.dtype)


def _options(causal, window_size, softcap, softmax_scale, implementation, on_mask,
             padding_segment_id=None) -> AttentionFn:
    """Check the options once, at construction, with the API's own validation."""
    probe = np.zeros((1, 1, 1, 8), np.float32)
    options.canonicalize(probe, probe, probe, softmax_scale=softmax_scale, causal=causal,
                         window_size=window_size, softcap=softcap, implementation=implementation)
    if padding_segment_id is not None:
        options.check_segment_ids(np.zeros((1, 1), np.int32), probe, probe, padding_segment_id)
    return AttentionFn(causal, tuple(window_size), float(softcap), softmax_scale,
                       implementation, on_mask, padding_segment_id)


# -- NNX ---------------------------------------------------------------------------------------
class MultiHeadAttention(nnx.MultiHeadAttention):
    """``flax.nnx.MultiHeadAttention`` running jax-fa4's attention.

    Takes every constructor argument of ``nnx.MultiHeadAttention`` (``num_heads``,
    ``in_features``, ``qkv_features``, ``out_features``, ``num_kv_heads``, ``in_kv_features``,
    ``dtype``, ``param_dtype``, ``kernel_init``, ``bias_init``, ``use_bias``, ``decode``,
    ``normalize_qk``, ``rngs``, ...) except ``attention_fn``, and has the same parameters and
    call (``module(inputs_q, inputs_k=None, inputs_v=None, *, mask=None, deterministic=None,
    rngs=None, sow_weights=False, decode=None, is_causal=False, ...)``). Extra keyword options:

    Args:
      causal: causal self-attention (Flax's ``is_causal=True`` per call does the same).
      window_size: ``(left, right)`` sliding window, ``None`` = unbounded.
      softcap: if > 0, scores become ``softcap * tanh(scores / softcap)``.
      softmax_scale: default ``1/sqrt(head_dim)``.
      implementation: ``None`` (kernel on a supported GPU, reference elsewhere) or a forced one.
      on_mask: ``"fallback"`` or ``"raise"`` for an explicit mask (see the module docstring).
      sow_max_logits: every call stores its per-(batch, head) max logits (QK-Clip) in
        ``nnx.Intermediate`` as ``max_logits`` (``nnx.pop(module, nnx.Intermediate)``).
      padding_segment_id: the id of padding tokens in ``segment_ids`` (e.g. 0).

    The call also takes ``segment_ids=`` (packed rows, see the module docstring).

    For the kernels, use ``dtype=jnp.bfloat16`` (or float16): the projections then produce
    16-bit q, k, v. float32 runs the reference.
    """

    def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
                 out_features: int | None = None, num_kv_heads: int | None = None,
                 in_kv_features: int | None = None, *, causal: bool = False,
                 window_size: tuple[int | None, int | None] = (None, None),
                 softcap: float = 0.0, softmax_scale: float | None = None,
                 implementation: str | None = None, on_mask: str = "fallback",
                 sow_max_logits: bool = False, padding_segment_id: int | None = None,
                 **kwargs: Any):
        if "attention_fn" in kwargs:
            raise TypeError("jax_fa4.flax.MultiHeadAttention sets its own attention_fn; to use "
                            "jax-fa4 inside Flax's module pass "
                            "nnx.MultiHeadAttention(..., attention_fn=jax_fa4.flax.attention_fn)")
        fn = _options(causal, window_size, softcap, softmax_scale, implementation, on_mask,
                      padding_segment_id)
        if num_kv_heads is not None:
            kwargs["num_kv_heads"] = num_kv_heads
        super().__init__(num_heads, in_features, qkv_features, out_features,
                         in_kv_features=in_kv_features, attention_fn=fn, **kwargs)
        self.sow_max_logits = sow_max_logits

    def __call__(self, inputs_q: jax.Array, inputs_k: jax.Array | None = None,
                 inputs_v: jax.Array | None = None, *, segment_ids: Any = None,
                 **kwargs: Any) -> jax.Array:
        decode = kwargs.get("decode")
        decode = self.decode if decode is None else decode
        if decode and self.attention_fn.window_size != (None, None):
            raise ValueError("decode=True with a window_size is not supported: the window "
                             "would be measured from the end of the cache, not the last token")
        extra = _call_extras(segment_ids, decode, self.sow_max_logits,
                             lambda x: self.sow(nnx.Intermediate, "max_logits", x))
        if not extra:
            return super().__call__(inputs_q, inputs_k, inputs_v, **kwargs)
        fn = self.attention_fn
        self.attention_fn = functools.partial(fn, **extra)  # this call's extras
        try:
            return super().__call__(inputs_q, inputs_k, inputs_v, **kwargs)
        finally:
            self.attention_fn = fn


# -- Linen -------------------------------------------------------------------------------------
class LinenMultiHeadAttention(nn.Module):
    """Linen multi-head attention running jax-fa4's attention.

    The fields and the call of ``flax.linen.MultiHeadDotProductAttention`` (parameters
    ``query``, ``key``, ``value``, ``out``: interchangeable with it when ``num_kv_heads`` is
    unset), plus ``num_kv_heads`` (GQA/MQA), ``causal``, ``window_size``, ``softcap``,
    ``softmax_scale``, ``implementation``, ``on_mask``, ``padding_segment_id`` and
    ``sow_max_logits`` (into the
    ``intermediates`` collection) as in :class:`MultiHeadAttention`; the call takes
    ``segment_ids=`` too. ``decode=True`` keeps a ``cache`` collection as Linen's module does
    (one token per call).
    """

    num_heads: int
    dtype: Any = None
    param_dtype: Any = jnp.float32
    qkv_features: int | None = None
    out_features: int | None = None
    num_kv_heads: int | None = None
    broadcast_dropout: bool = True
    dropout_rate: float = 0.0
    deterministic: bool | None = None
    precision: Any = None
    kernel_init: Callable = nn.linear.default_kernel_init
    out_kernel_init: Callable | None = None
    bias_init: Callable = nn.initializers.zeros_init()
    out_bias_init: Callable | None = None
    use_bias: bool = True
    decode: bool = False
    normalize_qk: bool = False
    causal: bool = False
    window_size: tuple[int | None, int | None] = (None, None)
    softcap: float = 0.0
    softmax_scale: float | None = None
    implementation: str | None = None
    on_mask: str = "fallback"
    sow_max_logits: bool = False
    padding_segment_id: int | None = None

    @nn.compact
    def __call__(self, inputs_q: jax.Array, inputs_k: jax.Array | None = None,
                 inputs_v: jax.Array | None = None, *, mask: jax.Array | None = None,
                 deterministic: bool | None = None, dropout_rng: jax.Array | None = None,
                 sow_weights: bool = False, segment_ids: Any = None) -> jax.Array:
        fn = _options(self.causal, self.window_size, self.softcap, self.softmax_scale,
                      self.implementation, self.on_mask, self.padding_segment_id)
        if inputs_k is None:
            if inputs_v is not None:
                raise ValueError("inputs_k cannot be None when inputs_v is given")
            inputs_k = inputs_q
        if inputs_v is None:
            inputs_v = inputs_k
        qkv_features = self.qkv_features or inputs_q.shape[-1]
        num_kv_heads = self.num_kv_heads or self.num_heads
        if qkv_features % self.num_heads or self.num_heads % num_kv_heads:
            raise ValueError(f"qkv_features ({qkv_features}) must be a multiple of num_heads "
                             f"({self.num_heads}), itself a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        head_dim = qkv_features // self.num_heads
        dense = functools.partial(
            nn.DenseGeneral, axis=-1, dtype=self.dtype, param_dtype=self.param_dtype,
            kernel_init=self.kernel_init, bias_init=self.bias_init, use_bias=self.use_bias,
            precision=self.precision)
        query = dense(features=(self.num_heads, head_dim), name="query")(inputs_q)
        key = dense(features=(num_kv_heads, head_dim), name="key")(inputs_k)
        value = dense(features=(num_kv_heads, head_dim), name="value")(inputs_v)
        if self.normalize_qk:
            query = nn.LayerNorm(name="query_ln", use_bias=False, dtype=self.dtype,
                                 param_dtype=self.param_dtype)(query)
            key = nn.LayerNorm(name="key_ln", use_bias=False, dtype=self.dtype,
                               param_dtype=self.param_dtype)(key)
        if self.decode:
            if fn.window_size != (None, None):
                raise ValueError("decode=True with a window_size is not supported")
            key, value, mask = self._decode_step(key, value, mask)
        m_deterministic = True
        if self.dropout_rate > 0:
            m_deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        extra = _call_extras(segment_ids, self.decode, self.sow_max_logits,
                             lambda x: self.sow("intermediates", "max_logits", x))
        x = fn(query, key, value, mask=mask, dropout_rate=self.dropout_rate,
               deterministic=m_deterministic, dtype=self.dtype,
               module=self if sow_weights else None, **extra)
        return nn.DenseGeneral(
            features=self.out_features or inputs_q.shape[-1], axis=(-2, -1),
            kernel_init=self.out_kernel_init or self.kernel_init,
            bias_init=self.out_bias_init or self.bias_init, use_bias=self.use_bias,
            dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision,
            name="out")(x)

    def _decode_step(self, key, value, mask):
        """Write this token's k/v into the cache; the mask hides the slots not written yet."""
        initialized = self.has_variable("cache", "cached_key")
        cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape,
                                     value.dtype)
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        if not initialized:  # the init call only shapes the cache
            return key, value, mask
        *batch, max_length, hkv, d = cached_key.value.shape
        if key.shape != (*batch, 1, hkv, d):
            raise ValueError(f"decode=True takes one token per call: expected key shape "
                             f"{(*batch, 1, hkv, d)}, got {key.shape}")
        i = index.value
        start = (0,) * len(batch) + (i, 0, 0)
        cached_key.value = lax.dynamic_update_slice(cached_key.value, key, start)
        cached_value.value = lax.dynamic_update_slice(cached_value.value, value, start)
        index.value = i + 1
        written = jnp.broadcast_to(jnp.arange(max_length) <= i, (*batch, 1, 1, max_length))
        mask = written if mask is None else jnp.logical_and(mask.astype(bool), written)
        return cached_key.value, cached_value.value, mask
