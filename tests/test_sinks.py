"""The learnable sink, against the brute-force form: one virtual key with score = sink, value 0.

Covers the reference's naive, blocked and explicit backward forms (plus
:func:`jax_fa4.reference.sink_gradient`), the differentiable core behind
``flash_attention(learnable_sink=...)``, and ``flash_attention`` itself once it takes the option.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import autodiff, options, reference

BLOCK_K = 8
TOL = dict(atol=2e-5, rtol=2e-5)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "window", "softcap"))
def brute_force(q, k, v, sink, *, softmax_scale=None, window=(None, None), softcap=0.0):
    """Attention with the sink as an extra, always-visible key of score ``sink`` and value 0,
    written independently in plain jnp (float32, differentiable with jax.grad)."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    scale = 1 / np.sqrt(d) if softmax_scale is None else softmax_scale
    kr, vr = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = scale * jnp.einsum("bihd,bjhd->bhij", q, kr, precision="highest")
    if softcap > 0:
        s = softcap * jnp.tanh(s / softcap)
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    left, right = window
    visible = np.ones((sq, sk), bool)
    if left is not None:
        visible &= j >= i + sk - sq - left
    if right is not None:
        visible &= j <= i + sk - sq + right
    s = jnp.where(visible, s, -jnp.inf)
    s = jnp.concatenate([s, jnp.broadcast_to(sink[None, :, None, None], (b, h, sq, 1))], -1)
    v_ext = jnp.concatenate([vr, jnp.zeros((b, 1, h, vr.shape[3]), vr.dtype)], axis=1)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    return jnp.einsum("bhij,bjhd->bihd", p, v_ext, precision="highest"), lse


CASES = [  # (b, sq, sk, h, hkv, d, dv, window, softcap, scale)
    (2, 9, 13, 4, 2, 16, 8, (None, None), 0.0, None),
    (1, 13, 6, 2, 1, 8, 8, (None, 0), 0.0, 0.5),  # causal, Sq > Sk: rows 0-6 see no key
    (2, 11, 11, 4, 4, 8, 16, (3, 2), 2.0, None),
]


def _inputs(case, seed, sink_values=None):
    b, sq, sk, h, hkv, d, dv = case[:7]
    rng = np.random.default_rng(seed)

    def randn(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * scale)

    q, k, v = randn(b, sq, h, d), randn(b, sk, hkv, d), randn(b, sk, hkv, dv)
    sink = randn(h, scale=2.0) if sink_values is None else jnp.asarray(sink_values, jnp.float32)
    return q, k, v, sink, randn(b, sq, h, dv), randn(b, h, sq)


def _options(case):
    window, softcap, scale = case[7:]
    return dict(window=window, softcap=softcap, softmax_scale=scale)


def _assert_close(got, want, name=""):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert np.isfinite(got).all(), name
    np.testing.assert_allclose(got, want, err_msg=name, **TOL)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_matches_brute_force(case):
    q, k, v, sink, _, _ = _inputs(case, seed=0)
    want_out, want_lse = brute_force(q, k, v, sink, **_options(case))
    for name, fn in (("naive", reference.attention),
                     ("blocked", functools.partial(reference.attention_blocked,
                                                   block_k=BLOCK_K))):
        out, lse = fn(q, k, v, learnable_sink=sink, **_options(case))
        _assert_close(out, want_out, f"{name} out")
        _assert_close(lse, want_lse, f"{name} lse")


def test_rows_without_keys_get_zero_output_and_lse_sink():
    case = CASES[1]
    q, k, v, sink, _, _ = _inputs(case, seed=1)
    for fn in (reference.attention, functools.partial(reference.attention_blocked, block_k=4)):
        out, lse = fn(q, k, v, learnable_sink=sink, **_options(case))
        assert (np.asarray(out[:, :7]) == 0).all()
        np.testing.assert_allclose(lse[:, :, :7], np.broadcast_to(sink[None, :, None], (1, 2, 7)),
                                   rtol=1e-6)


def test_extreme_sinks():
    """A sink far above the scores (the row max must include it) and a -inf sink (no sink)."""
    case = CASES[0]
    q, k, v, _, _, _ = _inputs(case, seed=2)
    big = jnp.asarray([80.0, -jnp.inf, 0.0, 30.0])
    want_out, want_lse = brute_force(q, k, v, big, **_options(case))
    plain_out, plain_lse = reference.attention(q, k, v, **_options(case))
    for fn in (reference.attention, functools.partial(reference.attention_blocked,
                                                      block_k=BLOCK_K)):
        out, lse = fn(q, k, v, learnable_sink=big, **_options(case))
        _assert_close(out, want_out, "out")
        _assert_close(lse, want_lse, "lse")
        _assert_close(out[:, :, 1], plain_out[:, :, 1], "-inf sink out")  # head 1: no sink
        _assert_close(lse[:, 1], plain_lse[:, 1], "-inf sink lse")


def _brute_force_grads(case, q, k, v, sink, dout, dlse):
    _, vjp = jax.vjp(functools.partial(brute_force, **_options(case)), q, k, v, sink)
    return vjp((dout, dlse))


