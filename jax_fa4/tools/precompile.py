"""Build kernels into the persistent cache ahead of time, on any machine (no GPU needed).

    python -m jax_fa4.tools.precompile                  # every shipped variant, sm_90a and sm_100a
    python -m jax_fa4.tools.precompile --suite tests --arch sm_90a --cache-dir .device/kernel-cache
    python -m jax_fa4.tools.precompile --dtype bfloat16 --head-dim 128 --family bwd_preprocess
    python -m jax_fa4.tools.precompile --list           # what the cache holds
    python -m jax_fa4.tools.precompile --suite tests --arch sm_90a \
        --cache-dir .device/kernel-cache \
        --from-cache .pytest_cache/d/jax-fa4-kernels    # copy what another cache has built
    python -m jax_fa4.tools.precompile --check          # ... and SASS-check every variant

``--check`` is the exhaustive kernel check (run it after any change under ``jax_fa4/kernels/``):
every selected variant compiled (or read from the cache) and its SASS inspected
(:mod:`jax_fa4.tools.sass`): no local memory, at most 255 registers, shared memory within 227 KB,
the instructions its kernel kind is built on (``variants.required_sass``). ``--representative``
narrows any selection to its representative variants (``variants.representative``: every
class and every option value of each family).

Copy the cache directory to the GPU machines and point ``JAX_FA4_CACHE_DIR`` at it: they then run
with only the CuTe-DSL runtime library, no compiler. Also installed as ``jax-fa4-precompile``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence

from jax_fa4.ffi.cache import KernelCache
from jax_fa4.ffi.compiler import SUPPORTED_ARCHS, compile_config, dsl_version
from jax_fa4.kernels.sm90.fwd_config import FP8_DTYPE
from jax_fa4.kernels.spec import FLOAT_DTYPES
from jax_fa4.tools.variants import (FAMILIES, HEAD_DIMS, SUITES, Variant, required_sass,
                              representative, variants)


def _compile_one(variant: Variant) -> tuple[Variant, bytes, float]:
    compiled = compile_config(variant.config, variant.arch)
    return variant, compiled.object_bytes, compiled.seconds


def build(selected: Sequence[Variant], cache: KernelCache, *, force: bool = False,
          progress: bool = True, jobs: int = 1,
          source: KernelCache | None = None) -> list[dict]:
    """Compile each variant that the cache lacks (all with ``force``); returns one record each.

    ``source``: another cache (e.g. the exhaustive test tier's) whose entries for the same key
    (config, arch, kernel sources, DSL version) are copied instead of compiled (not with
    ``force``); they are verified on reading (sha256), so a damaged one is compiled instead.
    ``jobs > 1`` compiles in that many worker processes (the DSL's tracing state is per process);
    the cache is written by this process only.
    """
    from tqdm import tqdm

    version = dsl_version()
    if version is None:
        raise SystemExit("precompile needs nvidia-cutlass-dsl: pip install 'jax-fa4[cuda13]'")
    records = []
    todo = []
    for variant in selected:
        entry = None if force else cache.get(variant.config, variant.arch, version)
        copied = None
        if entry is None and source is not None and not force:
            copied = source.get(variant.config, variant.arch, version)
        if copied is not None:
            seconds = copied.meta.get("compile_seconds")
            with cache.lock(variant.config, variant.arch, version):
                cache.put(variant.config, variant.arch, version, copied.object_bytes,
                          extra=None if seconds is None else {"compile_seconds": seconds})
            records.append({"variant": variant.describe(), "status": "copied",
                            "seconds": seconds})
        elif entry is None:
            todo.append(variant)
        else:
            records.append({"variant": variant.describe(), "status": "cached",
                            "seconds": entry.meta.get("compile_seconds")})
    bar = tqdm(total=len(todo), desc="compiling kernels", unit="kernel",
               disable=not progress or not todo, file=sys.stderr)

    def store(variant: Variant, data: bytes, seconds: float) -> None:
        with cache.lock(variant.config, variant.arch, version):
            cache.put(variant.config, variant.arch, version, data,
                      extra={"compile_seconds": round(seconds, 3)})
        records.append({"variant": variant.describe(), "status": "compiled",
                        "seconds": round(seconds, 3), "bytes": len(data)})
        bar.set_postfix_str(f"{variant.arch} {variant.config.kernel_name}")
        bar.update()

    if jobs > 1 and len(todo) > 1:
        ctx = multiprocessing.get_context("spawn")
        try:
            with concurrent.futures.ProcessPoolExecutor(min(jobs, len(todo)),
                                                        mp_context=ctx) as pool:
                for future in concurrent.futures.as_completed(
                        [pool.submit(_compile_one, v) for v in todo]):
                    store(*future.result())
        except concurrent.futures.process.BrokenProcessPool as err:
            # A worker died (killed, or crashed): finish in this process, which reports a
            # compiler crash with its variant instead of losing the whole run.
            print(f"precompile: a worker process died ({err}); compiling the rest serially",
                  file=sys.stderr)
    done = {r["variant"] for r in records}
    for variant in todo:
        if variant.describe() not in done:
            store(*_compile_one(variant))
    bar.close()
    return records


def variant_problems(variant: Variant, object_bytes: bytes, kernels=None) -> list[str]:
    """What keeps one compiled variant from shipping (:func:`jax_fa4.tools.sass.problems` on each
    kernel function of its object, with its config's shared memory and its kind's required
    instructions); an object without exactly one kernel function is a problem too. ``kernels``:
    the object's already disassembled ``jax_fa4.tools.sass.kernels``."""
    from jax_fa4.tools import sass

    label = variant.describe()
    found = sass.kernels(object_bytes) if kernels is None else list(kernels)
    if len(found) != 1:
        return [f"{label}: {len(found)} kernel functions in its object (expected 1)"]
    smem = variant.config.smem_bytes() if hasattr(variant.config, "smem_bytes") else 0
    return sass.problems(found[0], dynamic_smem_bytes=smem, label=label,
                         must_have=required_sass(variant.config))


def check(selected: Sequence[Variant], cache: KernelCache, *, progress: bool = True,
          jobs: int = 1, disassemble=None) -> list[str]:
    """SASS-check every variant of ``selected`` (each must be in ``cache``: :func:`build`
    first); one line per problem, empty when all are clean. Disassembly runs ``jobs`` at a
    time (separate processes: cuobjdump / nvdisasm); ``disassemble(object_bytes)`` replaces
    ``jax_fa4.tools.sass.kernels`` (the tests pass one that memoises listings)."""
    from tqdm import tqdm

    version = dsl_version()

    def one(variant: Variant) -> list[str]:
        entry = cache.get(variant.config, variant.arch, version)
        if entry is None:
            return [f"{variant.describe()}: not in the cache {cache.root}"]
        kernels = None if disassemble is None else disassemble(entry.object_bytes)
        return variant_problems(variant, entry.object_bytes, kernels)

    found: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool, \
            tqdm(total=len(selected), desc="checking SASS", unit="kernel", file=sys.stderr,
                 disable=not progress or not selected) as bar:
        for lines in pool.map(one, selected):
            found.extend(lines)
            bar.update()
    return found


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jax_fa4.tools.precompile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=SUITES, default="default",
                   help="which set of variants (default: every shipped variant)")
    p.add_argument("--arch", nargs="+", choices=SUPPORTED_ARCHS, help="target archs (default: all)")
    p.add_argument("--dtype", nargs="+", choices=FLOAT_DTYPES + (FP8_DTYPE,),
                   help="input dtypes (float8_e4m3fn: the FP8 forward)")
    p.add_argument("--head-dim", nargs="+", type=int, choices=HEAD_DIMS, help="head dims")
    p.add_argument("--family", nargs="+", choices=sorted(FAMILIES), help="kernel families")
    p.add_argument("--cache-dir", help="cache directory (default: $JAX_FA4_CACHE_DIR or "
                                       "~/.cache/jax_fa4)")
    p.add_argument("--force", action="store_true", help="rebuild entries already cached")
    p.add_argument("--from-cache", metavar="DIR",
                   help="copy the entries another cache holds for the same kernel sources "
                        "(e.g. .pytest_cache/d/jax-fa4-kernels after an exhaustive test run) "
                        "instead of compiling them")
    p.add_argument("--list", action="store_true", help="list the cache's entries and exit")
    p.add_argument("--check", action="store_true",
                   help="after building, SASS-check every selected variant (no spills, "
                        "registers and shared memory within limits, required instructions); "
                        "exit 1 on any problem")
    p.add_argument("--representative", action="store_true",
                   help="only the representative variants of the selection (every class and "
                        "option value of each family)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="compile in this many processes (default: one per CPU)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cache = KernelCache(args.cache_dir)
    if args.list:
        for meta in cache.entries():
            print(f"{meta.get('arch')}  dsl {meta.get('dsl_version')}  "
                  f"{meta.get('compile_seconds', '?')} s  {meta.get('config')}")
        return 0
    selected = variants(args.suite, archs=args.arch, dtypes=args.dtype, head_dims=args.head_dim,
                        families=args.family)
    if args.representative:
        selected = representative(selected)
    start = time.perf_counter()
    source = KernelCache(args.from_cache) if args.from_cache else None
    records = build(selected, cache, force=args.force, progress=not args.quiet, jobs=args.jobs,
                    source=source)
    compiled = [r for r in records if r["status"] == "compiled"]
    copied = [r for r in records if r["status"] == "copied"]
    print(f"{len(records)} kernels in {cache.root}: {len(compiled)} compiled, "
          f"{len(copied)} copied, {len(records) - len(compiled) - len(copied)} already cached; "
          f"{time.perf_counter() - start:.1f} s")
    if not args.check:
        return 0
    start = time.perf_counter()
    problems = check(selected, cache, progress=not args.quiet, jobs=args.jobs)
    for line in problems:
        print(f"PROBLEM {line}")
    print(f"SASS of {len(selected)} kernels checked: {len(problems)} problems; "
          f"{time.perf_counter() - start:.1f} s")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
