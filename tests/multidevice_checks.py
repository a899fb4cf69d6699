"""Multi-device checks on a CPU with 4 simulated devices, run in a subprocess by the tests.

    echo "ring causal_zigzag" | python tests/multidevice_checks.py

The test process has already initialised JAX with one CPU device, so these checks run in a fresh
interpreter with ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (set below, before JAX is
imported). Each check returns measurements (errors, collectives in the compiled HLO, shardings,
error messages, training losses) that ``tests/test_sharding.py``, ``tests/test_ring.py``,
``tests/test_sm100_bwd_wiring.py``, ``tests/test_train_example.py`` and
``tests/test_multi_gpu_script.py`` assert on. The process
runs one check per line of stdin, ``SUITE CASE`` (a name in ``SUITES``, one of its checks), and
prints its measurements as one ``RESULT`` line of JSON; the tests keep one such process and ask
it for the checks they assert on (``tests/test_sharding.py``'s ``multidevice_suite``).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import faulthandler  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_fa4  # noqa: E402
from jax_fa4.tools.bench import collectives  # noqa: E402
from jax_fa4.parallel import ring  # noqa: E402

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def qkv(b=4, s=32, h=4, hkv=2, d=16, dtype=jnp.float32, seed=0):
    """q (b, s, h, d), k and v (b, s, hkv, d) and a cotangent shaped like q, standard normal in
    ``dtype`` (drawn by NumPy: jax.random would compile a program per shape)."""
    from conformance import normal

    return normal(f"multidevice {seed}", [(b, s, h, d), (b, s, hkv, d), (b, s, hkv, d),
                                          (b, s, h, d)], dtype)


def max_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


# -- flash_attention under jit with sharded inputs ---------------------------------------------
def _sharded_case(mesh, spec, *, kv_spec=None, b=4, h=4, hkv=2, dtype=jnp.float32,
                  **options) -> dict:
    q, k, v, ct = qkv(b=b, h=h, hkv=hkv, dtype=dtype)

    def attn(q, k, v):
        return jax_fa4.flash_attention(q, k, v, **options)

    def loss(q, k, v):
        return jnp.sum(attn(q, k, v).astype(jnp.float32) * ct.astype(jnp.float32))

    kv_spec = spec if kv_spec is None else kv_spec
    placed = [jax.device_put(x, NamedSharding(mesh, s))
              for x, s in ((q, spec), (k, kv_spec), (v, kv_spec))]
    fwd = jax.jit(attn).lower(*placed).compile()
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*placed).compile()
    out = fwd(*placed)
    grads = grad(*placed)
    want_out = jax.jit(attn)(q, k, v)
    want_grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    return {
        "out_err": max_err(out, want_out),
        "grad_err": max(max_err(g, w) for g, w in zip(grads, want_grads)),
        "scale": max(float(jnp.max(jnp.abs(x.astype(jnp.float32))))
                     for x in (want_out, *want_grads)),
        "dtype": jnp.dtype(dtype).name,
        "out_spec": str(out.sharding.spec),
        "grad_specs": [str(g.sharding.spec) for g in grads],
        "fwd_collectives": collectives(fwd.as_text()),
        "grad_collectives": collectives(grad.as_text()),
    }


def _jvp_case(mesh, spec) -> dict:
    """Forward mode under jit with sharded inputs: the tangent keeps the inputs' sharding."""
    q, k, v, _ = qkv()
    tangents = qkv(seed=1)[:3]

    def jvp(q, k, v, tq, tk, tv):
        return jax.jvp(lambda *x: jax_fa4.flash_attention(*x, causal=True), (q, k, v),
                       (tq, tk, tv))

    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, *tangents)]
    compiled = jax.jit(jvp).lower(*placed).compile()
    out, tangent = compiled(*placed)
    want_out, want_tangent = jax.jit(jvp)(q, k, v, *tangents)
    return {"out_err": max_err(out, want_out), "tangent_err": max_err(tangent, want_tangent),
            "scale": float(jnp.max(jnp.abs(want_tangent))),
            "tangent_spec": str(tangent.sharding.spec),
            "collectives": collectives(compiled.as_text())}


