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
- Every operation is described by its operands' and results' roles (``_ROLES``;
  :func:`partitioned`): segment ids ``(b.., sq)`` / ``(b.., sk)`` follow the batch (their
  sequence factor is replicated like q's), a sink ``(h,)`` the heads, and a forward asked for
  max logits (``opts.max_logits``) returns the per-row max ``(b.., h, sq)`` sharded like lse;
  the FP8 forward's descales ``(b.., hkv)`` follow the batch and k's heads.

On one device, or inside ``shard_map`` with every mesh axis manual, the operations are inlined.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

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

__all__ = ["partitioned", "partitioned_backward", "partitioned_backward_with_sink",
           "partitioned_forward", "partitioned_forward_with_sink", "partitioned_fp8_forward"]

_REPLICATED_FACTORS = ("sq", "sk", "d", "dv")

# Operand kinds: (B.., S, H, X) arrays, (B.., H, S) row statistics (lse, its cotangent, the
# per-row max logits), per-head vectors (a learnable sink: (H,), or (V.., H) under vmap, V.. the
# mapped dims, which are B..'s leading dims), per-(batch, head) sums (B.., H) (the sink's
# gradient by batch entry, summed by the caller) and per-token ids (B.., S) (segment ids).
_BSHX, _BHS, _H, _BH, _BS = "bshx", "bhs", "h", "bh", "bs"

# (seq, heads, last dim) factor names of each operand / result.
_Q, _K, _V, _O = ("sq", "h", "d"), ("sk", "hkv", "d"), ("sk", "hkv", "dv"), ("sq", "h", "dv")
_LSE = ("sq", "h", None)
_SINK = (None, "h", None)

#: Every operand and result the operations take or give, by role: (kind, factor names).
_ROLES = {
    "q": (_BSHX, _Q), "k": (_BSHX, _K), "v": (_BSHX, _V),
    "out": (_BSHX, _O), "dout": (_BSHX, _O),
    "lse": (_BHS, _LSE), "dlse": (_BHS, _LSE), "delta": (_BHS, _LSE), "row_max": (_BHS, _LSE),
    "sink": (_H, _SINK), "dsink": (_BH, _SINK),
    "q_ids": (_BS, ("sq", None, None)), "kv_ids": (_BS, ("sk", None, None)),
    "dq": (_BSHX, _Q), "dk": (_BSHX, _K), "dv": (_BSHX, _V),
    # the FP8 forward's descales, float32 per (batch entry, kv head): sharded like k's heads
    "q_descale": (_BH, (None, "hkv", None)), "k_descale": (_BH, (None, "hkv", None)),
    "v_descale": (_BH, (None, "hkv", None)),
}

FORWARD_IN, FORWARD_OUT = ("q", "k", "v"), ("out", "lse")
FP8_FORWARD_IN = FORWARD_IN + ("q_descale", "k_descale", "v_descale")
BACKWARD_IN = ("q", "k", "v", "out", "lse", "dout", "dlse")
BACKWARD_OUT = ("dq", "dk", "dv", "delta")
SINK_BACKWARD_OUT = ("dq", "dk", "dv", "dsink")
SEGMENT_IDS = ("q_ids", "kv_ids")


def _kinds(roles: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(_ROLES[r][0] for r in roles)


def _results(roles_out: tuple[str, ...], opts) -> tuple[str, ...]:
    """A forward's results: ``roles_out`` and, when ``opts.max_logits``, the per-row max
    logits (B.., H, Sq) float32 after lse."""
    if getattr(opts, "max_logits", False) and "lse" in roles_out:
        return roles_out + ("row_max",)
    return roles_out


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


# -- result types ------------------------------------------------------------------------------
def _result_avals(roles_in: tuple[str, ...], roles_out: tuple[str, ...], avals, opts=None
                  ) -> tuple:
    """The results' types from the operands' (each by role): out like q with v's head dim (in
    ``opts.out_dtype`` where the static parameters name one: the FP8 forward) and
    the row statistics (lse, delta, row_max) (B.., H, Sq) float32, keeping q's batch / head
    sharding (explicit mesh axes) and q's varying manual axes (inside ``shard_map``); dq, dk,
    dv like q, k, v; the sink's gradient by batch entry (B.., H) float32, sharded like lse
    without its rows."""
    x = dict(zip(roles_in, avals))
    q, k, v = x["q"], x["k"], x["v"]
    if "out" not in x:  # a forward
        _check_explicit_sharding(q, k, v)
    *lead, sq, h, _ = q.shape
    spec = _padded(q.sharding.spec, q.ndim)
    mesh = q.sharding.mesh
    rows = q.update(shape=(*lead, h, sq), dtype=jnp.float32, weak_type=False,
                    sharding=NamedSharding(mesh, PartitionSpec(*spec[:-3], spec[-2], None)))
    made = {
        "out": q.update(shape=(*lead, sq, h, v.shape[-1]), weak_type=False,
                        dtype=q.dtype if getattr(opts, "out_dtype", None) is None
                        else opts.out_dtype,
                        sharding=NamedSharding(mesh, PartitionSpec(*spec[:-3], None, spec[-2],
                                                                   None))),
        "dq": q.update(weak_type=False), "dk": k.update(weak_type=False),
        "dv": v.update(weak_type=False),
        "dsink": rows.update(shape=rows.shape[:-1], sharding=NamedSharding(
            mesh, PartitionSpec(*spec[:-3], spec[-2]))),
    }
    return tuple(made.get(role, rows) for role in roles_out)


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
             _BH: PartitionSpec(*batch, heads),
             _BS: PartitionSpec(*batch, None)}
    return tuple(NamedSharding(mesh, specs[kind]) for kind in kinds)


def _mappings(roles, n_lead) -> tuple[ArrayMapping, ...]:
    lead = tuple(f"b{i}" for i in range(n_lead))
    out = []
    for role in roles:
        kind, (s, h, x) = _ROLES[role]
        factors = {_H: (*lead[:-1], h), _BH: (*lead, h), _BS: (*lead, s), _BHS: (*lead, h, s),
                   _BSHX: (*lead, s, h, x)}[kind]
        out.append(ArrayMapping(*factors))
    return tuple(out)


def _replicated(mappings) -> tuple[str, ...]:
    """The factors to replicate, in order of first appearance (Shardy wants them sorted)."""
    order: list[str] = []
    for mapping in mappings:
        for factor in mapping:
            if factor not in order:
                order.append(factor)
    return tuple(f for f in order if f in _REPLICATED_FACTORS)


def _rule(roles_in, roles_out, opts, mesh, value_types, result_types) -> SdyShardingRule:
    """Shardy's rule of an operation: batch dims and heads pass through, the sequences and head
    dims are replicated (module doc)."""
    del mesh, result_types
    n_lead = len(value_types[0].shape) - 3
    operands = _mappings(roles_in, n_lead)
    results = _mappings(_results(roles_out, opts), n_lead)
    return SdyShardingRule(operands, results,
                           need_replication_factors=_replicated(operands + results))


_forward_rule = functools.partial(_rule, FORWARD_IN, FORWARD_OUT)


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


def _partition(impl, roles_in, roles_out, opts, mesh, arg_shapes, result_shape):
    del result_shape
    batch, heads = _kept_axes(mesh, arg_shapes[0], arg_shapes[1])
    return (mesh, _shard_local(impl, opts),
            _shardings(mesh, _kinds(_results(roles_out, opts)), batch, heads),
            _shardings(mesh, _kinds(roles_in), batch, heads))


def _infer(roles_out, opts, mesh, arg_shapes, result_shape):  # GSPMD (Shardy off)
    del result_shape
    return _shardings(mesh, _kinds(_results(roles_out, opts)),
                      *_kept_axes(mesh, arg_shapes[0], arg_shapes[1]))


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


def partitioned(name: str, impl: Callable, roles_in: tuple[str, ...],
                roles_out: tuple[str, ...]) -> Callable:
    """``impl(*arrays, opts) -> results`` as an operation that shards over batch and heads:
    ``fn(*arrays, opts)``. ``roles_in`` / ``roles_out`` name each operand and result (keys of
    ``_ROLES``: q, k, v, out, lse, dout, dlse, sink, q_ids, kv_ids, dq, dk, dv, delta, dsink);
    a forward (results with lse) also returns the per-row max logits (B.., H, Sq) when
    ``opts.max_logits``. Under vmap ``impl`` gets a sink as (B, H), one row per folded batch
    entry."""
    prim = Primitive(name)
    prim.multiple_results = True
    impl = _folding(impl, _kinds(roles_in))

    @functools.lru_cache(maxsize=256)
    def jitted(opts):
        return jax.jit(lambda *args: prim.bind(*args, opts=opts))

    prim.def_impl(lambda *args, opts: jitted(opts)(*args))
    prim.def_abstract_eval(
        lambda *avals, opts: _result_avals(roles_in, _results(roles_out, opts), avals, opts))
    batching.primitive_batchers[prim] = lambda args, dims, **p: _vmap_rule(prim, args, dims, **p)

    partitioned_impl = custom_partitioning(impl, static_argnums=(len(roles_in),))  # opts static
    partitioned_impl.def_partition(
        partition=lambda *a: _partition(impl, roles_in, roles_out, *a),
        infer_sharding_from_operands=lambda *a: _infer(roles_out, *a),
        sharding_rule=functools.partial(_rule, roles_in, roles_out),
    )
    mlir.register_lowering(prim, mlir.lower_fun(
        lambda *args, opts: partitioned_impl(*args, opts), multiple_results=True))
    _requires_devices_during_lowering(prim)

    def run(*args):
        *arrays, opts = args
        return tuple(prim.bind(*arrays, opts=opts))

    return run


def partitioned_forward(impl: Callable) -> Callable:
    """``impl(q, k, v, opts) -> (out, lse[, row_max])`` as an operation that shards over batch
    and heads."""
    return partitioned("jax_fa4_attention_fwd", impl, FORWARD_IN, FORWARD_OUT)


def partitioned_fp8_forward(impl: Callable) -> Callable:
    """``impl(q, k, v, q_descale, k_descale, v_descale, static) -> (out, lse)``, the FP8
    forward, sharded over batch and heads with the (B.., Hkv) descales split like k's heads;
    ``out`` in ``static.out_dtype``."""
    return partitioned("jax_fa4_attention_fwd_fp8", impl, FP8_FORWARD_IN, FORWARD_OUT)


def partitioned_forward_with_sink(impl: Callable) -> Callable:
    """``impl(q, k, v, sink, opts) -> (out, lse[, row_max])`` with a learnable sink (H,)
    sharded like the heads. Under vmap ``impl`` gets the sink as (B, H), one row per folded
    batch entry."""
    return partitioned("jax_fa4_attention_fwd_sink", impl, FORWARD_IN + ("sink",), FORWARD_OUT)


def partitioned_backward(impl: Callable) -> Callable:
    """``impl(q, k, v, out, lse, dout, dlse, opts) -> (dq, dk, dv, delta)``, sharded like the
    forward (delta like lse)."""
    return partitioned("jax_fa4_attention_bwd", impl, BACKWARD_IN, BACKWARD_OUT)


def partitioned_backward_with_sink(impl: Callable) -> Callable:
    """``impl(q, k, v, out, lse, dout, dlse, sink, opts) -> (dq, dk, dv, dsink_parts)`` with
    the learnable sink (H,) sharded like the heads and its gradient by batch entry (B.., H)
    (the caller sums the batch). Under vmap ``impl`` gets the sink as (B, H)."""
    return partitioned("jax_fa4_attention_bwd_sink", impl, BACKWARD_IN + ("sink",),
                       SINK_BACKWARD_OUT)
