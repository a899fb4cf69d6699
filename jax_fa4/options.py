"""The options of one attention call and every input check: validate and canonicalise once.

:class:`AttentionOptions` is what the autodiff rules and the backends close over: hashable, with
causal folded into the window and the implementation resolved to a registered backend
(:func:`jax_fa4.backends.select`). The checks are named functions, one per concern, whose
messages name the argument and say what was expected and what came: the dense inputs
(:func:`canonicalize`), the packed variable-length ones (:func:`check_varlen_inputs`), a paged KV
cache (:func:`check_paged_inputs`), a learnable sink (:func:`check_learnable_sink`) and segment
ids (:func:`check_segment_ids`).

Dimension letters: B batch, Sq query length, Sk key length, H query heads, Hkv key/value heads
(H a multiple of Hkv: MHA when equal, GQA when between, MQA when Hkv = 1), D query/key head dim,
Dv value head dim.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa4 import backends
# the ids a padding segment id becomes (padding_segment_id), which the fast tables recognise
from jax_fa4.segments import PADDING_KV_ID, PADDING_Q_ID

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

Window = tuple[int | None, int | None]


@dataclass(frozen=True)
class AttentionOptions:
    """Canonical, hashable options of one attention call (what the autodiff rule closes over)."""

    softmax_scale: float
    window: Window  # (left, right); causal is (left, 0)
    softcap: float
    implementation: str  # resolved: a registered backend's name ("reference", "sm90", ...)
    forced: bool  # the caller named the implementation: no silent fallback
    deterministic: bool = False  # bitwise-reproducible gradients
    max_logits: bool = False  # the forward also returns each row's max logit (QK-Clip)

    @property
    def causal(self) -> bool:
        return self.window[1] == 0


# -- input checks: one named function each, messages say what was expected and what came ------
def is_array(x: Any) -> bool:
    """A jax or numpy array (what every array argument must be)."""
    return isinstance(x, (jax.Array, np.ndarray))


def check_array(name: str, x: Any) -> None:
    if not is_array(x):
        raise TypeError(f"{name} must be a jax.Array (or numpy array), got {type(x).__name__}")


def check_rank(name: str, x: Any, layout: str, rank: int = 4, note: str = "") -> None:
    if x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank} with layout {layout}{note}, got shape "
                         f"{x.shape}")


def check_nonempty(name: str, x: Any) -> None:
    if 0 in x.shape:
        raise ValueError(f"{name} must have no zero-sized dimension, got shape {x.shape}")


#: FP8 inputs (forward only, with descale factors): :func:`jax_fa4.flash_attention`, an e4m3
#: cache in :func:`jax_fa4.flash_attention_paged`, e4m3 q, k, v in
#: :func:`jax_fa4.flash_attention_varlen`.
FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)


def check_dtypes(q: Any, k: Any, v: Any, k_name: str = "k", v_name: str = "v",
                 allow_fp8: bool = False) -> None:
    supported = SUPPORTED_DTYPES + ((FP8_DTYPE,) if allow_fp8 else ())
    if jnp.dtype(q.dtype) not in supported:
        names = "bfloat16, float16, float32" + (" or float8_e4m3fn" if allow_fp8 else "")
        raise TypeError(f"q must have dtype {names}, got {q.dtype}")
    for name, x in ((k_name, k), (v_name, v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")


def check_descale(name: str, x: Any, shape: tuple[int, ...], layout: str = "(B, Hkv)"
                  ) -> jax.Array:
    """A descale argument as a float32 array of ``shape`` (its ``layout``: ``(B, Hkv)``,
    ``(Hkv,)`` for a paged cache's, ``(num_sequences, Hkv)`` for varlen): None -> ones, a
    scalar or ``shape`` broadcast."""
    if x is None:
        return jnp.ones(shape, jnp.float32)
    if not (is_array(x) or isinstance(x, (int, float))):
        raise TypeError(f"{name} must be a float32 scalar or {layout} array, got "
                        f"{type(x).__name__}")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be floating (float32), got {x.dtype}")
    if x.ndim != 0 and x.shape != tuple(shape):
        raise ValueError(f"{name} must be a scalar or have shape {layout} = {tuple(shape)}, "
                         f"got {x.shape}")
    return jnp.broadcast_to(x.astype(jnp.float32), shape)


def reject_fp8_arguments(fp8_args: dict[str, Any], what: str, got: str) -> None:
    """The FP8 arguments (descales, out_dtype) of a call whose inputs are not e4m3: a
    ValueError naming those given (``what``: the inputs an FP8 call has in e4m3; ``got``: what
    this call has)."""
    given = [name for name, x in fp8_args.items() if x is not None]
    if given:
        raise ValueError(f"{', '.join(given)} apply to FP8 calls only ({what} in "
                         f"float8_e4m3fn); got {got}")


def refuse_fp8_features(**features: bool) -> None:
    """NotImplementedError naming the features an FP8 call asked for that it lacks."""
    unsupported = [name for name, on in features.items() if on]
    if unsupported:
        raise NotImplementedError(f"FP8 (float8_e4m3fn) attention does not support "
                                  f"{', '.join(unsupported)} yet")


def check_fp8_cache_dtypes(q: Any, k_cache: Any, v_cache: Any) -> None:
    """An e4m3 paged cache: k_cache and v_cache both float8_e4m3fn; q float8_e4m3fn (with its
    q_descale) or bfloat16 / float16 / float32 (the call quantises it)."""
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if jnp.dtype(x.dtype) != FP8_DTYPE:
            raise TypeError(f"{name} must have dtype float8_e4m3fn like the other cache "
                            f"tensor (an FP8 KV cache), got {x.dtype}")
    if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES + (FP8_DTYPE,):
        raise TypeError(f"q must have dtype float8_e4m3fn, bfloat16, float16 or float32 "
                        f"with an FP8 KV cache, got {q.dtype}")


def check_out_dtype(out_dtype: Any) -> jnp.dtype:
    """An FP8 call's output dtype: bfloat16 (default), float16 or float32."""
    dtype = jnp.dtype(jnp.bfloat16 if out_dtype is None else out_dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {dtype}")
    return dtype


def check_shapes(q: Any, k: Any, v: Any) -> None:
    """Dense q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv)."""
    b, _, h, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {q.shape}, k {k.shape}, v {v.shape} "
                         "(expected the same B in dim 0)")
    if k.shape[3] != d:
        raise ValueError(f"k head_dim must equal q head_dim {d}: q {q.shape}, k {k.shape}")
    if v.shape[1] != k.shape[1] or v.shape[2] != k.shape[2]:
        raise ValueError(f"v must have k's (Sk, Hkv) = {k.shape[1:3]}, got v {v.shape}")
    hkv = k.shape[2]
    if hkv == 0 or h % hkv:
        raise ValueError(f"q heads H={h} must be a positive multiple of k/v heads Hkv={hkv}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_nonempty(name, x)


def check_window(window_size: Any) -> Window:
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    out = []
    for side, w in zip(("left", "right"), window_size):
        if w is None:
            out.append(None)
            continue
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)):
            raise TypeError(f"window_size {side} must be None or an int, got {w!r}")
        if w < 0:
            raise ValueError(f"window_size {side} must be >= 0 or None (unbounded), got {w}")
        out.append(int(w))
    return out[0], out[1]


