"""jax_fa4.flax: the NNX and Linen modules and the attention_fn, against plain JAX and Flax."""

from __future__ import annotations

import math

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import per_class
from flax import nnx

import jax_fa4
from jax_fa4.flax import (AttentionFn, LinenMultiHeadAttention, LinenMultiHeadAttentionAlias,
                          MultiHeadAttention, attention_fn)

try:
    from jax import enable_x64
except ImportError:  # jax < 0.8
    from jax.experimental import enable_x64

TOL = 2e-5
F, B, S = 32, 2, 12


def _normal(seed, shape):
    """Standard normal test inputs of JAX's default float dtype (float64 under x64), drawn by
    NumPy: no XLA program to compile per shape."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


def _x(seed=1, shape=(B, S, F)):
    return _normal(seed, shape)


def plain_attention_layer(w, x, *, heads, kv_heads, causal=False, window=(None, None),
                          softcap=0.0, mask=None, sink=None):
    """The layer written out in plain JAX: projections, softmax attention, output projection.

    ``w`` maps query/key/value/out to (kernel, bias); kernels (F, heads, D) and (H, D, F).
    ``sink`` (heads,): one more logit per head in every row's softmax, with no value.
    """
    proj = lambda name, t: jnp.einsum("bsf,fhd->bshd", t, w[name][0]) + w[name][1]  # noqa: E731
    q, k, v = proj("query", x), proj("key", x), proj("value", x)
    k, v = (jnp.repeat(t, heads // kv_heads, axis=2) for t in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    i, j = np.arange(x.shape[1])[:, None], np.arange(x.shape[1])[None, :]
    visible = np.ones((x.shape[1],) * 2, bool)
    left, right = (None, 0) if causal else window
    if left is not None:
        visible &= j >= i - left
    if right is not None:
        visible &= j <= i + right
    if mask is not None:
        visible = visible & mask
    s = jnp.where(visible, s, -jnp.inf)
    if sink is not None:  # the sink's column, dropped after the softmax
        column = jnp.broadcast_to(sink[None, :, None, None], (*s.shape[:3], 1))
        p = jax.nn.softmax(jnp.concatenate([s, column], axis=-1), axis=-1)[..., :-1]
    else:
        p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return jnp.einsum("bqhd,hdf->bqf", o, w["out"][0]) + w["out"][1]


def nnx_weights(m):
    return {n: (getattr(m, n).kernel[...], getattr(m, n).bias[...])
            for n in ("query", "key", "value", "out")}


def linen_weights(params):
    p = params["params"]
    return {n: (p[n]["kernel"], p[n]["bias"]) for n in ("query", "key", "value", "out")}


def close(a, b, tol=TOL):
    err = float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))
    assert err <= tol, err


LAYERS = [
    dict(heads=4, kv_heads=4),
    dict(heads=4, kv_heads=2, causal=True),
    dict(heads=4, kv_heads=1, window=(3, 1)),
    dict(heads=2, kv_heads=2, causal=True, softcap=5.0),
]


# -- NNX ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer", per_class(LAYERS, key=lambda layer: "causal" in layer))
def test_nnx_module_matches_plain_jax_forward_and_gradients(layer):
    m = MultiHeadAttention(num_heads=layer["heads"], in_features=F,
                           num_kv_heads=layer["kv_heads"], causal=layer.get("causal", False),
                           window_size=layer.get("window", (None, None)),
                           softcap=layer.get("softcap", 0.0), decode=False, rngs=nnx.Rngs(0))
    x = _x()
    plain = lambda w, x: plain_attention_layer(  # noqa: E731
        w, x, heads=layer["heads"], kv_heads=layer["kv_heads"],
        causal=layer.get("causal", False), window=layer.get("window", (None, None)),
        softcap=layer.get("softcap", 0.0))
    close(nnx.jit(lambda m, x: m(x))(m, x), plain(nnx_weights(m), x))
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(jnp.sin(m(x)))))(m)
    want = jax.jit(jax.grad(lambda w: jnp.sum(jnp.sin(plain(w, x)))))(nnx_weights(m))
    for name in ("query", "key", "value", "out"):
        close(getattr(grads, name).kernel[...], want[name][0], 1e-4)
        close(getattr(grads, name).bias[...], want[name][1], 1e-4)


def test_nnx_module_is_a_drop_in_for_flax_module():
    kw = dict(num_heads=4, in_features=F, qkv_features=16, out_features=24, num_kv_heads=2,
              decode=False)
    ours = MultiHeadAttention(**kw, rngs=nnx.Rngs(3))
    theirs = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(3))
    x, kv = _x(), _x(2, (B, 7, F))
    # Same parameters (names, shapes, values), same outputs, self- and cross-attention.
    assert (jax.tree.map(jnp.shape, nnx.state(ours, nnx.Param))
            == jax.tree.map(jnp.shape, nnx.state(theirs, nnx.Param)))
    close(ours(x, is_causal=True), theirs(x, is_causal=True))
    close(ours(x, kv), theirs(x, kv))


def test_nnx_module_jits_and_runs_bfloat16():
    m = MultiHeadAttention(num_heads=4, in_features=F, causal=True, dtype=jnp.bfloat16,
                           decode=False, rngs=nnx.Rngs(0))
    y = nnx.jit(lambda m, x: m(x))(m, _x())
    assert y.dtype == jnp.bfloat16 and y.shape == (B, S, F)
    ref = MultiHeadAttention(num_heads=4, in_features=F, causal=True, decode=False,
                             rngs=nnx.Rngs(0))(_x())
    close(y, ref, 0.1)


def test_nnx_decode_matches_full_causal_attention():
    kw = dict(num_heads=4, in_features=F, num_kv_heads=2, causal=True)
    full = MultiHeadAttention(**kw, decode=False, rngs=nnx.Rngs(0))
    step = MultiHeadAttention(**kw, decode=True, rngs=nnx.Rngs(0))
    x = _x()
    step.init_cache(x.shape)
    close(jnp.concatenate([step(x[:, i:i + 1]) for i in range(S)], axis=1), full(x))


# -- Linen -------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer", LAYERS)
def test_linen_module_matches_plain_jax(layer):
    m = LinenMultiHeadAttention(num_heads=layer["heads"], num_kv_heads=layer["kv_heads"],
                                causal=layer.get("causal", False),
                                window_size=layer.get("window", (None, None)),
                                softcap=layer.get("softcap", 0.0))
    x = _x()
    params = m.init(jax.random.key(0), x)
    assert params["params"]["key"]["kernel"].shape == (F, layer["kv_heads"], F // layer["heads"])
    close(m.apply(params, x), plain_attention_layer(
        linen_weights(params), x, heads=layer["heads"], kv_heads=layer["kv_heads"],
        causal=layer.get("causal", False), window=layer.get("window", (None, None)),
        softcap=layer.get("softcap", 0.0)))


def test_linen_module_is_a_drop_in_for_flax_module():
    x = _x()
    ours = LinenMultiHeadAttention(num_heads=4, qkv_features=16, causal=True)
    params = ours.init(jax.random.key(0), x)
    theirs = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=16)
    assert (jax.tree.map(jnp.shape, params)
            == jax.tree.map(jnp.shape, theirs.init(jax.random.key(0), x)))
    close(ours.apply(params, x),
          theirs.apply(params, x, mask=nn.make_causal_mask(jnp.ones((B, S)))))


def test_linen_decode_matches_full_causal_attention():
    m = LinenMultiHeadAttention(num_heads=4, num_kv_heads=2, causal=True, decode=True)
    x = _x()
    variables = m.init(jax.random.key(0), x)
    cache, outs = variables["cache"], []
    for i in range(S):
        y, updates = m.apply({"params": variables["params"], "cache": cache}, x[:, i:i + 1],
                             mutable=["cache"])
        cache = updates["cache"]
        outs.append(y)
    full = LinenMultiHeadAttention(num_heads=4, num_kv_heads=2, causal=True)
    close(jnp.concatenate(outs, axis=1), full.apply({"params": variables["params"]}, x))


# -- attention_fn in Flax's own modules --------------------------------------------------------
def test_attention_fn_inside_nnx_multi_head_attention():
    kw = dict(num_heads=4, in_features=F, num_kv_heads=2, decode=False)
    theirs = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
    ours = nnx.MultiHeadAttention(**kw, attention_fn=attention_fn, rngs=nnx.Rngs(0))
    x = _x()
    close(ours(x), theirs(x))
    close(ours(x, is_causal=True), theirs(x, is_causal=True))
    windowed = nnx.MultiHeadAttention(**kw, attention_fn=AttentionFn(window_size=(2, 0)),
                                      rngs=nnx.Rngs(0))
    close(windowed(x), plain_attention_layer(nnx_weights(theirs), x, heads=4, kv_heads=2,
                                             window=(2, 0)))


def test_attention_fn_inside_linen_module():
    x = _x()
    theirs = nn.MultiHeadDotProductAttention(num_heads=4)
    params = theirs.init(jax.random.key(0), x)
    ours = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=AttentionFn(causal=True))
    close(ours.apply(params, x),
          theirs.apply(params, x, mask=nn.make_causal_mask(jnp.ones((B, S)))))


def _qkv(lead=(B,), sq=S, sk=S, h=4, hkv=2, d=8):
    return (_normal(5, (*lead, sq, h, d)), _normal(6, (*lead, sk, hkv, d)),
            _normal(7, (*lead, sk, hkv, d)))


@pytest.mark.parametrize("lead", [(), (B,), (2, 3)])
def test_attention_fn_batch_dims(lead):
    q, k, v = _qkv(lead)
    got = jax.jit(lambda q, k, v: attention_fn(q, k, v, is_causal=True))(q, k, v)
    want = jax.jit(lambda q, k, v: nnx.dot_product_attention(q, k, v, is_causal=True))(q, k, v)
    assert got.shape == want.shape
    close(got, want)


def test_mask_and_bias_fall_back_to_masked_attention():
    q, k, v = _qkv(sk=9)
    pad = jnp.arange(9) < jnp.array([9, 5])[:, None]  # (B, Sk): key padding
    mask = nnx.make_attention_mask(jnp.ones((B, S), bool), pad, dtype=bool)  # (B, 1, Sq, Sk)
    bias = _normal(8, (1, 4, S, 9))
    ours = jax.jit(lambda q, k, v, bias, mask: attention_fn(q, k, v, bias=bias, mask=mask))
    flax_ = jax.jit(lambda q, k, v, bias, mask: nnx.dot_product_attention(q, k, v, bias=bias,
                                                                          mask=mask))
    close(ours(q, k, v, None, mask), flax_(q, k, v, None, mask))
    close(ours(q, k, v, bias, mask), flax_(q, k, v, bias, mask))
    qs, ks, vs = _qkv()
    causal = nnx.make_causal_mask(jnp.ones((B, S)))
    close(ours(qs, ks, vs, None, causal), attention_fn(qs, ks, vs, is_causal=True))
    # Gradients flow through the fallback.
    g = jax.jit(jax.grad(lambda q: jnp.sum(ours(q, k, v, bias, mask))))(q)
    g0 = jax.jit(jax.grad(lambda q: jnp.sum(flax_(q, k, v, bias, mask))))(q)
    close(g, g0, 1e-4)


def test_fallback_rows_with_no_visible_key_are_zero():
    q, k, v = _qkv()
    mask = jnp.ones((B, 1, S, S), bool).at[:, :, 3].set(False)
    out = attention_fn(q, k, v, mask=mask)
    assert jnp.all(out[:, 3] == 0) and bool(jnp.all(jnp.isfinite(out)))


# -- what cannot be honoured raises ------------------------------------------------------------
def test_unsupported_features_raise_clear_errors():
    q, k, v = _qkv()
    mask = jnp.ones((B, 1, S, S), bool)
    cases = [
        (lambda: attention_fn(q, k, v, dropout_rate=0.1, deterministic=False),
         NotImplementedError, "dropout"),
        (lambda: AttentionFn(on_mask="raise")(q, k, v, mask=mask), ValueError, "is_causal"),
        (lambda: attention_fn(q, k, v, module=object()), ValueError, "sow_weights"),
        (lambda: attention_fn(q, k, v, input_positions=jnp.arange(S)), TypeError, "RoPE"),
        (lambda: AttentionFn(on_mask="ignore"), ValueError, "on_mask"),
        (lambda: MultiHeadAttention(num_heads=4, in_features=F, attention_fn=attention_fn,
                                    rngs=nnx.Rngs(0)), TypeError, "attention_fn"),
        (lambda: MultiHeadAttention(num_heads=4, in_features=F, window_size=(-2, 0),
                                    rngs=nnx.Rngs(0)), ValueError, "window_size"),
        (lambda: LinenMultiHeadAttention(num_heads=4, softcap=-1.0).init(
            jax.random.key(0), _x()), ValueError, "softcap"),
    ]
    for fn, exc, word in cases:
        with pytest.raises(exc, match=word):
            fn()
    # Dropout configured but off (deterministic) is fine.
    m = MultiHeadAttention(num_heads=4, in_features=F, dropout_rate=0.1, decode=False,
                           rngs=nnx.Rngs(0))
    assert m(_x(), deterministic=True).shape == (B, S, F)
    with pytest.raises(NotImplementedError, match="dropout"):
        m(_x(), deterministic=False)
    windowed = MultiHeadAttention(num_heads=4, in_features=F, window_size=(4, 0), decode=True,
                                  rngs=nnx.Rngs(0))
    windowed.init_cache((B, S, F))
    with pytest.raises(ValueError, match="window_size"):
        windowed(_x()[:, :1])


def test_flax_layers_load_lazily_from_the_package():
    assert jax_fa4.flax.MultiHeadAttention is MultiHeadAttention


# -- packed rows and max logits ----------------------------------------------------------------
def _packed(b=2, s=40):
    ids = np.repeat([0, 1, 2], [10, 18, 12])[None].repeat(b, 0)
    return jnp.asarray(ids + np.arange(b)[:, None] * 5, jnp.int32)


def test_nnx_segment_ids_and_sown_max_logits():
    """segment_ids per call reach flash_attention (each document attends only to itself, so a
    document run alone gives the same rows), and sow_max_logits stores the per-(batch, head)
    max logits that return_max_logits gives, also under nnx.jit."""
    layer = MultiHeadAttention(num_heads=4, in_features=32, num_kv_heads=2, causal=True,
                               decode=False, sow_max_logits=True, rngs=nnx.Rngs(0))
    x = _normal(1, (2, 40, 32))
    ids = _packed()
    y = layer(x, segment_ids=ids)
    sown = nnx.pop(layer, nnx.Intermediate)["max_logits"].get_value()
    assert len(sown) == 1 and sown[0].shape == (2, 4)
    alone = layer(x[:, 10:28], segment_ids=ids[:, 10:28])
    np.testing.assert_allclose(y[:, 10:28], alone, atol=1e-5)
    nnx.pop(layer, nnx.Intermediate)
    q = layer.query(x)
    k = layer.key(x)
    _, want = jax_fa4.flash_attention(q, k, k, causal=True, segment_ids=ids,
                                      return_max_logits=True)
    np.testing.assert_allclose(sown[0], want, rtol=1e-5)
    y_jit = nnx.jit(lambda m, x, ids: m(x, segment_ids=ids))(layer, x, ids)
    np.testing.assert_allclose(y_jit, y, atol=1e-5)
    assert nnx.pop(layer, nnx.Intermediate)["max_logits"].get_value()[0].shape == (2, 4)
    plain = MultiHeadAttention(num_heads=4, in_features=32, num_kv_heads=2, causal=True,
                               decode=False, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(plain(x, segment_ids=ids), y, atol=1e-5)  # same params
    assert not nnx.state(plain, nnx.Intermediate)


def test_linen_segment_ids_and_sown_max_logits():
    layer = LinenMultiHeadAttention(num_heads=4, causal=True, sow_max_logits=True)
    x = _normal(2, (2, 40, 32))
    ids = _packed()
    params = layer.init(jax.random.key(0), x, segment_ids=ids)
    y, state = layer.apply(params, x, segment_ids=ids, mutable=["intermediates"])
    (max_logits,) = state["intermediates"]["max_logits"]
    assert max_logits.shape == (2, 4)
    alone = layer.apply(params, x[:, 28:], segment_ids=ids[:, 28:], mutable=["intermediates"])[0]
    np.testing.assert_allclose(y[:, 28:], alone, atol=1e-5)


def test_attention_fn_segment_ids_with_batch_dims_and_bad_shapes():
    q = _normal(3, (3, 2, 40, 4, 16))
    ids = jnp.stack([_packed()] * 3)  # (3, 2, 40)
    got = attention_fn(q, q, q, segment_ids=ids)
    want = jax_fa4.flash_attention(q.reshape(6, 40, 4, 16), q.reshape(6, 40, 4, 16),
                                   q.reshape(6, 40, 4, 16), segment_ids=ids.reshape(6, 40))
    np.testing.assert_allclose(got.reshape(want.shape), want, atol=1e-6)
    with pytest.raises(ValueError, match=r"segment_ids: q_segment_ids must have shape"):
        attention_fn(q, q, q, segment_ids=ids[:, :, :39])
    with pytest.raises(ValueError, match="explicit mask"):
        attention_fn(q, q, q, segment_ids=ids, mask=jnp.ones((40, 40), bool))


# -- Flax's inputs, fields, call and names -----------------------------------------------------
def test_float64_runs_in_float64_as_flax_does():
    """float64 inputs (jax_enable_x64), which flash_attention refuses, run the pure-JAX
    attention in float64, masked or not: Flax's layers' results to float64 rounding (a float32
    computation would miss by ~1e-7)."""
    with enable_x64():
        x = _normal(0, (B, S, F))
        theirs = nn.MultiHeadDotProductAttention(num_heads=4, param_dtype=jnp.float64)
        params = theirs.init(jax.random.key(1), x)
        ours = LinenMultiHeadAttention(num_heads=4, param_dtype=jnp.float64)
        for mask in (None, nn.make_causal_mask(jnp.ones((B, S)))):
            y = jax.jit(ours.apply)(params, x, mask=mask)
            assert y.dtype == jnp.float64
            np.testing.assert_allclose(y, jax.jit(theirs.apply)(params, x, mask=mask), rtol=0,
                                       atol=1e-12)
        # (nnx.MultiHeadAttention's default attention, jax.nn.dot_product_attention, rounds
        # the softmax of float64 to float32: the reference here is the layer in float64.)
        m = MultiHeadAttention(num_heads=4, in_features=F, num_kv_heads=2,
                               param_dtype=jnp.float64, decode=False, rngs=nnx.Rngs(0))
        y = nnx.jit(lambda m, x: m(x, is_causal=True))(m, x)
        assert y.dtype == jnp.float64
        want = jax.jit(lambda w, x: plain_attention_layer(w, x, heads=4, kv_heads=2,
                                                          causal=True))(nnx_weights(m), x)
        np.testing.assert_allclose(y, want, atol=1e-12)
        with pytest.raises(TypeError, match="got float64"):  # the API keeps its contract
            jax_fa4.flash_attention(*_qkv(), implementation="reference")
        q, k, v = (t.astype(jnp.float64) for t in _qkv())
        cases = [
            (lambda: AttentionFn(implementation="sm90")(q, k, v), "implementation='sm90'"),
            (lambda: attention_fn(q, k, v, force_fp32_for_softmax=True),
             "force_fp32_for_softmax=True with float64"),
            (lambda: attention_fn(q, k, v, segment_ids=jnp.zeros((B, S), jnp.int32)),
             "segment_ids and max logits need"),
        ]
        for fn, message in cases:
            with pytest.raises(ValueError, match=message):
                fn()


def test_complex_inputs_match_flax():
    """complex64 inputs run the pure-JAX attention in complex64 (Flax's complex softmax)."""
    re_, im = (jax.random.normal(jax.random.key(i), (B, S, F)) for i in (0, 1))
    x = (re_ + 1j * im).astype(jnp.complex64)
    theirs = nn.MultiHeadDotProductAttention(num_heads=4)
    params = theirs.init(jax.random.key(1), x)
    for mask in (None, nn.make_causal_mask(jnp.ones((B, S)))):
        y = LinenMultiHeadAttention(num_heads=4).apply(params, x, mask=mask)
        assert y.dtype == jnp.complex64
        np.testing.assert_allclose(y, theirs.apply(params, x, mask=mask), atol=1e-5)
    # (nnx.MultiHeadAttention's default attention, jax.nn.dot_product_attention, drops the
    # imaginary parts: the reference is Linen's attention function on the layer's projections.)
    m = MultiHeadAttention(num_heads=4, in_features=F, decode=False, rngs=nnx.Rngs(0))
    want = m.out(nn.dot_product_attention(m.query(x), m.key(x), m.value(x)))
    np.testing.assert_allclose(m(x), want, atol=1e-5)


def test_linen_decode_under_x64():
    """The cache's update indices share one integer dtype with jax_enable_x64 on."""
    x = _x()  # float32
    with enable_x64():
        m = LinenMultiHeadAttention(num_heads=4, num_kv_heads=2, causal=True, decode=True)
        variables = m.init(jax.random.key(0), x)
        cache, outs = variables["cache"], []
        step = jax.jit(lambda variables, x: m.apply(variables, x, mutable=["cache"]))
        for i in range(3):
            y, updates = step({"params": variables["params"], "cache": cache}, x[:, i:i + 1])
            cache = updates["cache"]
            outs.append(y)
        full = LinenMultiHeadAttention(num_heads=4, num_kv_heads=2, causal=True)
        close(jnp.concatenate(outs, axis=1),
              jax.jit(full.apply)({"params": variables["params"]}, x)[:, :3])


def test_linen_takes_flax_fields():
    """force_fp32_for_softmax and the projections' dot_general fields as Flax's module takes
    them; the fields that would replace the attention itself raise."""
    x = _x()
    theirs = nn.MultiHeadDotProductAttention(num_heads=4, force_fp32_for_softmax=True)
    params = theirs.init(jax.random.key(0), x)
    close(LinenMultiHeadAttention(num_heads=4, force_fp32_for_softmax=True).apply(params, x),
          theirs.apply(params, x))
    calls = []

    def dot_general(*args, **kwargs):
        calls.append(1)
        return jax.lax.dot_general(*args, **kwargs)

    y = LinenMultiHeadAttention(num_heads=4, qkv_dot_general=dot_general,
                                out_dot_general=dot_general).apply(params, x)
    assert len(calls) == 4  # query, key, value, out
    close(y, theirs.apply(params, x))
    with pytest.raises(TypeError, match="sets its own attention_fn"):
        LinenMultiHeadAttention(num_heads=4, attention_fn=attention_fn).apply(params, x)
    with pytest.raises(ValueError, match="qk_attn_weights_einsum_cls"):
        LinenMultiHeadAttention(num_heads=4,
                                qk_attn_weights_einsum_cls=lambda: jnp.einsum).apply(params, x)
    # Flax's module passes its einsums to an attention_fn that names them: refused, not dropped
    einsums = dict(qk_attn_weights_einsum_cls=lambda: jnp.einsum,
                   attn_weights_value_einsum_cls=lambda: jnp.einsum)
    with pytest.raises(ValueError, match="attn_weights_value_einsum: custom einsums"):
        nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=attention_fn,
                                        **einsums).apply(params, x)


