"""The attention building blocks, each run by a kernel or by the reference.

``forward``, ``bwd_preprocess`` and ``backward`` take an already resolved implementation (see
:mod:`jax_fa4.dispatch`) and decide, per call, whether a kernel covers the request.
"""

from __future__ import annotations

import functools
import logging
import math
import warnings

import jax
import jax.numpy as jnp

from jax_fa4 import reference
from jax_fa4.dispatch import KERNEL_ARCH, ImplementationUnavailableError
from jax_fa4.kernels.preprocess_config import PreprocessConfig

#: Above this many scores per head the reference switches to its memory-light blocked form.
_NAIVE_MAX_SCORES = 4096 * 4096
_BLOCK_K = 512

KERNEL_DTYPES = ("bfloat16", "float16")

_log = logging.getLogger("jax_fa4")


def reference_fallback(what: str, implementation: str, reason: str) -> None:
    """Record that ``what`` (``"forward"``, ``"backward"``, ...) of a call on a kernel
    ``implementation`` runs the pure-JAX reference, and why: logged on the ``jax_fa4`` logger
    (level INFO: ``logging.getLogger("jax_fa4").setLevel("INFO")`` shows which calls miss the
    kernels). Called while tracing, once per traced call; the GPU test suite makes it raise
    (``JAX_FA4_REQUIRE_GPU=1``) where a test expects a kernel."""
    _log.info("%s on %s runs the pure-JAX reference: %s", what, implementation, reason)


def reference_block_k(sq: int, sk: int) -> int | None:
    """None: the naive reference serves (sq, sk); an int: the key block of its blocked form."""
    return None if sq * sk <= _NAIVE_MAX_SCORES else _BLOCK_K


def reference_forward(q, k, v, opts, **extras) -> tuple[jax.Array, jax.Array]:
    """(out, lse) by the reference; ``extras`` are further reference options (sink, segments)."""
    kw = dict(softmax_scale=opts.softmax_scale, window=opts.window, softcap=opts.softcap, **extras)
    block_k = reference_block_k(q.shape[1], k.shape[1])
    if block_k is None:
        return reference.attention(q, k, v, **kw)
    return reference.attention_blocked(q, k, v, block_k=block_k, **kw)


def reference_delta(out, dout) -> jax.Array:
    """``rowsum(dout * out)`` (B, H, Sq) in float32 (no TF32: a full-precision contraction)."""
    return jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), dout.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def mask_kind(window) -> str:
    """The kernels' compile-time mask kind of a canonical window."""
    if window == (None, None):
        return "none"
    return "causal" if window == (None, 0) else "local"


def kernel_params(opts, head_dim: int | None = None) -> jax.Array:
    """Run-time scalars of the attention kernels: [scale, softcap, window_left, window_right].

    ``opts`` needs ``.softmax_scale`` (None: ``1/sqrt(head_dim)``), ``.softcap`` (0 or None: off)
    and ``.window`` ((left, right), None = unbounded).
    """
    scale = opts.softmax_scale
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    left, right = opts.window
    values = (scale, opts.softcap or 0.0, -1 if left is None else left,
              -1 if right is None else right)
    # Scalars stay literals in the jaxpr (no captured constant array: custom_partitioning
    # bodies must not close over constants).
    return jnp.stack([jnp.float32(x) for x in values])


def forward_config(q, k, v, opts):
    """The forward kernel config serving this call, or the reason none does (a str)."""
    dtype = jnp.dtype(q.dtype).name
    if dtype not in KERNEL_DTYPES:
        return f"the kernels take bfloat16 or float16 inputs, got {dtype}"
    if opts.implementation == "sm90":
        from jax_fa4.kernels.sm90.fwd_config import FwdConfig
    else:
        from jax_fa4.kernels.sm100.fwd_config import FwdConfig

    try:
        return FwdConfig.make(dtype, q.shape[3], v.shape[3], mask_kind(opts.window),
                              opts.softcap > 0)
    except ValueError as err:
        return str(err)