def _dot_product_attention_case(mesh, spec) -> dict:
    """jax_fa4.dot_product_attention (jax.nn's signature; padded lengths as segment ids) under
    jit with q, k, v sharded over batch and heads: the same results as unsharded, nothing
    gathered in the forward, the gradient's only collective the loss's scalar sum."""
    q, k, v, ct = qkv()
    lengths = jnp.array([32, 20, 7, 32], jnp.int32)

    def attn(q, k, v, lengths):
        return jax_fa4.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                             key_value_seq_lengths=lengths)

    def loss(q, k, v, lengths):
        return jnp.sum(attn(q, k, v, lengths) * ct)

    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    placed.append(jax.device_put(lengths, NamedSharding(mesh, P(spec[0]))))
    fwd = jax.jit(attn).lower(*placed).compile()
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*placed).compile()
    out, grads = fwd(*placed), grad(*placed)
    want_out = jax.jit(attn)(q, k, v, lengths)
    want_grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, lengths)
    return {"out_err": max_err(out, want_out),
            "grad_err": max(max_err(g, w) for g, w in zip(grads, want_grads)),
            "out_spec": str(out.sharding.spec),
            "fwd_collectives": collectives(fwd.as_text()),
            "grad_collectives": collectives(grad.as_text())}


def _shard_map_grad_case(q_spec, kv_spec, hkv: int) -> dict:
    """jax.grad inside shard_map (check_vma on): each device differentiates its shard's
    attention within the sum of the devices' losses; the gradients must equal the unsharded
    program's (an invariant k / v's gradient summed over the devices)."""
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
    q, k, v, _ = qkv(h=4, hkv=hkv)

    def loss(q, k, v):
        return jnp.sum(jnp.sin(jax_fa4.flash_attention(q, k, v, causal=True)))

    def local(q, k, v):
        return jax.grad(lambda *a: jax.lax.psum(loss(*a), "x"), argnums=(0, 1, 2))(q, k, v)

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec),
                            out_specs=(q_spec, kv_spec, kv_spec), check_vma=True)
    got = jax.jit(sharded)(q, k, v)
    want = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    return {"grad_err": max(max_err(g, w) for g, w in zip(got, want)),
            "scale": max(float(jnp.max(jnp.abs(w))) for w in want)}


