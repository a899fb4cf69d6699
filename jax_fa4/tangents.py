"""Forward-mode autodiff for the attention calls: a linear operation with its own transpose.

``jax.custom_vjp`` gives reverse mode only (``jax.jvp`` of such a function raises). The
differentiable entry points of :mod:`jax_fa4.autodiff` are instead ``jax.custom_jvp`` functions
whose JVP rule returns the primal outputs of the kernels and tangents from :func:`linear`: one
primitive, linear in its tangent operands, that

* evaluates ``tangent(residuals, tangents)`` in forward mode (``jax.jvp``, ``jax.linearize``,
  ``jax.jacfwd``): for attention, the JVP of the float32 reference's forward at the call's
  inputs, masks and extras (one more attention-sized pass over q, k, v, on the reference);
* transposes to ``transpose(residuals, cotangents)`` in reverse mode (``jax.grad``, ``jax.vjp``):
  the backend's backward chain on the saved (q, k, v, out, lse), exactly what the
  ``custom_vjp`` rules ran, so ``jax.grad`` runs the same kernels on the same residuals.

So reverse mode linearises the JVP rule, keeps the primal outputs as residuals and transposes the
linear part into the backward kernels; forward mode never touches them. The primitive batches by
vmapping both functions (``jax.vmap``; its tangent operands are then all batched, so that every
transpose has the batch its operands have) and lowers through ``tangent``'s own lowering.

Second-order derivatives through the attention calls (a JVP of a JVP or of a transpose) are not
supported and raise :class:`NotImplementedError` (the primitive is linear: its own JVP, with the
residuals held still, is itself).

``jax.linear_call`` (JAX's own linear call with a custom transpose) has the same meaning but no
batching rule, so ``jax.vmap`` of ``jax.grad`` (and ``jax.jacfwd``) through it fails: hence a
primitive of this package.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
from jax.interpreters import ad, batching, mlir

from jax_fa4.parallel.manual_axes import vary_like

linear_p = jax.extend.core.Primitive("jax_fa4_linear")
linear_p.multiple_results = True


class LinearFunctions:
    """The pair a :data:`linear_p` equation carries: ``tangent(residuals, tangents) -> outs``
    and ``transpose(residuals, cotangents) -> tangent cotangents``, each on flat lists of
    arrays, and the number of residual operands that lead the primitive's operands. Compared and
    hashed by identity (each call of an attention function makes its own)."""

    __slots__ = ("tangent", "transpose", "num_residuals")

    def __init__(self, tangent: Callable, transpose: Callable, num_residuals: int):
        self.tangent = tangent
        self.transpose = transpose
        self.num_residuals = num_residuals

    def split(self, operands: Sequence[Any]) -> tuple[list, list]:
        n = self.num_residuals
        return list(operands[:n]), list(operands[n:])


def linear(tangent: Callable, transpose: Callable, residuals: Sequence[jax.Array],
           tangents: Sequence[jax.Array]) -> list[jax.Array]:
    """``tangent(residuals, tangents)``, linear in ``tangents``, whose transpose (reverse mode)
    is ``transpose(residuals, cotangents)``.

    Args:
        tangent: ``(residuals: list, tangents: list) -> list`` of output tangents; any JAX
            function linear in its second argument.
        transpose: ``(residuals: list, cotangents: list) -> list``, one cotangent per tangent
            operand, each of that operand's shape and dtype.
        residuals: the arrays both functions are not linear in.
        tangents: the arrays ``tangent`` is linear in.
    """
    fns = LinearFunctions(tangent, transpose, len(residuals))
    # Inside shard_map every operand is made to vary over the manual axes any of them varies
    # over (an invariant tangent's cotangent is then summed over those axes, as JAX does for
    # any invariant input of a varying computation), and the results carry that type from the
    # abstract evaluation: marking the results afterwards would transpose into a sum of the
    # outputs' cotangents across devices.
    operands = list(vary_like([*residuals, *tangents], *residuals, *tangents))
    return list(linear_p.bind(*operands, fns=fns))


def _impl(*operands, fns: LinearFunctions):
    return fns.tangent(*fns.split(operands))


def _abstract_eval(*avals, fns: LinearFunctions):
    """The tangent's shapes and dtypes; each result takes the type (manual axes, sharding) of an
    operand of its shape and dtype (attention: out's and lse's residuals), else a plain one."""
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    outs = jax.eval_shape(lambda *x: fns.tangent(*fns.split(x)), *structs)
    result = []
    for o in outs:
        like = next((a for a in avals if a.shape == o.shape and a.dtype == o.dtype), None)
        result.append(jax.core.ShapedArray(o.shape, o.dtype) if like is None
                      else like.update(weak_type=False))
    return result


def _transpose(cts, *operands, fns: LinearFunctions):
    residuals, tangents = fns.split(operands)
    if any(ad.is_undefined_primal(r) for r in residuals):
        raise NotImplementedError(
            "jax-fa4: an attention call's tangent is linear in its tangents only: differentiating "
            "it with respect to q, k, v again (a second-order derivative) is not supported")
    cts = [ad.instantiate_zeros(ct) for ct in cts]
    grads = fns.transpose(residuals, cts)
    return [None] * len(residuals) + [g if ad.is_undefined_primal(t) else None
                                      for g, t in zip(grads, tangents)]


def _jvp(primals, tangents, *, fns: LinearFunctions):
    """A linear map's JVP is itself, along the tangent operands' tangents, while the residuals
    hold still; a moving residual would need the tangent's own derivative (second order)."""
    res_tangents, lin_tangents = fns.split(tangents)
    if any(type(t) is not ad.Zero for t in res_tangents):
        raise NotImplementedError(
            "jax-fa4: second-order derivatives through an attention call are not supported")
    outs = linear_p.bind(*primals, fns=fns)
    lin_tangents = [ad.instantiate_zeros(t) for t in lin_tangents]
    return outs, linear_p.bind(*fns.split(primals)[0], *lin_tangents, fns=fns)


def _batch(args, dims, *, fns: LinearFunctions):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    residuals, tangents = fns.split(args)
    res_dims, tan_dims = fns.split(dims)
    res_axes = list(res_dims)
    # Every tangent operand carries the batch: the transpose of a batched tangent then has the
    # operand's batch too (an unbatched operand's broadcast sums it back).
    tangents = [jnp.broadcast_to(t, (size, *t.shape)) if d is None
                else jnp.moveaxis(t, d, 0) for t, d in zip(tangents, tan_dims)]

    def tangent(res, tans):
        return jax.vmap(fns.tangent, in_axes=(res_axes, 0))(res, tans)

    def transpose(res, cts):
        return jax.vmap(fns.transpose, in_axes=(res_axes, 0))(res, cts)

    batched = LinearFunctions(tangent, transpose, fns.num_residuals)
    outs = linear_p.bind(*residuals, *tangents, fns=batched)
    return outs, [0] * len(outs)


linear_p.def_impl(_impl)
linear_p.def_abstract_eval(_abstract_eval)
ad.primitive_transposes[linear_p] = _transpose
ad.primitive_jvps[linear_p] = _jvp
batching.primitive_batchers[linear_p] = _batch
mlir.register_lowering(linear_p, mlir.lower_fun(_impl, multiple_results=True))
