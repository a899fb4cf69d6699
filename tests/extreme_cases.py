"""Extreme-numerics cases (issue #24), shared by tests/test_extreme_numerics.py (the reference,
on the CPU) and tests/gpu/test_extreme_numerics.py (the Hopper kernels).

Two families of cases, each run through the public API under ``jax.jit`` (so varlen / paged
metadata is traced) with ``return_lse=True``:

* **Huge scores**: fresh standard-normal q and k scaled so that the largest
  ``|softmax_scale · q·k|`` over the batch is a target from 1e4 (what fp16 scores allow) up to
  8e37 (near float32's 3.4e38, bf16 only), either by scaling q and k or through a large
  ``softmax_scale``; some with softcap (huge logits saturate tanh). The raw ``q·k`` a kernel
  accumulates before scaling stays below float32's overflow too (see :func:`_overflow_inputs`).
* **Rows with no visible key** under every mode: causal with Sq > Sk (bottom-right alignment
  leaves the top rows without keys), sliding windows that exclude every key of some rows,
  segment ids whose query segment has no key (and the padding conventions: distinct ids for
  query and key padding match nothing; one shared id makes padding attend padding), varlen with
  empty sequences, sequences with queries but no keys and padding tokens, paged with
  ``seqused_k = 0`` or fewer keys than causal queries.

Expectations (:func:`check_case`):

* no NaN anywhere (out, lse, every gradient);
* a row with no visible key: out exactly 0 and lse exactly -inf, or exactly the sink with a
  learnable sink (varlen padding tokens: lse -inf even with a sink);
* out on the other rows by FA4's rule (tests/numerics.py) against an independent float64 NumPy
  oracle (:func:`oracle`), with the 16-bit naive reference as FA4's "pt"; lse likewise on its
  finite entries;
* gradients (dense and varlen; paged is forward only) of ``sum(out·w) + sum(lse·w')`` (lse
  terms where lse is finite): dq, dk, dv, dsink all finite; dq exactly 0 on rows without keys,
  dk and dv exactly 0 for keys no query sees; dv and dsink by FA4's rule against the oracle's
  backward (on the kernels dv only up to scores of 1e7: ``Case.beyond_lse_precision``), and dq,
  dk too on the cases whose scores are moderate. With huge scores every row's
  softmax is one-hot, so the exact dq and dk are 0 while any float32 backward returns rounding
  noise times ``softmax_scale · |k|`` (``dS = P·(dP − delta)`` cancels two equal float32 sums);
  there they must only be finite.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa4
from jax_fa4 import reference
from numerics import assert_fa4_close

FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class Case:
    """One extreme case. ``kind``: "dense", "varlen" or "paged".

    Dense: q (b, sq, h, d), k / v (b, sk, hkv, d); ``segments``: None, "pair" (a query segment
    with no keys, query padding -1 and key padding -2) or "shared" (one (B, S) array whose
    padding id 0 is shared, so padding attends padding; needs sq == sk).
    Varlen: ``lens_q`` / ``lens_k`` per sequence, packed with ``PAD_FRONT`` / ``PAD_BACK``
    padding tokens around them (b = 1).
    Paged: ``seqused`` per batch entry, ``page_size``, ``max_pages`` (b = len(seqused)).
    ``score``: the largest |scaled score| the inputs are scaled to (None: standard normal);
    ``scale_by``: "inputs" (q and k scaled) or "softmax_scale" (a large softmax_scale).
    """

    name: str
    kind: str = "dense"
    dtype: str = "bfloat16"
    b: int = 1
    sq: int = 0
    sk: int = 0
    h: int = 4
    hkv: int = 2
    d: int = 128
    window: tuple = (None, None)
    softcap: float = 0.0
    sink: bool = False
    softmax_scale: float | None = None
    score: float | None = None
    scale_by: str = "inputs"
    segments: str | None = None
    lens_q: tuple = ()
    lens_k: tuple = ()
    seqused: tuple = ()
    page_size: int = 128
    max_pages: int = 4

    @property
    def differentiable(self) -> bool:
        return self.kind != "paged"

    @property
    def huge(self) -> bool:
        """Scores large enough that every row's softmax is one-hot (dq, dk only finite)."""
        return self.score is not None

    @property
    def beyond_lse_precision(self) -> bool:
        """Scores of 1e7 and more: a kernel backward rebuilds P = exp2(s·scale·log2 e − lse·log2 e)
        from the float32 lse the forward stored, whose rounding there (ulp(lse·log2 e) >= 1
        from 2^24 on) moves P's exponent by whole units, so dv is no longer within FA4's rule
        (checked finite only; from 1e9 on see tests/gpu/test_extreme_numerics.py)."""
        return self.score is not None and self.score >= 1e7


