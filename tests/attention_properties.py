"""Property-based checks of jax_fa4's public attention functions (Hypothesis), shared by
tests/test_properties.py (the pure-JAX reference on the CPU) and tests/gpu/test_properties.py
(the Hopper kernels).

Each property draws a problem (shapes, GQA / MQA ratio, causal, sliding window, softcap, scale,
learnable sink, segment ids, varlen or paged metadata) from a :class:`Space`, builds fresh
standard-normal bfloat16 inputs from a drawn seed, and compares the library's ``(out, lse)``
and, where the function is differentiable, its gradients (dq, dk, dv, dsink of a random-weighted
sum of ``out`` and the finite ``lse``) with :func:`naive_attention`: a dense, masked softmax
written here from the problem's definition (never calling :mod:`jax_fa4.reference`), computed
in float32 (``ref``) and in bfloat16 (``pt``, FA4's low-precision baseline, with a 16-bit
framework softmax: :func:`rounded_softmax`). Outputs and gradients pass FA4's rule
(tests/numerics.py, through :func:`assert_rule`), with two adaptations where the rule's
baselines degenerate, each explained at its function and pinned by a regression example: an
identically zero ref (:func:`assert_rule`) and d sink (:func:`check_results`). lse passes the
same rule with an absolute slack of 1e-3 · max(1, max|lse|) and must have the same ``-inf``
rows. Rows with no visible key must give exactly 0 output and lse ``-inf`` (``= sink`` with a
sink); varlen padding tokens exactly 0 output, lse ``-inf`` (even with a sink) and zero
gradients.

The oracle pads every problem into a few bucketed shapes (:meth:`Space.padded`), so it
compiles once per bucket; the library runs on the drawn shapes (one compile per example).

The visibility masks are built in NumPy, one function per entry point, straight from the
documented rules (:func:`dense_mask`, :func:`varlen_mask`, :func:`paged_keys`).

Hypothesis profiles (selected by ``JAX_FA4_HYPOTHESIS_PROFILE``, else each file's default):

* ``jax-fa4-cpu``: the default suite's: few examples, derandomized (CI sees the same examples
  every run), no example database, no deadline;
* ``jax-fa4-gpu``: the GPU file's default: more examples, derandomized;
* ``jax-fa4-explore``: many random examples, shrunk on failure, for bug hunting on either file
  (the example database in ``.hypothesis/`` replays failures).

The first two do not shrink a failure (each shrink step compiles new shapes: minutes); they
print the failing example, which reproduces (derandomized) and can be pinned with
``@example``.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

import jax_fa4
from jax_fa4.tools.fa4_rule import GRAD_SLACK, grad_scale
from numerics import assert_fa4_close

# -- Hypothesis profiles -------------------------------------------------------------------------
PROFILE_ENV = "JAX_FA4_HYPOTHESIS_PROFILE"
CPU_PROFILE = "jax-fa4-cpu"
GPU_PROFILE = "jax-fa4-gpu"
EXPLORE_PROFILE = "jax-fa4-explore"

_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)
settings.register_profile(CPU_PROFILE, max_examples=7, derandomize=True, database=None,
                          phases=_NO_SHRINK, **_COMMON)
settings.register_profile(GPU_PROFILE, max_examples=40, derandomize=True, database=None,
                          phases=_NO_SHRINK, **_COMMON)
settings.register_profile(EXPLORE_PROFILE, max_examples=300, derandomize=False, **_COMMON)


def profile(default: str, weight: float = 1.0) -> settings:
    """The settings of one property test: the profile named by ``JAX_FA4_HYPOTHESIS_PROFILE``
    (else ``default``), with its example count scaled by ``weight`` (cheap properties run more
    examples, expensive ones fewer)."""
    parent = settings.get_profile(os.environ.get(PROFILE_ENV) or default)
    return settings(parent, max_examples=max(1, round(parent.max_examples * weight)))


# -- the problem spaces --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Space:
    """What a property may draw: lengths, head dims ``(D, Dv)``, heads, batch, page sizes."""

    short_lengths: int  # lengths are drawn from 1..short_lengths ...
    long_lengths: int  # ... or 1..long_lengths, or from boundary_lengths
    boundary_lengths: tuple[int, ...]
    head_dims: tuple[tuple[int, int], ...]
    kv_heads: tuple[int, ...]
    groups: tuple[int, ...]  # query heads per kv head: H = Hkv * group
    max_batch: int
    page_sizes: tuple[int, ...]
    max_pages: int
    max_sequences: int  # varlen batch
    max_varlen_length: int
    length_bucket: int  # the oracle pads lengths to a multiple of this
    min_max_seqlen: int = 0  # the kernels launch no grid for max_seqlen_q = 0

    def padded(self, b, sq, sk, h, hkv, d, dv) -> tuple[int, ...]:
        """The oracle's shape for a problem: batch, heads and head dims at the space's
        largest, lengths rounded up to the bucket (so few shapes compile)."""
        def up(n):
            return max(1, -(-n // self.length_bucket)) * self.length_bucket

        assert b <= self.max_batch and h <= max(self.kv_heads) * max(self.groups)
        return (self.max_batch, up(sq), up(sk), max(self.kv_heads) * max(self.groups),
                max(self.kv_heads), max(x for x, _ in self.head_dims),
                max(y for _, y in self.head_dims))


#: The pure-JAX reference on a CPU: short sequences (each new shape compiles), every head dim
#: (the kernels' ones too, cheap at these lengths), Dv > D as well (the reference takes it).
CPU_SPACE = Space(short_lengths=9, long_lengths=40, boundary_lengths=(1, 2, 31, 32, 33),
                  head_dims=((8, 8), (16, 16), (16, 8), (8, 24), (32, 32), (64, 64), (96, 96),
                             (128, 128), (192, 128), (192, 192), (256, 256)),
                  kv_heads=(1, 2), groups=(1, 2, 3), max_batch=3, page_sizes=(1, 4, 8, 16),
                  max_pages=4, max_sequences=4, max_varlen_length=12, length_bucket=64)

#: The Hopper kernels: their head dims, lengths across their 64/128-row and 64..176-key tiles,
#: pages a multiple of the paged kernel's 64-key block. 192/192 has forward kernels only (its
#: gradient would run the reference, which the GPU suite refuses): tests/gpu/test_sm90_fwd.py,
#: test_paged.py and test_single_rounding.py cover it.
GPU_SPACE = Space(short_lengths=20, long_lengths=700,
                  boundary_lengths=(1, 63, 64, 65, 127, 128, 129, 175, 176, 177, 255, 256, 257),
                  head_dims=((64, 64), (96, 96), (128, 128), (192, 128), (256, 256)),
                  kv_heads=(1, 2, 4), groups=(1, 2, 4), max_batch=3, page_sizes=(64, 128, 256),
                  max_pages=6, max_sequences=6, max_varlen_length=400, length_bucket=256,
                  min_max_seqlen=1)


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of one call, as passed to the library."""

    causal: bool = False
    window: tuple[int | None, int | None] = (None, None)
    softcap: float = 0.0
    softmax_scale: float | None = None

    @property
    def effective_window(self) -> tuple[int | None, int | None]:
        """(left, right) with causal applied: causal is ``right = 0`` whatever right was."""
        left, right = self.window
        return (left, 0) if self.causal else (left, right)

    def kwargs(self) -> dict:
        """The library's keyword arguments."""
        return dict(causal=self.causal, window_size=self.window, softcap=self.softcap,
                    softmax_scale=self.softmax_scale)


