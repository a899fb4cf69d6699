"""Ring attention: context parallelism for :func:`jax_fa4.flash_attention` inside ``shard_map``.

Each of the ``n`` devices along ``axis_name`` holds one block of the sequence of q, k and v.
The K/V blocks travel around the ring (``jax.lax.ppermute`` to the next device) while each
device attends its queries to the block it holds; the partial outputs are merged with their
log-sum-exps. Every block is one :func:`jax_fa4.flash_attention` call (``return_lse=True``), so
the GPU kernels run on GPUs and the reference elsewhere. The backward passes the K/V blocks
around the ring again, together with their dK/dV accumulators, which end on their owner after
one last hop.

Layouts (how the global sequence is split into the per-device blocks):

- non-causal: any split works (attention is invariant to the order of the keys); the usual one
  is contiguous, device ``i`` holding tokens ``[i * S/n, (i+1) * S/n)``.
- ``causal=True, layout="zigzag"`` (default, balanced): the sequence is cut into ``2n`` chunks
  of ``S / (2n)`` tokens and device ``i`` holds chunks ``i`` and ``2n - 1 - i``, in that order.
  Every device then does the same work at every step (a causal diagonal at step 0, half a full
  block afterwards). :func:`zigzag` permutes a naturally ordered sequence into this layout so
  that a contiguous split (``PartitionSpec(None, axis_name)``) gives each device its two
  chunks; :func:`unzigzag` undoes it. Position-dependent inputs (RoPE positions, targets) must be
  permuted the same way: ``zigzag(jnp.arange(S), n, axis=0)``.
- ``causal=True, layout="contiguous"``: device ``i`` holds ``[i * S/n, (i+1) * S/n)``; simpler,
  but device ``i`` has ``i + 1`` blocks of work and the last device sets the pace.

Causal ring attention needs self-attention blocks: the local Sq equals the local Sk (and is even
for the zigzag layout). GQA/MQA, ``softmax_scale``, ``softcap`` and segment ids (packed rows:
each device's block carries its tokens' ids, the key ids travel around the ring with K/V) are
supported; sliding windows are not.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_fa4 import api, autodiff, options
from jax_fa4.parallel.manual_axes import vary_like

__all__ = ["LAYOUTS", "ring_attention", "unzigzag", "zigzag", "zigzag_indices"]

LAYOUTS = ("zigzag", "contiguous")


# -- layout helpers ----------------------------------------------------------------------------
def zigzag_indices(seq_len: int, num_shards: int) -> np.ndarray:
    """Positions of the natural sequence in zigzag order: ``x_zigzag = x[..., idx, ...]``.

    Args:
        seq_len: global sequence length, a multiple of ``2 * num_shards``.
        num_shards: devices along the ring axis.

    Raises:
        ValueError: if ``seq_len`` is not a multiple of ``2 * num_shards``.
    """
    if num_shards < 1 or seq_len % (2 * num_shards):
        raise ValueError(f"the zigzag layout needs seq_len ({seq_len}) to be a multiple of "
                         f"2 * num_shards (2 * {num_shards})")
    c = seq_len // (2 * num_shards)
    chunks = [j for i in range(num_shards) for j in (i, 2 * num_shards - 1 - i)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks])


def zigzag(x: jax.Array, num_shards: int, *, axis: int = 1) -> jax.Array:
    """Permute the sequence ``axis`` of ``x`` from natural order into the zigzag layout."""
    return jnp.take(x, zigzag_indices(x.shape[axis], num_shards), axis=axis)


def unzigzag(x: jax.Array, num_shards: int, *, axis: int = 1) -> jax.Array:
    """Inverse of :func:`zigzag`: back to natural order."""
    return jnp.take(x, np.argsort(zigzag_indices(x.shape[axis], num_shards)), axis=axis)


# -- configuration -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Ring:
    axis_name: Any
    causal: bool
    layout: str
    full: options.AttentionOptions  # options of a block without mask
    diagonal: options.AttentionOptions  # options of the step-0 block (causal when causal)
    segments: bool = False  # segment ids given (q_ids and kv_ids ride along)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis_name: Any,
    causal: bool = False,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    layout: str = "zigzag",
    return_lse: bool = False,
    deterministic: bool = False,
    implementation: str | None = None,
    segment_ids: Any = None,
    padding_segment_id: int | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention over a sequence split along the mesh axis ``axis_name``; call inside
    :func:`jax.shard_map`.

    Args:
      q: this device's queries ``(B, Sq_local, H, D)``.
      k: this device's keys ``(B, Sk_local, Hkv, D)``.
      v: this device's values ``(B, Sk_local, Hkv, Dv)``.
      axis_name: the mesh axis (or tuple of axes) the sequence is split over.
      causal: causal attention over the global sequence (needs ``Sq_local == Sk_local``).
      softmax_scale: default ``1/sqrt(D)``.
      softcap: as in :func:`jax_fa4.flash_attention`.
      layout: how the global sequence is split when causal: ``"zigzag"`` (balanced, see
        :func:`zigzag`) or ``"contiguous"``. Ignored when not causal.
      return_lse: also return this device's rows of the global log-sum-exp ``(B, H, Sq_local)``.
      deterministic: as in :func:`jax_fa4.flash_attention` (the ring's own accumulation order is
        fixed, so this only concerns the kernels of each block).
      implementation: as in :func:`jax_fa4.flash_attention`.
      segment_ids: this device's segment ids, ``(B, S_local)`` (its tokens', sharded like q)
        or a pair ``(q_segment_ids, kv_segment_ids)``, in the layout of q and k (zigzag when
        causal with that layout: permute them with :func:`zigzag` too). Token ``i`` sees key
        ``j`` only if their ids are equal, as in :func:`jax_fa4.flash_attention`; the key
        ids travel around the ring with their K/V block.
      padding_segment_id: as in :func:`jax_fa4.flash_attention`.

    Returns:
      this device's rows of the output ``(B, Sq_local, H, Dv)`` (and the lse with
      ``return_lse``), equal to the rows of unsplit attention over the global sequence.

    Differentiable; the backward is a second ring pass (see the module docstring).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    kw = dict(softmax_scale=softmax_scale, window_size=(None, None), softcap=softcap,
              deterministic=deterministic, implementation=implementation)
    full = options.canonicalize(q, k, v, causal=False, **kw)
    diagonal = options.canonicalize(q, k, v, causal=causal, **kw)
    if causal:
        if q.shape[1] != k.shape[1]:
            raise ValueError("causal ring_attention needs self-attention blocks: q and k must "
                             f"have the same local length, got {q.shape[1]} and {k.shape[1]}")
        if layout == "zigzag" and q.shape[1] % 2:
            raise ValueError("the zigzag layout holds two chunks per device: the local length "
                             f"must be even, got {q.shape[1]} (see jax_fa4.parallel.ring.zigzag)")
    ids = options.check_segment_ids(segment_ids, q, k, padding_segment_id)
    cfg = _Ring(axis_name, bool(causal), layout, full, diagonal, ids is not None)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if ids is None:
        out, lse = _ring(q, k, v, (), cfg)
    else:
        out, lse = _ring(q, k, v, ids, cfg)
    return (out, lse) if return_lse else out


# -- the ring ----------------------------------------------------------------------------------
def _ring_size_and_index(axis_name) -> tuple[int, jax.Array]:
    return lax.axis_size(axis_name), lax.axis_index(axis_name)


def _shift(xs, axis_name, n: int):
    """Send every array to the next device along the ring (device i -> i + 1 mod n)."""
    return lax.ppermute(xs, axis_name, perm=[(i, (i + 1) % n) for i in range(n)])


def _merge(out, lse, block_out, block_lse):
    """Combine two partial softmax results by their lse (rows with lse -inf weigh 0, no NaN)."""
    new_lse = jnp.logaddexp(lse, block_lse)
    ref = jnp.where(jnp.isneginf(new_lse), 0.0, new_lse)
    w_old = jnp.exp(lse - ref).transpose(0, 2, 1)[..., None]  # (B, Sq, H, 1)
    w_new = jnp.exp(block_lse - ref).transpose(0, 2, 1)[..., None]
    return w_old * out + w_new * block_out.astype(jnp.float32), new_lse


def _attend(q, k, v, opts, ids=()):
    """(out, lse) of one block; ``ids``: () or (q_ids, kv_ids) of the block's tokens."""
    return api.flash_attention(q, k, v, softmax_scale=opts.softmax_scale,
                               causal=opts.causal, softcap=opts.softcap, return_lse=True,
                               deterministic=opts.deterministic,
                               segment_ids=tuple(ids) if ids else None,
                               implementation=opts.implementation if opts.forced else None)