PAD_FRONT, PAD_BACK = 3, 5

_VARLEN_Q = (1, 0, 37, 5, 20)  # a 37-query sequence without keys; 20 queries over 9 keys
_VARLEN_K = (7, 3, 0, 64, 9)

CASES = [
    # -- huge scores ---------------------------------------------------------------------------
    Case("fp16 scores 1e4", dtype="float16", b=2, sq=40, sk=56, score=1e4),
    Case("fp16 scores 3e4 causal sink", dtype="float16", sq=48, sk=48, window=(None, 0),
         score=3e4, sink=True),
    Case("bf16 scores 1e4 window", sq=33, sk=70, window=(20, 5), score=1e4),
    Case("bf16 scores 1e6", sq=40, sk=56, score=1e6),
    # several key blocks (tile_n 128): the running max moves between blocks near the limit
    Case("bf16 scores 3e8, 3 key blocks", sq=40, sk=300, score=3e8),
    Case("fp16 scores 3e4, 3 key blocks causal", dtype="float16", sq=300, sk=300,
         window=(None, 0), score=3e4),
    Case("bf16 scores 1e12 causal", sq=56, sk=40, window=(None, 0), score=1e12),
    Case("bf16 scores 1e20 sink", sq=40, sk=56, score=1e20, sink=True),
    Case("bf16 scores 8e37", sq=40, sk=56, score=8e37, softmax_scale=1.0),
    Case("bf16 scores 8e37 causal sq>sk sink", sq=70, sk=33, window=(None, 0), score=8e37,
         softmax_scale=1.0, sink=True),
    Case("bf16 softmax_scale for 8e37", sq=40, sk=56, score=8e37, scale_by="softmax_scale"),
    Case("bf16 softmax_scale for 1e30 causal", sq=48, sk=48, window=(None, 0), score=1e30,
         scale_by="softmax_scale"),
    Case("bf16 softcap 30, scores 1e20", sq=40, sk=56, score=1e20, softcap=30.0),
    Case("bf16 softcap 5, softmax_scale for 8e37, sink", sq=40, sk=56, score=8e37,
         scale_by="softmax_scale", softcap=5.0, sink=True),
    Case("fp16 softcap 20, scores 3e4, window", dtype="float16", sq=48, sk=48, window=(8, 3),
         score=3e4, softcap=20.0),
    # -- rows without keys ---------------------------------------------------------------------
    Case("causal sq>sk", b=2, sq=70, sk=33, window=(None, 0)),
    Case("causal sq>sk sink", b=2, sq=70, sk=33, window=(None, 0), sink=True),
    Case("causal sq>sk fp16 softcap", dtype="float16", sq=100, sk=1, window=(None, 0),
         softcap=10.0),
    Case("window excludes top rows", b=2, sq=70, sk=40, window=(3, 2)),
    Case("window excludes top rows sink softcap", sq=70, sk=40, window=(3, 2), softcap=10.0,
         sink=True),
    Case("window diagonal only fp16", dtype="float16", sq=48, sk=16, window=(0, 0)),
    Case("window huge scores empty rows", sq=70, sk=40, window=(3, 2), score=1e20),
    Case("segments pair", b=2, sq=40, sk=52, segments="pair"),
    Case("segments pair causal sink", b=2, sq=40, sk=52, window=(None, 0), segments="pair",
         sink=True),
    Case("segments shared padding", b=2, sq=48, sk=48, segments="shared"),
    Case("varlen", kind="varlen", lens_q=_VARLEN_Q, lens_k=_VARLEN_K),
    Case("varlen causal sink", kind="varlen", lens_q=_VARLEN_Q, lens_k=_VARLEN_K,
         window=(None, 0), sink=True),
    Case("varlen window softcap fp16", kind="varlen", dtype="float16", lens_q=_VARLEN_Q,
         lens_k=_VARLEN_K, window=(4, 1), softcap=20.0),
    Case("varlen huge scores causal", kind="varlen", lens_q=_VARLEN_Q, lens_k=_VARLEN_K,
         window=(None, 0), score=1e20),
    Case("paged decode seqused 0", kind="paged", h=8, hkv=2, sq=1, seqused=(0, 300, 5)),
    Case("paged decode seqused 0 sink", kind="paged", h=8, hkv=2, sq=1, seqused=(0, 300, 5),
         sink=True),
    Case("paged causal chunk", kind="paged", sq=4, seqused=(2, 0, 129), window=(None, 0)),
    Case("paged split-KV seqused 0", kind="paged", h=8, hkv=2, sq=1, seqused=(0, 2500),
         max_pages=20),
    Case("paged huge scores window", kind="paged", sq=3, seqused=(0, 200, 2), score=1e20,
         window=(64, 0), sink=True),
]


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Problem:
    """A case's inputs, the library call, and the same problem as dense (B, Sq, Sk) attention.

    ``args``: the library call's positional arrays; ``call(*args, sink)`` returns (out, lse) in
    the dense layouts (B, Sq, H, Dv) / (B, H, Sq). ``q``, ``k``, ``v``: the dense views the
    oracle and the 16-bit reference see (varlen: one batch entry of the packed tokens; paged:
    the gathered pages). ``visible`` (B, Sq, Sk) bool: the mask, built here independently of
    the library; ``padding_rows`` (B, Sq): query rows outside every sequence (varlen), whose lse
    is -inf even with a sink. ``ref_kwargs``: the mask as reference.attention's arguments.
    """

    case: Case
    args: tuple
    call: object
    q: jax.Array
    k: jax.Array
    v: jax.Array
    sink: jax.Array | None
    visible: np.ndarray
    padding_rows: np.ndarray
    ref_kwargs: dict
    softmax_scale: float


