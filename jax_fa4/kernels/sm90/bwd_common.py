"""Helpers of both Hopper (sm_90a) backward kernels, the main kernel (bwd.py) and the dQ
postprocess (bwd_postprocess.py): the dQ GEMM whose accumulator-fragment order dq_accum holds,
shared-memory layouts and per-sequence views (varlen; the row stores are common/rows.py)."""

from __future__ import annotations

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


def dq_fragment_view(base: cute.Tensor, num_regs: int, tidx_in_wg: Int32) -> cute.Tensor:
    """This thread's ``num_regs`` floats of one warpgroup's dQ chunk ``base`` (1-D, 128·num_regs
    floats), as a (4, num_regs/4) tensor: register 4c + j sits at float (c·128 + t)·4 + j."""
    chunks = cute.make_tensor(base.iterator,
                              cute.make_layout((4, 128, num_regs // 4), stride=(1, 4, 512)))
    return chunks[None, tidx_in_wg, None]
