"""Tests of jax_fa4.reference against an independent float64 NumPy oracle."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compiled import per_class
from jax_fa4 import reference
from numerics import assert_fa4_close

# float32 results against the float64 oracle
ATOL, RTOL = 2e-5, 2e-5


def oracle(q, k, v, *, softmax_scale=None, window=(None, None), softcap=0.0):
    """Naive attention in NumPy float64 (written independently of reference.py)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    sq, sk = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scale = 1 / np.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    s = scale * np.einsum("bihd,bjhd->bhij", q, k)
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    left, right = window
    visible = np.ones((sq, sk), bool)
    if left is not None:
        visible &= j >= i + sk - sq - left
    if right is not None:
        visible &= j <= i + sk - sq + right
    s = np.where(visible, s, -np.inf)
    row_max = s.max(axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(row_max), row_max, 0.0))
    total = e.sum(axis=-1, keepdims=True)
    out = np.einsum("bhij,bjhd->bihd", e / np.where(total > 0, total, 1.0), v)
    with np.errstate(divide="ignore"):
        lse = np.log(total[..., 0]) + np.where(np.isfinite(row_max), row_max, 0.0)[..., 0]
    return out, lse


def randn(seed, *shapes, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for shape in shapes)


@dataclasses.dataclass(frozen=True)
class Case:
    sq: int
    sk: int
    h: int
    hkv: int
    d: int
    dv: int
    window: tuple
    softcap: float
    softmax_scale: float | None
    b: int = 2

    def __str__(self):
        return (
            f"s{self.sq}x{self.sk}-h{self.h}/{self.hkv}-d{self.d}/{self.dv}-w{self.window}"
            f"-cap{self.softcap}-scale{self.softmax_scale}"
        )

    def inputs(self, seed):
        return randn(
            seed,
            (self.b, self.sq, self.h, self.d),
            (self.b, self.sk, self.hkv, self.d),
            (self.b, self.sk, self.hkv, self.dv),
        )

    @property
    def options(self):
        return dict(window=self.window, softcap=self.softcap, softmax_scale=self.softmax_scale)


# The first five cases are also the gradient cases: together they cover every window kind,
# MHA/GQA/MQA, Dv != D, softcap, an explicit scale and rows with no visible key.
CASES = [
    Case(113, 203, 4, 1, 8, 24, (None, 0), softcap=0.0, softmax_scale=0.3),
    Case(203, 113, 4, 2, 16, 16, (5, 3), softcap=2.0, softmax_scale=None),  # rows 0-86: no key
    Case(64, 64, 2, 2, 64, 64, (0, 0), softcap=2.0, softmax_scale=None),
    Case(1, 37, 4, 2, 32, 8, (None, 7), softcap=0.0, softmax_scale=None),
    Case(203, 113, 2, 2, 32, 8, (None, None), softcap=0.0, softmax_scale=None),
    Case(1, 1, 2, 2, 16, 16, (None, None), softcap=0.0, softmax_scale=None),
    Case(1, 1, 4, 1, 32, 8, (None, 0), softcap=2.0, softmax_scale=0.3),
    Case(1, 1, 4, 2, 8, 24, (0, 0), softcap=0.0, softmax_scale=None),
    Case(113, 203, 4, 2, 64, 64, (None, None), softcap=2.0, softmax_scale=None),
    Case(113, 203, 4, 1, 32, 8, (5, 3), softcap=2.0, softmax_scale=None),
    Case(203, 113, 4, 1, 8, 24, (None, 0), softcap=0.0, softmax_scale=None),  # rows 0-89: no key
    Case(203, 113, 2, 2, 64, 64, (None, 7), softcap=0.0, softmax_scale=None),  # rows 0-82: no key
    Case(64, 64, 4, 1, 16, 16, (None, 7), softcap=0.0, softmax_scale=0.3),
    Case(64, 64, 4, 2, 32, 8, (None, 0), softcap=2.0, softmax_scale=None),
    Case(1, 37, 4, 1, 64, 64, (0, 0), softcap=0.0, softmax_scale=0.3),
    Case(1, 37, 2, 2, 16, 16, (5, 3), softcap=2.0, softmax_scale=None),
]
GRAD_CASES = CASES[:5]
#: The forward check's cases: the quick tier runs the gradient cases (every kind above), a
#: single-token one (Sq = Sk = 1) and one more; --exhaustive all of them.
FORWARD_CASES = per_class(CASES, key=lambda c: c if c in GRAD_CASES else (c.sq, c.sk) == (1, 1))
BLOCK_K = 32  # several blocks and a padded last one for the longer sequences


