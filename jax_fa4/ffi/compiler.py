"""Compile a kernel config into the object the XLA FFI handler runs. Needs nvidia-cutlass-dsl.

The object is what ``cutlass.jax.cutlass_call`` would produce: the config's launcher (from the
module :mod:`jax_fa4.kernels.registry` names for it) wrapped in cutlass.jax's ``jit_wrapper``
(which turns the XLA FFI buffer descriptors into ``cute.Tensor``s with dynamic shapes) and
exported with ``dump_to_object``. Unlike ``cutlass_call`` we compile ahead of time from the config
alone: shapes come from the config's representative sample shapes, and every dimension gets an
explicit divisibility hint so that nothing about the sample extents leaks into the generated code.
One object therefore serves every batch size, sequence length and head count.

The target arch is a parameter (``"sm_90a"``, ``"sm_100a"``): nothing here queries a GPU.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading
import time
from dataclasses import dataclass

from jax_fa4.kernels import registry
from jax_fa4.kernels.spec import KernelConfig, TensorArg

#: Symbol prefix the runtime handlers look the host entry point up under.
EXPORT_PREFIX = "cutlass_call"

SUPPORTED_ARCHS = ("sm_90a", "sm_100a")

_lock = threading.Lock()


class CompilerUnavailableError(RuntimeError):
    """nvidia-cutlass-dsl is not installed, so kernels cannot be compiled in this process."""


def dsl_version() -> str | None:
    """Version of the installed nvidia-cutlass-dsl, or None when it is not installed."""
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return None


def compiler_available() -> bool:
    return dsl_version() is not None


@dataclass(frozen=True)
class CompiledKernel:
    object_bytes: bytes
    seconds: float


def set_target_arch(arch: str) -> None:
    """Point the DSL at ``arch`` before it is imported or used (never by probing a GPU)."""
    os.environ["CUTE_DSL_ARCH"] = arch
    from cutlass.cutlass_dsl.cutlass import CuTeDSL

    # The DSL reads CUTE_DSL_ARCH once, when its singleton is built; later compiles for another
    # arch in the same process (precompiling for several archs) must update it too.
    CuTeDSL._get_dsl().envar.arch = arch


def _function_spec(config: KernelConfig):
    import jax
    import jax.numpy as jnp
    from cutlass.jax.compile import Arg, FunctionSpec
    from cutlass.jax.types import TensorSpec

    sig = config.signature()

    def args(tensors: tuple[TensorArg, ...]) -> tuple[Arg, ...]:
        return tuple(
            Arg(i, t.sample_shape, jnp.dtype(t.dtype), TensorSpec(
                layout=tuple(reversed(range(t.rank))),
                mode=tuple(range(t.rank)),
                static=False,
                divisibility=t.divisibility,
            ))
            for i, t in enumerate(tensors)
        )

    in_args, out_args = args(sig.inputs), args(sig.outputs)
    aliased_outputs = {o for _, o in sig.aliases}
    # Aliased outputs stay in the FFI frame but reach the launcher only as their input.
    launcher_outputs = [a for i, a in enumerate(out_args) if i not in aliased_outputs]
    return FunctionSpec(
        in_args=in_args,
        input_tree=jax.tree.structure(list(in_args)),
        out_args=out_args,
        output_tree=jax.tree.structure(launcher_outputs),
        input_output_aliases=tuple(sorted(sig.aliases)),
        input_spec=tuple(a.spec for a in in_args),
        output_spec=tuple(a.spec for a in out_args),
        compile_options=None,
        use_static_tensors=False,
        kwargs=(),
    )


def compile_config(config: KernelConfig, arch: str) -> CompiledKernel:
    """Compile ``config`` for ``arch`` and return the object bytes the FFI handler loads."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch must be one of {SUPPORTED_ARCHS}, got {arch!r}")
    if not compiler_available():
        raise CompilerUnavailableError(
            f"cannot compile {config.describe()} for {arch}: nvidia-cutlass-dsl is not installed")
    with _lock:  # the DSL's tracing state is process-global
        start = time.perf_counter()
        set_target_arch(arch)
        import cuda.bindings.driver as cuda
        import cutlass.cute as cute
        from cutlass.jax.compile import jit_wrapper

        spec = _function_spec(config)
        compiled = cute.compile(
            jit_wrapper,
            cuda.CUstream(0),
            *spec.get_compile_args(),
            wrapped_fn=registry.make_launcher(config),
            spec=spec,
            options=f"--gpu-arch {arch}",
        )
        object_bytes = bytes(compiled.dump_to_object(EXPORT_PREFIX))
        return CompiledKernel(object_bytes, time.perf_counter() - start)
