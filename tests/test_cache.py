"""The persistent kernel cache: hits, misses, corrupt entries, concurrency, safety."""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest

from jax_fa4.ffi import call, compiler
from jax_fa4.ffi.cache import KernelCache, UnsafeCacheError
from jax_fa4.kernels.preprocess_config import PreprocessConfig

CFG = PreprocessConfig("bfloat16", 128)
ARCH = "sm_90a"


def _count_compiles(monkeypatch) -> list:
    calls = []
    real = compiler.compile_config

    def counting(config, arch):
        calls.append((config, arch))
        return real(config, arch)

    monkeypatch.setattr(compiler, "compile_config", counting)
    return calls


def test_miss_compiles_then_hits(cache_dir, monkeypatch):
    calls = _count_compiles(monkeypatch)
    first = call.kernel_object(CFG, ARCH)
    call.clear_memory_cache()
    second = call.kernel_object(CFG, ARCH)
    assert first == second and len(calls) == 1
    entry = KernelCache(cache_dir).get(CFG, ARCH, compiler.dsl_version())
    assert entry.meta["config"] == CFG.key_dict() and entry.meta["arch"] == ARCH
    assert entry.meta["dsl_version"] == compiler.dsl_version()
    assert (cache_dir / ARCH).stat().st_mode & 0o777 == 0o700


def test_key_separates_config_and_arch(cache_dir):
    cache = KernelCache(cache_dir)
    version = compiler.dsl_version()
    digests = {cache.digest(c, a, version) for c in (CFG, PreprocessConfig("float16", 128),
                                                     PreprocessConfig("bfloat16", 64))
               for a in ("sm_90a", "sm_100a")}
    assert len(digests) == 6
    assert cache.digest(CFG, ARCH, "4.8.1") != cache.digest(CFG, ARCH, "4.9.0")


@pytest.mark.parametrize("damage", ["truncate", "flip", "bad_json", "drop_meta"])
def test_corrupt_entry_is_rebuilt(cache_dir, monkeypatch, damage):
    good = call.kernel_object(CFG, ARCH)
    call.clear_memory_cache()
    obj = next((cache_dir / ARCH).glob("*.o"))
    meta = obj.with_suffix(".json")
    if damage == "truncate":
        obj.write_bytes(good[: len(good) // 2])
    elif damage == "flip":
        obj.write_bytes(bytes([good[0] ^ 1]) + good[1:])
    elif damage == "bad_json":
        meta.write_text("{not json")
    else:
        meta.unlink()
    calls = _count_compiles(monkeypatch)
    assert KernelCache(cache_dir).get(CFG, ARCH, compiler.dsl_version()) is None
    rebuilt = call.kernel_object(CFG, ARCH)
    assert len(calls) == 1 and len(rebuilt) > 0
    assert KernelCache(cache_dir).get(CFG, ARCH, compiler.dsl_version()) is not None


def test_without_compiler_a_miss_names_the_kernel_and_the_command(cache_dir, monkeypatch):
    monkeypatch.setattr(compiler, "dsl_version", lambda: None)
    with pytest.raises(call.KernelNotAvailableError) as info:
        call.kernel_object(CFG, ARCH)
    msg = str(info.value)
    assert "bwd_preprocess(dtype=bfloat16, head_dim_v=128, zero_dq_accum=False)" in msg
    assert "python -m jax_fa4.tools.precompile" in msg and str(cache_dir) in msg


def test_without_compiler_any_dsl_version_entry_is_used(cache_dir, monkeypatch):
    built = call.kernel_object(CFG, ARCH)
    call.clear_memory_cache()
    monkeypatch.setattr(compiler, "dsl_version", lambda: None)
    assert call.kernel_object(CFG, ARCH) == built
    monkeypatch.setenv("JAX_FA4_DSL_VERSION", "0.0.1")  # pinned to a version nobody built
    call.clear_memory_cache()
    with pytest.raises(call.KernelNotAvailableError):
        call.kernel_object(CFG, ARCH)


def test_group_writable_directory_is_refused(cache_dir):
    call.kernel_object(CFG, ARCH)
    call.clear_memory_cache()
    os.chmod(cache_dir, 0o777)
    with pytest.raises(UnsafeCacheError, match="writable by group or others"):
        call.kernel_object(CFG, ARCH)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to hand the directory to another user")
def test_directory_of_another_user_is_refused(cache_dir):
    cache_dir.mkdir(mode=0o700)
    os.chown(cache_dir, 12345, -1)
    with pytest.raises(UnsafeCacheError, match="owned by uid 12345"):
        call.kernel_object(CFG, ARCH)


def _worker(root: str, queue) -> None:
    os.environ["JAX_FA4_CACHE_DIR"] = root
    from jax_fa4.ffi import call as worker_call
    from jax_fa4.ffi import compiler as worker_compiler

    compiled = []
    real = worker_compiler.compile_config
    worker_compiler.compile_config = lambda c, a: compiled.append(1) or real(c, a)
    data = worker_call.kernel_object(CFG, ARCH)
    queue.put((len(data), len(compiled)))


def test_concurrent_writers_compile_once(cache_dir):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(cache_dir), queue)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    sizes = {size for size, _ in results}
    assert len(sizes) == 1 and sizes.pop() > 0
    assert sum(n for _, n in results) == 1  # one compiled; the others waited on the lock and hit
    metas = list((cache_dir / ARCH).glob("*.json"))
    assert len(metas) == 1 and json.loads(metas[0].read_text())["sha256"]
