"""The per-call score scalars of every attention kernel, from the softmax scale and the softcap.

With raw scores ``S = q·kᵀ``, scale ``s`` and softcap ``c`` (the run-time values of
:data:`jax_fa4.kernels.spec.PARAM_SCALE` / :data:`~jax_fa4.kernels.spec.PARAM_SOFTCAP`):

* without softcap, ``P = exp2(S·scale_log2 − lse_log2)`` with ``scale_log2 = s·log2 e``;
* with softcap, the capped score is ``c·tanh(S·s/c)``: ``t = tanh(S·tanh_in_scale)`` with
  ``tanh_in_scale = s / c``, then ``P = exp2(t·scale_log2 − lse_log2)`` with
  ``scale_log2 = c·log2 e``; the backward recovers ``t`` from ``P`` through
  ``inv_scale_log2 = 1 / scale_log2`` (for ``tanh' = 1 − t²``).

Kernel code calls :func:`score_scales` while it traces (a plain function: the values are
CuTe-DSL ``Float32`` scalars); the expression order here is the kernels' float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cutlass import Float32

from jax_fa4.kernels.spec import LOG2_E, PARAM_SOFTCAP


@dataclass(frozen=True)
class ScoreScales:
    """The scalars :func:`score_scales` derives (module doc).

    Attributes:
      scale_log2: the factor of the (capped) score in the exponent, ``s·log2 e`` or ``c·log2 e``.
      tanh_in_scale: ``s / c``, the factor of the raw score inside tanh (``Float32(0)`` and unused
        without softcap).
      inv_scale_log2: ``1 / scale_log2`` (softcap and ``inverse=True`` only, else ``Float32(0)``).
    """

    scale_log2: Any
    tanh_in_scale: Any
    inv_scale_log2: Any


def score_scales(scale: Any, params: Any, has_softcap: bool, inverse: bool = False
                 ) -> ScoreScales:
    """The score scalars for softmax scale ``scale`` (``params[PARAM_SCALE]``, times any FP8
    dequantisation factor) and, when ``has_softcap`` (compile time), the softcap read from
    ``params[PARAM_SOFTCAP]``; ``inverse`` also computes ``inv_scale_log2`` (the backward's)."""
    if not has_softcap:
        return ScoreScales(scale * LOG2_E, Float32(0.0), Float32(0.0))
    softcap = params[PARAM_SOFTCAP]
    tanh_in_scale = scale / softcap
    scale_log2 = softcap * LOG2_E
    inv_scale_log2 = Float32(1.0) / scale_log2 if inverse else Float32(0.0)
    return ScoreScales(scale_log2, tanh_in_scale, inv_scale_log2)