def _nothing(q, kb, vb):
    """(out, lse) of a block with no visible key: zeros and -inf."""
    b, s, h, _ = q.shape
    return vary_like((jnp.zeros((b, s, h, vb.shape[3]), q.dtype),
                       jnp.full((b, h, s), -jnp.inf, jnp.float32)), q, kb, vb)


def _pair(q_ids, kv_ids, q_rows=slice(None), k_rows=slice(None)) -> tuple:
    """(q_ids, kv_ids) of a block's query and key rows; () without segment ids."""
    return () if q_ids is None else (q_ids[:, q_rows], kv_ids[:, k_rows])


def _block_forward(q, kb, vb, q_ids, kv_ids, step: int, src, me, cfg: _Ring):
    """(out, lse) of this device's queries against the K/V block of device ``src`` (with the
    block's key ids ``kv_ids`` when there are segment ids, else None)."""
    if step == 0:
        return _attend(q, kb, vb, cfg.diagonal, _pair(q_ids, kv_ids))
    if not cfg.causal:
        return _attend(q, kb, vb, cfg.full, _pair(q_ids, kv_ids))
    if cfg.layout == "contiguous":  # a block from before is fully visible, one from after not
        return lax.cond(src < me, lambda: _attend(q, kb, vb, cfg.full, _pair(q_ids, kv_ids)),
                        lambda: _nothing(q, kb, vb))
    c = q.shape[1] // 2

    def earlier():  # src < me: both query chunks see the first key chunk, none the second
        return _attend(q, kb[:, :c], vb[:, :c], cfg.full,
                       _pair(q_ids, kv_ids, k_rows=slice(None, c)))

    def later():  # src > me: only the second query chunk sees keys, and it sees all of them
        o, l = _attend(q[:, c:], kb, vb, cfg.full, _pair(q_ids, kv_ids, q_rows=slice(c, None)))
        o0, l0 = _nothing(q[:, :c], kb, vb)
        return jnp.concatenate([o0, o], axis=1), jnp.concatenate([l0, l], axis=2)

    return lax.cond(src < me, earlier, later)