def sharding_cases() -> dict:
    auto = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    heads4 = jax.make_mesh((4,), ("model",), axis_types=(AxisType.Auto,))
    bshd = P("data", None, "model", None)
    return {
        "batch_and_heads_gqa": lambda: _sharded_case(auto, bshd, causal=True),
        "batch_and_heads_mha_options": lambda: _sharded_case(
            auto, bshd, hkv=4, window_size=(5, 3), softcap=2.0, softmax_scale=0.3),
        "batch_only": lambda: _sharded_case(auto, P(("data", "model"))),
        "heads_only_bf16": lambda: _sharded_case(heads4, P(None, None, "model", None),
                                                 h=8, hkv=4, dtype=jnp.bfloat16, causal=True),
        # H=8 over 4 devices with Hkv=2: heads cannot split consistently, so they replicate.
        "heads_indivisible_gqa": lambda: _sharded_case(heads4, P(None, None, "model", None),
                                                       kv_spec=P(), h=8, hkv=2),
        "mqa_heads": lambda: _sharded_case(auto, bshd, kv_spec=P("data"), hkv=1),
        "seq_sharded_auto": lambda: _sharded_case(auto, P(None, "data", None, None),
                                                  causal=True),
        "vmap": lambda: _vmap_case(auto, P(None, "data", None, "model", None)),
        "vmap_sharded_mapped_axis": lambda: _vmap_case(auto, P("data", None, None, "model")),
        "explicit_batch_heads": lambda: _explicit_case(bshd),
        "explicit_seq_raises": lambda: _explicit_case(P(None, "data", None, None)),
        "sink_batch_heads": lambda: _sink_case(auto, bshd, P("model")),
        "sink_vmap": lambda: _sink_case(auto, P(None, "data", None, "model", None), P(),
                                        vmapped=True),
        "segments_kernel_batch_heads": lambda: _segments_case(auto, bshd, "sm90"),
        "segments_reference_batch_heads": lambda: _segments_case(auto, bshd, "reference"),
        "segments_kernel_seq_sharded": lambda: _segments_case(auto, P(None, "data", None, None),
                                                              "sm90"),
        "max_logits_batch_heads": lambda: _max_logits_case(auto, bshd),
        "jvp_batch_and_heads": lambda: _jvp_case(auto, bshd),
        "dot_product_attention_batch_heads": lambda: _dot_product_attention_case(auto, bshd),
        "shard_map_grad_batch": lambda: _shard_map_grad_case(P("x"), P("x"), hkv=2),
        "shard_map_grad_heads_invariant_kv": lambda: _shard_map_grad_case(
            P(None, None, "x"), P(), hkv=1),
        "fp8_reference_batch_heads": lambda: _fp8_case(auto, bshd, "reference"),
        "fp8_kernel_batch_heads": lambda: _fp8_case(auto, bshd, "sm90"),
        "fp8_vmap": lambda: _fp8_vmap_case(),
    }


def _fp8_case(mesh, spec, implementation: str) -> dict:
    """An FP8 call (e4m3 q, k, v; (B, Hkv) descales sharded like k's batch and heads) under jit
    with q, k, v sharded by ``spec``: "reference" runs the reference backend's FP8 forward,
    "sm90" the kernel route with the kernel stubbed (zeros; its inputs' shapes recorded: each
    device's own batch rows and heads). Against the unsharded reference."""
    from jax_fa4 import fp8
    from jax_fa4.ffi import call

    q, k, v, _ = qkv(b=4, s=64, h=4, hkv=2, d=64)
    (q8, qd), (k8, kd), (v8, vd) = fp8.quantize_grouped(q, 2), fp8.quantize(k), fp8.quantize(v)

    def attn(impl):
        return lambda q, k, v, qd, kd, vd: jax_fa4.flash_attention(
            q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, causal=True, implementation=impl)

    shapes: list = []
    real = call.call_kernel

    def recording(config, arch, *args, out_shapes):
        shapes.append((config.kernel_name, config.dtype, [list(x.shape) for x in args[:3]]))
        return tuple(jnp.zeros(o.shape, o.dtype) for o in out_shapes)

    call.call_kernel = recording
    try:
        placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q8, k8, v8)]
        descale_sharding = NamedSharding(mesh, P(spec[0], spec[2]))  # (B, Hkv): batch, heads
        placed += [jax.device_put(x, descale_sharding) for x in (qd, kd, vd)]
        fwd = jax.jit(attn(implementation)).lower(*placed).compile()
        out = fwd(*placed)
    finally:
        call.call_kernel = real
    want = attn("reference")(q8, k8, v8, qd, kd, vd)
    return {"out_err": max_err(out, want), "scale": float(jnp.max(jnp.abs(want))),
            "out_dtype": str(out.dtype), "out_spec": str(out.sharding.spec),
            "fwd_collectives": collectives(fwd.as_text()), "kernel_shapes": shapes}


