"""Which implementation runs: a kernel for this GPU, or the pure-JAX reference.

Implementations: ``"reference"`` (pure JAX, any backend), ``"sm90"`` (Hopper kernels, compute
capability 9.0), ``"sm100"`` (Blackwell kernels, compute capability 10.x; opt-in, see below).

``implementation=None`` picks the kernel for the default backend's GPU when there is one and falls
back to the reference otherwise. The sm100 kernels are compiled and inspected but have never run on
a Blackwell GPU in this project, so they are used only when forced (``implementation="sm100"``) or
enabled with ``JAX_FA4_ENABLE_SM100=1``; otherwise a Blackwell GPU gets the reference with a
one-time warning that says why.

Forcing a kernel on a GPU of another arch raises :class:`ImplementationUnavailableError`. With no
GPU at all, a forced kernel is traced normally (so ``jax.export`` for CUDA works on a CPU machine)
and lowering for the CPU raises the same error.
"""

from __future__ import annotations

import functools
import os
import warnings

import jax

IMPLEMENTATIONS = ("reference", "sm90", "sm100")
KERNEL_ARCH = {"sm90": "sm_90a", "sm100": "sm_100a"}
ENV_ENABLE_SM100 = "JAX_FA4_ENABLE_SM100"


class ImplementationUnavailableError(RuntimeError):
    """A forced implementation cannot run here (wrong GPU, missing feature, ...)."""


def gpu_compute_capability() -> str | None:
    """Compute capability (``"9.0"``) of the default backend's first device, None if not a GPU."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return None
    if device.platform != "gpu":
        return None
    return getattr(device, "compute_capability", None)


def _kernel_for_capability(cc: str) -> str | None:
    major = cc.split(".")[0]
    return {"9": "sm90", "10": "sm100"}.get(major)


@functools.cache
def _warn_sm100_not_enabled() -> None:
    warnings.warn(
        "jax_fa4: this is a Blackwell GPU, but the sm100 kernels have not been validated on "
        f"hardware by this project, so the pure-JAX reference runs instead. Set "
        f"{ENV_ENABLE_SM100}=1 or pass implementation='sm100' to use them.",
        RuntimeWarning, stacklevel=4)


def resolve_implementation(requested: str | None) -> str:
    """The implementation family to use: ``"reference"``, ``"sm90"`` or ``"sm100"``."""
    if requested is not None and requested not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, "
                         f"got {requested!r}")
    if requested == "reference":
        return requested
    cc = gpu_compute_capability()
    native = _kernel_for_capability(cc) if cc else None
    if requested is None:
        if native == "sm100" and os.environ.get(ENV_ENABLE_SM100, "") not in ("1", "true"):
            _warn_sm100_not_enabled()
            return "reference"
        return native or "reference"
    if cc is not None and native != requested:
        raise ImplementationUnavailableError(
            f"implementation={requested!r} needs a GPU of compute capability "
            f"{'9.0' if requested == 'sm90' else '10.x'}, but the default device has {cc}")
    return requested