NAMES = ("dq", "dk", "dv", "dsink")


@pytest.mark.parametrize("case", CASES, ids=str)
def test_gradients_match_brute_force(case):
    """dq, dk, dv and d sink with cotangents on both out and lse: autodiff of the naive form,
    and the custom_vjp core behind flash_attention(learnable_sink=...) under jit (the explicit
    backward plus sink_gradient)."""
    q, k, v, sink, dout, dlse = _inputs(case, seed=3)
    want = _brute_force_grads(case, q, k, v, sink, dout, dlse)
    def f(q, k, v, s):
        return reference.attention(q, k, v, learnable_sink=s, **_options(case))

    (out, lse), vjp = jax.vjp(f, q, k, v, sink)
    for name, got, w in zip(NAMES, vjp((dout, dlse)), want):
        _assert_close(got, w, f"vjp {name}")

    opts = options.canonicalize(q, k, v, softmax_scale=case[9], causal=False, window_size=case[7],
                            softcap=case[8], implementation=None)
    core = jax.jit(lambda q, k, v, s: autodiff.attention_with_extras(q, k, v, opts,
                                                                    learnable_sink=s))
    (out_c, lse_c), vjp = jax.vjp(core, q, k, v, sink)
    _assert_close(out_c, out, "core out")
    _assert_close(lse_c, lse, "core lse")
    for name, got, w in zip(NAMES, vjp((dout, dlse)), want):
        _assert_close(got, w, f"core {name}")


def test_blocked_gradients_match_brute_force():
    """Autodiff through the blocked forward, and the blocked explicit backward + sink_gradient,
    on the causal Sq > Sk case (rows without keys: lse = sink)."""
    case = CASES[1]
    q, k, v, sink, dout, dlse = _inputs(case, seed=4)
    want = _brute_force_grads(case, q, k, v, sink, dout, dlse)
    def f(q, k, v, s):
        return reference.attention_blocked(q, k, v, learnable_sink=s, block_k=4,
                                           **_options(case))

    (out, lse), vjp = jax.vjp(f, q, k, v, sink)
    for name, got, w in zip(NAMES, vjp((dout, dlse)), want):
        _assert_close(got, w, f"vjp blocked {name}")
    delta = jnp.einsum("bqhd,bqhd->bhq", out, dout, precision="highest") - dlse
    grads = reference.attention_backward(q, k, v, out, lse, dout, delta=delta, block_k=4,
                                         **_options(case))
    for name, got, w in zip(NAMES, (*grads, reference.sink_gradient(sink, lse, delta)), want):
        _assert_close(got, w, f"attention_backward(block_k=4) {name}")


def test_sink_gradient_by_finite_differences():
    """d sink of a scalar loss (cotangents on out and the finite lse) against central
    differences in float32 (loose tolerance)."""
    case = CASES[1]
    q, k, v, sink, dout, dlse = _inputs(case, seed=4)

    def loss(s):
        out, lse = reference.attention(q, k, v, learnable_sink=s, **_options(case))
        return jnp.sum(out * dout) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse)

    grad = jax.grad(loss)(sink)
    eps = 1e-2
    for h in range(sink.shape[0]):
        e = jnp.zeros_like(sink).at[h].set(eps)
        fd = (loss(sink + e) - loss(sink - e)) / (2 * eps)
        np.testing.assert_allclose(grad[h], fd, rtol=2e-2, atol=2e-3)


def test_sink_gradient_from_rows_matches_the_delta_form():
    """reference.sink_gradient_from_rows (the output's share summed by batch entry, as the
    Hopper backward kernel sums it, plus the lse cotangent's share) equals sink_gradient's
    ``-sum P_sink * (rowsum(dout * out) - dlse)`` on the same numbers, rows without keys
    (lse -inf, NaN cotangent there) left out; and it differs once the rows differ (the
    output's share is what the kernel changes)."""
    case = CASES[1]
    q, k, v, sink, dout, dlse = _inputs(case, seed=6)
    out, lse = reference.attention(q, k, v, learnable_sink=sink, **_options(case))
    lse = lse.at[:, :, 0].set(-jnp.inf)
    dlse = dlse.at[:, :, 0].set(jnp.nan)
    rowsum = jnp.einsum("bshd,bshd->bhs", out, dout)
    empty = jnp.isneginf(lse)
    p_sink = jnp.where(empty, 0.0, jnp.exp(sink[None, :, None] - jnp.where(empty, 0.0, lse)))
    rows = jnp.where(empty, 0.0, p_sink * rowsum).sum(axis=-1)  # (B, H)
    want = reference.sink_gradient(sink, lse, rowsum - dlse)
    got = reference.sink_gradient_from_rows(sink, lse, rows, dlse)
    np.testing.assert_allclose(got, want, **TOL)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(reference.sink_gradient_from_rows(sink, lse, rows, None),
                               -rows.sum(axis=0), **TOL)
    moved = reference.sink_gradient_from_rows(sink, lse, rows.at[0, 1].add(1.0), dlse)
    np.testing.assert_allclose(moved - got, np.eye(1, sink.shape[0], 1)[0] * -1.0, **TOL)


