"""Every differentiation rule: each runs the backend the options name, never a family by name.

The differentiable calls (dense, dense + sink, sink / segment ids, varlen) are ``custom_jvp``
functions: their JVP rule returns the forward's outputs and tangents through
:func:`jax_fa4.tangents.linear`, which is the float32 reference's JVP in forward mode
(``jax.jvp``, ``jax.linearize``, ``jax.jacfwd``) and, transposed in reverse mode (``jax.grad``),
the backward chain below on the saved (q, k, v, out, lse): the same kernels and residuals as a
``custom_vjp`` would run. Paged and FP8 calls are forward only (``custom_vjp`` rules that raise).

Dense (:func:`attention`): reverse mode keeps (q, k, v, out, lse); the backward runs the backend's
preprocess (``delta = rowsum(dO * O)``) and then its backward proper. Both halves are bound
through :mod:`jax_fa4.parallel.sharding`, so under ``jax.jit`` with q, k, v sharded over batch
and heads each device runs them on its own shard (see that module for the rules).

With a learnable sink (:func:`attention_with_sink`) the forward takes the sink as a fourth
operand (sharded with the heads) and the backend joins it: inside the kernel's softmax on
Hopper, else by :func:`jax_fa4.backends.base.join_sink` in float32 around the kernel's
(out, lse). The backward is the same chain on the final (out, lse): P computed from the lse
that includes the sink is the final softmax, and the sink has no value, so dq, dk, dv need
nothing else. The sink's gradient comes from the same bound backward
(:func:`backward_chain_with_sink`, by batch entry): on Hopper the backward kernel sums the
sink's share of the output's rowsum from its float32 view of the output (``sum_j P_ij dP_ij``),
else ``-sum_i P_sink_i * delta_i`` (:func:`jax_fa4.reference.sink_gradient`'s rule).

Segment ids (:func:`attention_with_extras`): the backend's forward kernel with segment ids
where it has one (``Backend.segments_forward``: key blocks that share no id with a query tile
skipped, :mod:`jax_fa4.segments`), else the reference; its backward by the backend's kernels
with segment ids where they serve the call (``Backend.segments_backward``), else the
reference's explicit FlashAttention backward plus the sink's gradient; reverse mode keeps
``(q, k, v, sink, segment ids, out, lse)``.

Varlen (:func:`varlen`): one rule over the packed batch, jitted with the backend's plan
as a static argument; its backward is the backend's varlen backward, or the reference's packed
backward where the backend has none. Paged KV (:func:`paged`): forward only.

Which backend runs is :func:`jax_fa4.backends.base.choose`'s answer: the one ``opts`` names when
it serves the call, else the reference (a forced implementation raises instead).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jax_fa4 import backends, fp8, reference
from jax_fa4.backends import base
from jax_fa4.backends.base import Segments
from jax_fa4.parallel import sharding
from jax_fa4.tangents import linear


# -- dense -------------------------------------------------------------------------------------
def forward_chain(q, k, v, opts):
    """(out, lse) of one (shard of an) attention call."""
    backend = backends.get(opts.implementation)
    backend = base.choose(backend, "forward", backend.supports_forward(q, k, v, opts), opts,
                          call="call")
    return backend.forward(q, k, v, opts)


def backward_chain(q, k, v, out, lse, dout, dlse, opts):
    """(dq, dk, dv, delta) from the saved forward and the cotangents of (out, lse), with
    ``delta = rowsum(dout * out) - dlse`` (B, H, Sq) float32 (what a sink's gradient needs).

    The backward kernels of ``opts.implementation`` serve the calls they cover; everything else
    (the reference, unsupported shapes or options) runs the reference's explicit backward, which
    is deterministic too; an opt-in backend whose forward ran a kernel says so with a one-time
    :class:`RuntimeWarning` naming the reason.
    """
    chosen, delta, lse_log2, accum = _backward_inputs(q, k, v, out, lse, dout, dlse, opts)
    return (*chosen.backward(q, k, v, out, lse, dout, delta, lse_log2, opts, **accum), delta)


def _backward_inputs(q, k, v, out, lse, dout, dlse, opts):
    """(the backend that runs the backward, delta, lse_log2, accum): the backward's choice,
    and the preprocess of ``opts.implementation`` (or the reference's), which also zero-fills
    the chosen kernel backward's dQ accumulator where it can: ``accum`` is then
    ``{"dq_accum": it}`` for the backward's keyword, else empty (a backend whose
    ``dq_accum_shape`` is None needs no such keyword)."""
    backend = backends.get(opts.implementation)
    chosen = base.choose(backend, "backward", backend.supports_backward(q, k, v, opts), opts,
                         kernel_forward=backend.supports_forward(q, k, v, opts) is None)
    shape = chosen.dq_accum_shape(q, k, v, opts) if chosen is backend else None
    delta, lse_log2, dq_accum = base.preprocess(backend, out, dout, lse, opts, shape)
    # d lse / d S = P, so a cotangent on lse enters dS = P * (dP - delta) as -dlse on delta.
    delta = delta - dlse
    return chosen, delta, lse_log2, ({} if dq_accum is None else {"dq_accum": dq_accum})


def backward_chain_with_sink(q, k, v, out, lse, dout, dlse, sink, opts):
    """(dq, dk, dv, dsink by batch entry (B, H) float32) with a learnable ``sink``: (H,), or
    (B, H) under vmap. Where the backward kernel sums the sink's share of the output's rowsum
    from its float32 view of the output (``Backend.backward_with_sink``), d sink takes that;
    else ``-sum_i P_sink_i * delta_i`` with delta from the 16-bit output (as everywhere else
    the sink's gradient is computed, :func:`jax_fa4.reference.sink_gradient`)."""
    chosen, delta, lse_log2, accum = _backward_inputs(q, k, v, out, lse, dout, dlse, opts)
    if sink.ndim == 1:
        dq, dk, dv, rows = chosen.backward_with_sink(q, k, v, out, lse, dout, delta, lse_log2,
                                                     opts, sink, **accum)
    else:  # one sink per batch entry (vmap): no kernel takes those
        (dq, dk, dv), rows = chosen.backward(q, k, v, out, lse, dout, delta, lse_log2, opts,
                                             **accum), None
    empty = jnp.isneginf(lse)
    p_sink = reference.sink_probability(sink, lse)
    if rows is None:
        part = -jnp.where(empty, 0.0, p_sink * delta.astype(jnp.float32)).sum(axis=-1)
    else:
        part = jnp.where(empty, 0.0, p_sink * dlse.astype(jnp.float32)).sum(axis=-1) - rows
    return dq, dk, dv, part


def forward_chain_with_sink(q, k, v, sink, opts):
    """(out, lse) of one (shard of an) attention call with a learnable sink: (H,), or (B, H)
    under vmap (one per batch entry; joined in float32 around the sink-less forward, as a
    kernel's params carry one sink per head for the whole call)."""
    backend = backends.get(opts.implementation)
    backend = base.choose(backend, "forward", backend.supports_forward(q, k, v, opts), opts,
                          call="call")
    if sink.ndim > 1:
        return base.join_sink_outs(backend.forward(q, k, v, opts), sink)
    return backend.forward(q, k, v, opts, sink=sink)


_forward = sharding.partitioned_forward(forward_chain)
_forward_sink = sharding.partitioned_forward_with_sink(forward_chain_with_sink)
_backward = sharding.partitioned_backward(backward_chain)
_backward_sink = sharding.partitioned_backward_with_sink(backward_chain_with_sink)


# -- forward mode ------------------------------------------------------------------------------
def _reference_tangents(opts, primals, tangents, *, forward=None, **extras):
    """(t_out, t_lse): the JVP of the float32 reference's forward at ``primals`` = (q, k, v[,
    sink]) along ``tangents`` (the same masks, window, softcap and ``extras``); ``forward``
    replaces :func:`jax_fa4.backends.base.reference_forward` (``(q, k, v, sink) -> (out,
    lse)``)."""
    opts = dataclasses.replace(opts, max_logits=False)
    if forward is None:
        def forward(q, k, v, sink):
            return base.reference_forward(q, k, v, opts, learnable_sink=sink, **extras)
    def run(q, k, v, *sink):  # (no sink: the forward's None)
        return forward(q, k, v, *(sink or (None,)))[:2]

    return jax.jvp(run, tuple(primals), tuple(tangents))[1]


def _summed_sink_gradient(parts, sink):
    """d sink from the backward's gradient by batch entry ``parts`` (..., H): summed over the
    leading axes, in the sink's dtype."""
    return parts.reshape(-1, parts.shape[-1]).sum(axis=0).astype(sink.dtype)


def _with_tangents(outs, residuals, tangents, tangent, transpose):
    """The JVP rule's output tangents for ``outs`` = (out, lse[, row_max]): (t_out, t_lse) by
    :func:`jax_fa4.tangents.linear` (``tangent(residuals, tangents)`` in forward mode; in reverse
    mode its transpose ``transpose(residuals, (dout, dlse))``, the backward chain), and zeros
    for the row max, a statistic without a gradient. ``residuals``: any pytree of arrays."""
    flat, tree = jax.tree.flatten(residuals)
    t_out, t_lse = linear(
        lambda res, tans: list(tangent(jax.tree.unflatten(tree, res), tans)),
        lambda res, cts: list(transpose(jax.tree.unflatten(tree, res), cts)),
        flat, list(tangents))
    return (t_out, t_lse, *(jnp.zeros_like(x) for x in outs[2:]))


# -- dense (and a learnable sink) -------------------------------------------------------------
@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def attention(q, k, v, opts):
    """(out, lse) with ``opts`` an :class:`jax_fa4.options.AttentionOptions`, and each row's
    max logit (B, H, Sq) when ``opts.max_logits`` (a statistic: no gradient flows through it).
    Reverse mode runs the backend's backward on the saved (q, k, v, out, lse); forward mode
    the reference's JVP (:mod:`jax_fa4.tangents`)."""
    return _forward(q, k, v, opts)


@attention.defjvp
def _attention_jvp(opts, primals, tangents):
    outs = _forward(*primals, opts)

    def transpose(res, cts):
        return _backward(*res, *cts, opts)[:3]

    return outs, _with_tangents(
        outs, (*primals, outs[0], outs[1]), tangents,
        lambda res, tans: _reference_tangents(opts, res[:3], tans), transpose)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def attention_with_sink(q, k, v, sink, opts):
    """(out, lse[, row_max]) with a learnable sink ``(H,)`` joining every row's denominator."""
    return _forward_sink(q, k, v, sink, opts)


@attention_with_sink.defjvp
def _attention_with_sink_jvp(opts, primals, tangents):
    q, k, v, sink = primals
    outs = _forward_sink(q, k, v, sink, opts)

    def transpose(res, cts):
        q, k, v, sink, out, lse = res
        dq, dk, dv, parts = _backward_sink(q, k, v, out, lse, *cts, sink, opts)
        return dq, dk, dv, _summed_sink_gradient(parts, sink)

    return outs, _with_tangents(
        outs, (q, k, v, sink, outs[0], outs[1]), tangents,
        lambda res, tans: _reference_tangents(opts, res[:4], tans), transpose)


# -- sink and segment ids (the segment-id kernels or the reference) ---------------------------
def _segments_on_kernel(backend, q, k, v, sink, q_ids, opts) -> bool:
    """Whether this (shard of a) call with these extras runs the segment-id kernels: segment
    ids given, a family kernel that takes them, and no per-batch-entry sink (vmap)."""
    return (q_ids is not None and backend is not base.REFERENCE_BACKEND
            and backend.supports_segments(q, k, v, opts) is None
            and (sink is None or sink.ndim == 1))


def _extras_forward_impl(has_sink: bool, has_ids: bool):
    """The shard-local forward with extras: ``(q, k, v, [sink], [q_ids, kv_ids], opts) ->
    (out, lse[, row_max])`` on the segment-id kernel where it serves, else the reference."""

    def run(*args):
        *arrays, opts = args
        q, k, v, *rest = arrays
        sink = rest.pop(0) if has_sink else None
        q_ids, kv_ids = rest if has_ids else (None, None)
        backend = backends.get(opts.implementation)
        if _segments_on_kernel(backend, q, k, v, sink, q_ids, opts):
            return backend.segments_forward(q, k, v, q_ids, kv_ids, opts, sink)
        if sink is not None and sink.ndim > 1:  # one sink per batch entry (vmap): joined after
            return base.join_sink_outs(base.reference_forward(
                q, k, v, opts, q_segment_ids=q_ids, kv_segment_ids=kv_ids), sink)
        return base.reference_forward(q, k, v, opts, learnable_sink=sink, q_segment_ids=q_ids,
                                      kv_segment_ids=kv_ids)

    return run


def extras_backward_impl(has_sink: bool, has_ids: bool):
    """The shard-local backward with extras: ``(q, k, v, out, lse, dout, dlse, [sink],
    [q_ids, kv_ids], opts) -> (dq, dk, dv[, d sink by batch entry (B, H) float32])`` on the
    segment-id backward kernel where the forward ran its kernel and a backward kernel serves,
    else the reference's explicit backward."""

    def run(*args):
        *arrays, opts = args
        q, k, v, out, lse, dout, dlse, *rest = arrays
        sink = rest.pop(0) if has_sink else None
        q_ids, kv_ids = rest if has_ids else (None, None)
        backend = backends.get(opts.implementation)
        if (_segments_on_kernel(backend, q, k, v, sink, q_ids, opts)
                and backend.supports_segments_backward(q, k, v, opts) is None):
            dq, dk, dv, rows = backend.segments_backward(q, k, v, out, lse, dout, dlse, q_ids,
                                                         kv_ids, opts, sink)
            if sink is None:
                return dq, dk, dv
            p_sink = reference.sink_probability(sink, lse)
            share = jnp.where(jnp.isneginf(lse), 0.0, p_sink * dlse.astype(jnp.float32))
            return dq, dk, dv, share.sum(axis=-1) - rows
        segments = Segments(q_ids, kv_ids)
        delta = base.reference_delta(out, dout) - dlse
        dq, dk, dv = base.reference_backward(q, k, v, out, lse, dout, delta, opts,
                                             **segments._asdict())
        if sink is None:
            return dq, dk, dv
        p_sink = reference.sink_probability(sink, lse)
        return dq, dk, dv, -jnp.where(jnp.isneginf(lse), 0.0, p_sink * delta).sum(axis=-1)

    return run


@functools.cache
def _extras_ops(has_sink: bool, has_ids: bool):
    """(forward, backward) operations with these extras, sharded over batch and heads
    (:func:`jax_fa4.parallel.sharding.partitioned`; segment ids (B.., S) follow the batch)."""
    extra = ("sink",) * has_sink + sharding.SEGMENT_IDS * has_ids
    name = "jax_fa4_attention_extras" + "_sink" * has_sink + "_ids" * has_ids
    forward = sharding.partitioned(name + "_fwd", _extras_forward_impl(has_sink, has_ids),
                                   sharding.FORWARD_IN + extra, sharding.FORWARD_OUT)
    backward = sharding.partitioned(
        name + "_bwd", extras_backward_impl(has_sink, has_ids), sharding.BACKWARD_IN + extra,
        sharding.SINK_BACKWARD_OUT if has_sink else sharding.BACKWARD_OUT[:3])
    return forward, backward


def _extra_arrays(sink, segments: Segments) -> tuple:
    ids = () if segments.q_segment_ids is None else (segments.q_segment_ids,
                                                     segments.kv_segment_ids)
    return ((sink,) if sink is not None else ()) + ids


@functools.partial(jax.custom_jvp, nondiff_argnums=(5,))
def _extras(q, k, v, sink, segments, opts):
    forward, _ = _extras_ops(sink is not None, segments.q_segment_ids is not None)
    return forward(q, k, v, *_extra_arrays(sink, segments), opts)


@_extras.defjvp
def _extras_jvp(opts, primals, tangents):
    q, k, v, sink, segments = primals
    outs = _extras(q, k, v, sink, segments, opts)
    n = 3 + (sink is not None)

    def tangent(res, tans):
        q, k, v, sink, segments = res[:5]
        return _reference_tangents(opts, (q, k, v, sink)[:n], tans, **segments._asdict())

    def transpose(res, cts):
        return _extras_backward(opts, res, cts)[:n]

    return outs, _with_tangents(outs, (*primals, outs[0], outs[1]), tangents[:n], tangent,
                                transpose)


def _extras_backward(opts, residuals, cotangents):
    """(dq, dk, dv, d sink or None) of :func:`_extras` from its saved (q, k, v, sink, segments,
    out, lse) and the cotangents of (out, lse)."""
    q, k, v, sink, segments, out, lse = residuals
    dout, dlse = cotangents[:2]
    has_ids = segments.q_segment_ids is not None
    backend = backends.get(opts.implementation)
    if has_ids and _segments_on_kernel(backend, q, k, v, sink, segments.q_segment_ids, opts):
        # says once when the gradient runs the reference's backward (the shard-local choice
        # repeats this test)
        base.choose(backend, "backward with segment_ids",
                    backend.supports_segments_backward(q, k, v, opts), opts, kernel_forward=True)
    _, backward = _extras_ops(sink is not None, has_ids)
    grads = backward(q, k, v, out, lse, dout, dlse, *_extra_arrays(sink, segments), opts)
    dsink = None if sink is None else _summed_sink_gradient(grads[3], sink)
    return (*grads[:3], dsink)


def attention_with_extras(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    opts: Any,
    *,
    learnable_sink: jax.Array | None = None,
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(out, lse)`` of :func:`jax_fa4.flash_attention` with a sink and/or segment ids (and
    each row's max logit (B, H, Sq) after them when ``opts.max_logits``).

    The inputs are already validated: q, k, v and ``opts`` (an
    :class:`jax_fa4.options.AttentionOptions`) by :func:`jax_fa4.options.canonicalize`, the
    extras by :func:`jax_fa4.options.check_learnable_sink` and
    :func:`jax_fa4.options.check_segment_ids`. Differentiable in q, k, v and the sink. The window
    rule keeps its usual positions (``i + Sk - Sq`` and ``j`` in the whole sequence); segment ids
    only add ``q_segment_ids[b, i] == kv_segment_ids[b, j]``.

    Raises:
        ImplementationUnavailableError: if a backend that does not take these options was
            forced (no kernel takes them yet).
    """
    what = " and ".join(name for name, x in (("learnable_sink", learnable_sink),
                                             ("segment_ids", segment_ids)) if x is not None)
    backend = backends.get(opts.implementation)
    q_ids, kv_ids = (None, None) if segment_ids is None else segment_ids
    segments = Segments(q_ids, kv_ids)
    if segment_ids is not None:
        reason = backend.supports_segments(q, k, v, opts)
        if reason is None and learnable_sink is not None and learnable_sink.ndim != 1:
            reason = "a learnable sink per batch entry (vmap) does not reach the kernel"
        base.choose(backend, "attention with " + what, reason, opts, call="call")
    else:
        base.choose(backend, "attention with " + (what or "extras"),
                    backend.supports_extras(what or "this call"), opts, call="call")
    return _extras(q, k, v, learnable_sink, segments, opts)


# -- varlen ------------------------------------------------------------------------------------
@functools.partial(jax.custom_jvp, nondiff_argnums=(7, 8))
def _varlen_attention(q, k, v, sink, segments, cu_seqlens_q, cu_seqlens_k, opts, route):
    name, plan = route
    return backends.get(name).varlen_forward(q, k, v, sink, segments, cu_seqlens_q,
                                             cu_seqlens_k, opts, plan)


@_varlen_attention.defjvp
def _varlen_jvp(opts, route, primals, tangents):
    q, k, v, sink, segments, cu_q, cu_k = primals
    outs = _varlen_attention(q, k, v, sink, segments, cu_q, cu_k, opts, route)
    n = 3 + (sink is not None)

    def tangent(res, tans):
        q, k, v, sink, segments, cu_q, cu_k = res[:7]

        def forward(q, k, v, sink):  # the reference's packed forward
            return base.REFERENCE_BACKEND.varlen_forward(q, k, v, sink, segments, cu_q, cu_k,
                                                         opts, None)

        return _reference_tangents(opts, (q, k, v, sink)[:n], tans, forward=forward)

    def transpose(res, cts):
        return _varlen_backward(opts, route, res, cts)[:n]

    return outs, _with_tangents(outs, (*primals, outs[0], outs[1]), tangents[:n], tangent,
                                transpose)


def _varlen_backward(opts, route, residuals, cotangents):
    """(dq, dk, dv, d sink or None) of :func:`_varlen_attention` from its saved inputs and
    (out, lse), and the cotangents of (out, lse)."""
    q, k, v, sink, segments, cu_q, cu_k, out, lse = residuals
    dout, dlse = cotangents
    name, plan = route
    backend = backends.get(name)
    chosen = base.choose(backend, "varlen backward",
                         backend.supports_varlen_backward(q, k, v, opts), opts,
                         kernel_forward=True)
    dq, dk, dv, dsink = chosen.varlen_backward(q, k, v, sink, segments, cu_q, cu_k, out, lse,
                                               dout, dlse, opts, plan)
    return dq, dk, dv, dsink


@functools.partial(jax.jit, static_argnames=("opts", "route", "max_seqlen_q", "max_seqlen_k"))
def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, learnable_sink, opts, route, max_seqlen_q,
            max_seqlen_k):
    # (the identity on valid metadata; keeps bad traced values inside every buffer)
    cu_seqlens_q = base.clamp_cu_seqlens(cu_seqlens_q, q.shape[0], max_seqlen_q)
    cu_seqlens_k = base.clamp_cu_seqlens(cu_seqlens_k, k.shape[0], max_seqlen_k)
    segments = base.varlen_segments(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    out, lse = _varlen_attention(q, k, v, learnable_sink, segments, cu_seqlens_q, cu_seqlens_k,
                                 opts, route)
    # Padding rows (in no sequence) have lse -inf even with a sink, and pass no cotangent on.
    lse = jnp.where(segments.q_segment_ids >= 0, lse[0], -jnp.inf)
    return out[0], lse  # (total_q, H, Dv), (H, total_q)


def varlen_route(q, k, v, opts, max_seqlen_q: int, max_seqlen_k: int) -> tuple:
    """(name of the backend running the varlen forward, its plan): decided outside the jit, so
    that it keys the jitted call."""
    backend, plan = base.planned(
        backends.get(opts.implementation), "varlen attention", opts,
        lambda b: b.varlen_plan(q, k, v, opts, max_seqlen_q, max_seqlen_k))
    return backend.name, plan


def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, learnable_sink, opts, max_seqlen_q: int,
           max_seqlen_k: int) -> tuple[jax.Array, jax.Array]:
    """(out (total_q, H, Dv), lse (H, total_q)) of a validated varlen call."""
    route = varlen_route(q, k, v, opts, max_seqlen_q, max_seqlen_k)
    return _varlen(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(cu_seqlens_q),
                   jnp.asarray(cu_seqlens_k), learnable_sink, opts, route, max_seqlen_q,
                   max_seqlen_k)


# -- paged KV (forward only) ------------------------------------------------------------------
def _paged_forward(q, k_cache, v_cache, page_table, seqused_k, learnable_sink, opts, route):
    name, plan = route
    return backends.get(name).paged_forward(q, k_cache, v_cache, page_table, seqused_k,
                                            learnable_sink, opts, plan)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _paged(q, k_cache, v_cache, page_table, seqused_k, learnable_sink, opts, route):
    return _paged_forward(q, k_cache, v_cache, page_table, seqused_k, learnable_sink, opts, route)


def _paged_fwd(q, k_cache, v_cache, page_table, seqused_k, learnable_sink, opts, route):
    out = _paged_forward(q, k_cache, v_cache, page_table, seqused_k, learnable_sink, opts, route)
    return out, None


def _paged_bwd(opts, route, residuals, cotangents):
    raise NotImplementedError(
        "flash_attention_paged is forward only (decode / prefill over a KV cache): it has no "
        "gradient. Wrap its inputs in jax.lax.stop_gradient if the surrounding computation is "
        "differentiated, or use flash_attention / flash_attention_varlen for training.")


_paged.defvjp(_paged_fwd, _paged_bwd)


@functools.partial(jax.jit, static_argnames=("opts", "route"))
def _paged_jit(q, k_cache, v_cache, page_table, seqused_k, learnable_sink, opts, route):
    return _paged(q, k_cache, v_cache, page_table, seqused_k, learnable_sink, opts, route)


def paged_route(q, k_cache, v_cache, page_table, opts) -> tuple:
    """(name of the backend running the paged call, its plan), decided outside the jit."""
    backend, plan = base.planned(
        backends.get(opts.implementation), "paged KV attention", opts,
        lambda b: b.paged_plan(q, k_cache, v_cache, page_table, opts))
    return backend.name, plan


def paged(q, k_cache, v_cache, page_table, seqused_k, learnable_sink, opts
          ) -> tuple[jax.Array, jax.Array]:
    """(out (B, Sq, H, Dv), lse (B, H, Sq)) of a validated paged call."""
    route = paged_route(q, k_cache, v_cache, page_table, opts)
    return _paged_jit(jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache),
                      jnp.asarray(page_table), jnp.asarray(seqused_k), learnable_sink, opts,
                      route)


# -- FP8 (forward only; jax_fa4.fp8) ------------------------------------------------------------
def fp8_route(q, k, v, opts) -> tuple:
    """(name of the backend running the FP8 forward, its plan), decided outside the jit."""
    backend, plan = base.planned(backends.get(opts.implementation), "FP8 attention", opts,
                                 lambda b: b.fp8_plan(q, k, v, opts))
    return backend.name, plan


@dataclasses.dataclass(frozen=True)
class Fp8Static:
    """The FP8 forward's static parameters: the call's options, the route decided outside the
    jit (backend name, plan) and the output dtype (the sharded operation's ``out`` type)."""

    opts: Any
    route: tuple
    out_dtype: Any


def _fp8_forward_impl(q, k, v, q_descale, k_descale, v_descale, static: Fp8Static):
    name, plan = static.route
    out, lse = backends.get(name).fp8_forward(q, k, v, q_descale, k_descale, v_descale,
                                              static.opts, plan)
    return out.astype(static.out_dtype), lse


_fp8_forward = sharding.partitioned_fp8_forward(_fp8_forward_impl)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _fp8_attention(q, k, v, q_descale, k_descale, v_descale, static):
    return tuple(_fp8_forward(q, k, v, q_descale, k_descale, v_descale, static))


def _fp8_attention_fwd(q, k, v, q_descale, k_descale, v_descale, static):
    return _fp8_attention(q, k, v, q_descale, k_descale, v_descale, static), None


#: What differentiating an FP8 call raises.
FP8_FORWARD_ONLY = (
    "attention with float8_e4m3fn inputs is forward only (prefill and inference): it has no "
    "gradient. Train with bfloat16 inputs (and quantise for inference with jax_fa4.fp8), or "
    "wrap the FP8 call's inputs in jax.lax.stop_gradient if the surrounding computation is "
    "differentiated.")


def _fp8_attention_bwd(static, residuals, cotangents):
    raise NotImplementedError(FP8_FORWARD_ONLY)


_fp8_attention.defvjp(_fp8_attention_fwd, _fp8_attention_bwd)


@functools.partial(jax.jit, static_argnames=("static",))
def _fp8_run(q, k, v, q_descale, k_descale, v_descale, static):
    return _fp8_attention(q, k, v, q_descale, k_descale, v_descale, static)


def fp8_attention(q, k, v, q_descale, k_descale, v_descale, opts, out_dtype
                  ) -> tuple[jax.Array, jax.Array]:
    """(out (B, Sq, H, Dv) in ``out_dtype``, lse (B, H, Sq) float32) of a validated FP8 call:
    e4m3 q, k, v and their (B, Hkv) float32 descales (:mod:`jax_fa4.fp8`). Forward only."""
    return _fp8_run(q, k, v, q_descale, k_descale, v_descale,
                    Fp8Static(opts, fp8_route(q, k, v, opts), jnp.dtype(out_dtype)))


# -- FP8 paged KV and varlen (forward only) ------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fp8_forward_only(run, static: Fp8Static, *args):
    """``run(*args, static)``, with a gradient that raises (:data:`FP8_FORWARD_ONLY`)."""
    return run(*args, static)


def _fp8_forward_only_fwd(run, static, *args):
    return _fp8_forward_only(run, static, *args), None


def _fp8_forward_only_bwd(run, static, residuals, cotangents):
    raise NotImplementedError(FP8_FORWARD_ONLY)


_fp8_forward_only.defvjp(_fp8_forward_only_fwd, _fp8_forward_only_bwd)


def _fp8_paged_impl(q, k_cache, v_cache, page_table, seqused_k, q_descale, k_descale,
                    v_descale, static: Fp8Static):
    name, plan = static.route
    return backends.get(name).fp8_paged_forward(q, k_cache, v_cache, page_table, seqused_k,
                                                q_descale, k_descale, v_descale, static.opts,
                                                plan)


@functools.partial(jax.jit, static_argnames=("static",))
def _fp8_paged_run(q, k_cache, v_cache, page_table, seqused_k, q_descale, k_descale, v_descale,
                   static: Fp8Static):
    if q.dtype != fp8.FP8:  # one e4m3 scale per (batch entry, kv head), as the kernels take q
        q, q_descale = fp8.quantize_grouped(q, k_cache.shape[2])
    out, lse = _fp8_forward_only(_fp8_paged_impl, static, q, k_cache, v_cache, page_table,
                                 seqused_k, q_descale, k_descale, v_descale)
    return out.astype(static.out_dtype), lse


def fp8_paged(q, k_cache, v_cache, page_table, seqused_k, q_descale, k_descale, v_descale,
              opts, out_dtype) -> tuple[jax.Array, jax.Array]:
    """(out (B, Sq, H, Dv) in ``out_dtype``, lse (B, H, Sq)) of a validated paged call over an
    e4m3 cache: q e4m3 with its (B, Hkv) descale, or 16-bit / float32 (``q_descale`` None:
    quantised here by :func:`jax_fa4.fp8.quantize_grouped`); the cache's descales (Hkv,)
    float32. Forward only."""
    q8_shape = jax.ShapeDtypeStruct(q.shape, fp8.FP8)  # (what the backend gets)
    backend, plan = base.planned(
        backends.get(opts.implementation), "FP8 paged KV attention", opts,
        lambda b: b.fp8_paged_plan(q8_shape, k_cache, v_cache, page_table, opts))
    static = Fp8Static(opts, (backend.name, plan), jnp.dtype(out_dtype))
    return _fp8_paged_run(jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache),
                          jnp.asarray(page_table), jnp.asarray(seqused_k), q_descale, k_descale,
                          v_descale, static)


def _fp8_varlen_impl(q, k, v, segments, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale,
                     v_descale, static: Fp8Static):
    name, plan = static.route
    return backends.get(name).fp8_varlen_forward(q, k, v, segments, cu_seqlens_q, cu_seqlens_k,
                                                 q_descale, k_descale, v_descale, static.opts,
                                                 plan)


@functools.partial(jax.jit, static_argnames=("static", "max_seqlen_q", "max_seqlen_k"))
def _fp8_varlen_run(q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale, v_descale,
                    static: Fp8Static, max_seqlen_q: int, max_seqlen_k: int):
    # (as _varlen: the identity on valid metadata)
    cu_seqlens_q = base.clamp_cu_seqlens(cu_seqlens_q, q.shape[0], max_seqlen_q)
    cu_seqlens_k = base.clamp_cu_seqlens(cu_seqlens_k, k.shape[0], max_seqlen_k)
    segments = base.varlen_segments(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    out, lse = _fp8_forward_only(_fp8_varlen_impl, static, q, k, v, segments, cu_seqlens_q,
                                 cu_seqlens_k, q_descale, k_descale, v_descale)
    lse = jnp.where(segments.q_segment_ids >= 0, lse[0], -jnp.inf)
    return out[0].astype(static.out_dtype), lse  # (total_q, H, Dv), (H, total_q)


def fp8_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale, v_descale, opts,
               out_dtype, max_seqlen_q: int, max_seqlen_k: int) -> tuple[jax.Array, jax.Array]:
    """(out (total_q, H, Dv) in ``out_dtype``, lse (H, total_q)) of a validated varlen call
    with packed e4m3 q, k, v and (num_sequences, Hkv) float32 descales. Forward only."""
    backend, plan = base.planned(
        backends.get(opts.implementation), "FP8 varlen attention", opts,
        lambda b: b.fp8_varlen_plan(q, k, v, opts, max_seqlen_q, max_seqlen_k))
    static = Fp8Static(opts, (backend.name, plan), jnp.dtype(out_dtype))
    return _fp8_varlen_run(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                           jnp.asarray(cu_seqlens_q), jnp.asarray(cu_seqlens_k), q_descale,
                           k_descale, v_descale, static, max_seqlen_q, max_seqlen_k)
