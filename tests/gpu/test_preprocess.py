"""The backward preprocess kernel and the binding, on the H200 (kernels precompiled elsewhere)."""

from __future__ import annotations

import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import backends, reference
from numerics import assert_fa4_close


def poison_device_memory(nbytes: int = 1 << 28) -> None:
    """Fill and free a large block so that fresh outputs start as NaN garbage, not zeros."""
    jnp.full((nbytes // 4,), jnp.nan, jnp.float32).block_until_ready().delete()


def _inputs(key, shape, dtype):
    k1, k2, k3 = jax.random.split(key, 3)
    b, s, h, _ = shape
    out = jax.random.normal(k1, shape, jnp.float32).astype(dtype)
    dout = jax.random.normal(k2, shape, jnp.float32).astype(dtype)
    lse = jax.random.normal(k3, (b, h, s), jnp.float32) * 3
    lse = lse.at[:, :, ::7].set(-jnp.inf)  # rows that saw no key
    return out, dout, lse


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", [(1, 1, 1, 64), (2, 113, 3, 128), (3, 1023, 4, 96),
                                   (1, 4224, 2, 256), (2, 2049, 5, 64)])
def test_preprocess_kernel_matches_float32(shape, dtype):
    out, dout, lse = _inputs(jax.random.key(sum(shape)), shape, dtype)
    poison_device_memory()
    preprocess = jax.jit(lambda o, d, l: backends.get("sm90").backward_preprocess(o, d, l))
    delta, lse_log2 = preprocess(out, dout, lse)
    want = np.einsum("bshd,bshd->bhs", np.asarray(out, np.float64), np.asarray(dout, np.float64))
    np.testing.assert_allclose(np.asarray(delta), want, rtol=1e-5, atol=1e-4 * math.sqrt(shape[3]))
    lse_np = np.asarray(lse)
    want_log2 = np.where(np.isneginf(lse_np), np.inf, lse_np * math.log2(math.e))
    np.testing.assert_allclose(np.asarray(lse_log2), want_log2, rtol=1e-6)


def test_preprocess_kernel_margin_on_huge_rows():
    """lse_log2 of huge rows (|lse·log2 e| >= 2^24) carries the margin that keeps the rebuilt
    P <= 1, bit for bit the reference backend's rule (tests/test_extreme_numerics.py checks that
    rule); ordinary rows and rows without keys are unchanged."""
    out, dout, _ = _inputs(jax.random.key(11), (1, 12, 1, 64), jnp.bfloat16)
    lse = jnp.asarray([[[0.0, -3.5, 11.0, 1e6, -1e6, 1.2e7, 1e9, -1e9, 3e20, 5e37, -1e30,
                         -jnp.inf]]], jnp.float32)
    poison_device_memory()
    _, got = jax.jit(lambda o, d, l: backends.get("sm90").backward_preprocess(o, d, l))(
        out, dout, lse)
    _, want = backends.get("reference").backward_preprocess(out, dout, lse)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    exact = np.asarray(lse, np.float64) * math.log2(math.e)
    assert np.all(np.asarray(got, np.float64)[0, 0, 5:11] > exact[0, 0, 5:11])


def test_preprocess_kernel_under_vmap():
    out, dout, lse = _inputs(jax.random.key(7), (2, 77, 3, 128), jnp.bfloat16)
    stack = lambda x: jnp.stack([x, x * 2])  # noqa: E731
    f = jax.jit(jax.vmap(lambda o, d, l: backends.get("sm90").backward_preprocess(o, d, l)))
    delta, _ = f(stack(out), stack(dout), stack(lse))
    preprocess = jax.jit(lambda o, d, l: backends.get("sm90").backward_preprocess(o, d, l))
    single, _ = preprocess(out, dout, lse)
    np.testing.assert_allclose(np.asarray(delta[0]), np.asarray(single), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(delta[1]), 4 * np.asarray(single), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_grad_through_api_uses_kernel_and_matches_reference(causal):
    ks = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(ks[0], (2, 203, 4, 128), jnp.bfloat16)
    k = jax.random.normal(ks[1], (2, 113, 2, 128), jnp.bfloat16)
    v = jax.random.normal(ks[2], (2, 113, 2, 128), jnp.bfloat16)
    ct = jax.random.normal(ks[3], (2, 203, 4, 128), jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * ct)

    ours = jax.jit(jax.grad(loss(lambda q, k, v: jax_fa4.flash_attention(
        q, k, v, causal=causal)), argnums=(0, 1, 2)))
    hlo = ours.lower(q, k, v).as_text()
    assert "CuteDSLRT_NvJaxCutlassCall_v2" in hlo  # the preprocess kernel is in the program
    window = (None, 0) if causal else (None, None)
    ref32 = jax.grad(loss(lambda q, k, v: reference.attention(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), window=window)[0]),
        argnums=(0, 1, 2))(q, k, v)
    pt = jax.grad(loss(lambda q, k, v: reference.attention(
        q, k, v, window=window, compute_dtype=jnp.bfloat16)[0]), argnums=(0, 1, 2))(q, k, v)
    for name, g, r, p in zip("qkv", ours(q, k, v), ref32, pt):
        assert_fa4_close(g, r.astype(jnp.bfloat16), p, name=f"d{name}")


