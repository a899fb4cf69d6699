"""Reading compiled kernels in tests: objects from the session's shipped cache, SASS reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CUBIN_REPORT = Path(__file__).resolve().parent.parent.parent / "shared" / "tools" / "cubin_report.py"
#: SASS checks need ../shared/tools/cubin_report.py beside the checkout
needs_cubin_report = pytest.mark.skipif(not CUBIN_REPORT.is_file(),
                                        reason="../shared/tools/cubin_report.py missing")


def compiled_object(cache, config, arch: str) -> bytes:
    """The object of ``config`` for ``arch``: from the ``shipped_cache`` fixture when it is a
    shipped variant (compiled once per session), else compiled now."""
    return shipped_object(cache, config, arch)[0]


def shipped_object(cache, config, arch: str) -> tuple[bytes, float]:
    """(object, compile seconds) of ``config`` for ``arch``, like :func:`compiled_object` (the
    seconds are the precompile's when the ``shipped_cache`` fixture has it)."""
    from jax_fa4.ffi.compiler import compile_config, dsl_version

    entry = cache.get(config, arch, dsl_version())
    if entry is not None:
        return entry.object_bytes, float(entry.meta.get("compile_seconds", float("nan")))
    compiled = compile_config(config, arch)
    return compiled.object_bytes, compiled.seconds


def sass_report(obj: bytes, tmp_path: Path) -> list[dict]:
    """``cubin_report.py --json`` of an object: one dict per kernel (reg, stack, local, ops...)."""
    path = tmp_path / "kernel.o"
    path.write_bytes(obj)
    res = subprocess.run([sys.executable, str(CUBIN_REPORT), str(path), "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(res.stdout)


#: Static shared memory every cubin lists: the system's per-CTA reservation.
RESERVED_SMEM_BYTES = 1024


def shipped_sass_problems(cache, configs, arch: str, kernel_name: str, tmp_path: Path,
                          must_have: tuple[str, ...]) -> list[str]:
    """Read every config's object from ``cache`` (compiled once per session by the
    ``shipped_cache`` fixture) and report, in one cubin_report.py run, each kernel named
    ``kernel_name`` that spills, has a stack frame, uses over 255 registers or over 227 KB of
    shared memory (``config.smem_bytes()`` plus any static beyond the reserved 1 KB), or lacks one of the ``must_have``
    instructions. Returns one line per problem (empty: all clean)."""
    paths = []
    for i, cfg in enumerate(configs):
        path = tmp_path / f"v{i}.o"
        path.write_bytes(compiled_object(cache, cfg, arch))
        paths.append(str(path))
    res = subprocess.run([sys.executable, str(CUBIN_REPORT), *paths, "--json"],
                         capture_output=True, text=True, check=True)
    by_file: dict[str, list[dict]] = {}
    for row in json.loads(res.stdout):
        if kernel_name in row["kernel"]:
            by_file.setdefault(row["file"], []).append(row)
    problems = []
    for i, cfg in enumerate(configs):
        rows = by_file.get(f"v{i}.o", [])
        if len(rows) != 1:
            problems.append(f"{cfg.describe()}: {len(rows)} {kernel_name} kernels")
            continue
        r, ops = rows[0], rows[0]["ops"]
        if ops.get("LDL", 0) or ops.get("STL", 0) or r.get("local", 0) or r.get("stack", 0):
            problems.append(f"{cfg.describe()}: spills (LDL {ops.get('LDL', 0)}, STL "
                            f"{ops.get('STL', 0)}, stack {r.get('stack')})")
        # the cubin's 1 KB of static shared memory is the system's per-CTA reservation
        # (.nv.shared.reserved), outside the 227 KB a CTA may use
        shared = max(r.get("shared_static", 0) - RESERVED_SMEM_BYTES, 0) + cfg.smem_bytes()
        if r.get("reg", 0) > 255 or shared > 227 * 1024:
            problems.append(f"{cfg.describe()}: {r.get('reg')} registers, {shared} B shared "
                            "memory")
        missing = [op for op in must_have if not ops.get(op, 0)]
        if missing:
            problems.append(f"{cfg.describe()}: no {', '.join(missing)}")
    return problems