@dataclasses.dataclass(frozen=True)
class Heads:
    """Query heads H, key/value heads Hkv (H a multiple), head dims D and Dv."""

    h: int
    hkv: int
    d: int
    dv: int


@dataclasses.dataclass(frozen=True)
class DenseCase:
    """A flash_attention problem; ``segments`` is None or ``("single" | "pair", "packed" |
    "random")``: one (B, S) array or a (q, kv) pair, of contiguous or arbitrary ids."""

    b: int
    sq: int
    sk: int
    heads: Heads
    opts: Options
    sink: str | None  # None, "normal" or "extreme" (see sink_values)
    lse_grad: bool  # whether the loss also weighs lse
    seed: int
    segments: tuple[str, str] | None = None


@dataclasses.dataclass(frozen=True)
class VarlenCase:
    """A flash_attention_varlen problem: per-sequence lengths, padding tokens before
    cu_seqlens[0] and after cu_seqlens[-1], and the static max_seqlen slack."""

    lens_q: tuple[int, ...]
    lens_k: tuple[int, ...]
    pad_q: tuple[int, int]  # (front, back)
    pad_k: tuple[int, int]
    max_slack: int
    heads: Heads
    opts: Options
    sink: str | None
    lse_grad: bool
    seed: int


@dataclasses.dataclass(frozen=True)
class PagedCase:
    """A flash_attention_paged problem: keys used per batch entry and the unused table entries'
    filling (``-1`` or stale page indices)."""

    sq: int
    seqused: tuple[int, ...]
    page_size: int
    max_pages: int
    spare_pages: int
    heads: Heads
    opts: Options
    sink: str | None
    stale_entries: bool
    seed: int


#: No sink, a sink of ordinary logits, or one with a dominant (+20) and an absent (-inf) head.
SINKS = st.sampled_from([None, "normal", "extreme"])


def lengths(space: Space) -> st.SearchStrategy[int]:
    """A sequence length: short, anything up to the space's long bound, or a tile boundary."""
    return st.one_of(st.integers(1, space.short_lengths), st.integers(1, space.long_lengths),
                     st.sampled_from(space.boundary_lengths))


@st.composite
def options(draw, max_len: int) -> Options:
    """Causal or not, a window side unbounded or 0..max_len + 1, softcap off or on, scale
    default or explicit."""
    bound = st.one_of(st.none(), st.integers(0, max_len + 1))
    causal = draw(st.booleans())
    window = (draw(bound), draw(bound))
    softcap = draw(st.one_of(st.just(0.0), st.sampled_from([1.0, 5.0, 30.0])))
    scale = draw(st.one_of(st.none(), st.sampled_from([0.05, 0.3, 1.0])))
    return Options(causal, window, softcap, scale)


@st.composite
def heads(draw, space: Space) -> Heads:
    """MHA, GQA or MQA over one of the space's (D, Dv) pairs."""
    hkv = draw(st.sampled_from(space.kv_heads))
    d, dv = draw(st.sampled_from(space.head_dims))
    return Heads(hkv * draw(st.sampled_from(space.groups)), hkv, d, dv)


@st.composite
def dense_cases(draw, space: Space, segments: bool = False) -> DenseCase:
    """A dense problem; with ``segments`` also the form of its segment ids."""
    seg = None
    if segments:
        seg = (draw(st.sampled_from(["single", "pair"])), draw(st.sampled_from(["packed",
                                                                                  "random"])))
    sq = draw(lengths(space))
    sk = sq if seg is not None and seg[0] == "single" else draw(lengths(space))
    return DenseCase(b=draw(st.integers(1, space.max_batch)), sq=sq, sk=sk,
                     heads=draw(heads(space)), opts=draw(options(max(sq, sk))),
                     sink=draw(SINKS), lse_grad=draw(st.booleans()),
                     seed=draw(st.integers(0, 2**31 - 1)), segments=seg)


