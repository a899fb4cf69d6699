"""``custom_vjp`` wiring: the forward saves (q, k, v, out, lse); the backward runs the
preprocess (``delta = rowsum(dO * O)``) and then the backward proper.

Both halves are bound through :mod:`jax_fa4.sharding`, so under ``jax.jit`` with q, k, v sharded
over batch and heads each device runs them on its own shard (see that module for the rules).
"""

from __future__ import annotations

import functools

import jax

from jax_fa4 import ops, sharding


def forward_chain(q, k, v, opts):
    """(out, lse) of one (shard of an) attention call."""
    return ops.forward(q, k, v, opts)


def backward_chain(q, k, v, out, lse, dout, dlse, opts):
    """(dq, dk, dv) from the saved forward and the cotangents of (out, lse)."""
    delta, lse_log2 = ops.bwd_preprocess(out, dout, lse, opts.implementation)
    # d lse / d S = P, so a cotangent on lse enters dS = P * (dP - delta) as -dlse on delta.
    delta = delta - dlse
    return ops.backward(q, k, v, out, lse, dout, delta, lse_log2, opts)


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
    return _backward(q, k, v, out, lse, dout, dlse, opts)


attention.defvjp(_fwd, _bwd)
