"""Sharded attention under ``jax.jit``: batch and head sharding without gathering q, k, v.

:func:`jax_fa4.flash_attention` runs two operations, the forward ``(q, k, v) -> (out, lse)`` and
the backward chain ``(q, k, v, out, lse, dout, dlse) -> (dq, dk, dv)`` (see
:mod:`jax_fa4.autodiff`). Each is bound as a primitive of this module whose lowering is a
:func:`jax.experimental.custom_partitioning` of the unsharded function, so when q, k, v are
sharded over a :class:`jax.sharding.Mesh` the SPMD partitioner runs the kernels (or the
reference) on each device's shard instead of gathering the inputs.

Dimension letters: B batch, Sq / Sk query / key length, H query heads, Hkv key/value heads
(query head ``h`` uses kv head ``h // (H / Hkv)``), D / Dv head dims. Under ``jax.vmap`` the
mapped axes become extra leading batch dims ``B0, B1, ...`` (folded into B only on each device,
so a sharded vmapped axis stays sharded).

The sharding rule (Shardy factors; the forward shown, the backward maps
``(q, k, v, out, lse, dout, dlse) -> (dq, dk, dv)`` with the same factors)::

    q (b.., sq, h, d), k (b.., sk, hkv, d), v (b.., sk, hkv, dv)
        -> out (b.., sq, h, dv), lse (b.., h, sq)

- Batch dims ``b..`` and heads ``h`` / ``hkv`` are passthrough factors: each device computes its
  batch rows and its heads. ``sq``, ``sk``, ``d`` and ``dv`` need replication.
- GQA: q's heads and k/v's heads must split by the same factor, so that a device holds kv heads
  ``[i * Hkv/n, (i+1) * Hkv/n)`` and exactly the query heads that use them. The partition callback
  takes the head sharding of q and applies it to k, v (and to every other operand and result)
  when its size divides Hkv; otherwise (e.g. MQA with sharded heads) the heads are replicated:
  correct, at the cost of a gather. ``h`` and ``hkv`` are separate factors on purpose: a
  compound ``(hkv g)`` lets Shardy split a mesh axis into sub-axes (H=8 over 4 devices with
  Hkv=2), which a partition spec cannot express. A batch axis that does not divide its dim is
  replicated too.
- **A sequence-sharded q, k or v is replicated, not rejected** (all-gathered along the sequence
  before the kernel), so results are always right, and Shardy, knowing the sequence needs
  replication, prefers head sharding where it has the choice (e.g. sequence-parallel layers
  around the attention). For context parallelism, where the sequence must stay split, call
  :func:`jax_fa4.ring_attention` inside :func:`jax.shard_map`. Under explicit sharding
  (``jax.sharding.AxisType.Explicit``), where the sharding is part of the type and the output
  type could not be honoured, a sequence- or head_dim-sharded q, k or v raises ``ValueError``.
- The backward partition forces ``out``, ``dout``, ``lse`` and ``dlse`` to q's batch/head
  sharding (a cotangent can arrive replicated, e.g. from ``jnp.sum``'s transpose).

On one device, or inside ``shard_map`` with every mesh axis manual, the operations are inlined.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import (
    ArrayMapping,
    SdyShardingRule,
    custom_partitioning,
)
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["partitioned_backward", "partitioned_backward_with_sink", "partitioned_forward",
           "partitioned_forward_with_sink"]

_REPLICATED_FACTORS = ("sq", "sk", "d", "dv")

# Operand kinds: (B.., S, H, X) arrays, (B.., H, S) row statistics (lse, its cotangent),
# per-head vectors (a learnable sink: (H,), or (V.., H) under vmap, V.. the mapped dims, which
# are B..'s leading dims) and per-(batch, head) sums (B.., H) (the sink's gradient by batch
# entry, summed by the caller).
_BSHX, _BHS, _H, _BH = "bshx", "bhs", "h", "bh"
_FORWARD_IN, _FORWARD_OUT = (_BSHX,) * 3, (_BSHX, _BHS)
_FORWARD_SINK_IN = (_BSHX,) * 3 + (_H,)
_BACKWARD_IN = (_BSHX, _BSHX, _BSHX, _BSHX, _BHS, _BSHX, _BHS)
_BACKWARD_OUT = (_BSHX, _BSHX, _BSHX, _BHS)
_BACKWARD_SINK_IN = _BACKWARD_IN + (_H,)
_BACKWARD_SINK_OUT = (_BSHX, _BSHX, _BSHX, _BH)


# -- folding extra leading batch dims (from vmap) into B, on each device -----------------------
def _folding(impl: Callable, kinds_in: tuple[str, ...]) -> Callable:
    """``impl(*arrays, opts)`` on 4-D q/k/v, applied to arrays with any number of leading batch
    dims (folded into one on each device, where it costs no communication). A per-head operand
    (``_H``) mapped by vmap, (V.., H), becomes one row per folded batch entry, (B, H)."""

    def run(*args):
        *arrays, opts = args
        lead = arrays[0].shape[:-3]
        if len(lead) == 1:
            return tuple(impl(*arrays, opts))
        n = math.prod(lead)
        flat = []
        for kind, x in zip(kinds_in, arrays):
            if kind == _H:
                x = jnp.broadcast_to(x[..., None, :], (*lead, x.shape[-1]))
                flat.append(x.reshape(n, x.shape[-1]))
            else:
                flat.append(x.reshape(n, *x.shape[len(lead):]))
        return tuple(o.reshape(*lead, *o.shape[1:]) for o in impl(*flat, opts))

    return run


# -- types of the two operations ----------------------------------------------------------------
def _forward_avals(q, k, v):
    """out like q with v's head dim, lse (B.., H, Sq) float32; both keep q's batch/head sharding
    (explicit mesh axes) and q's varying manual axes (inside ``shard_map``)."""
    _check_explicit_sharding(q, k, v)
    *lead, sq, h, _ = q.shape
    spec = _padded(q.sharding.spec, q.ndim)
    mesh = q.sharding.mesh
    out = q.update(shape=(*lead, sq, h, v.shape[-1]), weak_type=False,
                   sharding=NamedSharding(mesh, PartitionSpec(*spec[:-3], None, spec[-2], None)))
    lse = q.update(shape=(*lead, h, sq), dtype=jnp.float32, weak_type=False,
                   sharding=NamedSharding(mesh, PartitionSpec(*spec[:-3], spec[-2], None)))
    return out, lse