def test_export_roundtrip_runs_embedded_kernel():
    out, dout, lse = _inputs(jax.random.key(11), (2, 100, 3, 128), jnp.bfloat16)
    f = jax.jit(lambda o, d, l: backends.get("sm90").backward_preprocess(o, d, l))
    exported = jax.export.export(f, disabled_checks=jax_fa4.export_disabled_safety_checks())(
        out, dout, lse)
    restored = jax.export.deserialize(exported.serialize())
    np.testing.assert_array_equal(np.asarray(restored.call(out, dout, lse)[0]),
                                  np.asarray(f(out, dout, lse)[0]))


def test_runs_without_the_compiler():
    """With every kernel in the cache, nothing imports the CuTe-DSL compiler."""
    code = (
        "import sys, jax, jax.numpy as jnp\n"
        "from jax_fa4 import backends\n"
        "o = jnp.ones((1, 9, 2, 128), jnp.bfloat16)\n"
        "l = jnp.zeros((1, 2, 9), jnp.float32)\n"
        "d, _ = jax.jit(lambda o, l: backends.get('sm90').backward_preprocess(o, o, l))(o, l)\n"
        "assert float(d[0, 0, 0]) == 128.0, d\n"
        "assert 'cutlass' not in sys.modules, 'the compiler was imported'\n"
        "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def test_deterministic_gradients_are_bitwise_equal():
    """deterministic=True: two runs of the same backward give the same bits (on the GPU, where
    atomics and split reductions could otherwise reorder float additions)."""
    ks = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(ks[0], (2, 1000, 8, 128), jnp.bfloat16)
    k = jax.random.normal(ks[1], (2, 1000, 2, 128), jnp.bfloat16)
    v = jax.random.normal(ks[2], (2, 1000, 2, 128), jnp.bfloat16)
    grad = jax.jit(jax.grad(lambda q, k, v: jax_fa4.flash_attention(
        q, k, v, causal=True, deterministic=True).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    first, second = grad(q, k, v), grad(q, k, v)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("shape, n", [((1, 1, 1, 64), 64 * 64), ((2, 113, 3, 128), 128 * 128),
                                      ((3, 1023, 4, 96), 1024 * 96 + 4 * 7),
                                      ((1, 4224, 2, 256), 4224 * 256)])
def test_preprocess_zeroes_the_dq_accumulator(shape, n):
    """``zero_dq_accum``: every float of the (B, H, N) accumulator is 0 in NaN-poisoned memory,
    whatever N's split into the row blocks' shares (the third case's N is no multiple of its
    128 row blocks' stores); delta and lse_log2 are those of the plain preprocess."""
    out, dout, lse = _inputs(jax.random.key(7 + sum(shape)), shape, jnp.bfloat16)
    b, _, h, _ = shape
    sm90 = backends.get("sm90")
    poison_device_memory()
    delta, lse_log2, accum = jax.jit(lambda o, d, l: sm90.backward_preprocess_with_accum(
        o, d, l, (b, h, n)))(out, dout, lse)
    assert accum.shape == (b, h, n) and accum.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(accum), 0.0)
    want_delta, want_log2 = jax.jit(lambda o, d, l: sm90.backward_preprocess(o, d, l))(
        out, dout, lse)
    np.testing.assert_array_equal(np.asarray(delta), np.asarray(want_delta))
    np.testing.assert_array_equal(np.asarray(lse_log2), np.asarray(want_log2))
