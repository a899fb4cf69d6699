"""The Hopper backward kernels (sm90_bwd + sm90_bwd_postprocess) on the H200, under jax.jit.

dq, dk, dv from ``jax_fa4.backends.sm90.Sm90Backend.backward`` are compared with FA4's rule
(tests/numerics.py): ``ref`` = ``reference.attention_backward`` on float32-upcast inputs (with the
float32 forward's out and lse), ``pt`` = the gradient of the naive attention computed in the input
dtype (``reference.attention(..., compute_dtype=dtype)``). The kernel gets what the library feeds
it: out in the input dtype, delta / lse_log2 from the preprocess kernel.

Kernels come precompiled: every config used here is in ``variants.sm90_bwd_gpu_configs()``
(checked by test_cases_are_precompiled).
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import backends, reference
from jax_fa4.tools.variants import OPT_IN_FORMS, sm90_bwd_gpu_configs, sm90_bwd_pair_candidates
from numerics import assert_fa4_close


class Opts(NamedTuple):
    softmax_scale: float | None
    window: tuple
    softcap: float


class DetOpts(NamedTuple):
    softmax_scale: float | None
    window: tuple
    softcap: float
    deterministic: bool = True


class Case(NamedTuple):
    dtype: str
    d: int
    dv: int
    sq: int
    sk: int
    h: int
    hkv: int
    window: tuple = (None, None)
    softcap: float = 0.0
    b: int = 2


CAUSAL = (None, 0)
BF, FP = "bfloat16", "float16"

CASES = [
    # hdim 128: seqlens, masks, softcap, GQA/MQA, fp16
    Case(BF, 128, 128, 1, 1, 4, 4),
    Case(BF, 128, 128, 113, 203, 4, 4),
    Case(BF, 128, 128, 1023, 1024, 4, 4),
    Case(BF, 128, 128, 2049, 2048, 2, 2, b=1),
    Case(BF, 128, 128, 113, 203, 4, 4, CAUSAL),
    Case(BF, 128, 128, 203, 113, 4, 4, CAUSAL),  # 90 rows see no key
    Case(BF, 128, 128, 2049, 2048, 2, 2, CAUSAL, b=1),
    Case(BF, 128, 128, 1023, 1024, 4, 4, (64, 32)),
    Case(BF, 128, 128, 113, 203, 4, 4, (None, 7)),
    Case(BF, 128, 128, 2049, 2048, 2, 2, (256, 0), b=1),
    Case(BF, 128, 128, 113, 203, 4, 4, (3, 0)),  # key blocks nobody sees: dK = dV = 0
    Case(BF, 128, 128, 113, 203, 4, 4, softcap=30.0),
    Case(BF, 128, 128, 1023, 1024, 4, 4, CAUSAL, softcap=15.0),
    Case(BF, 128, 128, 113, 203, 4, 4, (40, 10), softcap=20.0),
    Case(BF, 128, 128, 113, 203, 6, 2),  # GQA
    Case(BF, 128, 128, 1023, 1024, 4, 1, CAUSAL),  # MQA
    Case(BF, 128, 128, 113, 203, 6, 3, CAUSAL, softcap=30.0),
    Case(FP, 128, 128, 113, 203, 4, 4),
    Case(FP, 128, 128, 1023, 1024, 4, 4, CAUSAL),
    Case(FP, 128, 128, 2049, 2048, 2, 2, (100, 50), b=1),
    Case(FP, 128, 128, 113, 203, 4, 4, softcap=30.0),
    # other head dims
    Case(BF, 64, 64, 113, 203, 4, 4),
    Case(BF, 64, 64, 1023, 1024, 4, 4, CAUSAL),
    Case(BF, 64, 64, 2049, 2048, 4, 2, b=1),
    Case(BF, 64, 64, 1, 1, 4, 4, (0, 0)),
    Case(BF, 96, 96, 113, 203, 4, 4),
    Case(BF, 96, 96, 1023, 1024, 4, 4, (128, 64)),
    Case(BF, 96, 96, 113, 203, 4, 2, CAUSAL),
    Case(BF, 192, 128, 113, 203, 4, 4),
    Case(BF, 192, 128, 1023, 1024, 4, 4, CAUSAL),
    Case(BF, 192, 128, 113, 203, 4, 1, (50, 20)),
    Case(BF, 256, 256, 113, 203, 4, 4),
    Case(BF, 256, 256, 1023, 1024, 2, 2, CAUSAL),
    Case(BF, 256, 256, 2049, 2048, 2, 1, (300, 100), b=1),
    Case(FP, 256, 256, 113, 203, 4, 4),
]


# deterministic (ordered dQ) kernels: variants.SM90_BWD_GPU_DETERMINISTIC
DETERMINISTIC_CASES = [
    Case(BF, 128, 128, 1023, 1024, 4, 4, CAUSAL),
    Case(BF, 128, 128, 203, 1113, 4, 4, CAUSAL),  # causal, more keys than queries, key tail
    Case(BF, 128, 128, 2049, 2048, 4, 2, b=1),  # GQA
    Case(BF, 64, 64, 1023, 1024, 4, 4, (64, 32)),
    Case(BF, 256, 256, 1023, 1024, 2, 2, CAUSAL),
]


# loop forms of the table's kernels (variants.SM90_BWD_GPU_SWAP, OPT_IN_FORMS): swap_sdp (Sᵀ /
# dPᵀ GEMMs, P and dS in registers for dV / dK), stats_smem (lse_log2 / delta through shared
# memory), both, and dq_red (dQ added by the MMA threads). The table picks some of them (head dim
# 128: all three; head dim 96 causal: swap + stats); every form is checked here whatever the
# table picks, so that a form can be timed (benchmarks/bwd_variants.py) and adopted safely.
SWAP_CASES = [
    Case(BF, 128, 128, 113, 203, 4, 4),
    Case(BF, 128, 128, 2049, 2048, 2, 2, b=1),
    Case(BF, 128, 128, 1023, 1024, 4, 4, CAUSAL),
    Case(BF, 128, 128, 203, 113, 4, 4, CAUSAL),  # 90 rows see no key
    Case(BF, 128, 128, 1023, 1024, 8, 2),  # GQA
    Case(BF, 96, 96, 1023, 1024, 4, 4, (64, 32)),
    Case(FP, 128, 128, 1023, 1024, 4, 4),
]


def _id(c: Case) -> str:
    w = "" if c.window == (None, None) else ("-causal" if c.window == CAUSAL else f"-w{c.window}")
    return (f"{c.dtype[:4]}-d{c.d}x{c.dv}-{c.sq}x{c.sk}-h{c.h}/{c.hkv}{w}"
            f"{'-cap' if c.softcap else ''}")


def poison_device_memory(nbytes: int = 1 << 28) -> None:
    """Fill and free a large block so that fresh outputs start as NaN garbage, not zeros."""
    jnp.full((nbytes // 4,), jnp.nan, jnp.float32).block_until_ready().delete()


def _inputs(c: Case, seed: int):
    dt = jnp.dtype(c.dtype)
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (c.b, c.sq, c.h, c.d), jnp.float32).astype(dt)
    k = jax.random.normal(ks[1], (c.b, c.sk, c.hkv, c.d), jnp.float32).astype(dt)
    v = jax.random.normal(ks[2], (c.b, c.sk, c.hkv, c.dv), jnp.float32).astype(dt)
    dout = jax.random.normal(ks[3], (c.b, c.sq, c.h, c.dv), jnp.float32).astype(dt)
    return q, k, v, dout


@functools.partial(jax.jit, static_argnames=("opts",))
def sm90_backward(q, k, v, out, lse, dout, opts):
    sm90 = backends.get("sm90")
    delta, lse_log2 = sm90.backward_preprocess(out, dout, lse)
    return sm90.backward(q, k, v, out, lse, dout, delta, lse_log2, opts)


@functools.partial(jax.jit, static_argnames=("opts", "config"))
def sm90_backward_config(q, k, v, out, lse, dout, opts, config):
    sm90 = backends.get("sm90")
    delta, lse_log2 = sm90.backward_preprocess(out, dout, lse)
    return sm90.backward(q, k, v, out, lse, dout, delta, lse_log2, opts, config=config)


@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap"))
def _forward32(q, k, v, *, scale, window, softcap):
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return reference.attention(f32(q), f32(k), f32(v), softmax_scale=scale, window=window,
                               softcap=softcap)


@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap"))
def _ref_backward(q, k, v, out32, lse, dout, *, scale, window, softcap):
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return reference.attention_backward(f32(q), f32(k), f32(v), out32, lse, f32(dout),
                                        softmax_scale=scale, window=window, softcap=softcap)


@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap"))
def _pt_backward(q, k, v, dout, *, scale, window, softcap):
    def f(q, k, v):
        out, _ = reference.attention(q, k, v, softmax_scale=scale, window=window, softcap=softcap,
                                     compute_dtype=q.dtype)
        return out
    _, vjp = jax.vjp(f, q, k, v)
    return vjp(dout)


def _run(c: Case, seed: int = 0, form: str | None = None):
    q, k, v, dout = _inputs(c, seed)
    scale = 1.0 / c.d ** 0.5
    kw = dict(scale=scale, window=c.window, softcap=c.softcap)
    out32, lse = _forward32(q, k, v, **kw)
    out = out32.astype(q.dtype)
    opts = Opts(scale, c.window, c.softcap)
    poison_device_memory()
    if form is not None:
        main, _ = backends.get("sm90").backward_configs(q, k, v, opts)
        got = sm90_backward_config(q, k, v, out, lse, dout, opts, OPT_IN_FORMS[form](main))
    else:
        got = sm90_backward(q, k, v, out, lse, dout, opts)
    return (q, k, v, out, lse, dout, opts), got, out32, kw


def test_cases_are_precompiled():
    available = set(sm90_bwd_gpu_configs())
    for cases, opts, forms in ((CASES, Opts, [None]), (DETERMINISTIC_CASES, DetOpts, [None]),
                               (SWAP_CASES, Opts, list(OPT_IN_FORMS))):
        for c, form in itertools.product(cases, forms):
            q = jax.ShapeDtypeStruct((c.b, c.sq, c.h, c.d), c.dtype)
            k = jax.ShapeDtypeStruct((c.b, c.sk, c.hkv, c.d), c.dtype)
            v = jax.ShapeDtypeStruct((c.b, c.sk, c.hkv, c.dv), c.dtype)
            main, post = backends.get("sm90").backward_configs(q, k, v,
                                                               opts(None, c.window, c.softcap))
            if form is not None:
                main = OPT_IN_FORMS[form](main)
            assert main in available and post in available, (_id(c), form)


@pytest.mark.parametrize("form", list(OPT_IN_FORMS))
@pytest.mark.parametrize("case", SWAP_CASES, ids=_id)
def test_opt_in_kernel_matches_reference(case, form):
    """Each opt-in form of the table's kernel passes FA4's rule, like the default one."""
    (q, k, v, out, lse, dout, opts), got, out32, kw = _run(case, seed=3, form=form)
    ref = _ref_backward(q, k, v, out32, lse, dout, **kw)
    pt = _pt_backward(q, k, v, dout, **kw)
    for name, g, r, p, x in zip(("dq", "dk", "dv"), got, ref, pt, (q, k, v)):
        assert bool(jnp.all(jnp.isfinite(g))), f"{name}: non-finite values"
        assert_fa4_close(g, r.astype(x.dtype), p, name=name)


D192_CASES = [
    Case(BF, 192, 192, 113, 203, 4, 4),
    Case(BF, 192, 192, 1023, 1024, 4, 4, CAUSAL),
    Case(BF, 192, 192, 203, 113, 6, 2, CAUSAL),  # GQA; 90 rows see no key
    Case(BF, 192, 192, 1023, 1024, 4, 2, (64, 32)),
    Case(BF, 192, 192, 1023, 1024, 4, 4, (64, 32)),
    Case(BF, 192, 192, 113, 203, 4, 2),
]  # every (mask kind, GQA) of the candidates


@pytest.mark.parametrize("dq_red", [False, True])
@pytest.mark.parametrize("case", D192_CASES, ids=_id)
def test_head_dim_192_candidates_match_reference(case, dq_red):
    """Head dims 192/192 (no table row yet: variants.sm90_bwd_d192_candidates) pass FA4's rule
    like the table's kernels; when they do on every case, (192, 192) may take a table row."""
    from jax_fa4.backends.base import mask_kind
    from jax_fa4.tools.variants import sm90_bwd_d192_candidates

    config = next(c for c in sm90_bwd_d192_candidates()
                  if (c.mask, c.gqa, c.dq_red) == (mask_kind(case.window), case.h != case.hkv,
                                                   dq_red))
    _check_config(case, config, seed=5)


