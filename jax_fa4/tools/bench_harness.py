"""What the GPU benchmark scripts under ``benchmarks/`` share: their timing flags, rotated input
sets, the run's header line and the result file they write as they go.

The kernel-variant sweeps' own parts (which configs, their flags and table) are in
:mod:`jax_fa4.tools.variant_sweeps`; the timing itself is :mod:`jax_fa4.tools.bench`'s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


def timing_parser(doc: str) -> argparse.ArgumentParser:
    """The flags every GPU benchmark script takes: rounds, round length, output JSON."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--target-ms", type=float, default=60.0, help="length of one timed round")
    p.add_argument("--out", type=Path)
    return p


def labelled_shapes(shapes: Sequence[tuple[int, int, int, int]]
                    ) -> Iterator[tuple[str, tuple[int, int, int, int], bool]]:
    """((label, (B, S, H, D), causal) for each (B, S, H, D) of ``shapes``, unmasked then causal:
    the loop of the training-shape scripts (varlen_bench.py, sink_bench.py, segments_bench.py)."""
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


def start(args: argparse.Namespace, n_shapes: int | None = None) -> tuple[Any, float]:
    """(device, wall-clock start); prints the run's header line (with the shapes and variants
    of a variants script when ``n_shapes`` is given)."""
    import jax

    device = jax.devices()[0]
    line = f"jax {jax.__version__} on {device.device_kind}"
    if n_shapes is not None:
        line += f"; {n_shapes} shapes, variants {getattr(args, 'variants', None) or 'all'}"
    print(line, flush=True)
    return device, time.perf_counter()


def error_text(err: BaseException) -> str:
    """An error as a row records it: its type and the first 300 characters of its first line."""
    return f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"


def report(device: Any, args: argparse.Namespace, t0: float,
           rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The result file's content: GPU, jax version, date, command, flags, wall time, rows."""
    import jax

    return {"gpu": device.device_kind, "jax": jax.__version__,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": list(sys.orig_argv),
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "wall_s": round(time.perf_counter() - t0, 1), "rows": rows}


def save(args: argparse.Namespace, device: Any, t0: float, rows: list[dict[str, Any]],
         final: bool = False) -> None:
    """Write the report so far to ``args.out`` (if given): called after every shape, so that a
    timeout keeps what was measured; ``final`` also says where it went."""
    if args.out:
        args.out.write_text(json.dumps(report(device, args, t0, rows), indent=1) + "\n")
        if final:
            print(f"wrote {args.out}")