def test_sink_dtype_and_shape_checks():
    q, k, v, sink, _, _ = _inputs(CASES[0], seed=5)
    with pytest.raises(ValueError, match=r"learnable_sink must have shape \(H,\) = \(4,\)"):
        reference.attention(q, k, v, learnable_sink=sink[:3])
    with pytest.raises(ValueError, match=r"learnable_sink must have shape \(H,\) = \(4,\)"):
        options.check_learnable_sink(sink[:3], 4)
    with pytest.raises(TypeError, match="learnable_sink must have a floating dtype"):
        options.check_learnable_sink(jnp.zeros(4, jnp.int32), 4)
    with pytest.raises(TypeError, match="learnable_sink must be None or a jax.Array"):
        options.check_learnable_sink([0.0] * 4, 4)
    # A bfloat16 sink: float32 arithmetic, gradient in bfloat16.
    s16 = sink.astype(jnp.bfloat16)
    opts = options.canonicalize(q, k, v, softmax_scale=None, causal=False, window_size=(None, None),
                            softcap=0.0, implementation=None)
    g = jax.grad(lambda s: autodiff.attention_with_extras(q, k, v, opts, learnable_sink=s)[0]
                 .sum())(s16)
    assert g.dtype == jnp.bfloat16 and g.shape == (4,)


def test_forced_kernel_raises():
    q, k, v, sink, _, _ = _inputs(CASES[0], seed=6)
    opts = options.canonicalize(q, k, v, softmax_scale=None, causal=False, window_size=(None, None),
                            softcap=0.0, implementation="sm90")
    with pytest.raises(jax_fa4.ImplementationUnavailableError, match="learnable_sink"):
        autodiff.attention_with_extras(q, k, v, opts, learnable_sink=sink)


_API_HAS_SINK = "learnable_sink" in inspect.signature(jax_fa4.flash_attention).parameters


@pytest.mark.skipif(not _API_HAS_SINK, reason="flash_attention has no learnable_sink yet")
def test_flash_attention_learnable_sink():
    case = CASES[2]
    q, k, v, sink, dout, dlse = _inputs(case, seed=7)
    f = jax.jit(lambda q, k, v, s: jax_fa4.flash_attention(
        q, k, v, learnable_sink=s, window_size=case[7], softcap=case[8], return_lse=True))
    (out, lse), vjp = jax.vjp(f, q, k, v, sink)
    want_out, want_lse = brute_force(q, k, v, sink, **_options(case))
    _assert_close(out, want_out, "out")
    _assert_close(lse, want_lse, "lse")
    for name, got, w in zip(NAMES, vjp((dout, dlse)),
                            _brute_force_grads(case, q, k, v, sink, dout, dlse)):
        _assert_close(got, w, name)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_route_hands_the_sink_to_the_backend_forward(case, monkeypatch):
    """flash_attention(learnable_sink=..., implementation="sm90") runs the kernel chain
    (jax_fa4.autodiff.attention_with_sink): the sink is the backend forward's own operand (the
    Hopper kernels join it inside their softmax); with the reference standing in for the sm90
    backend (a registered subclass of the reference) the outputs and the gradients of q, k, v
    and the sink equal the brute-force form's."""
    from jax_fa4 import backends
    from jax_fa4.backends import base

    calls = []

    class Sm90Stand_in(base.Backend):
        name = "sm90"

        def forward(self, q, k, v, opts, sink=None):
            calls.append((opts.implementation, sink is not None))
            return super().forward(q, k, v, opts, sink=sink)

    monkeypatch.setitem(backends.BACKENDS, "sm90", Sm90Stand_in())
    q, k, v, sink, _, _ = _inputs(case, seed=11)
    window, softcap, scale = case[7], case[8], case[9]

    def loss(fn):
        def f(q, k, v, s):
            out, lse = fn(q, k, v, s)
            return (out * jnp.cos(out)).sum() + (lse * jnp.sin(lse)).sum(), (out, lse)
        return jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)

    api_fn = lambda q, k, v, s: jax_fa4.flash_attention(  # noqa: E731
        q, k, v, softmax_scale=scale, window_size=window, softcap=softcap, learnable_sink=s,
        return_lse=True, implementation="sm90")
    brute = lambda q, k, v, s: brute_force(  # noqa: E731
        q, k, v, s, softmax_scale=scale, window=window, softcap=softcap)
    (_, (out, lse)), grads = loss(api_fn)(q, k, v, sink)
    (_, (want_out, want_lse)), want_grads = loss(brute)(q, k, v, sink)
    assert calls and set(calls) == {("sm90", True)}, "the kernel route did not get the sink"
    np.testing.assert_allclose(out, want_out, **TOL)
    np.testing.assert_allclose(lse, want_lse, **TOL)
    for name, g, w in zip("q k v sink".split(), grads, want_grads):
        np.testing.assert_allclose(g, w, err_msg=name, atol=5e-5, rtol=5e-5)
