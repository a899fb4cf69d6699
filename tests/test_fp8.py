"""FP8 (e4m3) attention on the CPU: the API's checks, the quantisation helpers, the reference
route, the missing gradient, and the FP8 kernel's value layout (its key permutation) against a
model of the WGMMA register fragments. The FP8 KV cache (flash_attention_paged) and packed FP8
sequences (flash_attention_varlen): their checks, the reference route on the dequantised
inputs, q quantised by the paged call, the Hopper route's operands (kernel stubbed)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from compiled import tiered
from conformance import normal
from jax_fa4 import backends, fp8, options, reference
from jax_fa4.kernels.sm90 import fwd_config


def _inputs(b=2, sq=77, sk=131, h=4, hkv=2, d=64, seed=0):
    q, k, v = normal(f"fp8 {seed}", [(b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d)],
                     jnp.float32)
    return q, k * 2.0, v * 0.5


def test_quantize_round_trip_per_head():
    q, k, _ = _inputs()
    # the helpers jitted (op by op, each of their operations compiles for each shape); the
    # checks' arithmetic in NumPy
    quantize, dequantize = jax.jit(fp8.quantize), jax.jit(fp8.dequantize)
    k8, kd = quantize(k)
    assert k8.dtype == jnp.float8_e4m3fn and kd.shape == (2, 2) and kd.dtype == jnp.float32
    # the largest magnitude of each (batch, head) maps to 448; e4m3 keeps 3 mantissa bits
    np.testing.assert_allclose(np.abs(np.asarray(k8, np.float32)).max(axis=(1, 3)), 448.0)
    back, k = np.asarray(dequantize(k8, kd)), np.asarray(k)
    rel = np.abs(back - k) / np.maximum(np.abs(k), 1e-3 * np.max(np.abs(k)))
    assert float(np.max(rel)) <= 2.0 ** -4 + 1e-6
    # one descale per kv head's group of query heads
    q8, qd = jax.jit(fp8.quantize_grouped, static_argnums=1)(q, 2)
    assert qd.shape == (2, 2)
    np.testing.assert_allclose(np.asarray(dequantize(q8, qd)), np.asarray(q), rtol=0.07,
                               atol=0.02 * float(np.max(np.abs(np.asarray(q)))))
    z8, zd = quantize(np.zeros((1, 5, 1, 8), np.float32))
    assert float(zd[0, 0]) == 1.0 and not np.any(np.asarray(z8, np.float32))


@pytest.mark.parametrize("causal, window, softcap", [(False, (None, None), 0.0),
                                                     (True, (None, None), 0.0),
                                                     (False, (20, 3), 4.0)])
def test_reference_route_is_the_dequantised_attention(causal, window, softcap):
    q, k, v = _inputs()
    (q8, qd), (k8, kd), (v8, vd) = fp8.quantize_grouped(q, 2), fp8.quantize(k), fp8.quantize(v)
    out, lse = jax_fa4.flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                       causal=causal, window_size=window, softcap=softcap,
                                       return_lse=True)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    deq = [fp8.dequantize(x, s) for x, s in ((q8, qd), (k8, kd), (v8, vd))]
    want, want_lse = jax_fa4.flash_attention(*deq, causal=causal, window_size=window,
                                             softcap=softcap, return_lse=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=8e-3)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-6, atol=1e-6)
    f32 = jax_fa4.flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                  causal=causal, window_size=window, softcap=softcap,
                                  out_dtype=jnp.float32)
    assert f32.dtype == jnp.float32


def test_scalar_descales_broadcast():
    q, k, v = (x.astype(jnp.float8_e4m3fn) for x in _inputs())
    a = jax_fa4.flash_attention(q, k, v, q_descale=0.5, k_descale=2.0, v_descale=0.25)
    ones = jnp.ones((2, 2), jnp.float32)
    b = jax_fa4.flash_attention(q, k, v, q_descale=0.5 * ones, k_descale=2.0 * ones,
                                v_descale=0.25 * ones)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    plain = jax_fa4.flash_attention(q, k, v)  # default descales: 1
    np.testing.assert_allclose(np.asarray(a, np.float32), 0.25 * np.asarray(plain, np.float32),
                               rtol=2e-2, atol=1e-3)


def test_fp8_calls_have_no_gradient():
    q, k, v = (x.astype(jnp.float8_e4m3fn) for x in _inputs())

    _, pullback = jax.vjp(lambda q: jax_fa4.flash_attention(q, k, v), q)
    with pytest.raises(NotImplementedError, match="forward only.*bfloat16"):
        pullback(jnp.ones((2, 77, 4, 64), jnp.bfloat16))


@pytest.mark.parametrize("bad, match", [
    (dict(q_descale=jnp.ones((2, 4))), r"q_descale must be a scalar or have shape \(B, Hkv\)"),
    (dict(v_descale=jnp.ones((2, 2), jnp.int32)), "v_descale must be floating"),
    (dict(k_descale="2"), "k_descale must be a float32 scalar"),
    (dict(out_dtype=jnp.int8), "out_dtype must be bfloat16, float16 or float32"),
])
def test_bad_fp8_arguments_are_named(bad, match):
    q, k, v = (x.astype(jnp.float8_e4m3fn) for x in _inputs())
    with pytest.raises((TypeError, ValueError), match=match):
        jax_fa4.flash_attention(q, k, v, **bad)


def test_fp8_options_that_are_not_supported_say_so():
    q, k, v = (x.astype(jnp.float8_e4m3fn) for x in _inputs())
    with pytest.raises(NotImplementedError, match="learnable_sink, return_max_logits"):
        jax_fa4.flash_attention(q, k, v, learnable_sink=jnp.zeros(4), return_max_logits=True)
    qb, kb, vb = _inputs()
    with pytest.raises(ValueError, match="q_descale apply to FP8 calls only"):
        jax_fa4.flash_attention(qb, kb, vb, q_descale=1.0)
    with pytest.raises(TypeError, match="k must have q's dtype"):
        jax_fa4.flash_attention(q, kb, vb)
    cu_q, cu_k = jnp.array([0, 77], jnp.int32), jnp.array([0, 131], jnp.int32)
    with pytest.raises(NotImplementedError, match="does not support learnable_sink"):
        jax_fa4.flash_attention_varlen(q[0], k[0], v[0], cu_q, cu_k, 77, 131,
                                       learnable_sink=jnp.zeros(4))
    with pytest.raises(ValueError, match=r"v_descale, out_dtype apply to FP8 calls only \(q, k, "
                                         r"v in float8_e4m3fn\); got q of dtype float32"):
        jax_fa4.flash_attention_varlen(qb[0], kb[0], vb[0], cu_q, cu_k, 77, 131, v_descale=1.0,
                                       out_dtype=jnp.float32)


def _operand_a_from_accumulator(p: np.ndarray) -> np.ndarray:
    """The P·V GEMM's A operand as the FP8 kernel builds it, for one row block: the QK
    accumulator's layout (thread t of a quad holds columns 8j + 2t + {0, 1}) packed by
    convert_p_e4m3 (word (r, h) byte e <- accumulator group 4kk + 2h + e // 2, column e % 2) and
    read by the e4m3 WGMMA (word (r, h) byte e of thread t = logical column 32kk + 16h + 4t + e).
    Returns the logical (rows, keys) matrix the tensor cores multiply."""
    rows, keys = p.shape
    logical = np.empty_like(p)
    for kk in range(keys // 32):
        for t in range(4):
            for h in range(2):
                for e in range(4):
                    physical = 32 * kk + 8 * (2 * h + e // 2) + 2 * t + e % 2
                    logical[:, 32 * kk + 16 * h + 4 * t + e] = p[:, physical]
    return logical


def test_value_permutation_follows_the_p_fragment():
    """P·V through the kernel's layouts (the permuted A operand; the value operand with column
    l of each group of 32 keys holding key fp8_value_permutation()[l], as the producer warps'
    transpose writes it: tests/test_v_transpose.py) equals P·V. Sk is not a multiple of 32:
    the keys past it read zeros (TMA fills rows out of bounds with zeros) and P is 0 there."""
    rng = np.random.default_rng(0)
    sk, dv = 77, 16
    p = rng.random((8, 96)).astype(np.float32)
    p[:, sk:] = 0.0  # keys past Sk are masked: P = 0 there
    v = rng.standard_normal((sk, dv)).astype(np.float32)
    v_tiles = np.zeros((96, dv), np.float32)  # the key blocks as TMA loads them
    v_tiles[:sk] = v
    perm = fwd_config.fp8_value_permutation()
    assert sorted(perm) == list(range(32))
    keys = [32 * (l // 32) + perm[l % 32] for l in range(96)]
    operand = v_tiles[keys].T  # (Dv, keys): the K-major B operand
    got = _operand_a_from_accumulator(p) @ operand.T
    np.testing.assert_allclose(got, p[:, :sk] @ v, rtol=1e-5, atol=1e-5)


def test_fp8_configs_and_signature():
    cfg = fwd_config.fp8_config(128, 128, "none", True)
    assert cfg.rescale_skip  # the exact skip (no threshold: checked for every shipped config below)
    assert cfg.fp8 and cfg.dtype == "float8_e4m3fn" and cfg.tile_n % 32 == 0
    names = [(a.name, a.dtype) for a in cfg.signature().inputs + cfg.signature().outputs]
    assert names == [("q", "float8_e4m3fn"), ("k", "float8_e4m3fn"), ("v", "float8_e4m3fn"),
                     ("params", "float32"), ("descale", "float32"), ("out", "bfloat16"),
                     ("lse", "float32")]
    # v as the 16-bit kernel takes it: (B, Sk, Hkv, Dv), no padding of the keys
    v_arg, = (a for a in cfg.signature().inputs if a.name == "v")
    b, sk, hkv, dv = v_arg.sample_shape
    assert dv == 128 and v_arg.divisibility == (1, 1, 1, 128)
    descale, = (a for a in cfg.signature().inputs if a.name == "descale")
    assert descale.sample_shape == (b, hkv, 2)
    for refused in (dict(segments=True), dict(max_logits=True), dict(num_sms=132),
                    dict(tile_m=64, pingpong=False, ctas_per_sm=2)):
        with pytest.raises(ValueError, match="float8_e4m3fn is implemented for dense, paged, "
                                             "decode and varlen calls"):
            fwd_config.FwdConfig.make("float8_e4m3fn", 128, 128, "none", False, **refused)
    with pytest.raises(ValueError, match="head_dim/head_dim_v 96/96 not supported"):
        fwd_config.fp8_config(96)
    # the decode tile: q and out head-major (B, H, S, D), out float32 for split chunks
    dec = fwd_config.fp8_decode_config(128, out_f32=True)
    assert dec.qo_head_major and dec.mask == "none" and dec.tile_m == fwd_config.DECODE_TILE_M
    sig = dec.signature()
    (q_arg,), (out_arg,) = ([a for a in sig.inputs + sig.outputs if a.name == n]
                            for n in ("q", "out"))
    b, h, s, d = q_arg.sample_shape
    assert q_arg.dtype == "float8_e4m3fn" and h != s and out_arg.sample_shape == (b, h, s, d)
    assert out_arg.dtype == "float32"
    assert [a.name for a in sig.inputs] == ["q", "k", "v", "params", "descale"]
    shipped = [c for c in fwd_config.shipped_configs() if c.fp8]
    # head dims 64, 128, 256 x 3 mask kinds x softcap x dense, varlen, paged (16-bit and
    # float32 out); the decode tile per head dim x softcap x float32 out or not
    assert len(shipped) == 54 + 18 + 12
    assert sum(c.paged for c in shipped) == 2 * sum(c.varlen for c in shipped) == 36
    assert all(c.qo_head_major for c in shipped if c.paged)
    assert sum(c.qo_head_major and not c.paged for c in shipped) == 12
    # the exact row max keeps each row's largest P exactly 1 in e4m3 (docs/fp8.md)
    assert all(c.rescale_threshold == 0 for c in shipped)
    with pytest.raises(ValueError, match="float8_e4m3fn needs rescale_threshold 0"):
        fwd_config.FwdConfig.make("float8_e4m3fn", 256, 256, "none", rescale_threshold=8.0)
    with pytest.raises(ValueError, match="float8_e4m3fn needs intra_wg_overlap"):
        fwd_config.FwdConfig.make("float8_e4m3fn", 128, 128, "none", intra_wg_overlap=False)


def test_fp8_configs_stage_v_for_the_transpose():
    """Every shipped FP8 config stages V as loaded in two stages where they fit (one at head dim
    256 with 128 query rows, whose K and V stages and O tile leave room for one; the paged and
    decode tiles' 64 rows leave room for two), within the shared memory; 16-bit configs stage
    nothing."""
    for cfg in (c for c in fwd_config.shipped_configs() if c.fp8):
        one = cfg.head_dim_v == 256 and cfg.tile_m > fwd_config.DECODE_TILE_M
        assert cfg.v_staging_stages == (1 if one else 2), cfg.describe()
        assert cfg.smem_bytes() <= cfg.smem_limit()
        two = cfg.smem_bytes() + (2 - cfg.v_staging_stages) * cfg.tile_n * cfg.head_dim_v
        assert (two <= cfg.smem_limit()) == (cfg.v_staging_stages == 2)
    assert fwd_config.FwdConfig.make("bfloat16", 128).v_staging_stages == 0


def test_sm90_route_passes_the_kernel_its_layouts(monkeypatch):
    """implementation="sm90" on FP8 inputs calls the FP8 forward kernel with q, k and v as
    given (no transpose, no padding of the 100 keys) and the descales as (q·k, v) per (batch,
    kv head); its bfloat16 out is cast to out_dtype (the kernel is stubbed: this checks the
    route, not the kernel)."""
    from jax_fa4.ffi import call

    calls = []

    def stub(config, arch, *args, out_shapes):
        jax.debug.callback(lambda *a: calls.append((config, arch, a)), *args)
        return tuple(jnp.zeros(s.shape, s.dtype) for s in out_shapes)

    monkeypatch.setattr(call, "call_kernel", stub)
    q, k, v = _inputs(sk=100)
    (q8, qd), (k8, kd), (v8, vd) = fp8.quantize_grouped(q, 2), fp8.quantize(k), fp8.quantize(v)
    out = jax_fa4.flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                  causal=True, out_dtype=jnp.float16, implementation="sm90")
    assert out.dtype == jnp.float16 and out.shape == (2, 77, 4, 64)
    jax.effects_barrier()
    (config, arch, args), = calls
    assert config.fp8 and config.mask == "causal" and arch == "sm_90a"
    q_in, k_in, v_in, params, descale = args
    assert q_in.dtype == k_in.dtype == v_in.dtype == jnp.float8_e4m3fn
    assert v_in.shape == (2, 100, 2, 64)
    np.testing.assert_array_equal(np.asarray(v_in, np.float32), np.asarray(v8, np.float32))
    np.testing.assert_allclose(np.asarray(descale), np.stack([qd * kd, vd], -1), rtol=1e-7)


def test_blackwell_refuses_fp8_with_a_reason():
    q, k, v = (x.astype(jnp.float8_e4m3fn) for x in _inputs())
    with pytest.raises(jax_fa4.ImplementationUnavailableError,
                       match="cannot run this FP8 attention call: there is no sm100 FP8"):
        jax_fa4.flash_attention(q, k, v, implementation="sm100")


# -- an FP8 KV cache (flash_attention_paged) ---------------------------------------------------
def _paged(b=3, sq=5, h=4, hkv=2, d=64, page_size=16, max_pages=4, seed=1):
    """float32 q (B, Sq, H, D), an e4m3 cache (quantize_paged_cache) with shuffled pages, the
    page table (unused entries -1) and odd key counts (one empty sequence)."""
    num_pages = b * max_pages + 2
    q, k, v = normal(f"fp8 paged {seed}", [(b, sq, h, d), (num_pages, page_size, hkv, d),
                                           (num_pages, page_size, hkv, d)], jnp.float32)
    k8, v8, kd, vd = fp8.quantize_paged_cache(k * 3.0, v * 0.5)
    rng = np.random.default_rng(seed)
    table = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    used = np.array([37, 0, 61][:b], np.int32)
    table[1] = -1  # the empty sequence: no page read
    return q, k8, v8, kd, vd, jnp.asarray(table), jnp.asarray(used)


def _paged_dequantised(q, k8, v8, kd, vd, table, used, **kw):
    """(out, lse) of the float32 attention over the dequantised cache (16-bit route)."""
    num_pages, hkv = k8.shape[0], k8.shape[2]
    k = fp8.dequantize(k8, jnp.broadcast_to(kd, (num_pages, hkv)))
    v = fp8.dequantize(v8, jnp.broadcast_to(vd, (num_pages, hkv)))
    return jax_fa4.flash_attention_paged(q, k, v, table, used, return_lse=True, **kw)


def test_quantize_paged_cache_one_descale_per_kv_head():
    k = normal("cache", [(6, 16, 3, 32)], jnp.float32)[0] * jnp.array([1.0, 10.0, 0.1])[:, None]
    k8, v8, kd, vd = fp8.quantize_paged_cache(k, k[..., :16])
    assert k8.dtype == v8.dtype == jnp.float8_e4m3fn and k8.shape == k.shape
    assert kd.shape == vd.shape == (3,) and kd.dtype == jnp.float32
    # each kv head's largest magnitude over every page maps to 448
    np.testing.assert_allclose(np.abs(np.asarray(k8, np.float32)).max(axis=(0, 1, 3)), 448.0)
    np.testing.assert_allclose(np.asarray(kd), np.abs(np.asarray(k)).max(axis=(0, 1, 3)) / 448,
                               rtol=1e-6)
    back = np.asarray(fp8.dequantize(k8, jnp.broadcast_to(kd, (6, 3))))
    np.testing.assert_allclose(back, np.asarray(k), rtol=2.0 ** -4,
                               atol=1e-6 * float(np.abs(np.asarray(k)).max()))
    with pytest.raises(ValueError, match=r"k_cache must have rank 4 .* got shape \(6, 16, 3\)"):
        fp8.quantize_paged_cache(k[..., 0], k)


@pytest.mark.parametrize("causal, window, softcap", [(False, (None, None), 0.0),
                                                     (True, (None, None), 0.0),
                                                     (False, (9, 2), 5.0)])
def test_fp8_paged_reference_is_the_dequantised_attention(causal, window, softcap):
    """An e4m3 q with its (B, Hkv) descale over an e4m3 cache: the reference on the dequantised
    inputs (out bfloat16, lse float32; the empty sequence's rows 0 and -inf)."""
    q, k8, v8, kd, vd, table, used = _paged()
    q8, qd = fp8.quantize_grouped(q, 2)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse = jax_fa4.flash_attention_paged(q8, k8, v8, table, used, q_descale=qd,
                                             k_descale=kd, v_descale=vd, return_lse=True, **kw)
    assert out.dtype == jnp.bfloat16 and out.shape == (3, 5, 4, 64)
    want, want_lse = _paged_dequantised(fp8.dequantize(q8, qd), k8, v8, kd, vd, table, used,
                                        **kw)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), rtol=2.0 ** -8,
                               atol=1e-3)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(out[1], np.float32) == 0) and np.all(np.isneginf(lse[1]))


