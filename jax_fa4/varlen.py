"""Variable-length (packed) attention, and the segment-id / learnable-sink attention core.

:func:`flash_attention_varlen` is FA4's ``flash_attn_varlen_func``: the tokens of a batch of
sequences are packed along one axis, q ``(total_q, H, D)``, k ``(total_k, Hkv, D)``,
v ``(total_k, Hkv, Dv)``, and sequence ``b`` owns the query tokens
``[cu_seqlens_q[b], cu_seqlens_q[b + 1])`` and the key tokens
``[cu_seqlens_k[b], cu_seqlens_k[b + 1])``. Each sequence attends only within itself, with
FA4's bottom-right alignment per sequence: query ``i`` of sequence ``b`` (counted from the
sequence's start) sees key ``j`` iff
``i + len_k(b) - len_q(b) - left <= j <= i + len_k(b) - len_q(b) + right``.

The lengths are run-time values: ``cu_seqlens_q`` / ``cu_seqlens_k`` are ordinary (traced)
int32 arrays, so new lengths never retrace or recompile; only the static shapes and the
static ``max_seqlen_q`` / ``max_seqlen_k`` ints (which will size the kernels' grids) enter the
trace.

On Hopper (``implementation="sm90"``, bf16/fp16) the forward is the varlen forward kernel: one
CTA per (query tile, head, sequence) of the longest sequence's grid, reading each sequence's rows
from its offset in the packed tensors and storing only its own rows (its lse comes back as
``(batch, H, max_seqlen_q)`` and is gathered to FA4's ``(H, total_q)``); a learnable sink joins
afterwards in float32 (:func:`jax_fa4.ops.join_sink`). The backward is the varlen backward
kernel (``_varlen_backward``): one CTA per (key block of a sequence, head), listed by a work list
built here from cu_seqlens (``work_table``: heaviest key blocks first), so every sequence costs
only its own blocks; its dQ partial sums go to tiles no other sequence shares
(``dq_accum_rows``), which the varlen postprocess turns into the packed dq (``tile_owners``).

The Blackwell forward kernel has the same varlen mode (``implementation="sm100"``, same call and
results contract; compiled and SASS-checked only, never run on hardware, so opt-in like every
sm100 kernel). Its backward is the reference's packed backward, with a one-time
``RuntimeWarning`` saying so: the sm100 backward kernel (used by dense calls) has no varlen mode
yet.

Elsewhere the pure-JAX reference runs: each token gets a segment id (its
sequence) and a position within its sequence, and :mod:`jax_fa4.reference` masks one packed
attention with them (:func:`jax_fa4.reference.visible_mask`: equal segment ids plus the window
rule on the positions). It is naive (one ``(total_q, total_k)`` score matrix per head) when
``total_q * total_k`` is at most ``4096**2`` and otherwise scans over blocks of 512 keys
(memory ``O(H * total_q * 512)``); the compute is ``O(total_q * total_k)`` either way.

The same core, :func:`attention_with_extras`, serves :func:`jax_fa4.flash_attention`'s
``learnable_sink`` and ``segment_ids`` options: a ``custom_vjp`` over ``(q, k, v, sink)`` whose
forward saves ``(q, k, v, sink, out, lse)`` and whose backward is the reference's explicit
FlashAttention backward plus :func:`jax_fa4.reference.sink_gradient`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa4 import api, ops, reference
from jax_fa4.dispatch import (
    IMPLEMENTATIONS,
    KERNEL_ARCH,
    ImplementationUnavailableError,
    resolve_implementation,
)

__all__ = [
    "Segments",
    "attention_with_extras",
    "check_learnable_sink",
    "check_segment_ids",
    "flash_attention_varlen",
    "varlen_segments",
]


class Segments(NamedTuple):
    """Per-token mask data of a batch, each ``None`` or an int32 array (see
    :func:`jax_fa4.reference.visible_mask`): ``q_segment_ids`` / ``q_positions`` ``(B, Sq)``,
    ``kv_segment_ids`` / ``kv_positions`` ``(B, Sk)``."""

    q_segment_ids: jax.Array | None = None
    kv_segment_ids: jax.Array | None = None
    q_positions: jax.Array | None = None
    kv_positions: jax.Array | None = None


# -- the differentiable core -------------------------------------------------------------------
def _forward(q, k, v, sink, segments: Segments, opts) -> tuple[jax.Array, jax.Array]:
    return ops.reference_forward(q, k, v, opts, learnable_sink=sink, **segments._asdict())


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, sink, segments, opts):
    return _forward(q, k, v, sink, segments, opts)


def _attention_fwd(q, k, v, sink, segments, opts):
    out, lse = _forward(q, k, v, sink, segments, opts)
    return (out, lse), (q, k, v, sink, segments, out, lse)


def _attention_bwd(opts, residuals, cotangents):
    q, k, v, sink, segments, out, lse = residuals
    dout, dlse = cotangents
    # delta = rowsum(dO * O); a cotangent on lse enters as -dlse (as in jax_fa4.autodiff).
    delta = ops.reference_delta(out, dout) - dlse
    dq, dk, dv = reference.attention_backward(
        q, k, v, out, lse, dout, delta=delta, softmax_scale=opts.softmax_scale,
        window=opts.window, softcap=opts.softcap, block_k=ops.reference_block_k(q.shape[1], k.shape[1]),
        **segments._asdict())
    dsink = None if sink is None else reference.sink_gradient(sink, lse, delta)
    return dq, dk, dv, dsink, None  # no cotangent for the integer segment data


_attention.defvjp(_attention_fwd, _attention_bwd)


def _require_reference(opts, what: str) -> None:
    """A forced kernel implementation cannot serve ``what`` yet: say so instead of falling back."""
    if opts.forced and opts.implementation != "reference":
        raise ImplementationUnavailableError(
            f"implementation={opts.implementation!r} cannot run this call: there is no "
            f"{opts.implementation} kernel for {what} yet (implementation=None or 'reference' "
            "runs the pure-JAX reference)")


def attention_with_extras(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    opts: Any,
    *,
    learnable_sink: jax.Array | None = None,
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(out, lse)`` of :func:`jax_fa4.flash_attention` with a sink and/or segment ids.

    The inputs are already validated: q, k, v and ``opts`` (an
    :class:`jax_fa4.api.AttentionOptions`) by :func:`jax_fa4.api.canonicalize`, the extras by
    :func:`check_learnable_sink` and :func:`check_segment_ids`. Differentiable in q, k, v and
    the sink. The window rule keeps its usual positions (``i + Sk - Sq`` and ``j`` in the whole
    sequence); segment ids only add ``q_segment_ids[b, i] == kv_segment_ids[b, j]``.

    Raises:
        ImplementationUnavailableError: if a kernel implementation was forced (none takes these
            options yet).
    """
    what = " and ".join(name for name, x in (("learnable_sink", learnable_sink),
                                             ("segment_ids", segment_ids)) if x is not None)
    _require_reference(opts, what or "this call")
    if opts.implementation != "reference":
        ops.reference_fallback("attention with " + (what or "extras"), opts.implementation,
                               f"no {opts.implementation} kernel takes {what or 'them'} yet")
    q_ids, kv_ids = (None, None) if segment_ids is None else segment_ids
    return _attention(q, k, v, learnable_sink, Segments(q_ids, kv_ids), opts)


