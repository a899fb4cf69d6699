"""The Hopper backward kernels (sm90_bwd + sm90_bwd_postprocess) on the H200, under jax.jit.

dq, dk, dv from ``jax_fa4.sm90_bwd_ops.backward`` are compared with FA4's rule
(tests/numerics.py): ``ref`` = ``reference.attention_backward`` on float32-upcast inputs (with the
float32 forward's out and lse), ``pt`` = the gradient of the naive attention computed in the input
dtype (``reference.attention(..., compute_dtype=dtype)``). The kernel gets what the library feeds
it: out in the input dtype, delta / lse_log2 from the preprocess kernel.

Kernels come precompiled: every config used here is in ``bwd_config.test_variants()``
(checked by test_cases_are_precompiled).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_fa4 import ops, reference, sm90_bwd_ops
from jax_fa4.kernels.sm90.bwd_config import test_variants
from numerics import assert_fa4_close


class Opts(NamedTuple):
    softmax_scale: float | None
    window: tuple
    softcap: float


class Case(NamedTuple):
    dtype: str
    d: int
    dv: int
    sq: int
    sk: int
    h: int
    hkv: int
    window: tuple = (None, None)
    softcap: float = 0.0
    b: int = 2


CAUSAL = (None, 0)
BF, FP = "bfloat16", "float16"

CASES = [
    # hdim 128: seqlens, masks, softcap, GQA/MQA, fp16
    Case(BF, 128, 128, 1, 1, 4, 4),
    Case(BF, 128, 128, 113, 203, 4, 4),
    Case(BF, 128, 128, 1023, 1024, 4, 4),
    Case(BF, 128, 128, 2049, 2048, 2, 2, b=1),
    Case(BF, 128, 128, 113, 203, 4, 4, CAUSAL),
    Case(BF, 128, 128, 203, 113, 4, 4, CAUSAL),  # 90 rows see no key
    Case(BF, 128, 128, 2049, 2048, 2, 2, CAUSAL, b=1),
    Case(BF, 128, 128, 1023, 1024, 4, 4, (64, 32)),
    Case(BF, 128, 128, 113, 203, 4, 4, (None, 7)),
    Case(BF, 128, 128, 2049, 2048, 2, 2, (256, 0), b=1),
    Case(BF, 128, 128, 113, 203, 4, 4, (3, 0)),  # key blocks nobody sees: dK = dV = 0
    Case(BF, 128, 128, 113, 203, 4, 4, softcap=30.0),
    Case(BF, 128, 128, 1023, 1024, 4, 4, CAUSAL, softcap=15.0),
    Case(BF, 128, 128, 113, 203, 4, 4, (40, 10), softcap=20.0),
    Case(BF, 128, 128, 113, 203, 6, 2),  # GQA
    Case(BF, 128, 128, 1023, 1024, 4, 1, CAUSAL),  # MQA
    Case(BF, 128, 128, 113, 203, 6, 3, CAUSAL, softcap=30.0),
    Case(FP, 128, 128, 113, 203, 4, 4),
    Case(FP, 128, 128, 1023, 1024, 4, 4, CAUSAL),
    Case(FP, 128, 128, 2049, 2048, 2, 2, (100, 50), b=1),
    Case(FP, 128, 128, 113, 203, 4, 4, softcap=30.0),
    # other head dims
    Case(BF, 64, 64, 113, 203, 4, 4),
    Case(BF, 64, 64, 1023, 1024, 4, 4, CAUSAL),
    Case(BF, 64, 64, 2049, 2048, 4, 2, b=1),
    Case(BF, 64, 64, 1, 1, 4, 4, (0, 0)),
    Case(BF, 96, 96, 113, 203, 4, 4),
    Case(BF, 96, 96, 1023, 1024, 4, 4, (128, 64)),
    Case(BF, 96, 96, 113, 203, 4, 2, CAUSAL),
    Case(BF, 192, 128, 113, 203, 4, 4),
    Case(BF, 192, 128, 1023, 1024, 4, 4, CAUSAL),
    Case(BF, 192, 128, 113, 203, 4, 1, (50, 20)),
    Case(BF, 256, 256, 113, 203, 4, 4),
    Case(BF, 256, 256, 1023, 1024, 2, 2, CAUSAL),
    Case(BF, 256, 256, 2049, 2048, 2, 1, (300, 100), b=1),
    Case(FP, 256, 256, 113, 203, 4, 4),
]


def _id(c: Case) -> str:
    w = "" if c.window == (None, None) else ("-causal" if c.window == CAUSAL else f"-w{c.window}")
    return (f"{c.dtype[:4]}-d{c.d}x{c.dv}-{c.sq}x{c.sk}-h{c.h}/{c.hkv}{w}"
            f"{'-cap' if c.softcap else ''}")


def poison_device_memory(nbytes: int = 1 << 28) -> None:
    """Fill and free a large block so that fresh outputs start as NaN garbage, not zeros."""
    jnp.full((nbytes // 4,), jnp.nan, jnp.float32).block_until_ready().delete()


def _inputs(c: Case, seed: int):
    dt = jnp.dtype(c.dtype)
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (c.b, c.sq, c.h, c.d), jnp.float32).astype(dt)
    k = jax.random.normal(ks[1], (c.b, c.sk, c.hkv, c.d), jnp.float32).astype(dt)
    v = jax.random.normal(ks[2], (c.b, c.sk, c.hkv, c.dv), jnp.float32).astype(dt)
    dout = jax.random.normal(ks[3], (c.b, c.sq, c.h, c.dv), jnp.float32).astype(dt)
    return q, k, v, dout


@functools.partial(jax.jit, static_argnames=("opts",))
def sm90_backward(q, k, v, out, lse, dout, opts):
    delta, lse_log2 = ops.bwd_preprocess(out, dout, lse, "sm90")
    return sm90_bwd_ops.backward(q, k, v, out, lse, dout, delta, lse_log2, opts)


@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap"))
def _forward32(q, k, v, *, scale, window, softcap):
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return reference.attention(f32(q), f32(k), f32(v), softmax_scale=scale, window=window,
                               softcap=softcap)


@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap"))
def _ref_backward(q, k, v, out32, lse, dout, *, scale, window, softcap):
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return reference.attention_backward(f32(q), f32(k), f32(v), out32, lse, f32(dout),
                                        softmax_scale=scale, window=window, softcap=softcap)


@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap"))
def _pt_backward(q, k, v, dout, *, scale, window, softcap):
    def f(q, k, v):
        out, _ = reference.attention(q, k, v, softmax_scale=scale, window=window, softcap=softcap,
                                     compute_dtype=q.dtype)
        return out
    _, vjp = jax.vjp(f, q, k, v)
    return vjp(dout)


def _run(c: Case, seed: int = 0):
    q, k, v, dout = _inputs(c, seed)
    scale = 1.0 / c.d ** 0.5
    kw = dict(scale=scale, window=c.window, softcap=c.softcap)
    out32, lse = _forward32(q, k, v, **kw)
    out = out32.astype(q.dtype)
    opts = Opts(scale, c.window, c.softcap)
    poison_device_memory()
    got = sm90_backward(q, k, v, out, lse, dout, opts)
    return (q, k, v, out, lse, dout, opts), got, out32, kw


def test_cases_are_precompiled():
    available = set(test_variants())
    for c in CASES:
        q = jax.ShapeDtypeStruct((c.b, c.sq, c.h, c.d), c.dtype)
        k = jax.ShapeDtypeStruct((c.b, c.sk, c.hkv, c.d), c.dtype)
        v = jax.ShapeDtypeStruct((c.b, c.sk, c.hkv, c.dv), c.dtype)
        main, post = sm90_bwd_ops.configs(q, k, v, Opts(None, c.window, c.softcap))
        assert main in available and post in available, _id(c)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_backward_matches_reference(case):
    (q, k, v, out, lse, dout, opts), got, out32, kw = _run(case)
    ref = _ref_backward(q, k, v, out32, lse, dout, **kw)
    pt = _pt_backward(q, k, v, dout, **kw)
    for name, g, r, p, x in zip(("dq", "dk", "dv"), got, ref, pt, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, (name, g.shape, g.dtype)
        assert bool(jnp.all(jnp.isfinite(g))), f"{name}: non-finite values"
        assert_fa4_close(g, r.astype(x.dtype), p, softcap=bool(case.softcap), name=name)


def test_repeatable_and_dq_order_independent():
    """dK / dV are written once per (key block, head): bitwise repeatable. dQ is reduce-added
    by many CTAs in any order: equal up to float32 summation order."""
    c = Case(BF, 128, 128, 1023, 1024, 4, 4, CAUSAL)
    args, first, _, _ = _run(c, seed=5)
    second = sm90_backward(*args)
    np.testing.assert_array_equal(np.asarray(first[1]), np.asarray(second[1]))
    np.testing.assert_array_equal(np.asarray(first[2]), np.asarray(second[2]))
    np.testing.assert_allclose(np.asarray(first[0], np.float32),
                               np.asarray(second[0], np.float32), rtol=2e-2, atol=2e-2)


def test_under_vmap():
    c = Case(BF, 128, 128, 113, 203, 4, 4, CAUSAL)
    (q, k, v, out, lse, dout, opts), single, _, _ = _run(c, seed=9)
    stack = lambda x: jnp.stack([x, x])  # noqa: E731
    batched = jax.jit(jax.vmap(lambda *a: sm90_backward(*a, opts)))(
        *(stack(x) for x in (q, k, v, out, lse, dout)))
    for s, bt in zip(single, batched):
        np.testing.assert_allclose(np.asarray(bt[1], np.float32), np.asarray(s, np.float32),
                                   rtol=1e-2, atol=1e-2)