def _fp8_vmap_case() -> dict:
    """jax.vmap over an FP8 call (reference backend): the mapped axis is one more batch dim."""
    from jax_fa4 import fp8

    q, k, v, _ = qkv(b=2, s=40, h=4, hkv=2, d=32)
    (q8, qd), (k8, kd), (v8, vd) = fp8.quantize_grouped(q, 2), fp8.quantize(k), fp8.quantize(v)
    stack = lambda x: jnp.stack([x, x[::-1]])  # noqa: E731 - two mapped entries
    f = lambda q, k, v, qd, kd, vd: jax_fa4.flash_attention(  # noqa: E731
        q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, implementation="reference")
    args = [stack(x) for x in (q8, k8, v8, qd, kd, vd)]
    got = jax.jit(jax.vmap(f))(*args)
    want = jnp.stack([f(*[a[i] for a in args]) for i in range(2)])
    return {"out_err": max_err(got, want), "scale": float(jnp.max(jnp.abs(want)))}


def _segments_case(mesh, spec, implementation: str) -> dict:
    """flash_attention with segment ids (traced, and a sink) under jit with q, k, v sharded by
    ``spec`` and the ids like q's (B, S) axes: "sm90" runs the segment-id kernels' route with the
    kernels emulated on the CPU (tests/test_segments.py's stand-ins, which read the mask from
    the tables alone), "reference" the reference's; both against the unsharded reference. The
    kernels' inputs are recorded (over batch and heads: each device's own rows and heads; over
    the sequence: gathered first, the generic rule)."""
    from test_segments import _emulated_segments_kernel

    from jax_fa4.ffi import call

    q, k, v, ct = qkv(b=4, s=96, h=4, hkv=2, d=64, dtype=jnp.bfloat16)
    ids = jnp.asarray(np.repeat([0, 1, 2, 1], [20, 30, 40, 6])[None].repeat(4, 0)
                      + np.arange(4)[:, None] * 10, jnp.int32)
    sink = jnp.linspace(-1.0, 2.0, 4, dtype=jnp.float32)

    def attn(impl):
        def f(q, k, v, s, ids):
            return jax_fa4.flash_attention(q, k, v, causal=True, segment_ids=ids,
                                           learnable_sink=s, return_max_logits=True,
                                           implementation=impl)
        return f

    def loss(impl):
        return lambda q, k, v, s, ids: jnp.sum(
            attn(impl)(q, k, v, s, ids)[0].astype(jnp.float32) * ct)

    calls: list = []
    shapes: list = []
    real = call.call_kernel
    emulated = _emulated_segments_kernel((None, 0), 0.0, calls)

    def recording(config, arch, *args, out_shapes):
        shapes.append((config.kernel_name, [list(x.shape) for x in args[:3]]))
        return emulated(config, arch, *args, out_shapes=out_shapes)

    call.call_kernel = recording
    try:
        placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
        placed.append(jax.device_put(sink, NamedSharding(mesh, P(*spec[2:3]))))
        placed.append(jax.device_put(ids, NamedSharding(mesh, P(*spec[:2]))))
        fwd = jax.jit(attn(implementation)).lower(*placed).compile()
        out, max_logits = fwd(*placed)
        grad = jax.jit(jax.grad(loss(implementation), argnums=(0, 1, 2, 3))).lower(
            *placed).compile()
        grads = grad(*placed)
    finally:
        call.call_kernel = real
    want, want_max = attn("reference")(q, k, v, sink, ids)
    want_grads = jax.grad(loss("reference"), argnums=(0, 1, 2, 3))(q, k, v, sink, ids)
    scale = max(float(jnp.max(jnp.abs(x.astype(jnp.float32)))) for x in (want, *want_grads))
    return {"out_err": max_err(out, want), "max_logits_err": max_err(max_logits, want_max),
            "grad_err": max(max_err(g, w) for g, w in zip(grads, want_grads)), "scale": scale,
            "out_spec": str(out.sharding.spec),
            "fwd_collectives": collectives(fwd.as_text()),
            "grad_collectives": collectives(grad.as_text()),
            "kernel_shapes": shapes}


