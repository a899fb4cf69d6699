"""The attention building blocks, each run by a kernel or by the reference.

``forward`` and ``bwd_preprocess`` take an already resolved implementation (see
:mod:`jax_fa4.dispatch`) and decide, per call, whether a kernel covers the request.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_fa4 import reference
from jax_fa4.dispatch import KERNEL_ARCH, ImplementationUnavailableError
from jax_fa4.kernels.preprocess_config import PreprocessConfig

#: Above this many scores per head the reference switches to its memory-light blocked form.
_NAIVE_MAX_SCORES = 4096 * 4096
_BLOCK_K = 512

_KERNEL_DTYPES = ("bfloat16", "float16")


def _reference_block_k(sq: int, sk: int) -> int | None:
    return None if sq * sk <= _NAIVE_MAX_SCORES else _BLOCK_K


def reference_forward(q, k, v, opts) -> tuple[jax.Array, jax.Array]:
    kw = dict(softmax_scale=opts.softmax_scale, window=opts.window, softcap=opts.softcap)
    if _reference_block_k(q.shape[1], k.shape[1]) is None:
        return reference.attention(q, k, v, **kw)
    return reference.attention_blocked(q, k, v, block_k=_BLOCK_K, **kw)


def forward_kernel_unsupported(q, k, v, opts) -> str | None:
    """Why no forward kernel serves this call (None when one does)."""
    return f"the {opts.implementation} forward kernel is not available yet"


def forward(q, k, v, opts) -> tuple[jax.Array, jax.Array]:
    """(out, lse) of one attention call."""
    if opts.implementation != "reference":
        reason = forward_kernel_unsupported(q, k, v, opts)
        if reason is None:
            raise AssertionError("unreachable until a forward kernel is registered")
        if opts.forced:
            raise ImplementationUnavailableError(
                f"implementation={opts.implementation!r} cannot run this call: {reason}")
    return reference_forward(q, k, v, opts)


def bwd_preprocess(out, dout, lse, implementation: str) -> tuple[jax.Array, jax.Array]:
    """``delta = rowsum(dout * out)`` (B, H, Sq) float32 and ``lse * log2(e)`` (+inf for -inf rows).

    Runs the preprocess kernel for kernel implementations when the dtype and head dim allow.
    """
    b, sq, h, dv = out.shape
    dtype = jnp.dtype(out.dtype).name
    if implementation in KERNEL_ARCH and dtype in _KERNEL_DTYPES and dv % 8 == 0 and dv <= 512:
        from jax_fa4.ffi.call import call_kernel

        shape = jax.ShapeDtypeStruct((b, h, sq), jnp.float32)
        delta, lse_log2 = call_kernel(PreprocessConfig(dtype, dv), KERNEL_ARCH[implementation],
                                      out, dout, lse, out_shapes=(shape, shape))
        return delta, lse_log2
    delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), dout.astype(jnp.float32))
    lse_log2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * math.log2(math.e))
    return delta, lse_log2


def backward(q, k, v, out, lse, dout, delta, opts) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dq, dk, dv from the saved forward and ``delta`` (the reference's explicit backward)."""
    return reference.attention_backward(
        q, k, v, out, lse, dout, delta=delta, softmax_scale=opts.softmax_scale,
        window=opts.window, softcap=opts.softcap,
        block_k=_reference_block_k(q.shape[1], k.shape[1]))
