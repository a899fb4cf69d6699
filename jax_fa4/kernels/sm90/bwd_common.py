"""Helpers of both Hopper (sm_90a) backward kernels, the main kernel (bwd.py) and the dQ
postprocess (bwd_postprocess.py): the dQ GEMM whose accumulator-fragment order dq_accum holds
(the helpers of every sm90 kernel are sm90/common.py; the row stores common/rows.py)."""

from __future__ import annotations

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32


def make_tiled_mma_dq(dtype, tile_m: int, head_dim: int):
    """The dQ = dS·K GEMM. Shared with the postprocess, which undoes its fragment order."""
    wm, wn = (2, 1) if tile_m == 128 else (1, 2)
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, Float32,
        (wm, wn, 1), (64, head_dim // wn))


def dq_fragment_view(base: cute.Tensor, num_regs: int, tidx_in_wg: Int32) -> cute.Tensor:
    """This thread's ``num_regs`` floats of one warpgroup's dQ chunk ``base`` (1-D, 128·num_regs
    floats), as a (4, num_regs/4) tensor: register 4c + j sits at float (c·128 + t)·4 + j."""
    chunks = cute.make_tensor(base.iterator,
                              cute.make_layout((4, 128, num_regs // 4), stride=(1, 4, 512)))
    return chunks[None, tidx_in_wg, None]