def _seed(case: Case) -> int:
    return zlib.crc32(case.name.encode())


def _normal(rng: np.random.Generator, shape) -> np.ndarray:
    """Standard normal float32 (NumPy: no XLA program per shape, as jax.random would compile)."""
    return rng.standard_normal(shape, np.float32)


def _overflow_inputs(case: Case, qn: np.ndarray, kn: np.ndarray, group: int):
    """(q factor, k factor, softmax_scale) that take the largest |scale·q·k| of the standard
    normal ``qn`` (B, Sq, H, D) and ``kn`` (B, Sk, Hkv, D) to ``case.score``. Checks that the
    raw sum a kernel accumulates before scaling (bounded by Σ|q_i k_i|) stays within float32."""
    d = qn.shape[-1]
    kr = np.repeat(kn.astype(np.float64), group, axis=2)
    q64 = qn.astype(np.float64)
    raw = np.abs(np.einsum("bqhd,bkhd->bhqk", q64, kr)).max()
    abs_sum = np.einsum("bqhd,bkhd->bhqk", np.abs(q64), np.abs(kr)).max()
    if case.scale_by == "softmax_scale":
        scale, factor = case.score / raw, 1.0
    else:
        scale = case.softmax_scale if case.softmax_scale is not None else 1.0 / np.sqrt(d)
        factor = float(np.sqrt(case.score / (scale * raw)))
    assert factor**2 * abs_sum < FLOAT32_MAX, f"{case.name}: raw q·k would overflow float32"
    return factor, float(scale)


def _scaling(case: Case, q, k, group: int):
    """(factor for q and k, softmax_scale to pass) of a case; q (B, Sq, H, D) and k (B, Sk, Hkv,
    D) standard normal float32."""
    if case.score is None:
        return 1.0, case.softmax_scale
    return _overflow_inputs(case, np.asarray(q), np.asarray(k), group)


def window_visible(sq, sk, window):
    """(sq, sk) bool: query i sees key j under the bottom-right aligned window rule."""
    i = np.arange(sq)[:, None] + sk - sq
    j = np.arange(sk)[None, :]
    left, right = window
    vis = np.ones((sq, sk), bool)
    if left is not None:
        vis &= j >= i - left
    if right is not None:
        vis &= j <= i + right
    return vis


