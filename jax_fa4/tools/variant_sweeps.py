"""The kernel-variant sweeps (``benchmarks/fwd_variants.py``, ``benchmarks/bwd_variants.py``):
which Hopper configs they time per anchor shape, the flags they share, precompiling those
configs on a machine without a GPU, and their table and result file.

The config lists import neither JAX's GPU backend nor the compiler: ``--list`` and
``--precompile`` run anywhere, and the CPU tests check the lists (``tests/test_bench.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

from jax_fa4.tools.bench_harness import timing_parser

#: --shapes groups: the head dims of the anchor shapes each takes
SHAPE_GROUPS = {"d64": (64,), "d96": (96,), "d128": (128,), "d192": (192,), "d256": (256,),
                "all": (64, 96, 128, 192, 256)}
H200_SMS = 132  # the persistent forward variants' grid (an H100 SXM has 132 SMs too)


def shape_label(shape: Any) -> str:
    """A shape's row label: ``B4 S8192 H16 D128 causal``."""
    return f"B{shape.B} S{shape.Sq} H{shape.H} D{shape.D}" + (" causal" if shape.causal else "")


# -- the forward's variants --------------------------------------------------------------------
def fwd_variants_for(head_dim: int, head_dim_v: int, mask: str) -> list[tuple[str, Any]]:
    """(name, FwdConfig) to time for one (head dim, mask kind); the first is the v1 default."""
    from jax_fa4.kernels.sm90.fwd_config import FwdConfig

    base = dict(dtype="bfloat16", head_dim=head_dim, head_dim_v=head_dim_v, mask=mask,
                has_softcap=False)
    out = [("v1", FwdConfig.make(**base))]

    def add(name: str, **overrides: Any) -> None:
        try:
            out.append((name, FwdConfig.make(**base, **overrides)))
        except ValueError as err:  # e.g. over shared memory / registers: not a variant here
            print(f"[fwd_variants] {name} d={head_dim} {mask}: {err}", file=sys.stderr)

    add("pp", pingpong=True)
    add("pp+rs8", pingpong=True, rescale_threshold=8.0)
    add("pp+persist", pingpong=True, num_sms=H200_SMS)
    # the table's tile on a persistent grid (O in its own buffer where it fits: own_o_buffer)
    add("persist", num_sms=H200_SMS)
    # the same two with the tiles claimed from a global counter (FwdConfig.dynamic_tiles)
    add("pp+persist+dyn", pingpong=True, num_sms=H200_SMS, dynamic_tiles=True)
    add("persist+dyn", num_sms=H200_SMS, dynamic_tiles=True)
    if head_dim in (64, 128):
        add("rs8", rescale_threshold=8.0)
    if head_dim == 64:
        add("3wg", tile_m=192)
        add("3wg+pp", tile_m=192, pingpong=True)
        add("3wg+pp+rs8", tile_m=192, pingpong=True, rescale_threshold=8.0)
        add("3wg+pp+rs8+persist", tile_m=192, pingpong=True, rescale_threshold=8.0,
            num_sms=H200_SMS)
    elif head_dim == 96:  # the non-causal tile is the one to find (issue #22)
        add("rs8", rescale_threshold=8.0)
        add("n144", tile_n=144)
        add("pp+n144", pingpong=True, tile_n=144)
        add("n96", tile_n=96)
        for n in (160, 176, 192):
            add(f"n{n}", tile_n=n)
        add("pp+n176", pingpong=True, tile_n=176)
        add("n144+s3", tile_n=144, stages=3)
        add("3wg", tile_m=192)
        add("3wg+pp", tile_m=192, pingpong=True)
        add("3wg+pp+rs8", tile_m=192, pingpong=True, rescale_threshold=8.0)
        add("3wg+n144", tile_m=192, tile_n=144)
        add("3wg+pp+n144", tile_m=192, pingpong=True, tile_n=144)
    elif head_dim == 128:
        add("pp+n176", pingpong=True, tile_n=176)
        add("s3", stages=3)  # a third K/V stage (224 KB of shared memory)
    return out


