"""The benchmark's environment facts, recorded in every result file: the GPU's state from
nvidia-smi (clocks, temperature, power, throttle reasons), the driver, and the versions of the
stack (jax, jaxlib, the CUDA plugin, cuDNN, and where the CuTe-DSL kernels and runtime come from).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import jax

import jax_fa4

#: nvidia-smi fields recorded before and after the sweep (each None where the driver lacks it).
GPU_QUERY_FIELDS = ("name", "driver_version", "clocks.sm", "clocks.mem", "clocks.max.sm",
                    "clocks.max.mem", "temperature.gpu", "power.draw",
                    "clocks_throttle_reasons.active")


def error_text(err: BaseException) -> str:
    """An error as a result file records it: its type and first line, at most 400 characters."""
    lines = [ln for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:400]


def _nvidia_smi(fields: Sequence[str]) -> list[list[str]] | None:
    """``nvidia-smi --query-gpu=FIELDS`` as one list of values per GPU, None when it fails."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    values = [[x.strip() for x in ln.split(",")] for ln in lines]
    return values if values and all(len(v) == len(fields) for v in values) else None


def _smi_value(text: str) -> str | float | None:
    """A number where nvidia-smi printed one; None for its "[N/A]"-style placeholders."""
    if not text or text.startswith("[") or text.lower() in ("n/a", "not supported"):
        return None
    try:
        return float(text)
    except ValueError:
        return text


def gpu_state(fields: Sequence[str] = GPU_QUERY_FIELDS) -> list[dict[str, Any]] | None:
    """Name, driver, clocks, temperature, power and throttle reasons of each GPU (nvidia-smi),
    None without nvidia-smi. Fields are asked for together, else one by one: a field this driver
    does not know is None (the throttle reasons are also tried under their newer name,
    ``clocks_event_reasons.active``)."""
    if shutil.which("nvidia-smi") is None:
        return None
    together = _nvidia_smi(fields)
    if together is not None:
        return [dict(zip(fields, map(_smi_value, gpu))) for gpu in together]
    columns: dict[str, list[Any] | None] = {}
    for field in fields:
        got = _nvidia_smi([field])
        if got is None and field == "clocks_throttle_reasons.active":
            got = _nvidia_smi(["clocks_event_reasons.active"])
        columns[field] = None if got is None else [_smi_value(v[0]) for v in got]
    count = max((len(c) for c in columns.values() if c is not None), default=0)
    if count == 0:
        return None
    return [{f: (c[i] if c is not None and i < len(c) else None) for f, c in columns.items()}
            for i in range(count)]


def driver_version(state: list[dict[str, Any]] | None = None) -> str | None:
    """The NVIDIA driver version (from ``gpu_state``), None without nvidia-smi."""
    state = gpu_state(("driver_version",)) if state is None else state
    value = state[0].get("driver_version") if state else None
    return None if value is None else str(value)


def cute_dsl_versions() -> dict[str, Any]:
    """Where the CuTe-DSL kernels and runtime come from: ``nvidia-cutlass-dsl``'s version when
    installed; the DSL versions recorded in the kernel cache's entries (a machine with only the
    runtime library runs kernels compiled elsewhere), with their counts; the runtime library."""
    from jax_fa4.ffi import cache as kernel_cache
    from jax_fa4.ffi import runtime

    found: dict[str, Any] = {"nvidia-cutlass-dsl": None, "kernel_cache": None,
                             "kernel_cache_dsl_versions": {},
                             "runtime_library": os.environ.get(runtime.ENV_RUNTIME_LIB)}
    try:
        found["nvidia-cutlass-dsl"] = importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        store = kernel_cache.KernelCache()
        found["kernel_cache"] = str(store.root)
        counts: dict[str, int] = {}
        for meta in store.entries():
            version = str(meta.get("dsl_version"))
            counts[version] = counts.get(version, 0) + 1
        found["kernel_cache_dsl_versions"] = dict(sorted(counts.items()))
    except Exception as err:  # an unreadable cache only leaves the versions out
        found["kernel_cache_error"] = error_text(err)
    if found["runtime_library"] is None:
        try:
            found["runtime_library"] = str(runtime.find_runtime_library())
        except Exception:
            pass
    return found


def versions() -> dict[str, Any]:
    """Versions of the stack, each probe guarded."""
    found: dict[str, Any] = {"python": sys.version.split()[0], "jax": jax.__version__}
    for dist in ("jaxlib", "jax-fa4", "jax-cuda13-plugin", "jax-cuda13-pjrt",
                 "jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cudnn-cu13",
                 "nvidia-cudnn-cu12", "nvidia-cutlass-dsl"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    found["jax_fa4"] = jax_fa4.__version__
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        cuda_versions = None
    if cuda_versions is not None:
        for name, probe in (("cudnn", "cudnn_get_version"),
                            ("cuda_runtime", "cuda_runtime_get_version"),
                            ("cuda_driver", "cuda_driver_get_version")):
            try:
                found[name] = getattr(cuda_versions, probe)()
            except Exception:  # a missing or failing probe only leaves the entry out
                pass
    try:
        found["cute_dsl"] = cute_dsl_versions()
    except Exception as err:
        found["cute_dsl"] = {"error": error_text(err)}
    return found


class RunRecord:
    """What every result file opens with, for one run on ``device``: the GPU, its platform,
    the driver, the stack's versions and the GPU's state, read once when the run starts, the
    command that made the file and the date it was written (``header``)."""

    def __init__(self, device: Any, command: str):
        self.device, self.command = device, command
        self.state_before = gpu_state()
        self.driver = driver_version(self.state_before)
        self.versions = versions()

    def header(self, complete: bool) -> dict[str, Any]:
        """The result file's opening fields; the GPU's state after the run once ``complete``."""
        return {
            "gpu": self.device.device_kind,
            "platform": self.device.platform,
            "driver": self.driver,
            "versions": self.versions,
            "gpu_state": {"before": self.state_before,
                          "after": gpu_state() if complete else None},
            "command": self.command,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        }
