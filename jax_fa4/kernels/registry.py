"""Which module launches each kernel config: the one binding of config classes to kernels.

Configs never import their kernels (a kernel module imports its config). Each family's launcher
module is named here as a string and imported only when a config is compiled, so the runtime path,
which looks kernels up in the cache, never imports the compiler. The launcher module's import
closure (:func:`jax_fa4.ffi.sources.closure`) is also what the cache key hashes.

A launcher module defines ``make_launcher(config)``, returning the ``@cute.jit`` callable
``fn(stream, *inputs, *outputs)`` of the config's signature.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from jax_fa4.kernels.spec import KernelConfig

#: kernel_name -> the dotted name of its launcher module
LAUNCHERS: dict[str, str] = {
    "bwd_preprocess": "jax_fa4.kernels.preprocess",
    "sm90_fwd": "jax_fa4.kernels.sm90.flash_fwd",
    "sm90_bwd": "jax_fa4.kernels.sm90.bwd",
    "sm90_bwd_pair": "jax_fa4.kernels.sm90.bwd_pair",
    "sm90_bwd_postprocess": "jax_fa4.kernels.sm90.bwd_postprocess",
    "sm100_fwd": "jax_fa4.kernels.sm100.flash_fwd",
    "sm100_bwd": "jax_fa4.kernels.sm100.bwd_launcher",
    "sm100_bwd_split": "jax_fa4.kernels.sm100.bwd_split",
    "exp2_probe": "jax_fa4.kernels.exp2_probe",
}


def launcher_module(config: KernelConfig) -> str:
    """The dotted name of the module that launches ``config``'s kernel."""
    try:
        return LAUNCHERS[config.kernel_name]
    except KeyError:
        raise ValueError(f"no launcher registered for kernel {config.kernel_name!r} "
                         f"(known: {sorted(LAUNCHERS)})") from None


def make_launcher(config: KernelConfig) -> Callable[..., Any]:
    """Validate ``config``, import its launcher module (and with it the CuTe-DSL compiler) and
    return its ``@cute.jit`` launcher."""
    config.validate()
    return importlib.import_module(launcher_module(config)).make_launcher(config)
