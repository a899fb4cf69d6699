"""Shared test setup: the ``gpu`` marker skips cleanly without a Hopper GPU."""

from __future__ import annotations

import os

import pytest


def _skip_xla_gemm_autotuning() -> None:
    """XLA autotunes every GEMM of every program it compiles for a GPU; the GPU tests compile a
    float32 reference per shape, and autotuning made that ~20x slower than the kernels they
    check. Tests compare numbers, not speed: turn it off (only where the CUDA plugin, which
    knows the flag, is installed; set before the first backend initialisation)."""
    import importlib.util

    if not any(importlib.util.find_spec(m) for m in ("jax_cuda13_plugin", "jax_cuda12_plugin")):
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_autotune_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_autotune_level=0".strip()


_skip_xla_gemm_autotuning()


def hopper_available() -> bool:
    import jax

    try:
        device = jax.devices()[0]
    except RuntimeError:
        return False
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not hopper_available():
        skip = pytest.mark.skip(reason="needs an NVIDIA Hopper GPU (compute capability 9.0)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private, empty kernel cache for one test."""
    from jax_fa4.ffi import call

    path = tmp_path / "kernel-cache"
    monkeypatch.setenv("JAX_FA4_CACHE_DIR", str(path))
    call.clear_memory_cache()
    yield path
    call.clear_memory_cache()


@pytest.fixture(scope="session")
def shipped_cache(tmp_path_factory):
    """Every shipped kernel variant, for sm_90a and sm_100a, compiled once per test session.

    Compile tests read their objects from here instead of compiling again (CI time)."""
    from jax_fa4 import precompile
    from jax_fa4.ffi.cache import KernelCache

    root = tmp_path_factory.mktemp("shipped-kernels")
    assert precompile.main(["--cache-dir", str(root), "--quiet"]) == 0
    return KernelCache(root)


os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
