"""The public entry points: validate and canonicalise once (:mod:`jax_fa4.options`), then run
the autodiff rule (:mod:`jax_fa4.autodiff`), which runs the backend the options name.

* :func:`flash_attention`: dense ``(B, S, H, D)`` attention, with optional learnable sink and
  segment ids; differentiable.
* :func:`flash_attention_varlen`: FA4's ``flash_attn_varlen_func``: the tokens of a batch of
  sequences packed along one axis, q ``(total_q, H, D)``, k ``(total_k, Hkv, D)``,
  v ``(total_k, Hkv, Dv)``; sequence ``b`` owns the query tokens
  ``[cu_seqlens_q[b], cu_seqlens_q[b + 1])`` and the key tokens
  ``[cu_seqlens_k[b], cu_seqlens_k[b + 1])`` and attends only within itself, with FA4's
  bottom-right alignment per sequence: query ``i`` of sequence ``b`` (counted from the
  sequence's start) sees key ``j`` iff
  ``i + len_k(b) - len_q(b) - left <= j <= i + len_k(b) - len_q(b) + right``. The lengths are
  run-time values: ``cu_seqlens_q`` / ``cu_seqlens_k`` are ordinary (traced) int32 arrays, so new
  lengths never retrace or recompile; only the static shapes and the static ``max_seqlen_q`` /
  ``max_seqlen_k`` ints (which size the kernels' grids) enter the trace. Differentiable.
* :func:`flash_attention_paged`: a few new query tokens over a paged KV cache (FA4's
  ``page_table``): the cache holds fixed-size pages, k_cache ``(num_pages, page_size, Hkv, D)``
  and v_cache ``(num_pages, page_size, Hkv, Dv)``; batch entry ``b`` owns the pages
  ``page_table[b, 0], page_table[b, 1], ...`` in order, so its key ``j`` is
  ``k_cache[page_table[b, j // page_size], j % page_size]``, and its first ``seqused_k[b]`` keys
  are valid. The queries ``(B, Sq, H, D)`` are the last ``Sq`` tokens of each sequence: causal
  and windows align them bottom-right to ``seqused_k[b]``. Forward only: ``jax.grad`` (or
  ``jax.vjp``) with respect to anything that flows into q, k_cache, v_cache or the sink raises
  ``NotImplementedError`` (rather than silently returning zeros); wrap the call's inputs in
  ``jax.lax.stop_gradient`` when the surrounding computation is differentiated for other
  reasons.

Where no kernel serves a call the pure-JAX reference runs (:mod:`jax_fa4.backends.base`): varlen
masks one packed attention with per-token segment ids and positions (naive up to ``4096**2``
scores per head, else blocks of 512 keys), paged gathers the pages (dense up to 2048 key slots
per batch entry, else a split-KV scan over 512-key chunks).

Dimension letters: B batch, Sq query length, Sk key length, H query heads, Hkv key/value heads
(H a multiple of Hkv: MHA when equal, GQA when between, MQA when Hkv = 1), D query/key head dim,
Dv value head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jax_fa4 import autodiff, options
from jax_fa4.backends import REFERENCE
__all__ = ["flash_attention", "flash_attention_paged", "flash_attention_varlen"]


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
    return_max_logits: bool = False,
    padding_segment_id: int | None = None,
    q_descale: jax.Array | float | None = None,
    k_descale: jax.Array | float | None = None,
    v_descale: jax.Array | float | None = None,
    out_dtype: Any = None,
) -> jax.Array | tuple[jax.Array, ...]:
    """Scaled dot-product attention, FlashAttention-4 semantics, differentiable.

    Args:
      q: queries ``(B, Sq, H, D)``; bfloat16 or float16 for the GPU kernels (float32 runs the
        reference), or float8_e4m3fn with k and v for the FP8 forward (``q_descale`` ...).
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
        Differentiable. On Hopper the sink joins inside the kernel's softmax (decode-shaped
        calls: in the float32 merge of the kernel's float32 output), so the output is rounded
        once; its gradient comes from the backward's delta
        (``jax_fa4.autodiff.attention_with_sink``).
      segment_ids: optional integer segment ids: one ``(B, S)`` array (self-attention,
        ``Sq == Sk``) or a pair ``(q_segment_ids (B, Sq), kv_segment_ids (B, Sk))``. Query
        ``i`` sees key ``j`` only if their ids are equal, on top of ``causal`` / ``window_size``
        (which keep their positions in the whole sequence). A query whose id no key has sees
        nothing (out 0, lse -inf): give padding queries and padding keys different ids (e.g.
        -1 and -2) so that padding attends to nothing. On Hopper the forward and backward
        kernels take them with no (Sq × Sk) mask anywhere: blocks whose queries and keys share
        no id are skipped, contiguous runs (packed documents) are masked by each row's key
        span, other ids compared key by key (exact for any ids; a new packing never
        recompiles); ``deterministic=True`` runs the reference's backward. With ``"sm100"``
        the Blackwell forward and (head dims 64-128, 192/128) backward kernels take the same
        tables (compiled, never run on hardware here). Under ``jit``
        with q, k, v sharded over batch and heads the ids follow the batch sharding. For packed
        variable-length batches without a fixed (B, S) layout see
        :func:`jax_fa4.flash_attention_varlen`.
      return_lse: also return the log-sum-exp of each row's scores (natural log, float32).
      padding_segment_id: the id of padding tokens in ``segment_ids`` (e.g. 0, the convention
        of MaxText's and Levanter's ``segment_ids``): those queries see no key (out 0, lse
        ``-inf``, zero and finite gradients) and no query sees those keys. (Implemented by
        giving padding queries and keys two reserved ids, ``-2**31`` and ``-2**31 + 1``, which
        other tokens must not use.)
      return_max_logits: also return the largest score of each (batch entry, query head),
        ``max_ij s_ij`` over the keys the masks and segment ids leave visible, float32
        ``(B, H)`` (``-inf`` where a head sees nothing), with ``s = q·k · softmax_scale``
        (``softcap · tanh(s / softcap)`` with a softcap: the logit the softmax sees); a
        learnable sink does not count. What QK-Clip / MuonClip (Kimi K2) watch to rescale
        the query and key projections: ``max_logits.max(axis=0)`` gives the per-head maximum
        over the batch. A statistic: no gradient flows through it. On Hopper the forward
        kernel keeps one more running max per row (dense and segment-id calls);
        decode-shaped calls (few queries per key) and other backends run the reference.
      deterministic: make the gradients bitwise reproducible from run to run. The default
        Hopper backward kernel reduce-adds dQ across key blocks in arrival order, so its dq is
        not; ``deterministic=True`` runs a kernel that adds them in a fixed order (0.7–1.05×
        the default kernel's speed on the H200, slowest without a mask at head dim 64). The
        sm100 backward kernel has the same ordered mode (compile-verified only).
      implementation: ``None`` picks the kernel for this GPU and falls back to the pure-JAX
        reference elsewhere; ``"reference"``, ``"sm90"`` or ``"sm100"`` force one (a forced
        kernel that cannot run raises an error saying why).
      q_descale, k_descale, v_descale: FP8 calls (q, k, v in float8_e4m3fn) only: float32
        descale factors, each a scalar or ``(B, Hkv)`` (one per batch entry and kv head, q's
        applying to the query heads of the group; default 1): the call attends over the
        dequantised ``x.astype(float32) * x_descale`` (:mod:`jax_fa4.fp8`; its ``quantize``
        helpers make them). Forward only: differentiating an FP8 call raises. Causal, windows,
        softcap and GQA/MQA are supported; sinks, segment ids and max logits are not (yet).
      out_dtype: FP8 calls only: the output's dtype, bfloat16 by default (the Hopper kernel
        writes bfloat16; float16 / float32 are a cast of it).

    Returns:
      ``out`` of shape ``(B, Sq, H, Dv)`` in q's dtype, and with ``return_lse`` also ``lse`` of
      shape ``(B, H, Sq)`` float32, then with ``return_max_logits`` ``max_logits`` ``(B, H)``
      float32: ``out``, ``(out, lse)``, ``(out, max_logits)`` or ``(out, lse, max_logits)``.
      Rows with no visible key give 0 and lse ``-inf``.

    Differentiable (``jax.grad``, also through ``lse``), and works under ``jax.jit``,
    ``jax.vmap`` (mapped axes are folded into the batch) and ``jax.export``.

    Backward: on Hopper (``implementation="sm90"``, the default there) the preprocess, main and
    dQ postprocess kernels; with ``"sm100"`` (opt-in: forced, or ``JAX_FA4_ENABLE_SM100=1``) the
    preprocess and the Blackwell backward kernels (head dims 64, 96, 128 with ``Dv == D`` and
    192 with ``Dv`` 128, the last two with 2-CTA MMAs; 192/192 and 256 with a dK/dV and a dQ
    kernel; they compile but have never run on hardware), else the reference's backward with a
    one-time ``RuntimeWarning`` naming the reason (e.g. segment ids at head dim 256);
    elsewhere the preprocess (a kernel on GPUs) and the reference's explicit FlashAttention
    backward (also for calls the Hopper backward kernels do not cover).
    """
    opts = options.canonicalize(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                window_size=window_size, softcap=softcap,
                                implementation=implementation, deterministic=deterministic)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    fp8_args = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale,
                "out_dtype": out_dtype}
    if jnp.dtype(q.dtype) == options.FP8_DTYPE:
        options.refuse_fp8_features(learnable_sink=learnable_sink is not None,
                                    segment_ids=segment_ids is not None,
                                    return_max_logits=return_max_logits)
        shape = (q.shape[0], k.shape[2])
        descales = [options.check_descale(name, x, shape) for name, x in (
            ("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))]
        out, lse = autodiff.fp8_attention(q, k, v, *descales, opts,
                                          options.check_out_dtype(out_dtype))
        return (out, lse) if return_lse else out
    options.reject_fp8_arguments(fp8_args, "q, k, v", f"q of dtype {q.dtype}")
    if return_max_logits:
        opts = dataclasses.replace(opts, max_logits=True)
    learnable_sink = options.check_learnable_sink(learnable_sink, q.shape[2])
    segment_ids = options.check_segment_ids(segment_ids, q, k, padding_segment_id)
    if learnable_sink is None and segment_ids is None:
        outs = autodiff.attention(q, k, v, opts)
    elif segment_ids is None and opts.implementation != REFERENCE:
        # the backend's attention chain, the sink its forward's operand (autodiff)
        outs = autodiff.attention_with_sink(q, k, v, learnable_sink, opts)
    else:  # the segment-id kernels or the reference (autodiff.attention_with_extras)
        outs = autodiff.attention_with_extras(q, k, v, opts, learnable_sink=learnable_sink,
                                              segment_ids=segment_ids)
    out, lse = outs[0], outs[1]
    results = (out, lse) if return_lse else (out,)
    if return_max_logits:
        results += (jax.lax.stop_gradient(outs[2]).max(axis=-1),)
    return results if len(results) > 1 else out


def flash_attention_varlen(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
    learnable_sink: jax.Array | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
    validate: bool = False,
    q_descale: jax.Array | float | None = None,
    k_descale: jax.Array | float | None = None,
    v_descale: jax.Array | float | None = None,
    out_dtype: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention over a batch of variable-length sequences packed along one axis (FA4 varlen).

    Args:
      q: queries ``(total_q, H, D)``: the query tokens of all sequences, back to back.
      k: keys ``(total_k, Hkv, D)``, q's dtype; H a multiple of Hkv (GQA / MQA).
      v: values ``(total_k, Hkv, Dv)``, q's dtype.
      cu_seqlens_q: int32 ``(batch + 1,)``, non-decreasing, in ``[0, total_q]``: sequence
        ``b``'s queries are ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]``. A run-time value: new
        lengths never retrace. Empty and length-1 sequences are fine. Tokens outside
        ``[cu_seqlens_q[0], cu_seqlens_q[-1])`` are padding: output 0, lse ``-inf`` (even with a
        sink), no gradient.
      cu_seqlens_k: int32 ``(batch + 1,)``, likewise for k and v (keys outside
        ``[cu_seqlens_k[0], cu_seqlens_k[-1])`` are never seen). Padding tokens may hold
        anything, NaN and Inf included, in q, k, v and in the output's cotangent: the kernels
        write zeros over the rows past a sequence that a tile loads (and the reference selects
        them out) before any product, so no valid output or gradient changes.
      max_seqlen_q: static int >= every query length (sizes the kernels' grid; part of the
        compile key, so keep it fixed, e.g. a bucket).
      max_seqlen_k: static int >= every key length.
      softmax_scale: multiplies ``q·k``; default ``1/sqrt(D)``.
      causal: per sequence, bottom-right aligned: query ``i`` of sequence ``b`` sees keys up to
        ``i + len_k(b) - len_q(b)``. Same as ``window_size=(left, 0)``.
      window_size: ``(left, right)``, each None or an int >= 0, per sequence as for
        :func:`jax_fa4.flash_attention`.
      softcap: if > 0, scores become ``softcap * tanh(scores / softcap)``.
      learnable_sink: optional ``(H,)`` floating logits (float32 recommended), one per query
        head, joining every row's softmax denominator with no value; differentiable.
      return_lse: also return the log-sum-exp, ``(H, total_q)`` float32 (FA4's varlen layout).
      implementation: None (on an H100/H200 the Hopper varlen forward kernel when it serves
        the call, else the reference), ``"sm90"`` or ``"sm100"`` (that architecture's varlen
        forward kernel, or :class:`ImplementationUnavailableError` saying why not; the sm100
        kernel is opt-in, never run on hardware here) or ``"reference"``. On Hopper the
        backward runs the varlen backward kernel (each sequence's own blocks only); with
        sm100, the sm100 backward kernels' varlen modes at head dims 64, 96, 128 (1-CTA),
        192/128 (2-CTA), 192/192 and 256 (the split kernels) (compiled and model-checked, never
        run on hardware here), the reference's backward elsewhere (a one-time
        ``RuntimeWarning``).
      validate: also check traced cu_seqlens (under ``jit``): the same rules and messages as
        for concrete values, checked on the host when the program runs (one small
        device-to-host copy per call); a broken rule surfaces as JAX's runtime error carrying
        the ValueError's message, at the first wait on the results.
      q_descale, k_descale, v_descale: FP8 calls (q, k, v in float8_e4m3fn) only: float32
        descales, each a scalar or ``(num_sequences, Hkv)`` (one per sequence and kv head;
        default 1): the call attends over the dequantised tokens (docs/fp8.md;
        :func:`jax_fa4.fp8.dequantize_packed` is the rule). Forward only; no sink. On Hopper
        the FP8 varlen forward kernel runs, elsewhere the reference on the dequantised inputs.
      out_dtype: FP8 calls only: the output's dtype, bfloat16 by default.

    Returns:
      ``out`` ``(total_q, H, Dv)`` in q's dtype (FP8: ``out_dtype``), and with ``return_lse``
      also ``lse`` ``(H, total_q)`` float32. Rows with no visible key (e.g. a query whose
      sequence has no key) give 0 and lse ``-inf`` (``lse = sink`` with a sink).

    Differentiable with ``jax.grad`` in q, k, v and the sink (also through lse); works under
    ``jax.jit`` and ``jax.vmap``. cu_seqlens values that break the contract (negative,
    decreasing, past the packed tokens, a length above max_seqlen) raise a ValueError naming
    the index whenever they are known at the call (numpy or concrete jax arrays, eager calls);
    traced under ``jit`` they are checked only with ``validate=True``: otherwise the kernels
    stay in bounds and the result is unspecified.
    """
    options.check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                options.check_validate(validate))
    opts = options.options(q.shape[-1], softmax_scale=softmax_scale, causal=causal,
                           window_size=window_size, softcap=softcap,
                           implementation=implementation)
    fp8_args = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale,
                "out_dtype": out_dtype}
    if jnp.dtype(q.dtype) == options.FP8_DTYPE:
        options.refuse_fp8_features(learnable_sink=learnable_sink is not None)
        shape = (cu_seqlens_q.shape[0] - 1, k.shape[1])
        descales = [options.check_descale(name, x, shape, "(num_sequences, Hkv)")
                    for name, x in (("q_descale", q_descale), ("k_descale", k_descale),
                                    ("v_descale", v_descale))]
        out, lse = autodiff.fp8_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *descales, opts,
                                       options.check_out_dtype(out_dtype), max_seqlen_q,
                                       max_seqlen_k)
        return (out, lse) if return_lse else out
    options.reject_fp8_arguments(fp8_args, "q, k, v", f"q of dtype {q.dtype}")
    learnable_sink = options.check_learnable_sink(learnable_sink, q.shape[1])
    out, lse = autodiff.varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, learnable_sink, opts,
                               max_seqlen_q, max_seqlen_k)
    return (out, lse) if return_lse else out