def test_fp8_paged_quantises_a_16_bit_q_itself():
    """A bfloat16 q over an e4m3 cache is what the call gives with q quantised by
    fp8.quantize_grouped (one scale per batch entry and kv head) and passed in e4m3; scalar
    cache descales broadcast; out is bfloat16 unless out_dtype says otherwise."""
    q, k8, v8, kd, vd, table, used = _paged()
    qb = q.astype(jnp.bfloat16)
    got = jax_fa4.flash_attention_paged(qb, k8, v8, table, used, k_descale=0.5, v_descale=2.0,
                                        out_dtype=jnp.float32)
    q8, qd = fp8.quantize_grouped(qb, 2)
    want = jax_fa4.flash_attention_paged(q8, k8, v8, table, used, q_descale=qd,
                                         k_descale=jnp.full((2,), 0.5), v_descale=2.0,
                                         out_dtype=jnp.float32)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    bf16 = jax_fa4.flash_attention_paged(qb, k8, v8, table, used, k_descale=0.5, v_descale=2.0)
    assert bf16.dtype == jnp.bfloat16


@pytest.mark.parametrize("change, error, match", [
    (dict(v_cache="bf16"), TypeError,
     "v_cache must have dtype float8_e4m3fn like the other cache tensor .* got bfloat16"),
    (dict(q="int32"), TypeError, "q must have dtype float8_e4m3fn, bfloat16, float16 or float32 "
                                 "with an FP8 KV cache, got int32"),
    (dict(k_descale=jnp.ones((3,))), ValueError,
     r"k_descale must be a scalar or have shape \(Hkv,\) = \(2,\), got \(3,\)"),
    (dict(v_descale=jnp.ones((3, 2))), ValueError,
     r"v_descale must be a scalar or have shape \(Hkv,\) = \(2,\), got \(3, 2\)"),
    (dict(q_descale=1.0), ValueError,
     "q_descale applies to a float8_e4m3fn q; q of dtype float32 is quantised by the call"),
    (dict(q="e4m3", q_descale=jnp.ones((2,))), ValueError,
     r"q_descale must be a scalar or have shape \(B, Hkv\) = \(3, 2\), got \(2,\)"),
    (dict(k_descale=jnp.ones((2,), jnp.int32)), TypeError, "k_descale must be floating"),
    (dict(learnable_sink=jnp.zeros(4)), NotImplementedError,
     r"FP8 \(float8_e4m3fn\) attention does not support learnable_sink"),
    (dict(out_dtype=jnp.int8), TypeError, "out_dtype must be bfloat16, float16 or float32"),
])
def test_fp8_paged_arguments_are_checked(change, error, match):
    q, k8, v8, kd, vd, table, used = _paged()
    args = dict(q=q, k_cache=k8, v_cache=v8)
    kw = {name: x for name, x in change.items() if name not in args}
    casts = {"bf16": jnp.bfloat16, "int32": jnp.int32, "e4m3": jnp.float8_e4m3fn}
    args.update({name: args[name].astype(casts[x]) for name, x in change.items() if name in args})
    with pytest.raises(error, match=match):
        jax_fa4.flash_attention_paged(args["q"], args["k_cache"], args["v_cache"], table, used,
                                      **kw)