def assert_matches_oracle(out, lse, ref_out, ref_lse):
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert lse.dtype == jnp.float32
    empty = np.isneginf(ref_lse)  # (B, H, Sq): rows with no visible key
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert (np.asarray(out).transpose(0, 2, 1, 3)[empty] == 0).all()
    np.testing.assert_allclose(out, ref_out, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(lse, ref_lse, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("case", FORWARD_CASES, ids=str)
def test_forward_matches_oracle(case):
    q, k, v = case.inputs(seed=0)
    ref_out, ref_lse = oracle(q, k, v, **case.options)
    out, lse = reference.attention(q, k, v, **case.options)
    assert out.shape == (case.b, case.sq, case.h, case.dv) and out.dtype == q.dtype
    assert lse.shape == (case.b, case.h, case.sq)
    assert_matches_oracle(out, lse, ref_out, ref_lse)
    out_b, lse_b = reference.attention_blocked(q, k, v, block_k=BLOCK_K, **case.options)
    assert_matches_oracle(out_b, lse_b, ref_out, ref_lse)


@pytest.mark.parametrize(
    "window", [(None, None), (None, 0), (5, 3), (0, 0), (None, 7), (2, None)], ids=str
)
@pytest.mark.parametrize("sq, sk", [(5, 9), (9, 5), (7, 7)])
def test_visible_mask(sq, sk, window):
    left, right = window

    def sees(i, j):
        diag = i + sk - sq
        return (left is None or j >= diag - left) and (right is None or j <= diag + right)

    expected = np.array([[sees(i, j) for j in range(sk)] for i in range(sq)])
    full = reference.visible_mask(sq, sk, window)
    np.testing.assert_array_equal(full, expected)
    # The block form: keys [start, start + 4), those past sk (padding) invisible.
    for start in range(0, sk, 4):
        block = reference.visible_mask(sq, sk, window, k_start=start, num_k=4)
        padded = np.pad(expected, ((0, 0), (0, 4)))[:, start : start + 4]
        np.testing.assert_array_equal(block, padded)


def test_visible_mask_rejects_negative_window():
    with pytest.raises(ValueError, match="window"):
        reference.visible_mask(4, 4, (-1, 0))


def assert_grads_close(grads, expected, what=""):
    for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
        assert g.shape == e.shape
        np.testing.assert_allclose(g, e, atol=1e-5, rtol=1e-4, err_msg=f"{what} {name}")


def assert_grads_finite_and_zero_on_empty_rows(grads, lse):
    """All gradients finite; dq exactly 0 on query rows with no visible key (lse = -inf)."""
    for g in grads:
        assert np.isfinite(g).all()
    empty = np.isneginf(np.asarray(lse)).transpose(0, 2, 1)  # (B, Sq, H)
    assert (np.asarray(grads[0])[empty] == 0).all()


def test_fully_masked_rows():
    """Window (5, 3) with Sq = 203 > Sk = 113: query rows 0-86 see no key."""
    case = CASES[1]
    q, k, v = case.inputs(seed=1)
    (dout,) = randn(2, (case.b, case.sq, case.h, case.dv))
    for out, lse in (
        reference.attention(q, k, v, **case.options),
        reference.attention_blocked(q, k, v, block_k=BLOCK_K, **case.options),
    ):
        assert (out[:, :87] == 0).all() and np.isneginf(lse[..., :87]).all()
        assert np.isfinite(out).all() and np.isfinite(lse[..., 87:]).all()
        for block_k in (None, BLOCK_K):
            grads = reference.attention_backward(
                q, k, v, out, lse, dout, block_k=block_k, **case.options
            )
            assert_grads_finite_and_zero_on_empty_rows(grads, lse)


@pytest.mark.parametrize("case", GRAD_CASES, ids=str)
def test_backward_matches_autodiff(case):
    q, k, v = case.inputs(seed=3)
    (dout,) = randn(4, (case.b, case.sq, case.h, case.dv))
    out, lse = reference.attention(q, k, v, **case.options)
    _, vjp = jax.vjp(lambda q, k, v: reference.attention(q, k, v, **case.options)[0], q, k, v)
    expected = vjp(dout)
    # delta as a GPU kernel would pass it: rowsum(dout * out), (B, H, Sq) float32.
    delta = jnp.einsum("bqhd,bqhd->bhq", dout, out)
    for block_k, delta_arg in ((None, None), (BLOCK_K, delta)):
        grads = reference.attention_backward(
            q, k, v, out, lse, dout, delta=delta_arg, block_k=block_k, **case.options
        )
        assert [g.dtype for g in grads] == [jnp.float32] * 3
        assert_grads_finite_and_zero_on_empty_rows(grads, lse)
        assert_grads_close(grads, expected, f"block_k={block_k}")


@pytest.mark.parametrize("case", GRAD_CASES[:2], ids=str)
def test_grad_of_blocked_matches_naive(case):
    """jax.vjp through the scan, with cotangents on out and on every lse entry, even -inf ones."""
    q, k, v = case.inputs(seed=9)
    cotangents = randn(10, (case.b, case.sq, case.h, case.dv), (case.b, case.h, case.sq))
    naive = functools.partial(reference.attention, **case.options)
    blocked = functools.partial(reference.attention_blocked, block_k=BLOCK_K, **case.options)
    (_, lse), vjp = jax.vjp(naive, q, k, v)
    _, vjp_blocked = jax.vjp(blocked, q, k, v)
    expected, grads = vjp(cotangents), vjp_blocked(cotangents)
    assert_grads_finite_and_zero_on_empty_rows(expected, lse)
    assert_grads_finite_and_zero_on_empty_rows(grads, lse)
    assert_grads_close(grads, expected)


def finite_difference_grads(loss, arrays, eps=1e-6):
    """Central differences of loss() with respect to each float64 array, entry by entry."""
    grads = []
    for x in arrays:
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            orig = x[idx]
            x[idx] = orig + eps
            plus = loss()
            x[idx] = orig - eps
            minus = loss()
            x[idx] = orig
            g[idx] = (plus - minus) / (2 * eps)
        grads.append(g)
    return grads


@pytest.mark.parametrize(
    "case",
    [
        Case(4, 6, 2, 1, 4, 3, (2, 1), softcap=1.5, softmax_scale=None, b=1),
        Case(5, 3, 2, 2, 4, 4, (None, 0), softcap=0.0, softmax_scale=0.7, b=1),
    ],
    ids=str,
)
def test_backward_finite_difference(case):
    q, k, v = case.inputs(seed=5)
    (dout,) = randn(6, (case.b, case.sq, case.h, case.dv))
    q64, k64, v64, dout64 = (np.array(x, np.float64) for x in (q, k, v, dout))
    expected = finite_difference_grads(
        lambda: np.sum(oracle(q64, k64, v64, **case.options)[0] * dout64), [q64, k64, v64]
    )
    out, lse = reference.attention(q, k, v, **case.options)
    for block_k in (None, 2):
        grads = reference.attention_backward(
            q, k, v, out, lse, dout, block_k=block_k, **case.options
        )
        assert_grads_close(grads, expected, f"block_k={block_k}")


def test_bf16_fa4_rule():
    """FA4's rule on bf16 inputs: float32 blocked forward and blocked backward."""
    b, sq, sk, h, hkv, d, dv = 2, 97, 131, 4, 2, 64, 32
    q, k, v, dout = randn(
        7, (b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, dv), (b, sq, h, dv), dtype=jnp.bfloat16
    )
    options = dict(window=(None, 0), softcap=5.0)

    def forward_and_grads(**extra):
        attention = functools.partial(reference.attention, **options, **extra)
        (out, _), vjp = jax.vjp(attention, q, k, v)
        return out, vjp((dout, jnp.zeros((b, h, sq), jnp.float32)))

    ref, ref_grads = forward_and_grads()
    pt, pt_grads = forward_and_grads(compute_dtype=jnp.bfloat16)
    assert ref.dtype == pt.dtype == jnp.bfloat16
    assert float(jnp.max(jnp.abs(pt.astype(jnp.float32) - ref.astype(jnp.float32)))) > 0

    out, lse = reference.attention_blocked(q, k, v, block_k=BLOCK_K, **options)
    assert out.dtype == jnp.bfloat16
    assert_fa4_close(out, ref, pt, softcap=True)
    grads = reference.attention_backward(q, k, v, out, lse, dout, block_k=BLOCK_K, **options)
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, pt_grads):
        assert g.dtype == jnp.bfloat16
        assert_fa4_close(g, r, p, softcap=True, name=name)


def test_assert_fa4_close():
    ref = jnp.linspace(-1, 1, 64, dtype=jnp.float32)
    pt = ref + 0.01
    assert_fa4_close(ref + 0.015, ref, pt)  # 0.015 <= 2 * 0.01 + atol
    assert_fa4_close(ref + 0.025, ref, pt, softcap=True)  # 0.025 <= 3 * 0.01 + atol
    with pytest.raises(AssertionError, match=r"dk: max\|out - ref\| = .* exceeds the bound"):
        assert_fa4_close(ref + 0.025, ref, pt, name="dk")
    # atol is the rounding granularity of ref's dtype: bf16 near 0.3 allows an error of 1e-3.
    ref16 = ref.astype(jnp.bfloat16)
    assert_fa4_close(ref16.astype(jnp.float32) + 1e-3, ref16, ref16)
    with pytest.raises(AssertionError):
        assert_fa4_close(ref + 1e-3, ref, ref)


def test_blocked_32k():
    """B=1, H=1, D=64, Sk=32768 keys in float32: the online softmax runs over 64 key blocks,
    and every row matches the naive one.

    Without a mask the rows are independent and Sq enters no block's computation, so 64 of the
    32k queries (every 512th) check the 64-block accumulation as well as all 32k would, at 1/512
    of the cost (the whole 32k x 32k took 40 s on the CPU test machine)."""
    s = 32768
    q, k, v = randn(8, (1, s, 1, 64), (1, s, 1, 64), (1, s, 1, 64))
    q = q[:, ::512]
    out, lse = reference.attention_blocked(q, k, v)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    ref_out, ref_lse = reference.attention(q, k, v)
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-5, rtol=1e-5)
