"""Helpers of every Hopper (sm_90a) kernel (forward, backward, dQ postprocess): the WGMMA issue
and the swizzled shared-memory layouts of TMA and WGMMA operands."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum


@cute.jit
def wgmma(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
          zero_init: cutlass.Constexpr[bool]):
    """Issue acc (+)= A·B over all K blocks as one WGMMA group (no wait)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


def make_smem_layout(dtype, rows: int, cols: int, major_mode_size: int | None = None,
                     stages: int | None = None):
    """Row-major (cols contiguous) swizzled layout, usable by TMA and as a WGMMA operand, whose
    swizzle atom is at most ``major_mode_size`` columns wide (default ``cols``; a narrower one
    keeps a transposed view split into ``major_mode_size``-wide slices a canonical MN-major
    WGMMA operand), with a trailing ``stages`` mode when given."""
    if major_mode_size is None:
        major_mode_size = cols
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, major_mode_size), dtype)
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))
