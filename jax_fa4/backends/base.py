"""The backend interface, with the pure-JAX reference as the default of every entry point.

A backend is one implementation family: the reference (this class, runs anywhere) or the kernels
of one GPU family (:class:`jax_fa4.backends.kernel.KernelBackend` and its subclasses). Its entry
points, each paired with what it supports for a given call (None, or the reason it declines, a
str):

============================  ===================================  ===========================
entry point                   supports                             called from
============================  ===================================  ===========================
``forward``                   ``supports_forward``                 dense forward (per shard)
``backward_preprocess``       ``supports_preprocess``              dense / varlen backward
``backward``                  ``supports_backward``                dense backward (per shard)
(reference custom_vjp)        ``supports_extras``                  sink (+ segment ids)
``segments_forward``          ``supports_segments``                segment-id forward
``varlen_forward``            ``varlen_plan`` (a plan, or reason)  packed varlen forward
``varlen_backward``           ``supports_varlen_backward``         packed varlen backward
``paged_forward``             ``paged_plan`` (a plan, or reason)   paged KV forward
============================  ===================================  ===========================

A kernel backend whose dense backward adds dQ into a float32 accumulator gives its shape from
``dq_accum_shape`` (None: the backward makes its own); ``backward_preprocess_with_accum`` then
returns it zero-filled beside delta and lse_log2, and ``backward`` takes it as ``dq_accum``.

The varlen and paged calls are jitted by the package: what a backend decides outside the trace
(its kernel config, switches read from the environment) it returns from ``*_plan``, a hashable
value that keys the jitted call, and gets back in the entry point.

:func:`choose` is the one fallback policy: a backend that declines hands the call to the reference,
reported through :func:`reference_fallback` (the hook the GPU test suite patches to fail tests
that would silently miss the kernels); a forced implementation raises
:class:`ImplementationUnavailableError` for a forward entry point instead.

Dimension letters: B batch, Sq / Sk query / key length, H / Hkv query / key-value heads, D / Dv
head dims; packed varlen tensors are (total, H, ·).
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_fa4 import reference
from jax_fa4.kernels.preprocess_config import LSE_LOG2_MARGIN, LSE_LOG2_MARGIN_FROM
from jax_fa4.kernels.spec import LOG2_E

#: The name of the reference backend (what every fallback runs).
REFERENCE = "reference"

#: Above this many scores per head the reference switches to its memory-light blocked form.
_NAIVE_MAX_SCORES = 4096 * 4096
_BLOCK_K = 512
#: Paged KV: up to this many key slots per batch entry the whole cache of a batch entry is
#: gathered; above, a scan over chunks of this many keys (rounded to whole pages).
_DENSE_MAX_KEYS = 2048
_SPLIT_KEYS = 512

_log = logging.getLogger("jax_fa4")


class ImplementationUnavailableError(RuntimeError):
    """A forced implementation cannot run here (wrong GPU, missing feature, ...)."""


def reference_fallback(what: str, implementation: str, reason: str) -> None:
    """Record that ``what`` (``"forward"``, ``"backward"``, ...) of a call on a kernel
    ``implementation`` runs the pure-JAX reference, and why: logged on the ``jax_fa4`` logger
    (level INFO: ``logging.getLogger("jax_fa4").setLevel("INFO")`` shows which calls miss the
    kernels). Called while tracing, once per traced call; the GPU test suite makes it raise
    (``JAX_FA4_REQUIRE_GPU=1``) where a test expects a kernel."""
    _log.info("%s on %s runs the pure-JAX reference: %s", what, implementation, reason)


@functools.cache
def warn_reference_backward(implementation: str, reason: str) -> None:
    """Say (once per reason) that an opt-in backend's forward kernel's gradient runs the
    reference backward: the backend is opt-in, so a silent switch of families would mislead."""
    warnings.warn(
        f"jax_fa4: the {implementation} forward kernel serves this call but no {implementation} "
        f"backward kernel does ({reason}); the gradient runs the pure-JAX reference backward.",
        RuntimeWarning, stacklevel=2)


def choose(backend: Backend, what: str, reason: str | None, opts: Any, *,
           call: str | None = None, kernel_forward: bool = False) -> Backend:
    """The backend that runs ``what`` of a call: ``backend`` when it serves it (``reason`` None),
    else the reference.

    Args:
      call: for a forward entry point, the words naming the call in the error a forced
        implementation raises (``"call"``, ``"varlen attention call"``); None for a backward,
        which keeps its forward's choice and falls back.
      kernel_forward: the call's forward ran ``backend``'s kernel; an opt-in backend
        (``warns_reference_backward``) then says once that its gradient runs the reference.

    Raises:
      ImplementationUnavailableError: ``backend`` declines a forward entry point it was forced
        to run.
    """
    if reason is None:
        return backend
    if call is not None and opts.forced:
        raise ImplementationUnavailableError(
            f"implementation={opts.implementation!r} cannot run this {call}: {reason}")
    if kernel_forward and backend.warns_reference_backward:
        warn_reference_backward(backend.name, reason)
    reference_fallback(what, backend.name, reason)
    return REFERENCE_BACKEND


def planned(backend: Backend, what: str, opts: Any, make_plan) -> tuple[Backend, Hashable]:
    """(backend, plan) for a jitted entry point: ``make_plan(backend)`` returns the backend's
    plan or the reason it declines (a str); a declining backend is replaced by :func:`choose`'s
    (or raises when forced)."""
    plan = make_plan(backend)
    if isinstance(plan, str):
        backend = choose(backend, what, plan, opts, call=f"{what} call")
        plan = make_plan(backend)
    return backend, plan


def preprocess(backend: Backend, out, dout, lse, opts,
               dq_accum_shape: tuple[int, ...] | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(delta, lse_log2, dq_accum) by ``backend``'s backward preprocess, or the reference's
    (reported) where it declines. ``dq_accum_shape``: the dense backward kernel's float32
    accumulator (:meth:`Backend.dq_accum_shape`), returned zero-filled by a backend whose
    preprocess kernel clears it (else None: the backward makes its own)."""
    chosen = choose(backend, "backward preprocess", backend.supports_preprocess(out), opts)
    if dq_accum_shape is None:
        return (*chosen.backward_preprocess(out, dout, lse), None)
    return chosen.backward_preprocess_with_accum(out, dout, lse, dq_accum_shape)


