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

An FP8 KV cache (``flash_attention_paged`` with e4m3 k_cache / v_cache, per-kv-head descales
from ``fp8.quantize_paged_cache``; q in e4m3 or bfloat16, quantised by the call) and packed FP8
sequences (``flash_attention_varlen``, per-(sequence, kv head) descales): pages shuffled across
sequences, odd key counts, an empty sequence, GQA / MQA, every mask kind, the slots and pages
past each sequence's keys (and the padding tokens around the packed sequences) filled with NaN,
which the kernel must keep out of P·V (its transposer clears those keys of V in registers).
Each sequence against the float32 reference on its own dequantised keys by the same rule.

Decode steps (one query token, dense or paged) run the FP8 decode tile on the rewritten call
(GQA heads packed into a tile's rows, keys split into chunks merged in float32): cases of
both kinds are in the lists.

Kernels needed in the cache: the shipped FP8 forward configs, dense, decode, paged and varlen
(precompile --dtype float8_e4m3fn).
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
    # decode steps (one query token) on the FP8 decode tile: 8 query heads packed per kv head
    # and 4 key chunks merged in float32; MQA packed, an odd key count, no split; 4 chunks of
    # 1500 keys with a softcap
    (2, 1, 4096, 16, 2, True, (None, None), 0.0),
    (3, 1, 777, 8, 1, False, (None, None), 0.0),
    (1, 1, 6000, 8, 2, False, (None, None), 20.0),
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


# -- an FP8 KV cache and packed FP8 sequences --------------------------------------------------
def _check_sequences(out, lse, q, keys, values, window, softcap, name):
    """out (B, Sq, H, D) / lse (B, H, Sq) of batch entry or sequence b against the float32
    reference and the naive FP8 attention on its dequantised q[b] and its own keys[b] /
    values[b] (an entry without keys: out 0, lse -inf)."""
    for b, (k, v) in enumerate(zip(keys, values)):
        if k.shape[1] == 0:
            assert np.all(np.asarray(out[b], np.float32) == 0), f"{name}: entry {b} not 0"
            assert np.all(np.isneginf(np.asarray(lse[b]))), f"{name}: entry {b} lse"
            continue
        ref = reference.attention(q[b: b + 1], k, v, window=window, softcap=softcap)
        pt = naive_fp8(q[b: b + 1], k, v, window=window, softcap=softcap)
        check_forward(out[b: b + 1], lse[b: b + 1], ref, pt, softcap, f"{name} entry {b}")


def run_fp8_paged_case(b, sq, h, hkv, d, page_size, max_pages, seqused, causal=False,
                       window=(None, None), softcap=0.0, q16=False):
    seed = zlib.crc32(repr((b, sq, h, hkv, d, page_size, max_pages, seqused, causal, window,
                            softcap, q16)).encode())
    num_pages = b * max_pages + 3
    ks = jax.random.split(jax.random.key(seed), 4)
    spread = jnp.exp(jax.random.uniform(ks[3], (1, 1, hkv, 1), minval=-1.0, maxval=1.0))
    q = jax.random.normal(ks[0], (b, sq, h, d), jnp.float32)
    k = jax.random.normal(ks[1], (num_pages, page_size, hkv, d), jnp.float32) * spread
    v = jax.random.normal(ks[2], (num_pages, page_size, hkv, d), jnp.float32) / spread
    k8, v8, kd, vd = fp8.quantize_paged_cache(k, v)
    rng = np.random.default_rng(seed)
    table = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    used = np.asarray(seqused, np.int32)
    # every cache slot no sequence uses: NaN (the unused tail of a last page, unused pages)
    in_use = np.zeros((num_pages, page_size), bool)
    for row, n in enumerate(used):
        for j in range(-(-int(n) // page_size)):
            in_use[table[row, j], : min(page_size, int(n) - j * page_size)] = True
        if row % 2:
            table[row, -(-int(n) // page_size):] = -1  # never read
    poisoned = [jnp.where(jnp.asarray(in_use)[:, :, None, None], x, jnp.nan).astype(fp8.FP8)
                for x in (k8.astype(jnp.float32), v8.astype(jnp.float32))]
    if q16:
        q_in, qd = q.astype(jnp.bfloat16), None
        q8, q_scale = fp8.quantize_grouped(q_in, hkv)  # what the call quantises it to
    else:
        q8, q_scale = fp8.quantize_grouped(q, hkv)
        q_in, qd = q8, q_scale
    window = (None, 0) if causal else window
    fn = jax.jit(lambda q, kc, vc, t, u, qd, kd, vd: jax_fa4.flash_attention_paged(
        q, kc, vc, t, u, q_descale=qd, k_descale=kd, v_descale=vd, window_size=window,
        softcap=softcap, return_lse=True, implementation="sm90"))
    poison_device_memory()
    out, lse = jax.block_until_ready(fn(q_in, *poisoned, jnp.asarray(table), jnp.asarray(used),
                                        qd, kd, vd))
    assert out.dtype == jnp.bfloat16 and out.shape == (b, sq, h, d)
    deq_k = fp8.dequantize(k8, jnp.broadcast_to(kd, (num_pages, hkv)))
    deq_v = fp8.dequantize(v8, jnp.broadcast_to(vd, (num_pages, hkv)))
    rows = [np.asarray(table[i, : -(-int(n) // page_size)]) for i, n in enumerate(used)]
    keys = [deq_k[r].reshape(1, -1, hkv, d)[:, : int(n)] for r, n in zip(rows, used)]
    values = [deq_v[r].reshape(1, -1, hkv, d)[:, : int(n)] for r, n in zip(rows, used)]
    name = (f"fp8 paged b={b} sq={sq} h={h}/{hkv} d={d} page={page_size} seqused={seqused} "
            f"window={window} softcap={softcap} q16={q16}")
    _check_sequences(out, lse, fp8.dequantize(q8, q_scale), keys, values, window, softcap, name)


@pytest.mark.parametrize("b, sq, h, hkv, d, page_size, max_pages, seqused, causal, window, "
                         "softcap, q16", [
    # a decode step: 4 query heads packed per kv head (1024 key slots: no split), one sequence
    # of 1 key, odd lengths
    (3, 1, 8, 2, 128, 128, 8, (1000, 1, 77), False, (None, None), 0.0, False),
    # a decode step split into 4 chunks of 1024 keys (float32 partials), 8 heads packed, q in
    # bfloat16 (quantised by the call)
    (2, 1, 16, 2, 128, 128, 32, (4000, 2500), False, (None, None), 0.0, True),
    # head dim 256, MQA, causal (one query: unmasked), 2 chunks; head dim 64 with a softcap
    (2, 1, 8, 1, 256, 128, 16, (2048, 1500), True, (None, None), 0.0, False),
    (2, 1, 4, 2, 64, 256, 8, (2000, 3), False, (None, None), 5.0, False),
    # a causal chunk of 77 queries, 256-key pages (two key blocks each), a bfloat16 q
    (2, 77, 4, 4, 128, 256, 3, (700, 129), True, (None, None), 0.0, True),
    # MQA at head dim 64, an empty sequence, a window and a softcap
    (2, 33, 8, 1, 64, 128, 4, (333, 0), False, (40, 3), 5.0, False),
    # head dim 256, causal, 128-key pages, keys ending 3 past a block
    (2, 16, 4, 2, 256, 128, 4, (300, 131), True, (None, None), 0.0, False),
])
def test_fp8_paged(b, sq, h, hkv, d, page_size, max_pages, seqused, causal, window, softcap,
                   q16):
    run_fp8_paged_case(b, sq, h, hkv, d, page_size, max_pages, seqused, causal, window,
                       softcap, q16)


#: padding tokens before the first and after the last packed sequence (NaN in q, k and v)
PAD_FRONT, PAD_BACK = 3, 5


def run_fp8_varlen_case(lens_q, lens_k, h, hkv, d, causal=False, window=(None, None),
                        softcap=0.0):
    seed = zlib.crc32(repr((lens_q, lens_k, h, hkv, d, causal, window, softcap)).encode())
    n = len(lens_q)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32) + PAD_FRONT
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32) + PAD_FRONT
    tq, tk = int(cu_q[-1]) + PAD_BACK, int(cu_k[-1]) + PAD_BACK
    ks = jax.random.split(jax.random.key(seed), 6)
    # e4m3 values over their range, and one descale per (sequence, kv head) of varied size
    q8, k8, v8 = (jnp.clip(jax.random.normal(key, shape, jnp.float32) * 100, -fp8.E4M3_MAX,
                           fp8.E4M3_MAX).astype(fp8.FP8)
                  for key, shape in zip(ks[:3], ((tq, h, d), (tk, hkv, d), (tk, hkv, d))))
    qd, kd, vd = (jnp.exp(jax.random.uniform(key, (n, hkv), minval=-5.5, maxval=-4.0))
                  for key in ks[3:])

    def poison(x, cu):
        t = np.arange(x.shape[0])
        inside = jnp.asarray((t >= cu[0]) & (t < cu[-1]))[:, None, None]
        return jnp.where(inside, x.astype(jnp.float32), jnp.nan).astype(fp8.FP8)

    window = (None, 0) if causal else window
    fn = jax.jit(lambda *a: jax_fa4.flash_attention_varlen(
        *a[:5], max(lens_q), max(lens_k), q_descale=a[5], k_descale=a[6], v_descale=a[7],
        window_size=window, softcap=softcap, return_lse=True, implementation="sm90"))
    poison_device_memory()
    out, lse = jax.block_until_ready(fn(poison(q8, cu_q), poison(k8, cu_k), poison(v8, cu_k),
                                        jnp.asarray(cu_q), jnp.asarray(cu_k), qd, kd, vd))
    assert out.dtype == jnp.bfloat16 and out.shape == (tq, h, d)
    name = f"fp8 varlen lens_q={lens_q} lens_k={lens_k} h={h}/{hkv} d={d} window={window}"
    padding = np.r_[0:PAD_FRONT, int(cu_q[-1]):tq]
    assert np.all(np.asarray(out, np.float32)[padding] == 0), f"{name}: padding rows not 0"
    for s in range(n):
        (q0, q1), (k0, k1) = (int(x) for x in cu_q[s: s + 2]), (int(x) for x in cu_k[s: s + 2])
        if q1 == q0:
            continue
        one = [fp8.dequantize(x[None, a:z], sc[s: s + 1])
               for x, sc, a, z in ((q8, qd, q0, q1), (k8, kd, k0, k1), (v8, vd, k0, k1))]
        _check_sequences(out[None, q0:q1], lse[None, :, q0:q1], one[0], [one[1]], [one[2]],
                         window, softcap, f"{name} sequence {s}")


@pytest.mark.parametrize("lens_q, lens_k, h, hkv, d, causal, window, softcap", [
    # lengths 0, 1 and odd; GQA; keys ending inside a key block (the next sequence's rows and
    # the NaN padding past them)
    ((77, 0, 1, 300), (200, 13, 1, 301), 8, 2, 128, False, (None, None), 0.0),
    ((77, 0, 1, 300), (200, 13, 1, 301), 8, 2, 128, True, (None, None), 0.0),
    ((129, 5, 64), (129, 99, 33), 4, 1, 64, False, (30, 7), 4.0),
    ((50, 1, 190), (61, 1, 190), 4, 4, 256, True, (None, None), 0.0),
])
def test_fp8_varlen(lens_q, lens_k, h, hkv, d, causal, window, softcap):
    run_fp8_varlen_case(lens_q, lens_k, h, hkv, d, causal, window, softcap)