def _kernel_forward(q, k, v, opts, config=None) -> tuple[jax.Array, jax.Array]:
    """(out, lse) by the forward kernel (``config``: forward_config's, which must serve). q and
    out are (B, S, H, ·), or (B, H, S, ·) for a head-major config (the decode tiles)."""
    from jax_fa4.ffi.call import call_kernel

    config = forward_config(q, k, v, opts) if config is None else config
    assert not isinstance(config, str), config
    if getattr(config, "qo_head_major", False):
        b, h, sq, _ = q.shape
        out_shape = (b, h, sq, v.shape[3])
    else:
        b, sq, h, _ = q.shape
        out_shape = (b, sq, h, v.shape[3])
    return call_kernel(
        config, KERNEL_ARCH[opts.implementation], q, k, v, kernel_params(opts, q.shape[3]),
        out_shapes=(jax.ShapeDtypeStruct(out_shape, q.dtype),
                    jax.ShapeDtypeStruct((b, h, sq), jnp.float32)))


def _decode_kernel_forward(qp, k, v, opts) -> tuple[jax.Array, jax.Array]:
    """The forward kernel on a rewritten decode call (unmasked; qp, out head-major as
    jax_fa4.decode.run passes and takes them): on Hopper the decode tile (or the alternative
    ``JAX_FA4_DECODE_TILE`` names) when the packed rows fit it and it is not turned off
    (jax_fa4.decode.decode_tile_option), else the training tile on transposed q and out."""
    from jax_fa4 import decode

    config = None
    option = decode.decode_tile_option() if opts.implementation == "sm90" else None
    if option is not None:
        from jax_fa4.kernels.sm90.fwd_config import DECODE_TILE_M, decode_config

        if qp.shape[2] <= DECODE_TILE_M:
            config = decode_config(jnp.dtype(qp.dtype).name, qp.shape[3], v.shape[3],
                                   opts.softcap > 0, **option)
    if config is not None and config.qo_head_major:
        return _kernel_forward(qp, k, v, opts, config)
    out, lse = _kernel_forward(qp.transpose(0, 2, 1, 3), k, v, opts, config)
    return out.transpose(0, 2, 1, 3), lse


def forward(q, k, v, opts) -> tuple[jax.Array, jax.Array]:
    """(out, lse) of one attention call: the kernel when one serves it, else the reference.
    Decode-shaped calls run the kernel on GQA-packed, split-KV inputs (jax_fa4.decode)."""
    if opts.implementation != "reference":
        config = forward_config(q, k, v, opts)
        if not isinstance(config, str):
            from jax_fa4 import decode

            decode_plan = decode.plan(q.shape, k.shape, opts.window)
            if decode_plan is not None:
                return decode.run(q, k, v, opts, decode_plan, _decode_kernel_forward)
            return _kernel_forward(q, k, v, opts, config)
        if opts.forced:
            raise ImplementationUnavailableError(
                f"implementation={opts.implementation!r} cannot run this call: {config}")
        reference_fallback("forward", opts.implementation, config)
    return reference_forward(q, k, v, opts)


def join_sink(out: jax.Array, lse: jax.Array, learnable_sink: jax.Array | None):
    """(out, lse) with a learnable sink joining each row's denominator, in float32:
    ``lse' = logaddexp(lse, sink)``, ``out' = out · e^{lse − lse'}`` (rows without keys: out 0,
    lse = sink)."""
    if learnable_sink is None:
        return out, lse
    sink = learnable_sink.astype(jnp.float32)[:, None]  # (H, 1) against lse (B, H, Sq)
    lse_all = jnp.logaddexp(lse, sink)
    factor = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(lse - lse_all))  # (B, H, Sq)
    out = (out.astype(jnp.float32) * factor.transpose(0, 2, 1)[..., None]).astype(out.dtype)
    return out, lse_all


def bwd_preprocess(out, dout, lse, implementation: str) -> tuple[jax.Array, jax.Array]:
    """``delta = rowsum(dout * out)`` (B, H, Sq) float32 and ``lse * log2(e)`` (+inf for -inf rows).

    Runs the preprocess kernel for kernel implementations when the dtype and head dim allow.
    """
    b, sq, h, dv = out.shape
    dtype = jnp.dtype(out.dtype).name
    if implementation in KERNEL_ARCH and dtype in KERNEL_DTYPES and dv % 8 == 0 and dv <= 512:
        from jax_fa4.ffi.call import call_kernel

        shape = jax.ShapeDtypeStruct((b, h, sq), jnp.float32)
        delta, lse_log2 = call_kernel(PreprocessConfig(dtype, dv), KERNEL_ARCH[implementation],
                                      out, dout, lse, out_shapes=(shape, shape))
        return delta, lse_log2
    if implementation in KERNEL_ARCH:
        reference_fallback("backward preprocess", implementation,
                           f"dtype {dtype}, head_dim_v {dv} (the kernel takes bfloat16 / float16 "
                           "and a multiple of 8 up to 512)")
    delta = reference_delta(out, dout)
    lse_log2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * math.log2(math.e))
    return delta, lse_log2


