"""Compiled kernels in tests: the test tiers, the test run's kernel cache, SASS reports.

Two tiers (docs/development.md):

* **quick** (``python -m pytest``, what CI runs): one compiled kernel per arch × kernel kind ×
  mode (``jax_fa4.tools.variants.family_mode_class``): the shipped-variant SASS check over one
  shipped variant of each such class, and each compile test over one config of each class of
  its :func:`tiered` list (a shipped one where it can, so the two share their compiles). A new
  kernel family or mode adds one kernel per arch to the tier, a new option or head dim none;
* **exhaustive** (``python -m pytest --exhaustive``; run it after any change under
  ``jax_fa4/kernels/``): every listed and every shipped variant.

Tests with many cases of a few kinds take their parameters through :func:`per_class`: the
quick tier runs one case per kind, ``--exhaustive`` all of them.

Objects come from one kernel cache per checkout (``.pytest_cache/d/jax-fa4-kernels``, keyed by
config, arch, kernel sources and DSL version like any jax-fa4 cache), so a variant is compiled
once, not once per test or per run; the run-wide fixture ``shipped_cache`` fills it in parallel.
Disassembly is :mod:`jax_fa4.tools.sass` (NVIDIA's cuobjdump / nvdisasm wheels, the test extra).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Hashable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import pytest

from jax_fa4.tools import sass
from jax_fa4.tools.variants import Variant, family_mode_class, representative, variants

T = TypeVar("T")

#: Set from ``--exhaustive`` by tests/conftest.py before any test module is collected.
EXHAUSTIVE = False
#: Every :func:`tiered` list (as variants), in the order the test modules registered them.
_LISTS: list[tuple[Variant, ...]] = []
#: The variants the selected tests take as parameters (tests/conftest.py fills it once
#: collection is done, so the run-wide fixture compiles them all in parallel up front).
REQUESTED: list[Variant] = []


def _tiered_variant(item) -> tuple[int, Variant] | None:
    """(list index, variant) of the :func:`tiered` parameter of a collected test ``item``."""
    marker = item.get_closest_marker("tiered")
    return None if marker is None else marker.args


def select_tier(items) -> tuple[list, list]:
    """(kept, deselected) ``items``: in the quick tier a test over a :func:`tiered` list runs
    the list's :func:`quick_choice` only; with ``--exhaustive`` everything runs."""
    if EXHAUSTIVE:
        return list(items), []
    chosen = [quick_choice(i) for i in range(len(_LISTS))]
    kept, dropped = [], []
    for item in items:
        found = _tiered_variant(item)
        (kept if found is None or found[1] in chosen[found[0]] else dropped).append(item)
    return kept, dropped


def requested_variants(items) -> list[Variant]:
    """The :func:`tiered` variants among the parameters of the collected test ``items``."""
    found = (_tiered_variant(item) for item in items)
    return list(dict.fromkeys(f[1] for f in found if f is not None))


def _disassembler_missing() -> str | None:
    try:
        sass.cuobjdump_path()
    except sass.DisassemblerNotFoundError as err:
        return str(err)
    return None


#: SASS checks need NVIDIA's disassembler wheels (``pip install -e '.[test]'``)
_MISSING = _disassembler_missing()
needs_disassembler = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")


def quick_sample(selected: Sequence[Variant], prefer: Iterable[Variant] = ()) -> list[Variant]:
    """The quick tier's rule: one of ``selected`` per arch × kernel kind × mode, a variant of
    ``prefer`` winning (``variants.representative`` with ``family_mode_class``)."""
    return representative(selected, prefer=set(prefer), every_value=False,
                          classes=family_mode_class)


@functools.cache
def shipped_representatives() -> tuple[Variant, ...]:
    """The quick tier's shipped variants (every arch and family): :func:`quick_sample` of the
    shipped set, preferring the variants the collected compile tests list (so that their own
    quick-tier choice is mostly compiled anyway). Called once collection is done."""
    listed = {v for members in _LISTS for v in members}
    return tuple(quick_sample(variants("default"), prefer=listed))


def tiered(configs: Iterable, arch: str) -> list:
    """``configs`` for ``arch`` as test parameters, each marked with its list: every one runs
    with ``--exhaustive``; the quick tier keeps :func:`quick_choice` (tests/conftest.py
    deselects the rest once every list is known)."""
    members = tuple(Variant(c, arch) for c in dict.fromkeys(configs))
    _LISTS.append(members)
    index = len(_LISTS) - 1
    return [pytest.param(v.config, marks=pytest.mark.tiered(index, v)) for v in members]