def test_fp8_descales_need_an_fp8_cache():
    q, k8, v8, kd, vd, table, used = _paged()
    k, v = (x.astype(jnp.float32) for x in (k8, v8))
    with pytest.raises(ValueError, match=r"k_descale apply to FP8 calls only \(k_cache and "
                                         r"v_cache in float8_e4m3fn\); got k_cache of dtype "
                                         "float32"):
        jax_fa4.flash_attention_paged(q, k, v, table, used, k_descale=kd)


def test_fp8_paged_and_varlen_calls_have_no_gradient():
    q, k8, v8, kd, vd, table, used = _paged()
    _, pullback = jax.vjp(lambda q: jax_fa4.flash_attention_paged(q, k8, v8, table, used), q)
    with pytest.raises(NotImplementedError, match="forward only"):
        pullback(jnp.ones((3, 5, 4, 64), jnp.bfloat16))
    q8, k8, v8, cu_q, cu_k, _ = _varlen()
    _, pullback = jax.vjp(lambda x: jax_fa4.flash_attention_varlen(
        x.astype(fp8.FP8), k8, v8, cu_q, cu_k, 9, 13), q8.astype(jnp.float32))
    with pytest.raises(NotImplementedError, match="forward only"):
        pullback(jnp.ones(q8.shape, jnp.bfloat16))


