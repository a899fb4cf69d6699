"""Forward-mode autodiff through the attention calls (``jax.jvp``, ``jax.linearize``,
``jax.jacfwd``) and the reverse mode it must leave as it was.

The tangent is the float32 reference's JVP (:mod:`jax_fa4.tangents`); reverse mode transposes it
into the backend's backward chain. On the CPU both sides run the reference, so the tangents are
compared with ``jax.jvp`` of the pure reference (:func:`jax_fa4.reference.attention`) and with
``jax.jacrev`` (the backward chain), which only agree if the tangent and its transpose are the
same linear map.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import reference, tangents
from numerics import assert_fa4_close, random_qkv

TOL = 2e-5


def _tangents(*xs, seed=7):
    ks = jax.random.split(jax.random.key(seed), len(xs))
    return tuple(jax.random.normal(kk, x.shape, jnp.float32).astype(x.dtype)
                 for kk, x in zip(ks, xs))


def _jvp(f, primals, tangents):
    """``jax.jvp(f, primals, tangents)`` as one compiled program (the tests' other calls;
    test_jvp_matches_the_reference runs the JVP op by op as well)."""
    return jax.jit(lambda p, t: jax.jvp(f, p, t))(tuple(primals), tuple(tangents))


def _close(a, b, tol=TOL):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = max(1.0, float(np.max(np.abs(b))))
    np.testing.assert_allclose(a, b, rtol=0, atol=tol * scale)


CASES = {
    # name: (shapes b, sq, sk, h, hkv, d, dv), flash_attention kwargs, reference kwargs
    "full_gqa": ((2, 37, 45, 4, 2, 32, 32), {}, {}),
    "causal_bottom_right": ((2, 29, 53, 4, 4, 16, 24), {"causal": True}, {"window": (None, 0)}),
    "window_softcap_scale": ((1, 41, 41, 2, 1, 32, 32),
                             {"window_size": (7, 3), "softcap": 3.0, "softmax_scale": 0.4},
                             {"window": (7, 3), "softcap": 3.0, "softmax_scale": 0.4}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_jvp_matches_the_reference(case):
    (b, sq, sk, h, hkv, d, dv), opts, ref_opts = CASES[case]
    q, k, v = random_qkv(b, sq, sk, h, hkv, d, dv)
    t = _tangents(q, k, v)

    def ours(q, k, v):
        return jax_fa4.flash_attention(q, k, v, return_lse=True, **opts)

    def ref(q, k, v):
        return reference.attention(q, k, v, **ref_opts)

    (out, lse), (t_out, t_lse) = jax.jvp(ours, (q, k, v), t)
    (want_out, want_lse), (want_t_out, want_t_lse) = jax.jvp(ref, (q, k, v), t)
    _close(out, want_out)
    _close(t_out, want_t_out)
    _close(t_lse, want_t_lse)
    assert float(jnp.max(jnp.abs(t_out))) > 0.1  # a real tangent, not zeros
    # and under jit, with the same tangents
    _, (jt_out, _) = jax.jit(lambda *a: jax.jvp(ours, a[:3], a[3:]))(q, k, v, *t)
    _close(jt_out, want_t_out)


def test_bfloat16_tangent_meets_fa4s_rule():
    """bfloat16 inputs: the tangent against the float32 JVP of the same (rounded) inputs, by
    FA4's rule with the naive bfloat16 computation as the baseline."""
    q, k, v = random_qkv(2, 67, 67, 4, 2, 64, dtype=jnp.bfloat16, seed=3)
    t = _tangents(q, k, v)
    _, t_out = _jvp(lambda *x: jax_fa4.flash_attention(*x, causal=True), (q, k, v), t)
    assert t_out.dtype == jnp.bfloat16

    def ref(compute_dtype):
        def f(q, k, v):
            return reference.attention(q, k, v, window=(None, 0), compute_dtype=compute_dtype)[0]
        up = [x.astype(jnp.float32) for x in (q, k, v)]
        ts = [x.astype(jnp.float32) for x in t] if compute_dtype == jnp.float32 else t
        return _jvp(f, tuple(up) if compute_dtype == jnp.float32 else (q, k, v), tuple(ts))[1]

    assert_fa4_close(t_out, ref(jnp.float32), ref(jnp.bfloat16), name="jvp tangent")