@st.composite
def varlen_cases(draw, space: Space) -> VarlenCase:
    """1..max_sequences sequences, each length 0, 1 or up to max_varlen_length (query and key
    lengths independent), 0..3 padding tokens at each end."""
    n = draw(st.integers(1, space.max_sequences))
    length = st.one_of(st.sampled_from([0, 1]), st.integers(0, space.max_varlen_length))
    lens_q = tuple(draw(st.lists(length, min_size=n, max_size=n)))
    lens_k = tuple(draw(st.lists(length, min_size=n, max_size=n)))
    pad = st.tuples(st.integers(0, 2), st.integers(0, 3))
    pad_q, pad_k = draw(pad), draw(pad)
    # no tensor may be empty: then a padding token after the last sequence
    if sum(lens_q) + sum(pad_q) == 0:
        pad_q = (pad_q[0], 1)
    if sum(lens_k) + sum(pad_k) == 0:
        pad_k = (pad_k[0], 1)
    return VarlenCase(lens_q, lens_k, pad_q, pad_k, max_slack=draw(st.integers(0, 2)),
                      heads=draw(heads(space)),
                      opts=draw(options(max(max(lens_q), max(lens_k), 1))),
                      sink=draw(SINKS), lse_grad=draw(st.booleans()),
                      seed=draw(st.integers(0, 2**31 - 1)))


