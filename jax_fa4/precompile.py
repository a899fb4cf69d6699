"""Build kernels into the persistent cache ahead of time, on any machine (no GPU needed).

    python -m jax_fa4.precompile                         # every shipped variant, sm_90a and sm_100a
    python -m jax_fa4.precompile --suite tests --arch sm_90a --cache-dir .device/kernel-cache
    python -m jax_fa4.precompile --dtype bfloat16 --head-dim 128 --family bwd_preprocess
    python -m jax_fa4.precompile --list                  # what the cache holds

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
from jax_fa4.kernels.spec import FLOAT_DTYPES
from jax_fa4.variants import FAMILIES, HEAD_DIMS, SUITES, Variant, variants


def _compile_one(variant: Variant) -> tuple[Variant, bytes, float]:
    compiled = compile_config(variant.config, variant.arch)
    return variant, compiled.object_bytes, compiled.seconds


def build(selected: Sequence[Variant], cache: KernelCache, *, force: bool = False,
          progress: bool = True, jobs: int = 1) -> list[dict]:
    """Compile each variant that the cache lacks (all with ``force``); returns one record each.

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
        if entry is None:
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jax_fa4.precompile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=SUITES, default="default",
                   help="which set of variants (default: every shipped variant)")
    p.add_argument("--arch", nargs="+", choices=SUPPORTED_ARCHS, help="target archs (default: all)")
    p.add_argument("--dtype", nargs="+", choices=FLOAT_DTYPES, help="input dtypes")
    p.add_argument("--head-dim", nargs="+", type=int, choices=HEAD_DIMS, help="head dims")
    p.add_argument("--family", nargs="+", choices=sorted(FAMILIES), help="kernel families")
    p.add_argument("--cache-dir", help="cache directory (default: $JAX_FA4_CACHE_DIR or "
                                       "~/.cache/jax_fa4)")
    p.add_argument("--force", action="store_true", help="rebuild entries already cached")
    p.add_argument("--list", action="store_true", help="list the cache's entries and exit")
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
    start = time.perf_counter()
    records = build(selected, cache, force=args.force, progress=not args.quiet, jobs=args.jobs)
    compiled = [r for r in records if r["status"] == "compiled"]
    print(f"{len(records)} kernels in {cache.root}: {len(compiled)} compiled, "
          f"{len(records) - len(compiled)} already cached; "
          f"{time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