def fwd_shapes(group: str = "all") -> list[Any]:
    """The forward sweep's shapes: the anchor shapes and the head dim 96 pair, of ``group``."""
    from jax_fa4.tools.bench_shapes import ANCHOR_SHAPES, D96_SHAPES

    return [s for s in ANCHOR_SHAPES + D96_SHAPES if s.D in SHAPE_GROUPS[group]]


def fwd_variant_configs(group: str = "all", names: list[str] | None = None) -> list[Any]:
    """Every kernel config the forward sweep needs (each once): precompile exactly these."""
    configs = []
    for shape in fwd_shapes(group):
        for name, cfg in fwd_variants_for(shape.D, shape.Dv,
                                          "causal" if shape.causal else "none"):
            if (names is None or name in names) and cfg not in configs:
                configs.append(cfg)
    return configs


# -- the backward's variants -------------------------------------------------------------------
def bwd_variants_for(head_dim: int, head_dim_v: int, mask: str,
                     gqa: bool) -> list[tuple[str, Any]]:
    """(name, BwdConfig) to time for one problem kind; the first is the table's (v1)."""
    from jax_fa4.kernels.sm90.bwd_config import (BwdConfig, with_stats_smem, with_swap_sdp,
                                                 without_swap_sdp)
    from jax_fa4.tools.variants import OPT_IN_FORMS

    def valid(cfg: Any) -> bool:  # over shared memory, GEMMs that do not split, swap_sdp limits
        try:
            cfg.validate()
        except ValueError:
            return False
        return True

    base = BwdConfig.make("bfloat16", head_dim, head_dim_v, mask, False, gqa)
    out = [("v1", base)]

    def add(name: str, cfg: Any) -> None:  # valid and not already listed under another name
        if valid(cfg) and all(cfg != c for _, c in out):
            out.append((name, cfg))

    # the loop forms (OPT_IN_FORMS: swap, stats, swap+stats, red) and none of them ("plain":
    # the plain loop, statistics from registers, dQ through the dQ warp)
    plain = dataclasses.replace(without_swap_sdp(base), stats_smem=False, stats_padded=False,
                                dq_red=False)
    for name, form in OPT_IN_FORMS.items():
        add(name, form(base))
    add("plain", plain)
    if gqa:  # the group_heads form with warpgroup-sliced descriptors (and padded statistics)
        group = dataclasses.replace(base, gqa=False, group_heads=True, wg_fragments=True)
        add("group+wgfrag", group)
        add("group+wgfrag+pad", dataclasses.replace(group, stats_padded=group.stats_smem))
    # dQ added by the MMA threads with one more Q stage
    add("red+s3", dataclasses.replace(base, dq_red=True, stages=base.stages + 1))
    # the other launch order: "rev" (from the last key block down) or "fwd-launch"
    add("fwd-launch" if base.reverse_launch else "rev",
        dataclasses.replace(base, reverse_launch=not base.reverse_launch))
    # tiles and stages: the plain loop, "+swap" its swap_sdp form (with the table's stats) and
    # "+red" its dq_red form (no dQ buffer: the shared memory it frees may take another stage)
    for tm, tn, stages, pds, form in itertools.product((64, 128), (64, 128), (1, 2, 3), (1, 2),
                                                       ("", "+swap", "+red")):
        cfg = dataclasses.replace(plain, tile_m=tm, tile_n=tn, stages=stages, pds_stages=pds)
        if form == "+swap":
            cfg = with_stats_smem(with_swap_sdp(cfg), base.stats_smem)
        elif form == "+red":
            cfg = dataclasses.replace(cfg, dq_red=True)
        add(f"m{tm}n{tn}s{stages}p{pds}{form}", cfg)
    # the split-operand CTA pair (bwd_pair_config.BwdPairConfig): "pair" with 2 Q / dO stages
    # and 2 P / dS exchange buffers, "pair-la" the same with lookahead, "pair-p1" with one
    # exchange buffer, "pair-s3" 3 stages and one buffer
    from jax_fa4.kernels.sm90.bwd_pair_config import BwdPairConfig

    for name, stages, pds, la in (("pair", 2, 2, False), ("pair-la", 2, 2, True),
                                  ("pair-p1", 2, 1, False), ("pair-s3", 3, 1, False)):
        pair = BwdPairConfig(dtype=base.dtype, head_dim=head_dim, head_dim_v=head_dim_v,
                             mask=mask, gqa=gqa, stages=stages, pds_stages=pds, lookahead=la)
        add(name, pair)
        if gqa:  # "+group": one cluster per kv head (BwdPairConfig.group_heads)
            add(f"{name}+group", dataclasses.replace(pair, gqa=False, group_heads=True))
    det = BwdConfig.make("bfloat16", head_dim, head_dim_v, mask, False, gqa, deterministic=True)
    add("det", det)
    if not base.swap_sdp:
        add("det+swap", with_swap_sdp(det))
    return out