def _forward(q, k, v, ids, cfg: _Ring):
    n, me = _ring_size_and_index(cfg.axis_name)
    out = jnp.zeros((*q.shape[:3], v.shape[3]), jnp.float32)
    lse = jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, jnp.float32)
    q_ids, kv_ids = ids if ids else (None, None)
    blocks = (k, v) + ((kv_ids,) if ids else ())  # the key ids ride with their K/V
    for step in range(n):
        if step + 1 < n:  # start the next hop before computing, so they can overlap
            nxt = _shift(blocks, cfg.axis_name, n)
        kb, vb, *kv_b = blocks
        block_out, block_lse = _block_forward(q, kb, vb, q_ids, kv_b[0] if kv_b else None,
                                              step, (me - step) % n, me, cfg)
        out, lse = _merge(out, lse, block_out, block_lse)
        if step + 1 < n:
            blocks = nxt
    return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ring(q, k, v, ids, cfg: _Ring):
    return _forward(q, k, v, ids, cfg)


def _ring_fwd(q, k, v, ids, cfg: _Ring):
    out, lse = _forward(q, k, v, ids, cfg)
    return (out, lse), (q, k, v, ids, out, lse)


def _block_backward(q, kb, vb, out, lse, dout, dlse, q_ids, kv_ids, step: int, src, me,
                    cfg: _Ring):
    """(dq, dk, dv) contributions of this device's queries and the K/V block of ``src``."""

    def grads(q, kb, vb, out, lse, dout, dlse, opts, ids=()):
        if ids:  # the shard-local backward with segment ids (kernel or reference)
            return autodiff.extras_backward_impl(False, True)(
                q, kb, vb, out, lse, dout, dlse, *ids, opts)[:3]
        # the library's backward: preprocess, then dq/dk/dv (delta unused)
        return autodiff.backward_chain(q, kb, vb, out, lse, dout, dlse, opts)[:3]

    args = (q, kb, vb, out, lse, dout, dlse)
    if step == 0:
        return grads(*args, cfg.diagonal, _pair(q_ids, kv_ids))
    if not cfg.causal:
        return grads(*args, cfg.full, _pair(q_ids, kv_ids))
    zeros = lambda: vary_like([jnp.zeros(x.shape, x.dtype) for x in (q, kb, vb)],  # noqa: E731
                                *args)
    if cfg.layout == "contiguous":
        return lax.cond(src < me, lambda: grads(*args, cfg.full, _pair(q_ids, kv_ids)), zeros)
    c = q.shape[1] // 2

    def earlier():  # every query sees the first key chunk
        dq, dk, dv = grads(q, kb[:, :c], vb[:, :c], out, lse, dout, dlse, cfg.full,
                           _pair(q_ids, kv_ids, k_rows=slice(None, c)))
        pad = lambda x: jnp.concatenate([x, jnp.zeros_like(x)], axis=1)  # noqa: E731
        return dq, pad(dk), pad(dv)

    def later():  # the second query chunk sees every key
        dq, dk, dv = grads(q[:, c:], kb, vb, out[:, c:], lse[..., c:], dout[:, c:],
                           dlse[..., c:], cfg.full, _pair(q_ids, kv_ids, q_rows=slice(c, None)))
        return jnp.concatenate([jnp.zeros_like(dq), dq], axis=1), dk, dv

    return lax.cond(src < me, earlier, later)


