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
    from jax_fa4.ffi.compiler import compile_config, dsl_version

    entry = cache.get(config, arch, dsl_version())
    return entry.object_bytes if entry is not None else compile_config(config, arch).object_bytes


def sass_report(obj: bytes, tmp_path: Path) -> list[dict]:
    """``cubin_report.py --json`` of an object: one dict per kernel (reg, stack, local, ops...)."""
    path = tmp_path / "kernel.o"
    path.write_bytes(obj)
    res = subprocess.run([sys.executable, str(CUBIN_REPORT), str(path), "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(res.stdout)