# -- packed FP8 sequences (flash_attention_varlen) ---------------------------------------------
def _varlen(h=4, hkv=2, d=64, seed=2):
    """Packed e4m3 q, k, v of sequences with lengths (q, k) (5, 9), (0, 4), (1, 1), (9, 13)
    after 2 padding tokens, 3 more at the end (padding holds NaN), and their (4, Hkv) descales."""
    lens_q, lens_k = [5, 0, 1, 9], [9, 4, 1, 13]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]) + 2
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]) + 2
    tq, tk = int(cu_q[-1]) + 3, int(cu_k[-1]) + 3
    q, k, v = normal(f"fp8 varlen {seed}", [(tq, h, d), (tk, hkv, d), (tk, hkv, d)],
                     jnp.float32)
    q8, k8, v8 = (x.at[:2].set(jnp.nan).astype(fp8.FP8) for x in (q * 30, k * 100, v * 50))
    descales = [jnp.exp(jnp.asarray(normal(f"descale {i}", [(4, hkv)], jnp.float32)[0]) - 4)
                for i in range(3)]
    return q8, k8, v8, jnp.asarray(cu_q, jnp.int32), jnp.asarray(cu_k, jnp.int32), descales


@pytest.mark.parametrize("causal, window", [(False, (None, None)), (True, (None, None)),
                                            (False, (3, 1))])