def test_linearize_and_jacfwd_agree_with_reverse_mode():
    """jax.linearize gives the JVP's tangent; jax.jacfwd (the tangent) equals jax.jacrev (the
    backward chain): the tangent and its transpose are one linear map."""
    q, k, v = random_qkv(1, 5, 6, 2, 1, 3, seed=11)

    def f(q, k, v):
        return jax_fa4.flash_attention(q, k, v, causal=True)

    t = _tangents(q, k, v)
    out, f_lin = jax.linearize(f, q, k, v)
    _close(f_lin(*t), _jvp(f, (q, k, v), t)[1])
    fwd = jax.jit(jax.jacfwd(f, argnums=(0, 1, 2)))(q, k, v)
    rev = jax.jit(jax.jacrev(f, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(fwd, rev):
        assert a.shape == out.shape + q.shape[:0] + a.shape[out.ndim:]
        _close(a, b)
    assert float(jnp.max(jnp.abs(fwd[0]))) > 0.01


def test_vmap_of_jvp_and_jvp_of_vmap():
    q, k, v = random_qkv(3, 19, 23, 2, 2, 16, seed=5)
    t = _tangents(q, k, v)

    def one(q, k, v):  # one batch entry, (S, H, D)
        return jax_fa4.flash_attention(q[None], k[None], v[None], window_size=(4, 2))[0]

    want = _jvp(lambda *x: reference.attention(*x, window=(4, 2))[0], (q, k, v), t)[1]
    got = jax.jit(jax.vmap(lambda *a: jax.jvp(one, a[:3], a[3:])[1]))(q, k, v, *t)
    _close(got, want)
    got = _jvp(jax.vmap(one), (q, k, v), t)[1]
    _close(got, want)


def test_sink_tangent_includes_the_sink():
    q, k, v = random_qkv(2, 31, 31, 4, 2, 32, seed=2)
    sink = jnp.array([0.5, -1.0, 2.0, 0.0], jnp.float32)
    t = _tangents(q, k, v, sink)

    def ours(q, k, v, s):
        return jax_fa4.flash_attention(q, k, v, causal=True, learnable_sink=s, return_lse=True)

    def ref(q, k, v, s):
        return reference.attention(q, k, v, window=(None, 0), learnable_sink=s)

    (_, got_lse), (got, got_t_lse) = _jvp(ours, (q, k, v, sink), t)
    want = _jvp(ref, (q, k, v, sink), t)[1]
    _close(got, want[0])
    _close(got_t_lse, want[1])
    # the sink's own tangent moves the output: with only it nonzero the tangent is not zero
    zeros = tuple(jnp.zeros_like(x) for x in (q, k, v))
    only_sink = _jvp(ours, (q, k, v, sink), (*zeros, t[3]))[1][0]
    assert float(jnp.max(jnp.abs(only_sink))) > 1e-3
    # and jacfwd in the sink equals jacrev (the backward chain's d sink), on the output taken
    # along a random direction of its head dim: still a row per query and head, and jacrev
    # pulls back 32x fewer cotangents than for the whole output (most of the test's time)
    direction = jax.random.normal(jax.random.key(5), (q.shape[-1],), jnp.float32)

    def out_of_sink(s):
        return ours(q, k, v, s)[0] @ direction
    _close(jax.jit(jax.jacfwd(out_of_sink))(sink), jax.jit(jax.jacrev(out_of_sink))(sink))


def test_segment_ids_tangent():
    q, k, v = random_qkv(2, 40, 40, 2, 2, 16, seed=4)
    ids = jnp.array([[1] * 15 + [2] * 20 + [0] * 5, [3] * 40], jnp.int32)
    t = _tangents(q, k, v)

    def ours(q, k, v):
        return jax_fa4.flash_attention(q, k, v, causal=True, segment_ids=ids,
                                       padding_segment_id=0)

    got = _jvp(ours, (q, k, v), t)[1]
    pad_q = jnp.where(ids == 0, -2, ids)
    pad_k = jnp.where(ids == 0, -3, ids)
    want = _jvp(lambda *x: reference.attention(*x, window=(None, 0), q_segment_ids=pad_q,
                                               kv_segment_ids=pad_k)[0], (q, k, v), t)[1]
    _close(got, want)
    assert float(jnp.max(jnp.abs(got[0, 35:]))) == 0.0  # padding queries: no tangent


def test_varlen_tangent_is_each_sequences_own():
    lens = [(9, 13), (17, 17), (5, 8)]
    h, hkv, d = 4, 2, 16
    cu_q = np.cumsum([0] + [a for a, _ in lens]).astype(np.int32)
    cu_k = np.cumsum([0] + [b for _, b in lens]).astype(np.int32)
    q, k, v = random_qkv(1, int(cu_q[-1]), int(cu_k[-1]), h, hkv, d, seed=8)
    q, k, v = q[0], k[0], v[0]
    t = _tangents(q, k, v)

    def ours(q, k, v):
        return jax_fa4.flash_attention_varlen(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k),
                                              17, 17, causal=True)

    got = _jvp(ours, (q, k, v), t)[1]
    for i in range(len(lens)):
        qs, ks_ = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        want = _jvp(lambda *x: reference.attention(*(y[None] for y in x),
                                                   window=(None, 0))[0][0],
                    (q[qs], k[ks_], v[ks_]), (t[0][qs], t[1][ks_], t[2][ks_]))[1]
        _close(got[qs], want)


def test_max_logits_have_no_tangent():
    q, k, v = random_qkv(1, 12, 12, 2, 2, 8, seed=9)
    t = _tangents(q, k, v)
    (_, row_max), (t_out, t_max) = _jvp(
        lambda *x: jax_fa4.flash_attention(*x, return_max_logits=True), (q, k, v), t)
    assert row_max.shape == (1, 2) and float(jnp.max(jnp.abs(t_max))) == 0.0
    assert float(jnp.max(jnp.abs(t_out))) > 0.0


def test_reverse_mode_runs_the_backward_chain_only():
    """jax.grad transposes the tangent into the backward operation: its program holds the
    forward and backward operations once each and nothing of the tangent (no reference JVP,
    no linear operation left)."""
    q, k, v = random_qkv(1, 16, 16, 2, 2, 8)

    def loss(q, k, v):
        return jnp.sum(jax_fa4.flash_attention(q, k, v, causal=True) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    names = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert names.count("jax_fa4_attention_fwd") == 1, names
    assert names.count("jax_fa4_attention_bwd") == 1, names
    assert not {"jax_fa4_linear", "exp", "dot_general", "scan"} & set(names), names


def test_second_order_is_refused():
    """Second-order derivatives through an attention call raise (as with the custom VJP
    before: no operation of the chain has a rule for them) rather than return wrong numbers."""
    q, k, v = random_qkv(1, 4, 4, 1, 1, 4)

    def loss(q):
        return jnp.sum(jax_fa4.flash_attention(q, k, v) ** 2)

    with pytest.raises(NotImplementedError, match="jax_fa4"):
        jax.jacfwd(jax.grad(loss))(q)
    with pytest.raises(NotImplementedError, match="jax_fa4"):
        jax.jacfwd(jax.jacfwd(loss))(q)


def test_linear_primitive_alone():
    """The primitive by itself, on ``x / r``: its transpose is the custom one (here deliberately
    ``2 * ct / r``, not the true transpose, so that the test sees which one runs), under grad,
    vmap of grad, grad of vmap and jit."""
    def f(r, x):
        return jnp.sum(tangents.linear(lambda res, t: [t[0] / res[0]],
                                       lambda res, ct: [2 * ct[0] / res[0]], [r], [x])[0])

    r = jnp.array([2.0, 4.0])
    x = jnp.array([1.0, 1.0])
    np.testing.assert_allclose(jax.jvp(lambda x: f(r, x), (x,), (x,))[1], 0.75)
    np.testing.assert_allclose(jax.grad(f, argnums=1)(r, x), [1.0, 0.5])
    np.testing.assert_allclose(jax.jit(jax.grad(f, argnums=1))(r, x), [1.0, 0.5])
    rs = jnp.stack([r, 2 * r])
    np.testing.assert_allclose(jax.vmap(jax.grad(f, argnums=1), in_axes=(0, None))(rs, x),
                               [[1.0, 0.5], [0.5, 0.25]])
    np.testing.assert_allclose(
        jax.grad(lambda x: jax.vmap(f, in_axes=(0, None))(rs, x).sum())(x), [1.5, 0.75])
