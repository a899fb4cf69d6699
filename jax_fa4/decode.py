"""Decode-shaped calls on the training forward kernel: GQA packing and split-KV.

A decode step (a few query tokens, ``H = g·Hkv`` query heads) leaves the forward kernel almost
idle: each 128-row query tile holds ``Sq`` real rows, the ``g`` query heads of a group each
stream the same K/V, and ``B·H`` tiles may not fill the GPU. Two exact rewrites around the same
kernel call fix that:

* **GQA packing**: the ``g`` query heads of a kv head become ``g·Sq`` rows of one head, so each
  kv head's K/V is read by one tile instead of ``g``. Row ``s·g + j`` of kv head ``c`` is query
  ``s`` of head ``c·g + j``. Exact when every row sees the same keys regardless of its position:
  no mask, or ``Sq == 1`` under a causal mask (the one query sees every key).
* **split-KV**: the keys are cut into ``S`` equal chunks, each a batch entry of its own (a free
  reshape of K and V; q is repeated, it is small), so ``S`` times more tiles run at once; the
  chunks' outputs are merged with their log-sum-exps:
  ``lse = logsumexp_s lse_s``, ``out = Σ_s exp(lse_s − lse) · out_s`` (float32).
  Exact when no mask ties a key to a query position (no mask after the causal → none above).
  One rounding more than the unsplit kernel: each chunk's output comes back in the input dtype
  before the float32 merge (FA4's split kernels keep it in float32; a float32-output variant
  of the forward kernel would remove this).

``plan`` decides (static shapes only, so it never recompiles); ``run`` applies a plan around a
``kernel(q, k, v, opts) -> (out, lse)`` with the API's layouts. Speed on the H200: not yet
measured (issue #8).

On Hopper the rewritten call runs a one-warpgroup, 64-row tile instead of the 128-row training
tile when the packed rows fit it (half the GEMM work on empty rows); ``JAX_FA4_DECODE_TILE``
(read at trace time, for comparisons) selects the training tile (``0``) or a decode-tile option
under measurement (a name in ``sm90.fwd_config.DECODE_OPTIONS``, also for paged calls).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import jax
import jax.numpy as jnp

#: Query rows of one forward-kernel tile (sm90: 128 for every head dim but 64, which has 192).
TILE_ROWS = 128
#: Fewest keys per split-KV chunk: below this a chunk is too short to keep the pipeline full.
MIN_CHUNK = 1024
MAX_SPLITS = 16
#: Split until the (packed) tiles give each SM this many (read at trace time).
TILES_PER_SM = 2
#: SM count assumed when no GPU is visible at trace time (an H100 / H200).
DEFAULT_SMS = 132


def decode_tile_option() -> dict | None:
    """The Hopper decode tile serving rewritten calls, from ``JAX_FA4_DECODE_TILE``: None for
    the 128-row training tile (``0``), else overrides of the decode tile's config (``{}``: the
    shipped decode tile, ``1`` or unset; a ``DECODE_OPTIONS`` name: that option)."""
    value = os.environ.get("JAX_FA4_DECODE_TILE", "1")
    if value == "0":
        return None
    if value == "1":
        return {}
    from jax_fa4.kernels.sm90.fwd_config import DECODE_OPTIONS

    if value not in DECODE_OPTIONS:
        raise ValueError(f"JAX_FA4_DECODE_TILE must be 0, 1 or one of {sorted(DECODE_OPTIONS)}, "
                         f"got {value!r}")
    return DECODE_OPTIONS[value]



@dataclasses.dataclass(frozen=True)
class DecodePlan:
    group: int  # query heads packed into the rows of one kv head (1: no packing)
    splits: int  # key chunks (1: no split)
    window: tuple  # the window the kernel runs with: (None, None)


def num_sms() -> int:
    """SMs of the first visible GPU (a speed heuristic only: results do not depend on it)."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return DEFAULT_SMS
    return int(getattr(gpus[0], "core_count", DEFAULT_SMS) or DEFAULT_SMS) if gpus else DEFAULT_SMS


