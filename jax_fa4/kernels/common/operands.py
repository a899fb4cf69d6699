"""Trace-time checks of a backward main kernel's operands (both architectures' call contract:
kernels/sm90/bwd_config.py, kernels/sm100/bwd_config.py)."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32


def check_backward_operands(dtype, gqa: bool, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
                            dout: cute.Tensor, lse_log2: cute.Tensor, delta: cute.Tensor,
                            params: cute.Tensor, dq_accum: cute.Tensor, dk: cute.Tensor,
                            dv: cute.Tensor) -> None:
    """TypeError naming the first operand whose element type is not the contract's: q, k, v,
    dout in ``dtype``; dk, dv in ``dtype`` (float32 per query head with ``gqa``); lse_log2,
    delta, params, dq_accum in float32."""
    for name, t in (("q", q), ("k", k), ("v", v), ("dout", dout)):
        if t.element_type != dtype:
            raise TypeError(f"{name}: expected {dtype}, got {t.element_type}")
    dkv_type = Float32 if gqa else dtype
    for name, t in (("dk", dk), ("dv", dv)):
        if t.element_type != dkv_type:
            raise TypeError(f"{name}: expected {dkv_type}, got {t.element_type}")
    for name, t in (("lse_log2", lse_log2), ("delta", delta), ("params", params),
                    ("dq_accum", dq_accum)):
        if t.element_type != Float32:
            raise TypeError(f"{name}: expected Float32, got {t.element_type}")
