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
  The chunks' outputs come back in float32 where the family has float32-out decode tiles
  (``KernelBackend.kernel_sinks``; else in the input dtype, one rounding more), and the merged
  output stays float32 for the caller to join a sink and round once.

``plan`` decides (static shapes only, so it never recompiles); ``run`` applies a plan around a
``kernel(qp, k, v, opts) -> (out, lse)`` on head-major packed queries (see ``rewrite``).

Every kernel backend runs these rewrites (:meth:`jax_fa4.backends.kernel.KernelBackend.forward`
and ``paged_forward``); which tile serves the rewritten call is the backend's choice (its
``make_decode``: on Hopper a 64-row decode tile, :mod:`jax_fa4.backends.sm90`). Speed:
docs/kernels/sm90-forward.md (decode).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

#: Query rows of one forward-kernel tile (sm90: 128 for every head dim but 64, which has 192).
TILE_ROWS = 128
#: Fewest keys per split-KV chunk: below this a chunk is too short to keep the pipeline full.
MIN_CHUNK = 1024
MAX_SPLITS = 16
#: Split until the (packed) tiles give each SM this many (read at trace time). One: a split
#: costs its merge (a float32 pass over every chunk's output) and the q repeat, which a second
#: wave of tiles did not repay (B32·Sk4096: 4.09 against 3.95 TB/s at two,
#: benchmarks/results/decode-options-nvidia-h200-2026-11-30.json).
TILES_PER_SM = 1
#: SM count assumed when no GPU is visible at trace time (an H100 / H200).
DEFAULT_SMS = 132
#: Split chunks come back in float32 where the family has float32-out tiles (read at trace
#: time). False: in the input dtype, one rounding more (what ran before; benchmarks/decode_bench.py
#: compares the two in one process).
SPLIT_PARTIALS_F32 = True


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


def kernel_window(sq: int, window: tuple) -> tuple:
    """The window a call with ``sq`` query tokens runs with: one query under a causal mask sees
    every key (bottom-right aligned), so it needs no mask, and with no mask its GQA heads can
    share a tile's rows (a causal kernel would mask packed row ``j`` as query ``j``)."""
    return (None, None) if window == (None, 0) and sq == 1 else window


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
    window = kernel_window(sq, window)
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
    """(out (B, Sq, H, Dv), lse (B, H, Sq)) of the call, computed by ``kernel(qp, k, v, opts)``
    on the packed, split problem: qp head-major (B·S, H/g, Sq·g, D) (see :func:`rewrite`), k and
    v (B·S, Sk/S, Hkv, ·); it returns out head-major (B·S, H/g, Sq·g, Dv) and lse
    (B·S, H/g, Sq·g). ``opts`` is the API's options; the kernel gets them with the plan's
    window. out is float32 when split (the merge's) or when the kernel's is."""
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
    packed, repeated queries qp, head-major ``(B·S, H/g, Sq·g, D)`` (entry ``b·S + s`` is batch
    entry b's query rows for key chunk s; row ``t·g + j`` of kv head c is query t of head
    ``c·g + j``), to chunk s of batch entry b's keys, and returns out head-major
    ``(B·S, H/g, Sq·g, Dv)`` and ``lse (B·S, H/g, Sq·g)``. Returns the call's
    ``(out (B, Sq, H, Dv), lse (B, H, Sq))``: chunks merged by their lse in float32 (out stays
    float32 after a merge; the caller casts it).

    With one query token and no split, qp and the returned out are free reshapes of q and out
    (no copy runs around the kernel)."""
    b, sq, h, d = q.shape
    g, s = decode_plan.group, decode_plan.splits
    heads = h // g
    rows = sq * g
    # (B, Sq, Hkv·g, D) -> (B, Hkv, Sq·g, D); one query token: a reshape
    qp = (q.reshape(b, heads, g, d) if sq == 1 else
          q.reshape(b, sq, heads, g, d).transpose(0, 2, 1, 3, 4).reshape(b, heads, rows, d))
    if s > 1:  # q repeated per chunk
        qp = jnp.broadcast_to(qp[:, None], (b, s, heads, rows, d)).reshape(b * s, heads, rows, d)
    out, lse = on_packed(qp, dataclasses.replace(opts, window=decode_plan.window))
    dv = out.shape[-1]
    if s > 1:
        out = out.reshape(b, s, heads, rows, dv)
        lse = lse.reshape(b, s, heads, rows)
        lse_all = jax.nn.logsumexp(lse, axis=1)  # (B, Hkv, rows); -inf if no chunk saw a key
        weight = jnp.where(jnp.isneginf(lse_all)[:, None], 0.0,
                           jnp.exp(lse - lse_all[:, None]))  # (B, S, Hkv, rows)
        out = jnp.einsum("bshr,bshrd->bhrd", weight, out.astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)  # float32: the caller rounds
        lse = lse_all
    # back to the API's layouts
    out = (out.reshape(b, sq, h, dv) if sq == 1 else
           out.reshape(b, heads, sq, g, dv).transpose(0, 2, 1, 3, 4).reshape(b, sq, h, dv))
    lse = lse.reshape(b, heads, sq, g).transpose(0, 1, 3, 2).reshape(b, h, sq)
    return out, lse