def _forward_sink_avals(q, k, v, sink):
    del sink
    return _forward_avals(q, k, v)


def _backward_avals(q, k, v, out, lse, dout, dlse):
    """dq, dk, dv like q, k, v; delta like lse."""
    del out, dout, dlse
    return tuple(x.update(weak_type=False) for x in (q, k, v, lse))


def _backward_sink_avals(q, k, v, out, lse, dout, dlse, sink):
    """dq, dk, dv like q, k, v; the sink's gradient by batch entry (B.., H) float32, sharded
    like lse without its rows."""
    del out, dout, dlse, sink
    spec = _padded(lse.sharding.spec, lse.ndim)
    part = lse.update(shape=lse.shape[:-1], dtype=jnp.float32, weak_type=False,
                      sharding=NamedSharding(lse.sharding.mesh, PartitionSpec(*spec[:-1])))
    return (*(x.update(weak_type=False) for x in (q, k, v)), part)


def _check_explicit_sharding(q, k, v) -> None:
    """Where the sharding is part of the type (explicit mesh axes), reject a split sequence.

    Raises:
        ValueError: if q, k or v is sharded along the sequence or the head dim.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        spec = _padded(x.sharding.spec, x.ndim)
        if spec[-3] is not None or spec[-1] is not None:
            raise ValueError(
                f"flash_attention: {name} is sharded along its sequence or head_dim axis "
                f"({PartitionSpec(*spec)}), but flash_attention splits work only over batch and "
                "heads. For sequence (context) parallelism call jax_fa4.ring_attention inside "
                "jax.shard_map; otherwise reshard the sequence axis to replicated first.")


# -- the partitioning rules --------------------------------------------------------------------
def _padded(spec, ndim: int) -> tuple:
    spec = tuple(spec) if spec is not None else ()
    return spec + (None,) * (ndim - len(spec))


def _axis_size(mesh, entry) -> int:
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[n] for n in names)


def _kept_axes(mesh, q, k) -> tuple[tuple, Any]:
    """The mesh axes kept on q's batch dims and on the heads (``None`` where replicated)."""
    n_lead = q.ndim - 3
    sharding = q.sharding
    if not isinstance(sharding, NamedSharding):
        return (None,) * n_lead, None
    spec = _padded(sharding.spec, q.ndim)
    batch = tuple(a if q.shape[i] % _axis_size(mesh, a) == 0 else None
                  for i, a in enumerate(spec[:n_lead]))
    heads = spec[-2]
    if heads is not None and k.shape[-2] % _axis_size(mesh, heads):
        heads = None  # H and Hkv must split by the same factor: replicate instead
    return batch, heads


