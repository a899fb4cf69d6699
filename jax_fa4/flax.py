"""Flax layers on :func:`jax_fa4.flash_attention`: NNX, Linen, and an ``attention_fn``.

- :class:`MultiHeadAttention`: ``flax.nnx.MultiHeadAttention`` (same constructor, call and
  parameters, so checkpoints are interchangeable) whose attention runs jax-fa4, plus the options
  ``causal``, ``window_size``, ``softcap``, ``softmax_scale``, ``implementation`` and
  ``on_mask``. ``num_kv_heads`` < ``num_heads`` gives GQA/MQA.
- :class:`LinenMultiHeadAttention`: ``flax.linen.MultiHeadDotProductAttention`` (its fields,
  call and parameters, and its automatic name as a submodule) with the same extra options,
  ``num_kv_heads`` included; :class:`LinenMultiHeadAttentionAlias` is Flax's alias
  ``flax.linen.MultiHeadAttention``.
- :func:`attention_fn` / :class:`AttentionFn`: a drop-in for ``flax.nnx.dot_product_attention``
  to pass as ``attention_fn=`` to Flax's own modules.

Packed rows: both modules take ``segment_ids=`` per call (one ``[batch..., length]`` int array
for self-attention, or a ``(q_segment_ids, kv_segment_ids)`` pair), as
:func:`jax_fa4.flash_attention` does: tokens attend only within their segment, on the kernels
(forward and backward) on Hopper. Padding: ``padding_segment_id=`` (constructor, e.g. 0)
names the padding id, whose tokens then attend to nothing (output 0); see
:func:`jax_fa4.flash_attention`. ``AttentionFn`` takes ``segment_ids=`` as a keyword too.

Attention sinks (gpt-oss): ``learnable_sink=True`` (constructor) gives the module a trained
parameter ``sink`` of shape ``[num_heads]`` (initialised by ``sink_init``, default normal with
standard deviation 0.02 as gpt-oss's training code does; stored in ``param_dtype``, used in
float32), one logit per query head that joins every row's softmax denominator with no value
(``learnable_sink`` of :func:`jax_fa4.flash_attention`; inside the kernel's softmax on Hopper).
It is part of the parameter tree (NNX ``nnx.Param``, Linen ``params``), so it trains and
checkpoints like the projections.

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
- ``precision``: used by the modules' projections, not by the attention, whose scores and
  softmax accumulate in float32 (float64 and complex inputs: below). Linen's
  ``force_fp32_for_softmax`` changes nothing for them (the softmax is float32 either way).
- float64 (``jax_enable_x64``) and complex inputs, which Flax takes and
  :func:`jax_fa4.flash_attention` does not: the pure-JAX attention above (mask or not), computed
  in their own dtype as Flax's Linen attention computes them (``jax.nn.dot_product_attention``,
  NNX's default, rounds their softmax to float32 and drops imaginary parts). A forced kernel
  ``implementation``, ``force_fp32_for_softmax=True``, ``segment_ids`` and ``sow_max_logits``
  raise ``ValueError`` with them.
- ``input_positions`` (RoPE in Flax's attention_fn protocol): ``TypeError``; apply RoPE to
  q and k before the call.
- Linen's custom einsums over the attention weights (``qk_attn_weights_einsum_cls``,
  ``attn_weights_value_einsum_cls``): ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jax_fa4 import api, options, reference

__all__ = ["AttentionFn", "LinenMultiHeadAttention", "LinenMultiHeadAttentionAlias",
           "MultiHeadAttention", "attention_fn"]

_ON_MASK = ("fallback", "raise")
#: The sink parameter's default initializer: normal, standard deviation 0.02 (gpt-oss's
#: training code initialises its per-head sinks so).
SINK_INIT = nnx.initializers.normal(stddev=0.02)

#: Input dtypes that Flax's attention takes and FlashAttention's kernels and float32 reference do
#: not: the layers run them on the pure-JAX attention, computed in their own dtype.
FLAX_ONLY_DTYPES = (jnp.dtype(jnp.float64), jnp.dtype(jnp.complex64), jnp.dtype(jnp.complex128))


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
        force_fp32_for_softmax: bool = False,
        qk_attn_weights_einsum: Callable | None = None,
        attn_weights_value_einsum: Callable | None = None,
        segment_ids: Any = None,
        on_max_logits: Callable[[jax.Array], Any] | None = None,
        learnable_sink: jax.Array | None = None,
        **unsupported: Any,
    ) -> jax.Array:
        """The attention output (see the class docstring). ``segment_ids``: ``[batch...,
        length]`` ints (self-attention) or a ``(q_segment_ids, kv_segment_ids)`` pair, as in
        :func:`jax_fa4.flash_attention` (not with an explicit mask or bias).
        ``on_max_logits``: called with the per-(batch, head) max logits ``[batch...,
        num_heads]`` float32 (QK-Clip; the modules' ``sow_max_logits``).
        ``learnable_sink``: ``[num_heads]`` sink logits joining every row's denominator (the
        modules' ``learnable_sink`` parameter), also with an explicit mask or bias.
        ``force_fp32_for_softmax`` (Linen's ``attention_fn`` protocol): the softmax of 16-bit
        and float32 inputs is float32 either way; with float64 or complex inputs, whose
        softmax runs in their own dtype, ``True`` raises ``ValueError``.
        ``qk_attn_weights_einsum`` / ``attn_weights_value_einsum`` (Linen's protocol: custom
        einsums over the attention weights): ``ValueError``."""
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
        _refuse_einsums(qk_attn_weights_einsum=qk_attn_weights_einsum,
                        attn_weights_value_einsum=attn_weights_value_einsum)
        if module is not None:
            raise ValueError("sow_weights=True needs the attention weights, which "
                             "FlashAttention never materialises; use jax.nn.dot_product_attention"
                             " (Flax's default attention_fn) to inspect them")
        query, key, value = _promote(query, key, value, dtype, promote_dtype)
        lead = _check_batch_dims(query, key, value)
        q, k, v = (x.reshape(math.prod(lead), *x.shape[-3:]) for x in (query, key, value))
        causal = bool(self.causal or is_causal)
        flax_only = jnp.dtype(q.dtype) in FLAX_ONLY_DTYPES
        if flax_only:
            self._check_flax_only_dtype(q.dtype, force_fp32_for_softmax, segment_ids,
                                        on_max_logits, learnable_sink)
        if mask is None and bias is None and not flax_only:
            res = api.flash_attention(q, k, v, softmax_scale=self.softmax_scale, causal=causal,
                                      window_size=self.window_size, softcap=self.softcap,
                                      segment_ids=_flat_ids(segment_ids, lead, q, k),
                                      padding_segment_id=(self.padding_segment_id
                                                          if segment_ids is not None else None),
                                      implementation=self.implementation,
                                      learnable_sink=learnable_sink,
                                      return_max_logits=on_max_logits is not None)
            out = res
            if on_max_logits is not None:
                out, max_logits = res
                on_max_logits(max_logits.reshape(*query.shape[:-3], max_logits.shape[-1]))
        elif segment_ids is not None or on_max_logits is not None:
            raise ValueError("segment_ids and max logits are not taken together with an "
                             "explicit mask or bias: fold the mask into segment ids, causal or "
                             "window_size")
        elif self.on_mask == "raise" and (mask is not None or bias is not None):
            raise ValueError(
                "jax_fa4 attention got an explicit mask/bias and on_mask='raise': express the "
                "mask as causal=True / is_causal=True or window_size, or use on_mask='fallback'"
                " (pure-JAX masked attention)")
        else:
            # Validates the options exactly as the kernel path would (float64 and complex
            # inputs, which it refuses: their shapes and the options).
            if flax_only:
                options.check_shapes(q, k, v)
            check = (functools.partial(options.options, q.shape[3]) if flax_only
                     else functools.partial(options.canonicalize, q, k, v))
            opts = check(softmax_scale=self.softmax_scale, causal=causal,
                         window_size=self.window_size, softcap=self.softcap,
                         implementation="reference")
            sink = options.check_learnable_sink(learnable_sink, q.shape[2])
            out = _masked_attention(q, k, v, _flat(bias, lead, q, k), _flat(mask, lead, q, k),
                                    opts, sink)
        return out.reshape(*query.shape[:-3], *out.shape[1:])

    def _check_flax_only_dtype(self, dtype: Any, force_fp32_for_softmax: bool, segment_ids: Any,
                               on_max_logits: Callable | None,
                               learnable_sink: jax.Array | None = None) -> None:
        """Refuse what the pure-JAX attention of float64 / complex inputs cannot honour."""
        if self.implementation not in (None, "reference"):
            raise ValueError(f"{dtype} inputs run the pure-JAX attention in their own dtype, "
                             f"not implementation={self.implementation!r} (whose kernels take "
                             "bfloat16 or float16): use implementation=None or 'reference'")
        if force_fp32_for_softmax:
            raise ValueError(f"force_fp32_for_softmax=True with {dtype} inputs: jax_fa4 runs "
                             "their softmax in their own dtype, never rounded to float32")
        if segment_ids is not None or on_max_logits is not None:
            raise ValueError(f"segment_ids and max logits need bfloat16, float16 or float32 "
                             f"inputs, got {dtype}")
        if learnable_sink is not None and jnp.issubdtype(dtype, jnp.complexfloating):
            raise ValueError(f"a learnable sink needs real inputs, got {dtype}")


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


def _refuse_einsums(**einsums: Callable | None) -> None:
    """Linen's custom einsums over the attention weights (AQT's), which never exist here."""
    given = [name for name, fn in einsums.items() if fn is not None]
    if given:
        raise ValueError(f"{' and '.join(given)}: custom einsums over the attention weights, "
                         "which FlashAttention never materialises, are not supported")


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
                 sow: Callable[[jax.Array], Any], sink: jax.Array | None = None) -> dict:
    """The keyword arguments a module's call adds to its :class:`AttentionFn`: this call's
    ``segment_ids`` (refused with ``decode=True``), with ``sow_max_logits`` ``sow`` as the
    max logits' receiver, and the module's ``sink`` parameter (float32)."""
    extra: dict = {}
    if sink is not None:
        extra["learnable_sink"] = jnp.asarray(sink, jnp.float32)
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


def _masked_attention(q, k, v, bias, mask, opts, sink=None) -> jax.Array:
    """Pure-JAX attention with an explicit mask and bias: float32 scores and softmax (float64 and
    complex inputs: in their own dtype); ``sink`` ``(H,)`` joins each row's denominator."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    hi = lax.Precision.HIGHEST
    ct = jnp.promote_types(q.dtype, jnp.float32)
    qg = q.astype(ct).reshape(b, sq, hkv, h // hkv, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg * opts.softmax_scale, k.astype(ct),
                   precision=hi).reshape(b, h, sq, sk)
    if opts.softcap > 0:
        s = opts.softcap * jnp.tanh(s / opts.softcap)
    if bias is not None:
        s = s + bias.astype(ct)
    visible = reference.visible_mask(sq, sk, opts.window)[None, None]
    if mask is not None:
        visible = visible & mask.astype(bool)
    s = jnp.where(visible, s, -jnp.inf)
    m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    if sink is not None:
        sink = sink.astype(ct)[None, :, None, None]
        m = jnp.maximum(m, lax.stop_gradient(sink))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(s - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    if sink is not None:
        total = total + jnp.exp(sink - m)
    p = e / jnp.where(jnp.abs(total) > 0, total, 1.0)  # rows with no visible key: 0
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p.reshape(b, hkv, h // hkv, sq, sk),
                     v.astype(ct), precision=hi)
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
      learnable_sink: give the module a trained ``sink`` parameter, ``nnx.Param`` of shape
        ``[num_heads]`` (see the module docstring).
      sink_init: the sink's initializer, ``(key, shape, dtype) -> array``; default normal with
        standard deviation 0.02.

    The call also takes ``segment_ids=`` (packed rows, see the module docstring).

    For the kernels, use ``dtype=jnp.bfloat16`` (or float16): the projections then produce
    16-bit q, k, v. float32 runs the reference; float64 and complex run the pure-JAX attention
    in their own dtype (see the module docstring).
    """

    def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
                 out_features: int | None = None, num_kv_heads: int | None = None,
                 in_kv_features: int | None = None, *, causal: bool = False,
                 window_size: tuple[int | None, int | None] = (None, None),
                 softcap: float = 0.0, softmax_scale: float | None = None,
                 implementation: str | None = None, on_mask: str = "fallback",
                 sow_max_logits: bool = False, padding_segment_id: int | None = None,
                 learnable_sink: bool = False, sink_init: Callable = SINK_INIT,
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
        rngs = kwargs.get("rngs")
        if learnable_sink and rngs is None:
            raise TypeError("learnable_sink=True needs rngs= to initialise the sink")
        self.sink = (nnx.Param(sink_init(rngs.params(), (num_heads,),
                                         kwargs.get("param_dtype", jnp.float32)))
                     if learnable_sink else None)

    def __call__(self, inputs_q: jax.Array, inputs_k: jax.Array | None = None,
                 inputs_v: jax.Array | None = None, *, segment_ids: Any = None,
                 **kwargs: Any) -> jax.Array:
        decode = kwargs.get("decode")
        decode = self.decode if decode is None else decode
        if decode and self.attention_fn.window_size != (None, None):
            raise ValueError("decode=True with a window_size is not supported: the window "
                             "would be measured from the end of the cache, not the last token")
        extra = _call_extras(segment_ids, decode, self.sow_max_logits,
                             lambda x: self.sow(nnx.Intermediate, "max_logits", x),
                             None if self.sink is None else self.sink[...])
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
    """``flax.linen.MultiHeadDotProductAttention`` running jax-fa4's attention.

    The fields (in Flax's order) and the call of ``flax.linen.MultiHeadDotProductAttention``
    (``module(inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None, mask=None,
    deterministic=None, dropout_rng=None, sow_weights=False)``, with Flax's deprecation
    warnings), the same parameters (``query``, ``key``, ``value``, ``out``, and ``query_ln`` /
    ``key_ln`` with ``normalize_qk``) and, as a submodule, the same automatic name
    (``MultiHeadDotProductAttention_0``, ...: this class's Linen name is Flax's), so parameter
    trees and checkpoints are interchangeable with Flax's layer when ``num_kv_heads`` is unset.
    Flax's ``nn.MultiHeadAttention`` alias is :class:`LinenMultiHeadAttentionAlias`.

    Extra fields, after Flax's: ``num_kv_heads`` (GQA/MQA), ``causal``, ``window_size``,
    ``softcap``, ``softmax_scale``, ``implementation``, ``on_mask``, ``sow_max_logits`` (into
    the ``intermediates`` collection), ``padding_segment_id``, ``learnable_sink`` (a ``sink``
    parameter ``[num_heads]`` in ``params``) and ``sink_init``, as in
    :class:`MultiHeadAttention`; the call takes ``segment_ids=`` too. ``decode=True`` keeps a
    ``cache`` collection as Linen's module does (one token per call).

    Flax's fields it cannot honour: ``attention_fn`` (``TypeError``: this module sets its own;
    pass ``attention_fn=jax_fa4.flax.attention_fn`` to Flax's module instead) and
    ``qk_attn_weights_einsum_cls`` / ``attn_weights_value_einsum_cls`` (``ValueError``: custom
    einsums over attention weights that FlashAttention never materialises).
    ``force_fp32_for_softmax`` changes nothing (the softmax is float32 whatever its value) except
    with float64 / complex inputs, where ``True`` raises ``ValueError``; ``precision`` reaches
    the projections only. The module docstring lists what the attention refuses.
    """

    num_heads: int
    dtype: Any = None
    param_dtype: Any = jnp.float32
    qkv_features: int | None = None
    out_features: int | None = None
    broadcast_dropout: bool = True
    dropout_rate: float = 0.0
    deterministic: bool | None = None
    precision: Any = None
    kernel_init: Callable = nn.linear.default_kernel_init
    out_kernel_init: Callable | None = None
    bias_init: Callable = nn.initializers.zeros_init()
    out_bias_init: Callable | None = None
    use_bias: bool = True
    attention_fn: Callable | None = None
    decode: bool = False
    normalize_qk: bool = False
    force_fp32_for_softmax: bool = False
    qkv_dot_general: Callable | None = None
    out_dot_general: Callable | None = None
    qkv_dot_general_cls: Any = None
    out_dot_general_cls: Any = None
    qk_attn_weights_einsum_cls: Callable | None = None
    attn_weights_value_einsum_cls: Callable | None = None
    num_kv_heads: int | None = None
    causal: bool = False
    window_size: tuple[int | None, int | None] = (None, None)
    softcap: float = 0.0
    softmax_scale: float | None = None
    implementation: str | None = None
    on_mask: str = "fallback"
    sow_max_logits: bool = False
    padding_segment_id: int | None = None
    learnable_sink: bool = False
    sink_init: Callable = None  # (default: SINK_INIT; a field default must be hashable)

    @nn.compact
    def __call__(self, inputs_q: jax.Array, inputs_k: jax.Array | None = None,
                 inputs_v: jax.Array | None = None, *, inputs_kv: jax.Array | None = None,
                 mask: jax.Array | None = None, deterministic: bool | None = None,
                 dropout_rng: jax.Array | None = None, sow_weights: bool = False,
                 segment_ids: Any = None) -> jax.Array:
        self._check_fields()
        fn = _options(self.causal, self.window_size, self.softcap, self.softmax_scale,
                      self.implementation, self.on_mask, self.padding_segment_id)
        inputs_k, inputs_v = _linen_kv_inputs(inputs_q, inputs_k, inputs_v, inputs_kv)
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
            precision=self.precision, dot_general=self.qkv_dot_general,
            dot_general_cls=self.qkv_dot_general_cls)
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
        sink = None
        if self.learnable_sink:
            sink = self.param("sink", self.sink_init or SINK_INIT, (self.num_heads,),
                              self.param_dtype)
        extra = _call_extras(segment_ids, self.decode, self.sow_max_logits,
                             lambda x: self.sow("intermediates", "max_logits", x), sink)
        x = fn(query, key, value, mask=mask, dropout_rate=self.dropout_rate,
               deterministic=m_deterministic, dtype=self.dtype,
               force_fp32_for_softmax=self.force_fp32_for_softmax,
               module=self if sow_weights else None, **extra)
        return nn.DenseGeneral(
            features=self.out_features or inputs_q.shape[-1], axis=(-2, -1),
            kernel_init=self.out_kernel_init or self.kernel_init,
            bias_init=self.out_bias_init or self.bias_init, use_bias=self.use_bias,
            dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision,
            dot_general=self.out_dot_general, dot_general_cls=self.out_dot_general_cls,
            name="out")(x)

    def _check_fields(self) -> None:
        """Refuse Flax's fields that replace the attention computation itself."""
        if self.attention_fn is not None:
            raise TypeError("jax_fa4.flax.LinenMultiHeadAttention sets its own attention_fn; "
                            "to use jax-fa4 inside Flax's module pass "
                            "nn.MultiHeadDotProductAttention(..., "
                            "attention_fn=jax_fa4.flax.attention_fn)")
        _refuse_einsums(qk_attn_weights_einsum_cls=self.qk_attn_weights_einsum_cls,
                        attn_weights_value_einsum_cls=self.attn_weights_value_einsum_cls)

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
        zero = jnp.zeros((), i.dtype)  # indices of one dtype, also under jax_enable_x64
        start = (zero,) * len(batch) + (i, zero, zero)
        cached_key.value = lax.dynamic_update_slice(cached_key.value, key, start)
        cached_value.value = lax.dynamic_update_slice(cached_value.value, value, start)
        index.value = i + 1
        written = jnp.broadcast_to(jnp.arange(max_length) <= i, (*batch, 1, 1, max_length))
        mask = written if mask is None else jnp.logical_and(mask.astype(bool), written)
        return cached_key.value, cached_value.value, mask


class LinenMultiHeadAttentionAlias(LinenMultiHeadAttention):
    """:class:`LinenMultiHeadAttention` under Linen's other name: the counterpart of
    ``flax.linen.MultiHeadAttention``, Flax's alias of ``MultiHeadDotProductAttention`` whose
    only difference is a submodule's automatic name (``MultiHeadAttention_0``, ...)."""


# Linen names an unnamed submodule after its class, and the name is its parameters' key and seeds
# their initialisation: the Linen classes carry the names of the Flax layers they replace.
LinenMultiHeadAttention.__name__ = "MultiHeadDotProductAttention"
LinenMultiHeadAttentionAlias.__name__ = "MultiHeadAttention"


def _linen_kv_inputs(inputs_q: jax.Array, inputs_k: jax.Array | None,
                     inputs_v: jax.Array | None, inputs_kv: jax.Array | None
                     ) -> tuple[jax.Array, jax.Array]:
    """Linen's key and value inputs, with ``flax.linen.MultiHeadDotProductAttention``'s rules
    and deprecation warnings: ``inputs_kv`` (deprecated) stands for both; a missing
    ``inputs_k`` is ``inputs_q``, a missing ``inputs_v`` is ``inputs_k``; an ``inputs_v`` whose
    last two dims are equal may be a mask passed positionally (the pre-0.7.4 signature)."""
    if inputs_kv is not None:
        if inputs_k is not None or inputs_v is not None:
            raise ValueError("If either `inputs_k` or `inputs_v` is not None, `inputs_kv` must "
                             "be None. Pass `inputs_k` and `inputs_v` (`inputs_kv` is "
                             "deprecated).")
        warnings.warn("The inputs_kv arg will be deprecated soon. Pass inputs_k (and inputs_v) "
                      "instead.", DeprecationWarning, stacklevel=2)
        return inputs_kv, inputs_kv
    if inputs_k is None:
        if inputs_v is not None:
            raise ValueError("`inputs_k` cannot be None if `inputs_v` is not None. Pass the "
                             "same array as `inputs_k` alone to use it for both.")
        inputs_k = inputs_q
    if inputs_v is None:
        return inputs_k, inputs_k
    if inputs_v.shape[-1] == inputs_v.shape[-2]:
        warnings.warn(f"inputs_v has shape {inputs_v.shape}: if it is a mask, pass it as "
                      "mask=: the function signature of MultiHeadDotProductAttention's "
                      "`__call__` method has changed to `__call__(inputs_q, inputs_k=None, "
                      "inputs_v=None, *, inputs_kv=None, mask=None, deterministic=None, ...)`.",
                      DeprecationWarning, stacklevel=2)
    return inputs_k, inputs_v