@st.composite
def paged_cases(draw, space: Space) -> PagedCase:
    """1..max_batch entries over pages of one size; each uses 0..all of its table row's keys
    (whole pages, a partly used last page, empty), 0..2 spare pages in the cache."""
    page_size = draw(st.sampled_from(space.page_sizes))
    max_pages = draw(st.integers(1, space.max_pages))
    capacity = page_size * max_pages
    used = st.one_of(st.integers(0, capacity), st.sampled_from([0, 1, capacity]),
                     st.integers(0, max_pages).map(lambda p: p * page_size))
    seqused = tuple(draw(st.lists(used, min_size=1, max_size=space.max_batch)))
    sq = draw(st.one_of(st.just(1), st.integers(1, 5), lengths(space)))
    return PagedCase(sq=sq, seqused=seqused, page_size=page_size, max_pages=max_pages,
                     spare_pages=draw(st.integers(0, 2)), heads=draw(heads(space)),
                     opts=draw(options(max(capacity, sq))), sink=draw(SINKS),
                     stale_entries=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


# -- inputs --------------------------------------------------------------------------------------
def normal(rng: np.random.Generator, *shape: int, dtype=jnp.bfloat16) -> jax.Array:
    """Standard normal values drawn in float32, cast to ``dtype`` (never all zeros; rounded to
    nearest even by NumPy, as XLA's conversion rounds, with no program to compile per shape)."""
    return jnp.asarray(rng.standard_normal(shape, np.float32).astype(dtype))


def sink_values(rng: np.random.Generator, h: int, kind: str | None) -> jax.Array | None:
    """A float32 sink per head (None for no sink): "normal" a spread of logits around the
    scores' scale; "extreme" the same with head 0 at +20 (it takes nearly all the mass) and,
    with several heads, the last at -inf (no sink)."""
    if kind is None:
        return None
    values = rng.standard_normal(h).astype(np.float32) * 2.0
    if kind == "extreme":
        values[0] = 20.0
        if h > 1:
            values[-1] = -np.inf
    return jnp.asarray(values)


def segment_ids(rng: np.random.Generator, b: int, sq: int, sk: int, form: tuple[str, str]):
    """``segment_ids`` for flash_attention, and the (q_ids, kv_ids) pair they mean.

    "packed": contiguous runs (documents of a packed batch, lengths 1 and up), the same cut
    points for queries and keys when Sq == Sk; "random": arbitrary ids in 0..2 (so some queries
    see no key)."""
    def packed(n: int) -> np.ndarray:
        cuts = np.sort(rng.choice(np.arange(1, n), size=min(n - 1, rng.integers(0, 4)),
                                  replace=False)) if n > 1 else np.array([], int)
        ids = np.zeros((b, n), np.int32)
        for row in range(b):
            ids[row] = np.searchsorted(cuts, np.arange(n), side="right") * 7 + row  # any ints
        return ids

    def random(n: int) -> np.ndarray:
        return rng.integers(0, 3, (b, n)).astype(np.int32)

    make = packed if form[1] == "packed" else random
    if form[0] == "single":
        ids = make(sq)
        return jnp.asarray(ids), (ids, ids)
    q_ids, kv_ids = make(sq), make(sk)
    return (jnp.asarray(q_ids), jnp.asarray(kv_ids)), (q_ids, kv_ids)


# -- the masks, from the documented rules --------------------------------------------------------
def window_visible(q_pos: np.ndarray, k_pos: np.ndarray, window) -> np.ndarray:
    """Query at position ``q_pos`` sees key at ``k_pos`` iff
    ``q_pos - left <= k_pos <= q_pos + right`` (None: that side unbounded); broadcasts."""
    left, right = window
    visible = np.ones(np.broadcast_shapes(q_pos.shape, k_pos.shape), bool)
    if left is not None:
        visible &= k_pos >= q_pos - left
    if right is not None:
        visible &= k_pos <= q_pos + right
    return visible


def dense_mask(b: int, sq: int, sk: int, window, q_ids=None, kv_ids=None) -> np.ndarray:
    """(B, Sq, Sk): bottom-right aligned window (query i at position i + Sk - Sq), and equal
    segment ids when given."""
    q_pos = np.arange(sq)[:, None] + sk - sq
    mask = np.broadcast_to(window_visible(q_pos, np.arange(sk)[None, :], window), (b, sq, sk))
    if q_ids is not None:
        mask = mask & (np.asarray(q_ids)[:, :, None] == np.asarray(kv_ids)[:, None, :])
    return mask


def cu_seqlens(lengths_: tuple[int, ...], front: int) -> np.ndarray:
    """int32 (batch + 1,) offsets of back-to-back sequences after ``front`` padding tokens."""
    return (np.concatenate([[0], np.cumsum(lengths_)]) + front).astype(np.int32)


def varlen_mask(case: VarlenCase, window) -> np.ndarray:
    """(1, total_q, total_k): sequence b's query i sees its key j by the window rule with the
    query at ``i + len_k(b) - len_q(b)``; padding tokens see and are seen by nothing."""
    cu_q, cu_k = cu_seqlens(case.lens_q, case.pad_q[0]), cu_seqlens(case.lens_k, case.pad_k[0])
    mask = np.zeros((1, int(cu_q[-1]) + case.pad_q[1], int(cu_k[-1]) + case.pad_k[1]), bool)
    for b, (lq, lk) in enumerate(zip(case.lens_q, case.lens_k)):
        q_pos = np.arange(lq)[:, None] + lk - lq
        mask[0, cu_q[b]:cu_q[b + 1], cu_k[b]:cu_k[b + 1]] = window_visible(
            q_pos, np.arange(lk)[None, :], window)
    return mask


def paged_keys(k_cache, v_cache, table: np.ndarray, seqused, sq: int, window):
    """Each batch entry's keys and values gathered page by page in table order (its first
    seqused_k keys, zero-padded to max_pages · page_size), and the (B, Sq, max_keys) mask: key
    j < seqused_k[b], window with query i at ``i + seqused_k[b] - Sq``."""
    k_cache, v_cache = np.asarray(k_cache, np.float32), np.asarray(v_cache, np.float32)
    b, max_pages = table.shape
    page_size = k_cache.shape[1]
    max_keys = max_pages * page_size
    k = np.zeros((b, max_keys) + k_cache.shape[2:], np.float32)
    v = np.zeros((b, max_keys) + v_cache.shape[2:], np.float32)
    mask = np.zeros((b, sq, max_keys), bool)
    for row, n in enumerate(seqused):
        for j in range(n):
            page, slot = table[row, j // page_size], j % page_size
            k[row, j], v[row, j] = k_cache[page, slot], v_cache[page, slot]
        q_pos = np.arange(sq)[:, None] + n - sq
        key = np.arange(max_keys)[None, :]
        mask[row] = window_visible(q_pos, key, window) & (key < n)
    return k, v, mask


# -- the naive oracle ----------------------------------------------------------------------------
_HIGHEST = jax.lax.Precision.HIGHEST  # float32 products in full precision (no TF32 on GPUs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def rounded_softmax(logits, dtype):
    """Softmax over the last axis of float32 ``logits`` (``-inf``: hidden), computed in
    float32 and rounded to ``dtype``; a row with no finite logit gives 0. Its gradient is the
    softmax's, ``p (g - sum(g p))``, from the rounded output ``p`` and cotangent ``g``, in
    float32: what a framework's 16-bit softmax does (FA4's pt is PyTorch's)."""
    return _softmax_forward(logits, dtype)[0]


def _softmax_forward(logits, dtype):
    """(p, residual p): the forward of :func:`rounded_softmax`."""
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = (e / jnp.where(total > 0, total, 1.0)).astype(dtype)
    return p, p


def _softmax_backward(dtype, p, g):
    """The cotangent of the logits from the rounded p and g (float32 arithmetic)."""
    p, g = p.astype(jnp.float32), g.astype(jnp.float32)
    return (p * (g - jnp.sum(g * p, axis=-1, keepdims=True)),)


rounded_softmax.defvjp(_softmax_forward, _softmax_backward)


def naive_attention(q, k, v, mask, sink, head_map, scale, softcap, dtype):
    """Dense masked softmax attention from its definition, every tensor rounded to ``dtype``.

    q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), mask (B, Sq, Sk) bool, sink (H,)
    float32 (``-inf``: no sink), head_map (H,) int: the kv head of each query head. ``scale``
    and ``softcap`` are float32 scalars (softcap 0: off). Scores ``scale · q·k`` (products
    accumulated in float32, then rounded to ``dtype``), capped to ``softcap · tanh(s / softcap)``
    when softcap > 0; the softmax (:func:`rounded_softmax`) is over the visible keys plus one
    extra logit ``sink[h]`` of value 0; the probabilities, in ``dtype``, multiply v (accumulated
    in float32). ``dtype = float32`` is the reference ``ref``; bfloat16 is FA4's ``pt``.

    Returns:
      out (B, Sq, H, Dv) in ``dtype`` (0 for rows with no visible key) and lse (B, H, Sq)
      float32, the log-sum-exp of the same logits (``-inf`` for those rows without a sink, the
      sink with one). Differentiable, with finite gradients everywhere.
    """
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    k, v = jnp.take(k, head_map, axis=2), jnp.take(v, head_map, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32,
                   precision=_HIGHEST).astype(dtype)
    s = (s * scale.astype(dtype)).astype(dtype)
    cap = softcap.astype(dtype)
    safe_cap = jnp.where(cap > 0, cap, jnp.ones_like(cap))
    s = jnp.where(cap > 0, (safe_cap * jnp.tanh(s / safe_cap)).astype(dtype), s)
    visible = jnp.asarray(mask)[:, None]  # (B, 1, Sq, Sk)
    sink_logit = jnp.broadcast_to(sink.astype(dtype).astype(jnp.float32)[None, :, None, None],
                                  s.shape[:3] + (1,))
    logits = jnp.concatenate([jnp.where(visible, s.astype(jnp.float32), -jnp.inf), sink_logit],
                             axis=-1)
    p = rounded_softmax(logits, dtype)[..., :-1]  # the sink's column has no value
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v, preferred_element_type=jnp.float32,
                     precision=_HIGHEST).astype(dtype)
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
    m = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    total = jnp.sum(jnp.exp(logits - m[..., None]), axis=-1)
    lse = jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)) + m, -jnp.inf)
    return out, lse


