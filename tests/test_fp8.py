"""FP8 (e4m3) attention on the CPU: the API's checks, the quantisation helpers, the reference
route, the missing gradient, and the FP8 kernel's value layout (its key permutation) against a
model of the WGMMA register fragments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from conformance import normal
from jax_fa4 import fp8
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
    with pytest.raises(TypeError, match="float8_e4m3fn"):  # other entry points: 16-bit only
        jax_fa4.flash_attention_varlen(q[0], k[0], v[0], jnp.array([0, 77]), jnp.array([0, 131]),
                                       77, 131)


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
    with pytest.raises(ValueError, match="float8_e4m3fn is implemented for dense calls only"):
        fwd_config.FwdConfig.make("float8_e4m3fn", 128, 128, "none", False, varlen=True)
    with pytest.raises(ValueError, match="head_dim/head_dim_v 96/96 not supported"):
        fwd_config.fp8_config(96)
    shipped = [c for c in fwd_config.shipped_configs() if c.fp8]
    assert len(shipped) == 18  # head dims 64, 128, 256 x 3 mask kinds x softcap
    # the exact row max keeps each row's largest P exactly 1 in e4m3 (docs/fp8.md)
    assert all(c.rescale_threshold == 0 for c in shipped)
    with pytest.raises(ValueError, match="float8_e4m3fn needs rescale_threshold 0"):
        fwd_config.FwdConfig.make("float8_e4m3fn", 256, 256, "none", rescale_threshold=8.0)
    with pytest.raises(ValueError, match="float8_e4m3fn needs intra_wg_overlap"):
        fwd_config.FwdConfig.make("float8_e4m3fn", 128, 128, "none", intra_wg_overlap=False)


def test_fp8_configs_stage_v_for_the_transpose():
    """Every shipped FP8 config stages V as loaded in two stages where they fit (one at head dim
    256, whose K and V stages and O tile leave room for one), within the shared memory; 16-bit
    configs stage nothing."""
    for cfg in (c for c in fwd_config.shipped_configs() if c.fp8):
        assert cfg.v_staging_stages == (1 if cfg.head_dim_v == 256 else 2), cfg.describe()
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
