"""Row-wise tile copies for packed (varlen) and paged sequences, shared by the Hopper forward and
backward kernels: a tile's rows below a sequence's end stored to global memory, the rows past it
zeroed in shared memory (they are the next sequence's, padding tokens or unused page slots, and
may hold anything, NaN included), and the packed rows outside every sequence zeroed in global
memory. 16 bytes a thread per step.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

#: zero_rows_from: the head dim from which its loop is rolled (unrolled below)
ROLLED_FROM_DIM = 128


def row_copy(dtype, dim: int, num_threads: int, tidx: Int32):
    """A tiled copy of (rows, dim) tiles of ``dtype`` by ``num_threads`` threads, 16 bytes a
    thread per step (a power-of-two number of threads along a row), and thread tidx's slice."""
    elems = 128 // dtype.width
    per_row = math.gcd(dim // elems, 32)
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
    tiled = cute.make_tiled_copy_tv(
        atom, cute.make_ordered_layout((num_threads // per_row, per_row), order=(1, 0)),
        cute.make_layout((1, elems)))
    return tiled, tiled.get_slice(tidx)


@cute.jit
def store_rows(s_x: cute.Tensor, g_x: cute.Tensor, rows: Int32, num_threads: cutlass.Constexpr,
               tidx: Int32):
    """Copy the first ``rows`` rows of the shared-memory tile s_x to g_x (same shape): the part
    of a packed sequence's last tile inside the sequence (the rows past it are the next one's)."""
    tile = (cute.size(s_x, mode=[0]), cute.size(s_x, mode=[1]))
    tiled, thr = row_copy(s_x.element_type, tile[1], num_threads, tidx)
    t_s, t_g = thr.partition_S(s_x), thr.partition_D(g_x)
    t_c = thr.partition_D(cute.make_identity_tensor(tile))
    t_r = cute.make_fragment_like(t_s)
    cute.autovec_copy(t_s, t_r)
    for m in cutlass.range_constexpr(cute.size(t_g, mode=[1])):
        if t_c[0, m, 0][0] < rows:
            cute.copy(tiled, t_r[None, m, None], t_g[None, m, None])


@cute.jit
def zero_rows_from(s_x: cute.Tensor, first: Int32, num_threads: cutlass.Constexpr,
                   tidx: Int32):
    """Write 0 to the rows ``first`` and up of the shared-memory tile s_x (rows, dim); the
    caller fences them for WGMMA reads. It runs once per sequence (its last tile), inside
    kernels whose accumulators hold nearly every register, so it adds as few live values as it
    can: one 16-byte fragment of zeros, stored by an unrolled loop over the thread's row steps
    below head dim 128 and a rolled one from 128 on (the form that spills least at each: the
    exhaustive ``precompile --check`` found local-window varlen backward spills with the
    rolled loop at head dim 64 and with the unrolled one at head dim 128)."""
    tile = (cute.size(s_x, mode=[0]), cute.size(s_x, mode=[1]))
    tiled, thr = row_copy(s_x.element_type, tile[1], num_threads, tidx)
    t_s = thr.partition_D(s_x)
    t_c = thr.partition_D(cute.make_identity_tensor(tile))
    zeros = cute.make_fragment_like(t_s[None, 0, None])
    zeros.fill(0.0)
    if const_expr(tile[1] < ROLLED_FROM_DIM):
        for m in cutlass.range_constexpr(cute.size(t_s, mode=[1])):
            if t_c[0, m, 0][0] >= first:
                cute.copy(tiled, zeros, t_s[None, m, None])
    else:
        for m in cutlass.range(cute.size(t_s, mode=[1]), unroll=1):
            if t_c[0, m, 0][0] >= first:
                cute.copy(tiled, zeros, t_s[None, m, None])


@cute.jit
def zero_padding_rows(mX: cute.Tensor, mCuSeqlens: cute.Tensor, head: Int32,
                      tile: cutlass.Constexpr, num_threads: cutlass.Constexpr, tidx: Int32,
                      part: Int32, parts: Int32):
    """Write 0 to head ``head`` of the rows of the packed mX (total, dim, H, 1) outside every
    sequence, [0, cu_seqlens[0]) and [cu_seqlens[-1], total), a ``tile`` = (rows, dim) a step:
    the caller is worker ``part`` of ``parts`` and takes every ``parts``-th such tile (the
    output, or the gradient, of the padding tokens)."""
    tm, dim = tile
    total = mX.shape[0]
    first, last = mCuSeqlens[0], mCuSeqlens[mCuSeqlens.shape[0] - 1]
    tiled, thr = row_copy(mX.element_type, dim, num_threads, tidx)
    t_c = thr.partition_D(cute.make_identity_tensor(tile))
    zeros = cute.make_fragment_like(t_c, mX.element_type)
    zeros.fill(0.0)
    mX_h = mX[None, None, head, 0]
    for region in cutlass.range_constexpr(2):  # the tiles before first, from last on
        lo = Int32(0) if const_expr(region == 0) else last // tm
        hi = (first + tm - 1) // tm if const_expr(region == 0) else (total + tm - 1) // tm
        for t in cutlass.range(lo + part, hi, parts, unroll=1):
            t_g = thr.partition_D(cute.local_tile(mX_h, tile, (t, 0)))
            for m in cutlass.range_constexpr(cute.size(t_g, mode=[1])):
                row = t * tm + t_c[0, m, 0][0]
                if row < total and (row < first or row >= last):
                    cute.copy(tiled, zeros[None, m, None], t_g[None, m, None])
