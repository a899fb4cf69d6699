"""The conformance suite: one list of problems that every backend must get right, and the check.

Each case is a problem through the public API (dense, dense with segment ids, packed varlen or
paged KV): odd and mismatched lengths, a one-token decode step, MHA / GQA / MQA, several head
dims, no mask / causal / sliding windows, softcap, segment ids (packed documents; scattered
ids with padding), bfloat16 and float16 (and one float32 case, which the kernels decline).
:func:`check_backend` runs a case on a backend and checks the forward (out and lse) and the
gradients (dq, dk, dv of a loss with cotangents on both out and lse; paged calls are
forward only) against the float32 oracle, ``reference.attention`` on the same inputs upcast
(autodiff for the gradients), by FA4's rule (tests/numerics.py) with the naive 16-bit
computation as its baseline. Where the backend declines a case (its ``supports_*`` gives a
reason), the public API must do what it documents: a forced forward raises
``ImplementationUnavailableError`` with that reason; a declined backward runs the reference,
reported through ``base.reference_fallback`` (and warned about by an opt-in backend); any other
fallback fails the check.

tests/test_conformance.py runs the cases on every registered backend (the reference here, kernel
backends compile-only), tests/gpu/test_conformance.py on the kernel backend of the GPU at hand:
a backend registered in ``jax_fa4.backends.BACKENDS`` gets all of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
import zlib
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import backends, options, reference
from jax_fa4.backends import base
from numerics import assert_fa4_close

# -- the cases --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """A dense problem: q (b, sq, h, d), k (b, sk, hkv, d), v (b, sk, hkv, dv)."""

    name: str
    dtype: str
    h: int
    hkv: int
    d: int
    dv: int | None = None
    b: int = 1
    sq: int = 1
    sk: int = 1
    causal: bool = False
    window_size: tuple = (None, None)
    softcap: float = 0.0
    softmax_scale: float | None = None

    #: whether the layout has gradients (paged KV is forward only)
    differentiable = True

    @property
    def head_dim_v(self) -> int:
        return self.dv or self.d

    @property
    def window(self) -> tuple:
        """The canonical (left, right) window (causal: right 0)."""
        return (self.window_size[0], 0 if self.causal else self.window_size[1])

    def kwargs(self) -> dict:
        """The API's keyword arguments of the case's options."""
        return dict(causal=self.causal, window_size=self.window_size, softcap=self.softcap,
                    softmax_scale=self.softmax_scale)

    def forced_options(self, implementation: str) -> options.AttentionOptions:
        """The canonical options of the call forced to ``implementation``."""
        opts = options.options(self.d, implementation=base.REFERENCE, **self.kwargs())
        return dataclasses.replace(opts, implementation=implementation, forced=True)

    def input_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shapes of the call's (q, k, v)."""
        dv = self.head_dim_v
        return ((self.b, self.sq, self.h, self.d), (self.b, self.sk, self.hkv, self.d),
                (self.b, self.sk, self.hkv, dv))

    def shapes(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        return tuple(jax.ShapeDtypeStruct(s, self.dtype) for s in self.input_shapes())

    def inputs(self) -> tuple[jax.Array, ...]:
        """Fresh standard normal (q, k, v) of the case (drawn by NumPy, seeded by its name:
        no program to compile)."""
        return normal(self.name, self.input_shapes(), self.dtype)

    def attention(self, implementation: str) -> Callable:
        """(q, k, v) -> (out (B, Sq, H, Dv), lse (B, H, Sq)) through the public API."""
        return lambda q, k, v: jax_fa4.flash_attention(
            q, k, v, return_lse=True, implementation=implementation, **self.kwargs())

    def oracle(self, compute_dtype) -> Callable:
        """:meth:`attention` by ``reference.attention`` computed in ``compute_dtype``."""
        return lambda q, k, v: reference.attention(q, k, v, compute_dtype=compute_dtype,
                                                   **self._reference_options())

    def _reference_options(self) -> dict:
        return dict(softmax_scale=self.softmax_scale, window=self.window, softcap=self.softcap)

    def reasons(self, backend: base.Backend, opts) -> tuple[str | None, str | None]:
        """Why ``backend`` declines the forward and the backward of the case (None: it serves)."""
        q, k, v = self.shapes()
        return backend.supports_forward(q, k, v, opts), backend.supports_backward(q, k, v, opts)

    def backward_kernels(self, backend, opts) -> tuple:
        """The configs of the kernel backend ``backend``'s backward kernels of the case."""
        return tuple(c for c in backend.backward_configs(*self.shapes(), opts) if c is not None)


def normal(seed: str, shapes, dtype) -> tuple[jax.Array, ...]:
    """Standard normal arrays of ``shapes`` in ``dtype``, drawn in float32 by NumPy from a
    generator seeded by ``seed`` (and transferred with ``jax.device_put``: ``jnp.asarray`` of a
    NumPy array compiles an XLA program per shape)."""
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    return tuple(jax.device_put(rng.standard_normal(s, np.float32).astype(dtype)) for s in shapes)


def _cu(lengths, pad: int = 0) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32) + pad


