"""The sm100 backward kernel behind jax.grad (CPU only: lowered and exported for CUDA, or run
with the kernels emulated by tests/sm100_emulation.py; no Blackwell GPU has run it).

``implementation="sm100"`` (forced, or enabled by ``JAX_FA4_ENABLE_SM100``) runs the sm100
backward kernel for the calls its config accepts (varlen calls: the varlen mode of the 1-CTA
kernel, or of the 2-CTA kernel at 192/128; segment-id calls: the 1-CTA kernel's segment-id
mode, or the 2-CTA kernel's at 192/128), and the reference backward with a one-time warning
for the others; the sm90 route is unchanged.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import per_class
from conformance import normal
from extreme_cases import oracle, window_visible
from sm100_emulation import emulated_call_kernel

import jax_fa4
from jax_fa4 import backends, options
from jax_fa4.backends import base
from jax_fa4.backends.sm100 import ENABLE_ENV
from jax_fa4.ffi import call

CUSTOM_CALL = "stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2"


def _qkv(b=2, sq=77, sk=77, h=4, hkv=4, d=128, dv=None, dtype=jnp.bfloat16, seed=1):
    """q (b, sq, h, d), k (b, sk, hkv, d), v (b, sk, hkv, dv or d): standard normal, drawn by
    NumPy (jax.random would compile a program per shape, and nearly every case has its own)."""
    return normal(f"qkv {seed}", [(b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, dv or d)], dtype)


def _cotangent(seed: int, *shape: int) -> jax.Array:
    """A float32 standard normal cotangent of ``shape`` (drawn as :func:`_qkv` draws)."""
    return normal(f"cotangent {seed}", [shape], jnp.float32)[0]


def _grad_fn(implementation, **kwargs):
    def loss(q, k, v):
        out = jax_fa4.flash_attention(q, k, v, implementation=implementation, **kwargs)
        return jnp.sum(out.astype(jnp.float32) ** 2)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _assert_grads_close(got, want) -> None:
    """Gradients (of q, k, v[, sink]) of the emulated sm100 route against the reference's:
    same dtypes and shapes, finite, within 2e-2 of each one's largest entry."""
    for name, g, w in zip(["q", "k", "v", "sink"], got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.isfinite(g).all(), name
        np.testing.assert_allclose(g, w, atol=2e-2 * np.abs(w).max(), rtol=0, err_msg=name)


def _oracle_grads(inputs, kwargs: dict, ct, visible=None) -> list:
    """The reference's gradients of ``sum(out · ct)`` with respect to q, k, v (and the sink,
    when ``inputs`` has one), in the inputs' dtypes: the float64 oracle of
    tests/extreme_cases.py (which the reference is checked against there and in
    tests/test_reference.py), NumPy: no XLA program per case. ``kwargs``: the call's window,
    softcap and scale options; ``visible`` (B, Sq, Sk): the segment ids' mask, joined with the
    window's."""
    q, k, v, sink = (inputs + (None,))[:4]
    b, sq, sk, d = q.shape[0], q.shape[1], k.shape[1], q.shape[3]
    window = (None, 0) if kwargs.get("causal") else kwargs.get("window_size", (None, None))
    mask = np.broadcast_to(window_visible(sq, sk, window), (b, sq, sk))
    if visible is not None:
        mask = mask & visible
    scale = kwargs.get("softmax_scale", 1 / math.sqrt(d))
    _, _, grads = oracle(*(np.asarray(x, np.float32) for x in (q, k, v)), mask, scale,
                         kwargs.get("softcap", 0.0), None if sink is None else np.asarray(sink),
                         dout=np.asarray(ct, np.float32))
    return [np.asarray(g).astype(x.dtype) for g, x in zip(grads, (q, k, v, sink))
            if x is not None]


def _export_for_cuda(f, *args):
    return jax.export.export(f, platforms=["cuda"],
                             disabled_checks=jax_fa4.export_disabled_safety_checks())(*args)


@pytest.fixture
def lowered(monkeypatch):
    """Records the (kernel config, arch) of every kernel a program lowers to, with placeholder
    objects instead of compiled ones (what is checked is the dispatch, not the code)."""
    seen = []

    def kernel_object(config, arch, cache=None):
        seen.append((config, arch))
        return b"placeholder " + config.kernel_name.encode()

    monkeypatch.setattr(call, "kernel_object", kernel_object)
    return seen


@pytest.fixture
def fresh_warning():
    """The once-per-reason fallback warning forgets what it said (before and after a test)."""
    base.warn_reference_backward.cache_clear()
    yield
    base.warn_reference_backward.cache_clear()


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    """A private kernel cache shared by this module's compiling tests (3-4 kernels, ~10 s)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAX_FA4_CACHE_DIR", str(tmp_path_factory.mktemp("sm100-bwd-wiring")))
        call.clear_memory_cache()
        yield
        call.clear_memory_cache()


# -- lowering: which kernels a gradient program carries ---------------------------------------
@pytest.mark.parametrize("deterministic, hkv", [(False, 4), (True, 2)])
def test_forced_sm100_gradient_lowers_to_the_sm100_backward_kernel(module_cache, monkeypatch,
                                                                   deterministic, hkv):
    """jax.grad through flash_attention(implementation="sm100") exports for CUDA with the sm100
    forward, the preprocess and the sm100 backward kernel, compiled here for sm_100a (no
    reference backward; deterministic=True: the ordered-dQ config and its int32 counters)."""
    real = call.kernel_object
    seen = []
    monkeypatch.setattr(call, "kernel_object",
                        lambda config, arch, cache=None: seen.append((config, arch))
                        or real(config, arch, cache))
    q, k, v = _qkv(hkv=hkv)
    exported = _export_for_cuda(_grad_fn("sm100", causal=True, deterministic=deterministic),
                                q, k, v)
    text = exported.mlir_module()
    assert sorted(c.kernel_name for c, _ in seen) == ["bwd_preprocess", "sm100_bwd", "sm100_fwd"]
    assert {arch for _, arch in seen} == {"sm_100a"}
    (bwd,) = [c for c, _ in seen if c.kernel_name == "sm100_bwd"]
    assert (bwd.mask, bwd.gqa, bwd.deterministic, bwd.head_dim, bwd.two_cta) == (
        "causal", hkv != 4, deterministic, 128, True)
    assert text.count(CUSTOM_CALL) == 3
    # dq_accum (B, H, ceil(77/128)·128·D) float32; with deterministic, one counter per 64-row
    # half of each query block (the 2-CTA kernel's two slots)
    assert "tensor<2x4x16384xf32>" in text
    assert ("tensor<2x4x2xi32>" in text) == deterministic
    assert [a.shape for a in exported.out_avals] == [q.shape, k.shape, v.shape]


def test_enabled_sm100_gradient_uses_the_sm100_backward(lowered, monkeypatch):
    """implementation=None on a Blackwell GPU with JAX_FA4_ENABLE_SM100=1 (GPU faked) takes the
    same backward kernel as a forced sm100."""
    monkeypatch.setattr(backends, "gpu_compute_capability", lambda: "10.0")
    monkeypatch.setenv(ENABLE_ENV, "1")
    _export_for_cuda(_grad_fn(None, window_size=(16, 0)), *_qkv(d=64))
    kernels = {c.kernel_name: c for c, _ in lowered}
    assert set(kernels) == {"sm100_fwd", "bwd_preprocess", "sm100_bwd"}
    assert kernels["sm100_bwd"].mask == "local" and kernels["sm100_bwd"].head_dim == 64


def test_sm100_gradient_at_head_dim_192_128_lowers_to_the_serial_2cta_kernel(lowered,
                                                                             fresh_warning):
    """Head dim 192 / Dv 128: the 2-CTA backward in its serial layout (dPᵀ over Sᵀ's upper half),
    no fallback warning."""
    q, k, v = _qkv(d=192, dv=128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _export_for_cuda(_grad_fn("sm100", causal=True), q, k, v)
    (bwd,) = [c for c, _ in lowered if c.kernel_name == "sm100_bwd"]
    assert (bwd.head_dim, bwd.head_dim_v, bwd.two_cta, bwd.serial) == (192, 128, True, True)


@pytest.mark.parametrize("d, dv", [(256, 256)])
def test_sm100_backward_the_kernel_rejects_falls_back_with_a_warning(lowered, fresh_warning, d,
                                                                      dv, monkeypatch):
    """Head dims the sm100 backward does not take keep the sm100 forward kernel and run the
    reference backward, saying so once, with the config's reason. Every head dim the sm100
    forward serves has a backward now; 256 stands in with its split backward switched off
    (the fused kernels' refusal: dK, dV, Sᵀ and dPᵀ exceed the 512 TMEM columns)."""
    from jax_fa4.kernels.sm100 import bwd_split_config

    monkeypatch.setattr(bwd_split_config, "serves", lambda head_dim, head_dim_v: False)
    q, k, v = _qkv(d=d, dv=dv)
    opts = options.canonicalize(q, k, v, softmax_scale=None, causal=True,
                                window_size=(None, None), softcap=0.0,
                                implementation="sm100")
    sm100 = backends.get("sm100")
    assert sm100.supports_forward(q, k, v, opts) is None  # the forward kernel serves
    reason = sm100.supports_backward(q, k, v, opts)
    assert reason is not None and "not supported" in reason
    with pytest.warns(RuntimeWarning, match="reference backward") as record:
        _export_for_cuda(_grad_fn("sm100", causal=True), q, k, v)
    assert any(reason in str(w.message) for w in record)
    assert sorted(c.kernel_name for c, _ in lowered) == ["bwd_preprocess", "sm100_fwd"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        _export_for_cuda(_grad_fn("sm100", causal=True, softcap=1.0), q, k, v)


def test_no_warning_when_the_sm100_forward_kernel_does_not_run_either(monkeypatch,
                                                                     fresh_warning):
    """sm100 enabled by the env var but float32 inputs: forward and backward both run the
    reference, as silently as the forward's fallback (the warning is about a split between a
    kernel forward and a reference backward)."""
    monkeypatch.setattr(backends, "gpu_compute_capability", lambda: "10.0")
    monkeypatch.setenv(ENABLE_ENV, "1")
    q, k, v = _qkv(sq=9, sk=9, d=64, dtype=jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grads = jax.jit(jax.grad(lambda q, k, v: jax_fa4.flash_attention(q, k, v).sum(),
                                 argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(lambda q, k, v: jax_fa4.flash_attention(
        q, k, v, implementation="reference").sum(), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


# -- sm90 unchanged -----------------------------------------------------------------------------
@pytest.mark.parametrize("deterministic", [False, True])
def test_sm90_gradient_still_lowers_to_the_sm90_backward_kernels(lowered, fresh_warning,
                                                                  deterministic):
    _export_for_cuda(_grad_fn("sm90", causal=True, deterministic=deterministic), *_qkv(hkv=2))
    names = sorted(c.kernel_name for c, _ in lowered)
    assert names == ["bwd_preprocess", "sm90_bwd", "sm90_bwd_postprocess", "sm90_fwd"]
    assert {arch for _, arch in lowered} == {"sm_90a"}
    (bwd,) = [c for c, _ in lowered if c.kernel_name == "sm90_bwd"]
    assert bwd.deterministic == deterministic and bwd.gqa


def test_sm90_backward_fallback_is_unchanged(lowered, fresh_warning):
    """Head dim 192/192: the sm90 forward kernel serves it, its backward kernels do not; the
    reference backward runs, silently as before, for the sm90 backend's reason."""
    q, k, v = _qkv(d=192)
    opts = options.canonicalize(q, k, v, softmax_scale=None, causal=False,
                                window_size=(None, None), softcap=0.0, implementation="sm90")
    reason = backends.get("sm90").supports_backward(q, k, v, opts)
    assert reason is not None and "192" in reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _export_for_cuda(_grad_fn("sm90", causal=True), q, k, v)
    assert sorted(c.kernel_name for c, _ in lowered) == ["bwd_preprocess", "sm90_fwd"]


@pytest.mark.parametrize("deterministic, hkv, d", [(False, 4, 256), (True, 2, 256),
                                                    (False, 2, 192), (True, 4, 192)])
def test_sm100_gradient_at_head_dim_256_lowers_to_the_split_kernels(lowered, fresh_warning,
                                                                    deterministic, hkv, d):
    """Head dim 256: the split backward's two kernels (dK/dV with GQA's per-query-head float32
    outputs when H > Hkv, and dQ), no fused kernel, no reference backward and no fallback
    warning; deterministic=True takes the same kernels (each writes its outputs once). Head dims
    192/192 likewise, the dK/dV kernel with one CTA per key block (all 192 columns)."""
    q, k, v = _qkv(hkv=hkv, d=d)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exported = _export_for_cuda(_grad_fn("sm100", causal=True, deterministic=deterministic),
                                    q, k, v)
    text = exported.mlir_module()
    assert sorted(c.kernel_name for c, _ in lowered) == [
        "bwd_preprocess", "sm100_bwd_split", "sm100_bwd_split", "sm100_fwd"]
    parts = {c.part: c for c, _ in lowered if c.kernel_name == "sm100_bwd_split"}
    assert set(parts) == {"dkdv", "dq"}
    assert (parts["dkdv"].gqa, parts["dkdv"].mask, parts["dq"].mask) == (
        hkv != 4, "causal", "causal")
    assert {(c.head_dim, c.head_dim_v) for c in parts.values()} == {(d, d)}
    assert (parts["dkdv"].col_splits, parts["dkdv"].out_cols) == (
        (1, 192) if d == 192 else (2, 128))
    assert text.count(CUSTOM_CALL) == 4
    # no dq_accum (2, 4, 128·D) and no ordering counters: dq is written once
    assert "xi32>" not in text and f"x{128 * d}xf32>" not in text
    assert [a.shape for a in exported.out_avals] == [q.shape, k.shape, v.shape]


# -- numbers: the sm100 route with emulated kernels equals the reference route -----------------
NUMERIC_CASES = [  # (b, sq, sk, h, hkv, d, flash_attention kwargs, learnable sink)
    (2, 77, 150, 4, 4, 64, {"causal": True}, False),
    (1, 130, 90, 4, 2, 128, {"window_size": (5, 3), "softcap": 2.0, "softmax_scale": 0.3},
     False),
    (2, 61, 61, 4, 1, 96, {"causal": True, "deterministic": True}, False),
    (2, 40, 70, 4, 2, 64, {"causal": True}, True),
    # head dim 256: the split backward (a dK/dV and a dQ kernel, dq written scaled, once)
    (2, 77, 150, 2, 2, 256, {"causal": True}, False),
    (1, 130, 90, 4, 2, 256, {"window_size": (5, 3), "softcap": 2.0, "softmax_scale": 0.3},
     False),
    (2, 61, 61, 4, 1, 256, {"causal": True, "deterministic": True}, False),
    (2, 40, 70, 4, 2, 256, {"causal": True}, True),
    # head dims 192/192: the split backward with one dK/dV CTA per key block
    (2, 77, 150, 2, 2, 192, {"causal": True}, False),
    (1, 130, 90, 4, 2, 192, {"window_size": (5, 3), "softcap": 2.0, "softmax_scale": 0.3},
     True),
    (2, 61, 61, 4, 1, 192, {"causal": True, "deterministic": True}, False),
]


def _route(d: int) -> str:
    """Which sm100 backward serves head dim ``d``: the fused kernels or the split ones."""
    return "split" if d in (192, 256) else "fused"


def _mask_kind(kwargs: dict) -> str:
    """The mask a case's flash_attention kwargs ask for: "causal", "local" or "none"."""
    return "causal" if kwargs.get("causal") else "local" if "window_size" in kwargs else "none"


#: the quick tier runs one case per (route, sink, deterministic), deterministic for the fused
#: kernels only (the split kernels take the same configs either way: its lowering test above
#: checks that); --exhaustive all
@pytest.mark.parametrize("case", per_class(NUMERIC_CASES, key=lambda c: (
    _route(c[5]), c[7], _route(c[5]) == "fused" and c[6].get("deterministic", False))), ids=str)
def test_sm100_backward_contract_gives_the_reference_gradients(case, monkeypatch, fresh_warning):
    """With the kernels replaced by contract-exact stand-ins, jax.grad through
    implementation="sm100" (dq_accum rows past Sq dropped and scaled by softmax_scale, GQA/MQA
    dK/dV summed per group, the ordered-dQ counters passed, a sink's gradient from the
    backward's delta; head dims 192/192 and 256: the split kernels' dk, dv and scaled dq) gives
    the reference's gradients (:func:`_oracle_grads`)."""
    b, sq, sk, h, hkv, d, kwargs, with_sink = case
    q, k, v = _qkv(b, sq, sk, h, hkv, d, seed=3)
    sink = jnp.linspace(-1.0, 1.0, h, dtype=jnp.float32) if with_sink else None
    window = (None, 0) if kwargs.get("causal") else kwargs.get("window_size", (None, None))
    options = {"softmax_scale": kwargs.get("softmax_scale", 1 / math.sqrt(d)), "window": window,
               "softcap": kwargs.get("softcap", 0.0)}
    calls = []
    monkeypatch.setattr(call, "call_kernel", emulated_call_kernel(options, calls))
    ct = _cotangent(7, b, sq, h, d)

    def loss(implementation):
        def f(q, k, v, s):
            out = jax_fa4.flash_attention(q, k, v, learnable_sink=s,
                                          implementation=implementation, **kwargs)
            return jnp.sum(out.astype(jnp.float32) * ct)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3) if with_sink else (0, 1, 2)))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kernel serves: no fallback warning
        got = loss("sm100")(q, k, v, sink)
    want = _oracle_grads((q, k, v, sink), kwargs, ct)
    if d in (192, 256):  # the split kernels (deterministic without a config of their own)
        split = sorted((c.part, c.gqa) for c, _, _ in calls if c.kernel_name == "sm100_bwd_split")
        assert split == [("dkdv", h != hkv), ("dq", False)]
        assert not [c for c, _, _ in calls if c.kernel_name == "sm100_bwd"]
        _assert_grads_close(got, want)
        return
    (bwd,) = [c for c, _, _ in calls if c.kernel_name == "sm100_bwd"]
    assert (bwd.gqa, bwd.deterministic, bwd.head_dim) == (
        h != hkv, kwargs.get("deterministic", False), d)
    _assert_grads_close(got, want)


def test_sm100_max_logits_route_gives_the_reference_max_logits(monkeypatch, fresh_warning):
    """return_max_logits=True with implementation="sm100" runs the sm100 forward config with
    max logits (its third output, emulated by the contract: each row's max over the visible
    keys) and gives the reference route's max logits, out and gradients (the backward takes the
    forward's residuals as without them)."""
    b, sq, sk, h, hkv, d = 2, 70, 150, 4, 2, 128
    kwargs = {"window_size": (40, 3), "softcap": 3.0, "softmax_scale": 0.2}
    q, k, v = _qkv(b, sq, sk, h, hkv, d, seed=5)
    options = {"softmax_scale": 0.2, "window": (40, 3), "softcap": 3.0}
    calls = []
    monkeypatch.setattr(call, "call_kernel", emulated_call_kernel(options, calls))
    ct = _cotangent(8, b, sq, h, d)

    def run(implementation):
        def f(q, k, v):
            out, row_max = jax_fa4.flash_attention(q, k, v, implementation=implementation,
                                                   return_max_logits=True, **kwargs)
            return jnp.sum(out.astype(jnp.float32) * ct), (out, row_max)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kernels serve: no fallback warning
        (_, (out, row_max)), grads = run("sm100")
    fwd = [(c, arch) for c, arch, _ in calls if c.kernel_name == "sm100_fwd"]
    assert fwd and all(c.max_logits and c.mask == "local" and c.has_softcap
                       and arch == "sm_100a" for c, arch in fwd)
    assert [c.kernel_name for c, _, _ in calls].count("sm100_bwd") == 1
    (_, (want_out, want_max)), want_grads = run("reference")
    assert row_max.shape == (b, h) and row_max.dtype == jnp.float32
    np.testing.assert_allclose(row_max, want_max, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32),
                               atol=1e-2)
    for name, g, w in zip("qkv", grads, want_grads):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, atol=2e-2 * np.abs(w).max(), rtol=0, err_msg=name)


SEGMENT_CASES = [  # (b, s, h, hkv, d, flash_attention kwargs, ids kind, learnable sink)
    (2, 300, 4, 2, 128, {"causal": True}, "packed", False),
    (1, 200, 2, 1, 256, {"window_size": (50, 10), "softcap": 5.0}, "random", True),
]


@pytest.mark.parametrize("case", SEGMENT_CASES, ids=str)
def test_sm100_segments_route_gives_the_reference(case, monkeypatch, fresh_warning):
    """segment_ids with implementation="sm100" run the sm100 forward with segment ids (and max
    logits) on jax_fa4.segments' tables for its 128-row Q tiles, emulated by the sm100 rule
    from the tables alone (sm100_emulation.sm100_table_visible), and the sm100 backward with
    segment ids (head dim 128; at 256, which has no such kernel, the reference's backward with
    a one-time warning): out, lse, max logits and gradients equal the reference's (the float64
    oracle's; a sink joined around the kernel's output)."""
    from test_segments import packed_ids

    b, s, h, hkv, d, kwargs, ids_kind, with_sink = case
    kernel_backward = d != 256
    rng = np.random.default_rng(d)
    ids = jnp.asarray(packed_ids(rng, b, s, 4) if ids_kind == "packed"
                      else rng.integers(0, 3, (b, s)).astype(np.int32))
    q, k, v = _qkv(b, s, s, h, hkv, d, seed=6)
    sink = jnp.linspace(-1.0, 1.0, h, dtype=jnp.float32) if with_sink else None
    window = (None, 0) if kwargs.get("causal") else kwargs["window_size"]
    options = {"softmax_scale": 1 / math.sqrt(d), "window": window,
               "softcap": kwargs.get("softcap", 0.0)}
    calls = []
    monkeypatch.setattr(call, "call_kernel", emulated_call_kernel(options, calls))
    ct = _cotangent(9, b, s, h, d)

    def f(q, k, v):
        out, lse, row_max = jax_fa4.flash_attention(
            q, k, v, segment_ids=ids, learnable_sink=sink, return_lse=True,
            return_max_logits=True, implementation="sm100", **kwargs)
        return jnp.sum(out.astype(jnp.float32) * ct), (out, lse, row_max)

    with (warnings.catch_warnings() if kernel_backward
          else pytest.warns(RuntimeWarning, match="segment-id kernel at head dims 256/256")):
        if kernel_backward:
            warnings.simplefilter("error")  # the kernel serves: no fallback warning
        (_, got), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(
            q, k, v)
    fwd = [(c, arch) for c, arch, _ in calls if c.kernel_name == "sm100_fwd"]
    assert fwd and all(c.segments and c.max_logits and c.head_dim == d and arch == "sm_100a"
                       for c, arch in fwd)
    bwd = [c for c, _, _ in calls if c.kernel_name == "sm100_bwd"]
    assert len(bwd) == kernel_backward and all(c.segments and c.gqa for c in bwd), bwd
    # the reference's numbers by the float64 oracle (NumPy: no reference program compiled)
    visible = window_visible(s, s, window)[None] & _segments_visible(ids, None)
    q64, k64 = (np.asarray(x, np.float64) for x in (q, k))
    scores = np.einsum("bqhd,bkhd->bhqk", q64, np.repeat(k64, h // hkv, axis=2)) / math.sqrt(d)
    if kwargs.get("softcap"):
        scores = kwargs["softcap"] * np.tanh(scores / kwargs["softcap"])
    want_max = np.where(visible[:, None], scores, -np.inf).max(axis=(2, 3))  # (B, H)
    want_out, want_lse, want_grads = oracle(q, k, v, visible, 1 / math.sqrt(d),
                                            kwargs.get("softcap", 0.0), sink, dout=ct)
    for name, g, w in zip(("out", "lse", "max_logits", "dq", "dk", "dv"), (*got, *grads),
                          (want_out, want_lse, want_max, *want_grads[:3])):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w), err_msg=name)
        fin = np.isfinite(w)
        bound = 2e-2 * max(1.0, float(np.abs(w[fin]).max()))
        assert float(np.abs(g[fin] - w[fin]).max()) <= bound, (name, np.abs(g - w).max())


# -- segment ids: the 1-CTA kernel's segment-id mode --------------------------------------------
def _segment_ids(kind: str, b: int, sq: int, sk: int, seed: int):
    """(segment_ids for flash_attention, padding_segment_id) of a kind: "packed" (contiguous
    documents), "random" (ids 0-2 anywhere: no contiguous runs), "padding" (packed documents
    ending in padding id 0, which the API rewrites), "pair" (Sq != Sk: each query id a run of
    keys in another order, one query id no key has)."""
    from test_segments import packed_ids

    rng = np.random.default_rng(seed)
    if kind == "packed":
        return jnp.asarray(packed_ids(rng, b, sq, 4)), None
    if kind == "random":
        return jnp.asarray(rng.integers(0, 3, (b, sq)).astype(np.int32)), None
    if kind == "padding":
        return jnp.asarray(packed_ids(rng, b, sq, 3) + 1).at[:, sq - sq // 4:].set(0), 0
    assert kind == "pair"
    q_ids = rng.integers(0, 4, (b, sq)).astype(np.int32)
    kv_ids = np.sort(rng.integers(0, 3, (b, sk)), axis=1)[:, ::-1].astype(np.int32)
    return (jnp.asarray(q_ids), jnp.asarray(kv_ids)), None


SEGMENT_BACKWARD_CASES = [  # (b, sq, sk, h, hkv, d, flash_attention kwargs, ids kind, sink)
    (2, 300, 300, 4, 2, 128, {"causal": True}, "packed", False),
    (2, 261, 261, 4, 4, 64, {"window_size": (70, 9), "softcap": 4.0}, "random", False),
    (1, 333, 333, 2, 1, 96, {"causal": True}, "padding", True),
    (2, 140, 270, 4, 2, 64, {"softmax_scale": 0.2}, "pair", False),
    (1, 129, 129, 2, 2, 128, {"window_size": (20, None)}, "padding", False),
]


def _segments_visible(ids, padding_id) -> np.ndarray:
    """(B, Sq, Sk) bool: the keys each query's segment id leaves visible (a (q, kv) pair or one
    array for both; padding queries see no key, no query sees a padding key)."""
    q_ids, kv_ids = (np.asarray(x) for x in (ids if isinstance(ids, tuple) else (ids, ids)))
    visible = q_ids[:, :, None] == kv_ids[:, None, :]
    if padding_id is not None:
        visible &= (q_ids != padding_id)[:, :, None] & (kv_ids != padding_id)[:, None, :]
    return visible


def _segments_oracle(inputs, rest, **kwargs) -> list:
    """:func:`_oracle_grads` of a segment-id case (``inputs``, ``rest`` as
    :func:`_segments_emulated` returns them)."""
    ids, padding_id, ct, _ = rest
    return _oracle_grads(inputs, kwargs, ct, _segments_visible(ids, padding_id))


def _segments_grad_fn(implementation, ids, padding_id, ct, with_sink, **kwargs):
    def loss(q, k, v, s):
        out = jax_fa4.flash_attention(q, k, v, segment_ids=ids, padding_segment_id=padding_id,
                                      learnable_sink=s, implementation=implementation,
                                      **kwargs)
        return jnp.sum(out.astype(jnp.float32) * ct)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3) if with_sink else (0, 1, 2)))


def _segments_emulated(monkeypatch, case, dv=None):
    """The case's inputs, ids and cotangent, with call_kernel emulated; returns them and the
    list of kernel calls. ``dv``: the values' head dim (default: d)."""
    b, sq, sk, h, hkv, d, kwargs, ids_kind, with_sink = case
    q, k, v = _qkv(b, sq, sk, h, hkv, d, dv, seed=11)
    ids, padding_id = _segment_ids(ids_kind, b, sq, sk, seed=d + sq)
    sink = jnp.linspace(-1.0, 1.0, h, dtype=jnp.float32) if with_sink else None
    window = (None, 0) if kwargs.get("causal") else kwargs.get("window_size", (None, None))
    options = {"softmax_scale": kwargs.get("softmax_scale", 1 / math.sqrt(d)),
               "window": window, "softcap": kwargs.get("softcap", 0.0)}
    calls = []
    monkeypatch.setattr(call, "call_kernel", emulated_call_kernel(options, calls))
    ct = _cotangent(12, b, sq, h, dv or d)
    return (q, k, v, sink), (ids, padding_id, ct, with_sink), calls


#: the quick tier runs one case per (sink, mask) (the ids kinds packed, random, padding, pair and
#: odd lengths among them); --exhaustive all
@pytest.mark.parametrize("case", per_class(SEGMENT_BACKWARD_CASES, key=lambda c: (
    c[8], _mask_kind(c[6]))), ids=str)
def test_sm100_segments_backward_gives_the_reference_gradients(case, monkeypatch,
                                                               fresh_warning):
    """jax.grad through flash_attention(segment_ids=..., implementation="sm100") with the
    kernels emulated (the backward's stand-in reads the mask from its tables as the kernel does:
    key-block ranges, bulk, ids): packed documents, ids without contiguous runs, padding ids,
    query / key id pairs of other lengths, causal and windows, softcap, GQA / MQA, odd lengths
    and a sink (its gradient from delta) give the reference's gradients (:func:`_oracle_grads`),
    with the sm100 backward kernel with segment ids and no fallback warning."""
    inputs, rest, calls = _segments_emulated(monkeypatch, case)
    kwargs = case[6]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kernel serves: no fallback warning
        got = _segments_grad_fn("sm100", *rest, **kwargs)(*inputs)
    (bwd,) = [c for c, _, _ in calls if c.kernel_name == "sm100_bwd"]
    assert bwd.segments and not bwd.two_cta and bwd.gqa == (case[3] != case[4])
    assert bwd.head_dim == case[5] and bwd.has_softcap == ("softcap" in kwargs)
    monkeypatch.undo()
    _assert_grads_close(got, _segments_oracle(inputs, rest, **kwargs))


def _shift(x, column: int, by: int):
    return x.at[..., column].add(by)


#: the case of the stand-in's mutation checks below
_TABLES_CASE = (2, 300, 300, 4, 2, 64, {"causal": True}, "random", False)


@functools.cache
def _tables_case_reference() -> tuple:
    """The reference's gradients (:func:`_oracle_grads`) of ``_TABLES_CASE`` (computed once for
    the three mutation checks below)."""
    with pytest.MonkeyPatch.context() as mp:
        inputs, rest, _ = _segments_emulated(mp, _TABLES_CASE)
    return _segments_oracle(inputs, rest, **_TABLES_CASE[6])


@pytest.mark.parametrize("broken", ["key range", "bulk", "row ids"])
def test_the_segments_stand_in_reads_the_tables(broken, monkeypatch, fresh_warning):
    """The backward's stand-in takes its mask from the tables alone: a key block's query-block
    range cut short, a bulk claimed over every key block, or the rows' ids shifted, and its
    gradients are no longer the reference's (so the test above checks the backend's tables)."""
    from jax_fa4 import segments
    from jax_fa4.kernels import segments_config as cols

    case = _TABLES_CASE
    inputs, rest, _ = _segments_emulated(monkeypatch, case)
    tables = segments.backward_tables

    def corrupted(q_ids, kv_ids, tile_m, tile_n):
        tiles, keys, rows, kv = tables(q_ids, kv_ids, tile_m, tile_n)
        if broken == "key range":
            keys = _shift(keys, cols.SEG_KEY_M_HI, -1)
        elif broken == "bulk":
            tiles = tiles.at[..., cols.SEG_BULK_LO].set(0).at[..., cols.SEG_BULK_HI].set(99)
        else:
            rows = _shift(rows, cols.SEG_ROW_ID, 1)
        return tiles, keys, rows, kv

    monkeypatch.setattr(segments, "backward_tables", corrupted)
    got = _segments_grad_fn("sm100", *rest, **case[6])(*inputs)
    monkeypatch.undo()
    with pytest.raises(AssertionError):
        _assert_grads_close(got, _tables_case_reference())


@pytest.mark.parametrize("d, dv, two_cta, dq_stages", [(128, 128, False, 2),
                                                       (192, 128, True, 1)])
def test_segments_gradient_lowers_to_the_sm100_segments_backward(lowered, fresh_warning, d, dv,
                                                                 two_cta, dq_stages):
    """jax.grad through flash_attention(segment_ids=..., implementation="sm100") exports for
    CUDA with the sm100 forward and backward kernels with segment ids (the 1-CTA kernel, head
    dim 128 too; at 192/128 the 2-CTA kernel's mode, one dQ staging buffer) and the
    preprocess, the backward taking the four tables for its 128 × 128 tile; no fallback
    warning, no reference backward."""
    b, s, h, hkv = 2, 300, 4, 2
    q, k, v = _qkv(b, s, s, h, hkv, d, dv)
    ids = jnp.zeros((b, s), jnp.int32).at[:, 100:].set(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exported = _export_for_cuda(_grad_fn("sm100", causal=True, segment_ids=ids), q, k, v)
    kernels = {c.kernel_name: c for c, _ in lowered}
    assert sorted(c.kernel_name for c, _ in lowered) == ["bwd_preprocess", "sm100_bwd",
                                                         "sm100_fwd"]
    assert {arch for _, arch in lowered} == {"sm_100a"}
    bwd = kernels["sm100_bwd"]
    assert (bwd.segments, bwd.two_cta, bwd.deterministic, bwd.mask, bwd.gqa, bwd.head_dim,
            bwd.head_dim_v, bwd.dq_stages) == (True, two_cta, False, "causal", True, d, dv,
                                               dq_stages)
    assert kernels["sm100_fwd"].segments
    text = exported.mlir_module()
    assert text.count(CUSTOM_CALL) == 3
    blocks = -(-s // 128)
    assert f"tensor<{b}x{blocks}x8xi32>" in text  # seg_tiles, seg_keys
    assert f"tensor<{b}x{s}x4xi32>" in text  # seg_rows
    assert [a.shape for a in exported.out_avals] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("d, dv, kwargs, reason", [
    (256, 256, {}, "no segment-id kernel at head dims 256/256"),
    (64, 64, {"deterministic": True}, "adds dQ in no fixed order"),
    (192, 128, {"deterministic": True}, "adds dQ in no fixed order"),
])
def test_segments_backward_the_kernel_declines_falls_back_with_a_warning(lowered, fresh_warning,
                                                                          d, dv, kwargs,
                                                                          reason):
    """Head dim 256 (no segment-id backward kernel) and deterministic=True (the 1-CTA and
    2-CTA segment-id modes add dQ in no fixed order) keep the sm100 forward with segment ids
    and run the reference's backward, saying why once."""
    q, k, v = _qkv(sq=130, sk=130, d=d, dv=dv)
    ids = jnp.zeros((2, 130), jnp.int32).at[:, 64:].set(1)
    with pytest.warns(RuntimeWarning, match=reason):
        _export_for_cuda(_grad_fn("sm100", segment_ids=ids, **kwargs), q, k, v)
    assert sorted(c.kernel_name for c, _ in lowered) == ["sm100_fwd"]
    assert lowered[0][0].segments


# -- segment ids at 192/128: the 2-CTA kernel's segment-id mode ---------------------------------
SEGMENT_2CTA_CASES = [  # (b, sq, sk, h, hkv, d, flash_attention kwargs, ids kind, sink); Dv 128
    # 600 keys: three pairs, the last one's second block past the keys
    (2, 600, 600, 4, 2, 192, {"causal": True}, "packed", False),
    (1, 520, 520, 2, 2, 192, {"window_size": (150, 20), "softcap": 4.0}, "random", False),
    (1, 459, 459, 4, 1, 192, {"causal": True}, "padding", True),
    (2, 140, 530, 2, 2, 192, {"softmax_scale": 0.2}, "pair", False),
    # a multiple of the query block: no padded dq_accum rows
    (1, 512, 512, 2, 2, 192, {"window_size": (20, None)}, "padding", False),
]


#: the quick tier runs one case with a sink and one without (the 1-CTA list above covers every
#: ids kind in it); --exhaustive all
@pytest.mark.parametrize("case", per_class(SEGMENT_2CTA_CASES, key=lambda c: c[8]), ids=str)
def test_sm100_2cta_segments_backward_gives_the_reference_gradients(case, monkeypatch,
                                                                    fresh_warning):
    """At head dims 192/128, jax.grad through flash_attention(segment_ids=...,
    implementation="sm100") with the kernels emulated (the 2-CTA stand-in visits each pair's
    union of its two key blocks' table ranges, then masks by the bulk and the ids per 128-key
    block): packed documents, ids without contiguous runs, padding ids, query / key ids of
    other lengths, causal and windows, softcap, GQA / MQA, a sink, pairs whose second block
    lies past the keys give the reference's gradients, with the 2-CTA kernel's segment-id
    config (one dQ staging buffer) and no fallback warning."""
    inputs, rest, calls = _segments_emulated(monkeypatch, case, dv=128)
    kwargs = case[6]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kernel serves: no fallback warning
        got = _segments_grad_fn("sm100", *rest, **kwargs)(*inputs)
    (bwd,) = [c for c, _, _ in calls if c.kernel_name == "sm100_bwd"]
    assert bwd.segments and bwd.two_cta and bwd.serial and bwd.dq_stages == 1, bwd
    assert (bwd.head_dim, bwd.head_dim_v, bwd.gqa) == (192, 128, case[3] != case[4])
    assert bwd.has_softcap == ("softcap" in kwargs) and not bwd.deterministic
    monkeypatch.undo()
    _assert_grads_close(got, _segments_oracle(inputs, rest, **kwargs))


def test_the_2cta_segments_stand_in_walks_the_pair_ranges(monkeypatch, fresh_warning):
    """The 2-CTA stand-in takes each key block's query blocks from its pair (the union of both
    blocks' table ranges): with the even blocks' ranges emptied, the odd blocks' ranges still
    cover the pairs and the gradients stay the reference's where the odd ranges hold the even
    ones' (packed documents of one pair each); with the odd blocks' emptied as well, they do
    not (so the test above checks the union)."""
    from jax_fa4 import segments
    from jax_fa4.kernels import segments_config as cols

    case = (1, 500, 500, 2, 2, 192, {"causal": True}, "packed", False)
    inputs, (_, _, ct, with_sink), _ = _segments_emulated(monkeypatch, case, dv=128)
    # documents [0, 256) and [256, 500): both blocks of a pair have the same range
    ids = jnp.zeros((1, 500), jnp.int32).at[:, 256:].set(1)
    rest = (ids, None, ct, with_sink)
    tables = segments.backward_tables

    def emptied(blocks):
        # (jitted: the traced backward takes no captured constants)
        @functools.partial(jax.jit, static_argnames=("tile_m", "tile_n"))
        def corrupted(q_ids, kv_ids, tile_m, tile_n):
            tiles, keys, rows, kv = tables(q_ids, kv_ids, tile_m, tile_n)
            for n in blocks:
                keys = keys.at[:, n, cols.SEG_KEY_M_LO].set(0).at[:, n, cols.SEG_KEY_M_HI].set(0)
            return tiles, keys, rows, kv
        return corrupted

    results = {}
    for name, blocks in (("even", (0, 2)), ("all", (0, 1, 2, 3))):
        monkeypatch.setattr(segments, "backward_tables", emptied(blocks))
        results[name] = _segments_grad_fn("sm100", *rest, causal=True)(*inputs)
    monkeypatch.undo()
    want = _segments_oracle(inputs, rest, causal=True)
    _assert_grads_close(results["even"], want)
    with pytest.raises(AssertionError):
        _assert_grads_close(results["all"], want)


# -- callers on several devices (4 simulated CPU devices, in a subprocess) ----------------------
@pytest.fixture(scope="module")
def multidevice():
    from test_sharding import multidevice_suite

    return multidevice_suite("sm100_bwd")


def test_sharded_gradient_runs_the_sm100_backward_on_each_shard(multidevice):
    """q, k, v sharded over batch and heads (GQA): the partitioned backward runs the sm100
    backward kernel on each device's (B/2, S, H/2) shard, without communication, and gives the
    reference's gradients."""
    r = multidevice["sharded"]
    assert "error" not in r, r.get("traceback")
    assert r["kernels"] == ["bwd_preprocess", "sm100_bwd", "sm100_fwd"]
    assert [2, 32, 2, 64] in r["bwd_q_shapes"]  # the shard-local call the program runs
    assert r["grad_specs"] == ["P('data', None, 'model', None)"] * 3
    assert r["grad_collectives"] == {}
    assert r["grad_err"] <= 2 ** -7 * max(1.0, r["grad_scale"]), r


def test_ring_gradient_runs_the_sm100_backward_on_every_hop(multidevice):
    """Causal zigzag ring attention with implementation="sm100": each hop's backward (the
    causal diagonal, then both cond branches of 3 hops) is the sm100 backward kernel."""
    r = multidevice["ring"]
    assert "error" not in r, r.get("traceback")
    assert r["bwd_masks"] == ["causal", "none"] and r["bwd_calls"] == 1 + 2 * 3, r
    assert r["grad_err"] <= 3e-2 * max(1.0, r["grad_scale"]), r


# -- varlen: the 1-CTA kernel's varlen mode (the 2-CTA kernel's at 192/128) ---------------------
VARLEN_LENS_Q, VARLEN_LENS_K = (130, 0, 1, 77, 5), (60, 9, 1, 140, 33)
VARLEN_PAD = 11  # padding tokens after the last sequence (a tile of the last one loads them)


def _varlen_inputs(h, hkv, d, dv=None, seed=5, pad_value=None, pad=VARLEN_PAD):
    """Packed bf16 q, k, v, the cotangent of out, cu_seqlens and the max lengths; ``pad``
    padding tokens after the last sequence, holding ``pad_value`` (e.g. NaN) when given."""
    dv = d if dv is None else dv
    tq, tk = sum(VARLEN_LENS_Q) + pad, sum(VARLEN_LENS_K) + pad
    rng = np.random.default_rng(seed)  # (NumPy: no XLA program per shape)
    q, k, v, ct = (rng.standard_normal(shape, np.float32)
                   for shape in ((tq, h, d), (tk, hkv, d), (tk, hkv, dv), (tq, h, dv)))
    if pad_value is not None:
        for x, total in ((q, tq), (ct, tq), (k, tk), (v, tk)):
            x[total - pad:] = pad_value
    cu_q, cu_k = (jnp.asarray(np.concatenate([[0], np.cumsum(x)]), jnp.int32)
                  for x in (VARLEN_LENS_Q, VARLEN_LENS_K))
    q, k, v = (jnp.asarray(x.astype(jnp.bfloat16)) for x in (q, k, v))
    return q, k, v, jnp.asarray(ct), cu_q, cu_k, max(VARLEN_LENS_Q), max(VARLEN_LENS_K)


def _varlen_oracle(inputs, ct, cu_q, cu_k, kwargs: dict) -> list:
    """The reference's gradients of a varlen case's loss (:func:`_varlen_grad_fn`) with respect
    to q, k, v (and the sink, when ``inputs`` has one), in the inputs' dtypes: the float64
    oracle on each sequence alone (tests/test_varlen.py's per_sequence; the padding tokens' 0),
    NumPy: no XLA program per case."""
    from test_varlen import _ref_options, per_sequence

    q, k, v, sink = inputs
    lens_q, lens_k = (np.diff(np.asarray(cu)) for cu in (cu_q, cu_k))
    cotangents = (ct, np.zeros((q.shape[1], q.shape[0]), np.float32))
    _, _, grads = per_sequence(q, k, v, lens_q, lens_k, sink, cotangents, **_ref_options(kwargs))
    return [np.asarray(g).astype(x.dtype) for g, x in zip(grads, inputs) if x is not None]


def _varlen_grad_fn(implementation, ct, cu_q, cu_k, max_q, max_k, with_sink=False, **kwargs):
    def loss(q, k, v, s):
        out = jax_fa4.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k,
                                             learnable_sink=s, implementation=implementation,
                                             **kwargs)
        return jnp.sum(jnp.where(jnp.isfinite(ct), out.astype(jnp.float32) * ct, 0.0))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3) if with_sink else (0, 1, 2)))