def test_fp8_varlen_reference_is_the_dequantised_attention(causal, window):
    """Per-(sequence, kv head) descales: each sequence attends as a dense call on its own
    dequantised tokens (lengths 0, 1 and odd; padding out 0 and lse -inf)."""
    q8, k8, v8, cu_q, cu_k, (qd, kd, vd) = _varlen()
    out, lse = jax_fa4.flash_attention_varlen(q8, k8, v8, cu_q, cu_k, 9, 13, q_descale=qd,
                                              k_descale=kd, v_descale=vd, causal=causal,
                                              window_size=window, return_lse=True)
    assert out.dtype == jnp.bfloat16 and out.shape == q8.shape and lse.shape == (4, q8.shape[0])
    for s in range(4):
        (q0, q1), (k0, k1) = (int(x) for x in cu_q[s: s + 2]), (int(x) for x in cu_k[s: s + 2])
        if q1 == q0:
            continue
        one = [fp8.dequantize(x[None, a:b], d[s: s + 1])
               for x, d, a, b in ((q8, qd, q0, q1), (k8, kd, k0, k1), (v8, vd, k0, k1))]
        want, want_lse = jax_fa4.flash_attention(*one, causal=causal, window_size=window,
                                                 return_lse=True)
        np.testing.assert_allclose(np.asarray(out[q0:q1], np.float32), np.asarray(want[0]),
                                   rtol=2.0 ** -8, atol=1e-3, err_msg=f"sequence {s}")
        np.testing.assert_allclose(np.asarray(lse[:, q0:q1]), np.asarray(want_lse[0]),
                                   rtol=1e-5, atol=1e-5)
    padding = np.r_[0:2, int(cu_q[-1]):q8.shape[0]]
    assert np.all(np.asarray(out, np.float32)[padding] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[:, padding]))


