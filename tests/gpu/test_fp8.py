"""The FP8 (e4m3) forward kernel on an H200, against the float32 reference on the dequantised
inputs.

``flash_attention(q8, k8, v8, q_descale=..., k_descale=..., v_descale=..., implementation=
"sm90")`` under ``jax.jit`` (out bfloat16, lse), in NaN-poisoned memory, on odd and mismatched
lengths (key counts that are no multiple of 32: the kernel reads v as stored, its tail rows
zero-filled by TMA), every mask kind, softcap, GQA/MQA, head dims 64, 128 and 256, per-(batch,
kv head) descales that differ from 1.

The rule (docs/fp8.md): FA4's, ``max|out - ref| <= 2·max|pt - ref| + atol`` (3 with a
softcap), where ``ref`` is attention in float32 on the dequantised inputs and ``pt`` the naive
FP8 attention a framework would write: the same float32 scores, P rounded to e4m3 before the
P·V product, the output rounded to bfloat16. lse is compared like the 16-bit kernels' (its sums
are float32 in both). Rows without a visible key: out exactly 0, lse -inf.

Kernels needed in the cache: the shipped FP8 forward configs (precompile --dtype
float8_e4m3fn).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import fp8, reference
from tests.gpu.test_sm90_fwd import check_forward, poison_device_memory

pytestmark = pytest.mark.gpu


def _quantized(seed, b, sq, sk, h, hkv, d):
    """e4m3 q, k, v with per-(batch, kv head) descales, from normal inputs of varied scale."""
    ks = jax.random.split(jax.random.key(seed), 4)
    spread = jnp.exp(jax.random.uniform(ks[3], (b, 1, hkv, 1), minval=-1.0, maxval=1.0))
    q = jax.random.normal(ks[0], (b, sq, h, d), jnp.float32)
    k = jax.random.normal(ks[1], (b, sk, hkv, d), jnp.float32) * spread
    v = jax.random.normal(ks[2], (b, sk, hkv, d), jnp.float32) / spread
    q8, qd = fp8.quantize_grouped(q, hkv)
    (k8, kd), (v8, vd) = fp8.quantize(k), fp8.quantize(v)
    return (q8, k8, v8), (qd, kd, vd)


def naive_fp8(q, k, v, *, window, softcap, softmax_scale=None):
    """(out, lse) of the naive FP8 attention (module doc): float32 scores and sums, P in e4m3."""
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else softmax_scale
    kr, vr = (jnp.repeat(x, h // hkv, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kr, precision="highest") * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    sk = k.shape[1]
    i, j = np.arange(sq)[:, None], np.arange(sk)[None]
    left, right = window
    seen = np.ones((sq, sk), bool)
    if right is not None:
        seen &= j <= i + sk - sq + right
    if left is not None:
        seen &= j >= i + sk - sq - left
    s = jnp.where(seen, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    total = p.sum(-1, keepdims=True)
    p8 = p.astype(fp8.FP8).astype(jnp.float32)
    out = jnp.einsum("bhqk,bkhd->bqhd", p8, vr, precision="highest")
    out = out / jnp.where(total > 0, total, 1.0).transpose(0, 2, 1, 3)
    lse = jnp.where(total[..., 0] > 0, m[..., 0] + jnp.log(total[..., 0]), -jnp.inf)
    return out.astype(jnp.bfloat16), lse


CASES = [  # (b, sq, sk, h, hkv, causal, window, softcap)
    (2, 1000, 1000, 4, 4, False, (None, None), 0.0),
    (2, 777, 1201, 8, 2, True, (None, None), 0.0),
    (1, 1500, 900, 4, 1, False, (200, 17), 0.0),
    (2, 640, 640, 4, 2, True, (None, None), 30.0),
    (1, 333, 4000, 4, 4, False, (None, None), 5.0),
    (3, 129, 97, 2, 1, True, (None, None), 0.0),  # keys end before the diagonal: empty rows
    # V read as stored: key counts that are no multiple of 32 (the tail rows TMA zero-fills),
    # one key block (77 < every FP8 tile_n: the producer's last transposes alone) and two or
    # three (200)
    (2, 77, 77, 4, 2, False, (None, None), 0.0),
    (1, 300, 77, 8, 2, False, (30, 5), 3.0),
    (2, 200, 200, 6, 3, True, (None, None), 0.0),
]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("b, sq, sk, h, hkv, causal, window, softcap", CASES)
def test_fp8_forward(d, b, sq, sk, h, hkv, causal, window, softcap):
    seed = zlib.crc32(repr((d, b, sq, sk, h, hkv, causal, window, softcap)).encode())
    (q8, k8, v8), (qd, kd, vd) = _quantized(seed, b, sq, sk, h, hkv, d)
    window = (None, 0) if causal else window

    @jax.jit
    def run(q8, k8, v8, qd, kd, vd):
        return jax_fa4.flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                       window_size=window, softcap=softcap, return_lse=True,
                                       implementation="sm90")

    poison_device_memory()
    out, lse = run(q8, k8, v8, qd, kd, vd)
    assert out.dtype == jnp.bfloat16 and out.shape == (b, sq, h, d)
    q, k, v = fp8.dequantize(q8, qd), fp8.dequantize(k8, kd), fp8.dequantize(v8, vd)
    ref = reference.attention(q, k, v, window=window, softcap=softcap)
    pt = naive_fp8(q, k, v, window=window, softcap=softcap)
    check_forward(out, lse, ref, pt, softcap, f"fp8 d={d} {(b, sq, sk, h, hkv)}")


def test_fp8_scalar_descales_and_out_dtype():
    """Scalar descales broadcast; out_dtype=float32 is the kernel's bfloat16 out, cast."""
    (q8, k8, v8), _ = _quantized(7, 2, 300, 300, 4, 2, 128)
    f = jax.jit(lambda *a: jax_fa4.flash_attention(
        *a[:3], q_descale=a[3], k_descale=a[4], v_descale=a[5], out_dtype=jnp.float32,
        implementation="sm90"))
    out = f(q8, k8, v8, jnp.float32(0.5), jnp.float32(2.0), jnp.float32(0.25))
    want = jax_fa4.flash_attention(q8, k8, v8, q_descale=0.5, k_descale=2.0, v_descale=0.25,
                                   implementation="sm90")
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want, np.float32))
