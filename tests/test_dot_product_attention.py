"""``jax_fa4.dot_product_attention`` against ``jax.nn.dot_product_attention`` (XLA), on the CPU.

Every documented argument of jax.nn's function and their combinations (GQA / MQA, T != S both
ways, sequence lengths with causal and windows, windows of every sign, residuals, bias and mask,
3-dim inputs) go through both, float32 agreeing to 1e-5 in the output, the residual and the
gradients; a second test shows the cases catch a wrong window mapping (flash_attention's own
bottom-right alignment, or a window one key too wide); and the errors, the pass-through of
``implementation="xla" / "cudnn"``, jit, vmap and export.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import nn as fa4_nn

ATOL = 1e-5

# (B, T, S, N, K, H)
SHAPES = {"mha": (2, 9, 9, 4, 4, 16), "gqa-t<s": (2, 7, 13, 4, 2, 16),
          "mqa-t>s": (2, 13, 6, 6, 1, 8)}
Q_LEN = {"mha": [4, 9], "gqa-t<s": [0, 5], "mqa-t>s": [13, 2]}
KV_LEN = {"mha": [9, 3], "gqa-t<s": [13, 0], "mqa-t>s": [1, 6]}
OPTIONS = {
    "none": {},
    "causal": {"is_causal": True},
    "window-int": {"local_window_size": 2},
    "window-left": {"local_window_size": (3, 0)},
    "window-right": {"local_window_size": (0, 2)},
    "window-wide": {"local_window_size": (1, 20)},
    "window-negative-right": {"local_window_size": (4, -2)},
    "window-negative-left": {"local_window_size": (-1, 3)},
    "window-empty": {"local_window_size": (-3, 1)},
    "causal-window-scale": {"is_causal": True, "local_window_size": (2, 3), "scale": 0.3},
}
LENGTHS = ["none", "kv", "both"]  # (query lengths alone: in the gradient cases)


def _inputs(shape, dtype=jnp.float32, seed=0):
    b, t, s, n, k, h = shape
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (b, t, n, h), dtype), jax.random.normal(kk, (b, s, k, h), dtype),
            jax.random.normal(kv, (b, s, k, h), dtype))


def _lengths(shape_name, which):
    q = jnp.asarray(Q_LEN[shape_name], jnp.int32) if which in ("q", "both") else None
    kv = jnp.asarray(KV_LEN[shape_name], jnp.int32) if which in ("kv", "both") else None
    return {"query_seq_lengths": q, "key_value_seq_lengths": kv}


def _both(q, k, v, **kw):
    want = jax.nn.dot_product_attention(q, k, v, return_residual=True, **kw)
    got = jax_fa4.dot_product_attention(q, k, v, return_residual=True, **kw)
    return got, want


def _assert_same(got, want, atol=ATOL):
    for name, g, w in zip(("output", "residual"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   atol=atol, rtol=atol, err_msg=name)


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_jax_nn(shape, opts, lengths):
    q, k, v = _inputs(SHAPES[shape])
    got, want = _both(q, k, v, **OPTIONS[opts], **_lengths(shape, lengths))
    _assert_same(got, want)


@pytest.mark.parametrize("opts", ["causal", "window-left", "window-wide",
                                  "causal-window-scale"])
@pytest.mark.parametrize("shape", ["gqa-t<s", "mqa-t>s"])
def test_the_cases_catch_a_wrong_window_mapping(shape, opts):
    """flash_attention's bottom-right alignment, or a window one key wider each side, as the
    mapping:
    the comparison above sees the difference."""
    q, k, v = _inputs(SHAPES[shape])
    kw = OPTIONS[opts]
    want = jax.nn.dot_product_attention(q, k, v, **kw)
    left, right = kw.get("local_window_size", (None, None))
    if kw.get("is_causal"):
        right = 0
    bottom_right = jax_fa4.flash_attention(q, k, v, window_size=(left, right),
                                           softmax_scale=kw.get("scale"))
    unbounded = q.shape[1] + k.shape[1]
    wider_window = tuple(unbounded if w is None else w + 1 for w in (left, right))  # +1 key
    wider = jax.nn.dot_product_attention(q, k, v, scale=kw.get("scale"),
                                         local_window_size=wider_window)
    for wrong in (bottom_right, wider):
        assert float(jnp.max(jnp.abs(wrong - want))) > 100 * ATOL


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_inputs(dtype):
    shape = SHAPES["gqa-t<s"]
    q, k, v = _inputs(shape, dtype)
    got, want = _both(q, k, v, is_causal=True, **_lengths("gqa-t<s", "both"))
    # residual of padding / empty rows: -0.7 * float32 max in the key's dtype (-inf in float16)
    np.testing.assert_array_equal(np.asarray(got[1][0, :, :]).astype(np.float32),
                                  np.asarray(want[1][0, :, :]).astype(np.float32))
    _assert_same(got, want, atol=2e-2)


@pytest.mark.parametrize("which", ["bias", "mask", "both"])
def test_bias_and_mask_run_jax_nn(which, monkeypatch):
    shape = SHAPES["gqa-t<s"]
    b, t, s, n = shape[:4]
    q, k, v = _inputs(shape)
    kw = dict(is_causal=True, **_lengths("gqa-t<s", "kv"))
    if which in ("bias", "both"):
        kw["bias"] = jax.random.normal(jax.random.key(5), (1, n, t, s))
    if which in ("mask", "both"):
        kw["mask"] = jax.random.bernoulli(jax.random.key(6), 0.6, (b, 1, t, s))
    monkeypatch.setattr(fa4_nn, "_warn_mask_fallback", fa4_nn._warn_mask_fallback.__wrapped__)
    with pytest.warns(RuntimeWarning, match="explicit bias or mask"):
        got, want = _both(q, k, v, **kw)
    _assert_same(got, want, atol=0)
    with pytest.raises(ValueError, match="on_mask='raise'"):
        jax_fa4.dot_product_attention(q, k, v, on_mask="raise", **kw)
    with pytest.raises(jax_fa4.ImplementationUnavailableError, match="bias or mask"):
        jax_fa4.dot_product_attention(q, k, v, implementation="sm90", **kw)


def test_mask_fallback_warns_once():
    q, k, v = _inputs(SHAPES["mha"])
    mask = jnp.ones((1, 1, 9, 9), bool)
    fa4_nn._warn_mask_fallback.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            jax_fa4.dot_product_attention(q, k, v, mask=mask)
    assert len([w for w in caught if "explicit bias or mask" in str(w.message)]) == 1


@pytest.mark.parametrize("opts", ["none", "causal", "window-negative-right"])
def test_three_dim_inputs(opts):
    q, k, v = (x[0] for x in _inputs(SHAPES["gqa-t<s"]))
    got, want = _both(q, k, v, **OPTIONS[opts])
    assert got[0].shape == q.shape and got[1].shape == q.shape[:2]
    _assert_same(got, want)


@pytest.mark.parametrize("implementation", ["xla", "cudnn"])
def test_jax_implementations_pass_through(implementation, monkeypatch):
    calls = []

    def recorder(*args, **kwargs):
        calls.append((args, kwargs))
        return "result"

    monkeypatch.setattr(jax.nn, "dot_product_attention", recorder)
    q, k, v = _inputs(SHAPES["mha"])
    lengths = jnp.asarray([3, 4], jnp.int32)
    kw = dict(scale=0.5, is_causal=True, query_seq_lengths=lengths,
              key_value_seq_lengths=lengths, local_window_size=3,
              implementation=implementation, return_residual=True)
    assert jax_fa4.dot_product_attention(q, k, v, None, None, **kw) == "result"
    (args, kwargs), = calls
    assert args == (q, k, v, None, None) and kwargs == kw


def test_xla_gives_jax_nn_exactly():
    q, k, v = _inputs(SHAPES["mha"])
    got = jax_fa4.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_array_equal(got, jax.nn.dot_product_attention(q, k, v, is_causal=True))


def test_signature_is_jax_nns_plus_on_mask():
    import inspect

    ours = inspect.signature(jax_fa4.dot_product_attention).parameters
    theirs = inspect.signature(jax.nn.dot_product_attention).parameters
    assert list(ours) == [*theirs, "on_mask"]
    for name, p in theirs.items():
        assert (ours[name].kind, ours[name].default) == (p.kind, p.default), name


GRAD_CASES = {
    "causal-lengths": ("gqa-t<s", {"is_causal": True, **_lengths("gqa-t<s", "both")}),
    "window-t>s": ("mqa-t>s", {"local_window_size": (3, 1), **_lengths("mqa-t>s", "kv")}),
    "window-negative": ("mha", {"local_window_size": (4, -2), **_lengths("mha", "q")}),
    "plain": ("gqa-t<s", {"scale": 0.25}),
}


@pytest.mark.parametrize("case", GRAD_CASES)
def test_gradients_match(case):
    shape, kw = GRAD_CASES[case]
    q, k, v = _inputs(SHAPES[shape])
    w = jax.random.normal(jax.random.key(9), q.shape)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, **kw) * w)

    # (jitted: one compiled program each, not the gradient's operations one by one)
    got = jax.jit(jax.grad(loss(jax_fa4.dot_product_attention), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss(jax.nn.dot_product_attention), argnums=(0, 1, 2)))(q, k, v)
    for name, g, r in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, r, atol=ATOL, rtol=ATOL, err_msg=name)


def test_jit_with_traced_lengths_does_not_retrace():
    q, k, v = _inputs(SHAPES["gqa-t<s"])
    traces = []

    @jax.jit
    def f(q, k, v, ql, kl):
        traces.append(1)
        return jax_fa4.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=ql,
                                             key_value_seq_lengths=kl, return_residual=True)

    for ql, kl in (([0, 5], [13, 0]), ([7, 2], [3, 13])):
        ql, kl = jnp.asarray(ql, jnp.int32), jnp.asarray(kl, jnp.int32)
        want = jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=ql,
                                            key_value_seq_lengths=kl, return_residual=True)
        _assert_same(f(q, k, v, ql, kl), want)
    assert len(traces) == 1


def test_vmap_and_export():
    q, k, v = _inputs(SHAPES["mqa-t>s"])
    kl = jnp.asarray(KV_LEN["mqa-t>s"], jnp.int32)

    def f(fn):
        return lambda q, k, v: fn(q, k, v, local_window_size=(2, 1), key_value_seq_lengths=kl)

    stack = lambda x: jnp.stack([x, 2 * x])  # noqa: E731
    got = jax.jit(jax.vmap(f(jax_fa4.dot_product_attention)))(stack(q), stack(k), stack(v))
    want = jax.jit(jax.vmap(f(jax.nn.dot_product_attention)))(stack(q), stack(k), stack(v))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=ATOL)
    exported = jax.export.export(jax.jit(f(jax_fa4.dot_product_attention)),
                                 disabled_checks=jax_fa4.export_disabled_safety_checks())(q, k, v)
    np.testing.assert_allclose(exported.call(q, k, v), want[0], atol=ATOL, rtol=ATOL)


def _bad(name):
    q, k, v = _inputs(SHAPES["gqa-t<s"])  # (2, 7, 4, 16), (2, 13, 2, 16)
    i32 = jnp.int32
    cases = {
        "query-type": ((q.tolist(), k, v), {}, TypeError, "query must be a jax.Array"),
        "query-rank": ((q[0, 0], k, v), {}, ValueError, r"query must have shape \(B, T, N, H\)"),
        "key-rank": ((q, k[0], v), {}, ValueError, "key must have query's rank 4"),
        "dtype": (tuple(x.astype(jnp.int32) for x in (q, k, v)), {}, TypeError,
                  "query must have a floating dtype .*got int32"),
        "key-dtype": ((q, k.astype(jnp.bfloat16), v), {}, TypeError,
                      "key must have query's dtype float32, got bfloat16"),
        "value-shape": ((q, k, v[:, :5]), {}, ValueError, "value must have key's shape"),
        "head-dim": ((q[..., :8], k, v), {}, ValueError, "same batch size and head dim"),
        "heads": ((q[:, :, :3], k, v), {}, ValueError, "N=3 must be a multiple of .* K=2"),
        "scale": ((q, k, v), {"scale": -1.0}, ValueError, "scale must be a finite number > 0"),
        "is_causal": ((q, k, v), {"is_causal": 1}, TypeError, "is_causal must be a bool"),
        "residual": ((q, k, v), {"return_residual": None}, TypeError,
                     "return_residual must be a bool"),
        "window": ((q, k, v), {"local_window_size": (1, None)}, TypeError,
                   "local_window_size must be None, an int or a pair"),
        "window-len": ((q, k, v), {"local_window_size": (1, 2, 3)}, TypeError,
                       "local_window_size must be"),
        "q-lengths-shape": ((q, k, v), {"query_seq_lengths": jnp.zeros((3,), i32)}, ValueError,
                            r"query_seq_lengths must have shape \(B,\) = \(2,\), got \(3,\)"),
        "kv-lengths-dtype": ((q, k, v), {"key_value_seq_lengths": jnp.zeros((2,))}, TypeError,
                             "key_value_seq_lengths must have an integer dtype"),
        "kv-lengths-type": ((q, k, v), {"key_value_seq_lengths": [1, 2]}, TypeError,
                            "key_value_seq_lengths must be an int32 array"),
        "implementation": ((q, k, v), {"implementation": "triton"}, ValueError,
                           "implementation must be None or one of .*'xla', 'cudnn'"),
        "on_mask": ((q, k, v), {"on_mask": "ignore"}, ValueError, "on_mask must be one of"),
    }
    return cases[name]


@pytest.mark.parametrize("name", ["query-type", "query-rank", "key-rank", "dtype", "key-dtype",
                                  "value-shape", "head-dim", "heads", "scale", "is_causal",
                                  "residual", "window", "window-len", "q-lengths-shape",
                                  "kv-lengths-dtype", "kv-lengths-type", "implementation",
                                  "on_mask"])
def test_errors_name_the_argument(name):
    args, kw, error, match = _bad(name)
    with pytest.raises(error, match=match):
        jax_fa4.dot_product_attention(*args, **kw)


def test_float64_and_complex_run_jax_nns_own_implementation():
    """float64 (x64) and complex inputs, which no kernel or float32 reference takes, give
    exactly jax.nn's XLA implementation's results in their own dtype; a forced kernel raises."""
    try:
        from jax import enable_x64
    except ImportError:  # older jax
        from jax.experimental import enable_x64
    with enable_x64():
        q, k, v = (x.astype(jnp.float64) for x in _inputs((2, 9, 11, 4, 2, 8)))
        kw = dict(is_causal=True, key_value_seq_lengths=jnp.array([11, 5], jnp.int32))
        got = jax_fa4.dot_product_attention(q, k, v, **kw)
        assert got.dtype == jnp.float64
        want = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        with pytest.raises(jax_fa4.ImplementationUnavailableError, match="float64"):
            jax_fa4.dot_product_attention(q, k, v, implementation="sm90")
    q, k, v = (x.astype(jnp.complex64) for x in _inputs((1, 5, 5, 2, 2, 4)))
    got = jax_fa4.dot_product_attention(q, k, v)
    assert got.dtype == jnp.complex64
    np.testing.assert_array_equal(np.asarray(got), np.asarray(
        jax.nn.dot_product_attention(q, k, v, implementation="xla")))
