"""Extreme numerics on the pure-JAX reference (issue #24): scores near float32's overflow bound,
softcap with huge logits, and rows with no visible key under every mode (causal Sq > Sk,
windows, segment ids, varlen, paged), through the public API under ``jax.jit``, against a
float64 oracle. The cases and the checks are in tests/extreme_cases.py, shared with
tests/gpu/test_extreme_numerics.py (the same cases on the Hopper kernels).

The quick tier runs one case of each class (:func:`case_class`; :func:`blocked_class` for the
blocked forms), ``--exhaustive`` all of them.
Also the reference's other forms on the same masks and magnitudes: the blocked (online-softmax)
forward and the blocked explicit backward, which the API runs only above 4096² scores per head.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from compiled import per_class
from extreme_cases import CASES, check_case, make_problem, oracle
from jax_fa4 import reference
from numerics import assert_fa4_close


def case_class(case) -> tuple:
    """The quick tier runs one case per class (``--exhaustive``: every case): the layout, the
    score range (standard, large, beyond the lse's float32 precision), segment ids, and whether a
    sink or softcap takes part."""
    scores = "normal" if case.score is None else ("beyond" if case.beyond_lse_precision
                                                  else "large")
    return case.kind, scores, case.segments is not None, case.sink or case.softcap > 0


@pytest.mark.parametrize("case", per_class(CASES, case_class), ids=lambda c: c.name)
def test_extreme_case_reference(case):
    check_case(case, "reference")


def blocked_class(case) -> tuple:
    """The blocked forms' classes in the quick tier: :func:`case_class` without segment ids (the
    forms' block masks from segment ids: tests/test_varlen.py's
    test_packed_segments_match_per_segment_reference; their rows without a visible key: the
    causal Sq > Sk cases here)."""
    kind, scores, _, extras = case_class(case)
    return kind, scores, extras


_BLOCKED = per_class([c for c in CASES if c.kind == "dense"], blocked_class)


@pytest.mark.parametrize("case", _BLOCKED, ids=lambda c: c.name)
def test_blocked_reference_forms(case):
    """reference.attention_blocked and attention_backward(block_k=...) with 16-key blocks (so a
    row's first blocks may hold no visible key, and the running max starts at -inf): no NaN,
    rows without keys 0 / -inf (or the sink), the rest against the float64 oracle."""
    pb = make_problem(case, "reference")
    kw = dict(softmax_scale=pb.softmax_scale, window=case.window, softcap=case.softcap,
              **pb.ref_kwargs)
    out, lse = reference.attention_blocked(pb.q, pb.k, pb.v, block_k=16,
                                           learnable_sink=pb.sink, **kw)
    sink = None if pb.sink is None else np.asarray(pb.sink)
    ref_out, ref_lse = oracle(pb.q, pb.k, pb.v, pb.visible, pb.softmax_scale, case.softcap, sink)
    empty = ~pb.visible.any(-1)
    assert not np.isnan(np.asarray(out, np.float32)).any() and not np.isnan(lse).any()
    assert (np.asarray(out, np.float32)[empty] == 0).all()
    np.testing.assert_array_equal(np.asarray(lse).transpose(0, 2, 1)[empty],
                                  np.asarray(ref_lse).transpose(0, 2, 1)[empty])
    pt_out, _ = reference.attention(pb.q, pb.k, pb.v, compute_dtype=pb.q.dtype,
                                    learnable_sink=pb.sink, **kw)
    rows = ~empty
    assert_fa4_close(out[rows], jnp.asarray(ref_out[rows], jnp.float32).astype(out.dtype),
                     pt_out[rows], softcap=case.softcap > 0, name=f"{case.name} blocked out")

    dout = jnp.asarray(np.random.default_rng(1).standard_normal(out.shape), out.dtype)
    grads = reference.attention_backward(pb.q, pb.k, pb.v, out, lse, dout, block_k=16, **kw)
    naive = reference.attention_backward(pb.q, pb.k, pb.v, out, lse, dout, **kw)
    for name, g, n in zip(("dq", "dk", "dv"), grads, naive):
        g32 = np.asarray(g, np.float32)
        assert np.isfinite(g32).all(), f"{case.name} blocked {name} not finite"
        if name != "dv" and case.huge:
            continue  # one-hot softmax: dq, dk are rounding noise (tests/extreme_cases.py)
        # the same float32 arithmetic block by block, from the same lse: equal up to rounding.
        # Both forms recompute the scores, each with its own summation order, so P = e^{s - lse}
        # moves by up to e^{±few ulps of the largest score} (1e-3 relative at scores ~1e4, 6 %
        # per ulp at 1e6, where XLA's CPU dot of jax 0.10 and the blocked einsum differ by a few
        # ulps): the bound allows four, and beyond ~1e8 no float32 backward resolves P, so there
        # only finiteness (above) holds.
        n32 = np.asarray(n, np.float32)
        ulp = float(np.spacing(np.float32(case.score or 0.0)))
        with np.errstate(over="ignore"):
            moved = float(np.expm1(np.float32(4 * ulp)))
        np.testing.assert_allclose(g32, n32, rtol=0,
                                   atol=(1e-2 + moved) * float(np.abs(n32).max()),
                                   err_msg=f"{case.name} blocked {name}")
    assert (np.asarray(grads[0], np.float32)[empty] == 0).all()


def test_backward_preprocess_margin_on_huge_rows():
    """The backward's lse_log2 (the reference backend's preprocess, the kernel's rule): exact
    ``lse·log2 e`` below LSE_LOG2_MARGIN_FROM, raised by ``|lse_log2|·LSE_LOG2_MARGIN`` (at
    least 16 float32 ulps) from it on, so a P rebuilt from a row's largest score, rounded as
    the forward and the backward round it, stays <= 1 (without the margin it reaches
    exp2(+128) = inf near 2^31: NaN gradients); +inf for rows that saw no key."""
    import math

    from jax_fa4 import backends
    from jax_fa4.kernels.preprocess_config import LSE_LOG2_MARGIN_FROM

    log2e = np.float32(math.log2(math.e))
    lse = np.array([[[0.0, -3.5, 11.0, 1e6, -1e6, 1.2e7, 1e9, -1e9, 3e20, 8e37 / 1.5,
                      -np.inf]]], np.float32)
    out = jnp.ones((1, lse.shape[-1], 1, 8), jnp.bfloat16)
    _, lse_log2 = backends.get("reference").backward_preprocess(out, out, jnp.asarray(lse))
    got = np.asarray(lse_log2, np.float64)[0, 0]
    exact = lse[0, 0].astype(np.float64) * float(log2e)
    small = np.abs(exact) < LSE_LOG2_MARGIN_FROM
    np.testing.assert_allclose(got[small], exact[small], rtol=2e-7)
    huge = ~small & np.isfinite(exact)
    assert huge.sum() == 5
    ulp = np.spacing(np.abs(exact[huge]).astype(np.float32)).astype(np.float64)
    assert np.all(got[huge] - exact[huge] >= 16 * ulp - 2 * ulp), (got[huge] - exact[huge]) / ulp
    assert np.all(np.isfinite(got[:-1])) and got[-1] == np.inf
    # a row's largest scaled score, as a recomputation may round it (a few ulps above the
    # forward's lse): P = exp2(s - lse_log2) <= 1 in float32
    s = (exact[huge] + 4 * ulp).astype(np.float32)
    p = np.exp2(s - got[huge].astype(np.float32))
    assert np.all(p <= 1.0), p