# -- input checks ------------------------------------------------------------------------------
def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def check_learnable_sink(learnable_sink: Any, num_heads: int) -> jax.Array | None:
    """Validate a learnable sink: ``None`` or a floating array of shape ``(H,)``.

    Returns:
        the sink as a jax array (its dtype kept: arithmetic is float32 and its gradient comes
        back in its dtype), or None.
    """
    if learnable_sink is None:
        return None
    if not _is_array(learnable_sink):
        raise TypeError("learnable_sink must be None or a jax.Array of shape (H,), got "
                        f"{type(learnable_sink).__name__}")
    if learnable_sink.shape != (num_heads,):
        raise ValueError(f"learnable_sink must have shape (H,) = ({num_heads},) (one logit per "
                         f"query head), got {learnable_sink.shape}")
    if not jnp.issubdtype(learnable_sink.dtype, jnp.floating):
        raise TypeError(f"learnable_sink must have a floating dtype (float32 recommended), got "
                        f"{learnable_sink.dtype}")
    return jnp.asarray(learnable_sink)


def _check_int_array(name: str, x: Any, shape: tuple[int, ...], layout: str) -> jax.Array:
    if not _is_array(x):
        raise TypeError(f"{name} must be an int32 jax.Array {layout}, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype (int32), got {x.dtype}")
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {layout} = {shape}, got {x.shape}")
    return jnp.asarray(x, jnp.int32)