def weighted_loss(attend, w_out, w_lse):
    """``loss(q, k, v, sink) -> (sum(out · w_out) + sum(finite lse · w_lse), (out, lse))``
    for an ``attend(q, k, v, sink) -> (out, lse)``; ``w_lse`` None leaves lse out."""
    def loss(q, k, v, sink):
        out, lse = attend(q, k, v, sink)
        value = jnp.sum(out.astype(jnp.float32) * w_out)
        if w_lse is not None:
            value = value + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse)
        return value, (out, lse)
    return loss


def outputs_and_grads(attend, args, w_out, w_lse):
    """(out, lse, grads): grads of :func:`weighted_loss` in q, k, v (and the sink if given)."""
    q, k, v, sink = args
    argnums = (0, 1, 2) if sink is None else (0, 1, 2, 3)
    (_, (out, lse)), grads = jax.value_and_grad(weighted_loss(attend, w_out, w_lse), argnums,
                                                has_aux=True)(q, k, v, sink)
    return out, lse, grads


@jax.jit
def _oracle(q, k, v, mask, sink, head_map, scale, softcap, w_out, w_lse):
    """(ref, pt): :func:`naive_attention`'s (out, lse, (dq, dk, dv, dsink)) in float32 on the
    float32-upcast inputs and in bfloat16, one compiled program per padded shape."""
    results = []
    for dtype in (jnp.float32, jnp.bfloat16):
        def attend(q, k, v, sink, dtype=dtype):
            return naive_attention(q, k, v, mask, sink, head_map, scale, softcap, dtype)
        args = tuple(x.astype(dtype) for x in (q, k, v)) + (sink,)
        results.append(outputs_and_grads(attend, args, w_out, w_lse))
    return tuple(results)


def _padded(x, shape, dtype, fill=0) -> np.ndarray:
    """``x`` in the leading corner of a ``shape`` array of ``fill``."""
    out = np.full(shape, fill, dtype)
    out[tuple(slice(0, n) for n in np.shape(x))] = np.asarray(x, dtype)
    return out


def naive_results(space: Space, q, k, v, mask, sink, scale: float, softcap: float, w_out,
                  w_lse):
    """``(ref, pt)`` of :func:`naive_attention`, each ``(out, lse, (dq, dk, dv[, dsink]))`` as
    NumPy arrays of the problem's shapes (q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv),
    mask (B, Sq, Sk), sink None or (H,)).

    Every problem is padded into a shape of the space's buckets (:meth:`Space.padded`; padding
    queries, keys, heads and head-dim columns are zeros, masked, or weighted 0), so the oracle
    compiles once per bucket, not once per drawn shape."""
    (b, sq, h, d), (sk, hkv), dv = np.shape(q), np.shape(k)[1:3], np.shape(v)[3]
    bp, sqp, skp, hp, hkvp, dp, dvp = space.padded(b, sq, sk, h, hkv, d, dv)
    bf16 = jnp.bfloat16
    head_map = np.zeros(hp, np.int32)
    head_map[:h] = np.arange(h) // (h // hkv)
    args = (_padded(q, (bp, sqp, hp, dp), bf16), _padded(k, (bp, skp, hkvp, dp), bf16),
            _padded(v, (bp, skp, hkvp, dvp), bf16), _padded(mask, (bp, sqp, skp), bool),
            _padded(np.full(h, -np.inf) if sink is None else sink, (hp,), np.float32, -np.inf),
            head_map, np.float32(scale), np.float32(softcap),
            _padded(w_out, (bp, sqp, hp, dvp), np.float32),
            _padded(np.zeros((b, h, sq)) if w_lse is None else w_lse, (bp, hp, sqp), np.float32))
    results = []
    for out, lse, (dq, dk, dv_, dsink) in jax.device_get(_oracle(*args)):
        grads = (dq[:b, :sq, :h, :d], dk[:b, :sk, :hkv, :d], dv_[:b, :sk, :hkv, :dv])
        results.append((out[:b, :sq, :h, :dv], lse[:b, :h, :sq],
                        grads if sink is None else grads + (dsink[:h],)))
    return results


# -- checks --------------------------------------------------------------------------------------
def assert_no_nan(name: str, x) -> None:
    """No NaN anywhere in ``x``."""
    assert not np.isnan(np.asarray(x, np.float32)).any(), f"{name}: NaN"


def assert_lse_close(lse, ref_lse, pt_lse, *, softcap: bool, name: str = "lse") -> None:
    """The same ``-inf`` entries as ``ref_lse``; on the finite ones FA4's rule with an absolute
    slack of 1e-3 · max(1, max|ref_lse|) (lse is float32 in every implementation)."""
    lse, ref_lse, pt_lse = (np.asarray(x, np.float32) for x in (lse, ref_lse, pt_lse))
    assert lse.shape == ref_lse.shape, f"{name}: shape {lse.shape}, want {ref_lse.shape}"
    assert_no_nan(name, lse)
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty, err_msg=f"{name}: -inf rows differ")
    finite = ~empty
    if finite.any():
        err = float(np.max(np.abs(lse[finite] - ref_lse[finite])))
        pt_err = float(np.max(np.abs(pt_lse[finite] - ref_lse[finite])))
        bound = (3 if softcap else 2) * pt_err + 1e-3 * max(1.0, float(np.abs(ref_lse[finite])
                                                                       .max()))
        assert err <= bound, (f"{name}: max|lse - ref| = {err:.4g} exceeds {bound:.4g} "
                              f"(pt error {pt_err:.4g})")