def _check_config(case: Case, config, seed: int) -> None:
    """``config``'s backward on fresh inputs of ``case`` (outputs poisoned first): each gradient
    has its input's shape and dtype, is finite and passes FA4's rule."""
    q, k, v, dout = _inputs(case, seed=seed)
    kw = dict(scale=1.0 / case.d ** 0.5, window=case.window, softcap=case.softcap)
    out32, lse = _forward32(q, k, v, **kw)
    poison_device_memory()
    got = sm90_backward_config(q, k, v, out32.astype(q.dtype), lse, dout,
                               Opts(kw["scale"], case.window, case.softcap), config)
    ref = _ref_backward(q, k, v, out32, lse, dout, **kw)
    pt = _pt_backward(q, k, v, dout, **kw)
    for name, g, r, p, x in zip(("dq", "dk", "dv"), got, ref, pt, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, (name, g.shape, g.dtype)
        assert bool(jnp.all(jnp.isfinite(g))), f"{name}: non-finite values"
        assert_fa4_close(g, r.astype(x.dtype), p, name=name)


PAIR_CASES = [
    Case(BF, 256, 256, 113, 203, 2, 2),  # query and key tails
    Case(BF, 256, 256, 1023, 1024, 2, 2, CAUSAL),
    Case(BF, 256, 256, 203, 113, 4, 2, CAUSAL),  # GQA; 90 rows see no key
    Case(BF, 256, 256, 1023, 1024, 2, 2, (64, 32)),
    Case(BF, 256, 256, 113, 203, 2, 2, (3, 0)),  # key blocks nobody sees: dK = dV = 0
    Case(BF, 256, 256, 2049, 2048, 2, 1, (256, 0), b=1),  # MQA
    Case(BF, 256, 256, 1023, 1024, 4, 2),  # GQA
    Case(BF, 256, 256, 113, 203, 2, 2, softcap=30.0),
    Case(FP, 256, 256, 1023, 1024, 2, 2, CAUSAL),
    Case(BF, 128, 128, 2049, 2048, 2, 2, b=1),
    Case(BF, 128, 128, 1023, 1024, 4, 2, CAUSAL),  # GQA
    Case(BF, 192, 128, 1023, 1024, 2, 2, CAUSAL),
    Case(BF, 192, 128, 113, 203, 4, 2),  # GQA
    Case(BF, 192, 128, 113, 203, 2, 2, (40, 10)),
]  # every problem kind of variants.SM90_BWD_GPU_PAIR


def _pair_config(case: Case, lookahead: bool, grouped: bool):
    from jax_fa4.backends.base import mask_kind

    gqa = case.h != case.hkv
    kind = (case.dtype, case.d, mask_kind(case.window), bool(case.softcap), gqa and not grouped,
            grouped, lookahead)
    return next(c for c in sm90_bwd_pair_candidates()
                if (c.dtype, c.head_dim, c.mask, c.has_softcap, c.gqa, c.group_heads,
                    c.lookahead) == kind)


#: (case, grouped): every case, and the GQA ones in the group_heads form too
PAIR_FORMS = [(c, False) for c in PAIR_CASES] + [(c, True) for c in PAIR_CASES if c.h != c.hkv]


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("case,grouped", PAIR_FORMS,
                         ids=[f"{_id(c)}{'-group' if g else ''}" for c, g in PAIR_FORMS])
def test_pair_kernel_matches_reference(case, grouped, lookahead):
    """The split-operand CTA pair (BwdPairConfig: no table row picks it before it has passed
    here and been timed) passes FA4's rule like the table's kernels, outputs poisoned first."""
    _check_config(case, _pair_config(case, lookahead, grouped), seed=7)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_backward_matches_reference(case):
    (q, k, v, out, lse, dout, opts), got, out32, kw = _run(case)
    ref = _ref_backward(q, k, v, out32, lse, dout, **kw)
    pt = _pt_backward(q, k, v, dout, **kw)
    for name, g, r, p, x in zip(("dq", "dk", "dv"), got, ref, pt, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, (name, g.shape, g.dtype)
        assert bool(jnp.all(jnp.isfinite(g))), f"{name}: non-finite values"
        if not np.any(np.asarray(r)):
            _assert_float32_roundoff(name, g, q, k, v, dout, kw["scale"])
            continue
        assert_fa4_close(g, r.astype(x.dtype), p, softcap=bool(case.softcap), name=name)


def _assert_float32_roundoff(name, g, q, k, v, dout, scale):
    """When every query sees a single key, dS = P·(dP − delta) is exactly 0 and so are the exact
    dq and dk. FA4's atol, derived from ref's values, is then 0 as well, but the kernel's dP
    (a WGMMA sum) and delta (the preprocess's sum) are float32 sums of the same products in
    different orders: bound that rounding, |dP − delta| <= 2·Dv·eps32·max|dO|·max|V|, carried
    through the scale and the (at most max(Sq, Sk)-term) dS GEMMs."""
    a = lambda x: float(jnp.max(jnp.abs(x.astype(jnp.float32))))  # noqa: E731
    ds = 2 * v.shape[3] * np.finfo(np.float32).eps * a(dout) * a(v)
    bound = ds * scale * max(a(q), a(k)) * max(q.shape[1], k.shape[1])
    err = a(g)
    assert err <= bound, f"{name}: exact gradient is 0, got max|{name}| = {err:.3g} > {bound:.3g}"


def test_repeatable_and_dq_order_independent():
    """dK / dV are written once per (key block, head): bitwise repeatable. dQ is reduce-added
    by many CTAs in any order: equal up to float32 summation order."""
    c = Case(BF, 128, 128, 1023, 1024, 4, 4, CAUSAL)
    args, first, _, _ = _run(c, seed=5)
    second = sm90_backward(*args)
    np.testing.assert_array_equal(np.asarray(first[1]), np.asarray(second[1]))
    np.testing.assert_array_equal(np.asarray(first[2]), np.asarray(second[2]))
    np.testing.assert_allclose(np.asarray(first[0], np.float32),
                               np.asarray(second[0], np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("case", DETERMINISTIC_CASES, ids=_id)
def test_deterministic_kernel_is_bitwise_repeatable(case):
    """The ordered-dQ kernel: dq, dk, dv identical bit for bit over three runs (fresh poison in
    between), and as accurate as the default kernel (FA4's rule against the reference)."""
    (q, k, v, out, lse, dout, opts), _, out32, kw = _run(case, seed=21)
    det = DetOpts(*opts)
    runs = []
    for _ in range(3):
        poison_device_memory()
        runs.append([np.asarray(g) for g in sm90_backward(q, k, v, out, lse, dout, det)])
    for later in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], later):
            np.testing.assert_array_equal(a, b, err_msg=name)
    ref = _ref_backward(q, k, v, out32, lse, dout, **kw)
    pt = _pt_backward(q, k, v, dout, **kw)
    for name, g, r, p, x in zip(("dq", "dk", "dv"), runs[0], ref, pt, (q, k, v)):
        assert_fa4_close(jnp.asarray(g), r.astype(x.dtype), p, name=name)


def test_under_vmap():
    c = Case(BF, 128, 128, 113, 203, 4, 4, CAUSAL)
    (q, k, v, out, lse, dout, opts), single, _, _ = _run(c, seed=9)
    stack = lambda x: jnp.stack([x, x])  # noqa: E731
    batched = jax.jit(jax.vmap(lambda *a: sm90_backward(*a, opts)))(
        *(stack(x) for x in (q, k, v, out, lse, dout)))
    for s, bt in zip(single, batched):
        np.testing.assert_allclose(np.asarray(bt[1], np.float32), np.asarray(s, np.float32),
                                   rtol=1e-2, atol=1e-2)


def _api_grads(q, k, v, w, *, causal, implementation, deterministic=False):
    def loss(q, k, v):
        out = jax_fa4.flash_attention(q, k, v, causal=causal, implementation=implementation,
                                      deterministic=deterministic)
        return jnp.sum(out.astype(jnp.float32) * w)

    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return f, f(q, k, v)


@pytest.mark.parametrize("causal", [False, True])
def test_grad_through_the_api_matches_the_reference(causal):
    """jax.grad of a loss through flash_attention (GQA, odd lengths) runs the backward kernels
    and matches jax.grad through the float32 reference by FA4's rule."""
    b, sq, sk, h, hkv, d = 2, 300, 517, 4, 2, 128
    ks = jax.random.split(jax.random.key(11), 4)
    q = jax.random.normal(ks[0], (b, sq, h, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, sk, hkv, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, sk, hkv, d), jnp.float32).astype(jnp.bfloat16)
    dout = jax.random.normal(ks[3], (b, sq, h, d), jnp.float32).astype(jnp.bfloat16)
    w = dout.astype(jnp.float32)
    f, got = _api_grads(q, k, v, w, causal=causal, implementation="sm90")
    # fwd, pre, bwd, post
    assert f.lower(q, k, v).as_text().count("CuteDSLRT_NvJaxCutlassCall_v2") == 4
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    _, ref = _api_grads(f32(q), f32(k), f32(v), w, causal=causal, implementation="reference")
    window = CAUSAL if causal else (None, None)
    pt = _pt_backward(q, k, v, dout, scale=1.0 / d ** 0.5, window=window, softcap=0.0)
    for name, g, r, p, x in zip(("dq", "dk", "dv"), got, ref, pt, (q, k, v)):
        assert g.dtype == x.dtype
        assert_fa4_close(g, r.astype(x.dtype), p, name=name)


def test_deterministic_grads_are_bitwise_repeatable():
    """deterministic=True through the API: the ordered-dQ kernel (its int32 counters are in the
    program), the same gradients bit for bit from two runs."""
    ks = jax.random.split(jax.random.key(12), 4)
    q, k, v, w = (jax.random.normal(kk, (2, 333, 4, 64), jnp.float32) for kk in ks)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    f, first = _api_grads(q, k, v, w, causal=True, implementation="sm90", deterministic=True)
    text = f.lower(q, k, v).as_text()
    assert text.count("CuteDSLRT_NvJaxCutlassCall_v2") == 4  # fwd, pre, bwd, post
    assert "tensor<2x4x3xi32>" in text  # dq_sem: (B, H, 3 query blocks of 128 rows)
    poison_device_memory()
    second = f(q, k, v)
    for a, b_ in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))


