"""Segment ids as tables the kernels read: no (Sq × Sk) mask anywhere.

Query ``i`` sees key ``j`` only if ``q_ids[i] == kv_ids[j]`` (on top of causal / window). The
kernels never compare ids key by key where they need not: for each query row,
:func:`row_spans` finds the span of keys carrying its id, ``[first, last + 1)``, and whether
that span holds its id only (a *contiguous* run: packed documents). A row then sees exactly
the keys of its span, a window-like bound the kernels apply per row as they apply causal and
sliding windows. For each query tile, :func:`tile_table` derives the key blocks any of its rows
sees (the rest are skipped, not masked) and the bulk of them every row sees whole (no mask at
all); a tile holding a row whose id is not one contiguous run is flagged, and the kernel then
compares ids key by key in its masked blocks (its bulk is empty): exact for any ids.

Two ways to the spans, both traced under ``jax.jit`` with the ids (a new packing never
recompiles), neither with a loop:

* ``Sq == Sk`` (self-attention, the packed-training case; :func:`run_spans`): O(S) scans, no
  sort. Each token's run of equal ids; a batch row whose runs each hold a different id (ids
  increasing from run to run, padding ignored: packing's layout) and whose query and key ids
  agree takes the runs as exact spans. Any other row stays exact through the key-by-key
  compare: its rows' spans become the key blocks whose id range meets the tile's (a superset
  of the blocks holding the row's id) and its tiles are flagged.
* otherwise (:func:`row_spans`): O(S log S), three sorts: the first and last key of each id.

(XLA's sorts of a few thousand ids per row cost about 0.15 ms per call on the H200: measured
with benchmarks/segments_bench.py, in benchmarks/results/
segments-traced-sorted-tables-nvidia-h200-2026-12-03.json against
segments-traced-nvidia-h200-2026-12-03.json.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_fa4.kernels import segments_config as _cols

#: The ids a padding segment id becomes (``flash_attention(padding_segment_id=...)``): queries
#: and keys get two values no other token may hold, so padding attends to nothing and no query
#: sees padding.
PADDING_Q_ID = int(jnp.iinfo(jnp.int32).min)
PADDING_KV_ID = PADDING_Q_ID + 1


def row_spans(q_ids: jax.Array, kv_ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each query row's key span and whether its id is one contiguous run of the keys.

    Args:
        q_ids: (B, Sq) int32 segment ids of the queries.
        kv_ids: (B, Sk) int32 segment ids of the keys.

    Returns:
        ``(start, end, contiguous)``, each (B, Sq): ``[start, end)`` from the first key with
        the row's id to one past the last (``(0, 0)`` when no key has it), int32; and whether
        every key of that span has the row's id (True for an empty span).
    """
    def one(qi, ki):
        perm = jnp.argsort(ki, stable=True)  # equal ids keep their positions' order
        sorted_ids = ki[perm]
        # method "sort": one sort, no loop (the default bisects in a while loop, which on a
        # GPU waits on the host every iteration: 0.2-0.4 ms per call, in benchmarks/results/:
        # segments-scan-nvidia-h200-2026-12-03.json against segments-nvidia-h200-2026-12-03.json)
        lo = jnp.searchsorted(sorted_ids, qi, side="left", method="sort")
        hi = jnp.searchsorted(sorted_ids, qi, side="right", method="sort")
        count = (hi - lo).astype(jnp.int32)
        has = count > 0
        last_index = ki.shape[0] - 1
        first = perm[jnp.minimum(lo, last_index)].astype(jnp.int32)
        last = perm[jnp.clip(hi - 1, 0, last_index)].astype(jnp.int32)
        start = jnp.where(has, first, 0)
        end = jnp.where(has, last + 1, 0)
        return start, end, end - start == count

    return jax.vmap(one)(q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32))


def _ceil_div(x, n: int):
    return (x + n - 1) // n


def _blocks(x, size: int, fill):
    """(B, S) -> (B, ceil(S / size), size), the tail padded with ``fill``."""
    b, s = x.shape
    n = _ceil_div(s, size)
    return jnp.pad(x, ((0, 0), (0, n * size - s)), constant_values=fill).reshape(b, n, size)