def sink_gradients_of_rounded_cotangent(ref_out, ref_lse, sink, w_out, w_lse, out_dtype):
    """d sink of the weighted loss as a FlashAttention backward computes it from what it has:
    the output's cotangent in the output dtype (the cotangent of a bfloat16 output is bfloat16
    under JAX's autodiff), here ``w_out`` rounded to ``out_dtype``, with the output either as
    the forward accumulated it (a backward summing P·dP in float32, as the sm90 kernel's
    sink_grad does: the oracle's float32 ``ref_out``) or rounded to ``out_dtype`` (one taking
    ``rowsum(dout · out)`` of the output it returned). Both forms, each
    ``-sum_{b,i} e^{sink_h - lse_bhi} (sum_d w_out_bihd out_bihd - w_lse_bhi)`` over the rows
    with a finite lse, in float64. ref_out (B, Sq, H, Dv), ref_lse (B, H, Sq)."""
    def rounded(x):
        return np.asarray(np.asarray(x, np.float32).astype(out_dtype), np.float64)

    lse = np.asarray(ref_lse, np.float64)
    finite = np.isfinite(lse)
    p_sink = np.where(finite, np.exp(np.asarray(sink, np.float64)[None, :, None]
                                     - np.where(finite, lse, 0.0)), 0.0)
    forms = []
    for out in (np.asarray(ref_out, np.float64), rounded(ref_out)):
        rowsum = np.einsum("bqhd,bqhd->bhq", rounded(w_out), out)
        if w_lse is not None:
            rowsum = rowsum - np.asarray(w_lse, np.float64)
        forms.append(-(p_sink * rowsum).sum(axis=(0, 2)).astype(np.float32))
    return tuple(forms)


def dsink_pt(pt_dsink, ref_dsink, forms):
    """FA4's "pt" for d sink: the farthest from ``ref_dsink`` of the 16-bit oracle's d sink
    ``pt_dsink`` and ``forms`` (:func:`sink_gradients_of_rounded_cotangent`), in pt's dtype."""
    ref32 = np.asarray(ref_dsink, np.float32)
    far = max((np.asarray(pt_dsink, np.float32), *forms),
              key=lambda x: np.abs(np.asarray(x, np.float32) - ref32).max())
    return np.asarray(far).astype(pt_dsink.dtype)


def dsink_pt_of(pt_dsink, ref_dsink, ref_out, ref_lse, sink, w_out, w_lse,
                out_dtype=jnp.bfloat16) -> jax.Array:
    """:func:`dsink_pt` with the forms of :func:`sink_gradients_of_rounded_cotangent`."""
    forms = sink_gradients_of_rounded_cotangent(ref_out, ref_lse, sink, w_out, w_lse, out_dtype)
    return jnp.asarray(dsink_pt(pt_dsink, ref_dsink, forms))


def assert_rule(got, ref, pt, *, softcap: bool, name: str,
                grad_scale: float | None = None) -> None:
    """FA4's rule (tests/numerics.py), ``ref`` cast to ``got``'s dtype. Its atol,
    ``2 max|(ref + 0.3 - 0.3) - ref|``, is twice the rounding error of adding 0.3 in that dtype
    (about an ulp at 0.3), except for an identically zero ref, where it degenerates to 0 (e.g.
    dq when every query sees exactly one key: the softmax is constant, and dq is float32
    cancellation noise); then the rule takes that ulp, ``eps / 4``, as its atol. A gradient
    (``grad_scale``: the case's largest reference gradient entry) also takes the rule's slack
    for cancellation, ``2⁻¹² · grad_scale`` (``jax_fa4.tools.fa4_rule``)."""
    ref = np.asarray(ref).astype(got.dtype)
    if ref.size == 0 or np.any(ref != 0):
        assert_fa4_close(got, ref, pt, softcap=softcap, name=name, grad_scale=grad_scale)
        return
    got32, pt32 = np.asarray(got, np.float32), np.asarray(pt, np.float32)
    assert got32.shape == ref.shape == pt32.shape, (name, got32.shape, ref.shape, pt32.shape)
    atol = float(jnp.finfo(got.dtype).eps / 4)
    if grad_scale is not None:
        atol = max(atol, GRAD_SLACK * grad_scale)
    bound = (3 if softcap else 2) * float(np.abs(pt32).max()) + atol
    err = float(np.abs(got32).max())
    assert err <= bound, f"{name}: max|out| = {err:.4g} exceeds {bound:.4g} (ref is all zeros)"


def check_results(name: str, got, ref, pt, *, softcap: bool, grad_names=(),
                  dsink_forms=()) -> None:
    """``got``, ``ref``, ``pt`` are (out, lse, grads): out and each gradient by FA4's rule
    against ref (:func:`assert_rule`), lse by :func:`assert_lse_close`; nothing NaN.

    d sink (float32, summed over every row) is the one gradient whose low-precision error the
    bfloat16 oracle does not bound: a FlashAttention backward computes it from the output's
    cotangent, bfloat16 (and possibly the bfloat16 output), so its error grows with the rows and
    Dv, while pt's d sink (through P and V) is nearly the float32 sum rounded once. Its pt is
    therefore the farthest from ref of pt's d sink and ``dsink_forms``
    (:func:`sink_gradients_of_rounded_cotangent`: the exact formula on the rounded cotangent,
    with the output exact or rounded), :func:`dsink_pt`."""
    (out, lse, grads), (ref_out, ref_lse, ref_grads), (pt_out, pt_lse, pt_grads) = got, ref, pt
    assert_no_nan(f"{name} out", out)
    assert_rule(out, ref_out, pt_out, softcap=softcap, name=f"{name} out")
    assert_lse_close(lse, ref_lse, pt_lse, softcap=softcap, name=f"{name} lse")
    # the slack's scale: the largest dq / dk / dv entry; d sink (a sum over every row) its own
    token_scale = grad_scale(*ref_grads[:3])
    for gname, g, r, p in zip(grad_names, grads, ref_grads, pt_grads):
        scale = grad_scale(r) if gname == "dsink" else token_scale
        assert g.shape == r.shape and g.dtype == p.dtype, (gname, g.shape, g.dtype)
        assert_no_nan(f"{name} {gname}", g)
        if gname == "dsink" and dsink_forms:
            p = dsink_pt(p, r, dsink_forms)
        assert_rule(g, r, p, softcap=softcap, name=f"{name} {gname}", grad_scale=scale)