def test_fp8_varlen_descales_are_checked():
    q8, k8, v8, cu_q, cu_k, (qd, kd, vd) = _varlen()
    with pytest.raises(ValueError, match=r"k_descale must be a scalar or have shape "
                                         r"\(num_sequences, Hkv\) = \(4, 2\), got \(2, 4\)"):
        jax_fa4.flash_attention_varlen(q8, k8, v8, cu_q, cu_k, 9, 13, k_descale=kd.T)
    with pytest.raises(TypeError, match="k must have q's dtype float8_e4m3fn, got float32"):
        jax_fa4.flash_attention_varlen(q8, k8.astype(jnp.float32), v8, cu_q, cu_k, 9, 13)
    scalar = jax_fa4.flash_attention_varlen(q8, k8, v8, cu_q, cu_k, 9, 13, q_descale=0.01,
                                            v_descale=0.02)
    full = jax_fa4.flash_attention_varlen(q8, k8, v8, cu_q, cu_k, 9, 13,
                                          q_descale=jnp.full((4, 2), 0.01),
                                          v_descale=jnp.full((4, 2), 0.02))
    np.testing.assert_array_equal(np.asarray(scalar, np.float32), np.asarray(full, np.float32))


def _stub_kernel(monkeypatch) -> list:
    """call_kernel replaced by zeros of its out shapes; the calls' (config, arch, inputs)."""
    from jax_fa4.ffi import call

    calls = []

    def stub(config, arch, *args, out_shapes):
        jax.debug.callback(lambda *a: calls.append((config, arch, a)), *args)
        return tuple(jnp.zeros(s.shape, s.dtype) for s in out_shapes)

    monkeypatch.setattr(call, "call_kernel", stub)
    return calls


def test_sm90_fp8_paged_route_passes_the_kernel_its_operands(monkeypatch):
    """implementation="sm90" over an e4m3 cache with a bfloat16 q: the FP8 paged kernel gets q
    quantised, the cache as one batch entry of its 128-key blocks (a 256-key page: two blocks;
    32-key pages are refused), seqused_k as it is and the (B, Hkv, 2) descale of (q·k, v) with
    the cache's per-kv-head values in every batch row (the kernel is stubbed: this checks the
    route, not the kernel)."""
    calls = _stub_kernel(monkeypatch)
    q, k8, v8, kd, vd, table, used = _paged(page_size=256)
    out = jax_fa4.flash_attention_paged(q.astype(jnp.bfloat16), k8, v8, table, used,
                                        k_descale=kd, v_descale=vd, causal=True,
                                        implementation="sm90")
    assert out.dtype == jnp.bfloat16 and out.shape == (3, 5, 4, 64)
    jax.effects_barrier()
    (config, arch, args), = calls
    assert config.fp8 and config.paged and config.mask == "causal" and arch == "sm_90a"
    assert config.tile_n == 128 and config.qo_head_major and not config.out_f32
    q_in, k_in, v_in, params, table_in, used_in, descale = args
    q8, qd = fp8.quantize_grouped(q.astype(jnp.bfloat16), 2)
    # five causal queries: neither packed nor split, q head-major (B, H, Sq, D)
    np.testing.assert_array_equal(np.asarray(q_in, np.float32),
                                  np.asarray(q8, np.float32).transpose(0, 2, 1, 3))
    assert k_in.shape == (1, 14 * 256, 2, 64) and k_in.dtype == jnp.float8_e4m3fn
    t = np.asarray(table)
    np.testing.assert_array_equal(table_in, np.stack([2 * t, 2 * t + 1], -1).reshape(3, 8))
    np.testing.assert_array_equal(used_in, used)
    want = np.stack([np.asarray(qd) * np.asarray(kd), np.broadcast_to(vd, (3, 2))], -1)
    np.testing.assert_allclose(np.asarray(descale), want, rtol=1e-7)
    with pytest.raises(jax_fa4.ImplementationUnavailableError,
                       match="page_size 32 is not a multiple of the FP8 paged kernel's key "
                             "block 128"):
        q, k8, v8, kd, vd, table, used = _paged(page_size=32)
        jax_fa4.flash_attention_paged(q, k8, v8, table, jnp.minimum(used, 32),
                                      implementation="sm90")


def _emulated_fp8_kernel(configs: list):
    """A stand-in for call_kernel that computes what the sm90 FP8 forward does, on the CPU
    (dense and paged, q and out head-major or not, out float32 or bfloat16): the 16-bit
    kernel's contract (tests/test_paged.py's emulation for paged, the float32 reference for
    dense) on the e4m3 values, q·k's descale folded into q and v's applied to the output per
    (batch entry, kv head) of the descale operand (the last input). Appends each config."""
    from test_paged import emulated_paged_kernel

    def kernel(config, arch, q, k, v, params, *rest, out_shapes):
        *rest, descale = rest
        assert config.fp8 and arch == "sm_90a" and descale.shape[0] == q.shape[0]
        configs.append(config)
        head_major = config.qo_head_major
        ratio = (q.shape[1] if head_major else q.shape[2]) // k.shape[2]
        qk, vd = (jnp.repeat(descale[..., i], ratio, axis=1) for i in (0, 1))  # (B, H)

        def per_head(x):  # (B, H) over q's / out's layout
            return x[:, :, None, None] if head_major else x[:, None, :, None]

        qf = q.astype(jnp.float32) * per_head(qk)
        kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
        f32 = (jax.ShapeDtypeStruct(out_shapes[0].shape, jnp.float32), out_shapes[1])
        if config.paged:
            out, lse = emulated_paged_kernel(config, arch, qf, kf, vf, params, *rest,
                                             out_shapes=f32)
        else:
            scale, softcap, left, right = (float(x) for x in params[:4])
            out, lse = reference.attention(
                qf.transpose(0, 2, 1, 3) if head_major else qf, kf, vf, softmax_scale=scale,
                window=(None if left < 0 else int(left), None if right < 0 else int(right)),
                softcap=softcap)
            out = out.transpose(0, 2, 1, 3) if head_major else out
        assert (out.shape, lse.shape) == tuple(x.shape for x in out_shapes)
        return (out * per_head(vd)).astype(out_shapes[0].dtype), lse

    return kernel


