"""Helpers of both Hopper (sm_90a) backward kernels, the main kernel (bwd.py) and the dQ
postprocess (bwd_postprocess.py): the dQ GEMM whose accumulator-fragment order dq_accum holds,
shared-memory layouts, per-sequence views and row stores (varlen)."""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum


def make_smem_layout(dtype, rows: int, cols: int, major_mode_size: int, stages: int | None = None):
    """Row-major (cols contiguous) swizzled layout, usable by TMA and as a WGMMA operand, whose
    swizzle atom is at most ``major_mode_size`` columns wide (so that a transposed view split
    into ``major_mode_size``-wide slices is still a canonical MN-major WGMMA operand)."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, major_mode_size), dtype)
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def make_tiled_mma_dq(dtype, tile_m: int, head_dim: int):
    """The dQ = dS·K GEMM. Shared with the postprocess, which undoes its fragment order."""
    wm, wn = (2, 1) if tile_m == 128 else (1, 2)
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, Float32,
        (wm, wn, 1), (64, head_dim // wn))


def sequence(mX: cute.Tensor, head, batch, offset=None) -> cute.Tensor:
    """The (rows, dim) view of one head of a (S, dim, H, B) tensor: batch entry ``batch``, or
    (varlen: packed as one batch entry) the rows from ``offset`` on."""
    if const_expr(offset is None):
        return mX[None, None, head, batch]
    return cute.domain_offset((offset, 0), mX[None, None, head, 0])


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
    """Copy the first ``rows`` rows of the shared-memory tile s_x to g_x (same shape), 16 bytes
    a thread per step (varlen: the part of a tile inside its sequence)."""
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
    """Write 0 to the rows ``first`` and up of the shared-memory tile s_x (rows, dim), 16 bytes
    a thread per step (varlen: rows past a sequence, which may hold anything, NaN included; the
    caller fences them for WGMMA reads)."""
    tile = (cute.size(s_x, mode=[0]), cute.size(s_x, mode=[1]))
    tiled, thr = row_copy(s_x.element_type, tile[1], num_threads, tidx)
    t_s = thr.partition_D(s_x)
    t_c = thr.partition_D(cute.make_identity_tensor(tile))
    zeros = cute.make_fragment_like(t_s)
    zeros.fill(0.0)
    for m in cutlass.range_constexpr(cute.size(t_s, mode=[1])):
        if t_c[0, m, 0][0] >= first:
            cute.copy(tiled, zeros[None, m, None], t_s[None, m, None])


@cute.jit
def zero_padding_rows(mX: cute.Tensor, mCuSeqlens: cute.Tensor, head: Int32,
                      tile: cutlass.Constexpr, num_threads: cutlass.Constexpr, tidx: Int32):
    """Write 0 to head ``head`` of the rows of the packed mX (total, dim, H, 1) outside every
    sequence, [0, cu_seqlens[0]) and [cu_seqlens[-1], total), a ``tile`` = (rows, dim) a step
    (varlen: the gradient of the padding tokens)."""
    tm, dim = tile
    total = mX.shape[0]
    first, last = mCuSeqlens[0], mCuSeqlens[mCuSeqlens.shape[0] - 1]
    tiled, thr = row_copy(mX.element_type, dim, num_threads, tidx)
    t_c = thr.partition_D(cute.make_identity_tensor(tile))
    zeros = cute.make_fragment_like(t_c, mX.element_type)
    zeros.fill(0.0)
    mX_h = mX[None, None, head, 0]
    for part in cutlass.range_constexpr(2):  # the tiles before first, from last on
        lo = Int32(0) if const_expr(part == 0) else last // tm
        hi = (first + tm - 1) // tm if const_expr(part == 0) else (total + tm - 1) // tm
        for t in cutlass.range(lo, hi, unroll=1):
            t_g = thr.partition_D(cute.local_tile(mX_h, tile, (t, 0)))
            for m in cutlass.range_constexpr(cute.size(t_g, mode=[1])):
                row = t * tm + t_c[0, m, 0][0]
                if row < total and (row < first or row >= last):
                    cute.copy(tiled, zeros[None, m, None], t_g[None, m, None])


def dq_fragment_view(base: cute.Tensor, num_regs: int, tidx_in_wg: Int32) -> cute.Tensor:
    """This thread's ``num_regs`` floats of one warpgroup's dQ chunk ``base`` (1-D, 128·num_regs
    floats), as a (4, num_regs/4) tensor: register 4c + j sits at float (c·128 + t)·4 + j."""
    chunks = cute.make_tensor(base.iterator,
                              cute.make_layout((4, 128, num_regs // 4), stride=(1, 4, 512)))
    return chunks[None, tidx_in_wg, None]
