"""Where the time of a forward with segment ids goes, against the dense kernel (issue #23).

For each of segments_bench.py's shapes, forward only, in one process with ``jax_fa4.tools.bench``'s
timing (input sets rotated past the L2), useful TFLOP/s relative to ``dense``:

* ``dense``: the whole rows (the bar's reference); ``dense-pers`` (unmasked only): the same
  with the persistent grid of 132 CTAs (``num_sms``; its kernels must be in the cache);
* ``short``: the dense kernel on rows of S/4 tokens (4·B rows): uniform 2k-token documents
  without any segment logic, what the tile-per-CTA design costs at that length;
  ``short-pers`` with the persistent grid;
* ``varlen``: the bench's documents through ``flash_attention_varlen``;
* ``segments``: the documents as traced segment ids (a training step);
* ``segments-const``: the same ids as constants (XLA folds the tables at compile time): the
  kernel without the tables' cost;
* ``segments-bulk``: the tables rewritten so that every visited block is bulk (no per-row
  mask, no id compare): wrong results, timed as the bound without the masked path;
* ``tables``: ``segments.forward_tables`` alone (its own program: includes a launch's fixed
  cost, so read ``segments - segments-const`` for the tables' share of a call).

    python benchmarks/segments_breakdown.py --out benchmarks/results/segments-breakdown-<gpu>-<date>.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa4
import segments_bench as sb
from jax_fa4 import segments
from jax_fa4.tools import bench
from jax_fa4.kernels import segments_config as cols
from jax_fa4.kernels.sm90 import fwd_config, fwd_tuning
from variant_harness import rotating_sets

_real_tables = segments.forward_tables


@jax.jit
def _all_bulk(tiles):
    tiles = tiles.at[..., cols.SEG_BULK_LO].set(tiles[..., cols.SEG_N_LO])
    tiles = tiles.at[..., cols.SEG_BULK_HI].set(tiles[..., cols.SEG_N_HI])
    return tiles.at[..., cols.SEG_IDS].set(0)


def _bulk_tables(q_ids, kv_ids, tile_m, tile_n, *rest):
    tiles, rows, kv = _real_tables(q_ids, kv_ids, tile_m, tile_n, *rest)
    return _all_bulk(tiles), rows, kv


def _persistent_table():
    return {key: {kind: (fwd_tuning.Sm90FwdTuning(**{**t.__dict__, "num_sms": 132})
                         if kind == "none" else t) for kind, t in row.items()}
            for key, row in fwd_tuning.TUNING_TABLE.items()}


def _traced_under(compile_fn, name: str):
    """Compile with the variant's patch in place (jit caches cleared around it)."""
    saved_table = dict(fwd_tuning.TUNING_TABLE)
    jax.clear_caches()
    if name.endswith("-pers"):
        fwd_tuning.TUNING_TABLE.update(_persistent_table())
    if name.endswith("-bulk"):
        segments.forward_tables = _bulk_tables
    try:
        return compile_fn()
    finally:
        fwd_tuning.TUNING_TABLE.clear()
        fwd_tuning.TUNING_TABLE.update(saved_table)
        segments.forward_tables = _real_tables
        jax.clear_caches()


def variants(b, s, h, d, causal, ids_np, flat):
    """name -> (document lengths for the FLOP count, the call)"""
    shape = (b, s, h, d)
    fa = jax_fa4.flash_attention
    tile_m = fwd_config.segments_config("bfloat16", d, d).tile_m
    out = {
        "dense": ([s] * b, lambda q, k, v, ids, cu: fa(q, k, v, causal=causal,
                                                       implementation="sm90")),
        "short": ([s // 4] * (4 * b), lambda q, k, v, ids, cu: fa(
            *(x.reshape(4 * b, s // 4, h, d) for x in (q, k, v)), causal=causal,
            implementation="sm90")),
        "varlen": (flat, lambda q, k, v, ids, cu: jax_fa4.flash_attention_varlen(
            q.reshape(b * s, h, d), k.reshape(b * s, h, d), v.reshape(b * s, h, d), cu, cu,
            max(flat), max(flat), causal=causal, implementation="sm90").reshape(shape)),
        "segments": (flat, lambda q, k, v, ids, cu: fa(
            q, k, v, causal=causal, segment_ids=ids, implementation="sm90")),
        "segments-const": (flat, lambda q, k, v, ids, cu: fa(
            q, k, v, causal=causal, segment_ids=jnp.asarray(ids_np), implementation="sm90")),
        "segments-bulk": (flat, lambda q, k, v, ids, cu: fa(
            q, k, v, causal=causal, segment_ids=ids, implementation="sm90")),
        "tables": (flat, lambda q, k, v, ids, cu: segments.forward_tables(ids, ids, tile_m, 128)),
    }
    if not causal:
        out["dense-pers"], out["short-pers"] = out["dense"], out["short"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path)
    p.add_argument("--only", help="comma-separated variants (dense is always timed)")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    only = set(args.only.split(",")) | {"dense"} if args.only else None
    device, t0, rows = jax.devices()[0], time.perf_counter(), []
    for b, s, h, d in sb.SHAPES:
        for causal in (False, True):
            label = f"B{b} S{s} H{h} D{d}" + (" causal" if causal else "")
            rng = np.random.default_rng(b * s + d + causal)  # segments_bench's documents
            docs = [sb.documents(rng, s) for _ in range(b)]
            ids_np = np.stack([np.repeat(np.arange(len(x)), x) for x in docs]).astype(np.int32)
            flat = [n for row in docs for n in row]
            cu = jnp.asarray(np.concatenate([[0], np.cumsum(flat)]), jnp.int32)
            sets = [(*x, jnp.asarray(ids_np), cu)
                    for x in rotating_sets(jax.random.key(b * s + causal), (b, s, h, d))]
            table = variants(b, s, h, d, causal, ids_np, flat)
            programs, names = [], []
            for name, (lens, attn) in table.items():
                if only and name not in only:
                    continue

                def fwd(q, k, v, do, ids, cu, attn=attn):
                    return attn(q, k, v, ids, cu)

                compiled = _traced_under(lambda: jax.jit(fwd).lower(*sets[0]).compile(), name)
                programs.append(bench.make_program(None, compiled, sets, 1))
                names.append(name)
            timings = bench.time_programs(programs, repeats=args.repeats, target_s=0.3,
                                          sync_each=False)
            ms = {n: t.ms for n, t in zip(names, timings)}
            dense_tflops = sb.flops([s] * b, h, d, causal) / (ms["dense"] * 1e-3) / 1e12
            line = []
            for n in names:
                tflops = sb.flops(table[n][0], h, d, causal) / (ms[n] * 1e-3) / 1e12
                rows.append(dict(shape=label, variant=n, ms=ms[n], useful_tflops=tflops,
                                 vs_dense=tflops / dense_tflops))
                line.append(f"{n} {ms[n]:.3f} ms ({tflops / dense_tflops:.2f})")
            print(f"{label}: " + "  ".join(line), f"({time.perf_counter() - t0:.0f} s)",
                  flush=True)
            if args.out:
                args.out.write_text(json.dumps(dict(
                    gpu=device.device_kind, date=time.strftime("%Y-%m-%d"),
                    command=list(sys.orig_argv), rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