def check_segment_ids(segment_ids: Any, q: Any, k: Any) -> tuple[jax.Array, jax.Array] | None:
    """Validate ``segment_ids``: None, one ``(B, S)`` int array (self-attention, ``Sq == Sk``)
    or a pair ``(q_segment_ids (B, Sq), kv_segment_ids (B, Sk))``.

    Returns:
        ``(q_segment_ids, kv_segment_ids)`` as int32 jax arrays, or None.
    """
    if segment_ids is None:
        return None
    b, sq = q.shape[:2]
    sk = k.shape[1]
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError("segment_ids must be one (B, S) array or a pair (q_segment_ids, "
                             f"kv_segment_ids), got a sequence of {len(segment_ids)}")
        q_ids, kv_ids = segment_ids
    else:
        if _is_array(segment_ids) and sq != sk:
            raise ValueError(f"a single segment_ids array needs Sq == Sk (got Sq={sq}, Sk={sk}); "
                             "pass a pair (q_segment_ids, kv_segment_ids)")
        q_ids = kv_ids = segment_ids
    return (_check_int_array("q_segment_ids", q_ids, (b, sq), "(B, Sq)"),
            _check_int_array("kv_segment_ids", kv_ids, (b, sk), "(B, Sk)"))


def _check_static_int(name: str, x: Any) -> int:
    if isinstance(x, jax.Array):  # concrete or traced (tracers are jax.Arrays too)
        raise TypeError(f"{name} must be a static Python int (it sizes the kernel grid and is "
                        "part of the compile key); pass run-time lengths through cu_seqlens")
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name} must be a Python int, got {type(x).__name__}")
    if x < 0:
        raise ValueError(f"{name} must be >= 0, got {x}")
    return int(x)


def _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    for name, x, layout in (("q", q, "(total_q, H, D)"), ("k", k, "(total_k, Hkv, D)"),
                            ("v", v, "(total_k, Hkv, Dv)")):
        if not _is_array(x):
            raise TypeError(f"{name} must be a jax.Array (or numpy array), got "
                            f"{type(x).__name__}")
        if x.ndim != 3:
            raise ValueError(f"{name} must have rank 3 with layout {layout} (tokens packed along "
                             f"one axis), got shape {x.shape}")
        if 0 in x.shape:
            raise ValueError(f"{name} must have no zero-sized dimension, got shape {x.shape}")
    api._check_dtypes(q, k, v)
    total_q, h, d = q.shape
    total_k, hkv = k.shape[:2]
    if k.shape[2] != d:
        raise ValueError(f"k head_dim must equal q head_dim {d}: q {q.shape}, k {k.shape}")
    if v.shape[:2] != (total_k, hkv):
        raise ValueError(f"v must have k's (total_k, Hkv) = {(total_k, hkv)}, got v {v.shape}")
    if h % hkv:
        raise ValueError(f"q heads H={h} must be a multiple of k/v heads Hkv={hkv}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not _is_array(cu):
            raise TypeError(f"{name} must be an int32 jax.Array (batch + 1,), got "
                            f"{type(cu).__name__}")
        if cu.ndim != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must have shape (batch + 1,) with batch >= 1, got "
                             f"{cu.shape}")
        if cu.dtype != jnp.int32:
            raise TypeError(f"{name} must have dtype int32, got {cu.dtype}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same shape (batch + 1,), "
                         f"got {cu_seqlens_q.shape} and {cu_seqlens_k.shape}")
    max_q = _check_static_int("max_seqlen_q", max_seqlen_q)
    max_k = _check_static_int("max_seqlen_k", max_seqlen_k)
    # Values are checked only when they are host data (numpy): reading a device array would
    # synchronise, and under jit they are traced.
    for name, cu, total, mx, mx_name in (
        ("cu_seqlens_q", cu_seqlens_q, total_q, max_q, "max_seqlen_q"),
        ("cu_seqlens_k", cu_seqlens_k, total_k, max_k, "max_seqlen_k"),
    ):
        if isinstance(cu, np.ndarray):
            lengths = np.diff(cu)
            if cu[0] < 0 or (lengths < 0).any():
                raise ValueError(f"{name} must be non-decreasing and start at >= 0, got {cu}")
            if cu[-1] > total:
                raise ValueError(f"{name}[-1] = {cu[-1]} exceeds the number of packed tokens "
                                 f"{total}")
            if lengths.max() > mx:
                raise ValueError(f"{name} has a sequence of length {lengths.max()} > "
                                 f"{mx_name} = {mx}")