def quick_choice(index: int) -> set[Variant]:
    """The quick tier's members of :func:`tiered` list ``index``: :func:`quick_sample` of the
    list, a shipped representative winning; every member runs with ``--exhaustive``."""
    return set(quick_sample(_LISTS[index], prefer=shipped_representatives()))


def per_class(params: Sequence[T], key: Callable[[T], Hashable]) -> list[T]:
    """A parametrize list for both tiers: with ``--exhaustive`` all of ``params``; in the quick
    tier the first of each class ``key(param)`` (for tests whose cases are many variations of a
    few kinds, each kind still runs in CI). Read at collection time (``EXHAUSTIVE`` is set by
    then)."""
    if EXHAUSTIVE:
        return list(params)
    first: dict[Hashable, T] = {}
    for param in params:
        first.setdefault(key(param), param)
    return list(first.values())


def shipped_object(cache, config, arch: str) -> tuple[bytes, float]:
    """(object, compile seconds) of ``config`` for ``arch`` from ``cache`` (the test run's),
    compiled and stored there first when missing."""
    from jax_fa4.ffi.compiler import compile_config, dsl_version

    version = dsl_version()
    entry = cache.get(config, arch, version)
    if entry is None:
        compiled = compile_config(config, arch)
        with cache.lock(config, arch, version):
            cache.put(config, arch, version, compiled.object_bytes,
                      extra={"compile_seconds": round(compiled.seconds, 3)})
        return compiled.object_bytes, compiled.seconds
    return entry.object_bytes, float(entry.meta.get("compile_seconds", float("nan")))


def compiled_object(cache, config, arch: str) -> bytes:
    """The object of ``config`` for ``arch`` (see :func:`shipped_object`)."""
    return shipped_object(cache, config, arch)[0]


#: Where disassembled listings persist (set by the run-wide fixture: beside its kernel cache),
#: so xdist workers and later runs read an object's SASS instead of disassembling it again.
SASS_DIR: Path | None = None
_DISASSEMBLED: dict[str, tuple[sass.Kernel, ...]] = {}  # object sha256 -> its kernels


def disassembled(obj: bytes) -> tuple[sass.Kernel, ...]:
    """``jax_fa4.tools.sass.kernels(obj)``, memoised per object (in memory and under SASS_DIR)."""
    digest = hashlib.sha256(obj).hexdigest()
    if digest not in _DISASSEMBLED:
        _DISASSEMBLED[digest] = sass.stored_kernels(obj, SASS_DIR)
    return _DISASSEMBLED[digest]


def kernel_sass(obj: bytes, name_contains: str | None = None) -> sass.Kernel:
    """The one kernel function of ``obj`` (whose name contains ``name_contains``),
    disassembled (once per object: :func:`disassembled`)."""
    found = [k for k in disassembled(obj) if name_contains is None or name_contains in k.name]
    assert len(found) == 1, f"expected one kernel function, found {[k.name for k in found]}"
    return found[0]


def compiled_sass(cache, config, arch: str) -> sass.Kernel:
    """:func:`kernel_sass` of ``config``'s object from the test run's cache."""
    return kernel_sass(compiled_object(cache, config, arch))


def compiled_report(cache, config, arch: str) -> tuple[sass.Kernel, float]:
    """(:func:`compiled_sass`, compile seconds) of ``config``, reading its object once."""
    obj, seconds = shipped_object(cache, config, arch)
    return kernel_sass(obj), seconds


def assert_no_local_memory(k: sass.Kernel) -> None:
    assert k.count("LDL") == 0 and k.count("STL") == 0, "local-memory traffic (spills)"
    assert k.local == 0 and k.stack == 0, "stack frame / local memory"


def shipped_problems(cache, selected: Sequence[Variant], jobs: int) -> list[str]:
    """``precompile.check`` over ``selected`` (compiled into ``cache`` first), with the
    memoised listings of :func:`disassembled`."""
    from jax_fa4.tools import precompile

    precompile.build(selected, cache, progress=False, jobs=jobs)
    return precompile.check(selected, cache, progress=False, jobs=jobs, disassemble=disassembled)
