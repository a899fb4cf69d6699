"""Calling a compiled kernel from JAX: one primitive, lowered to the CuTe-DSL FFI custom call.

``call_kernel(config, arch, *inputs)`` binds the ``jax_fa4_kernel`` primitive. Its CUDA lowering
fetches the kernel object for (config, arch) from the persistent cache (compiling it first when it
is missing and nvidia-cutlass-dsl is installed) and emits a custom call to the runtime's handler
with the object bytes as an attribute, so a jitted or exported program carries its kernels.

Batching (``jax.vmap``): every kernel tensor marked ``batched`` has the batch as its leading axis,
so vmapped axes are folded into it and the kernel runs once; an output not marked ``batched``
(the forward's tile counter, updated in place) keeps its shape and is not mapped.
"""

from __future__ import annotations

import functools
import hashlib
import threading

import jax
import jax.extend
import jax.numpy as jnp
from jax.interpreters import batching, mlir

from jax_fa4.backends.base import ImplementationUnavailableError
from jax_fa4.ffi import compiler
from jax_fa4.ffi.cache import KernelCache
from jax_fa4.ffi.runtime import CALL_TARGET, RuntimeLibraryNotFoundError, register_ffi_targets
from jax_fa4.kernels.spec import KernelConfig
from jax_fa4.parallel.manual_axes import vary_like

PRECOMPILE_HINT = "python -m jax_fa4.tools.precompile"


class KernelNotAvailableError(RuntimeError):
    """A kernel is not in the cache and cannot be compiled in this process."""


_memo: dict[tuple, bytes] = {}
_memo_lock = threading.Lock()


def clear_memory_cache() -> None:
    """Forget kernel objects held in memory (the on-disk cache is untouched)."""
    with _memo_lock:
        _memo.clear()


def kernel_object(config: KernelConfig, arch: str, cache: KernelCache | None = None) -> bytes:
    """The compiled object for (config, arch): memory, then disk cache, then the compiler."""
    cache = cache or KernelCache()
    memo_key = (str(cache.root), config, arch)
    with _memo_lock:
        if memo_key in _memo:
            return _memo[memo_key]
    version = compiler.dsl_version()
    entry = cache.get(config, arch, version)
    if entry is None:
        if version is None:
            raise KernelNotAvailableError(
                f"kernel {config.describe()} for {arch} is not in the kernel cache "
                f"({cache.root}) and nvidia-cutlass-dsl is not installed to compile it. Build it "
                f"on any machine with nvidia-cutlass-dsl (no GPU needed) with `{PRECOMPILE_HINT} "
                f"--arch {arch} ...` and point JAX_FA4_CACHE_DIR at the result.")
        with cache.lock(config, arch, version):
            entry = cache.get(config, arch, version)  # another process may have built it
            if entry is None:
                built = compiler.compile_config(config, arch)
                entry = cache.put(config, arch, version, built.object_bytes,
                                  extra={"compile_seconds": round(built.seconds, 3)})
    with _memo_lock:
        _memo[memo_key] = entry.object_bytes
    return entry.object_bytes


# -- the primitive ----------------------------------------------------------------------------
kernel_call_p = jax.extend.core.Primitive("jax_fa4_kernel")
kernel_call_p.multiple_results = True