def check_scalar(name: str, x: Any, *, allow_zero: bool) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must be a Python float, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x) or x < 0 or (x == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, "
                         f"got {x}")
    return x


def check_flag(name: str, flag: Any) -> bool:
    if not isinstance(flag, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    return bool(flag)


def check_implementation(implementation: Any) -> None:
    if implementation is not None and implementation not in backends.names():
        raise ValueError(f"implementation must be None or one of {backends.names()}, "
                         f"got {implementation!r}")


def check_learnable_sink(learnable_sink: Any, num_heads: int) -> jax.Array | None:
    """Validate a learnable sink: ``None`` or a floating array of shape ``(H,)``.

    Returns:
        the sink as a jax array (its dtype kept: arithmetic is float32 and its gradient comes
        back in its dtype), or None.
    """
    if learnable_sink is None:
        return None
    if not is_array(learnable_sink):
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
    if not is_array(x):
        raise TypeError(f"{name} must be an int32 jax.Array {layout}, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype (int32), got {x.dtype}")
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {layout} = {shape}, got {x.shape}")
    return jnp.asarray(x, jnp.int32)


def check_segment_ids(segment_ids: Any, q: Any, k: Any, padding_segment_id: int | None = None
                      ) -> tuple[jax.Array, jax.Array] | None:
    """Validate ``segment_ids``: None, one ``(B, S)`` int array (self-attention, ``Sq == Sk``)
    or a pair ``(q_segment_ids (B, Sq), kv_segment_ids (B, Sk))``. ``padding_segment_id``: the
    id of padding tokens (e.g. 0, MaxText's and Levanter's convention), rewritten to
    PADDING_Q_ID in the queries and PADDING_KV_ID in the keys, so padding sees no key and no
    query sees padding.

    Returns:
        ``(q_segment_ids, kv_segment_ids)`` as int32 jax arrays, or None.
    """
    if segment_ids is None:
        if padding_segment_id is not None:
            raise ValueError("padding_segment_id needs segment_ids")
        return None
    if padding_segment_id is not None:
        if isinstance(padding_segment_id, bool) or not isinstance(padding_segment_id,
                                                                  (int, np.integer)):
            raise TypeError("padding_segment_id must be a Python int, got "
                            f"{type(padding_segment_id).__name__}")
        if padding_segment_id in (PADDING_Q_ID, PADDING_KV_ID):
            raise ValueError(f"padding_segment_id {padding_segment_id} is reserved (the "
                             "padding ids of the queries and keys)")
    b, sq = q.shape[:2]
    sk = k.shape[1]
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError("segment_ids must be one (B, S) array or a pair (q_segment_ids, "
                             f"kv_segment_ids), got a sequence of {len(segment_ids)}")
        q_ids, kv_ids = segment_ids
    else:
        if is_array(segment_ids) and sq != sk:
            raise ValueError(f"a single segment_ids array needs Sq == Sk (got Sq={sq}, Sk={sk}); "
                             "pass a pair (q_segment_ids, kv_segment_ids)")
        q_ids = kv_ids = segment_ids
    q_ids = _check_int_array("q_segment_ids", q_ids, (b, sq), "(B, Sq)")
    kv_ids = _check_int_array("kv_segment_ids", kv_ids, (b, sk), "(B, Sk)")
    if padding_segment_id is None:
        return q_ids, kv_ids
    pad = int(padding_segment_id)
    return (jnp.where(q_ids == pad, PADDING_Q_ID, q_ids),
            jnp.where(kv_ids == pad, PADDING_KV_ID, kv_ids))


def check_static_int(name: str, x: Any) -> int:
    if isinstance(x, jax.Array):  # concrete or traced (tracers are jax.Arrays too)
        raise TypeError(f"{name} must be a static Python int (it sizes the kernel grid and is "
                        "part of the compile key); pass run-time lengths through cu_seqlens")
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name} must be a Python int, got {type(x).__name__}")
    if x < 0:
        raise ValueError(f"{name} must be >= 0, got {x}")
    return int(x)


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        validate: bool = False) -> None:
    """Packed q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv) of one dtype
    (float8_e4m3fn too: the FP8 varlen forward), int32 cu_seqlens (batch + 1,) and static
    max_seqlen ints. Values are checked wherever they are known at the call
    (:func:`concrete_values`); traced ones only with ``validate``
    (:func:`check_at_run_time`)."""
    for name, x, layout in (("q", q, "(total_q, H, D)"), ("k", k, "(total_k, Hkv, D)"),
                            ("v", v, "(total_k, Hkv, Dv)")):
        check_array(name, x)
        check_rank(name, x, layout, 3, " (tokens packed along one axis)")
        check_nonempty(name, x)
    check_dtypes(q, k, v, allow_fp8=True)
    total_q, h, d = q.shape
    total_k, hkv = k.shape[:2]
    if k.shape[2] != d:
        raise ValueError(f"k head_dim must equal q head_dim {d}: q {q.shape}, k {k.shape}")
    if v.shape[:2] != (total_k, hkv):
        raise ValueError(f"v must have k's (total_k, Hkv) = {(total_k, hkv)}, got v {v.shape}")
    if h % hkv:
        raise ValueError(f"q heads H={h} must be a multiple of k/v heads Hkv={hkv}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not is_array(cu):
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
    max_q = check_static_int("max_seqlen_q", max_seqlen_q)
    max_k = check_static_int("max_seqlen_k", max_seqlen_k)
    for name, cu, total, mx, mx_name in (
        ("cu_seqlens_q", cu_seqlens_q, total_q, max_q, "max_seqlen_q"),
        ("cu_seqlens_k", cu_seqlens_k, total_k, max_k, "max_seqlen_k"),
    ):
        check = functools.partial(check_cu_seqlens, name, total=total, max_len=mx,
                                  max_name=mx_name)
        values = concrete_values(cu)
        if values is not None:
            check(values)
        elif validate:
            check_at_run_time(check, cu)


def check_validate(validate: Any) -> bool:
    """The API's ``validate`` flag: a Python bool (it decides what is traced, so it is static)."""
    if not isinstance(validate, (bool, np.bool_)):
        raise TypeError(f"validate must be a bool, got {type(validate).__name__}")
    return bool(validate)


def check_at_run_time(check: Callable[..., None], *values: jax.Array) -> None:
    """Run ``check`` (one of the ``check_*`` value rules below) on the values of traced metadata
    when the computation runs (a ``jax.debug.callback``): under ``jit`` a broken rule then
    raises when the program executes (with async dispatch at the first wait on its results,
    e.g. ``block_until_ready``), as the ValueError's message inside JAX's runtime error. The
    validated mode's cost is one device-to-host copy of the metadata per call."""
    def host(*arrays):
        check(*(np.asarray(a) for a in arrays))

    jax.debug.callback(host, *values)


def concrete_values(x: Any) -> np.ndarray | None:
    """The values of metadata known outside a trace (numpy, or a concrete jax.Array: one small
    device-to-host copy), None under ``jit`` / ``vmap`` (a tracer) or for an array with shards
    on other processes. Traced metadata is not checked: the kernels clamp every index to the
    tensors' bounds, and the result of breaking a rule is unspecified."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, jax.core.Tracer) or not getattr(x, "is_fully_addressable", True):
        return None  # traced, or spread over other processes' devices
    return np.asarray(x)


def check_cu_seqlens(name: str, cu: np.ndarray, total: int, max_len: int, max_name: str) -> None:
    """``cu`` (batch + 1,): starts at >= 0, non-decreasing, ends within the ``total`` packed
    tokens, no sequence longer than ``max_len``; the error names the first index that breaks a
    rule."""
    if cu[0] < 0:
        raise ValueError(f"{name}[0]={cu[0]} is negative: must be >= 0 (tokens before it are "
                         "padding)")
    lengths = np.diff(cu)
    down = np.flatnonzero(lengths < 0)
    if down.size:
        i = int(down[0]) + 1
        raise ValueError(f"{name}[{i}]={cu[i]} < {name}[{i - 1}]={cu[i - 1]}: must be "
                         "non-decreasing")
    if cu[-1] > total:
        raise ValueError(f"{name}[-1] = {cu[-1]} exceeds the number of packed tokens {total} "
                         f"(index {len(cu) - 1})")
    if lengths.max() > max_len:
        b = int(np.argmax(lengths))
        raise ValueError(f"{name} has a sequence of length {lengths[b]} > {max_name} = "
                         f"{max_len} (sequence {b}: {name}[{b + 1}]={cu[b + 1]} − "
                         f"{name}[{b}]={cu[b]})")


def check_paged_inputs(q, k_cache, v_cache, page_table, seqused_k, validate: bool = False,
                       fp8: bool = False) -> None:
    """q (B, Sq, H, D), a paged cache (num_pages, page_size, Hkv, D / Dv), an int32 page table
    (B, max_pages) and seqused_k (B,); ``fp8``: an e4m3 cache (:func:`check_fp8_cache_dtypes`).
    Values are checked wherever they are known at the call (:func:`concrete_values`); traced
    ones only with ``validate`` (:func:`check_at_run_time`)."""
    for name, x, layout in (("q", q, "(B, Sq, H, D)"),
                            ("k_cache", k_cache, "(num_pages, page_size, Hkv, D)"),
                            ("v_cache", v_cache, "(num_pages, page_size, Hkv, Dv)")):
        check_array(name, x)
        check_rank(name, x, layout)
        check_nonempty(name, x)
    if fp8:
        check_fp8_cache_dtypes(q, k_cache, v_cache)
    else:
        check_dtypes(q, k_cache, v_cache, "k_cache", "v_cache")
    b, _, h, d = q.shape
    num_pages, page_size, hkv, _ = k_cache.shape
    if k_cache.shape[3] != d:
        raise ValueError(f"k_cache head_dim must equal q head_dim {d}: q {q.shape}, "
                         f"k_cache {k_cache.shape}")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"v_cache must have k_cache's (num_pages, page_size, Hkv) = "
                         f"{k_cache.shape[:3]}, got v_cache {v_cache.shape}")
    if h % hkv:
        raise ValueError(f"q heads H={h} must be a multiple of cache heads Hkv={hkv}")
    for name, x, ndim, layout in (("page_table", page_table, 2, "(B, max_pages)"),
                                  ("seqused_k", seqused_k, 1, "(B,)")):
        if not is_array(x):
            raise TypeError(f"{name} must be an int32 jax.Array {layout}, got "
                            f"{type(x).__name__}")
        if x.dtype != jnp.int32:
            raise TypeError(f"{name} must have dtype int32, got {x.dtype}")
        if x.ndim != ndim or x.shape[0] != b or 0 in x.shape:
            raise ValueError(f"{name} must have shape {layout} with B = {b} (q's batch), got "
                             f"{x.shape}")
    # Values wherever they are known outside a trace (concrete_values).
    max_pages = page_table.shape[1]

    def check_both(table: np.ndarray, used_keys: np.ndarray) -> None:
        check_seqused_k(used_keys, max_pages, page_size)
        check_page_table(table, used_keys, page_size, num_pages)

    used_keys = concrete_values(seqused_k)
    table = concrete_values(page_table)
    if used_keys is not None:
        check_seqused_k(used_keys, max_pages, page_size)
    if used_keys is not None and table is not None:
        check_page_table(table, used_keys, page_size, num_pages)
    elif validate:  # (one of them traced: both checked on the host when the program runs)
        check_at_run_time(check_both, page_table, seqused_k)


def check_seqused_k(seqused_k: np.ndarray, max_pages: int, page_size: int) -> None:
    """Each entry in [0, max_pages · page_size] (the keys a page-table row can hold)."""
    max_keys = max_pages * page_size
    bad = np.flatnonzero((seqused_k < 0) | (seqused_k > max_keys))
    if bad.size:
        b = int(bad[0])
        rule = "is negative" if seqused_k[b] < 0 else "exceeds"
        raise ValueError(f"seqused_k[{b}]={seqused_k[b]} {rule}: must lie in [0, max_pages * "
                         f"page_size = {max_keys}]")


def check_page_table(page_table: np.ndarray, seqused_k: np.ndarray, page_size: int,
                     num_pages: int) -> None:
    """The entries of the pages each batch entry uses (the first ceil(seqused_k[b] /
    page_size) of its row) in [0, num_pages); the unused ones may hold anything (e.g. -1)."""
    used = np.arange(page_table.shape[1])[None, :] * page_size < seqused_k[:, None]
    bad = np.argwhere(used & ((page_table < 0) | (page_table >= num_pages)))
    if bad.size:
        b, j = (int(i) for i in bad[0])
        raise ValueError(f"page_table[{b}, {j}]={page_table[b, j]} is outside [0, num_pages = "
                         f"{num_pages}): batch entry {b} uses its first "
                         f"{-(-int(seqused_k[b]) // page_size)} pages (seqused_k[{b}]="
                         f"{seqused_k[b]})")


# -- canonical options -------------------------------------------------------------------------
def options(head_dim: int, *, softmax_scale: float | None, causal: bool, window_size: Any,
            softcap: float, implementation: str | None,
            deterministic: bool = False) -> AttentionOptions:
    """Canonical :class:`AttentionOptions` of a call whose queries have head dim ``head_dim``
    (the default scale is ``1/sqrt(head_dim)``); the arrays are checked by the caller."""
    left, right = check_window(window_size)
    if check_flag("causal", causal):
        right = 0
    deterministic = check_flag("deterministic", deterministic)
    scale = (1.0 / math.sqrt(head_dim) if softmax_scale is None
             else check_scalar("softmax_scale", softmax_scale, allow_zero=False))
    cap = check_scalar("softcap", softcap, allow_zero=True)
    check_implementation(implementation)
    return AttentionOptions(scale, (left, right), cap, backends.select(implementation),
                            forced=implementation is not None, deterministic=deterministic)


def canonicalize(q: Any, k: Any, v: Any, *, softmax_scale: float | None, causal: bool,
                 window_size: Any, softcap: float, implementation: str | None,
                 deterministic: bool = False) -> AttentionOptions:
    """Validate the inputs and options of one dense call and return its canonical options
    (float8_e4m3fn inputs allowed: :mod:`jax_fa4.fp8` checks the rest)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(name, x)
    check_rank("q", q, "(B, Sq, H, D)")
    check_rank("k", k, "(B, Sk, Hkv, D)")
    check_rank("v", v, "(B, Sk, Hkv, Dv)")
    check_dtypes(q, k, v, allow_fp8=True)
    check_shapes(q, k, v)
    return options(q.shape[3], softmax_scale=softmax_scale, causal=causal,
                   window_size=window_size, softcap=softcap, implementation=implementation,
                   deterministic=deterministic)