def _max_logits_case(mesh, spec) -> dict:
    """flash_attention(return_max_logits=True) under jit with q, k, v sharded over batch and
    heads: the per-row max logits are one more (B, H, Sq) result sharded like lse, reduced
    over the rows after the call."""
    q, k, v, _ = qkv(b=4, h=4, hkv=2)

    def f(q, k, v):
        return jax_fa4.flash_attention(q, k, v, window_size=(7, 2), softcap=3.0,
                                       return_max_logits=True)

    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    fwd = jax.jit(f).lower(*placed).compile()
    out, max_logits = fwd(*placed)
    want_out, want = f(q, k, v)
    return {"out_err": max_err(out, want_out), "max_logits_err": max_err(max_logits, want),
            "max_logits_spec": str(max_logits.sharding.spec),
            "fwd_collectives": collectives(fwd.as_text())}


def _sink_case(mesh, spec, sink_spec, *, vmapped=False) -> dict:
    """flash_attention with a learnable sink on a kernel backend's route (the sink is the
    forward's fourth operand, sharded with the heads): a stand-in for "sm90" (the reference
    under that name) records the sink shapes its forward gets on each device, and its backward
    returns the sink's share of the output's rowsum itself, as the Hopper kernel does
    (``backward_with_sink``: its shapes recorded too; under vmap the chain computes d sink from
    delta instead)."""
    from jax_fa4 import backends
    from jax_fa4.backends import base

    seen, seen_bwd = [], []

    class SinkStandIn(base.Backend):
        name = "sm90"

        def forward(self, q, k, v, opts, sink=None):
            seen.append(None if sink is None else list(sink.shape))
            return super().forward(q, k, v, opts, sink=sink)

        def backward_with_sink(self, q, k, v, out, lse, dout, delta, lse_log2, opts, sink):
            seen_bwd.append(list(sink.shape))
            grads = self.backward(q, k, v, out, lse, dout, delta, lse_log2, opts)
            p_sink = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(sink[None, :, None] - lse))
            rows = (p_sink * base.reference_delta(out, dout)).sum(axis=-1)
            return (*grads, rows)

    saved = backends.BACKENDS["sm90"]
    backends.BACKENDS["sm90"] = SinkStandIn()
    try:
        q, k, v, ct = qkv(b=4, h=4, hkv=2)
        sink = jnp.linspace(-1.0, 2.0, q.shape[2], dtype=jnp.float32)

        def attn(impl):
            def f(q, k, v, s):
                return jax_fa4.flash_attention(q, k, v, causal=True, learnable_sink=s,
                                               implementation=impl)
            return jax.vmap(f, in_axes=(0, 0, 0, None)) if vmapped else f

        def loss(impl):
            return lambda q, k, v, s: jnp.sum(attn(impl)(q, k, v, s) * ct)

        if vmapped:  # a mapped axis of 2 over the batch of 2
            q, k, v = (x.reshape(2, 2, *x.shape[1:]) for x in (q, k, v))
            ct = ct.reshape(2, 2, *ct.shape[1:])
        placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
        placed.append(jax.device_put(sink, NamedSharding(mesh, sink_spec)))
        fwd = jax.jit(attn("sm90")).lower(*placed).compile()
        out = fwd(*placed)
        grads = jax.jit(jax.grad(loss("sm90"), argnums=(0, 1, 2, 3)))(*placed)
        want = attn("reference")(q, k, v, sink)
        want_grads = jax.grad(loss("reference"), argnums=(0, 1, 2, 3))(q, k, v, sink)
    finally:
        backends.BACKENDS["sm90"] = saved
    return {"out_err": max_err(out, want),
            "grad_err": max(max_err(g, w) for g, w in zip(grads, want_grads)),
            "fwd_collectives": collectives(fwd.as_text()),
            "sink_shapes": seen, "sink_bwd_shapes": seen_bwd}


def _vmap_case(mesh, spec) -> dict:
    q, k, v, _ = qkv(b=2)
    stack = lambda x: jnp.stack([x, 2 * x])  # noqa: E731
    qs, ks, vs = (stack(x) for x in (q, k, v))
    f = jax.jit(jax.vmap(lambda q, k, v: jax_fa4.flash_attention(q, k, v, causal=True)))
    sh = NamedSharding(mesh, spec)
    placed = [jax.device_put(x, sh) for x in (qs, ks, vs)]
    return {"out_err": max_err(f(*placed), f(qs, ks, vs)),
            "fwd_collectives": collectives(f.lower(*placed).compile().as_text())}