def test_linen_call_takes_inputs_kv_with_flax_warnings():
    """Flax's deprecated inputs_kv= (with its DeprecationWarning and errors), and its warning
    when inputs_v looks like a mask passed positionally (the pre-0.7.4 signature)."""
    x, kv = _x(), _x(2, (B, 7, F))
    m = LinenMultiHeadAttention(num_heads=4)
    params = m.init(jax.random.key(0), x)
    with pytest.warns(DeprecationWarning, match="The inputs_kv arg will be deprecated soon"):
        y = m.apply(params, x, inputs_kv=kv)
    np.testing.assert_array_equal(y, m.apply(params, x, kv, kv))
    with pytest.raises(ValueError, match="`inputs_kv` must be None"):
        m.apply(params, x, kv, inputs_kv=kv)
    with pytest.raises(ValueError, match="`inputs_k` cannot be None if `inputs_v` is not None"):
        m.apply(params, x, inputs_v=kv)
    mask = nn.make_causal_mask(jnp.ones((B, S)))  # (B, 1, S, S), passed as inputs_v
    with pytest.warns(DeprecationWarning, match="signature of MultiHeadDotProductAttention's"):
        with pytest.raises(flax.errors.ScopeParamShapeError):
            m.apply(params, x, x, mask)


def test_linen_submodule_names_match_flax():
    """As an unnamed submodule the Linen layers take Flax's names (MultiHeadDotProductAttention_0,
    and MultiHeadAttention_0 for the alias): the same parameter tree and initial values."""

    class Parent(nn.Module):
        layer: type

        @nn.compact
        def __call__(self, x):
            return self.layer(num_heads=4)(x)

    x = _x()
    for ours, theirs, name in (
            (LinenMultiHeadAttention, nn.MultiHeadDotProductAttention,
             "MultiHeadDotProductAttention_0"),
            (LinenMultiHeadAttentionAlias, nn.MultiHeadAttention, "MultiHeadAttention_0")):
        params = Parent(ours).init(jax.random.key(0), x)
        want = Parent(theirs).init(jax.random.key(0), x)
        assert list(params["params"]) == [name]
        assert jax.tree.structure(params) == jax.tree.structure(want)
        jax.tree.map(np.testing.assert_array_equal, params, want)
        close(Parent(ours).apply(want, x), Parent(theirs).apply(want, x))