# -- varlen ------------------------------------------------------------------------------------
def _token_layout(cu: jax.Array, total: int):
    """Sequence of each packed token, clipped to [0, batch), whether it belongs to one, and
    its sequence's start and end."""
    batch = cu.shape[0] - 1
    t = jnp.arange(total, dtype=jnp.int32)
    seq = jnp.searchsorted(cu, t, side="right").astype(jnp.int32) - 1
    valid = (seq >= 0) & (seq < batch)
    seq = jnp.clip(seq, 0, batch - 1)
    return t, seq, valid, cu[seq], cu[seq + 1]


def varlen_segments(cu_seqlens_q: jax.Array, cu_seqlens_k: jax.Array, total_q: int,
                    total_k: int) -> Segments:
    """The packed batch as segment ids and positions, each ``(1, total)`` int32.

    Segment id = sequence index; tokens outside every sequence (padding before
    ``cu_seqlens[0]`` or after ``cu_seqlens[-1]``) get ``-1`` (queries) and ``-2`` (keys),
    which match nothing. Positions
    are within the sequence, with the queries shifted by ``len_k - len_q`` so that the window
    rule aligns each sequence bottom-right.
    """
    tq, seq_q, valid_q, _, end_q = _token_layout(cu_seqlens_q, total_q)
    tk, seq_k, valid_k, start_k, _ = _token_layout(cu_seqlens_k, total_k)
    len_k_of_q = cu_seqlens_k[seq_q + 1] - cu_seqlens_k[seq_q]
    return Segments(
        q_segment_ids=jnp.where(valid_q, seq_q, -1)[None],
        kv_segment_ids=jnp.where(valid_k, seq_k, -2)[None],
        # i + len_k - len_q with i = t - start_q, i.e. t - end_q + len_k
        q_positions=(tq - end_q + len_k_of_q)[None],
        kv_positions=(tk - start_k)[None],
    )


def kernel_config(q, v, opts, max_seqlen_q: int):
    """The varlen forward kernel config serving this call (q (total_q, H, D), v (total_k, Hkv,
    Dv)), or the reason none does (a str). Hopper: ``sm90.fwd_config.varlen_config``;
    Blackwell (opt-in, compiled and SASS-checked, never run on hardware):
    ``sm100.fwd_config.varlen_config``."""
    if opts.implementation not in KERNEL_ARCH:
        return f"there is no varlen kernel for implementation={opts.implementation!r}"
    dtype = jnp.dtype(q.dtype).name
    if dtype not in ops.KERNEL_DTYPES:
        return f"the kernels take bfloat16 or float16 inputs, got {dtype}"
    if max_seqlen_q == 0:
        return "max_seqlen_q is 0 (no query rows to launch)"
    if opts.implementation == "sm90":
        from jax_fa4.kernels.sm90.fwd_config import varlen_config
    else:
        from jax_fa4.kernels.sm100.fwd_config import varlen_config

    try:
        return varlen_config(dtype, q.shape[2], v.shape[2], ops.mask_kind(opts.window),
                             opts.softcap > 0)
    except ValueError as err:
        return str(err)


def _kernel_forward(q, k, v, sink, cu_seqlens_q, cu_seqlens_k, opts, kernel):
    """(out (1, total_q, H, Dv), lse (1, H, total_q)) by the varlen forward kernel; ``kernel``
    is (config, max_seqlen_q, max_seqlen_k, the backward's work order). Tokens outside every
    sequence: out 0 (written by the kernel), lse -inf."""
    from jax_fa4.ffi.call import call_kernel

    config, max_q = kernel[:2]
    total_q, h, d = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    out, lse_pad = call_kernel(
        config, KERNEL_ARCH[opts.implementation], q[None], k[None], v[None],
        ops.kernel_params(opts, d), cu_seqlens_q, cu_seqlens_k,
        out_shapes=(jax.ShapeDtypeStruct((1, total_q, h, v.shape[2]), q.dtype),
                    jax.ShapeDtypeStruct((batch, h, max_q), jnp.float32)))
    t, seq, valid, start, _ = _token_layout(cu_seqlens_q, total_q)
    lse = lse_pad[seq, :, jnp.clip(t - start, 0, max_q - 1)].T  # (H, total_q)
    lse = jnp.where(valid, lse, -jnp.inf)[None]  # (the kernel wrote 0 to padding tokens' out)
    return ops.join_sink(out, lse, sink)