def backward_kind(q, k, v, opts) -> dict:
    """The problem kind a backward kernel config is made for (the keyword arguments of
    ``BwdConfig.make`` / ``Sm100BwdConfig.make``). ``opts`` needs ``.window`` and ``.softcap``;
    ``.deterministic`` is optional (False)."""
    return dict(dtype=jnp.dtype(q.dtype).name, head_dim=q.shape[3], head_dim_v=v.shape[3],
                mask=mask_kind(opts.window), has_softcap=bool(opts.softcap and opts.softcap > 0),
                gqa=q.shape[2] != k.shape[2],
                deterministic=bool(getattr(opts, "deterministic", False)))


def config_refusal(configs, q, k, v, opts) -> str | None:
    """Why ``configs(q, k, v, opts)`` (a kernel-config builder raising ValueError) cannot serve
    this call, None when it can."""
    if not (q.dtype == k.dtype == v.dtype):
        return "q, k, v dtypes differ"
    try:
        configs(q, k, v, opts)
    except ValueError as e:
        return str(e)
    return None


def backward_ops(implementation: str):
    """The JAX side of ``implementation``'s backward kernels (``sm90_bwd_ops`` /
    ``sm100_bwd_ops``: the same ``unsupported`` / ``backward`` contract), None for the
    reference."""
    if implementation == "sm90":
        from jax_fa4 import sm90_bwd_ops

        return sm90_bwd_ops
    if implementation == "sm100":
        from jax_fa4 import sm100_bwd_ops

        return sm100_bwd_ops
    return None


def backward_unsupported(q, k, v, opts) -> str | None:
    """Why no backward kernel serves this call (None when one does)."""
    kernels = backward_ops(opts.implementation)
    if kernels is None:
        return f"no backward kernel is enabled for implementation={opts.implementation!r}"
    return kernels.unsupported(q, k, v, opts)


@functools.cache
def warn_reference_backward(implementation: str, reason: str) -> None:
    """Say (once per reason) that an sm100 forward kernel's gradient runs the reference
    backward: sm100 is opt-in, so a silent switch of families would mislead."""
    warnings.warn(
        f"jax_fa4: the {implementation} forward kernel serves this call but no {implementation} "
        f"backward kernel does ({reason}); the gradient runs the pure-JAX reference backward.",
        RuntimeWarning, stacklevel=2)


def backward(q, k, v, out, lse, dout, delta, lse_log2, opts
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dq, dk, dv from the saved forward, ``delta`` and ``lse_log2`` (see :func:`bwd_preprocess`).

    The backward kernels of ``opts.implementation`` serve the calls they cover: on Hopper
    (``"sm90"``) the main and dQ postprocess kernels, on Blackwell (``"sm100"``, compiled only,
    never run on hardware) the main kernel with the dQ scale done by XLA; with
    ``deterministic=True`` the kernel that adds dQ in a fixed order. Everything else (the
    reference, unsupported shapes or options, e.g. head dim 256 on sm100) runs the
    reference's explicit backward, which is deterministic too; an sm100 call whose forward ran a
    kernel says so with a one-time :class:`RuntimeWarning` naming the reason.
    """
    reason = backward_unsupported(q, k, v, opts)
    if reason is None:
        return backward_ops(opts.implementation).backward(q, k, v, out, lse, dout, delta,
                                                          lse_log2, opts)
    if opts.implementation == "sm100" and not isinstance(forward_config(q, k, v, opts), str):
        warn_reference_backward(opts.implementation, reason)
    if opts.implementation != "reference":
        reference_fallback("backward", opts.implementation, reason)
    return reference.attention_backward(
        q, k, v, out, lse, dout, delta=delta, softmax_scale=opts.softmax_scale,
        window=opts.window, softcap=opts.softcap,
        block_k=reference_block_k(q.shape[1], k.shape[1]))