# -- learnable sinks ---------------------------------------------------------------------------
def test_nnx_learnable_sink_is_a_trained_parameter():
    """learnable_sink=True: a [num_heads] nnx.Param ``sink`` (normal, std 0.02), joining every
    row's denominator in the forward, with a gradient, and restored from a checkpoint."""
    import orbax.checkpoint as ocp

    m = MultiHeadAttention(num_heads=4, in_features=F, num_kv_heads=2, causal=True,
                           learnable_sink=True, decode=False, rngs=nnx.Rngs(0))
    sink = m.sink[...]
    assert sink.shape == (4,) and sink.dtype == jnp.float32
    assert 0 < float(jnp.max(jnp.abs(sink))) < 0.2  # normal(0.02) draws, not zeros
    assert "sink" in nnx.to_pure_dict(nnx.state(m, nnx.Param))
    x = _x()
    m.sink[...] = jnp.array([1.5, -2.0, 0.5, 3.0])  # large enough to matter
    plain = lambda w, sink, x: plain_attention_layer(  # noqa: E731
        w, x, heads=4, kv_heads=2, causal=True, sink=sink)
    close(m(x), plain(nnx_weights(m), m.sink[...], x))
    assert float(jnp.max(jnp.abs(m(x) - plain(nnx_weights(m), None, x)))) > 1e-2
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(jnp.sin(m(x)))))(m)
    want = jax.jit(jax.grad(lambda w, s: jnp.sum(jnp.sin(plain(w, s, x))), argnums=1))(
        nnx_weights(m), m.sink[...])
    close(grads.sink[...], want, 1e-4)
    assert float(jnp.max(jnp.abs(want))) > 1e-3

    # a checkpoint round trip restores the sink with the projections
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(f"{d}/state", nnx.state(m))
        checkpointer.wait_until_finished()
        fresh = MultiHeadAttention(num_heads=4, in_features=F, num_kv_heads=2, causal=True,
                                   learnable_sink=True, decode=False, rngs=nnx.Rngs(7))
        graph, abstract = nnx.split(fresh)
        restored = nnx.merge(graph, checkpointer.restore(f"{d}/state", abstract))
    close(restored.sink[...], m.sink[...], 0.0)
    close(restored(x), m(x), 0.0)