def plan(q_shape: tuple, k_shape: tuple, window: tuple, sms: int | None = None,
         key_block: int = 1) -> DecodePlan | None:
    """The rewrite for a call of these shapes, or None to run it as it is.

    ``q_shape`` (B, Sq, H, D), ``k_shape`` (B, Sk, Hkv, D), ``window`` the canonical window
    ((None, None) unmasked, (None, 0) causal). Packs when H > Hkv and all ``g·Sq`` rows fit one
    tile; splits when the (packed) tiles would not give each SM ``TILES_PER_SM``, into chunks
    of at least ``MIN_CHUNK`` keys that divide Sk into whole blocks of ``key_block`` keys (paged
    KV: a chunk is whole kernel key blocks of the page table).
    """
    b, sq, h, _ = q_shape
    _, sk, hkv, _ = k_shape
    if window == (None, 0) and sq == 1:
        window = (None, None)  # the single query sees every key
    if window != (None, None) or sq > TILE_ROWS:
        return None
    group = h // hkv if h > hkv and sq * (h // hkv) <= TILE_ROWS else 1
    tiles = b * (h // group)  # one query tile each (sq·group <= TILE_ROWS, or sq <= TILE_ROWS)
    splits = 1
    target = TILES_PER_SM * (sms or num_sms())
    blocks = sk // key_block
    while (splits * 2 <= MAX_SPLITS and tiles * splits < target and blocks % (splits * 2) == 0
           and sk // (splits * 2) >= MIN_CHUNK):
        splits *= 2
    if group == 1 and splits == 1:
        return None
    return DecodePlan(group=group, splits=splits, window=window)


def run(q: jax.Array, k: jax.Array, v: jax.Array, opts, decode_plan: DecodePlan,
        kernel: Callable) -> tuple[jax.Array, jax.Array]:
    """(out (B, Sq, H, Dv), lse (B, H, Sq)) of the call, computed by ``kernel`` on the packed,
    split problem. ``opts`` is the API's options; the kernel gets them with the plan's window."""
    b, sk, hkv, d = k.shape
    s = decode_plan.splits

    def on_packed(qp, kernel_opts):
        # every chunk is a batch entry: (B·S, Sk/S, Hkv, ·) is a free reshape of K and V
        return kernel(qp, k.reshape(b * s, sk // s, hkv, d),
                      v.reshape(b * s, sk // s, hkv, v.shape[3]), kernel_opts)

    return rewrite(q, opts, decode_plan, on_packed)


def rewrite(q: jax.Array, opts, decode_plan: DecodePlan, on_packed: Callable
            ) -> tuple[jax.Array, jax.Array]:
    """Apply a plan around ``on_packed(qp, kernel_opts) -> (out, lse)``, which attends the
    packed, repeated queries qp ``(B·S, Sq·g, H/g, D)`` (entry ``b·S + s`` is batch entry b's
    query rows for key chunk s) to chunk s of batch entry b's keys, and returns
    ``out (B·S, Sq·g, H/g, Dv)``, ``lse (B·S, H/g, Sq·g)``. Returns the call's
    ``(out (B, Sq, H, Dv), lse (B, H, Sq))``: chunks merged by their lse in float32."""
    b, sq, h, d = q.shape
    g, s = decode_plan.group, decode_plan.splits
    heads = h // g
    # (B, Sq, Hkv·g, D) -> (B, Sq·g, Hkv, D): row s·g + j of kv head c is head c·g + j
    qp = q.reshape(b, sq, heads, g, d).transpose(0, 1, 3, 2, 4).reshape(b, sq * g, heads, d)
    rows = sq * g
    if s > 1:  # q repeated per chunk
        qp = jnp.broadcast_to(qp[:, None], (b, s, rows, heads, d)).reshape(b * s, rows, heads, d)
    out, lse = on_packed(qp, dataclasses.replace(opts, window=decode_plan.window))
    dv = out.shape[-1]
    if s > 1:
        out = out.reshape(b, s, rows, heads, dv)
        lse = lse.reshape(b, s, heads, rows)
        lse_all = jax.nn.logsumexp(lse, axis=1)  # (B, Hkv, rows); -inf if no chunk saw a key
        weight = jnp.where(jnp.isneginf(lse_all)[:, None], 0.0,
                           jnp.exp(lse - lse_all[:, None]))  # (B, S, Hkv, rows)
        out = jnp.einsum("bshr,bsrhd->brhd", weight, out.astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST).astype(q.dtype)
        lse = lse_all
    # back to the API's layouts
    out = out.reshape(b, sq, g, heads, dv).transpose(0, 1, 3, 2, 4).reshape(b, sq, h, dv)
    lse = lse.reshape(b, heads, sq, g).transpose(0, 1, 3, 2).reshape(b, h, sq)
    return out, lse