def _sm90_opts(d, causal):
    opts = options.options(d, softmax_scale=None, causal=causal, window_size=(None, None),
                           softcap=0.0, implementation=None)
    return dataclasses.replace(opts, implementation="sm90")


@pytest.mark.parametrize("sq,h,hkv,d,page_size,max_pages,seqused,causal,splits", [
    # a decode step: 4 query heads packed per kv head, 256-key pages (two 128-key blocks each)
    # split into 4 chunks merged in float32, an empty sequence and one of a single key
    (1, 8, 2, 64, 256, 16, (3000, 1, 0), True, 4),
    # an MHA decode step at head dim 128: nothing to pack, too few keys to split
    (1, 4, 4, 128, 128, 4, (300, 129, 5), False, 1),
    # a causal chunk of 3 queries: head-major q and out, neither packed nor split
    (3, 4, 2, 64, 128, 3, (2, 300, 129), True, 1),
])
def test_sm90_fp8_paged_decode_with_an_emulated_kernel(monkeypatch, sq, h, hkv, d, page_size,
                                                       max_pages, seqused, causal, splits):
    """The FP8 paged route's decode rewrite (GQA packing, split-KV with float32 chunks, the
    descales repeated for each chunk, per-chunk seqused_k, the lse merge) against each
    sequence's float32 attention over the dequantised q and cache."""
    from jax_fa4.ffi import call
    from test_paged import _cache, dense_per_sequence

    configs = []
    monkeypatch.setattr(call, "call_kernel", _emulated_fp8_kernel(configs))
    b = len(seqused)
    q, k, v, table, used = _cache(b, sq, h, hkv, d, d, page_size, num_pages=b * max_pages + 2,
                                  max_pages=max_pages, seqused=seqused, seed=5)
    k8, v8, kd, vd = fp8.quantize_paged_cache(k * 3.0, v * 0.5)
    q8, qd = fp8.quantize_grouped(q, hkv)
    opts = _sm90_opts(d, causal)
    sm90 = backends.get("sm90")
    plan = sm90.fp8_paged_plan(q8, k8, v8, jnp.asarray(table), opts)
    assert not isinstance(plan, str), plan
    out, lse = sm90.fp8_paged_forward(q8, k8, v8, jnp.asarray(table), jnp.asarray(used), qd,
                                      kd, vd, opts, plan)
    config, = configs
    assert config.paged and config.qo_head_major and config.out_f32 == (splits > 1)
    assert config.mask == ("causal" if causal and sq > 1 else "none")
    assert out.dtype == jnp.bfloat16 and out.shape == (b, sq, h, d)
    num_pages = k8.shape[0]
    k_deq, v_deq = (fp8.dequantize(x, jnp.broadcast_to(s, (num_pages, hkv)))
                    for x, s in ((k8, kd), (v8, vd)))
    want_out, want_lse = dense_per_sequence(fp8.dequantize(q8, qd), k_deq, v_deq, table, used,
                                            window=(None, 0) if causal else (None, None))
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out, np.float32), want_out, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("b,h,hkv,sk,causal,splits,f32", [
    # GQA 4:1, 4096 keys: packed and split into 4 chunks (float32 partials)
    (2, 8, 2, 4096, True, 4, True),
    # MQA, 700 keys: 8 heads packed into one tile's rows, no split (a bfloat16 out)
    (3, 8, 1, 700, False, 1, False),
])
def test_sm90_fp8_decode_with_an_emulated_kernel(monkeypatch, b, h, hkv, sk, causal, splits,
                                                 f32):
    """A dense FP8 decode step (one query token) runs the FP8 decode tile on GQA-packed,
    split-KV inputs, each chunk with its batch entry's descales, against the float32 attention
    over the dequantised inputs."""
    from jax_fa4.backends import decode
    from jax_fa4.ffi import call

    configs = []
    monkeypatch.setattr(call, "call_kernel", _emulated_fp8_kernel(configs))
    q, k, v = _inputs(b=b, sq=1, sk=sk, h=h, hkv=hkv, seed=3)
    (q8, qd), (k8, kd), (v8, vd) = fp8.quantize_grouped(q, hkv), fp8.quantize(k), fp8.quantize(v)
    opts = _sm90_opts(q.shape[3], causal)
    rewrite = decode.plan(q.shape, k.shape, opts.window)
    assert (rewrite.group, rewrite.splits) == (h // hkv, splits)
    sm90 = backends.get("sm90")
    out, lse = sm90.fp8_forward(q8, k8, v8, qd, kd, vd, opts, sm90.fp8_plan(q8, k8, v8, opts))
    config, = configs
    assert config.qo_head_major and config.mask == "none" and config.out_f32 == f32
    assert config.tile_m == fwd_config.DECODE_TILE_M and not config.paged
    assert out.dtype == jnp.bfloat16 and out.shape == (b, 1, h, q.shape[3])
    want_out, want_lse = reference.attention(
        fp8.dequantize(q8, qd), fp8.dequantize(k8, kd), fp8.dequantize(v8, vd),
        window=(None, 0) if causal else (None, None))
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out),
                               atol=2e-2, rtol=2e-2)