# -- the varlen backward kernel ------------------------------------------------------------------
#: Launch order of the varlen backward's work items: "sequence" (sequence by sequence, each
#: from its last key block down, as the dense kernels launch: a sequence's CTAs run together and
#: share its Q / dO / K / V in L2) or "heavy_first" (the key blocks with the most query blocks to
#: visit first, ties in sequence order). On the H200 "sequence" was 6 % ahead at 64 × 512 causal
#: and within ±2 % elsewhere (docs/perf-log.md). JAX_FA4_VARLEN_BWD_ORDER overrides.
VARLEN_BWD_ORDER = "sequence"


def _work_order() -> str:
    import os

    order = os.environ.get("JAX_FA4_VARLEN_BWD_ORDER", VARLEN_BWD_ORDER)
    if order not in ("heavy_first", "sequence"):
        raise ValueError(f"JAX_FA4_VARLEN_BWD_ORDER must be 'heavy_first' or 'sequence', got "
                         f"{order!r}")
    return order


#: The work list's sequence value of the item that zeroes dK / dV outside every sequence.
ZERO_PADDING = -2


def work_items(total_k: int, batch: int, tile_n: int) -> int:
    """Rows of the work list: a bound on the key blocks of all sequences (sum of
    ceil(len_k / tile_n) <= total_k // tile_n + batch), and the ZERO_PADDING item."""
    return total_k // tile_n + batch + 1


