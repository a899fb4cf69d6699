"""Compile key of the exp2 probe, a test-only kernel (no compiler import here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from jax_fa4.kernels.spec import KernelConfig, KernelSignature, TensorArg


@dataclass(frozen=True)
class Exp2ProbeConfig(KernelConfig):
    """Test-only kernel: ``2^x`` of a float32 vector by the software exp2 of ``common/exp2.py``
    and by MUFU, so that the device functions' numbers can be checked on a GPU (issue #7).

    ``fn(stream, x, sw, mufu)``: x, sw, mufu are (N,) float32, N dynamic; ``sw`` is the software
    exp2, ``mufu`` is ``cute.math.exp2(x, fastmath=True)`` (``ex2.approx.ftz.f32``: MUFU.EX2).

    ``packed`` picks the software form: False the scalar ``exp2_sw``, True the packed
    ``exp2_sw_x2`` on element pairs. The packed form's ``add/sub/fma.f32x2`` exist from sm_100
    only: for sm_90a libNVVM refuses it ("F32x2 intrinsics are not supported on this
    architecture"), so the H200 runs the scalar form and the packed form is only compiled (for
    sm_100a, where it assembles to FADD2/FFMA2; tests/test_exp2_probe.py).
    """

    kernel_name: ClassVar[str] = "exp2_probe"

    packed: bool = False

    def signature(self) -> KernelSignature:
        n = 4096
        return KernelSignature(
            inputs=(TensorArg("x", "float32", (n,), (1,)),),
            outputs=(TensorArg("sw", "float32", (n,), (1,)),
                     TensorArg("mufu", "float32", (n,), (1,))),
        )