@dataclasses.dataclass(frozen=True, kw_only=True)
class VarlenCase(Case):
    """Packed sequences of lengths ``lens_q`` / ``lens_k`` after ``pad`` tokens in no sequence
    (out 0, lse -inf, no gradient); results in the dense layout with batch 1."""

    lens_q: tuple
    lens_k: tuple
    pad: int = 3

    def input_shapes(self):
        tq, tk = sum(self.lens_q) + self.pad, sum(self.lens_k) + self.pad
        return (tq, self.h, self.d), (tk, self.hkv, self.d), (tk, self.hkv, self.head_dim_v)

    def attention(self, implementation):
        cu_q, cu_k = _cu(self.lens_q, self.pad), _cu(self.lens_k, self.pad)

        def f(q, k, v):
            out, lse = jax_fa4.flash_attention_varlen(
                q, k, v, cu_q, cu_k, max(self.lens_q), max(self.lens_k), return_lse=True,
                implementation=implementation, **self.kwargs())
            return out[None], lse[None]
        return f

    def oracle(self, compute_dtype):
        """Each token sees the keys of its own sequence (segment ids), the window aligned
        bottom-right per sequence (positions)."""
        seq_q = np.repeat(np.arange(len(self.lens_q)), self.lens_q)
        seq_k = np.repeat(np.arange(len(self.lens_k)), self.lens_k)
        pos_q = np.concatenate([np.arange(lq) + lk - lq for lq, lk in zip(self.lens_q,
                                                                           self.lens_k)])
        pos_k = np.concatenate([np.arange(lk) for lk in self.lens_k])
        pad = np.zeros(self.pad, np.int32)
        masks = dict(q_segment_ids=np.concatenate([pad - 1, seq_q]),
                     kv_segment_ids=np.concatenate([pad - 2, seq_k]),
                     q_positions=np.concatenate([pad, pos_q]),
                     kv_positions=np.concatenate([pad, pos_k]))
        masks = {key: jnp.asarray(x, jnp.int32)[None] for key, x in masks.items()}
        return lambda q, k, v: reference.attention(
            q[None], k[None], v[None], compute_dtype=compute_dtype, **masks,
            **self._reference_options())

    def reasons(self, backend, opts):
        q, k, v = self.shapes()
        return (backend.supports_varlen(q, k, v, opts, max(self.lens_q), max(self.lens_k)),
                backend.supports_varlen_backward(q, k, v, opts))

    def backward_kernels(self, backend, opts):
        return (backend.varlen_backward_config(*self.shapes(), opts),)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SegmentsCase(Case):
    """A dense self-attention problem (``sq == sk``) with one (b, sq) array of segment ids
    (drawn by NumPy, seeded by the name): ``ids="packed"``, documents of random lengths (ids
    increasing run by run); ``"scattered"``, ids 1-3 at random (no contiguous runs) with
    padding tokens of id 0 (``padding_segment_id=0``), a run at the end and a few inside."""

    ids: str

    #: the padding id of the scattered ids (the API's padding_segment_id)
    padding_id = 0

    def segment_ids(self) -> np.ndarray:
        """The (b, sq) int32 segment ids."""
        rng = np.random.default_rng(zlib.crc32(f"{self.name} ids".encode()))
        if self.ids == "packed":
            starts = rng.random((self.b, self.sq)) < 4 / self.sq
            return np.cumsum(starts, axis=1).astype(np.int32)
        assert self.ids == "scattered", self.ids
        ids = rng.integers(1, 4, (self.b, self.sq))
        ids[:, self.sq - self.sq // 5:] = self.padding_id
        ids[rng.random((self.b, self.sq)) < 0.05] = self.padding_id
        return ids.astype(np.int32)

    def _padding(self) -> dict:
        return {"padding_segment_id": self.padding_id} if self.ids == "scattered" else {}

    def attention(self, implementation):
        ids = jnp.asarray(self.segment_ids())
        return lambda q, k, v: jax_fa4.flash_attention(
            q, k, v, segment_ids=ids, return_lse=True, implementation=implementation,
            **self._padding(), **self.kwargs())

    def oracle(self, compute_dtype):
        """Query i sees key j only if their ids are equal; padding queries and keys get two
        ids of their own (-1, -2), so padding sees nothing and nothing sees padding."""
        ids = self.segment_ids()
        pad = ids == self.padding_id if self.ids == "scattered" else np.zeros_like(ids, bool)
        q_ids, kv_ids = (jnp.asarray(np.where(pad, fill, ids)) for fill in (-1, -2))
        return lambda q, k, v: reference.attention(
            q, k, v, compute_dtype=compute_dtype, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
            **self._reference_options())

    def reasons(self, backend, opts):
        q, k, v = self.shapes()
        backward = getattr(backend, "supports_segments_backward", None)
        return (backend.supports_segments(q, k, v, opts),
                None if backward is None else backward(q, k, v, opts))

    def backward_kernels(self, backend, opts):
        return (backend.segments_backward_config(*self.shapes(), opts),)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedCase(Case):
    """q (b, sq, h, d) over a paged KV cache: batch entry i owns ``sk // page_size`` pages of a
    shuffled table (entries past its used pages -1 on odd rows) and its first ``seqused[i]``
    keys. Forward only."""

    page_size: int
    seqused: tuple

    differentiable = False

    def _table(self) -> np.ndarray:
        per_entry = self.sk // self.page_size
        rng = np.random.default_rng(zlib.crc32(self.name.encode()))
        table = rng.permutation(self.b * per_entry).reshape(self.b, per_entry).astype(np.int32)
        for row, used in enumerate(self.seqused):
            if row % 2:
                table[row, -(-used // self.page_size):] = -1
        return table

    def input_shapes(self):
        q, k, v = super().input_shapes()  # the caches: the batch's keys cut into pages
        pages = self.b * self.sk // self.page_size
        return q, *((pages, self.page_size, *x[2:]) for x in (k, v))

    def attention(self, implementation):
        table, seqused = self._table(), np.asarray(self.seqused, np.int32)
        return lambda q, k_cache, v_cache: jax_fa4.flash_attention_paged(
            q, k_cache, v_cache, table, seqused, return_lse=True,
            implementation=implementation, **self.kwargs())

    def oracle(self, compute_dtype):
        """Dense attention over each entry's pages gathered in table order, keys past its
        ``seqused`` masked, the queries aligned to its last keys."""
        pages = np.maximum(self._table(), 0)
        used = np.asarray(self.seqused)[:, None]
        masks = dict(q_segment_ids=np.zeros((self.b, self.sq)),
                     kv_segment_ids=np.where(np.arange(self.sk) < used, 0, -1),
                     q_positions=np.arange(self.sq) + used - self.sq)
        masks = {key: jnp.asarray(x, jnp.int32) for key, x in masks.items()}

        def gather(cache):
            return cache[pages].reshape(self.b, self.sk, *cache.shape[2:])
        return lambda q, k_cache, v_cache: reference.attention(
            q, gather(k_cache), gather(v_cache), compute_dtype=compute_dtype, **masks,
            **self._reference_options())

    def reasons(self, backend, opts):
        q, k_cache, v_cache = self.shapes()
        table = jax.ShapeDtypeStruct((self.b, self.sk // self.page_size), jnp.int32)
        return backend.supports_paged(q, k_cache, v_cache, table, opts), None

    def backward_kernels(self, backend, opts):
        return ()


BF16, FP16 = "bfloat16", "float16"

CASES = [
    Case(name="mha-d128-bf16", dtype=BF16, b=2, sq=77, sk=131, h=4, hkv=4, d=128),
    # causal with more queries than keys: the first 54 rows see no key (out 0, lse -inf)
    Case(name="gqa-d128-bf16-causal", dtype=BF16, b=2, sq=131, sk=77, h=4, hkv=2, d=128,
         causal=True),
    # keys 0..36 are in no query's window: their dk, dv are 0
    Case(name="mha-d128-fp16-window", dtype=FP16, sq=77, sk=131, h=4, hkv=4, d=128,
         window_size=(17, 5)),
    Case(name="mqa-d64-bf16", dtype=BF16, b=2, sq=131, sk=77, h=4, hkv=1, d=64),
    # one query token: the decode rewrite (GQA heads packed into one tile's rows)
    Case(name="decode-gqa-d128-bf16", dtype=BF16, b=2, sq=1, sk=257, h=8, hkv=2, d=128,
         causal=True),
    # causal with a left window: the window (40, 0)
    Case(name="mha-d96-bf16-causal-window", dtype=BF16, sq=77, sk=131, h=2, hkv=2, d=96,
         causal=True, window_size=(40, None)),
    Case(name="mha-d192x128-bf16-causal", dtype=BF16, sq=77, sk=131, h=4, hkv=4, d=192,
         dv=128, causal=True),
    Case(name="mha-d192-bf16", dtype=BF16, sq=77, sk=131, h=2, hkv=2, d=192),
    Case(name="mha-d128-fp16-softcap", dtype=FP16, b=2, sq=77, sk=131, h=4, hkv=4, d=128,
         softcap=15.0, softmax_scale=0.1),
    # head dim 256 (the split sm100 backward), GQA with a window
    Case(name="gqa-d256-bf16-window", dtype=BF16, sq=77, sk=131, h=2, hkv=1, d=256,
         window_size=(40, 9)),
    # float32: the kernels decline it; the reference is held to float32 agreement
    Case(name="gqa-d64-fp32-softcap-window", dtype="float32", b=2, sq=37, sk=53, h=4, hkv=2,
         d=64, window_size=(4, 2), softcap=3.0),
    # segment ids: packed documents (contiguous runs: key spans and bulk blocks)
    SegmentsCase(name="segments-packed-gqa-d128-bf16-causal", dtype=BF16, b=2, sq=200, sk=200,
                 h=4, hkv=2, d=128, causal=True, ids="packed"),
    # ids without contiguous runs (compared key by key) and padding id 0 (out 0, lse -inf)
    SegmentsCase(name="segments-scattered-padding-d64-fp16", dtype=FP16, sq=150, sk=150, h=2,
                 hkv=2, d=64, ids="scattered"),
    # lengths 1, Sq < Sk and Sq > Sk (causal: rows without keys), padding tokens
    VarlenCase(name="varlen-gqa-d128-bf16-causal", dtype=BF16, h=4, hkv=2, d=128,
               lens_q=(1, 77, 130), lens_k=(50, 131, 100), causal=True),
    # 192/128 packed: the sm100 2-CTA kernel's varlen mode
    VarlenCase(name="varlen-mha-d192x128-fp16", dtype=FP16, h=2, hkv=2, d=192, dv=128,
               lens_q=(130, 3), lens_k=(61, 200)),
    # a decode step over a paged cache: 2 pages of 128 keys per entry, 200 and 1 keys used
    PagedCase(name="paged-decode-gqa-d128-bf16", dtype=BF16, b=2, sq=1, sk=256, h=8, hkv=2,
              d=128, page_size=128, seqused=(200, 1), causal=True),
]


# -- running and checking a case --------------------------------------------------------------
class Results(NamedTuple):
    out: jax.Array  # (B, Sq, H, Dv)
    lse: jax.Array  # (B, H, Sq)
    grads: tuple  # (dq, dk, dv), or () for a forward-only case


def _results(case: Case, attention: Callable, inputs, dout, dlse) -> Results:
    """``attention``'s (out, lse) on ``inputs`` and, for a differentiable case, the gradients
    of ``sum(out · dout) + sum(lse · dlse)`` (rows without keys carry no lse cotangent)."""
    def loss(q, k, v):
        out, lse = attention(q, k, v)
        value = (jnp.sum(out.astype(jnp.float32) * dout)
                 + jnp.sum(jnp.where(jnp.isneginf(lse), 0.0, lse) * dlse))
        return value, (out, lse)

    if not case.differentiable:
        return Results(*attention(*inputs), ())
    grads, (out, lse) = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(*inputs)
    return Results(out, lse, grads)


def evaluate(case: Case, implementation: str, before_run: Callable = lambda: None):
    """(inputs, got, ref, pt) of ``case``: its fresh inputs, the results of the public API
    forced to ``implementation`` (:class:`Results`; fresh normal cotangents) in one jitted
    program run after ``before_run()``, and, in another, the float32 oracle's on the inputs
    upcast and the naive computation's in the inputs' dtype (float32 inputs: the oracle's)."""
    inputs = case.inputs()
    out, lse = jax.eval_shape(case.oracle(jnp.float32),
                              *(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in inputs))
    cotangents = normal(f"{case.name} cotangents", (out.shape, lse.shape), jnp.float32)

    def oracles(inputs, cotangents):
        f32 = [x.astype(jnp.float32) for x in inputs]
        ref = _results(case, case.oracle(jnp.float32), f32, *cotangents)
        if jnp.dtype(case.dtype) == jnp.float32:
            return ref, ref
        # out and the gradients in the inputs' dtype, as the rule compares them
        ref = Results(ref.out.astype(case.dtype), ref.lse,
                      tuple(g.astype(case.dtype) for g in ref.grads))
        return ref, _results(case, case.oracle(jnp.dtype(case.dtype)), inputs, *cotangents)

    program = jax.jit(lambda inputs, cotangents: _results(
        case, case.attention(implementation), inputs, *cotangents))
    program = program.trace(inputs, cotangents).lower().compile()
    before_run()
    got = jax.block_until_ready(program(inputs, cotangents))
    return (inputs, got, *jax.jit(oracles)(inputs, cotangents))


def check_results(case: Case, got: Results, ref: Results, pt: Results, inputs) -> None:
    """``got`` against the float32 oracle ``ref``: shapes and dtypes, no NaN, the same rows
    without a visible key (lse -inf, out exactly 0), then FA4's rule (16-bit inputs, ``pt``
    the baseline) on out, lse's finite entries and the gradients; float32 inputs (where the
    rule's baseline is the oracle itself) are held to float32 agreement instead."""
    dtype = jnp.dtype(case.dtype)
    assert got.out.shape == ref.out.shape and got.out.dtype == dtype, got.out
    assert got.lse.shape == ref.lse.shape and got.lse.dtype == jnp.float32, got.lse
    lse, ref_lse = np.asarray(got.lse), np.asarray(ref.lse)
    assert not np.isnan(lse).any(), "lse has NaN"
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty, err_msg="lse -inf rows differ")
    out = np.asarray(got.out, np.float32)
    assert not np.isnan(out).any(), "out has NaN"
    assert (out.transpose(0, 2, 1, 3)[empty] == 0).all(), "rows without keys are not 0"
    pairs = [("out", got.out, ref.out, pt.out),
             ("lse", lse[~empty], ref_lse[~empty], np.asarray(pt.lse)[~empty])]
    for name, g, r, p, x in zip(("dq", "dk", "dv"), got.grads, ref.grads, pt.grads, inputs):
        assert g.shape == x.shape and g.dtype == x.dtype, (name, g.shape, g.dtype)
        pairs.append((name, g, r, p))
    assert len(got.grads) == (3 if case.differentiable else 0)
    for name, g, r, p in pairs:
        assert np.isfinite(np.asarray(g, np.float32)).all(), f"{name}: non-finite values"
        if dtype != jnp.float32:
            assert_fa4_close(g, r, p, softcap=case.softcap > 0, name=name)
        elif name in ("out", "lse"):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=name)
        else:  # an explicit backward against autodiff: float32 sums in other orders
            np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-5, err_msg=name)


class Watched(NamedTuple):
    fallbacks: list  # (what, implementation, reason) of every reported reference fallback
    warnings: list  # the messages of the warnings raised


@contextlib.contextmanager
def watch_fallbacks(expected: bool):
    """Record every call's fallback to the reference (``base.reference_fallback``, which the
    GPU suite otherwise turns into a failure) and every warning, the once-per-reason backward
    warning forgotten before and after. Fallbacks are reported while tracing: where one is
    ``expected``, JAX's caches are cleared first (a trace cached by an earlier identical call
    would report nothing)."""
    watched = Watched([], [])
    if expected:
        jax.clear_caches()
    base.warn_reference_backward.cache_clear()
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mp.setattr(base, "reference_fallback", lambda *a: watched.fallbacks.append(a))
        try:
            yield watched
        finally:
            watched.warnings.extend(str(w.message) for w in caught)
            base.warn_reference_backward.cache_clear()


def check_declines(backend: base.Backend, watched: Watched, backward_reason: str | None):
    """What the API documents for a backward the backend declines: the reference runs,
    reported once with the backend's reason, and an opt-in backend (``warns_reference_backward``)
    warns naming it; nothing is reported where the backend serves."""
    expected = [] if backward_reason is None else [backward_reason]
    assert [reason for _, _, reason in watched.fallbacks] == expected, watched.fallbacks
    assert {name for _, name, _ in watched.fallbacks} <= {backend.name}
    warned = [w for w in watched.warnings if "reference backward" in w]
    if backward_reason is not None and backend.warns_reference_backward:
        assert any(backward_reason in w for w in warned), watched.warnings
    else:
        assert not warned, warned


def check_forward_declined(case: Case, backend: base.Backend, reason: str, inputs) -> None:
    """A forced call the backend declines raises ImplementationUnavailableError with why."""
    with pytest.raises(jax_fa4.ImplementationUnavailableError, match=re.escape(reason)):
        case.attention(backend.name)(*inputs)


def check_backend(case: Case, backend: base.Backend, before_run: Callable = lambda: None):
    """Run ``case`` on ``backend`` (forced) and check it (see the module docstring);
    ``before_run`` runs just before (the GPU suite poisons device memory)."""
    forward_reason, backward_reason = case.reasons(backend, case.forced_options(backend.name))
    if forward_reason is not None:
        check_forward_declined(case, backend, forward_reason, case.inputs())
        return
    backward_reason = backward_reason if case.differentiable else None
    with watch_fallbacks(expected=backward_reason is not None) as watched:
        inputs, got, ref, pt = evaluate(case, backend.name, before_run)
    check_declines(backend, watched, backward_reason)
    check_results(case, got, ref, pt, inputs)


def gpu_is_default_device(backend: base.Backend) -> bool:
    """Whether the default device is a GPU of ``backend``'s family (it runs the kernels)."""
    cc = backends.gpu_compute_capability()
    return (backend.compute_capability is not None and cc is not None
            and cc.split(".")[0] == backend.compute_capability)
