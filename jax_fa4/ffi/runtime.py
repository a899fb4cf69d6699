"""The CuTe-DSL runtime library and its XLA FFI handlers, loaded without the DSL compiler.

A compiled kernel object is executed by the handlers that nvidia-cutlass-dsl's runtime library
(``libcute_dsl_runtime.so``) exports: the FFI target ``CuteDSLRT_NvJaxCutlassCall_v2`` loads the
object bytes carried as a custom-call attribute and calls its host entry point with the XLA
buffers. That library is all a GPU process needs; ``cutlass.jax`` registers the same handlers but
imports the compiler to do so, which a machine with only precompiled kernels does not have.

The library is found through ``JAX_FA4_CUTE_RUNTIME_LIB`` (a path to the ``.so``), else inside an
installed nvidia-cutlass-dsl (located without importing it).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import threading
from pathlib import Path

import jax

#: The FFI target every kernel call lowers to, and its handler stages.
CALL_TARGET = "CuteDSLRT_NvJaxCutlassCall_v2"
_CALL_STAGES = {
    "instantiate": "CuteDSLRT_NvJaxCutlassCallInstantiate_v2",
    "prepare": "CuteDSLRT_NvJaxCutlassCallPrepare_v2",
    "execute": "CuteDSLRT_NvJaxCutlassCallExecute_v2",
}
_STATE_TYPE = "CuteDSLRT_NvJaxCutlassCallTypes_v2"
_STATE_TYPE_SYMBOLS = {
    "type_id": "CuteDSLRT_NvJaxCutlassCallStateTypeId_v2",
    "type_info": "CuteDSLRT_NvJaxCutlassCallStateTypeInfo_v2",
}
ENV_RUNTIME_LIB = "JAX_FA4_CUTE_RUNTIME_LIB"
_LIB_NAME = "libcute_dsl_runtime.so"

_lock = threading.Lock()
_registered = False


class RuntimeLibraryNotFoundError(RuntimeError):
    """The CuTe-DSL runtime library could not be located."""


def find_runtime_library() -> Path:
    """Path of ``libcute_dsl_runtime.so``: ``$JAX_FA4_CUTE_RUNTIME_LIB``, else the installed
    wheel."""
    env = os.environ.get(ENV_RUNTIME_LIB)
    if env:
        path = Path(env)
        if not path.is_file():
            raise RuntimeLibraryNotFoundError(f"{ENV_RUNTIME_LIB}={env} is not a file")
        return path
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            for cuda_major in ("cu13", "cu12"):
                path = Path(root) / cuda_major / "lib" / _LIB_NAME
                if path.is_file():
                    return path
    raise RuntimeLibraryNotFoundError(
        f"the CuTe-DSL runtime library ({_LIB_NAME}) was not found: install "
        f"nvidia-cutlass-dsl (pip install 'jax-fa4[cuda13]') or set {ENV_RUNTIME_LIB} to its path")


@functools.cache
def _load_library() -> ctypes.CDLL:
    return ctypes.CDLL(str(find_runtime_library()))


def _capsule(lib: ctypes.CDLL, symbol: str, call: bool = False):
    fn = getattr(lib, symbol)
    fn.restype = ctypes.c_void_p
    return jax.ffi.pycapsule(fn() if call else fn)


def register_ffi_targets() -> None:
    """Register the runtime library's FFI type and call target with JAX (idempotent)."""
    global _registered
    with _lock:
        if _registered:
            return
        lib = _load_library()
        jax.ffi.register_ffi_type(
            _STATE_TYPE,
            {field: _capsule(lib, sym, call=True) for field, sym in _STATE_TYPE_SYMBOLS.items()},
            platform="CUDA",
        )
        jax.ffi.register_ffi_target(
            CALL_TARGET,
            {stage: _capsule(lib, sym) for stage, sym in _CALL_STAGES.items()},
            platform="CUDA",
        )
        _registered = True


def export_disabled_safety_checks() -> tuple[jax.export.DisabledSafetyCheck, ...]:
    """The safety checks ``jax.export`` must skip for a function that calls jax-fa4 kernels.

    ``jax.export`` refuses custom calls it does not know to be stable; jax-fa4's kernels are custom
    calls to the CuTe-DSL runtime's handler, with the kernel object embedded in the call::

        exported = jax.export.export(
            jax.jit(f), disabled_checks=jax_fa4.export_disabled_safety_checks())(*args)

    The process that runs the deserialized artifact needs the runtime library (it registers the
    handler when jax_fa4 is imported and a kernel is first called, or explicitly through
    :func:`register_ffi_targets`).
    """
    return (jax.export.DisabledSafetyCheck.custom_call(CALL_TARGET),)