def call_kernel(config: KernelConfig, arch: str, *inputs: jax.Array,
                out_shapes: tuple[jax.ShapeDtypeStruct, ...]) -> list[jax.Array]:
    """Run the kernel of ``config`` compiled for ``arch`` on ``inputs``; returns its outputs."""
    sig = config.signature()
    if len(inputs) != len(sig.inputs) or len(out_shapes) != len(sig.outputs):
        raise ValueError(f"{config.kernel_name}: expected {len(sig.inputs)} inputs and "
                         f"{len(sig.outputs)} outputs, got {len(inputs)} and {len(out_shapes)}")
    for arg, x in zip(sig.inputs, inputs):
        if x.ndim != arg.rank or jnp.dtype(x.dtype) != jnp.dtype(arg.dtype):
            raise ValueError(f"{config.kernel_name}: input {arg.name!r} must be rank {arg.rank} "
                             f"{arg.dtype}, got shape {x.shape} {x.dtype}")
    for i, o in sig.aliases:
        if (tuple(inputs[i].shape), jnp.dtype(inputs[i].dtype)) != (
                tuple(out_shapes[o].shape), jnp.dtype(out_shapes[o].dtype)):
            raise ValueError(f"{config.kernel_name}: aliased input {sig.inputs[i].name!r} and "
                             f"output {sig.outputs[o].name!r} must match in shape and dtype")
    outs = tuple((tuple(s.shape), jnp.dtype(s.dtype)) for s in out_shapes)
    results = kernel_call_p.bind(*inputs, config=config, arch=arch, out_shapes=outs)
    # Inside shard_map the results vary over the manual mesh axes the inputs vary over (the
    # primitive's abstract values carry none; custom_vjp checks gradients against their inputs).
    return vary_like(results, *inputs)


@kernel_call_p.def_abstract_eval
def _abstract_eval(*_, out_shapes, **__):
    return [jax.core.ShapedArray(shape, dtype) for shape, dtype in out_shapes]


@functools.lru_cache(maxsize=256)
def _jitted_call(config: KernelConfig, arch: str, out_shapes: tuple):
    return jax.jit(lambda *a: kernel_call_p.bind(*a, config=config, arch=arch,
                                                 out_shapes=out_shapes))


def _impl(*args, config: KernelConfig, arch: str, out_shapes: tuple):
    """Eager calls (outside jit) run through one cached jitted function per kernel and shapes."""
    return _jitted_call(config, arch, out_shapes)(*args)


kernel_call_p.def_impl(_impl)


def _lowering(ctx, *operands, config: KernelConfig, arch: str, out_shapes):
    del out_shapes
    obj = kernel_object(config, arch)
    try:
        register_ffi_targets()
    except RuntimeLibraryNotFoundError:
        # Lowering for export on a machine without the runtime is fine; running is not.
        if any(d.platform == "gpu" for d in jax.devices()):
            raise
    aliases = dict(config.signature().aliases)
    rule = jax.ffi.ffi_lowering(CALL_TARGET, operand_output_aliases=aliases or None)
    return rule(ctx, *operands, module=obj, key=hashlib.sha256(obj).digest())


mlir.register_lowering(kernel_call_p, _lowering, platform="cuda")


def _unsupported_platform_lowering(ctx, *operands, config: KernelConfig, **_):
    platforms = ", ".join(ctx.module_context.platforms)
    raise ImplementationUnavailableError(
        f"jax-fa4 kernel {config.kernel_name} runs on CUDA GPUs, but this computation is being "
        f"lowered for {platforms}: use implementation=None (picks the reference there) or "
        "implementation='reference'")


for _platform in ("cpu", "rocm", "tpu"):
    mlir.register_lowering(kernel_call_p, _unsupported_platform_lowering, platform=_platform)


def _batching_rule(args, dims, *, config: KernelConfig, arch: str, out_shapes):
    sig = config.signature()
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    folded = []
    for arg, x, d in zip(sig.inputs, args, dims):
        if not arg.batched:
            if d is not None:
                raise NotImplementedError(
                    f"{config.kernel_name}: vmap over the non-batch input {arg.name!r}")
            folded.append(x)
            continue
        x = (jnp.broadcast_to(x, (size, *x.shape)) if d is None
             else jnp.moveaxis(x, d, 0))
        folded.append(x.reshape(size * x.shape[1], *x.shape[2:]))
    batched = [arg.batched for arg in sig.outputs]
    new_outs = tuple(((size * s[0], *s[1:]) if b else s, dt)
                     for b, (s, dt) in zip(batched, out_shapes))
    results = kernel_call_p.bind(*folded, config=config, arch=arch, out_shapes=new_outs)
    results = [r.reshape(size, r.shape[0] // size, *r.shape[1:]) if b else r
               for b, r in zip(batched, results)]
    return results, [0 if b else None for b in batched]  # (None: not mapped)


batching.primitive_batchers[kernel_call_p] = _batching_rule