def _ring_bwd(cfg: _Ring, residuals, cotangents):
    q, k, v, ids, out, lse = residuals
    dout, dlse = cotangents
    n, me = _ring_size_and_index(cfg.axis_name)
    dq = jnp.zeros(q.shape, jnp.float32)
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    q_ids, kv_ids = ids if ids else (None, None)
    kb, vb = k, v
    for step in range(n):
        if step > 0:  # the K/V block moves on with the dK/dV accumulated for it so far
            moved = _shift((kb, vb, dk, dv) + ((kv_ids,) if ids else ()), cfg.axis_name, n)
            kb, vb, dk, dv = moved[:4]
            kv_ids = moved[4] if ids else None
        dq_b, dk_b, dv_b = _block_backward(q, kb, vb, out, lse, dout, dlse, q_ids, kv_ids,
                                           step, (me - step) % n, me, cfg)
        dq = dq + dq_b.astype(jnp.float32)
        dk = dk + dk_b.astype(jnp.float32)
        dv = dv + dv_b.astype(jnp.float32)
    dk, dv = _shift((dk, dv), cfg.axis_name, n)  # the last hop brings them home
    no_ids = None if not ids else tuple(None for _ in ids)  # integer ids: no cotangent
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), no_ids


_ring.defvjp(_ring_fwd, _ring_bwd)
