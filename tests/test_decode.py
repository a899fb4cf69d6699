"""GQA packing and split-KV around the forward kernel (jax_fa4/backends/decode.py), on the CPU.

The rewrite is checked with the reference forward standing in for the kernel: packing rows,
splitting keys and merging the chunks by their lse must give the unrewritten attention, and the
plan must refuse every call where a mask ties keys to query positions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import backends
from jax_fa4.backends import base, decode, sm90
from jax_fa4.options import AttentionOptions

NONE, CAUSAL = (None, None), (None, 0)


@pytest.mark.parametrize("q_shape,k_shape,window,expected", [
    # the decode anchor: 512 packed tiles fill 132 SMs: pack only
    ((64, 1, 32, 128), (64, 8192, 8, 128), NONE, decode.DecodePlan(4, 1, NONE)),
    # causal with one query = unmasked
    ((64, 1, 32, 128), (64, 8192, 8, 128), CAUSAL, decode.DecodePlan(4, 1, NONE)),
    # few tiles, long keys: pack and split until a tile per SM (8 × 8 × 4 = 256 >= 132)
    ((8, 1, 32, 128), (8, 32768, 8, 128), NONE, decode.DecodePlan(4, 4, NONE)),
    # MHA: split only (2 × 16 × 8 = 256)
    ((2, 4, 16, 64), (2, 16384, 16, 64), NONE, decode.DecodePlan(1, 8, NONE)),
    # chunks never shorter than MIN_CHUNK keys, and they divide Sk
    ((1, 1, 8, 128), (1, 2048, 1, 128), NONE, decode.DecodePlan(8, 2, NONE)),
    ((1, 1, 8, 128), (1, 2047, 1, 128), NONE, decode.DecodePlan(8, 1, NONE)),
])
def test_plan(q_shape, k_shape, window, expected):
    assert decode.plan(q_shape, k_shape, window, sms=132) == expected


@pytest.mark.parametrize("q_shape,k_shape,window", [
    ((64, 2, 32, 128), (64, 8192, 8, 128), CAUSAL),  # two queries at different positions
    ((64, 1, 32, 128), (64, 8192, 8, 128), (16, 0)),  # a window
    ((4, 8192, 32, 128), (4, 8192, 8, 128), NONE),  # training shape: nothing to gain
    ((1, 128, 16, 128), (1, 128, 16, 128), NONE),  # MHA, short keys: nothing to gain
])
def test_plan_refuses(q_shape, k_shape, window):
    assert decode.plan(q_shape, k_shape, window, sms=132) is None


def _opts(window):
    return AttentionOptions(softmax_scale=0.125, window=window, softcap=0.0,
                            implementation="reference", forced=False)


@pytest.mark.parametrize("b,sq,h,hkv,sk,window,plan", [
    (2, 1, 8, 2, 4096, CAUSAL, decode.DecodePlan(4, 1, NONE)),
    (2, 3, 8, 2, 4096, NONE, decode.DecodePlan(4, 4, NONE)),
    (1, 5, 6, 6, 3072, NONE, decode.DecodePlan(1, 3, NONE)),
    (3, 1, 4, 1, 2000, CAUSAL, decode.DecodePlan(4, 2, NONE)),
])
def test_rewrite_is_exact(b, sq, h, hkv, sk, window, plan):
    """Packed, split, merged = the plain attention (float32, reference as the kernel)."""
    rng = np.random.default_rng(7)  # (NumPy: no XLA program per shape)
    q, k, v = (jnp.asarray(rng.standard_normal(shape, np.float32)) for shape in
               ((b, sq, h, 64), (b, sk, hkv, 64), (b, sk, hkv, 32)))
    v = v * 3
    opts = _opts(window)
    calls = []

    def kernel(q_, k_, v_, o_):  # q and out head-major
        calls.append((q_.shape, k_.shape, o_.window))
        out_, lse_ = base.reference_forward(q_.transpose(0, 2, 1, 3), k_, v_, o_)
        return out_.transpose(0, 2, 1, 3), lse_

    # one program (traced once: one kernel call), not an XLA program per eager operation
    out, lse = jax.jit(lambda q, k, v: decode.run(q, k, v, opts, plan, kernel))(q, k, v)
    ref_out, ref_lse = base.reference_forward(q, k, v, opts)
    assert calls == [((b * plan.splits, h // plan.group, sq * plan.group, 64),
                      (b * plan.splits, sk // plan.splits, hkv, 64), NONE)]
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    np.testing.assert_allclose(out, ref_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("decode_tile", [False, True])
def test_decode_call_lowers_to_one_packed_split_kernel(shipped_cache, monkeypatch, decode_tile):
    """flash_attention on a decode shape (sm90) runs one forward kernel on (B·S, g·Sq, Hkv, D)
    inputs, and its gradient program still lowers (the backward sees the original layout). A
    split call's chunks come back in float32 (the decode tile's out_f32 config), so the 64-row
    decode tile serves it even where the training tile is chosen (JAX_FA4_DECODE_TILE=0)."""
    from jax_fa4.ffi import call

    monkeypatch.setenv("JAX_FA4_CACHE_DIR", str(shipped_cache.root))
    monkeypatch.setattr(decode, "num_sms", lambda: 132)
    monkeypatch.setenv("JAX_FA4_DECODE_TILE", "1" if decode_tile else "0")
    configs = []
    call_kernel = call.call_kernel

    def recording(config, *args, **kwargs):
        configs.append(config)
        return call_kernel(config, *args, **kwargs)

    monkeypatch.setattr(call, "call_kernel", recording)
    call.clear_memory_cache()
    b, h, hkv, sk, d = 8, 32, 8, 32768, 128
    q = jax.ShapeDtypeStruct((b, 1, h, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, sk, hkv, d), jnp.bfloat16)
    f = jax.jit(lambda q, k, v: jax_fa4.flash_attention(q, k, v, causal=True,
                                                        implementation="sm90"))
    text = jax.export.export(f, platforms=["cuda"],
                             disabled_checks=jax_fa4.export_disabled_safety_checks())(
        q, kv, kv).mlir_module()
    calls = [line for line in text.splitlines()
             if "stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2" in line]
    assert len(calls) == 1
    # 64 tiles on 132 SMs: 4 splits. q: 4 splits × 8 batch entries, 8 kv heads, 4 packed heads
    # as rows: head-major for the decode tile, (B, S, H, D) for the training tile
    q_type = "tensor<32x8x4x128xbf16>"
    # k / v: 4 chunks of 8192 keys per batch entry; out float32
    assert f"({q_type}, tensor<32x8192x8x128xbf16>, tensor<32x8192x8x128xbf16>" in calls[0]
    assert "-> (tensor<32x8x4x128xf32>" in calls[0], calls[0]
    assert [(c.tile_m, c.qo_head_major, c.out_f32) for c in configs] == [(64, True, True)]
    loss = lambda q, k, v: f(q, k, v).astype(jnp.float32).sum()  # noqa: E731
    grad = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"],
                             disabled_checks=jax_fa4.export_disabled_safety_checks())(q, kv, kv)
    # forward + preprocess + backward + dQ postprocess, the backward on the original layout
    assert grad.mlir_module().count("stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2") == 4
    assert [a.shape for a in grad.out_avals] == [q.shape, kv.shape, kv.shape]
    call.clear_memory_cache()


def test_a_decode_step_reaches_the_kernel_without_copies(shipped_cache, monkeypatch):
    """One query token, enough tiles not to split (B·Hkv = 512 on 132 SMs): q and out are
    reshaped, never transposed, around the head-major decode tile."""
    from jax_fa4.ffi import call

    monkeypatch.setenv("JAX_FA4_CACHE_DIR", str(shipped_cache.root))
    monkeypatch.setattr(decode, "num_sms", lambda: 132)
    monkeypatch.delenv("JAX_FA4_DECODE_TILE", raising=False)
    call.clear_memory_cache()
    q = jax.ShapeDtypeStruct((64, 1, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((64, 8192, 8, 128), jnp.bfloat16)
    text = jax.export.export(
        jax.jit(lambda q, k, v: jax_fa4.flash_attention(q, k, v, implementation="sm90")),
        platforms=["cuda"], disabled_checks=jax_fa4.export_disabled_safety_checks())(
        q, kv, kv).mlir_module()
    assert text.count("stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2") == 1
    assert "tensor<64x8x4x128xbf16>" in text  # (B, Hkv, g, D): q's free reshape
    assert "stablehlo.transpose" not in text
    call.clear_memory_cache()


def test_options_pass_through_with_the_plans_window():
    opts = dataclasses.replace(_opts(CAUSAL), softcap=30.0)
    seen = []
    q = jnp.ones((1, 1, 4, 16), jnp.float32)
    k = v = jnp.ones((1, 1024, 1, 16), jnp.float32)
    def kernel(q_, k_, v_, o_):
        seen.append(o_)
        out_, lse_ = base.reference_forward(q_.transpose(0, 2, 1, 3), k_, v_, o_)
        return out_.transpose(0, 2, 1, 3), lse_

    decode.run(q, k, v, opts, decode.DecodePlan(4, 1, NONE), kernel)
    assert seen[0].softcap == 30.0 and seen[0].window == NONE and seen[0].softmax_scale == 0.125


def test_decode_configs_are_shipped_one_warpgroup_tiles():
    from jax_fa4.kernels.sm90.fwd_config import (TUNING_TABLE, FwdConfig, decode_config,
                                                 shipped_configs)

    shipped = set(shipped_configs())
    for (d, dv) in TUNING_TABLE:
        for dtype in ("bfloat16", "float16"):
            cfg = decode_config(dtype, d, dv)
            assert cfg in shipped and cfg.tile_m == 64 and cfg.num_threads == 256
            assert cfg.mask == "none" and not cfg.pingpong and cfg.num_sms == 0
            assert cfg.qo_head_major
            # two CTAs per SM with two 64-key stages, one at 192/192 (shared memory); one CTA
            # with the table's key block at 256 (registers)
            want = {(192, 192): (2, 64, 1), (256, 256): (1, 80, 2)}.get((d, dv), (2, 64, 2))
            assert (cfg.ctas_per_sm, cfg.tile_n, cfg.stages) == want
    with pytest.raises(ValueError, match="pingpong"):
        FwdConfig.make("bfloat16", 128, tile_m=64, pingpong=True)


def test_decode_tile_option_from_the_environment(monkeypatch):
    """JAX_FA4_DECODE_TILE: 0 the training tile, 1 / unset the shipped decode tile, a
    DECODE_OPTIONS name that option (for dense and paged calls); anything else is refused."""
    from jax_fa4.kernels.sm90.fwd_config import DECODE_OPTIONS, decode_config

    monkeypatch.delenv("JAX_FA4_DECODE_TILE", raising=False)
    assert sm90.decode_tile_option() == {}
    for value, want in (("0", None), ("1", {}), *DECODE_OPTIONS.items()):
        monkeypatch.setenv("JAX_FA4_DECODE_TILE", value)
        assert sm90.decode_tile_option() == want
    name, option = next(iter(DECODE_OPTIONS.items()))
    monkeypatch.setenv("JAX_FA4_DECODE_TILE", name)
    q = jnp.zeros((2, 1, 8, 128), jnp.bfloat16)
    cache = jnp.zeros((4, 128, 2, 128), jnp.bfloat16)
    cfg = backends.get("sm90").paged_plan(q, cache, cache, jnp.zeros((2, 1), jnp.int32),
                                          dataclasses.replace(_opts(NONE), implementation="sm90"))
    assert cfg.paged and all(getattr(cfg, f) == v for f, v in option.items())
    assert decode_config("bfloat16", 128, 128, **option).ctas_per_sm == option["ctas_per_sm"]
    monkeypatch.setenv("JAX_FA4_DECODE_TILE", "fast")
    with pytest.raises(ValueError, match="JAX_FA4_DECODE_TILE must be 0, 1 or one of"):
        sm90.decode_tile_option()


def test_two_ctas_per_sm_limits():
    """ctas_per_sm=2 needs one consumer warpgroup and half an SM's shared memory; its consumers
    get 232 registers (2 CTAs × (128·232 + 128·24) = 64K)."""
    from jax_fa4.kernels.sm90.fwd_config import DECODE_OPTIONS, FwdConfig, decode_config

    two_cta = [decode_config("bfloat16", 128, 128)] + [
        decode_config("bfloat16", 128, 128, **o) for o in DECODE_OPTIONS.values()
        if o["ctas_per_sm"] == 2]
    assert len(two_cta) == 2
    for cfg in two_cta:
        assert cfg.register_split() == (232, 24) and cfg.num_threads == 256
        assert 2 * (cfg.smem_bytes() + 2048) <= 228 * 1024
    assert decode_config("bfloat16", 128, 128, **DECODE_OPTIONS["1cta"]).register_split() == (
        240, 24)
    with pytest.raises(ValueError, match="one consumer warpgroup"):
        FwdConfig.make("bfloat16", 128, ctas_per_sm=2)
    with pytest.raises(ValueError, match="shared memory"):
        decode_config("bfloat16", 128, 128, ctas_per_sm=2)  # two 128-key stages: too big
    with pytest.raises(ValueError, match="128-register entry cap"):
        decode_config("bfloat16", 256, 256, ctas_per_sm=2, tile_n=64, stages=1)
    with pytest.raises(ValueError, match="ctas_per_sm"):
        decode_config("bfloat16", 128, 128, ctas_per_sm=3)