def _lowered_decode_step(shipped_cache, monkeypatch, fn, *args) -> str:
    """The StableHLO of ``fn`` jitted and exported for CUDA (132 SMs assumed), its kernels from
    the test cache."""
    from jax_fa4.backends import decode
    from jax_fa4.ffi import call

    monkeypatch.setenv("JAX_FA4_CACHE_DIR", str(shipped_cache.root))
    monkeypatch.setattr(decode, "num_sms", lambda: 132)
    call.clear_memory_cache()
    try:
        return jax.export.export(jax.jit(fn), platforms=["cuda"],
                                 disabled_checks=jax_fa4.export_disabled_safety_checks())(
            *args).mlir_module()
    finally:
        call.clear_memory_cache()


@pytest.mark.parametrize("config", tiered([fwd_config.fp8_paged_config(128)], "sm_90a"),
                         ids=["fp8-paged-128"])
def test_an_fp8_paged_decode_step_reaches_the_kernel_without_copies(config, shipped_cache,
                                                                     monkeypatch):
    """One query token on an e4m3 cache, enough tiles not to split (B·Hkv = 512 on 132 SMs):
    the 4 query heads of a kv head are packed into one tile's rows by a free reshape of q
    (B, Hkv, g, D) and the head-major FP8 paged tile runs: one custom call, no transpose."""
    e4m3 = jnp.float8_e4m3fn
    b, h, hkv, d, pages = 64, 32, 8, 128, 64
    args = (jax.ShapeDtypeStruct((b, 1, h, d), e4m3),
            jax.ShapeDtypeStruct((b * pages, 128, hkv, d), e4m3),
            jax.ShapeDtypeStruct((b * pages, 128, hkv, d), e4m3),
            jax.ShapeDtypeStruct((b, pages), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32),
            jax.ShapeDtypeStruct((b, hkv), jnp.float32), jax.ShapeDtypeStruct((hkv,), jnp.float32),
            jax.ShapeDtypeStruct((hkv,), jnp.float32))
    text = _lowered_decode_step(
        shipped_cache, monkeypatch,
        lambda q, kc, vc, t, u, qd, kd, vd: jax_fa4.flash_attention_paged(
            q, kc, vc, t, u, q_descale=qd, k_descale=kd, v_descale=vd, causal=True,
            implementation="sm90"), *args)
    assert text.count("stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2") == 1
    assert f"tensor<{b}x{hkv}x{h // hkv}x{d}xf8E4M3FN>" in text  # q's free reshape
    assert "stablehlo.transpose" not in text


@pytest.mark.parametrize("config", tiered([fwd_config.fp8_decode_config(128)], "sm_90a"),
                         ids=["fp8-decode-128"])
def test_an_fp8_decode_step_reaches_the_kernel_without_copies(config, shipped_cache,
                                                              monkeypatch):
    """The dense twin: e4m3 q, k, v with one query token run the FP8 decode tile on q's free
    reshape, one custom call, no transpose."""
    e4m3 = jnp.float8_e4m3fn
    b, h, hkv, d, sk = 64, 32, 8, 128, 8192
    args = (jax.ShapeDtypeStruct((b, 1, h, d), e4m3),
            *(jax.ShapeDtypeStruct((b, sk, hkv, d), e4m3) for _ in range(2)),
            *(jax.ShapeDtypeStruct((b, hkv), jnp.float32) for _ in range(3)))
    text = _lowered_decode_step(
        shipped_cache, monkeypatch,
        lambda q, k, v, qd, kd, vd: jax_fa4.flash_attention(
            q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, implementation="sm90"), *args)
    assert text.count("stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2") == 1
    assert f"tensor<{b}x{hkv}x{h // hkv}x{d}xf8E4M3FN>" in text
    assert "stablehlo.transpose" not in text


def test_sm90_fp8_varlen_route_passes_the_kernel_its_operands(monkeypatch):
    """implementation="sm90" on packed e4m3 q, k, v: the FP8 varlen kernel gets them as one
    batch entry, cu_seqlens, and the (num_sequences, Hkv, 2) descale of (q·k, v); lse comes
    back as (batch, H, max_seqlen_q) and is gathered to the packed layout (stubbed)."""
    calls = _stub_kernel(monkeypatch)
    q8, k8, v8, cu_q, cu_k, (qd, kd, vd) = _varlen()
    out, lse = jax_fa4.flash_attention_varlen(q8, k8, v8, cu_q, cu_k, 9, 13, q_descale=qd,
                                              k_descale=kd, v_descale=vd, return_lse=True,
                                              implementation="sm90")
    assert out.dtype == jnp.bfloat16 and out.shape == q8.shape
    jax.effects_barrier()
    (config, arch, args), = calls
    assert config.fp8 and config.varlen and arch == "sm_90a"
    q_in, k_in, v_in, params, cu_q_in, cu_k_in, descale = args
    assert q_in.shape == (1, *q8.shape) and q_in.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(cu_q_in, cu_q)
    np.testing.assert_allclose(np.asarray(descale), np.stack([qd * kd, vd], -1), rtol=1e-7)
    assert np.all(np.isneginf(np.asarray(lse)[:, :2]))  # padding tokens