@pytest.mark.parametrize("causal", [False, True])
def test_sink_grad_through_the_api_matches_the_reference(causal):
    """flash_attention with a learnable sink on the kernels (the sink joined around them):
    out, lse and the gradients of q, k, v and the sink by FA4's rule against the float32
    reference, with the naive bf16 reference (jax.grad through reference.attention) as pt."""
    b, sq, sk, h, hkv, d = 2, 300, 517, 4, 2, 128
    ks = jax.random.split(jax.random.key(13), 4)
    q = jax.random.normal(ks[0], (b, sq, h, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, sk, hkv, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, sk, hkv, d), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(ks[3], (b, sq, h, d), jnp.float32)
    sink = jnp.asarray([-1.0, 0.5, 2.0, 4.0], jnp.float32)
    window = CAUSAL if causal else (None, None)

    def loss(attn):
        def f(q, k, v, s):
            out, lse = attn(q, k, v, s)
            return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jnp.sin(lse)), (out, lse)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3), has_aux=True))

    kernel = loss(lambda q, k, v, s: jax_fa4.flash_attention(
        q, k, v, causal=causal, learnable_sink=s, return_lse=True, implementation="sm90"))
    assert kernel.lower(q, k, v, sink).as_text().count("CuteDSLRT_NvJaxCutlassCall_v2") == 4
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    poison_device_memory()
    got, (out, lse) = kernel(q, k, v, sink)
    ref, (ref_out, ref_lse) = loss(lambda q, k, v, s: reference.attention(
        q, k, v, window=window, learnable_sink=s))(f32(q), f32(k), f32(v), sink)
    pt, (pt_out, pt_lse) = loss(lambda q, k, v, s: reference.attention(
        q, k, v, window=window, learnable_sink=s, compute_dtype=jnp.bfloat16))(q, k, v, sink)
    assert_fa4_close(out, ref_out.astype(out.dtype), pt_out, name="out")
    assert_fa4_close(lse, ref_lse, pt_lse, name="lse")
    for name, g, r, p in zip(("dq", "dk", "dv", "dsink"), got, ref, pt):
        assert_fa4_close(g, r.astype(g.dtype), p, name=name)