def _shardings(mesh, kinds, batch, heads) -> tuple[NamedSharding, ...]:
    specs = {_BSHX: PartitionSpec(*batch, None, heads, None),
             _BHS: PartitionSpec(*batch, heads, None),
             _H: PartitionSpec(*batch[:-1], heads),
             _BH: PartitionSpec(*batch, heads)}
    return tuple(NamedSharding(mesh, specs[kind]) for kind in kinds)


def _mappings(kinds, names, n_lead) -> tuple[ArrayMapping, ...]:
    lead = tuple(f"b{i}" for i in range(n_lead))
    out = []
    for kind, (s, h, x) in zip(kinds, names):
        if kind == _H:
            out.append(ArrayMapping(*lead[:-1], h))
        elif kind == _BH:
            out.append(ArrayMapping(*lead, h))
        else:
            out.append(ArrayMapping(*lead, s, h, x) if kind == _BSHX else
                       ArrayMapping(*lead, h, s))
    return tuple(out)


def _replicated(mappings) -> tuple[str, ...]:
    """The factors to replicate, in order of first appearance (Shardy wants them sorted)."""
    order: list[str] = []
    for mapping in mappings:
        for factor in mapping:
            if factor not in order:
                order.append(factor)
    return tuple(f for f in order if f in _REPLICATED_FACTORS)


# (seq, heads, last dim) factor names of each operand / result.
_Q, _K, _V, _O = ("sq", "h", "d"), ("sk", "hkv", "d"), ("sk", "hkv", "dv"), ("sq", "h", "dv")
_LSE = ("sq", "h", None)
_SINK = (None, "h", None)


def _forward_rule(opts, mesh, value_types, result_types) -> SdyShardingRule:
    del opts, mesh, result_types
    n_lead = len(value_types[0].shape) - 3
    operands = _mappings(_FORWARD_IN, (_Q, _K, _V), n_lead)
    results = _mappings(_FORWARD_OUT, (_O, _LSE), n_lead)
    return SdyShardingRule(operands, results,
                           need_replication_factors=_replicated(operands + results))


def _forward_sink_rule(opts, mesh, value_types, result_types) -> SdyShardingRule:
    del opts, mesh, result_types
    n_lead = len(value_types[0].shape) - 3
    operands = _mappings(_FORWARD_SINK_IN, (_Q, _K, _V, _SINK), n_lead)
    results = _mappings(_FORWARD_OUT, (_O, _LSE), n_lead)
    return SdyShardingRule(operands, results,
                           need_replication_factors=_replicated(operands + results))


def _backward_rule(opts, mesh, value_types, result_types) -> SdyShardingRule:
    del opts, mesh, result_types
    n_lead = len(value_types[0].shape) - 3
    operands = _mappings(_BACKWARD_IN, (_Q, _K, _V, _O, _LSE, _O, _LSE), n_lead)
    results = _mappings(_BACKWARD_OUT, (_Q, _K, _V, _LSE), n_lead)
    return SdyShardingRule(operands, results,
                           need_replication_factors=_replicated(operands + results))


def _backward_sink_rule(opts, mesh, value_types, result_types) -> SdyShardingRule:
    del opts, mesh, result_types
    n_lead = len(value_types[0].shape) - 3
    operands = _mappings(_BACKWARD_SINK_IN, (_Q, _K, _V, _O, _LSE, _O, _LSE, _SINK), n_lead)
    results = _mappings(_BACKWARD_SINK_OUT, (_Q, _K, _V, _SINK), n_lead)
    return SdyShardingRule(operands, results,
                           need_replication_factors=_replicated(operands + results))


def _shard_local(impl: Callable, opts) -> Callable:
    """The function each device runs on its shard, traced with no mesh in context.

    The partitioner traces it while compiling, possibly inside the caller's ``jax.set_mesh``;
    shard-local code must not pick up that mesh's shardings.
    """
    empty = jax.sharding.AbstractMesh((), ())

    def run(*args):
        with jax.sharding.use_abstract_mesh(empty):
            return impl(*args, opts)

    return run


def _partition(impl, kinds_in, kinds_out, opts, mesh, arg_shapes, result_shape):
    del result_shape
    batch, heads = _kept_axes(mesh, arg_shapes[0], arg_shapes[1])
    return (mesh, _shard_local(impl, opts), _shardings(mesh, kinds_out, batch, heads),
            _shardings(mesh, kinds_in, batch, heads))


def _infer(kinds_out, opts, mesh, arg_shapes, result_shape):  # GSPMD (Shardy off)
    del opts, result_shape
    return _shardings(mesh, kinds_out, *_kept_axes(mesh, arg_shapes[0], arg_shapes[1]))