# -- shared pieces (any backend) ---------------------------------------------------------------
def reference_block_k(sq: int, sk: int) -> int | None:
    """None: the naive reference serves (sq, sk); an int: the key block of its blocked form."""
    return None if sq * sk <= _NAIVE_MAX_SCORES else _BLOCK_K


def reference_forward(q, k, v, opts, **extras) -> tuple[jax.Array, ...]:
    """(out, lse) by the reference, and each row's max logit (B, H, Sq) float32 when
    ``opts.max_logits``; ``extras`` are further reference options (sink, segments)."""
    kw = dict(softmax_scale=opts.softmax_scale, window=opts.window, softcap=opts.softcap, **extras)
    block_k = reference_block_k(q.shape[1], k.shape[1])
    if block_k is None:
        outs = reference.attention(q, k, v, **kw)
    else:
        outs = reference.attention_blocked(q, k, v, block_k=block_k, **kw)
    if not getattr(opts, "max_logits", False):
        return outs
    kw.pop("learnable_sink", None)
    return (*outs, reference.row_max_logits(q, k, block_k=block_k or _BLOCK_K, **kw))


def reference_delta(out, dout) -> jax.Array:
    """``rowsum(dout * out)`` (B, H, Sq) in float32 (no TF32: a full-precision contraction)."""
    return jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), dout.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def reference_backward(q, k, v, out, lse, dout, delta, opts, **segments):
    """(dq, dk, dv) by the reference's explicit FlashAttention backward (deterministic)."""
    return reference.attention_backward(
        q, k, v, out, lse, dout, delta=delta, softmax_scale=opts.softmax_scale,
        window=opts.window, softcap=opts.softcap,
        block_k=reference_block_k(q.shape[1], k.shape[1]), **segments)