def run_spans(q_ids: jax.Array, kv_ids: jax.Array, tile_m: int, tile_n: int
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`row_spans`' contract for ``Sq == Sk`` in O(S) scans (no sort; module doc).

    A batch row is *packed* when its query and key ids agree (padding: ``PADDING_Q_ID`` /
    ``PADDING_KV_ID`` at the same places) and no id comes back after another run (each
    non-padding token continues its predecessor's run or has an id above every earlier one).
    Its rows' spans are then their runs, exactly, contiguous (padding queries: empty). In any
    other batch row, each row's span covers the key blocks whose [min, max] id range meets its
    ``tile_m`` query tile's (with ``tile_n`` keys per block), not contiguous: the kernels then
    compare ids key by key there, still exact."""
    b, s = q_ids.shape
    i32 = jnp.int32
    idx = jnp.arange(s, dtype=i32)
    lowest = jnp.iinfo(i32).min
    pad_q = q_ids == PADDING_Q_ID
    pad_k = kv_ids == PADDING_KV_ID
    # runs: [run_start, run_end) of equal ids around each token
    new_run = jnp.concatenate([jnp.ones((b, 1), bool), q_ids[:, 1:] != q_ids[:, :-1]], axis=1)
    last_of_run = jnp.concatenate([new_run[:, 1:], jnp.ones((b, 1), bool)], axis=1)
    run_start = jax.lax.cummax(jnp.where(new_run, idx, 0), axis=1)
    run_end = jax.lax.cummin(jnp.where(last_of_run, idx + 1, s), axis=1, reverse=True)
    # packed rows: ids agree, and every id is one run
    agree = (q_ids == kv_ids) | (pad_q & pad_k)
    seen_max = jax.lax.cummax(jnp.where(pad_q, lowest, q_ids), axis=1)
    before = jnp.concatenate([jnp.full((b, 1), lowest, i32), seen_max[:, :-1]], axis=1)
    continues = jnp.concatenate(
        [jnp.zeros((b, 1), bool), ~pad_q[:, :-1] & ~new_run[:, 1:]], axis=1)
    packed = (agree & (pad_q | continues | (q_ids > before))).all(axis=1, keepdims=True)
    # other rows: the key blocks whose id range meets the query tile's
    big = jnp.iinfo(i32).max
    q_lo = _blocks(jnp.where(pad_q, big, q_ids), tile_m, big).min(-1)  # (B, Mb)
    q_hi = _blocks(jnp.where(pad_q, lowest, q_ids), tile_m, lowest).max(-1)
    k_lo = _blocks(jnp.where(pad_k, big, kv_ids), tile_n, big).min(-1)  # (B, Nb)
    k_hi = _blocks(jnp.where(pad_k, lowest, kv_ids), tile_n, lowest).max(-1)
    meets = (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
    n_blocks = meets.shape[2]
    any_block = meets.any(axis=2)
    first = jnp.argmax(meets, axis=2).astype(i32)
    last = (n_blocks - jnp.argmax(meets[:, :, ::-1], axis=2)).astype(i32)
    tile_of = idx // tile_m
    wide_start = jnp.where(any_block, first * tile_n, 0)[:, tile_of]
    wide_end = jnp.where(any_block, jnp.minimum(last * tile_n, s), 0)[:, tile_of]
    start = jnp.where(pad_q, 0, jnp.where(packed, run_start, wide_start)).astype(i32)
    end = jnp.where(pad_q, 0, jnp.where(packed, run_end, wide_end)).astype(i32)
    return start, end, packed | pad_q


def spans(q_ids: jax.Array, kv_ids: jax.Array, tile_m: int, tile_n: int
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(start, end, contiguous) for the tables: :func:`run_spans` when ``Sq == Sk``, else
    :func:`row_spans`."""
    if q_ids.shape[1] == kv_ids.shape[1]:
        return run_spans(q_ids, kv_ids, tile_m, tile_n)
    return row_spans(q_ids, kv_ids)


def tile_table(start: jax.Array, end: jax.Array, contiguous: jax.Array, tile_m: int,
               tile_n: int) -> jax.Array:
    """The per-query-tile table of the kernels (columns ``SEG_*`` of
    :mod:`jax_fa4.kernels.segments_config`), (B, ceil(Sq / tile_m), 8) int32.

    For the rows ``[m·tile_m, (m+1)·tile_m) ∩ [0, Sq)`` of tile m, from :func:`row_spans`:

    * ``[n_lo, n_hi)``: the key blocks (of ``tile_n`` keys) some row's span meets; (0, 0) when
      every span is empty;
    * ``[bulk_lo, bulk_hi)``, inside it: the blocks every row's span covers whole, when every
      row of the tile is non-empty and contiguous (else empty: ``bulk_lo = bulk_hi = n_hi``);
    * ``ids``: 1 when some row is not contiguous (its blocks compare ids key by key).
    """
    b, sq = start.shape
    m_blocks = _ceil_div(sq, tile_m)
    big = jnp.iinfo(jnp.int32).max

    def tiles(x, fill):
        return _blocks(x, tile_m, fill)

    nonempty = end > start
    # key blocks any row meets (empty rows ignored)
    first_key = tiles(jnp.where(nonempty, start, big), big).min(-1)
    last_key = tiles(jnp.where(nonempty, end, 0), 0).max(-1)
    any_row = last_key > 0
    n_lo = jnp.where(any_row, first_key // tile_n, 0)
    n_hi = jnp.where(any_row, _ceil_div(last_key, tile_n), 0)
    # blocks every row covers whole: [ceil(max start / tn), floor(min end / tn))
    whole = tiles(nonempty & contiguous, True).all(-1)
    bulk_lo = _ceil_div(tiles(start, 0).max(-1), tile_n)
    bulk_hi = tiles(end, big).min(-1) // tile_n
    has_bulk = whole & (bulk_hi > bulk_lo)
    bulk_lo = jnp.where(has_bulk, jnp.clip(bulk_lo, n_lo, n_hi), n_hi)
    bulk_hi = jnp.where(has_bulk, jnp.clip(bulk_hi, bulk_lo, n_hi), n_hi)
    ids = ~tiles(contiguous, True).all(-1)
    columns = {_cols.SEG_N_LO: n_lo, _cols.SEG_N_HI: n_hi, _cols.SEG_BULK_LO: bulk_lo,
               _cols.SEG_BULK_HI: bulk_hi, _cols.SEG_IDS: ids}
    zero = jnp.zeros((b, m_blocks), jnp.int32)
    return jnp.stack([columns.get(c, zero).astype(jnp.int32)
                      for c in range(_cols.SEG_TILE_COLUMNS)], axis=-1)


def row_table(start: jax.Array, end: jax.Array, q_ids: jax.Array) -> jax.Array:
    """The per-row table of the forward kernels, (B, Sq, 4) int32: span start, span end, id."""
    columns = {_cols.SEG_ROW_START: start, _cols.SEG_ROW_END: end, _cols.SEG_ROW_ID: q_ids}
    zero = jnp.zeros_like(start)
    return jnp.stack([columns.get(c, zero).astype(jnp.int32)
                      for c in range(_cols.SEG_ROW_COLUMNS)], axis=-1)


@functools.partial(jax.jit, static_argnames=("tile_m", "tile_n"))
def forward_tables(q_ids: jax.Array, kv_ids: jax.Array, tile_m: int, tile_n: int
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(seg_tiles, seg_rows, kv_ids) of a forward kernel with segment ids and this tile."""
    q_ids, kv_ids = q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
    start, end, contiguous = spans(q_ids, kv_ids, tile_m, tile_n)
    return (tile_table(start, end, contiguous, tile_m, tile_n), row_table(start, end, q_ids),
            kv_ids)


@functools.partial(jax.jit, static_argnames=("tile_m", "tile_n"))
def backward_tables(q_ids: jax.Array, kv_ids: jax.Array, tile_m: int, tile_n: int
                    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(seg_tiles, seg_keys, seg_rows, kv_ids) of a backward kernel with segment ids and this
    tile (bwd_config.with_segment_tables): the forward's tile and row tables for the
    backward's tile, and per key block n the query blocks ``[m_lo, m_hi)`` whose visited range
    holds n ((0, 0) when none), (B, ceil(Sk / tile_n), 8) int32."""
    q_ids, kv_ids = q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
    start, end, contiguous = spans(q_ids, kv_ids, tile_m, tile_n)
    tiles = tile_table(start, end, contiguous, tile_m, tile_n)
    b, m_blocks = tiles.shape[:2]
    n_blocks = _ceil_div(kv_ids.shape[1], tile_n)
    n = jnp.arange(n_blocks)
    visits = ((n >= tiles[:, :, None, _cols.SEG_N_LO])
              & (n < tiles[:, :, None, _cols.SEG_N_HI]))  # (B, m_blocks, n_blocks)
    m = jnp.arange(m_blocks)[None, :, None]
    any_m = visits.any(axis=1)
    m_lo = jnp.where(any_m, jnp.where(visits, m, m_blocks).min(axis=1), 0)
    m_hi = jnp.where(any_m, jnp.where(visits, m + 1, 0).max(axis=1), 0)
    columns = {_cols.SEG_KEY_M_LO: m_lo, _cols.SEG_KEY_M_HI: m_hi}
    zero = jnp.zeros((b, n_blocks), jnp.int32)
    keys = jnp.stack([columns.get(c, zero).astype(jnp.int32)
                      for c in range(_cols.SEG_TILE_COLUMNS)], axis=-1)
    return tiles, keys, row_table(start, end, q_ids), kv_ids
