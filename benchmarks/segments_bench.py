"""Packed rows with segment ids on the GPU, per useful FLOP, against the dense kernels.

The bar (issue #23): ``flash_attention(..., segment_ids=...)`` on rows of 8k tokens packed with
documents of 512–4k tokens at ≥ 0.95× the dense kernel's TFLOP/s, counting only the FLOPs
inside documents (what a packed model needs), forward (and forward+backward:
``--with-backward``). Per shape (B rows of S tokens, H heads, hdim D, bf16; causal and not), in
one process with ``jax_fa4.tools.bench``'s timing (warm-up, rounds rotating which program opens
them, median, input sets rotated past the L2):

* ``dense``: ``flash_attention`` on (B, S, H, D), no segment ids (all S² FLOPs useful);
* ``segments``: the same rows with segment ids cutting each into documents of 512–4k tokens
  (each row its own cut points; FLOPs counted per document);
* ``varlen``: the same documents through ``flash_attention_varlen`` (packed (B·S, H, D));
* ``dense+max_logits`` / ``segments+max_logits`` (forward only): the same calls with
  ``return_max_logits=True`` (QK-Clip), for the max-logit overhead (``max_logits_overhead``:
  time over the call without it, minus 1).

``--breakdown`` times instead where a forward with segment ids spends its time against the
dense kernel (forward only; by default 15 rounds of 300 ms):

* ``dense``, ``segments``, ``varlen`` as above; ``dense-pers`` (unmasked only): the dense call
  with the persistent grid of 132 CTAs (``num_sms``; its kernels must be in the cache);
  ``segments-pers``: the segment-id call on the persistent grid with dynamic tiles
  (``jax_fa4.tools.variants.persistent_segments``, in no table row yet);
* ``short``: the dense kernel on rows of S/4 tokens (4·B rows): uniform 2k-token documents
  without any segment logic, what the tile-per-CTA design costs at that length;
  ``short-pers`` with the persistent grid;
* ``segments-const``: the ids as constants (XLA folds the tables at compile time): the kernel
  without the tables' cost;
* ``segments-bulk``: the tables rewritten so that every visited block is bulk (no per-row
  mask, no id compare): wrong results, timed as the bound without the masked path;
* ``tables``: ``segments.forward_tables`` alone (its own program: includes a launch's fixed
  cost, so read ``segments - segments-const`` for the tables' share of a call).

The ids (and cu_seqlens) are arguments of the jitted programs, as in a training step, so the
segment tables are built on the GPU in every call (constants would be folded at compile time).

TFLOP/s use the anchors' convention (forward 2·Σ Sq·Sk·H·(D+Dv), halved under a causal mask,
backward 2.5×). Writes JSON with the command, GPU and date; each row has
``"segment_ids": true`` where segment ids ran, and ``fwd_vs_dense``: its useful TFLOP/s over
the dense call's.

    python benchmarks/segments_bench.py --out benchmarks/results/segments-<gpu>-<date>.json
    python benchmarks/segments_bench.py --breakdown \\
        --out benchmarks/results/segments-breakdown-<gpu>-<date>.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa4
from jax_fa4 import segments
from jax_fa4.kernels import segments_config as cols
from jax_fa4.kernels.sm90 import fwd_config, fwd_tuning
from jax_fa4.tools import bench
from jax_fa4.tools.bench_shapes import document_lengths
from jax_fa4.tools.bench_harness import (labelled_shapes, rotating_sets, save, start,
                                         timing_parser)
from jax_fa4.tools.variants import persistent_segments

#: (B, S, H, D): rows of 8k tokens (the issue's shape) at hdim 128 and 64
SHAPES = ((2, 8192, 16, 128), (4, 8192, 8, 64))
DOC_MIN, DOC_MAX = 512, 4096
#: name -> (the lengths of the documents whose FLOPs count, the call on (q, k, v, ids, cu))
Variants = dict[str, tuple[list[int], Callable]]


def documents(rng: np.random.Generator, s: int) -> list[int]:
    """Lengths in [DOC_MIN, DOC_MAX] summing to s (``bench_shapes.document_lengths``)."""
    return document_lengths(rng, s, DOC_MIN, DOC_MAX)


def packed_rows(b: int, s: int, d: int, causal: bool) -> list[list[int]]:
    """``b`` rows of ``s`` tokens cut into :func:`documents`, the same cuts in every run."""
    rng = np.random.default_rng(b * s + d + causal)
    return [documents(rng, s) for _ in range(b)]


def flops(lens: list[int], h: int, d: int, causal: bool) -> float:
    """Forward FLOPs of self-attention over documents of ``lens`` tokens."""
    f = sum(2.0 * n * n * h * 2 * d for n in lens)
    return f / 2 if causal else f


def speed_variants(b: int, s: int, h: int, d: int, causal: bool, flat: list[int]) -> Variants:
    """The default run's calls: dense, segments, varlen, and the max-logit calls."""
    shape = (b, s, h, d)
    return {
        "dense": ([s] * b, lambda q, k, v, ids, cu: jax_fa4.flash_attention(
            q, k, v, causal=causal, implementation="sm90")),
        "segments": (flat, lambda q, k, v, ids, cu: jax_fa4.flash_attention(
            q, k, v, causal=causal, segment_ids=ids, implementation="sm90")),
        "varlen": (flat, lambda q, k, v, ids, cu: jax_fa4.flash_attention_varlen(
            q.reshape(b * s, h, d), k.reshape(b * s, h, d), v.reshape(b * s, h, d), cu, cu,
            max(flat), max(flat), causal=causal, implementation="sm90").reshape(shape)),
        "dense+max_logits": ([s] * b, lambda q, k, v, ids, cu: jax_fa4.flash_attention(
            q, k, v, causal=causal, return_max_logits=True, implementation="sm90")),
        "segments+max_logits": (flat, lambda q, k, v, ids, cu: jax_fa4.flash_attention(
            q, k, v, causal=causal, segment_ids=ids, return_max_logits=True,
            implementation="sm90")),
    }


