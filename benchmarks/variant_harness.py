"""What benchmarks/fwd_variants.py and bwd_variants.py share: flags, precompiling, the report."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

#: --shapes groups: the head dims of the anchor shapes each takes
SHAPE_GROUPS = {"d64": (64,), "d96": (96,), "d128": (128,), "d256": (256,),
                "all": (64, 96, 128, 256)}


def timing_parser(doc: str) -> argparse.ArgumentParser:
    """The flags every GPU benchmark script here takes: rounds, round length, output JSON."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--target-ms", type=float, default=60.0, help="length of one timed round")
    p.add_argument("--out", type=Path)
    return p


def parser(doc: str) -> argparse.ArgumentParser:
    """The flags fwd_variants.py and bwd_variants.py take (each adds its own check threshold)."""
    p = timing_parser(doc)
    p.add_argument("--shapes", choices=sorted(SHAPE_GROUPS), default="all")
    p.add_argument("--variants", help="comma-separated names (default: all; v1 always runs)")
    p.add_argument("--list", action="store_true", help="print the configs needed and exit")
    p.add_argument("--precompile", action="store_true", help="build the configs into the cache")
    p.add_argument("--cache-dir", help="kernel cache for --precompile (default: the package's)")
    p.add_argument("--verbose", action="store_true")
    return p


def variant_names(args) -> list[str] | None:
    return args.variants.split(",") if args.variants else None


def precompile(configs: list[Any], cache_dir: str | None) -> int:
    """Build ``configs`` for sm_90a into the kernel cache (the CPU machine's side of a run)."""
    from jax_fa4.ffi.cache import KernelCache
    from jax_fa4.tools.precompile import build
    from jax_fa4.tools.variants import Variant

    for record in build([Variant(c, "sm_90a") for c in configs], KernelCache(cache_dir)):
        print(record)
    return 0


def labelled_shapes(shapes):
    """((label, (B, S, H, D), causal) for each (B, S, H, D) of ``shapes``, unmasked then causal:
    the loop of the training-shape scripts (varlen_bench.py, sink_bench.py)."""
    for b, s, h, d in shapes:
        for causal in (False, True):
            yield f"B{b} S{s} H{h} D{d}" + (" causal" if causal else ""), (b, s, h, d), causal


def rotating_sets(key, shape: tuple[int, ...], per_set: int = 4) -> list[tuple[Any, ...]]:
    """Enough sets of ``per_set`` standard-normal bf16 arrays of ``shape`` (from ``key``) to
    exceed ``jax_fa4.tools.bench.ROTATION_BYTES`` together: timing rotates through them, so no
    program's inputs stay in the L2."""
    import math

    import jax
    import jax.numpy as jnp
    from jax_fa4.tools import bench

    n_sets = max(2, -(-bench.ROTATION_BYTES // (per_set * math.prod(shape) * 2)))
    return [tuple(jax.random.normal(k, shape, jnp.bfloat16)
                  for k in jax.random.split(set_key, per_set))
            for set_key in jax.random.split(key, n_sets)]


def start(args, n_shapes: int | None = None):
    """(device, wall-clock start); prints the run's header line (with the shapes and variants
    of a variants script when ``n_shapes`` is given)."""
    import jax

    device = jax.devices()[0]
    line = f"jax {jax.__version__} on {device.device_kind}"
    if n_shapes is not None:
        line += f"; {n_shapes} shapes, variants {variant_names(args) or 'all'}"
    print(line, flush=True)
    return device, time.perf_counter()


def error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"


def finish_shape(rows: list[dict[str, Any]], label: str, index: int, total: int,
                 t0: float) -> None:
    """ratio_vs_cudnn / ratio_vs_v1 of every timed row of one shape, then its progress line."""
    mine = [r for r in rows if r["shape"] == label and "tflops" in r]
    cudnn = next((r["tflops"] for r in mine if r["variant"] == "cudnn"), None)
    v1 = next((r["tflops"] for r in mine if r["variant"] == "v1"), None)
    for row in mine:
        row["ratio_vs_cudnn"] = row["tflops"] / cudnn if cudnn else None
        row["ratio_vs_v1"] = row["tflops"] / v1 if v1 else None
    line = "  ".join(f"{r['variant']} {r['tflops']:.0f}" for r in mine)
    print(f"[{index + 1}/{total}] {label}: {line}  ({time.perf_counter() - t0:.0f} s)", flush=True)


def report(device, args, t0: float, rows: list[dict[str, Any]]) -> dict[str, Any]:
    import jax

    return {"gpu": device.device_kind, "jax": jax.__version__,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": list(sys.orig_argv),
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "wall_s": round(time.perf_counter() - t0, 1), "rows": rows}


def save(args, device, t0: float, rows: list[dict[str, Any]], final: bool = False) -> None:
    """Write the report so far to ``args.out`` (if given): called after every shape, so that a
    timeout keeps what was measured; ``final`` also says where it went."""
    if args.out:
        args.out.write_text(json.dumps(report(device, args, t0, rows), indent=1) + "\n")
        if final:
            print(f"wrote {args.out}")


def write(result: dict[str, Any], prefix: str, out: Path | None) -> int:
    """Print the table, write the JSON (default ``benchmarks/results/<prefix>-<gpu>-<date>.json``);
    exit status 1 when a correctness check failed."""
    print_table(result)
    if out is None:
        slug = "".join(ch if ch.isalnum() else "-" for ch in result["gpu"].lower()).strip("-")
        out = Path("benchmarks/results") / f"{prefix}-{slug}-{datetime.date.today()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {out} ({result['wall_s']} s)")
    return 1 if any(r.get("ok") is False for r in result["rows"]) else 0


def print_table(result: dict[str, Any]) -> None:
    rows = result["rows"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    variants = [v for v in dict.fromkeys(r["variant"] for r in rows) if v != "cudnn"] + ["cudnn"]
    cell = {(r["shape"], r["variant"]): r for r in rows}
    width = 22
    print("\nTFLOP/s (ratio to cuDNN in the same process); FAIL = a correctness check failed")
    print(f"{'shape':<26}" + "".join(f"{v:>{width}}" for v in variants))
    for s in shapes:
        line = f"{s:<26}"
        for v in variants:
            r = cell.get((s, v))
            if r is None:
                text = ""
            elif "tflops" not in r:
                text = "skipped"
            else:
                ratio = r.get("ratio_vs_cudnn")
                text = f"{r['tflops']:.0f}" + (f" ({ratio:.3f})" if ratio and v != "cudnn" else "")
                if r.get("ok") is False:
                    text = "FAIL " + text
            line += f"{text:>{width}}"
        print(line)
    for r in rows:
        if r.get("ok") is False or "skipped" in r:
            print(f"  {r['shape']} {r['variant']}: {r.get('skipped') or r.get('why')}")