def _explicit_case(spec) -> dict:
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    q, k, v, _ = qkv()
    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    with jax.set_mesh(mesh):
        out = jax.jit(lambda q, k, v: jax_fa4.flash_attention(q, k, v))(*placed)
    return {"out_err": max_err(out, jax_fa4.flash_attention(q, k, v)),
            "out_spec": str(out.sharding.spec)}


# -- ring attention ----------------------------------------------------------------------------
def _ring_case(*, causal: bool, layout: str = "zigzag", h=4, hkv=2, s=64, softcap=0.0,
               dtype=jnp.float32, segments: bool = False) -> dict:
    n = 4
    mesh = jax.make_mesh((n,), ("sp",), axis_types=(AxisType.Auto,))
    q, k, v, ct = qkv(b=2, s=s, h=h, hkv=hkv, dtype=dtype, seed=1)
    zz = causal and layout == "zigzag"
    to = (lambda x, axis=1: ring.zigzag(x, n, axis=axis)) if zz else (lambda x, axis=1: x)
    back = (lambda x, axis=1: ring.unzigzag(x, n, axis=axis)) if zz else (lambda x, axis=1: x)
    # packed rows: documents crossing the device blocks, padding (id 0) at the end of row 1
    ids = np.stack([np.repeat([1, 2, 3, 4], [10, 25, 20, s - 55]),
                    np.repeat([1, 2, 0], [30, s - 40, 10])]).astype(np.int32)
    seg = dict(padding_segment_id=0) if segments else {}
    f = jax.shard_map(
        lambda q, k, v, i: ring.ring_attention(
            q, k, v, axis_name="sp", causal=causal, layout=layout, softcap=softcap,
            return_lse=True, segment_ids=i if segments else None, **seg),
        mesh=mesh, in_specs=P(None, "sp"), out_specs=(P(None, "sp"), P(None, None, "sp")))

    def ring_fn(q, k, v):
        out, lse = f(to(q), to(k), to(v), to(jnp.asarray(ids)))
        return back(out), back(lse, axis=2)

    def flash_fn(q, k, v):
        return jax_fa4.flash_attention(q, k, v, causal=causal, softcap=softcap, return_lse=True,
                                       segment_ids=jnp.asarray(ids) if segments else None,
                                       **seg)

    def loss(fn):  # cotangents on both out and lse
        def g(q, k, v):
            out, lse = fn(q, k, v)
            return (jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))
                    + jnp.sum(jnp.where(jnp.isneginf(lse), 0.0, jnp.sin(lse))))
        return g

    out, lse = jax.jit(ring_fn)(q, k, v)
    want_out, want_lse = jax.jit(flash_fn)(q, k, v)
    grad = jax.jit(jax.grad(loss(ring_fn), argnums=(0, 1, 2))).lower(q, k, v).compile()
    grads = grad(q, k, v)
    want = jax.jit(jax.grad(loss(flash_fn), argnums=(0, 1, 2)))(q, k, v)
    hlo = grad.as_text()
    assert (np.isneginf(np.asarray(lse)) == np.isneginf(np.asarray(want_lse))).all()
    lse, want_lse = (jnp.where(jnp.isneginf(want_lse), 0.0, x) for x in (lse, want_lse))
    return {"out_err": max_err(out, want_out), "lse_err": max_err(lse, want_lse),
            "grad_errs": [max_err(g, w) for g, w in zip(grads, want)],
            "grad_scale": max(float(jnp.max(jnp.abs(w.astype(jnp.float32)))) for w in want),
            "collectives": sorted(collectives(hlo))}