def dq_accum_rows(total_q: int, batch: int, tile_m: int) -> int:
    """Rows of the varlen dq_accum: sequence b's blocks start at tile
    ``(cu_q[b] + b·tile_m) // tile_m`` and end by tile ``total_q // tile_m + batch``."""
    return (total_q // tile_m + batch) * tile_m


def first_tiles(cu_seqlens_q: jax.Array, tile_m: int) -> jax.Array:
    """(batch,) int32: sequence b's first dq_accum tile, ``(cu_q[b] + b·tile_m) // tile_m``."""
    batch = cu_seqlens_q.shape[0] - 1
    return (cu_seqlens_q[:-1] + jnp.arange(batch, dtype=jnp.int32) * tile_m) // tile_m


def tile_owners(cu_seqlens_q: jax.Array, num_tiles: int, tile_m: int) -> jax.Array:
    """(num_tiles,) int32: the sequence owning each dq_accum tile, -1 for none (sequence b owns
    the ceil(len_q(b) / tile_m) tiles from (cu_q[b] + b·tile_m) // tile_m on)."""
    batch = cu_seqlens_q.shape[0] - 1
    lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    first = first_tiles(cu_seqlens_q, tile_m)
    end = first + (lens + tile_m - 1) // tile_m
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    # the last sequence starting at or before t (empty sequences own no tile)
    seq = jnp.clip(jnp.searchsorted(first, t, side="right") - 1, 0, batch - 1)
    return jnp.where((first[seq] <= t) & (t < end[seq]), seq, -1).astype(jnp.int32)


def visited_query_blocks(len_q, len_k, n_block, tile_m: int, tile_n: int, window):
    """Query blocks key block ``n_block`` of a sequence visits (the kernel's block range,
    elementwise on int32 arrays); ``window`` the canonical (left, right), None = unbounded."""
    left, right = window
    wl = len_k if left is None else jnp.minimum(left, len_k)
    wr = len_q if right is None else jnp.minimum(right, len_q)
    off = len_k - len_q
    m_min = jnp.zeros_like(n_block)
    m_max = (len_q + tile_m - 1) // tile_m
    if window != (None, None):
        m_min = jnp.maximum(n_block * tile_n - off - wr, 0) // tile_m
    if left is not None:
        m_max = jnp.minimum(m_max, jnp.maximum((n_block + 1) * tile_n - 1 + wl - off + tile_m,
                                               0) // tile_m)
    return jnp.maximum(m_max - m_min, 0)


def work_table(cu_seqlens_q: jax.Array, cu_seqlens_k: jax.Array, num_items: int, tile_m: int,
               tile_n: int, window, order: str = VARLEN_BWD_ORDER) -> jax.Array:
    """The varlen backward's work list, (num_items, 8) int32: row x of CTA x is (sequence b, key
    block, cu_seqlens_q[b], cu_seqlens_k[b], len_q(b), len_k(b), b's first dq_accum tile, 0)
    (sm90.bwd_config.varlen_attention_backward_signature): every key block of every sequence
    once, in launch ``order`` (see VARLEN_BWD_ORDER), then spare rows (-1, 0, …) with lengths
    0, and last (ZERO_PADDING, 0, …), the item that writes the zero gradient of the keys
    outside every sequence."""
    lens_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    lens_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    batch = lens_k.shape[0]
    blocks = (lens_k + tile_n - 1) // tile_n
    ends = jnp.cumsum(blocks)
    x = jnp.arange(num_items - 1, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, x, side="right"), batch - 1)
    used = x < ends[-1]
    # sequence by sequence, each from its last key block down
    n_block = (ends[seq] - 1 - x).astype(jnp.int32)
    columns = (seq, n_block, cu_seqlens_q[seq], cu_seqlens_k[seq], lens_q[seq], lens_k[seq],
               first_tiles(cu_seqlens_q, tile_m)[seq], jnp.zeros_like(seq))
    spare = (-1,) + (0,) * (len(columns) - 1)
    table = jnp.stack([jnp.where(used, c, fill) for c, fill in zip(columns, spare)],
                      axis=-1).astype(jnp.int32)
    if order == "heavy_first":
        cost = visited_query_blocks(lens_q[seq], lens_k[seq], n_block, tile_m, tile_n, window)
        table = table[jnp.argsort(jnp.where(used, -cost, 1), stable=True)]
    padding = jnp.asarray([[ZERO_PADDING] + [0] * (len(columns) - 1)], jnp.int32)
    return jnp.concatenate([table, padding])


def varlen_backward_config(q, k, v, opts):
    """The varlen backward kernel config serving this call (q (total_q, H, D), k (total_k, Hkv,
    D), v (total_k, Hkv, Dv)), or the reason none does (a str)."""
    if opts.implementation != "sm90":
        return f"there is no varlen backward kernel for implementation={opts.implementation!r}"
    dtype = jnp.dtype(q.dtype).name
    if dtype not in ops.KERNEL_DTYPES or not (q.dtype == k.dtype == v.dtype):
        return f"the kernels take bfloat16 or float16 inputs of one dtype, got {dtype}"
    from jax_fa4.kernels.sm90.bwd_config import varlen_config

    try:
        return varlen_config(dtype, q.shape[2], v.shape[2], ops.mask_kind(opts.window),
                             opts.softcap > 0, gqa=q.shape[1] != k.shape[1])
    except ValueError as err:
        return str(err)


def _varlen_backward(q, k, v, out, lse, dout, dlse, cu_seqlens_q, cu_seqlens_k, opts, config,
                     order: str = VARLEN_BWD_ORDER):
    """(dq, dk, dv) packed and ``delta = rowsum(dout * out) - dlse`` (1, H, total_q), by the varlen
    backward chain: the preprocess on the packed out / dout, the varlen main kernel (every
    sequence's own blocks only) and the varlen postprocess, which writes each sequence's dQ rows
    in place. ``lse``, ``dlse``: (H, total_q); ``order``: the work list's launch order
    (VARLEN_BWD_ORDER)."""
    from jax_fa4.ffi.call import call_kernel

    arch = KERNEL_ARCH[opts.implementation]
    total_q, h, d = q.shape
    total_k, hkv, dv = v.shape
    batch = cu_seqlens_q.shape[0] - 1
    tm = config.tile_m
    delta, lse_log2 = ops.bwd_preprocess(out[None], dout[None], lse[None], opts.implementation)
    delta = delta - dlse[None]  # a cotangent on lse enters as -dlse (jax_fa4.autodiff)
    params = ops.kernel_params(opts, d)
    rows = dq_accum_rows(total_q, batch, tm)
    work = work_table(cu_seqlens_q, cu_seqlens_k, work_items(total_k, batch, config.tile_n), tm,
                      config.tile_n, opts.window, order)
    hdk = h if config.gqa else hkv
    dkv_dtype = jnp.float32 if config.gqa else q.dtype
    dq_accum = jnp.zeros((1, h, rows * d), jnp.float32)
    dq_accum, dk, dvv = call_kernel(
        config, arch, q[None], k[None], v[None], dout[None], lse_log2, delta, params, dq_accum,
        cu_seqlens_q, cu_seqlens_k, work,
        out_shapes=(jax.ShapeDtypeStruct(dq_accum.shape, jnp.float32),
                    jax.ShapeDtypeStruct((1, total_k, hdk, d), dkv_dtype),
                    jax.ShapeDtypeStruct((1, total_k, hdk, dv), dkv_dtype)))
    # the postprocess writes each sequence's dQ rows in place and zeros outside them
    (dq,) = call_kernel(config.postprocess_config(), arch, dq_accum, params, cu_seqlens_q,
                        tile_owners(cu_seqlens_q, rows // tm, tm),
                        out_shapes=(jax.ShapeDtypeStruct((1, total_q, h, d), q.dtype),))
    dq = dq[0]
    dk, dvv = dk[0], dvv[0]  # (the kernel wrote zeros to the keys outside every sequence)
    if config.gqa:
        dk = dk.reshape(total_k, hkv, h // hkv, d).sum(axis=2)
        dvv = dvv.reshape(total_k, hkv, h // hkv, dv).sum(axis=2)
    return dq, dk.astype(k.dtype), dvv.astype(v.dtype), delta


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _kernel_attention(q, k, v, sink, segments, cu_seqlens_q, cu_seqlens_k, opts, kernel):
    return _kernel_forward(q, k, v, sink, cu_seqlens_q, cu_seqlens_k, opts, kernel)


def _kernel_attention_fwd(q, k, v, sink, segments, cu_seqlens_q, cu_seqlens_k, opts, kernel):
    out, lse = _kernel_forward(q, k, v, sink, cu_seqlens_q, cu_seqlens_k, opts, kernel)
    return (out, lse), (q, k, v, sink, segments, cu_seqlens_q, cu_seqlens_k, out, lse)


def _kernel_attention_bwd(opts, kernel, residuals, cotangents):
    q, k, v, sink, segments, cu_q, cu_k, out, lse = residuals
    dout, dlse = cotangents
    order = kernel[3]
    bwd_config = varlen_backward_config(q, k, v, opts)
    if not isinstance(bwd_config, str):
        dq, dk, dv, delta = _varlen_backward(q, k, v, out[0], lse[0], dout[0], dlse[0], cu_q,
                                             cu_k, opts, bwd_config, order)
        # (the preprocess's delta: no second pass over out and dout for the sink)
        dsink = None if sink is None else reference.sink_gradient(sink, lse, delta)
        return dq, dk, dv, dsink, None, None, None
    if opts.implementation == "sm100":
        ops.warn_reference_backward(opts.implementation, bwd_config)  # the forward was a kernel
    ops.reference_fallback("varlen backward", opts.implementation, bwd_config)
    # the reference's explicit backward on the packed batch
    dq, dk, dv, dsink, _ = _attention_bwd(
        opts, (q[None], k[None], v[None], sink, segments, out, lse), cotangents)
    return dq[0], dk[0], dv[0], dsink, None, None, None


_kernel_attention.defvjp(_kernel_attention_fwd, _kernel_attention_bwd)


@functools.partial(jax.jit, static_argnames=("opts", "kernel"))
def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, learnable_sink, opts, kernel=None):
    segments = varlen_segments(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    if kernel is not None:
        out, lse = _kernel_attention(q, k, v, learnable_sink, segments, cu_seqlens_q,
                                     cu_seqlens_k, opts, kernel)
    else:
        out, lse = _attention(q[None], k[None], v[None], learnable_sink, segments, opts)
    # Padding rows (in no sequence) have lse -inf even with a sink, and pass no cotangent on.
    lse = jnp.where(segments.q_segment_ids >= 0, lse[0], -jnp.inf)
    return out[0], lse  # (total_q, H, Dv), (H, total_q)


def flash_attention_varlen(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
    learnable_sink: jax.Array | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention over a batch of variable-length sequences packed along one axis (FA4 varlen).

    Args:
      q: queries ``(total_q, H, D)``: the query tokens of all sequences, back to back.
      k: keys ``(total_k, Hkv, D)``, q's dtype; H a multiple of Hkv (GQA / MQA).
      v: values ``(total_k, Hkv, Dv)``, q's dtype.
      cu_seqlens_q: int32 ``(batch + 1,)``, non-decreasing: sequence ``b``'s queries are
        ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]``. A run-time value: new lengths never
        retrace. Empty and length-1 sequences are fine. Tokens outside
        ``[cu_seqlens_q[0], cu_seqlens_q[-1])`` are padding: output 0, lse ``-inf`` (even with a
        sink), no gradient.
      cu_seqlens_k: int32 ``(batch + 1,)``, likewise for k and v (keys outside
        ``[cu_seqlens_k[0], cu_seqlens_k[-1])`` are never seen). Padding tokens must still hold
        finite values (zeros, say) in q, k and v: the kernels load the padding after the last
        sequence with its last block and mask it out, and a masked ``0 · inf`` is NaN.
      max_seqlen_q: static int >= every query length (sizes the kernels' grid; part of the
        compile key, so keep it fixed, e.g. a bucket).
      max_seqlen_k: static int >= every key length.
      softmax_scale: multiplies ``q·k``; default ``1/sqrt(D)``.
      causal: per sequence, bottom-right aligned: query ``i`` of sequence ``b`` sees keys up to
        ``i + len_k(b) - len_q(b)``. Same as ``window_size=(left, 0)``.
      window_size: ``(left, right)``, each None or an int >= 0, per sequence as for
        :func:`jax_fa4.flash_attention`.
      softcap: if > 0, scores become ``softcap * tanh(scores / softcap)``.
      learnable_sink: optional ``(H,)`` floating logits (float32 recommended), one per query
        head, joining every row's softmax denominator with no value; differentiable.
      return_lse: also return the log-sum-exp, ``(H, total_q)`` float32 (FA4's varlen layout).
      implementation: None (on an H100/H200 the Hopper varlen forward kernel when it serves
        the call, else the reference), ``"sm90"`` or ``"sm100"`` (that architecture's varlen
        forward kernel, or :class:`ImplementationUnavailableError` saying why not; the sm100
        kernel is opt-in, never run on hardware here) or ``"reference"``. On Hopper the
        backward runs the varlen backward kernel (each sequence's own blocks only); with
        sm100, the reference's backward (the sm100 backward kernel has no varlen mode yet; a
        one-time ``RuntimeWarning`` says so).

    Returns:
      ``out`` ``(total_q, H, Dv)`` in q's dtype, and with ``return_lse`` also ``lse``
      ``(H, total_q)`` float32. Rows with no visible key (e.g. a query whose sequence has no
      key) give 0 and lse ``-inf`` (``lse = sink`` with a sink).

    Differentiable with ``jax.grad`` in q, k, v and the sink (also through lse); works under
    ``jax.jit`` and ``jax.vmap``. Values of cu_seqlens that violate the contract (decreasing,
    a length above max_seqlen) are rejected when they are host (numpy) arrays and otherwise
    give unspecified results.
    """
    _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    opts = _options(q, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                    softcap=softcap, implementation=implementation)
    learnable_sink = check_learnable_sink(learnable_sink, q.shape[1])
    kernel = None
    if opts.implementation != "reference":
        config = kernel_config(q, v, opts, max_seqlen_q)
        if not isinstance(config, str):
            # (the work order is read here, outside the jitted core, so that it keys its cache)
            kernel = (config, max_seqlen_q, max_seqlen_k, _work_order())
        elif opts.forced:
            raise ImplementationUnavailableError(
                f"implementation={opts.implementation!r} cannot run this varlen attention call: "
                f"{config}")
        else:
            ops.reference_fallback("varlen attention", opts.implementation, config)
    out, lse = _varlen(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(cu_seqlens_q),
                       jnp.asarray(cu_seqlens_k), learnable_sink, opts, kernel)
    return (out, lse) if return_lse else out


def _options(q, *, softmax_scale, causal, window_size, softcap, implementation):
    """Canonical :class:`jax_fa4.api.AttentionOptions` from q (any layout with D last)."""
    left, right = api._check_window(window_size)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if causal:
        right = 0
    scale = (1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None
             else api._check_scalar("softmax_scale", softmax_scale, allow_zero=False))
    cap = api._check_scalar("softcap", softcap, allow_zero=True)
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    return api.AttentionOptions(scale, (left, right), cap, resolve_implementation(implementation),
                                forced=implementation is not None)
