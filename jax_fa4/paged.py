"""Attention over a paged KV cache: decode steps and prefill chunks (FA4's ``page_table``).

The cache holds fixed-size pages, k_cache ``(num_pages, page_size, Hkv, D)`` and v_cache
``(num_pages, page_size, Hkv, Dv)``; batch entry ``b`` owns the pages
``page_table[b, 0], page_table[b, 1], ...`` in order, so its key ``j`` is
``k_cache[page_table[b, j // page_size], j % page_size]``, and its first ``seqused_k[b]`` keys
are valid. The queries ``(B, Sq, H, D)`` are the last ``Sq`` tokens of each sequence: causal and
windows align them bottom-right to ``seqused_k[b]`` (query ``i`` sees keys up to
``i + seqused_k[b] - Sq``).

On Hopper (``implementation="sm90"``, bf16/fp16, page_size a multiple of the kernel's key block,
64 keys: the decode tile's) the paged forward kernel runs: each key block of a batch entry is one
TMA load of the cache tile its page table entry names, and the kernel stops at
``seqused_k[b]``. Decode steps are rewritten around it as for dense decode
(:mod:`jax_fa4.decode`): the ``g`` query heads of a kv head packed into one tile's rows and, when
the tiles would not fill the GPU, the page table split into chunks (one batch entry each, with
its own ``seqused_k``) merged by their lse. The Blackwell forward kernel has the same paged
mode (compiled and SASS-checked only; used when sm100 is forced or enabled, like every sm100
kernel). A learnable sink joins afterwards in float32:
``lse' = logaddexp(lse, sink)``, ``out' = out · e^{lse − lse'}``.

Otherwise the pure-JAX reference runs, in one of two forms:

- dense (at most 2048 key slots per batch entry, ``max_pages * page_size``): the pages are
  gathered (``jnp.take``) into ``(B, max_pages * page_size, Hkv, D)`` and keys at
  ``j >= seqused_k[b]`` are masked;
- split-KV: a scan over chunks of the page table (512 keys per chunk) that gathers only the
  chunk's pages and merges the chunks with an online softmax, so memory is
  ``O(B * H * Sq * 512)`` plus one chunk of K/V, whatever the context length.

Forward only: there is no gradient through this function. ``jax.grad`` (or ``jax.vjp``) with
respect to anything that flows into q, k_cache, v_cache or the sink raises
``NotImplementedError`` (rather than silently returning zeros); wrap the call's inputs in
``jax.lax.stop_gradient`` when the surrounding computation is differentiated for other reasons.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_fa4 import api, decode, ops, reference
from jax_fa4.dispatch import KERNEL_ARCH, ImplementationUnavailableError
from jax_fa4.varlen import _is_array, _options, check_learnable_sink

__all__ = ["flash_attention_paged"]

#: Up to this many key slots per batch entry the whole cache of a batch entry is gathered.
_DENSE_MAX_KEYS = 2048
#: Keys per chunk of the split-KV form (rounded to whole pages).
_SPLIT_KEYS = 512


def _check_paged_inputs(q, k_cache, v_cache, page_table, seqused_k) -> None:
    for name, x, layout in (("q", q, "(B, Sq, H, D)"),
                            ("k_cache", k_cache, "(num_pages, page_size, Hkv, D)"),
                            ("v_cache", v_cache, "(num_pages, page_size, Hkv, Dv)")):
        if not _is_array(x):
            raise TypeError(f"{name} must be a jax.Array (or numpy array), got "
                            f"{type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 with layout {layout}, got shape "
                             f"{x.shape}")
        if 0 in x.shape:
            raise ValueError(f"{name} must have no zero-sized dimension, got shape {x.shape}")
    api._check_dtypes(q, k_cache, v_cache)
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
        if not _is_array(x):
            raise TypeError(f"{name} must be an int32 jax.Array {layout}, got "
                            f"{type(x).__name__}")
        if x.dtype != jnp.int32:
            raise TypeError(f"{name} must have dtype int32, got {x.dtype}")
        if x.ndim != ndim or x.shape[0] != b or 0 in x.shape:
            raise ValueError(f"{name} must have shape {layout} with B = {b} (q's batch), got "
                             f"{x.shape}")
    # Values only when they are host (numpy) data: no device sync, and traced under jit.
    max_keys = page_table.shape[1] * page_size
    if isinstance(seqused_k, np.ndarray) and ((seqused_k < 0) | (seqused_k > max_keys)).any():
        raise ValueError(f"seqused_k must lie in [0, max_pages * page_size = {max_keys}], got "
                         f"{seqused_k}")
    if isinstance(page_table, np.ndarray) and isinstance(seqused_k, np.ndarray):
        used = np.arange(page_table.shape[1])[None, :] * page_size < seqused_k[:, None]
        bad = used & ((page_table < 0) | (page_table >= num_pages))
        if bad.any():
            raise ValueError(f"page_table entries of used pages must lie in [0, num_pages = "
                             f"{num_pages}), got {page_table[bad][:8]}")


def _gather(cache: jax.Array, pages: jax.Array) -> jax.Array:
    """Pages (B, n) of a cache (num_pages, page_size, Hkv, X) -> (B, n * page_size, Hkv, X).

    Page indices are clipped into range: entries past a sequence's used pages may hold
    anything (e.g. -1); the keys they give are masked.
    """
    pages = jnp.clip(pages, 0, cache.shape[0] - 1)
    x = jnp.take(cache, pages, axis=0)  # (B, n, page_size, Hkv, X)
    b, n, ps, hkv, rest = x.shape
    return x.reshape(b, n * ps, hkv, rest)


def _mask_data(seqused_k, sq: int, kv_index: jax.Array):
    """q segment ids / positions (B, Sq) and the kv segment ids (B, n) of keys ``kv_index``."""
    b = seqused_k.shape[0]
    q_ids = jnp.zeros((b, sq), jnp.int32)
    q_pos = jnp.arange(sq, dtype=jnp.int32)[None, :] + (seqused_k - sq)[:, None]
    kv_ids = jnp.where(kv_index[None, :] < seqused_k[:, None], 0, -1)  # -1: an unused slot
    return q_ids, q_pos, kv_ids


def _paged_reference(q, k_cache, v_cache, page_table, seqused_k, learnable_sink, opts,
                     pages_per_block: int | None):
    """(out, lse); ``pages_per_block`` None: dense, else split-KV with that many pages a chunk."""
    b, sq, h, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    dv = v_cache.shape[3]
    max_pages = page_table.shape[1]
    sk = max_pages * page_size
    if pages_per_block is None:
        k, v = _gather(k_cache, page_table), _gather(v_cache, page_table)
        q_ids, q_pos, kv_ids = _mask_data(seqused_k, sq, jnp.arange(sk))
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
        kb = _gather(k_cache, pages).astype(jnp.float32)
        vb = _gather(v_cache, pages).astype(jnp.float32)
        q_ids, q_pos, kv_ids = _mask_data(seqused_k, sq, start + jnp.arange(block_k))
        mask = reference.visible_mask(sq, sk, opts.window, k_start=start, num_k=block_k,
                                      q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                                      q_positions=q_pos)
        return reference._online_update(carry, qg, kb, vb, mask, opts.softmax_scale,
                                        opts.softcap), None

    carry, _ = lax.scan(step, reference._online_init(b, hkv, h // hkv, sq, dv),
                        (table, jnp.arange(chunks) * block_k))
    out, lse = reference._online_finish(carry, learnable_sink)
    return out.reshape(b, sq, h, dv).astype(q.dtype), reference._ungroup_lse(lse)


def kernel_config(q, k_cache, v_cache, opts):
    """The paged forward kernel config serving this call, or the reason none does (a str).
    Hopper: the 64-row decode tile (``sm90.fwd_config.paged_config``); Blackwell (opt-in, never
    run on hardware): the table's config with ``paged=True``."""
    if opts.implementation not in KERNEL_ARCH:
        return f"there is no paged kernel for implementation={opts.implementation!r}"
    dtype = jnp.dtype(q.dtype).name
    if dtype not in ops.KERNEL_DTYPES:
        return f"the kernels take bfloat16 or float16 inputs, got {dtype}"
    kind = (dtype, q.shape[3], v_cache.shape[3], ops.mask_kind(opts.window), opts.softcap > 0)
    try:
        if opts.implementation == "sm90":
            from jax_fa4 import decode
            from jax_fa4.kernels.sm90.fwd_config import paged_config

            config = paged_config(*kind, **(decode.decode_tile_option() or {}))
        else:
            from jax_fa4.kernels.sm100.fwd_config import FwdConfig

            config = FwdConfig.make(*kind, paged=True)
    except ValueError as err:
        return str(err)
    page_size = k_cache.shape[1]
    if page_size % config.tile_n:
        return (f"page_size {page_size} is not a multiple of the paged kernel's key block "
                f"{config.tile_n}")
    return config


