"""The column layout of the segment-id tables the kernels with segment ids read
(``FwdConfig.segments``, ``BwdConfig.segments``; built by :mod:`jax_fa4.segments`).

Importable without the compiler (config modules and the JAX side read it). One row of 8 int32
(32 bytes) per query tile, 4 per query row, 8 per key block (backward).
"""

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