def join_sink(out: jax.Array, lse: jax.Array, learnable_sink: jax.Array | None,
              dtype=None):
    """(out, lse) with a learnable sink joining each row's denominator, in float32:
    ``lse' = logaddexp(lse, sink)``, ``out' = out · e^{lse − lse'}`` (rows without keys: out 0,
    lse = sink). ``learnable_sink`` is (H,) or (B, H) (one per batch row); out comes back in
    ``dtype`` (default: out's), also when there is no sink."""
    dtype = out.dtype if dtype is None else dtype
    if learnable_sink is None:
        return out.astype(dtype), lse
    sink = learnable_sink.astype(jnp.float32)[..., None]  # (.., H, 1) against lse (B, H, Sq)
    lse_all = jnp.logaddexp(lse, sink)
    factor = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(lse - lse_all))  # (B, H, Sq)
    out = (out.astype(jnp.float32) * factor.transpose(0, 2, 1)[..., None]).astype(dtype)
    return out, lse_all


def join_sink_outs(outs: tuple, learnable_sink: jax.Array | None) -> tuple:
    """:func:`join_sink` on a forward's ``(out, lse[, row_max])``: the sink joins out and lse
    only (it is not a score, so the max logits stay as they are)."""
    return (*join_sink(outs[0], outs[1], learnable_sink), *outs[2:])


class Segments(NamedTuple):
    """Per-token mask data of a batch, each ``None`` or an int32 array (see
    :func:`jax_fa4.reference.visible_mask`): ``q_segment_ids`` / ``q_positions`` ``(B, Sq)``,
    ``kv_segment_ids`` / ``kv_positions`` ``(B, Sk)``."""

    q_segment_ids: jax.Array | None = None
    kv_segment_ids: jax.Array | None = None
    q_positions: jax.Array | None = None
    kv_positions: jax.Array | None = None


def token_layout(cu: jax.Array, total: int):
    """Sequence of each packed token, clipped to [0, batch), whether it belongs to one, and
    its sequence's start and end."""
    batch = cu.shape[0] - 1
    t = jnp.arange(total, dtype=jnp.int32)
    seq = jnp.searchsorted(cu, t, side="right").astype(jnp.int32) - 1
    valid = (seq >= 0) & (seq < batch)
    seq = jnp.clip(seq, 0, batch - 1)
    return t, seq, valid, cu[seq], cu[seq + 1]


def clamp_cu_seqlens(cu_seqlens: jax.Array, total: int, max_seqlen: int) -> jax.Array:
    """The cu_seqlens every varlen path runs with: clipped to ``[0, total]``, made
    non-decreasing (a running max: a sequence with a negative length becomes empty) and each
    length capped at ``max_seqlen`` (the later sequences move down by what was cut). The
    identity on metadata that keeps the contract; for traced values that break it (unchecked
    under ``jit`` without ``validate=True``) it keeps every kernel index inside its buffers:
    the results are then meaningless, but no memory outside the call's is read or written."""
    cu = lax.cummax(jnp.clip(cu_seqlens.astype(jnp.int32), 0, total))
    lengths = jnp.minimum(jnp.diff(cu), max_seqlen)
    return jnp.concatenate([cu[:1], cu[0] + jnp.cumsum(lengths, dtype=jnp.int32)])


def varlen_segments(cu_seqlens_q: jax.Array, cu_seqlens_k: jax.Array, total_q: int,
                    total_k: int) -> Segments:
    """The packed batch as segment ids and positions, each ``(1, total)`` int32.

    Segment id = sequence index; tokens outside every sequence (padding before
    ``cu_seqlens[0]`` or after ``cu_seqlens[-1]``) get ``-1`` (queries) and ``-2`` (keys),
    which match nothing. Positions
    are within the sequence, with the queries shifted by ``len_k - len_q`` so that the window
    rule aligns each sequence bottom-right.
    """
    tq, seq_q, valid_q, _, end_q = token_layout(cu_seqlens_q, total_q)
    tk, seq_k, valid_k, start_k, _ = token_layout(cu_seqlens_k, total_k)
    len_k_of_q = cu_seqlens_k[seq_q + 1] - cu_seqlens_k[seq_q]
    return Segments(
        q_segment_ids=jnp.where(valid_q, seq_q, -1)[None],
        kv_segment_ids=jnp.where(valid_k, seq_k, -2)[None],
        # i + len_k - len_q with i = t - start_q, i.e. t - end_q + len_k
        q_positions=(tq - end_q + len_k_of_q)[None],
        kv_positions=(tk - start_k)[None],
    )