def _segment_ids(case: Case, rng: np.random.Generator):
    """(q ids (B, Sq), kv ids (B, Sk)) int32 of a segments case, and the API's argument."""
    b, sq, sk = case.b, case.sq, case.sk
    if case.segments == "pair":
        # query segments 0, 1, 2 (2 has no key), then query padding -1; keys 0, 1, then -2
        q_ids = np.repeat(np.array([0, 1, 2, -1]), [sq // 4, sq // 4, sq // 4, sq - 3 * (sq // 4)])
        kv_ids = np.repeat(np.array([0, 1, -2]), [sk // 3, sk // 3, sk - 2 * (sk // 3)])
        q_ids = np.broadcast_to(q_ids, (b, sq)).astype(np.int32)
        kv_ids = np.broadcast_to(kv_ids, (b, sk)).astype(np.int32)
        return q_ids, kv_ids, (jnp.asarray(q_ids), jnp.asarray(kv_ids))
    assert case.segments == "shared" and sq == sk
    # segments 1, 2, 3 then padding 0 (shared by queries and keys: padding sees padding)
    ids = np.repeat(np.array([1, 2, 3, 0]), [sq // 4, sq // 4, sq // 4, sq - 3 * (sq // 4)])
    ids = np.stack([np.roll(ids, 5 * row) for row in range(b)]).astype(np.int32)
    return ids, ids, jnp.asarray(ids)


def make_problem(case: Case, implementation: str) -> Problem:
    """The inputs and the library call of ``case`` (fresh normal values, seeded by its name)."""
    rng = np.random.default_rng(_seed(case))
    dtype = jnp.dtype(case.dtype)
    group = case.h // case.hkv
    sink = (jnp.asarray(rng.uniform(-2.0, 3.0, case.h), jnp.float32) if case.sink else None)
    common = dict(window_size=case.window, softcap=case.softcap, return_lse=True,
                  implementation=implementation)

    if case.kind == "dense":
        q = _normal(rng, (case.b, case.sq, case.h, case.d))
        k = _normal(rng, (case.b, case.sk, case.hkv, case.d))
        v = jnp.asarray(_normal(rng, (case.b, case.sk, case.hkv, case.d)), dtype)
        factor, scale = _scaling(case, q, k, group)
        q, k = jnp.asarray(q * factor, dtype), jnp.asarray(k * factor, dtype)
        visible = np.broadcast_to(window_visible(case.sq, case.sk, case.window),
                                  (case.b, case.sq, case.sk)).copy()
        ref_kwargs, seg_arg = {}, None
        if case.segments:
            q_ids, kv_ids, seg_arg = _segment_ids(case, rng)
            visible &= q_ids[:, :, None] == kv_ids[:, None, :]
            ref_kwargs = dict(q_segment_ids=jnp.asarray(q_ids), kv_segment_ids=jnp.asarray(kv_ids))

        def call(q, k, v, sink):
            return jax_fa4.flash_attention(q, k, v, softmax_scale=scale, learnable_sink=sink,
                                           segment_ids=seg_arg, **common)

        padding = np.zeros(visible.shape[:2], bool)
        return Problem(case, (q, k, v), call, q, k, v, sink, visible, padding, ref_kwargs,
                       _resolved_scale(scale, case.d))

    if case.kind == "varlen":
        tq = PAD_FRONT + sum(case.lens_q) + PAD_BACK
        tk = PAD_FRONT + sum(case.lens_k) + PAD_BACK
        q = _normal(rng, (1, tq, case.h, case.d))
        k = _normal(rng, (1, tk, case.hkv, case.d))
        v = jnp.asarray(_normal(rng, (1, tk, case.hkv, case.d)), dtype)
        factor, scale = _scaling(case, q, k, group)
        q, k = jnp.asarray(q * factor, dtype), jnp.asarray(k * factor, dtype)
        cu_q = np.concatenate([[0], np.cumsum(case.lens_q)]).astype(np.int32) + PAD_FRONT
        cu_k = np.concatenate([[0], np.cumsum(case.lens_k)]).astype(np.int32) + PAD_FRONT
        visible = np.zeros((1, tq, tk), bool)
        padding = np.ones((1, tq), bool)
        # the same mask as reference.attention's arguments: sequence ids (padding -1 / -2 match
        # nothing) and positions that align each sequence bottom-right
        ids_q, ids_k = np.full((1, tq), -1, np.int32), np.full((1, tk), -2, np.int32)
        pos_q, pos_k = np.zeros((1, tq), np.int32), np.zeros((1, tk), np.int32)
        for s, (lq, lk) in enumerate(zip(case.lens_q, case.lens_k)):
            rows, cols = slice(cu_q[s], cu_q[s] + lq), slice(cu_k[s], cu_k[s] + lk)
            visible[0, rows, cols] = window_visible(lq, lk, case.window)
            padding[0, rows] = False
            ids_q[0, rows], ids_k[0, cols] = s, s
            pos_q[0, rows] = np.arange(lq) + lk - lq
            pos_k[0, cols] = np.arange(lk)
        ref_kwargs = dict(q_segment_ids=ids_q, kv_segment_ids=ids_k, q_positions=pos_q,
                          kv_positions=pos_k)
        max_q, max_k = max(case.lens_q), max(case.lens_k)

        def call(q, k, v, cu_q, cu_k, sink):
            out, lse = jax_fa4.flash_attention_varlen(
                q[0], k[0], v[0], cu_q, cu_k, max_q, max_k, softmax_scale=scale,
                learnable_sink=sink, **common)
            return out[None], lse[None]

        return Problem(case, (q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k)), call, q, k, v,
                       sink, visible, padding, _as_jax(ref_kwargs), _resolved_scale(scale, case.d))

    assert case.kind == "paged"
    b, ps, max_pages = len(case.seqused), case.page_size, case.max_pages
    num_pages = b * max_pages + 3
    q = _normal(rng, (b, case.sq, case.h, case.d))
    k_cache = _normal(rng, (num_pages, ps, case.hkv, case.d))
    v_cache = _normal(rng, (num_pages, ps, case.hkv, case.d))
    table = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    used = np.asarray(case.seqused, np.int32)
    for row, n in enumerate(used):
        table[row, -(-n // ps):] = -1  # unused entries: never read
    # each batch entry's keys in table order (unused slots: page 0, masked), for the scaling
    def gathered(cache):
        return cache[np.maximum(table, 0)].reshape(b, max_pages * ps, case.hkv, -1)

    factor, scale = _scaling(case, q, gathered(k_cache), group)
    q, k_cache = q * factor, k_cache * factor
    sk = max_pages * ps
    visible = np.zeros((b, case.sq, sk), bool)
    for row, n in enumerate(used):
        visible[row, :, :n] = window_visible(case.sq, int(n), case.window)

    def call(q, k_cache, v_cache, table, used, sink):
        return jax_fa4.flash_attention_paged(q, k_cache, v_cache, table, used,
                                             softmax_scale=scale, learnable_sink=sink, **common)

    # the mask as reference.attention's arguments: keys past seqused_k[b] have id -1, queries
    # are the last Sq positions of seqused_k[b]
    ref_kwargs = dict(q_segment_ids=np.zeros((b, case.sq), np.int32),
                      kv_segment_ids=np.where(np.arange(sk)[None] < used[:, None], 0, -1),
                      q_positions=np.arange(case.sq)[None] + (used - case.sq)[:, None])
    args = tuple(jnp.asarray(x, dtype) for x in (q, k_cache, v_cache))
    k_dense, v_dense = (jnp.asarray(gathered(x), dtype) for x in (k_cache, v_cache))
    return Problem(case, args + (jnp.asarray(table), jnp.asarray(used)), call, args[0],
                   k_dense, v_dense, sink, visible, np.zeros((b, case.sq), bool),
                   _as_jax(ref_kwargs), _resolved_scale(scale, case.d))


def _as_jax(arrays: dict) -> dict:
    return {name: jnp.asarray(x, jnp.int32) for name, x in arrays.items()}


def _resolved_scale(scale, d):
    return 1.0 / np.sqrt(d) if scale is None else float(scale)


# ---------------------------------------------------------------------------------------------
# the float64 oracle
# ---------------------------------------------------------------------------------------------
def oracle(q, k, v, visible, scale, softcap=0.0, sink=None, dout=None, dlse=None):
    """Attention in NumPy float64, written independently of the library: out (B, Sq, H, Dv),
    lse (B, H, Sq) (-inf for rows with no visible key and no sink), and with ``dout`` (and
    ``dlse``, lse's cotangent) the gradients (dq, dk, dv, dsink) of FA's backward:
    ``dS = P·(dP − delta)``, ``delta = rowsum(dout·out) − dlse``, ``dsink = −Σ P_sink·delta``."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kr, vr = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s_raw = np.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    s = softcap * np.tanh(s_raw / softcap) if softcap else s_raw
    mask = np.asarray(visible)[:, None]
    m = np.where(mask, s, -np.inf).max(-1)
    if sink is not None:
        sink = np.asarray(sink, np.float64)[None, :, None]
        m = np.maximum(m, sink)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(mask, np.exp(np.where(mask, s, m[..., None]) - m[..., None]), 0.0)
    total = e.sum(-1)
    p_sink = None
    if sink is not None:
        total = total + np.exp(sink - m)
    has = total > 0
    total_safe = np.where(has, total, 1.0)
    p = e / total_safe[..., None]
    out = np.einsum("bhqk,bkhd->bqhd", p, vr)
    lse = np.where(has, m + np.log(total_safe), -np.inf)
    if dout is None:
        return out, lse
    dout = np.asarray(dout, np.float64)
    dlse = np.zeros(lse.shape) if dlse is None else np.asarray(dlse, np.float64)
    delta = np.einsum("bqhd,bqhd->bhq", dout, out) - dlse
    dp = np.einsum("bqhd,bkhd->bhqk", dout, vr)
    ds = p * (dp - delta[..., None])
    if softcap:
        ds = ds * (1.0 - np.tanh(s_raw / softcap) ** 2)
    b, sk, hkv, d = k.shape
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kr) * scale
    dk = (np.einsum("bhqk,bqhd->bkhd", ds, q) * scale).reshape(b, sk, hkv, group, d).sum(3)
    dv = np.einsum("bhqk,bqhd->bkhd", p, dout).reshape(b, sk, hkv, group, -1).sum(3)
    dsink = None
    if sink is not None:
        p_sink = np.where(has, np.exp(sink - np.where(has, lse, 0.0)), 0.0)
        dsink = -(p_sink * delta).sum(axis=(0, 2))
    return out, lse, (dq, dk, dv, dsink)


# ---------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------
def _assert_finite(x, what):
    x = np.asarray(x, np.float32)
    assert not np.isnan(x).any(), f"{what}: NaN"
    assert np.isfinite(x).all(), f"{what}: inf"


def check_lse(lse, ref_lse, pt_lse, rows, softcap, name):
    """lse on ``rows`` (B, H, Sq) bool, all finite there: FA4's rule with a relative floor
    (``2·max|pt − ref| + 1e-3·max(1, max|ref|)``, 3× with softcap)."""
    lse, ref_lse, pt_lse = (np.asarray(x, np.float64)[rows] for x in (lse, ref_lse, pt_lse))
    if lse.size == 0:
        return
    _assert_finite(lse, f"{name} lse")
    err = np.abs(lse - ref_lse).max()
    pt_err = np.abs(pt_lse - ref_lse).max()
    bound = (3 if softcap else 2) * pt_err + 1e-3 * max(1.0, np.abs(ref_lse).max())
    assert err <= bound, f"{name} lse: max err {err:.4g} > bound {bound:.4g} (pt {pt_err:.4g})"


def _weights(case: Case, out_shape, lse_shape):
    rng = np.random.default_rng(_seed(case) + 1)
    return _normal(rng, out_shape), _normal(rng, lse_shape)


def check_case(case: Case, implementation: str, before_run=None) -> None:
    """Run ``case`` through the API with ``implementation`` under jit and check everything the
    module docstring lists. ``before_run``: called before each library run (the GPU tests
    poison device memory there)."""
    pb = make_problem(case, implementation)
    name = f"{case.name} [{implementation}]"
    dtype = jnp.dtype(case.dtype)
    softcap = case.softcap > 0
    empty = ~pb.visible.any(-1)  # (B, Sq)
    empty_bhs = np.broadcast_to(empty[:, None], (empty.shape[0], case.h, empty.shape[1]))
    unseen_keys = ~pb.visible.any(1)  # (B, Sk) of the dense view
    sink = None if pb.sink is None else np.asarray(pb.sink)

    fwd = jax.jit(lambda args, sink: pb.call(*args, sink))
    if before_run:
        before_run()
    out, lse = (np.asarray(x) for x in jax.block_until_ready(fwd(pb.args, pb.sink)))
    assert out.dtype == dtype and out.shape == pb.q.shape[:3] + (pb.v.shape[3],), name
    out32 = out.astype(np.float32)
    assert not np.isnan(out32).any(), f"{name}: NaN in out"
    assert not np.isnan(lse).any(), f"{name}: NaN in lse"

    # rows with no visible key: out exactly 0, lse exactly -inf (or the sink)
    assert (out32.transpose(0, 2, 1, 3)[empty_bhs] == 0).all(), f"{name}: empty rows not 0"
    expected = np.full(lse.shape, -np.inf, np.float32)
    if sink is not None:
        expected[:] = sink[None, :, None]
        expected[np.broadcast_to(pb.padding_rows[:, None], lse.shape)] = -np.inf
    # exactly -inf; with a sink the sink within float32 rounding (a kernel computes lse in
    # log2 units from the max in score units: sink·log2 e / scale_log2 · scale_log2 · ln 2)
    np.testing.assert_array_equal(np.isneginf(lse[empty_bhs]), np.isneginf(expected[empty_bhs]),
                                  err_msg=f"{name}: lse of rows without keys")
    np.testing.assert_allclose(lse[empty_bhs], expected[empty_bhs], rtol=2 ** -21, atol=0,
                               err_msg=f"{name}: lse of rows without keys")

    # the other rows against the float64 oracle (FA4's rule, the 16-bit reference as pt)
    ref_out, ref_lse = oracle(pb.q, pb.k, pb.v, pb.visible, pb.softmax_scale, case.softcap,
                              sink)
    ref_kw = dict(softmax_scale=pb.softmax_scale, window=case.window, softcap=case.softcap,
                  **pb.ref_kwargs)

    def pt_attention(q, k, v, sink):
        return reference.attention(q, k, v, compute_dtype=dtype, learnable_sink=sink, **ref_kw)

    pt_out, pt_lse = (np.asarray(x) for x in jax.jit(pt_attention)(pb.q, pb.k, pb.v, pb.sink))
    rows = ~empty  # (B, Sq)
    assert_fa4_close(out[rows], ref_out[rows].astype(dtype), pt_out[rows], softcap=softcap,
                     name=f"{name} out")
    check_lse(lse, ref_lse, pt_lse, np.broadcast_to(rows[:, None], lse.shape), softcap, name)
    if not case.differentiable:
        return

    # gradients of sum(out·w) + sum(lse·w') (lse terms where the expected lse is finite)
    w, wl = _weights(case, out.shape, lse.shape)
    lse_weight = np.where(np.isfinite(expected) | ~empty_bhs, wl, np.float32(0.0))

    def loss(o, l):
        return (jnp.sum(o.astype(jnp.float32) * w)
                + jnp.sum(jnp.where(jnp.isfinite(l), l, 0.0) * lse_weight))

    argnums = (0, 1, 2, 3) if sink is not None else (0, 1, 2)

    def lib_loss(q, k, v, sink, rest):
        return loss(*pb.call(q, k, v, *rest, sink))

    if before_run:
        before_run()
    got = jax.jit(jax.grad(lib_loss, argnums=argnums))(*pb.args[:3], pb.sink, pb.args[3:])
    got = [np.asarray(g) for g in jax.block_until_ready(got)] + [None] * (4 - len(argnums))
    pt_grads = jax.jit(jax.grad(lambda *a: loss(*pt_attention(*a)), argnums=argnums))(
        pb.q, pb.k, pb.v, pb.sink)
    pt_grads = [np.asarray(g) for g in pt_grads] + [None] * (4 - len(argnums))
    dlse = np.where(np.isfinite(lse), lse_weight, 0.0)
    _, _, ref_grads = oracle(pb.q, pb.k, pb.v, pb.visible, pb.softmax_scale, case.softcap,
                             sink, dout=w, dlse=dlse)

    for gname, g, r, p in zip(("dq", "dk", "dv", "dsink"), got, ref_grads, pt_grads):
        if g is None:
            continue
        _assert_finite(g, f"{name} {gname}")
        if gname == "dq":
            assert (g[empty] == 0).all(), f"{name}: dq of rows without keys is not 0"
        if gname in ("dk", "dv"):
            assert (g[unseen_keys] == 0).all(), f"{name}: {gname} of keys no query sees is not 0"
        if gname in ("dq", "dk") and case.huge:
            continue  # one-hot softmax: only rounding noise (module docstring)
        if gname == "dv" and case.beyond_lse_precision and implementation != "reference":
            continue  # P rebuilt from a float32 lse: only finite (Case.beyond_lse_precision)
        assert_fa4_close(g, r.astype(g.dtype), p, softcap=softcap, name=f"{name} {gname}")


#: The kernels' exact range (their documented contract, docs/api.md, "Numerics"): a row whose
#: largest scaled score m (softmax_scale·q·k, or the sink if larger) has |m·log2 e| at or past
#: this, by input dtype, comes out as NaN (out and lse); below it the row is exact.
KERNEL_EXACT_LIMIT_LOG2 = {"bfloat16": 2.0 ** 31, "float16": 2.0 ** 27}


def check_beyond_range(case: Case, implementation: str, before_run=None) -> int:
    """The forward of a huge-score ``case`` on a kernel: each row past the exact range
    (:data:`KERNEL_EXACT_LIMIT_LOG2`, from the float64 oracle's row max, the sink included
    where it joins inside the kernel; rows within a factor 2 of the limit are not judged) is
    NaN in every output element and in lse, never a finite value; rows without keys are exactly 0 /
    -inf (or the sink); the other rows are finite and by FA4's rule. Returns the number of rows
    found past the range."""
    pb = make_problem(case, implementation)
    name = f"{case.name} [{implementation}]"
    dtype = jnp.dtype(case.dtype)
    fwd = jax.jit(lambda args, sink: pb.call(*args, sink))
    if before_run:
        before_run()
    out, lse = (np.asarray(x) for x in jax.block_until_ready(fwd(pb.args, pb.sink)))
    out32 = out.astype(np.float32).transpose(0, 2, 1, 3)  # (B, H, Sq, Dv) like lse
    sink = None if pb.sink is None else np.asarray(pb.sink)

    q, k = (np.asarray(x, np.float64) for x in (pb.q, pb.k))
    group = q.shape[2] // k.shape[2]
    s = np.einsum("bqhd,bkhd->bhqk", q, np.repeat(k, group, axis=2)) * pb.softmax_scale
    if case.softcap:
        s = case.softcap * np.tanh(s / case.softcap)
    m = np.where(pb.visible[:, None], s, -np.inf).max(-1)  # (B, H, Sq)
    if sink is not None and case.kind != "paged":
        # (dense and varlen: the sink is inside the kernel's softmax; paged calls join it
        # after the kernel, whose rows past the range are NaN however large the sink)
        m = np.maximum(m, sink[None, :, None].astype(np.float64))
    r = np.abs(m * np.log2(np.e))
    limit = KERNEL_EXACT_LIMIT_LOG2[case.dtype]
    seen = np.broadcast_to(pb.visible.any(-1)[:, None], lse.shape)
    beyond = seen & np.isfinite(m) & (r >= 2 * limit)
    inside = seen & (r < limit / 2)

    for where in np.argwhere(beyond):
        b, h, i = where
        assert np.isnan(lse[b, h, i]), (f"{name}: row {tuple(where)} past the range: "
                                        f"lse {lse[b, h, i]}")
        assert np.isnan(out32[b, h, i]).all(), f"{name}: row {tuple(where)} past the range not NaN"
    empty = ~seen
    assert (out32[empty] == 0).all(), f"{name}: rows without keys not 0"
    if sink is None:
        assert np.isneginf(lse[empty]).all(), f"{name}: lse of rows without keys"
    if inside.any():
        ref_out, _ = oracle(pb.q, pb.k, pb.v, pb.visible, pb.softmax_scale, case.softcap, sink)
        ref_kw = dict(softmax_scale=pb.softmax_scale, window=case.window, softcap=case.softcap,
                      **pb.ref_kwargs)
        pt_out, _ = reference.attention(pb.q, pb.k, pb.v, compute_dtype=dtype,
                                        learnable_sink=pb.sink, **ref_kw)
        ref_t = ref_out.transpose(0, 2, 1, 3)[inside]
        pt_t = np.asarray(pt_out).transpose(0, 2, 1, 3)[inside]
        assert_fa4_close(out32[inside], ref_t.astype(dtype), pt_t, softcap=case.softcap > 0,
                         name=f"{name} out (rows inside the range)")
    return int(beyond.sum())