def test_linen_learnable_sink_parameter_decode_and_serialization():
    """Linen: ``params['sink']`` [num_heads]; the decode cache's masked path joins it as the
    kernel path does; flax.serialization round-trips it."""
    m = LinenMultiHeadAttention(num_heads=4, num_kv_heads=2, causal=True, learnable_sink=True)
    x = _x()
    variables = m.init(jax.random.key(0), x)
    params = variables["params"]
    assert params["sink"].shape == (4,)
    params = {**params, "sink": jnp.array([2.0, -1.0, 0.0, 1.0])}
    want = plain_attention_layer(linen_weights({"params": params}), x, heads=4, kv_heads=2,
                                 causal=True, sink=params["sink"])
    close(m.apply({"params": params}, x), want)
    grad = jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(m.apply({"params": p}, x)))))(
        params)["sink"]
    assert grad.shape == (4,) and float(jnp.max(jnp.abs(grad))) > 1e-3
    # one token at a time through the cache (the masked fallback) gives the same rows
    dec = LinenMultiHeadAttention(num_heads=4, num_kv_heads=2, causal=True, decode=True,
                                  learnable_sink=True)
    cache, outs = dec.init(jax.random.key(0), x)["cache"], []
    step = jax.jit(lambda variables, x: dec.apply(variables, x, mutable=["cache"]))
    for i in range(S):
        y, updates = step({"params": params, "cache": cache}, x[:, i:i + 1])
        cache = updates["cache"]
        outs.append(y)
    close(jnp.concatenate(outs, axis=1), want)
    blob = flax.serialization.to_bytes(params)
    back = flax.serialization.from_bytes(jax.tree.map(jnp.zeros_like, params), blob)
    close(back["sink"], params["sink"], 0.0)


def test_attention_fn_sink_with_a_mask_matches_the_kernel_path():
    """The masked fallback joins a sink as flash_attention does, rows with no visible key
    included (output 0)."""
    q, k, v = (_normal(seed, (2, 9, 4, 8)) for seed in (3, 4, 5))
    sink = jnp.array([0.5, -1.0, 2.0, 0.0])
    want = jax.jit(lambda q, k, v, s: jax_fa4.flash_attention(q, k, v, causal=True,
                                                               learnable_sink=s))(q, k, v, sink)
    masked = jax.jit(lambda q, k, v, mask, s: attention_fn(q, k, v, mask=mask, learnable_sink=s))
    mask = jnp.tril(jnp.ones((9, 9), bool))
    close(masked(q, k, v, mask, sink), want)
    empty = jnp.zeros((9, 9), bool).at[1:].set(mask[1:])  # row 0 sees nothing
    got = masked(q, k, v, empty, sink)
    assert float(jnp.max(jnp.abs(got[:, 0]))) == 0.0
    close(got[:, 1:], want[:, 1:])
