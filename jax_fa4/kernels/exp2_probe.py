"""Exp2 probe kernel (test-only): runs the software exp2 of ``common/exp2.py`` on a GPU.

    sw[i]   = exp2_sw(x[i])               (packed=False: scalar form)
            = exp2_sw_x2(x[i], x[i+1])     (packed=True: f32x2 form, element pairs)
    mufu[i] = ex2.approx.ftz.f32(x[i])     (cute.math.exp2(fastmath=True): MUFU.EX2)

Each thread takes the element pair (2t, 2t+1); an odd N's last element is handled alone (the
packed form then pairs it with itself). x, sw, mufu are (N,) float32, N dynamic.

Test-only (see :class:`~jax_fa4.kernels.exp2_probe_config.Exp2ProbeConfig`): the packed form
compiles for sm_100a only (f32x2 arithmetic is Blackwell's), so on the H200 the probe runs the
scalar form, built with ``packed=False`` for sm_90a.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass.cute as cute
from cutlass import Float32, const_expr

from jax_fa4.kernels.common.exp2 import exp2_sw, exp2_sw_x2
from jax_fa4.kernels.exp2_probe_config import Exp2ProbeConfig

_NUM_THREADS = 256


class Exp2Probe:
    """``sw = 2^x`` by the software exp2 and ``mufu = 2^x`` by MUFU, elementwise."""

    def __init__(self, config: Exp2ProbeConfig):
        self.packed = config.packed

    @cute.jit
    def __call__(self, stream: cuda.CUstream, mX: cute.Tensor, mSw: cute.Tensor,
                 mMufu: cute.Tensor):
        n = mX.shape[0]
        grid = (cute.ceil_div(n, 2 * _NUM_THREADS), 1, 1)
        self.kernel(mX, mSw, mMufu).launch(grid=grid, block=[_NUM_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mSw: cute.Tensor, mMufu: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        n = mX.shape[0]
        i = (bidx * _NUM_THREADS + tidx) * 2
        if i < n:
            x0 = mX[i]
            x1 = x0
            has_second = i + 1 < n
            if has_second:
                x1 = mX[i + 1]
            y0, y1 = Float32(0.0), Float32(0.0)
            if const_expr(self.packed):
                y0, y1 = exp2_sw_x2(x0, x1)
            else:
                y0 = exp2_sw(x0)
                y1 = exp2_sw(x1)
            mSw[i] = y0
            mMufu[i] = cute.math.exp2(x0, fastmath=True)
            if has_second:
                mSw[i + 1] = y1
                mMufu[i + 1] = cute.math.exp2(x1, fastmath=True)


def make_launcher(cfg: Exp2ProbeConfig) -> Exp2Probe:
    """The `@cute.jit` launcher ``fn(stream, x, sw, mufu)`` for this config."""
    return Exp2Probe(cfg)