def bwd_shapes(group: str = "all") -> list[Any]:
    """The backward sweep's shapes: the anchor, GQA 32/8 and head dim 96 shapes, of ``group``."""
    from jax_fa4.tools.bench_shapes import ANCHOR_SHAPES, D96_SHAPES, D192_SHAPES, GQA_SHAPES

    return [s for s in ANCHOR_SHAPES + GQA_SHAPES + D96_SHAPES + D192_SHAPES
            if s.D in SHAPE_GROUPS[group]]


def bwd_shape_variants(shape: Any, names: list[str] | None) -> list[tuple[str, Any]]:
    """(name, BwdConfig) of ``shape`` among ``names`` (all when None; v1 always)."""
    mask = "causal" if shape.causal else "none"
    return [(n, c) for n, c in bwd_variants_for(shape.D, shape.Dv, mask, shape.H != shape.Hkv)
            if names is None or n in names or n == "v1"]


def bwd_variant_configs(group: str = "all", names: list[str] | None = None) -> list[Any]:
    """Every kernel config the backward sweep needs (main kernels and their postprocesses, each
    once)."""
    configs = []
    for shape in bwd_shapes(group):
        for _, cfg in bwd_shape_variants(shape, names):
            for c in (cfg, cfg.postprocess_config()):
                if c not in configs:
                    configs.append(c)
    return configs


# -- flags, precompiling, the table ------------------------------------------------------------
def parser(doc: str) -> argparse.ArgumentParser:
    """The flags both sweeps take (each adds its own check threshold)."""
    p = timing_parser(doc)
    p.add_argument("--shapes", choices=sorted(SHAPE_GROUPS), default="all")
    p.add_argument("--variants", help="comma-separated names (default: all; v1 always runs)")
    p.add_argument("--list", action="store_true", help="print the configs needed and exit")
    p.add_argument("--precompile", action="store_true", help="build the configs into the cache")
    p.add_argument("--cache-dir", help="kernel cache for --precompile (default: the package's)")
    p.add_argument("--from-cache", metavar="DIR",
                   help="--precompile copies the entries this cache holds for the same kernel "
                        "sources (e.g. an exhaustive check's) instead of compiling them")
    p.add_argument("--jobs", type=int, default=1, help="--precompile's compiler processes")
    p.add_argument("--verbose", action="store_true")
    return p


def variant_names(args: argparse.Namespace) -> list[str] | None:
    """``--variants`` as a list (None: all)."""
    return args.variants.split(",") if args.variants else None


def precompile(configs: list[Any], args: argparse.Namespace) -> int:
    """Build ``configs`` for sm_90a into the kernel cache (the CPU machine's side of a run):
    ``--cache-dir``, copying what ``--from-cache`` holds, ``--jobs`` compiler processes."""
    from jax_fa4.ffi.cache import KernelCache
    from jax_fa4.tools.precompile import build
    from jax_fa4.tools.variants import Variant

    source = KernelCache(args.from_cache) if args.from_cache else None
    for record in build([Variant(c, "sm_90a") for c in configs], KernelCache(args.cache_dir),
                        jobs=args.jobs, source=source):
        print(record)
    return 0


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
    """Variant × shape: TFLOP/s and the ratio to cuDNN, FAIL where a check failed."""
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