def flash_attention_paged(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    page_table: jax.Array,
    seqused_k: jax.Array,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
    learnable_sink: jax.Array | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
    validate: bool = False,
    q_descale: jax.Array | float | None = None,
    k_descale: jax.Array | float | None = None,
    v_descale: jax.Array | float | None = None,
    out_dtype: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of a few new query tokens over a paged KV cache (decode / chunked prefill).

    Args:
      q: queries ``(B, Sq, H, D)``: the last Sq tokens of each sequence (Sq = 1 for a decode
        step; any Sq works).
      k_cache: ``(num_pages, page_size, Hkv, D)``, q's dtype; H a multiple of Hkv.
      v_cache: ``(num_pages, page_size, Hkv, Dv)``, q's dtype.
      page_table: int32 ``(B, max_pages)``: the cache pages of each batch entry, in order.
        Entries past a sequence's used pages are ignored (they may hold any value, e.g. -1).
        Pages and page slots past ``seqused_k`` may hold anything, NaN included: the kernel
        zeroes the slots it loads past the used keys before any product.
      seqused_k: int32 ``(B,)``: the number of valid keys of each batch entry, in
        ``[0, max_pages * page_size]`` (a run-time value: it never retraces).
      softmax_scale: multiplies ``q·k``; default ``1/sqrt(D)``.
      causal: bottom-right aligned to ``seqused_k``: query ``i`` sees keys up to
        ``i + seqused_k[b] - Sq``. Same as ``window_size=(left, 0)``.
      window_size: ``(left, right)``, each None or an int >= 0, aligned likewise.
      softcap: if > 0, scores become ``softcap * tanh(scores / softcap)``.
      learnable_sink: optional ``(H,)`` floating logits joining every row's denominator.
      return_lse: also return lse ``(B, H, Sq)`` float32.
      implementation: None (the Hopper kernel on an H100/H200 when it serves the call, see the
        module docstring; else the reference), ``"sm90"`` (the kernel or
        :class:`jax_fa4.ImplementationUnavailableError` saying why not) or ``"reference"``.
      validate: also check traced page_table / seqused_k (under ``jit``), as
        :func:`flash_attention_varlen`'s ``validate`` does for cu_seqlens.
      q_descale, k_descale, v_descale: an FP8 KV cache (k_cache and v_cache in
        float8_e4m3fn) only: float32 descales. ``k_descale`` / ``v_descale``: a scalar or
        ``(Hkv,)``, one per kv head for every page (the cache is shared by the batch;
        :func:`jax_fa4.fp8.quantize_paged_cache` makes them). q may be float8_e4m3fn with
        ``q_descale`` a scalar or ``(B, Hkv)``, or bfloat16 / float16 / float32 (no
        ``q_descale``): the call then quantises it to e4m3 itself, one scale per (batch
        entry, kv head) (:func:`jax_fa4.fp8.quantize_grouped`), as the e4m3 kernel needs both
        operands in e4m3. The call attends over the dequantised inputs (docs/fp8.md). Forward
        only; no sink. On Hopper the FP8 paged kernel runs (a decode step's GQA heads packed,
        split-KV where the tiles would not fill the GPU, as for a 16-bit cache), elsewhere the
        reference on the dequantised inputs.
      out_dtype: FP8 cache only: the output's dtype, bfloat16 by default.

    Returns:
      ``out`` ``(B, Sq, H, Dv)`` in q's dtype (FP8 cache: ``out_dtype``), and with
      ``return_lse`` also lse ``(B, H, Sq)``. Rows with no visible key (e.g. ``seqused_k[b] =
      0``) give 0 and lse ``-inf`` (``lse = sink`` with a sink).

    Forward only: differentiating through it raises ``NotImplementedError`` (see the module
    docstring). Works under ``jax.jit`` and ``jax.vmap``. A seqused_k outside its range, or a
    used page's page_table entry outside ``[0, num_pages)``, raises a ValueError naming the
    index whenever the values are known at the call (numpy or concrete jax arrays); traced
    under ``jit`` they are checked only with ``validate=True``: otherwise the kernels stay in
    bounds and the result is unspecified.
    """
    fp8_cache = options.FP8_DTYPE in (getattr(x, "dtype", None) for x in (k_cache, v_cache))
    options.check_paged_inputs(q, k_cache, v_cache, page_table, seqused_k,
                               options.check_validate(validate), fp8=fp8_cache)
    opts = options.options(q.shape[-1], softmax_scale=softmax_scale, causal=causal,
                           window_size=window_size, softcap=softcap,
                           implementation=implementation)
    fp8_args = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale,
                "out_dtype": out_dtype}
    if fp8_cache:
        options.refuse_fp8_features(learnable_sink=learnable_sink is not None)
        hkv = k_cache.shape[2]
        if jnp.dtype(q.dtype) == options.FP8_DTYPE:
            q_descale = options.check_descale("q_descale", q_descale, (q.shape[0], hkv))
        elif q_descale is not None:
            raise ValueError(f"q_descale applies to a float8_e4m3fn q; q of dtype {q.dtype} "
                             "is quantised by the call (one scale per batch entry and kv head)")
        k_descale, v_descale = (options.check_descale(name, x, (hkv,), "(Hkv,)")
                                for name, x in (("k_descale", k_descale),
                                                ("v_descale", v_descale)))
        out, lse = autodiff.fp8_paged(q, k_cache, v_cache, page_table, seqused_k, q_descale,
                                      k_descale, v_descale, opts,
                                      options.check_out_dtype(out_dtype))
        return (out, lse) if return_lse else out
    options.reject_fp8_arguments(fp8_args, "k_cache and v_cache",
                                 f"k_cache of dtype {k_cache.dtype}")
    learnable_sink = options.check_learnable_sink(learnable_sink, q.shape[2])
    out, lse = autodiff.paged(q, k_cache, v_cache, page_table, seqused_k, learnable_sink, opts)
    return (out, lse) if return_lse else out