def _ring_kernel_trace(causal: bool) -> dict:
    """jax.grad of the ring with the sm90 kernels inside shard_map, traced (no GPU here): the
    custom_vjp's gradients must carry q/k/v's varying mesh axes through the kernel calls."""
    mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,))
    q, k, v, _ = qkv(b=2, s=64, h=4, hkv=2, d=64, dtype=jnp.bfloat16, seed=2)
    f = jax.shard_map(
        lambda q, k, v: ring.ring_attention(q, k, v, axis_name="sp", causal=causal,
                                            implementation="sm90"),
        mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32))  # noqa: E731
    jaxpr = str(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).jaxpr)
    return {"kernel_calls": jaxpr.count("jax_fa4_kernel")}


def ring_cases() -> dict:
    return {
        "kernel_trace": lambda: _ring_kernel_trace(causal=False),
        "kernel_trace_causal": lambda: _ring_kernel_trace(causal=True),
        "noncausal": lambda: _ring_case(causal=False),
        "causal_zigzag": lambda: _ring_case(causal=True),
        "causal_contiguous": lambda: _ring_case(causal=True, layout="contiguous"),
        "causal_zigzag_mqa_softcap": lambda: _ring_case(causal=True, hkv=1, softcap=3.0),
        "noncausal_mha_bf16": lambda: _ring_case(causal=False, hkv=4, dtype=jnp.bfloat16),
        "noncausal_segments": lambda: _ring_case(causal=False, segments=True),
        "causal_zigzag_segments": lambda: _ring_case(causal=True, segments=True),
        "causal_contiguous_segments": lambda: _ring_case(causal=True, layout="contiguous",
                                                         segments=True),
    }


# -- the sm100 backward on shards, with the kernels emulated (tests/sm100_emulation.py) ---------
def _emulating_sm100(fn, **options):
    """Run ``fn(calls)`` with the sm100 kernels replaced by their CPU stand-ins; ``calls`` lists
    each kernel call's (config, arch, input shapes)."""
    from sm100_emulation import emulated_call_kernel

    from jax_fa4.ffi import call

    calls: list = []
    real = call.call_kernel
    call.call_kernel = emulated_call_kernel({"window": (None, None), **options}, calls)
    try:
        return fn(calls)
    finally:
        call.call_kernel = real


def _sm100_sharded_case(calls) -> dict:
    """jax.grad of flash_attention(implementation="sm100") with q, k, v sharded over batch and
    heads: each device's backward runs the sm100 backward kernel on its own shard."""
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    spec = P("data", None, "model", None)
    q, k, v, ct = qkv(b=4, h=4, hkv=2, d=64, dtype=jnp.bfloat16)

    def loss(implementation):
        def f(q, k, v):
            out = jax_fa4.flash_attention(q, k, v, causal=True, implementation=implementation)
            return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))
        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    grad = loss("sm100").lower(*placed).compile()
    grads = grad(*placed)
    want = loss("reference")(q, k, v)
    return {"grad_err": max(max_err(g, w) for g, w in zip(grads, want)),
            "grad_scale": max(float(jnp.max(jnp.abs(w.astype(jnp.float32)))) for w in want),
            "grad_specs": [str(g.sharding.spec) for g in grads],
            "grad_collectives": collectives(grad.as_text()),
            "bwd_q_shapes": sorted({c[2][0] for c in calls if c[0].kernel_name == "sm100_bwd"}),
            "kernels": sorted({c[0].kernel_name for c in calls})}