def mask_kind(window) -> str:
    """The kernels' compile-time mask kind of a canonical window."""
    if window == (None, None):
        return "none"
    return "causal" if window == (None, 0) else "local"


# -- paged KV, on the reference --------------------------------------------------------------
def gather_pages(cache: jax.Array, pages: jax.Array) -> jax.Array:
    """Pages (B, n) of a cache (num_pages, page_size, Hkv, X) -> (B, n * page_size, Hkv, X).

    Page indices are clipped into range: entries past a sequence's used pages may hold
    anything (e.g. -1); the keys they give are masked.
    """
    pages = jnp.clip(pages, 0, cache.shape[0] - 1)
    x = jnp.take(cache, pages, axis=0)  # (B, n, page_size, Hkv, X)
    b, n, ps, hkv, rest = x.shape
    return x.reshape(b, n * ps, hkv, rest)


def paged_mask_data(seqused_k, sq: int, kv_index: jax.Array):
    """q segment ids / positions (B, Sq) and the kv segment ids (B, n) of keys ``kv_index``."""
    b = seqused_k.shape[0]
    q_ids = jnp.zeros((b, sq), jnp.int32)
    q_pos = jnp.arange(sq, dtype=jnp.int32)[None, :] + (seqused_k - sq)[:, None]
    kv_ids = jnp.where(kv_index[None, :] < seqused_k[:, None], 0, -1)  # -1: an unused slot
    return q_ids, q_pos, kv_ids