# -- --breakdown -------------------------------------------------------------------------------
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


_real_segments_config = fwd_config.segments_config


def _persistent_segments_config(*args, **kwargs):
    return persistent_segments(_real_segments_config(*args, **kwargs))


def _traced_under(compile_fn: Callable, name: str):
    """``compile_fn()``; for a ``-pers`` or ``-bulk`` variant with its patch in place (jit caches
    cleared around it, so that the patch reaches no other program)."""
    if not name.endswith(("-pers", "-bulk")):
        return compile_fn()
    saved_table = dict(fwd_tuning.TUNING_TABLE)
    jax.clear_caches()
    if name == "segments-pers":
        fwd_config.segments_config = _persistent_segments_config
    elif name.endswith("-pers"):
        fwd_tuning.TUNING_TABLE.update(_persistent_table())
    if name.endswith("-bulk"):
        segments.forward_tables = _bulk_tables
    try:
        return compile_fn()
    finally:
        fwd_tuning.TUNING_TABLE.clear()
        fwd_tuning.TUNING_TABLE.update(saved_table)
        segments.forward_tables = _real_tables
        fwd_config.segments_config = _real_segments_config
        jax.clear_caches()


def breakdown_variants(b: int, s: int, h: int, d: int, causal: bool, ids_np: np.ndarray,
                       flat: list[int]) -> Variants:
    """The ``--breakdown`` calls (module docstring)."""
    fa = jax_fa4.flash_attention
    tile_m = fwd_config.segments_config("bfloat16", d, d).tile_m
    speed = speed_variants(b, s, h, d, causal, flat)
    out = {
        "dense": speed["dense"],
        "short": ([s // 4] * (4 * b), lambda q, k, v, ids, cu: fa(
            *(x.reshape(4 * b, s // 4, h, d) for x in (q, k, v)), causal=causal,
            implementation="sm90")),
        "varlen": speed["varlen"],
        "segments": speed["segments"],
        "segments-const": (flat, lambda q, k, v, ids, cu: fa(
            q, k, v, causal=causal, segment_ids=jnp.asarray(ids_np), implementation="sm90")),
        "segments-bulk": speed["segments"],  # compiled under the all-bulk tables
        "segments-pers": speed["segments"],  # compiled on the persistent grid
        "tables": (flat, lambda q, k, v, ids, cu: segments.forward_tables(ids, ids, tile_m, 128)),
    }
    if not causal:  # compiled under the persistent tuning table
        out["dense-pers"], out["short-pers"] = out["dense"], out["short"]
    return out


# -- the run -----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = timing_parser(__doc__)
    parser.set_defaults(repeats=None, target_ms=None)  # 5 × 60 ms; with --breakdown 15 × 300 ms
    parser.add_argument("--with-backward", action="store_true",
                        help="also time forward+backward (the backward of segment ids)")
    parser.add_argument("--breakdown", action="store_true",
                        help="where a forward with segment ids spends its time (forward only)")
    parser.add_argument("--only", help="comma-separated variants (dense is always timed)")
    args = parser.parse_args(argv)
    if args.breakdown and args.with_backward:
        parser.error("--breakdown times forwards only: drop --with-backward")
    args.repeats = args.repeats or (15 if args.breakdown else 5)
    args.target_ms = args.target_ms or (300.0 if args.breakdown else 60.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    only = set(args.only.split(",")) | {"dense"} if args.only else None
    device, t0 = start(args)
    rows = []
    for label, (b, s, h, d), causal in labelled_shapes(SHAPES):
        docs = packed_rows(b, s, d, causal)
        ids_np = np.stack([np.repeat(np.arange(len(x)), x) for x in docs]).astype(np.int32)
        flat = [n for row in docs for n in row]
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(flat)]), jnp.int32)
        sets = [(*x, jnp.asarray(ids_np), cu)
                for x in rotating_sets(jax.random.key(b * s + causal), (b, s, h, d))]
        variants = (breakdown_variants(b, s, h, d, causal, ids_np, flat) if args.breakdown
                    else speed_variants(b, s, h, d, causal, flat))
        variants = {n: v for n, v in variants.items() if only is None or n in only}
        programs, names = [], []
        for name, (_lens, attn) in variants.items():
            def fwd(q, k, v, do, ids, cu, attn=attn):
                return attn(q, k, v, ids, cu)

            def fwd_bwd(q, k, v, do, ids, cu, attn=attn):
                out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, ids, cu), q, k, v)
                return out, vjp(do)

            kinds = ("fwd", "fwd+bwd") if args.with_backward and "max" not in name else ("fwd",)
            for kind, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                if kind in kinds:
                    compiled = _traced_under(
                        lambda fn=fn, first=sets[0]: jax.jit(fn).lower(*first).compile(), name)
                    programs.append(bench.make_program(None, compiled, sets, 1))
                    names.append((name, kind))
        timings = bench.time_programs(programs, repeats=args.repeats,
                                      target_s=args.target_ms / 1e3, sync_each=False)
        ms = {key: t.ms for key, t in zip(names, timings)}
        mine = []
        for name, (lens, _) in variants.items():
            f = flops(lens, h, d, causal)
            row = dict(shape=label, variant=name, segment_ids=name.startswith("segments"),
                       max_logits=name.endswith("max_logits"),
                       documents=docs if lens is flat else None,
                       fwd_ms=ms[(name, "fwd")],
                       useful_fwd_tflops=f / (ms[(name, "fwd")] * 1e-3) / 1e12)
            if name.endswith("+max_logits"):
                row["max_logits_overhead"] = ms[(name, "fwd")] / ms[(name[:-11], "fwd")] - 1
            if (name, "fwd+bwd") in ms:
                t_fb = ms[(name, "fwd+bwd")]
                row.update(fwdbwd_ms=t_fb, useful_fwdbwd_tflops=3.5 * f / (t_fb * 1e-3) / 1e12)
            mine.append(row)
        dense = mine[0]
        for r in mine:
            for key in ("useful_fwd_tflops", "useful_fwdbwd_tflops"):
                if key in r:
                    r[key.replace("useful_", "").replace("_tflops", "_vs_dense")] = (
                        r[key] / dense[key])
        rows += mine
        line = "  ".join(f"{r['variant']} {r['fwd_ms']:.3f} ms fwd {r['useful_fwd_tflops']:.0f} "
                         f"({r['fwd_vs_dense']:.2f})" for r in mine)
        print(f"{label}: {line}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        del sets, programs
        save(args, device, t0, rows)
    save(args, device, t0, rows, final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