# -- primitives --------------------------------------------------------------------------------
def _vmap_rule(prim: Primitive, args, dims, **params):
    """Batching: the mapped axis becomes one more leading batch dim of every operand."""
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    moved = [jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
             for x, d in zip(args, dims)]
    outs = prim.bind(*moved, **params)
    return outs, [0] * len(outs)


def _requires_devices_during_lowering(prim: Primitive) -> None:
    # custom_partitioning needs the device assignment while lowering; JAX registers its own
    # primitive, which ours hide behind mlir.lower_fun (the cuDNN attention does the same).
    try:
        from jax._src import dispatch
    except ImportError:  # pragma: no cover - moved in a later JAX; single devices unaffected
        return
    dispatch.prim_requires_devices_during_lowering.add(prim)


def _make_primitive(name: str, impl: Callable, kinds_in: tuple[str, ...],
                    kinds_out: tuple[str, ...], abstract_eval: Callable,
                    rule: Callable) -> Primitive:
    prim = Primitive(name)
    prim.multiple_results = True
    impl = _folding(impl, kinds_in)

    @functools.lru_cache(maxsize=256)
    def jitted(opts):
        return jax.jit(lambda *args: prim.bind(*args, opts=opts))

    prim.def_impl(lambda *args, opts: jitted(opts)(*args))
    prim.def_abstract_eval(lambda *avals, opts: abstract_eval(*avals))
    batching.primitive_batchers[prim] = lambda args, dims, **p: _vmap_rule(prim, args, dims, **p)

    partitioned = custom_partitioning(impl, static_argnums=(len(kinds_in),))  # opts is static
    partitioned.def_partition(
        partition=lambda *a: _partition(impl, kinds_in, kinds_out, *a),
        infer_sharding_from_operands=lambda *a: _infer(kinds_out, *a),
        sharding_rule=rule,
    )
    mlir.register_lowering(prim, mlir.lower_fun(lambda *args, opts: partitioned(*args, opts),
                                                multiple_results=True))
    _requires_devices_during_lowering(prim)
    return prim


def partitioned_forward(impl: Callable) -> Callable:
    """``impl(q, k, v, opts) -> (out, lse)`` as an operation that shards over batch and heads."""
    prim = _make_primitive("jax_fa4_attention_fwd", impl, _FORWARD_IN, _FORWARD_OUT,
                           _forward_avals, _forward_rule)

    def forward(q, k, v, opts):
        return tuple(prim.bind(q, k, v, opts=opts))

    return forward


def partitioned_forward_with_sink(impl: Callable) -> Callable:
    """``impl(q, k, v, sink, opts) -> (out, lse)`` with a learnable sink (H,) sharded like the
    heads. Under vmap ``impl`` gets the sink as (B, H), one row per folded batch entry."""
    prim = _make_primitive("jax_fa4_attention_fwd_sink", impl, _FORWARD_SINK_IN, _FORWARD_OUT,
                           _forward_sink_avals, _forward_sink_rule)

    def forward(q, k, v, sink, opts):
        return tuple(prim.bind(q, k, v, sink, opts=opts))

    return forward


def partitioned_backward(impl: Callable) -> Callable:
    """``impl(q, k, v, out, lse, dout, dlse, opts) -> (dq, dk, dv, delta)``, sharded like the
    forward (delta like lse)."""
    prim = _make_primitive("jax_fa4_attention_bwd", impl, _BACKWARD_IN, _BACKWARD_OUT,
                           _backward_avals, _backward_rule)

    def backward(q, k, v, out, lse, dout, dlse, opts):
        return tuple(prim.bind(q, k, v, out, lse, dout, dlse, opts=opts))

    return backward


def partitioned_backward_with_sink(impl: Callable) -> Callable:
    """``impl(q, k, v, out, lse, dout, dlse, sink, opts) -> (dq, dk, dv, dsink_parts)`` with
    the learnable sink (H,) sharded like the heads and its gradient by batch entry (B.., H)
    (the caller sums the batch). Under vmap ``impl`` gets the sink as (B, H)."""
    prim = _make_primitive("jax_fa4_attention_bwd_sink", impl, _BACKWARD_SINK_IN,
                           _BACKWARD_SINK_OUT, _backward_sink_avals, _backward_sink_rule)

    def backward(q, k, v, out, lse, dout, dlse, sink, opts):
        return tuple(prim.bind(q, k, v, out, lse, dout, dlse, sink, opts=opts))

    return backward
