"""``custom_vjp`` wiring: the forward saves (q, k, v, out, lse); the backward runs the
preprocess (``delta = rowsum(dO * O)``) and then the backward proper.

With a learnable sink (:func:`attention_with_sink`) the sink joins the kernel's (out, lse)
afterwards (:func:`jax_fa4.ops.join_sink`); the backward is the same chain on the final (out,
lse): P computed from the lse that includes the sink is the final softmax, and the sink has no
value, so dq, dk, dv need nothing else. The sink's gradient is
:func:`jax_fa4.reference.sink_gradient`.

Both halves are bound through :mod:`jax_fa4.parallel.sharding`, so under ``jax.jit`` with q, k, v sharded
over batch and heads each device runs them on its own shard (see that module for the rules).
"""

from __future__ import annotations

import functools

import jax

from jax_fa4 import ops, reference
from jax_fa4.parallel import sharding


def forward_chain(q, k, v, opts):
    """(out, lse) of one (shard of an) attention call."""
    return ops.forward(q, k, v, opts)


def backward_chain(q, k, v, out, lse, dout, dlse, opts):
    """(dq, dk, dv, delta) from the saved forward and the cotangents of (out, lse), with
    ``delta = rowsum(dout * out) - dlse`` (B, H, Sq) float32 (what a sink's gradient needs)."""
    delta, lse_log2 = ops.bwd_preprocess(out, dout, lse, opts.implementation)
    # d lse / d S = P, so a cotangent on lse enters dS = P * (dP - delta) as -dlse on delta.
    delta = delta - dlse
    return (*ops.backward(q, k, v, out, lse, dout, delta, lse_log2, opts), delta)


_forward = sharding.partitioned_forward(forward_chain)
_backward = sharding.partitioned_backward(backward_chain)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def attention(q, k, v, opts):
    """(out, lse) with ``opts`` an :class:`jax_fa4.api.AttentionOptions`."""
    return _forward(q, k, v, opts)


def _fwd(q, k, v, opts):
    out, lse = _forward(q, k, v, opts)
    return (out, lse), (q, k, v, out, lse)


def _bwd(opts, residuals, cotangents):
    q, k, v, out, lse = residuals
    dout, dlse = cotangents
    return _backward(q, k, v, out, lse, dout, dlse, opts)[:3]


attention.defvjp(_fwd, _bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def attention_with_sink(q, k, v, sink, opts):
    """(out, lse) with a learnable sink ``(H,)`` joining every row's denominator."""
    return ops.join_sink(*_forward(q, k, v, opts), sink)


def _sink_fwd(q, k, v, sink, opts):
    out, lse = ops.join_sink(*_forward(q, k, v, opts), sink)
    return (out, lse), (q, k, v, sink, out, lse)


def _sink_bwd(opts, residuals, cotangents):
    q, k, v, sink, out, lse = residuals
    dout, dlse = cotangents
    dq, dk, dv, delta = _backward(q, k, v, out, lse, dout, dlse, opts)
    # (the preprocess's delta: no second pass over out and dout)
    return dq, dk, dv, reference.sink_gradient(sink, lse, delta)


attention_with_sink.defvjp(_sink_fwd, _sink_bwd)