def check_empty_rows(name: str, out, lse, key_less: np.ndarray, sink) -> None:
    """Rows with no visible key (``key_less``, (B, H, Sq) bool): output exactly 0, lse -inf or,
    with a sink, the sink itself."""
    if not key_less.any():
        return
    rows = np.asarray(out, np.float32).transpose(0, 2, 1, 3)[key_less]
    assert (rows == 0).all(), f"{name}: rows without a visible key are not 0"
    lse = np.asarray(lse)
    if sink is None:
        assert np.isneginf(lse[key_less]).all(), f"{name}: key-less rows' lse is not -inf"
    else:
        want = np.broadcast_to(np.asarray(sink)[None, :, None], lse.shape)[key_less]
        np.testing.assert_allclose(lse[key_less], want, rtol=1e-6, atol=1e-6,
                                   err_msg=f"{name}: key-less rows' lse is not the sink")


def _grad_names(sink) -> tuple[str, ...]:
    """The gradients a call returns: of q, k, v, and of the sink if there is one."""
    return ("dq", "dk", "dv") if sink is None else ("dq", "dk", "dv", "dsink")


# -- the properties ------------------------------------------------------------------------------
def _weights(rng, out_shape, lse_shape, with_lse: bool):
    """Random loss weights of out and (if ``with_lse``) of lse, float32."""
    w_out = rng.standard_normal(out_shape, np.float32)
    w_lse = rng.standard_normal(lse_shape, np.float32) if with_lse else None
    return w_out, w_lse


def _scale(opts: Options, d: int) -> float:
    """The softmax scale the call uses: explicit, or the default 1/sqrt(D)."""
    return 1.0 / np.sqrt(d) if opts.softmax_scale is None else opts.softmax_scale


def _run(fn, *args, before_call=None):
    """``fn(*args)`` jitted, compiled first, then ``before_call()`` (e.g. poisoning free device
    memory) right before it runs."""
    compiled = jax.jit(fn).lower(*args).compile()
    if before_call is not None:
        before_call()
    return jax.block_until_ready(compiled(*args))


def _library_grads(library, args, w_out, w_lse, before_call=None):
    """(out, lse, grads) of ``library(q, k, v, sink) -> (out, lse)`` under one jit."""
    return _run(lambda args: outputs_and_grads(library, args, w_out, w_lse), args,
                before_call=before_call)


def check_dense(case: DenseCase, implementation: str | None, space: Space,
                before_call=None) -> None:
    """flash_attention (with segment ids when the case has them) against the naive oracle:
    out, lse, dq, dk, dv (and dsink), the key-less rows."""
    hd, opts = case.heads, case.opts
    rng = np.random.default_rng(case.seed)
    q = normal(rng, case.b, case.sq, hd.h, hd.d)
    k = normal(rng, case.b, case.sk, hd.hkv, hd.d)
    v = normal(rng, case.b, case.sk, hd.hkv, hd.dv)
    sink = sink_values(rng, hd.h, case.sink)
    w_out, w_lse = _weights(rng, (case.b, case.sq, hd.h, hd.dv), (case.b, hd.h, case.sq),
                            case.lse_grad)
    seg_arg, (q_ids, kv_ids) = (None, (None, None)) if case.segments is None else segment_ids(
        rng, case.b, case.sq, case.sk, case.segments)
    mask = dense_mask(case.b, case.sq, case.sk, opts.effective_window, q_ids, kv_ids)

    def library(q, k, v, sink):
        return jax_fa4.flash_attention(q, k, v, learnable_sink=sink, segment_ids=seg_arg,
                                       return_lse=True, implementation=implementation,
                                       **opts.kwargs())

    got = _library_grads(library, (q, k, v, sink), w_out, w_lse, before_call)
    ref, pt = naive_results(space, q, k, v, mask, sink, _scale(opts, hd.d), opts.softcap,
                            w_out, w_lse)
    out, lse = got[0], got[1]
    assert out.shape == (case.b, case.sq, hd.h, hd.dv) and out.dtype == jnp.bfloat16
    assert lse.shape == (case.b, hd.h, case.sq) and lse.dtype == jnp.float32
    name = f"dense {case}"
    forms = () if sink is None else sink_gradients_of_rounded_cotangent(
        ref[0], ref[1], sink, w_out, w_lse, out.dtype)
    check_results(name, got, ref, pt, softcap=opts.softcap > 0, grad_names=_grad_names(sink),
                  dsink_forms=forms)
    key_less = np.broadcast_to(~mask.any(-1)[:, None, :], lse.shape)
    check_empty_rows(name, out, lse, key_less, sink)


