"""The backends registry: ``implementation=`` name -> backend, and which one a call runs.

Backends (:class:`jax_fa4.backends.base.Backend`): ``"reference"`` (pure JAX, any device),
``"sm90"`` (Hopper kernels, compute capability 9.0), ``"sm100"`` (Blackwell kernels, compute
capability 10.x; opt-in, see below). Adding one (a new GPU family) is a module with a
:class:`~jax_fa4.backends.kernel.KernelBackend` subclass and its line in :data:`BACKENDS`.

``implementation=None`` picks the backend whose GPUs the default device is, and the reference
otherwise. An opt-in backend (``enable_env``: the sm100 kernels are compiled and inspected but
have never run on a Blackwell GPU in this project) is picked only with its variable set
(``JAX_FA4_ENABLE_SM100=1``); otherwise its GPU gets the reference with a one-time warning that
says why.

Forcing a kernel backend on a GPU of another family raises
:class:`~jax_fa4.backends.base.ImplementationUnavailableError`. With no GPU at all, a forced
kernel is traced normally (so ``jax.export`` for CUDA works on a CPU machine) and lowering for
the CPU raises the same error.
"""

from __future__ import annotations

import functools
import os
import warnings

import jax

from jax_fa4.backends.base import (REFERENCE, REFERENCE_BACKEND, Backend,
                                   ImplementationUnavailableError)
from jax_fa4.backends.sm90 import Sm90Backend
from jax_fa4.backends.sm100 import Sm100Backend

__all__ = ["BACKENDS", "REFERENCE", "Backend", "ImplementationUnavailableError", "get", "names",
           "select"]

#: Every registered backend by name, in the order errors list them (the registration line).
BACKENDS: dict[str, Backend] = {b.name: b for b in (REFERENCE_BACKEND, Sm90Backend(),
                                                    Sm100Backend())}


def names() -> tuple[str, ...]:
    """The valid ``implementation=`` names."""
    return tuple(BACKENDS)


def get(name: str) -> Backend:
    """The backend registered as ``name`` (a resolved implementation)."""
    return BACKENDS[name]


def gpu_compute_capability() -> str | None:
    """Compute capability (``"9.0"``) of the default backend's first device, None if not a GPU."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return None
    if device.platform != "gpu":
        return None
    return getattr(device, "compute_capability", None)


def _native(cc: str | None) -> Backend | None:
    """The backend whose kernels run on GPUs of compute capability ``cc``."""
    if cc is None:
        return None
    major = cc.split(".")[0]
    return next((b for b in BACKENDS.values() if b.compute_capability == major), None)


@functools.cache
def _warn_not_enabled(name: str) -> None:
    backend = BACKENDS[name]
    warnings.warn(
        f"jax_fa4: this is a {backend.gpu_family} GPU, but the {name} kernels have not been "
        f"validated on hardware by this project, so the pure-JAX reference runs instead. Set "
        f"{backend.enable_env}=1 or pass implementation='{name}' to use them.",
        RuntimeWarning, stacklevel=4)


def select(requested: str | None) -> str:
    """The backend a call runs (its name), for ``implementation=requested``.

    Raises:
      ValueError: ``requested`` is not a registered name.
      ImplementationUnavailableError: ``requested`` is a kernel backend and the default device
        is a GPU of another family.
    """
    if requested is not None and requested not in BACKENDS:
        raise ValueError(f"implementation must be None or one of {names()}, "
                         f"got {requested!r}")
    if requested is not None and BACKENDS[requested].compute_capability is None:
        return requested  # runs on any device
    cc = gpu_compute_capability()
    native = _native(cc)
    if requested is None:
        if native is None:
            return REFERENCE
        if native.enable_env and os.environ.get(native.enable_env, "") not in ("1", "true"):
            _warn_not_enabled(native.name)
            return REFERENCE
        return native.name
    if cc is not None and (native is None or native.name != requested):
        raise ImplementationUnavailableError(
            f"implementation={requested!r} needs a GPU of compute capability "
            f"{BACKENDS[requested].capability_text}, but the default device has {cc}")
    return requested