@pytest.mark.parametrize("h, hkv, d, dv", [(4, 2, 64, 64), (2, 2, 128, 128), (2, 2, 192, 128),
                                            (4, 2, 192, 128)])
def test_varlen_gradient_lowers_to_the_sm100_varlen_backward(lowered, fresh_warning,
                                                             monkeypatch, h, hkv, d, dv):
    """jax.grad through flash_attention_varlen(implementation="sm100") exports for CUDA with the
    sm100 varlen forward, the preprocess and the backward kernel in its varlen mode: the 1-CTA
    kernel's (head dim 128 too, whose dense route is 2-CTA), the 2-CTA kernel's at 192/128 (no
    1-CTA kernel fits: 640 TMEM columns), with the Hopper varlen contract's operands (dq_accum
    (1, H, R·D), the work list: one row per 128-key block, or per 256-key pair span for the
    2-CTA kernel, and the padding item); no fallback warning, no reference backward."""
    from jax_fa4.backends import sm90

    q, k, v, ct, cu_q, cu_k, max_q, max_k = _varlen_inputs(h, hkv, d, dv)
    tables = []
    work_table = sm90.work_table
    monkeypatch.setattr(sm90, "work_table", lambda *a: tables.append(a[2:5]) or work_table(*a))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exported = _export_for_cuda(
            _varlen_grad_fn("sm100", ct, cu_q, cu_k, max_q, max_k, causal=True), q, k, v, None)
    kernels = {c.kernel_name: c for c, _ in lowered}
    assert set(kernels) == {"sm100_fwd", "bwd_preprocess", "sm100_bwd"}
    assert {arch for _, arch in lowered} == {"sm_100a"}
    bwd = kernels["sm100_bwd"]
    two_cta = d == 192
    assert (bwd.varlen, bwd.two_cta, bwd.deterministic, bwd.mask, bwd.head_dim, bwd.head_dim_v,
            bwd.gqa) == (True, two_cta, False, "causal", d, dv, h != hkv)
    assert kernels["sm100_fwd"].varlen
    text = exported.mlir_module()
    total_q, total_k, batch = q.shape[0], k.shape[0], len(VARLEN_LENS_Q)
    rows = (total_q // 128 + batch) * 128  # sm90.dq_accum_rows
    assert f"tensor<1x{h}x{rows * d}xf32>" in text
    tn = 256 if two_cta else 128  # keys per work item
    # (num_items, tile_m, tile_n) of the work list (sm90.work_items)
    assert tables == [(total_k // tn + batch + 1, 128, tn)]
    assert f"tensor<{total_k // tn + batch + 1}x8xi32>" in text
    assert [a.shape for a in exported.out_avals] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("h, hkv, d", [(4, 2, 256), (2, 2, 256), (4, 2, 192)])
def test_varlen_gradient_at_head_dim_256_lowers_to_the_split_varlen_kernels(
        lowered, fresh_warning, monkeypatch, h, hkv, d):
    """Head dim 256 (and 192/192): the split backward's two kernels in their varlen mode, each
    with its work list (key blocks of 128 for dK/dV, built from (cu_seqlens_q, cu_seqlens_k);
    query blocks of 128 for dQ, from the swapped pair, in sequence order; each costed in 64-row
    streamed tiles), no dq_accum, no fused kernel, no fallback warning."""
    from jax_fa4.backends import sm90

    q, k, v, ct, cu_q, cu_k, max_q, max_k = _varlen_inputs(h, hkv, d)
    from jax_fa4.backends.sm100 import Sm100Backend

    tables, seen = [], {}
    work_table, split = sm90.work_table, Sm100Backend.split_varlen_backward

    def spy_split(self, q, k, v, sink, segments, cu_seqlens_q, cu_seqlens_k, *rest):
        seen.update(q=cu_seqlens_q, k=cu_seqlens_k)  # (the traced cu_seqlens of this call)
        return split(self, q, k, v, sink, segments, cu_seqlens_q, cu_seqlens_k, *rest)

    def spy(cu_a, cu_b, *rest):
        which = [next((n for n, x in seen.items() if x is cu), "?") for cu in (cu_a, cu_b)]
        tables.append((*which, *rest[:3], rest[4] if len(rest) > 4 else None))
        return work_table(cu_a, cu_b, *rest)

    monkeypatch.setattr(Sm100Backend, "split_varlen_backward", spy_split)
    monkeypatch.setattr(sm90, "work_table", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exported = _export_for_cuda(
            _varlen_grad_fn("sm100", ct, cu_q, cu_k, max_q, max_k, causal=True), q, k, v, None)
    assert sorted(c.kernel_name for c, _ in lowered) == [
        "bwd_preprocess", "sm100_bwd_split", "sm100_bwd_split", "sm100_fwd"]
    parts = {c.part: c for c, _ in lowered if c.kernel_name == "sm100_bwd_split"}
    assert set(parts) == {"dkdv", "dq"} and all(c.varlen for c in parts.values())
    assert (parts["dkdv"].gqa, parts["dkdv"].mask) == (h != hkv, "causal")
    assert {(c.head_dim, c.head_dim_v) for c in parts.values()} == {(d, d)}
    text = exported.mlir_module()
    total_q, total_k, batch = q.shape[0], k.shape[0], len(VARLEN_LENS_Q)
    assert f"tensor<{total_k // 128 + batch + 1}x8xi32>" in text
    assert f"tensor<{total_q // 128 + batch + 1}x8xi32>" in text
    assert tables == [("q", "k", total_k // 128 + batch + 1, 64, 128, sm90.work_order()),
                      ("k", "q", total_q // 128 + batch + 1, 64, 128, "sequence")], tables
    # no dq_accum (1, H, R·D) of the varlen backward's rows
    assert f"x{sm90.dq_accum_rows(total_q, batch, 128) * d}xf32>" not in text
    assert [a.shape for a in exported.out_avals] == [q.shape, k.shape, v.shape]


VARLEN_CASES = [  # (h, hkv, d, flash_attention_varlen kwargs, learnable sink)
    (4, 2, 64, {"causal": True}, False),
    (2, 2, 128, {"window_size": (20, 3), "softcap": 2.0, "softmax_scale": 0.3}, False),
    (2, 1, 96, {}, True),
    # head dim 256: the split backward's varlen mode
    (4, 2, 256, {"causal": True}, False),
    (2, 2, 256, {"window_size": (20, 3), "softcap": 2.0, "softmax_scale": 0.3}, True),
    # head dims 192/192: the split backward's varlen mode, one dK/dV CTA per work row
    (4, 2, 192, {"causal": True}, True),
    (2, 2, 192, {"window_size": (20, 3), "softcap": 2.0, "softmax_scale": 0.3}, False),
]
#: the 2-CTA kernel's varlen mode (head dims 192/128): (h, hkv, kwargs, learnable sink); 200
#: NaN padding tokens, more than a 128-key tile's overhang past the last sequence (33 keys: its
#: pair span loads 223 rows past it), so the backend must zero a pair span's 256 key rows. The
#: quick tier runs the first (GQA, window, softcap, sink), --exhaustive both.
VARLEN_2CTA_CASES = per_class([
    (4, 2, {"window_size": (50, 7), "softcap": 3.0}, True),
    (2, 2, {"causal": True}, False),
], key=lambda case: 0)


def _varlen_emulated(monkeypatch, kwargs, d):
    """call_kernel with the varlen forward's stand-in (tests/test_varlen.py) and the sm100
    backward's (tests/sm100_emulation.py); returns the list of backward calls. (The package's
    jitted varlen call may hold a trace of the same shapes with the real call_kernel, from the
    lowering tests: its traces are cleared, not the rest of JAX's caches.)"""
    from test_varlen import _emulated_varlen_kernel, _ref_options

    from jax_fa4 import autodiff

    autodiff._varlen.clear_cache()

    options = dict(_ref_options(kwargs))
    options["softmax_scale"] = options["softmax_scale"] or 1 / math.sqrt(d)
    forward = _emulated_varlen_kernel(dict(options), "sm100")
    calls = []
    backward = emulated_call_kernel(options, calls)
    monkeypatch.setattr(call, "call_kernel", lambda config, *a, **kw: (
        forward if config.kernel_name == "sm100_fwd" else backward)(config, *a, **kw))
    return calls


#: the quick tier runs one case per (route, sink); --exhaustive all
@pytest.mark.parametrize("case", per_class(VARLEN_CASES, key=lambda c: (_route(c[2]), c[4])),
                         ids=str)
def test_sm100_varlen_backward_contract_gives_the_reference_gradients(case, monkeypatch,
                                                                      fresh_warning):
    """With the kernels replaced by contract-exact stand-ins, jax.grad through
    flash_attention_varlen(implementation="sm100") (work list, dq rows gathered from their
    tiles and scaled, GQA groups summed, zero dK / dV outside every sequence, a sink's gradient
    from delta) gives the reference's gradients (:func:`_varlen_oracle`), with NaN in every
    padding token of q, k, v and the cotangent (the rows after the last sequence that its tiles
    load are zeroed)."""
    h, hkv, d, kwargs, with_sink = case
    q, k, v, ct, cu_q, cu_k, max_q, max_k = _varlen_inputs(h, hkv, d, pad_value=jnp.nan)
    sink = jnp.linspace(-1.0, 1.0, h, dtype=jnp.float32) if with_sink else None
    calls = _varlen_emulated(monkeypatch, kwargs, d)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kernel serves: no fallback warning
        got = _varlen_grad_fn("sm100", ct, cu_q, cu_k, max_q, max_k, with_sink, **kwargs)(
            q, k, v, sink)
    if d in (192, 256):  # the split kernels' varlen mode
        split = sorted((c.part, c.gqa, c.varlen) for c, _, _ in calls
                       if c.kernel_name == "sm100_bwd_split")
        assert split == [("dkdv", h != hkv, True), ("dq", False, True)]
    else:
        (bwd,) = [c for c, _, _ in calls if c.kernel_name == "sm100_bwd"]
        assert bwd.varlen and bwd.gqa == (h != hkv) and bwd.head_dim == d
    monkeypatch.undo()
    _assert_grads_close(got, _varlen_oracle((q, k, v, sink), ct, cu_q, cu_k, kwargs))


@pytest.mark.parametrize("case", VARLEN_2CTA_CASES, ids=str)
def test_sm100_2cta_varlen_backward_contract_gives_the_reference_gradients(case, monkeypatch,
                                                                           fresh_warning):
    """At 192/128, with the kernels replaced by contract-exact stand-ins (the 2-CTA varlen
    config's: one work row per 256-key pair span, k / v rows loaded up to a span past each
    sequence), jax.grad through flash_attention_varlen(implementation="sm100") runs the 2-CTA
    varlen kernel and gives the reference's gradients (:func:`_varlen_oracle`), with NaN in 200
    padding tokens of q, k, v and the cotangent."""
    h, hkv, kwargs, with_sink = case
    q, k, v, ct, cu_q, cu_k, max_q, max_k = _varlen_inputs(h, hkv, 192, 128, pad_value=jnp.nan,
                                                           pad=200)
    sink = jnp.linspace(-1.0, 1.0, h, dtype=jnp.float32) if with_sink else None
    calls = _varlen_emulated(monkeypatch, kwargs, 192)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kernel serves: no fallback warning
        got = _varlen_grad_fn("sm100", ct, cu_q, cu_k, max_q, max_k, with_sink, **kwargs)(
            q, k, v, sink)
    (bwd,) = [c for c, _, _ in calls if c.kernel_name == "sm100_bwd"]
    assert bwd.varlen and bwd.two_cta and bwd.work_tile_n == 256 and bwd.gqa == (h != hkv)
    monkeypatch.undo()
    _assert_grads_close(got, _varlen_oracle((q, k, v, sink), ct, cu_q, cu_k, kwargs))


def test_sm100_varlen_backward_needs_the_padding_rows_zeroed(monkeypatch, fresh_warning):
    """The emulated kernel multiplies the rows past a sequence that its tiles load by zero, as
    the kernel does: without the backend's zeroing of the 128 rows after the last sequence, their
    NaN reaches the gradients of exactly the sequences (with queries and keys) whose last query
    or key tile reaches past the last sequence (not only the last one's: the sequences after a
    long one may be shorter than its last tile's overhang)."""
    from jax_fa4.backends import sm100

    q, k, v, ct, cu_q, cu_k, max_q, max_k = _varlen_inputs(2, 2, 64, pad_value=jnp.nan)
    _varlen_emulated(monkeypatch, {}, 64)
    monkeypatch.setattr(sm100, "zero_rows_from", lambda x, start, rows: x)
    dq, dk, dv = _varlen_grad_fn("sm100", ct, cu_q, cu_k, max_q, max_k)(q, k, v, None)
    cq, ck = np.asarray(cu_q), np.asarray(cu_k)
    lq, lk = np.diff(cq), np.diff(ck)
    reaches = ((cq[:-1] + -(-lq // 128) * 128 > cq[-1]) | (ck[:-1] + -(-lk // 128) * 128 > ck[-1]))
    poisoned = reaches & (lq > 0) & (lk > 0)
    assert poisoned.any() and not poisoned.all()
    for g, cu in ((dq, cq), (dk, ck), (dv, ck)):
        nan_rows = np.isnan(np.asarray(g, np.float32)).any(axis=(1, 2))
        want = np.zeros_like(nan_rows)
        for b in np.nonzero(poisoned)[0]:
            want[cu[b]:cu[b + 1]] = True
        np.testing.assert_array_equal(nan_rows, want)


@pytest.mark.parametrize("d", per_class([256, 192], key=lambda d: 0))  # quick tier: 256
def test_sm100_split_varlen_backward_needs_the_padding_rows_zeroed(monkeypatch, fresh_warning,
                                                                    d):
    """Head dims 256 and 192/192, as above for the split kernels' tiles: without the backend's
    zeroing, the NaN padding rows reach dK / dV of the sequences whose last 64-row query tile
    reaches past the last sequence (the dK/dV kernel streams q, dout) and dQ of those whose last
    64-key tile does (the dQ kernel streams k, v); with it, none (the contract test above)."""
    from jax_fa4.backends import sm100

    q, k, v, ct, cu_q, cu_k, max_q, max_k = _varlen_inputs(2, 2, d, pad_value=jnp.nan)
    _varlen_emulated(monkeypatch, {}, d)
    monkeypatch.setattr(sm100, "zero_rows_from", lambda x, start, rows: x)
    grads = _varlen_grad_fn("sm100", ct, cu_q, cu_k, max_q, max_k)(q, k, v, None)
    cq, ck = np.asarray(cu_q), np.asarray(cu_k)
    lq, lk = np.diff(cq), np.diff(ck)
    both = (lq > 0) & (lk > 0)
    by_q = both & (cq[:-1] + -(-lq // 64) * 64 > cq[-1])  # dK, dV
    by_k = both & (ck[:-1] + -(-lk // 64) * 64 > ck[-1])  # dQ
    assert by_q.any() and by_k.any() and not (by_q & by_k).all()
    for g, cu, poisoned in zip(grads, (cq, ck, ck), (by_k, by_q, by_q)):
        nan_rows = np.isnan(np.asarray(g, np.float32)).any(axis=(1, 2))
        want = np.zeros_like(nan_rows)
        for b in np.nonzero(poisoned)[0]:
            want[cu[b]:cu[b + 1]] = True
        np.testing.assert_array_equal(nan_rows, want)