def check_varlen(case: VarlenCase, implementation: str | None, space: Space,
                 before_call=None) -> None:
    """flash_attention_varlen against the naive oracle on the packed tokens (one batch entry
    masked by :func:`varlen_mask`): out, lse (H, total_q), dq, dk, dv (and dsink); padding
    tokens exactly 0 output, lse -inf (even with a sink), zero gradients."""
    hd, opts = case.heads, case.opts
    rng = np.random.default_rng(case.seed)
    cu_q, cu_k = cu_seqlens(case.lens_q, case.pad_q[0]), cu_seqlens(case.lens_k, case.pad_k[0])
    total_q, total_k = int(cu_q[-1]) + case.pad_q[1], int(cu_k[-1]) + case.pad_k[1]
    q = normal(rng, total_q, hd.h, hd.d)
    k = normal(rng, total_k, hd.hkv, hd.d)
    v = normal(rng, total_k, hd.hkv, hd.dv)
    sink = sink_values(rng, hd.h, case.sink)
    w_out, w_lse = _weights(rng, (total_q, hd.h, hd.dv), (hd.h, total_q), case.lse_grad)
    mask = varlen_mask(case, opts.effective_window)
    max_q, max_k = (max(max(lens) + case.max_slack, space.min_max_seqlen)
                    for lens in (case.lens_q, case.lens_k))
    in_sequence_q = np.zeros(total_q, bool)
    in_sequence_q[cu_q[0]:cu_q[-1]] = True
    in_sequence_k = np.zeros(total_k, bool)
    in_sequence_k[cu_k[0]:cu_k[-1]] = True

    def library(q, k, v, sink):
        return jax_fa4.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k,
                                              learnable_sink=sink, return_lse=True,
                                              implementation=implementation, **opts.kwargs())

    got = _library_grads(library, (q, k, v, sink), w_out, w_lse, before_call)
    # the oracle on the packed tokens as one batch entry; padding queries belong to no
    # sequence: no sink either (lse -inf), and no lse weight (their lse is not a function)
    w_lse_valid = None if w_lse is None else np.where(in_sequence_q[None, :], w_lse, 0)
    naive = naive_results(space, *(np.asarray(x)[None] for x in (q, k, v)), mask, sink,
                          _scale(opts, hd.d), opts.softcap, w_out[None],
                          None if w_lse is None else w_lse_valid[None])
    ref, pt = ((o[0], np.where(in_sequence_q[None, :], l[0], -np.inf),
                tuple(g[0] for g in gr[:3]) + tuple(gr[3:])) for o, l, gr in naive)
    out, lse, grads = got
    assert out.shape == (total_q, hd.h, hd.dv) and lse.shape == (hd.h, total_q)
    name = f"varlen {case}"
    forms = () if sink is None else sink_gradients_of_rounded_cotangent(
        ref[0][None], ref[1][None], sink, w_out[None],
        None if w_lse is None else w_lse_valid[None], out.dtype)
    check_results(name, got, ref, pt, softcap=opts.softcap > 0, grad_names=_grad_names(sink),
                  dsink_forms=forms)
    out32 = np.asarray(out, np.float32)
    assert (out32[~in_sequence_q] == 0).all(), f"{name}: padding tokens' output is not 0"
    assert np.isneginf(np.asarray(lse)[:, ~in_sequence_q]).all(), \
        f"{name}: padding tokens' lse is not -inf"
    for gname, g, valid in zip(("dq", "dk", "dv"), grads, (in_sequence_q, in_sequence_k,
                                                           in_sequence_k)):
        assert (np.asarray(g, np.float32)[~valid] == 0).all(), \
            f"{name}: padding tokens got a nonzero {gname}"
    key_less = np.broadcast_to(~mask[0].any(-1)[None, :], lse.shape) & in_sequence_q[None, :]
    check_empty_rows(name, np.asarray(out)[None], np.asarray(lse)[None], key_less[None], sink)


def check_paged(case: PagedCase, implementation: str | None, space: Space,
                before_call=None) -> None:
    """flash_attention_paged against the naive oracle on each entry's keys gathered page by
    page (:func:`paged_keys`): out and lse, the key-less rows (forward only: the paged call is
    not differentiable)."""
    hd, opts = case.heads, case.opts
    rng = np.random.default_rng(case.seed)
    b = len(case.seqused)
    num_pages = b * case.max_pages + case.spare_pages
    q = normal(rng, b, case.sq, hd.h, hd.d)
    k_cache = normal(rng, num_pages, case.page_size, hd.hkv, hd.d)
    v_cache = normal(rng, num_pages, case.page_size, hd.hkv, hd.dv)
    sink = sink_values(rng, hd.h, case.sink)
    table = rng.permutation(num_pages)[:b * case.max_pages].reshape(b, case.max_pages)
    table = table.astype(np.int32)
    for row, n in enumerate(case.seqused):  # entries past the used pages: never read
        unused = slice(-(-n // case.page_size), None)
        table[row, unused] = (rng.integers(0, num_pages, table[row, unused].shape)
                              if case.stale_entries else -1)
    seqused = np.asarray(case.seqused, np.int32)
    k, v, mask = paged_keys(k_cache, v_cache, table, case.seqused, case.sq,
                            opts.effective_window)

    out, lse = _run(lambda q, k_cache, v_cache, sink: jax_fa4.flash_attention_paged(
        q, k_cache, v_cache, table, seqused, learnable_sink=sink, return_lse=True,
        implementation=implementation, **opts.kwargs()), q, k_cache, v_cache, sink,
        before_call=before_call)
    ref, pt = naive_results(space, q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), mask,
                            sink, _scale(opts, hd.d), opts.softcap,
                            np.zeros((b, case.sq, hd.h, hd.dv), np.float32), None)
    assert out.shape == (b, case.sq, hd.h, hd.dv) and lse.shape == (b, hd.h, case.sq)
    name = f"paged {case}"
    check_results(name, (out, lse, ()), ref, pt, softcap=opts.softcap > 0)
    key_less = np.broadcast_to(~mask.any(-1)[:, None, :], lse.shape)
    check_empty_rows(name, out, lse, key_less, sink)
