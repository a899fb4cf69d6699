"""Shared test setup: the test tiers, the test run's kernel cache, the ``gpu`` marker.

* ``--exhaustive``: every shipped kernel variant compiled and SASS-checked (tests/compiled.py);
  without it, the quick tier's: one kernel per arch × kernel kind × mode.
* ``gpu`` tests skip cleanly without a Hopper GPU, unless ``JAX_FA4_REQUIRE_GPU=1`` (the GPU
  machine's runs set it): then a missing Hopper GPU fails them, and so does a call that would
  run the pure-JAX reference where a kernel was expected (tests/gpu/conftest.py).
"""

from __future__ import annotations

import fcntl
import os

import pytest

import compiled

ENV_REQUIRE_GPU = "JAX_FA4_REQUIRE_GPU"


def require_gpu() -> bool:
    """``JAX_FA4_REQUIRE_GPU=1``: GPU tests must run, not skip."""
    return os.environ.get(ENV_REQUIRE_GPU, "") not in ("", "0")


def pytest_addoption(parser):
    parser.addoption("--exhaustive", action="store_true",
                     help="compile and SASS-check every shipped kernel variant (run after any "
                          "change under jax_fa4/kernels/); default: the representative ones")


def pytest_configure(config):
    compiled.EXHAUSTIVE = config.getoption("--exhaustive")
    if os.environ.get("JAX_FA4_TEST_XLA_CACHE", "1") != "0" and not _cuda_plugin_installed():
        _share_xla_compilations(config)


def _share_xla_compilations(config) -> None:
    """XLA's persistent compilation cache in ``.pytest_cache``, shared by the xdist workers and
    by later runs: many tests compile the same small programs (the reference at a few shapes,
    the same options through several entry points), and on a 2-core machine compiling them is
    most of a test's time (CPU runs only: the GPU suite keeps XLA's defaults). Keys hash the
    program, the compile options and the jax/XLA version, so an entry never serves a different
    program. ``JAX_FA4_TEST_XLA_CACHE=0`` turns it off."""
    if getattr(config, "cache", None) is None:  # -p no:cacheprovider
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", str(config.cache.mkdir("jax-compilation")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _cuda_plugin_installed() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) for m in ("jax_cuda13_plugin", "jax_cuda12_plugin"))


def _add_xla_flags(*flags: str) -> None:
    """Append each ``--name=value`` to XLA_FLAGS unless the name is set already (before the
    first backend initialisation)."""
    current = os.environ.get("XLA_FLAGS", "")
    for flag in flags:
        if flag.split("=")[0] not in current:
            current = f"{current} {flag}".strip()
    os.environ["XLA_FLAGS"] = current


if _cuda_plugin_installed():
    # XLA autotunes every GEMM of every program it compiles for a GPU; the GPU tests compile a
    # float32 reference per shape, and autotuning made that ~20x slower than the kernels they
    # check. Tests compare numbers, not speed: turn it off.
    _add_xla_flags("--xla_gpu_autotune_level=0")
else:
    # On a CPU-only machine XLA's LLVM optimisation of each test program costs more than running
    # it (the programs are tiny): the backend's cheapest settings (no numerical effect: the same
    # IEEE operations, scheduled less cleverly). The GPU suite keeps XLA's defaults.
    _add_xla_flags("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def hopper_available() -> bool:
    import jax

    try:
        device = jax.devices()[0]
    except RuntimeError:
        return False
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


def pytest_collection_finish(session):
    compiled.REQUESTED[:] = compiled.requested_variants(session.items)


def pytest_collection_modifyitems(config, items):
    kept, deselected = compiled.select_tier(items)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
    if any("gpu" in item.keywords for item in items) and not hopper_available():
        if require_gpu():
            raise pytest.UsageError(f"{ENV_REQUIRE_GPU}=1 but no NVIDIA Hopper GPU (compute "
                                    "capability 9.0) is the default JAX device")
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
def shipped_cache(request):
    """The checkout's test kernel cache, holding the tier's shipped variants for sm_90a and
    sm_100a (the quick tier's representatives, or every one with ``--exhaustive``) and every
    variant a collected test's ``tiered`` list names, compiled in parallel on first use;
    compile tests read their objects from it (and add what else they compile). It persists in
    ``.pytest_cache`` (keys hash the kernel sources, so edits rekey)."""
    from jax_fa4.tools import precompile
    from jax_fa4.ffi.cache import KernelCache
    from jax_fa4.tools.variants import variants

    if getattr(request.config, "cache", None) is not None:
        root = request.config.cache.mkdir("jax-fa4-kernels")
    else:  # -p no:cacheprovider
        root = request.getfixturevalue("tmp_path_factory").mktemp("jax-fa4-kernels")
    cache = KernelCache(root)
    compiled.SASS_DIR = root / "sass"
    selected = (variants("default") if compiled.EXHAUSTIVE
                else list(compiled.shipped_representatives()))
    selected = list(dict.fromkeys(selected + compiled.REQUESTED))
    # pytest-xdist workers share the cache: the first to get here builds on every core while
    # the others wait, then find everything cached
    with open(root / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        precompile.build(selected, cache, progress=False, jobs=os.cpu_count() or 1)
    return cache


os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