def _sm100_ring_case(calls) -> dict:
    """jax.grad of causal zigzag ring attention with implementation="sm100": every hop's
    backward runs the sm100 backward kernel (diagonal causal, full and half blocks)."""
    n = 4
    mesh = jax.make_mesh((n,), ("sp",), axis_types=(AxisType.Auto,))
    q, k, v, ct = qkv(b=2, s=64, h=4, hkv=4, d=64, dtype=jnp.bfloat16, seed=1)
    f = jax.shard_map(
        lambda q, k, v: ring.ring_attention(q, k, v, axis_name="sp", causal=True,
                                            implementation="sm100"),
        mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))

    def ring_loss(q, k, v):
        out = ring.unzigzag(f(*(ring.zigzag(x, n) for x in (q, k, v))), n)
        return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))

    def ref_loss(q, k, v):
        out = jax_fa4.flash_attention(q, k, v, causal=True, implementation="reference")
        return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))

    grads = jax.jit(jax.grad(ring_loss, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2)))(q, k, v)
    bwd = [c[0] for c in calls if c[0].kernel_name == "sm100_bwd"]
    return {"grad_err": max(max_err(g, w) for g, w in zip(grads, want)),
            "grad_scale": max(float(jnp.max(jnp.abs(w.astype(jnp.float32)))) for w in want),
            "bwd_masks": sorted({c.mask for c in bwd}), "bwd_calls": len(bwd)}


def sm100_bwd_cases() -> dict:
    return {
        "sharded": lambda: _emulating_sm100(_sm100_sharded_case, softmax_scale=0.125,
                                            softcap=0.0),
        "ring": lambda: _emulating_sm100(_sm100_ring_case, softmax_scale=0.125, softcap=0.0),
    }


# -- examples/train_gpt.py: the same training alone and on a 2x2 mesh ---------------------------
def _train_example(*args: str) -> dict:
    """The ``--log-json`` record of 20 tiny training steps of examples/train_gpt.py (batch 4:
    a quarter of the tiny config's, still split over the mesh's data axis; one block instead of
    the tiny config's: the loss still falls by ~1.9, and a step costs a fraction as much)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import train_gpt
    finally:
        sys.path.pop(0)
    with tempfile.TemporaryDirectory() as tmp:
        log = pathlib.Path(tmp) / "run.json"
        train_gpt.main(["--tiny", "--no-progress", "--steps", "20", "--seed", "0", "--batch", "4",
                        "--layers", "1",
                        "--log-json", str(log), *args])
        return json.loads(log.read_text())


def train_example_cases() -> dict:
    return {"single": _train_example, "mesh": lambda: _train_example("--mesh", "2x2"),
            "pack": lambda: _train_example("--pack"),
            "pack_mesh": lambda: _train_example("--pack", "--mesh", "2x2")}


# -- the multi-GPU run (jax_fa4.tools.multi_gpu) at its smoke sizes -----------------------------
def _multi_gpu_script(*args: str) -> dict:
    """The report of ``benchmarks/multi_gpu.py --smoke`` on the 4 devices (``args`` added)."""
    from jax_fa4.tools import multi_gpu

    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "report.json"
        status = multi_gpu.main(["--smoke", "--out", str(out), *args])
        return {"status": status, "report": json.loads(out.read_text())}


def multi_gpu_cases() -> dict:
    return {"checks_and_ring": lambda: _multi_gpu_script(
        "--parts", "checks,ring", "--checks", "sharded_batch_heads_causal,ring_causal_zigzag",
        "--masks", "causal", "--repeats", "1", "--target-ms", "1")}


def _run(fn) -> dict:
    try:
        return fn()
    except Exception as e:  # reported to the test, which decides whether it was expected
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}


#: Each suite's checks, by name: functions returning their measurements.
SUITES = {"sharding": sharding_cases, "ring": ring_cases, "sm100_bwd": sm100_bwd_cases,
          "train_example": train_example_cases, "multi_gpu": multi_gpu_cases}
CASE_TIMEOUT_S = 300


def serve() -> None:
    """Run the check named by each line of stdin (``SUITE CASE``) and print its measurements as
    a ``RESULT`` line, until stdin closes; a check running past ``CASE_TIMEOUT_S`` ends the
    process (with every thread's traceback on stderr)."""
    for line in sys.stdin:
        suite, case = line.split()
        faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)
        result = _run(SUITES[suite]()[case])
        faulthandler.cancel_dump_traceback_later()
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    serve()
