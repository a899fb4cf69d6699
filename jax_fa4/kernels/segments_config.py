"""The column layout of the segment-id tables the kernels with segment ids read
(``FwdConfig.segments``, ``BwdConfig.segments``, ``Sm100BwdConfig.segments``; built by
:mod:`jax_fa4.segments`), and the backward kernels' call contract with them
(:func:`with_segment_tables`, shared by the Hopper and Blackwell backward).

Importable without the compiler (config modules and the JAX side read it). One row of 8 int32
(32 bytes) per query tile, 4 per query row, 8 per key block (backward).
"""

from __future__ import annotations

import dataclasses

from jax_fa4.kernels.spec import KernelSignature, TensorArg

#: Query-tile table (B, query tiles, SEG_TILE_COLUMNS): the key blocks [SEG_N_LO, SEG_N_HI)
#: the tile visits, the bulk [SEG_BULK_LO, SEG_BULK_HI) of them that every row sees whole (no
#: mask), and SEG_IDS: 1 if some row's id is not one contiguous run of the keys (masked blocks
#: then compare ids key by key).
SEG_N_LO, SEG_N_HI, SEG_BULK_LO, SEG_BULK_HI, SEG_IDS = range(5)
SEG_TILE_COLUMNS = 8

#: Row table (B, Sq, SEG_ROW_COLUMNS): the row's key span [SEG_ROW_START, SEG_ROW_END) (the
#: first and one past the last key with its id; empty if none) and its id SEG_ROW_ID.
SEG_ROW_START, SEG_ROW_END, SEG_ROW_ID = range(3)
SEG_ROW_COLUMNS = 4

#: Key-block table (B, key blocks, SEG_TILE_COLUMNS), backward: the query blocks
#: [SEG_KEY_M_LO, SEG_KEY_M_HI) a key block visits.
SEG_KEY_M_LO, SEG_KEY_M_HI = 0, 1


def with_segment_tables(sig: KernelSignature, tile_m: int, tile_n: int) -> KernelSignature:
    """A backward signature (Hopper's or Blackwell's) with the segment-id tables appended to its
    inputs: seg_tiles (B, query blocks, SEG_TILE_COLUMNS) and seg_rows (B, Sq, SEG_ROW_COLUMNS)
    as the forward's (for this tile), seg_keys (B, key blocks, SEG_TILE_COLUMNS) (the query
    blocks each key block visits) and kv_ids (B, Sk)."""
    b, sq, _, _ = sig.inputs[0].sample_shape
    sk = sig.inputs[1].sample_shape[1]
    cols = SEG_TILE_COLUMNS
    extra = (
        TensorArg("seg_tiles", "int32", (b, sq // tile_m, cols), (1, 1, cols)),
        TensorArg("seg_keys", "int32", (b, sk // tile_n, cols), (1, 1, cols)),
        TensorArg("seg_rows", "int32", (b, sq, SEG_ROW_COLUMNS), (1, 1, SEG_ROW_COLUMNS)),
        TensorArg("kv_ids", "int32", (b, sk), (1, 1)),
    )
    return dataclasses.replace(sig, inputs=(*sig.inputs, *extra))
