"""Compile key of the backward preprocess kernel (no compiler import here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from jax_fa4.kernels.spec import FLOAT_DTYPES, KernelConfig, KernelSignature, TensorArg

#: |lse_log2| from which the backward's exponent gets a margin (``PreprocessConfig``).
LSE_LOG2_MARGIN_FROM = 2.0 ** 24
#: That margin, relative to |lse_log2|: 16 to 32 float32 ulps of it.
LSE_LOG2_MARGIN = 2.0 ** -19
#: Floats per store of the dq_accum clear (16 bytes): dq_accum's last extent is a multiple of it.
DQ_ACCUM_VECTOR = 4


@dataclass(frozen=True)
class PreprocessConfig(KernelConfig):
    """Backward preprocess: per (batch, head, query row)

    * ``delta = sum_d dO[d] * O[d]`` in float32 (the ``D`` term of the softmax gradient), and
    * ``lse_log2 = lse * log2(e)``, with rows that saw no key (lse = -inf) mapped to +inf so that
      the backward's ``P = exp2(S * scale_log2 - lse_log2)`` is exactly 0 there, and huge rows
      (``|lse_log2| >= LSE_LOG2_MARGIN_FROM``, scores of ~1e7 and up) raised by
      ``|lse_log2| * LSE_LOG2_MARGIN``: a float32 lse carries such a row's log-sum only to
      whole units of the exponent (the forward's and the backward's roundings of max·scale,
      a recomputed S summed in another order), so without the margin the rebuilt P could
      reach exp2(+128) = inf (NaN gradients from scores of ~1e9); with it P <= 1. Such rows'
      gradients are not accurate either way (their P is off by a power of two common to the
      row); they are finite.

    With ``zero_dq_accum`` it also writes zeros to a float32 ``dq_accum`` (B, H, N), N a
    multiple of ``DQ_ACCUM_VECTOR``: the dense backward's dQ accumulator, which its main kernel
    adds into (so the zeros are made where their layer's backward starts, not by an XLA fill
    that the compiler may hoist and merge with other layers' fills, keeping every layer's
    buffer alive at once). Each CTA clears an equal share of its (batch, head)'s N floats.

    The dtype, the value head dim and ``zero_dq_accum`` change the generated code.
    """

    kernel_name: ClassVar[str] = "bwd_preprocess"

    dtype: str
    head_dim_v: int
    zero_dq_accum: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"bwd_preprocess: dtype must be one of {FLOAT_DTYPES}, "
                             f"got {self.dtype!r}")
        if self.head_dim_v % 8 or not 8 <= self.head_dim_v <= 512:
            raise ValueError("bwd_preprocess: head_dim_v must be a multiple of 8 in [8, 512], "
                             f"got {self.head_dim_v}")

    def signature(self) -> KernelSignature:
        dv = self.head_dim_v
        o = TensorArg("out", self.dtype, (2, 67, 3, dv), (1, 1, 1, dv))
        rows = (TensorArg("delta", "float32", (2, 3, 67), (1, 1, 1)),
                TensorArg("lse_log2", "float32", (2, 3, 67), (1, 1, 1)))
        accum = (TensorArg("dq_accum", "float32", (2, 3, 40 * DQ_ACCUM_VECTOR),
                           (1, 1, DQ_ACCUM_VECTOR)),) if self.zero_dq_accum else ()
        return KernelSignature(
            inputs=(o, TensorArg("dout", self.dtype, o.sample_shape, o.divisibility),
                    TensorArg("lse", "float32", (2, 3, 67), (1, 1, 1))),
            outputs=rows + accum,
        )