def paged_reference(q, k_cache, v_cache, page_table, seqused_k, learnable_sink, opts,
                    pages_per_block: int | None):
    """(out, lse) of a paged call by the reference, in one of two forms:

    - dense (``pages_per_block`` None): the pages are gathered (``jnp.take``) into
      ``(B, max_pages * page_size, Hkv, D)`` and keys at ``j >= seqused_k[b]`` are masked;
    - split-KV: a scan over chunks of ``pages_per_block`` pages of the page table that gathers
      only the chunk's pages and merges the chunks with an online softmax, so memory is
      ``O(B * H * Sq * chunk)`` plus one chunk of K/V, whatever the context length.
    """
    b, sq, h, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    dv = v_cache.shape[3]
    max_pages = page_table.shape[1]
    sk = max_pages * page_size
    if pages_per_block is None:
        k, v = gather_pages(k_cache, page_table), gather_pages(v_cache, page_table)
        q_ids, q_pos, kv_ids = paged_mask_data(seqused_k, sq, jnp.arange(sk))
        return reference.attention(
            q, k, v, softmax_scale=opts.softmax_scale, window=opts.window, softcap=opts.softcap,
            learnable_sink=learnable_sink, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
            q_positions=q_pos)

    n = min(pages_per_block, max_pages)
    chunks = -(-max_pages // n)
    table = jnp.pad(page_table, ((0, 0), (0, chunks * n - max_pages)))  # padding slots: j >= sk
    table = table.reshape(b, chunks, n).swapaxes(0, 1)  # (chunks, B, n)
    block_k = n * page_size
    qg = reference._group(q.astype(jnp.float32), hkv)

    def step(carry, chunk):
        pages, start = chunk
        kb = gather_pages(k_cache, pages).astype(jnp.float32)
        vb = gather_pages(v_cache, pages).astype(jnp.float32)
        q_ids, q_pos, kv_ids = paged_mask_data(seqused_k, sq, start + jnp.arange(block_k))
        mask = reference.visible_mask(sq, sk, opts.window, k_start=start, num_k=block_k,
                                      q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                                      q_positions=q_pos)
        return reference._online_update(carry, qg, kb, vb, mask, opts.softmax_scale,
                                        opts.softcap), None

    carry, _ = lax.scan(step, reference._online_init(b, hkv, h // hkv, sq, dv),
                        (table, jnp.arange(chunks) * block_k))
    out, lse = reference._online_finish(carry, learnable_sink)
    return out.reshape(b, sq, h, dv).astype(q.dtype), reference._ungroup_lse(lse)


# -- the interface -----------------------------------------------------------------------------
class Backend:
    """One implementation family; this class is the pure-JAX reference, which serves every call.

    A kernel backend (:class:`jax_fa4.backends.kernel.KernelBackend`) overrides the entry points
    its kernels serve and says, in ``supports_*`` / ``*_plan``, which calls those are. ``opts``
    is always an :class:`jax_fa4.options.AttentionOptions`.
    """

    #: The ``implementation=`` name (and the registry key).
    name: str = REFERENCE
    #: Major compute capability of the GPUs this backend's kernels run on (``"9"``); None: it
    #: runs on any device (the reference).
    compute_capability: str | None = None
    #: How an error states that capability (``"9.0"``, ``"10.x"``) and the GPU family's name.
    capability_text: str = ""
    gpu_family: str = ""
    #: Opt-in backends are picked by ``implementation=None`` only with this variable set to 1;
    #: None: picked on its GPUs by default.
    enable_env: str | None = None
    #: Whether a gradient that falls back to the reference after this backend's forward kernel
    #: ran says so with a one-time RuntimeWarning (opt-in backends: a silent switch misleads).
    warns_reference_backward: bool = False

    # -- dense ----------------------------------------------------------------------------------
    def supports_forward(self, q, k, v, opts) -> str | None:
        """None when :meth:`forward` serves this call (q (B, Sq, H, D) ...), else why not."""
        return None

    def forward(self, q, k, v, opts, sink: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
        """(out (B, Sq, H, Dv), lse (B, H, Sq) float32) of one (shard of a) dense call, with
        the learnable ``sink`` (H,) of each query head joined when given."""
        return reference_forward(q, k, v, opts, learnable_sink=sink)

    def supports_preprocess(self, out) -> str | None:
        """None when :meth:`backward_preprocess` serves outputs like ``out``, else why not."""
        return None

    def backward_preprocess(self, out, dout, lse) -> tuple[jax.Array, jax.Array]:
        """``delta = rowsum(dout * out)`` (B, H, Sq) float32 and ``lse * log2(e)`` (+inf for
        -inf rows, the margin on huge rows: the preprocess kernel's rule,
        jax_fa4/kernels/preprocess_config.py)."""
        lse_log2 = lse.astype(jnp.float32) * jnp.float32(LOG2_E)
        huge = jnp.abs(lse_log2) >= LSE_LOG2_MARGIN_FROM
        lse_log2 = jnp.where(huge, lse_log2 + jnp.abs(lse_log2) * jnp.float32(LSE_LOG2_MARGIN),
                             lse_log2)
        lse_log2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse_log2)
        return reference_delta(out, dout), lse_log2

    def backward_preprocess_with_accum(self, out, dout, lse, dq_accum_shape: tuple[int, ...]
                                       ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """:meth:`backward_preprocess` and the dense backward's float32 dQ accumulator of
        ``dq_accum_shape`` zero-filled, where this backend's preprocess kernel clears it;
        None here."""
        del dq_accum_shape
        return (*self.backward_preprocess(out, dout, lse), None)

    def supports_backward(self, q, k, v, opts) -> str | None:
        """None when :meth:`backward` serves this call, else why not."""
        return None

    def dq_accum_shape(self, q, k, v, opts) -> tuple[int, ...] | None:
        """The float32 dQ accumulator that this backend's dense backward of the call adds
        into, where its preprocess kernel clears it (:func:`preprocess`); None here."""
        return None

    def backward(self, q, k, v, out, lse, dout, delta, lse_log2, opts,
                 dq_accum: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(dq, dk, dv) in the dtypes of q, k, v from the saved forward, ``delta`` (the
        preprocess's, minus the lse cotangent), ``lse_log2`` and the preprocess's zero-filled
        ``dq_accum`` where it made one (:meth:`dq_accum_shape`)."""
        del lse_log2, dq_accum
        return reference_backward(q, k, v, out, lse, dout, delta, opts)

    def backward_with_sink(self, q, k, v, out, lse, dout, delta, lse_log2, opts, sink,
                           dq_accum: jax.Array | None = None
                           ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
        """:meth:`backward` of a call with the learnable ``sink`` (H,), plus ``sink_rows``
        (B, H) float32, ``sum_i e^{sink_h - lse_bhi} rowsum(dout * out)_bhi`` with the output
        as the backward kernel rebuilds it in float32 (``sum_j P_ij dP_ij``), where the backend
        computes it; None here: the caller takes the sink's gradient from ``delta``."""
        del sink
        accum = {} if dq_accum is None else {"dq_accum": dq_accum}
        return (*self.backward(q, k, v, out, lse, dout, delta, lse_log2, opts, **accum), None)

    def supports_extras(self, what: str) -> str | None:
        """None when this backend takes ``what`` (``"learnable_sink"``, ``"segment_ids"``)
        itself, else why not (the reference's custom_vjp then serves them)."""
        return None

    def supports_segments(self, q, k, v, opts) -> str | None:
        """None when this backend serves a call with segment ids (a kernel backend: by
        ``segments_forward``; the reference: its own custom_vjp), else why not."""
        return None

    # -- FP8 (forward only) ---------------------------------------------------------------------
    def fp8_plan(self, q, k, v, opts) -> Hashable | str:
        """What :meth:`fp8_forward` needs decided outside the jit (hashable), or the reason this
        backend declines the call (a str). q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv,
        Dv), float8_e4m3fn."""
        return None

    def fp8_forward(self, q, k, v, q_descale, k_descale, v_descale, opts, plan
                    ) -> tuple[jax.Array, jax.Array]:
        """(out (B, Sq, H, Dv), lse (B, H, Sq) float32) of an FP8 call: the reference on the
        dequantised inputs (each (B, Hkv) float32 descale multiplies its tensor's kv head, and
        q's heads of that group), in float32; out float32."""
        from jax_fa4 import fp8

        q, k, v = fp8.dequantize(q, q_descale), fp8.dequantize(k, k_descale), \
            fp8.dequantize(v, v_descale)
        return reference_forward(q, k, v, opts)

    def fp8_paged_plan(self, q, k_cache, v_cache, page_table, opts) -> Hashable | str:
        """What :meth:`fp8_paged_forward` needs decided outside the jit, or why this backend
        declines the call (a str). The reference: :meth:`paged_plan`'s."""
        return Backend.paged_plan(self, q, k_cache, v_cache, page_table, opts)

    def fp8_paged_forward(self, q, k_cache, v_cache, page_table, seqused_k, q_descale,
                          k_descale, v_descale, opts, plan) -> tuple[jax.Array, jax.Array]:
        """(out (B, Sq, H, Dv), lse (B, H, Sq)) over an e4m3 paged cache: the reference on the
        dequantised inputs, in float32 (q's descale (B, Hkv), the cache's (Hkv,), one per kv
        head for every page); out float32."""
        from jax_fa4 import fp8

        num_pages, hkv = k_cache.shape[0], k_cache.shape[2]

        def per_page(x):  # the cache's descale as fp8.dequantize's (pages, Hkv)
            return jnp.broadcast_to(x, (num_pages, hkv))

        return paged_reference(fp8.dequantize(q, q_descale),
                               fp8.dequantize(k_cache, per_page(k_descale)),
                               fp8.dequantize(v_cache, per_page(v_descale)), page_table,
                               seqused_k, None, opts, plan)

    # -- varlen ---------------------------------------------------------------------------------
    def varlen_plan(self, q, k, v, opts, max_seqlen_q: int, max_seqlen_k: int
                    ) -> Hashable | str:
        """What :meth:`varlen_forward` / :meth:`varlen_backward` need decided outside the jit
        (hashable), or the reason this backend declines the call (a str). Packed q
        (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv)."""
        return None

    def supports_varlen(self, q, k, v, opts, max_seqlen_q: int, max_seqlen_k: int
                        ) -> str | None:
        """None when this backend serves this varlen call, else why not."""
        plan = self.varlen_plan(q, k, v, opts, max_seqlen_q, max_seqlen_k)
        return plan if isinstance(plan, str) else None

    def varlen_forward(self, q, k, v, sink, segments: Segments, cu_seqlens_q, cu_seqlens_k,
                       opts, plan) -> tuple[jax.Array, jax.Array]:
        """(out (1, total_q, H, Dv), lse (1, H, total_q)) of the packed batch, the sink joined;
        ``segments``: :func:`varlen_segments` of the batch."""
        return reference_forward(q[None], k[None], v[None], opts, learnable_sink=sink,
                                 **segments._asdict())

    def fp8_varlen_plan(self, q, k, v, opts, max_seqlen_q: int, max_seqlen_k: int
                        ) -> Hashable | str:
        """:meth:`varlen_plan` of an FP8 varlen call (packed e4m3 q, k, v)."""
        return None

    def fp8_varlen_forward(self, q, k, v, segments: Segments, cu_seqlens_q, cu_seqlens_k,
                           q_descale, k_descale, v_descale, opts, plan
                           ) -> tuple[jax.Array, jax.Array]:
        """(out (1, total_q, H, Dv), lse (1, H, total_q)) of a packed e4m3 batch, each
        (num_sequences, Hkv) descale applying to its sequence's tokens: the reference on the
        dequantised inputs, in float32; out float32."""
        from jax_fa4 import fp8

        q, k, v = (fp8.dequantize_packed(x, descale, cu) for x, descale, cu in (
            (q, q_descale, cu_seqlens_q), (k, k_descale, cu_seqlens_k),
            (v, v_descale, cu_seqlens_k)))
        return self.varlen_forward(q, k, v, None, segments, cu_seqlens_q, cu_seqlens_k, opts,
                                   plan)

    def supports_varlen_backward(self, q, k, v, opts) -> str | None:
        """None when :meth:`varlen_backward` serves this call, else why not."""
        return None

    def varlen_backward(self, q, k, v, sink, segments: Segments, cu_seqlens_q, cu_seqlens_k,
                        out, lse, dout, dlse, opts, plan):
        """(dq, dk, dv, dsink) of the packed batch from the saved (out, lse) and their
        cotangents, all as :meth:`varlen_forward` returns them."""
        # Padding rows (in no sequence) output nothing to differentiate: their dout may hold
        # anything, NaN included, and must not reach delta (so the sink's gradient).
        in_sequence = segments.q_segment_ids[:, :, None, None] >= 0
        dout = jnp.where(in_sequence, dout, jnp.zeros((), dout.dtype))
        return extras_backward(q[None], k[None], v[None], sink, segments, out, lse, dout, dlse,
                               opts, unbatch=True)

    # -- paged KV ------------------------------------------------------------------------------
    def paged_plan(self, q, k_cache, v_cache, page_table, opts) -> Hashable | str:
        """What :meth:`paged_forward` needs decided outside the jit, or why this backend
        declines the call (a str). The reference: its split-KV chunk in pages (None: dense)."""
        page_size, max_pages = k_cache.shape[1], page_table.shape[1]
        return (None if max_pages * page_size <= _DENSE_MAX_KEYS
                else max(1, _SPLIT_KEYS // page_size))

    def supports_paged(self, q, k_cache, v_cache, page_table, opts) -> str | None:
        """None when this backend serves this paged call, else why not."""
        plan = self.paged_plan(q, k_cache, v_cache, page_table, opts)
        return plan if isinstance(plan, str) else None

    def paged_forward(self, q, k_cache, v_cache, page_table, seqused_k, sink, opts, plan
                      ) -> tuple[jax.Array, jax.Array]:
        """(out (B, Sq, H, Dv), lse (B, H, Sq)) over a paged KV cache, the sink joined."""
        return paged_reference(q, k_cache, v_cache, page_table, seqused_k, sink, opts, plan)


def extras_backward(q, k, v, sink, segments: Segments, out, lse, dout, dlse, opts, *,
                    unbatch: bool = False):
    """(dq, dk, dv, dsink) of the reference with a sink and segment data: the explicit
    FlashAttention backward plus :func:`jax_fa4.reference.sink_gradient`. ``unbatch``: drop the
    leading unit batch of dq, dk, dv (a packed varlen batch)."""
    # delta = rowsum(dO * O); a cotangent on lse enters as -dlse (as in jax_fa4.autodiff).
    delta = reference_delta(out, dout) - dlse
    dq, dk, dv = reference_backward(q, k, v, out, lse, dout, delta, opts, **segments._asdict())
    dsink = None if sink is None else reference.sink_gradient(sink, lse, delta)
    if unbatch:
        dq, dk, dv = dq[0], dk[0], dv[0]
    return dq, dk, dv, dsink


#: The reference backend (registered by :mod:`jax_fa4.backends`; what :func:`choose` falls back
#: to).
REFERENCE_BACKEND = Backend()