def _paged_kernel(q, k_cache, v_cache, page_table, seqused_k, learnable_sink, opts, config):
    """(out, lse) by the paged forward kernel, with decode shapes packed / split (decode.py)."""
    from jax_fa4.ffi.call import call_kernel

    b, sq, h, d = q.shape
    num_pages, page_size, hkv, _ = k_cache.shape
    dv = v_cache.shape[3]
    tile_n = config.tile_n
    per_page = page_size // tile_n
    # the cache as one batch entry of tile_n-key tiles; a page is per_page consecutive tiles
    k_tiles = k_cache.reshape(1, num_pages * page_size, hkv, d)
    v_tiles = v_cache.reshape(1, num_pages * page_size, hkv, dv)
    table = page_table  # (B, blocks): the cache tile of each key block
    if per_page > 1:
        table = (page_table[:, :, None] * per_page
                 + jnp.arange(per_page, dtype=jnp.int32)).reshape(b, -1)
    blocks = table.shape[1]
    plan = decode.plan(q.shape, (b, blocks * tile_n, hkv, d), opts.window, key_block=tile_n)
    if plan is None:
        plan = decode.DecodePlan(group=1, splits=1, window=opts.window)
    s = plan.splits
    chunk = blocks // s * tile_n  # keys per chunk

    def on_packed(qp, kernel_opts):
        # chunk c of batch entry i: table columns [c·blocks/S, (c+1)·blocks/S), its keys clipped
        # (the Hopper kernel clamps seqused_k to its table row's keys: unsplit, it takes it as
        # it is)
        used = seqused_k if s == 1 and opts.implementation == "sm90" else jnp.clip(
            seqused_k[:, None] - jnp.arange(s, dtype=jnp.int32) * chunk, 0, chunk)
        head_major = getattr(config, "qo_head_major", False)  # else (B, S, H, D)
        heads, rows = qp.shape[1], qp.shape[2]
        out_shape = (b * s, heads, rows, dv) if head_major else (b * s, rows, heads, dv)
        out, lse = call_kernel(
            config, KERNEL_ARCH[opts.implementation],
            qp if head_major else qp.transpose(0, 2, 1, 3), k_tiles, v_tiles,
            ops.kernel_params(kernel_opts, d), table.reshape(b * s, blocks // s),
            used.reshape(b * s).astype(jnp.int32),
            out_shapes=(jax.ShapeDtypeStruct(out_shape, q.dtype),
                        jax.ShapeDtypeStruct((b * s, heads, rows), jnp.float32)))
        return (out if head_major else out.transpose(0, 2, 1, 3)), lse

    out, lse = decode.rewrite(q, opts, plan, on_packed)
    return ops.join_sink(out, lse, learnable_sink)


def _paged_forward(q, k_cache, v_cache, page_table, seqused_k, learnable_sink, opts, route):
    if route[0] == "kernel":
        return _paged_kernel(q, k_cache, v_cache, page_table, seqused_k, learnable_sink, opts,
                             route[1])
    return _paged_reference(q, k_cache, v_cache, page_table, seqused_k, learnable_sink, opts,
                            route[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _paged(q, k_cache, v_cache, page_table, seqused_k, learnable_sink, opts, route):
    return _paged_forward(q, k_cache, v_cache, page_table, seqused_k, learnable_sink, opts, route)


def _paged_fwd(q, k_cache, v_cache, page_table, seqused_k, learnable_sink, opts, route):
    out = _paged_forward(q, k_cache, v_cache, page_table, seqused_k, learnable_sink, opts, route)
    return out, None


def _paged_bwd(opts, route, residuals, cotangents):
    raise NotImplementedError(
        "flash_attention_paged is forward only (decode / prefill over a KV cache): it has no "
        "gradient. Wrap its inputs in jax.lax.stop_gradient if the surrounding computation is "
        "differentiated, or use flash_attention / flash_attention_varlen for training.")


_paged.defvjp(_paged_fwd, _paged_bwd)


@functools.partial(jax.jit, static_argnames=("opts", "route"))
def _paged_jit(q, k_cache, v_cache, page_table, seqused_k, learnable_sink, opts, route):
    return _paged(q, k_cache, v_cache, page_table, seqused_k, learnable_sink, opts, route)


def flash_attention_paged(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    page_table: jax.Array,
    seqused_k: jax.Array,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
    learnable_sink: jax.Array | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of a few new query tokens over a paged KV cache (decode / chunked prefill).

    Args:
      q: queries ``(B, Sq, H, D)``: the last Sq tokens of each sequence (Sq = 1 for a decode
        step; any Sq works).
      k_cache: ``(num_pages, page_size, Hkv, D)``, q's dtype; H a multiple of Hkv.
      v_cache: ``(num_pages, page_size, Hkv, Dv)``, q's dtype.
      page_table: int32 ``(B, max_pages)``: the cache pages of each batch entry, in order.
        Entries past a sequence's used pages are ignored (they may hold any value, e.g. -1).
      seqused_k: int32 ``(B,)``: the number of valid keys of each batch entry, in
        ``[0, max_pages * page_size]`` (a run-time value: it never retraces).
      softmax_scale: multiplies ``q·k``; default ``1/sqrt(D)``.
      causal: bottom-right aligned to ``seqused_k``: query ``i`` sees keys up to
        ``i + seqused_k[b] - Sq``. Same as ``window_size=(left, 0)``.
      window_size: ``(left, right)``, each None or an int >= 0, aligned likewise.
      softcap: if > 0, scores become ``softcap * tanh(scores / softcap)``.
      learnable_sink: optional ``(H,)`` floating logits joining every row's denominator.
      return_lse: also return lse ``(B, H, Sq)`` float32.
      implementation: None (the Hopper kernel on an H100/H200 when it serves the call, see the
        module docstring; else the reference), ``"sm90"`` (the kernel or
        :class:`jax_fa4.ImplementationUnavailableError` saying why not) or ``"reference"``.

    Returns:
      ``out`` ``(B, Sq, H, Dv)`` in q's dtype, and with ``return_lse`` also lse ``(B, H, Sq)``.
      Rows with no visible key (e.g. ``seqused_k[b] = 0``) give 0 and lse ``-inf`` (``lse =
      sink`` with a sink).

    Forward only: differentiating through it raises ``NotImplementedError`` (see the module
    docstring). Works under ``jax.jit`` and ``jax.vmap``.
    """
    _check_paged_inputs(q, k_cache, v_cache, page_table, seqused_k)
    opts = _options(q, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                    softcap=softcap, implementation=implementation)
    learnable_sink = check_learnable_sink(learnable_sink, q.shape[2])
    route = _route(q, k_cache, v_cache, page_table, opts)
    out, lse = _paged_jit(jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache),
                          jnp.asarray(page_table), jnp.asarray(seqused_k), learnable_sink, opts,
                          route)
    return (out, lse) if return_lse else out


def _route(q, k_cache, v_cache, page_table, opts) -> tuple:
    """("kernel", config) or ("reference", pages_per_block) (see _paged_reference)."""
    if opts.implementation != "reference":
        config = kernel_config(q, k_cache, v_cache, opts)
        if not isinstance(config, str):
            return ("kernel", config)
        if opts.forced:
            raise ImplementationUnavailableError(
                f"implementation={opts.implementation!r} cannot run this paged KV attention "
                f"call: {config}")
        ops.reference_fallback("paged KV attention", opts.implementation, config)
    page_size, max_pages = k_cache.shape[1], page_table.shape[1]
    return ("reference", None if max_pages * page_size <= _DENSE_MAX_KEYS
            else max(1, _SPLIT_KEYS // page_size))
