"""The FP8 forward's in-kernel V transpose, as plain integers: which shared-memory bytes each
lane of the producer warpgroup reads and writes (no ``cutlass``: the kernel evaluates it at trace
time, the lane bases with the lane and warp as run-time integers; tests/test_v_transpose.py
checks it in NumPy).

The P·V WGMMA of the e4m3 forward reads V K-major, (Dv, tile_n) with the keys contiguous, in the
key order of P's register fragment (fwd_config.fp8_value_permutation: operand column l of each
group of 32 keys holds key perm[l]). TMA brings V as stored, (tile_n, Dv) with the dims
contiguous, into a staging stage; the producer warpgroup's four warps turn each staged tile into
the operand's layout with three warp instructions per 512 bytes:

* ``ldmatrix.x4.trans`` (b16): four 8×8 matrices of 16-bit elements, each 8 keys (rows of the
  staged tile) × 16 dims (one 16-byte chunk). Transposed, lane t = 4·r + c of a matrix of keys
  k0..k0+7 receives keys k0 + 2c and k0 + 2c + 1 at dims 2r and 2r + 1: bytes (key 2c, dim 2r),
  (2c, 2r + 1), (2c + 1, 2r), (2c + 1, 2r + 1). A "pair" of matrices holds keys 16h..16h + 7 and
  16h + 8..16h + 15 of one chunk: lane t then has, for dims 2r and 2r + 1, keys 16h + {2c,
  2c + 1, 2c + 8, 2c + 9}: exactly the four keys perm puts at operand columns 16h + 4c .. + 3.
* two ``prmt`` per pair make the two output words, dim 2r (selector 0x6420) and dim 2r + 1
  (0x7531), bytes in column order.
* ``stmatrix.x4`` (b16, not transposed) writes them: row r of a matrix is the 16 keys of the half
  at one dim, its 4 words from lanes 4r .. 4r + 3. Lanes 16..31 (r >= 4) swap their two words
  (their selectors are swapped), so that each stored matrix holds dims 2r + (r >= 4) (or the
  other parity): 8 dims with distinct residues mod 8, which keeps every swizzled layout
  bank-conflict free (plain 2r would put dims d and d + 8, one bank group, in one phase).

Work: a pair is 16 keys × 16 dims; one warp instruction moves two pairs, the key halves 2o and
2o + 1 of one dim chunk q. Warp w of the four takes the chunks q = w + 4c (c < Dv / 64) and, for
each, every pair of key halves o < tile_n / 32: an even split, Dv / 64 · tile_n / 32 instructions
per warp and tile. Addresses are (lane base ^ X) + C, X and C compile-time constants of the
instruction (the lane base holds the swizzle's row-dependent part): the reads step along the
keys, whole swizzle periods (C only, an immediate offset); the writes step along the keys of a
Vt row, inside its swizzle atom (one XOR, none where the atom is 32 bytes wide).

Keys past a sequence (varlen, paged): in the highest key block the staged rows past the keys
hold whatever the memory had (the next sequence, a page's unused slots: NaN possibly, and P = 0
does not cancel a NaN in P·V). Each lane knows which keys its bytes hold: byte j of both words of
a pair is key 16h + 2c + WORD_KEYS[j] (c = lane % 4, h the pair's key half). Those of keys >=
the block's valid count are cleared in registers after the prmt (:meth:`VTransposePlan.
key_mask`: an AND mask per pair from four comparisons with compile-time thresholds) before
stmatrix: no pass over shared memory, no barrier.

Both layouts are jax_fa4.kernels.sm90.common.make_smem_layout tiles of 8-bit elements (rows x
cols, cols contiguous, swizzle atoms of 8 rows x W bytes, W the widest of 128 / 64 / 32 dividing
cols, tiled rows first): byte (row, col) of a stage is ``swizzle((col // W)·rows·W + row·W +
col % W)``, where the swizzle XORs the 16-byte chunk bits (4 .. 3 + log2(W/16)) with bits 7 ..
6 + log2(W/16). :func:`smem_offset` is that formula; the kernel checks it against CuTe's layouts
while it traces.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Warps of the producer warpgroup that transpose (all four; warp 0 also issues the TMA loads).
TRANSPOSE_WARPS = 4
#: Lanes of a warp.
LANES = 32
#: prmt selectors of a pair's two output words: dim 2r (even bytes of both matrices' words) and
#: dim 2r + 1 (odd bytes), each in key (column) order.
SELECT_EVEN_DIM = 0x6420
SELECT_ODD_DIM = 0x7531
#: The keys of a pair's output words, byte by byte, relative to the pair's first key plus
#: 2·(lane % 4): both words (two dims) hold the same four keys.
WORD_KEYS = (0, 1, 8, 9)


def swizzle_width(cols: int) -> int:
    """W, the byte width of the swizzle atom make_smem_layout picks for ``cols`` 8-bit columns."""
    for width in (128, 64, 32):
        if cols % width == 0:
            return width
    raise ValueError(f"{cols} one-byte columns have no swizzled layout (a multiple of 32)")


def smem_offset(rows: int, cols: int, row: int, col: int) -> int:
    """Byte offset of (row, col) in one stage of a (rows, cols) 8-bit make_smem_layout tile."""
    width = swizzle_width(cols)
    linear = (col // width) * rows * width + row * width + col % width
    mask = width // 16 - 1
    return linear ^ (((linear >> 7) & mask) << 4)


@dataclass(frozen=True)
class VTransposePlan:
    """Who moves which bytes of one (tile_n, Dv) staged V tile into the (Dv, tile_n) operand."""

    tile_n: int
    head_dim_v: int

    def __post_init__(self) -> None:
        if self.tile_n % 32 or self.head_dim_v % (16 * TRANSPOSE_WARPS):
            raise ValueError(f"the V transpose needs tile_n a multiple of 32 and head_dim_v of "
                             f"{16 * TRANSPOSE_WARPS}, got {self.tile_n} and {self.head_dim_v}")

    @property
    def chunks(self) -> int:
        """Dim chunks (16 dims) per warp: c < Dv / 64."""
        return self.head_dim_v // (16 * TRANSPOSE_WARPS)

    @property
    def half_pairs(self) -> int:
        """Key-half pairs (32 keys) per chunk: o < tile_n / 32."""
        return self.tile_n // 32

    @property
    def instructions(self) -> int:
        """ldmatrix (and stmatrix) instructions per warp and tile."""
        return self.chunks * self.half_pairs

    # -- one instruction, one lane ----------------------------------------------------------------
    def chunk(self, warp: int, c: int) -> int:
        """The 16-dim chunk q of warp ``warp``'s ``c``-th chunk."""
        return warp + TRANSPOSE_WARPS * c

    def read_row(self, lane: int, o: int) -> int:
        """The key whose 16 staged bytes lane ``lane`` addresses in ldmatrix ``o`` of a chunk:
        matrix lane // 8 = (pair, half) = (lane // 16, lane // 8 % 2), row lane % 8."""
        return 16 * (2 * o + lane // 16) + 8 * (lane // 8 % 2) + lane % 8

    def write_row(self, lane: int, q: int) -> tuple[int, int]:
        """(dim, first key column) of the 16 Vt bytes lane ``lane`` addresses in a stmatrix of
        chunk ``q`` and key halves (2o, 2o + 1), minus 16·2o on the key column: matrix lane // 8
        = (pair lane // 16, parity lane // 8 % 2), row r = lane % 8 holds dim 2r + (parity ^
        (r >= 4))."""
        r = lane % 8
        parity = (lane // 8 % 2) ^ (r >> 2)  # (r >> 2: r >= 4, in integer arithmetic)
        return 16 * q + 2 * r + parity, 16 * (lane // 16)

    def read_offset(self, warp: int, c: int, o: int, lane: int) -> int:
        """Byte offset in a staged stage (tile_n, Dv) of lane ``lane``'s ldmatrix row."""
        return smem_offset(self.tile_n, self.head_dim_v, self.read_row(lane, o),
                           16 * self.chunk(warp, c))

    def write_offset(self, warp: int, c: int, o: int, lane: int) -> int:
        """Byte offset in a Vt stage (Dv, tile_n) of lane ``lane``'s stmatrix row."""
        dim, col = self.write_row(lane, self.chunk(warp, c))
        return smem_offset(self.head_dim_v, self.tile_n, dim, col + 32 * o)

    @staticmethod
    def selectors(lane: int) -> tuple[int, int]:
        """prmt selectors of the lane's first and second word of a pair (swapped for r >= 4)."""
        if lane < 16:
            return SELECT_EVEN_DIM, SELECT_ODD_DIM
        return SELECT_ODD_DIM, SELECT_EVEN_DIM

    # -- keys past the sequence: the byte mask of a pair's words ------------------------------
    @staticmethod
    def pair_first_key(o: int, pair: int) -> int:
        """The first key of pair ``pair`` (0: registers 0-1, 1: registers 2-3) of key-half pair
        ``o``: the key half 2o + pair."""
        return 16 * (2 * o + pair)

    @staticmethod
    def lane_key(lane: int) -> int:
        """The lane's key offset within each key half's first 8 keys: 2·(lane % 4)."""
        return 2 * (lane % 4)

    @staticmethod
    def mask_thresholds(o: int, pair: int) -> tuple[int, ...]:
        """Byte j of pair ``pair``'s words of key-half pair ``o`` holds a key below ``valid``
        iff ``valid - lane_key(lane) > thresholds[j]`` (compile-time constants)."""
        first = VTransposePlan.pair_first_key(o, pair)
        return tuple(first + key for key in WORD_KEYS)

    @classmethod
    def key_mask(cls, lane: int, o: int, pair: int, valid: int) -> int:
        """The AND mask (unsigned 32 bits) that keeps the bytes of keys below ``valid`` in
        lane ``lane``'s two words of pair ``pair`` of key-half pair ``o``, and clears the
        rest (the kernel computes it with selects on ``valid - lane_key(lane)``)."""
        left = valid - cls.lane_key(lane)
        return sum(0xFF << (8 * j) for j, t in enumerate(cls.mask_thresholds(o, pair))
                   if left > t)

    # -- the same, split as the kernel computes it: (base ^ X) + C ---------------------------
    def read_base(self, warp: int, lane: int) -> int:
        """The lane's ldmatrix base: its row of instruction (c, o) = (0, 0)."""
        return self.read_offset(warp, 0, 0, lane)

    def read_step(self, c: int, o: int) -> tuple[int, int]:
        """(X, C) of ldmatrix (c, o): offset = (read_base ^ X) + C for every warp and lane."""
        return self._step(self.read_offset, self.read_base, c, o)

    def write_base(self, warp: int, lane: int) -> int:
        """The lane's stmatrix base: its row of instruction (c, o) = (0, 0)."""
        return self.write_offset(warp, 0, 0, lane)

    def write_step(self, c: int, o: int) -> tuple[int, int]:
        """(X, C) of stmatrix (c, o): offset = (write_base ^ X) + C for every warp and lane."""
        return self._step(self.write_offset, self.write_base, c, o)

    def _step(self, offset, base, c: int, o: int) -> tuple[int, int]:
        """(X, C) with offset(w, c, o, lane) = (base(w, lane) ^ X) + C for all w and lanes: X
        from the chunk bits (4..6) of lane 0 of warp 0, C the rest; ValueError if no such pair
        exists (the kernel would compute wrong addresses)."""
        x = (offset(0, c, o, 0) ^ base(0, 0)) & 0x70
        const = offset(0, c, o, 0) - (base(0, 0) ^ x)
        for warp in range(TRANSPOSE_WARPS):
            for lane in range(LANES):
                if offset(warp, c, o, lane) != (base(warp, lane) ^ x) + const:
                    raise ValueError(f"instruction {(c, o)} of warp {warp}, lane {lane}: its "
                                     "address is not the lane base's XOR and offset")
        return x, const
