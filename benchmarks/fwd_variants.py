"""Time the Hopper forward kernel under several tuning configs per anchor shape, in one process.

    python benchmarks/fwd_variants.py                     # on the H200 (kernels precompiled)
    python benchmarks/fwd_variants.py --list              # the configs it needs, one per line
    CUTE_DSL_ARCH=sm_90a python benchmarks/fwd_variants.py --precompile --with-tests \
        --cache-dir .device/kernel-cache                  # build them (CPU machine, no GPU)
    python benchmarks/fwd_variants.py --shapes d64 --variants v1,3wg+pp --repeats 9

For every anchor shape (``jax_fa4.bench.ANCHOR_SHAPES``: B·S·H·D of the peers' table, causal and
not, bf16) it runs the kernel directly (``jax_fa4.ffi.call.call_kernel``, bypassing the
dispatch, so a config that is not the table's default can run) under each config of
``variants_for(D, Dv, mask)``, and cuDNN (``jax.nn.dot_product_attention(implementation=
"cudnn")``) in the same process. ``variant_configs()`` lists exactly the kernels it needs.

Timing (``jax_fa4.bench``'s method): every program is compiled and warmed up, then the rounds of
all programs of one shape alternate (v1, pp, ..., cuDNN, v1, ...), so a drift in clocks biases
the ratios little; each round is as many back-to-back dispatches as fill ``--target-ms``,
synchronised with ``block_until_ready``; the figure is the median round. Dispatches rotate over
several random input sets (together > 2 × the 60 MB L2).

Checks per variant, on the first input set: ``max|out - out_v1|`` and ``max|lse - lse_v1|``
against the v1 default config (the measured-correct one; differences are rounding-level,
~1e-2 for bf16 outputs of this size), and the FA4 rule against a float32 reference on a slice
(the last ``--ref-rows`` query rows of batch 0, heads 0-1, all keys: bottom-right causal
alignment is unchanged by taking the last rows): ``max|out - ref| <= 2·max|pt - ref| + atol``.
A variant that fails a check is marked ``FAIL`` in the table (its time is still reported).

Output: a JSON (``--out``, default ``benchmarks/results/fwd-variants-<gpu>-<date>.json``) and a
table variant × shape of TFLOP/s (ratio to cuDNN). Whole run on an H200: ~2-3 minutes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any

H200_SMS = 132  # the persistent variants' grid (an H100 SXM has 132 SMs too)
SHAPE_GROUPS = {"d64": (64,), "d128": (128,), "d256": (256,), "all": (64, 128, 256)}


# ---------------------------------------------------------------------------------------------
# the configs (importable without JAX's GPU backend or the compiler)
# ---------------------------------------------------------------------------------------------
def variants_for(head_dim: int, head_dim_v: int, mask: str) -> list[tuple[str, Any]]:
    """(name, FwdConfig) to time for one (head dim, mask kind); the first is the v1 default."""
    from jax_fa4.kernels.sm90.fwd_config import FwdConfig

    base = dict(dtype="bfloat16", head_dim=head_dim, head_dim_v=head_dim_v, mask=mask,
                has_softcap=False)
    out = [("v1", FwdConfig.make(**base))]

    def add(name: str, **overrides) -> None:
        try:
            out.append((name, FwdConfig.make(**base, **overrides)))
        except ValueError as err:  # e.g. over shared memory / registers: not a variant here
            print(f"[fwd_variants] {name} d={head_dim} {mask}: {err}", file=sys.stderr)

    add("pp", pingpong=True)
    add("pp+rs8", pingpong=True, rescale_threshold=8.0)
    add("pp+persist", pingpong=True, num_sms=H200_SMS)
    if head_dim == 64:
        add("rs8", rescale_threshold=8.0)
        add("3wg", tile_m=192)
        add("3wg+pp", tile_m=192, pingpong=True)
        add("3wg+pp+rs8", tile_m=192, pingpong=True, rescale_threshold=8.0)
        add("3wg+pp+rs8+persist", tile_m=192, pingpong=True, rescale_threshold=8.0,
            num_sms=H200_SMS)
        for per_32 in (4, 6, 8):  # partial software exp2 (FMA pipe), tile 192
            add(f"3wg+sx{per_32}", tile_m=192, exp2_sw_per_32=per_32)
        add("3wg+pp+rs8+sx6", tile_m=192, pingpong=True, rescale_threshold=8.0, exp2_sw_per_32=6)
    elif head_dim == 128:
        add("pp+n176", pingpong=True, tile_n=176)
    return out


def shapes_for(group: str = "all"):
    from jax_fa4.bench import ANCHOR_SHAPES

    return [s for s in ANCHOR_SHAPES if s.D in SHAPE_GROUPS[group]]


def variant_configs(group: str = "all", names: list[str] | None = None) -> list[Any]:
    """Every kernel config the run needs (each once): precompile exactly these."""
    configs = []
    for shape in shapes_for(group):
        for name, cfg in variants_for(shape.D, shape.Dv, "causal" if shape.causal else "none"):
            if (names is None or name in names) and cfg not in configs:
                configs.append(cfg)
    return configs


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------
def _label(shape) -> str:
    return f"B{shape.B} S{shape.Sq} H{shape.H} D{shape.D}" + (" causal" if shape.causal else "")


def _kernel_fn(cfg, shape):
    import jax
    import jax.numpy as jnp

    from jax_fa4.ffi.call import call_kernel

    scale = 1.0 / math.sqrt(shape.D)
    window = (-1.0, 0.0) if shape.causal else (-1.0, -1.0)  # as the API passes them

    def attention(q, k, v):
        params = jnp.array([scale, 0.0, *window], jnp.float32)
        b, sq, h, _ = q.shape
        out, lse = call_kernel(cfg, "sm_90a", q, k, v, params, out_shapes=(
            jax.ShapeDtypeStruct((b, sq, h, v.shape[3]), q.dtype),
            jax.ShapeDtypeStruct((b, h, sq), jnp.float32)))
        return out, lse
    return attention


def _reference_check(out, q, k, v, shape, rows: int) -> dict[str, float]:
    """FA4's rule on the last ``rows`` query rows of batch 0, heads 0-1 (all keys)."""
    import jax.numpy as jnp
    import numpy as np

    from jax_fa4 import reference

    hs = slice(0, min(2, shape.H))
    qs, ks, vs = q[:1, -rows:, hs], k[:1, :, hs], v[:1, :, hs]
    kw = dict(softmax_scale=1.0 / math.sqrt(shape.D),
              window=(None, 0) if shape.causal else (None, None))
    ref, _ = reference.attention(qs, ks, vs, **kw)
    pt, _ = reference.attention(qs, ks, vs, compute_dtype=q.dtype, **kw)
    ref = np.asarray(ref, np.float32)
    got = np.asarray(out[:1, -rows:, hs], np.float32)
    err = float(np.max(np.abs(got - ref)))
    pt_err = float(np.max(np.abs(np.asarray(pt, np.float32) - ref)))
    ref_j = jnp.asarray(ref)
    atol = 2 * float(jnp.max(jnp.abs((ref_j + 0.3 - 0.3) - ref_j)))
    return {"ref_err": err, "ref_bound": 2 * pt_err + atol,
            "ref_nan": bool(np.isnan(got).any())}


def run(args) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from jax_fa4 import bench

    device = jax.devices()[0]
    names = args.variants.split(",") if args.variants else None
    shapes = shapes_for(args.shapes)
    print(f"jax {jax.__version__} on {device.device_kind}; {len(shapes)} shapes, variants "
          f"{names or 'all'}", flush=True)
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for si, shape in enumerate(shapes):
        mask = "causal" if shape.causal else "none"
        variants = [(n, c) for n, c in variants_for(shape.D, shape.Dv, mask)
                    if names is None or n in names or n == "v1"]
        arg_sets = bench.make_inputs(shape, jnp.bfloat16, jax.random.key(1000 + si), 1)
        arg_sets = [(q, k, v) for q, k, v, _ in arg_sets]
        q0, k0, v0 = arg_sets[0]
        flops = shape.fwd_flops()
        programs, entries = [], []
        base_out = None
        for name, cfg in variants:
            row = {"shape": _label(shape), "B": shape.B, "S": shape.Sq, "H": shape.H,
                   "D": shape.D, "causal": shape.causal, "variant": name,
                   "config": cfg.describe(), "flops": flops}
            try:
                fn = jax.jit(_kernel_fn(cfg, shape))
                compiled = fn.lower(q0, k0, v0).compile()
                out, lse = jax.block_until_ready(compiled(q0, k0, v0))
                if base_out is None:
                    base_out = (out, lse)
                    row["max_diff_vs_v1"], row["lse_diff_vs_v1"] = 0.0, 0.0
                else:
                    d_out = jnp.max(jnp.abs(out.astype(jnp.float32) -
                                            base_out[0].astype(jnp.float32)))
                    fin = jnp.isfinite(base_out[1])
                    d_lse = jnp.max(jnp.where(fin, jnp.abs(lse - base_out[1]), 0.0))
                    row["max_diff_vs_v1"], row["lse_diff_vs_v1"] = float(d_out), float(d_lse)
                row.update(_reference_check(out, q0, k0, v0, shape, args.ref_rows))
                row["ok"] = (not row["ref_nan"] and row["ref_err"] <= row["ref_bound"]
                             and row["max_diff_vs_v1"] <= args.max_diff)
                del out, lse
                programs.append(bench.make_program(fn, compiled, arg_sets, 1))
                entries.append(row)
            except Exception as err:  # a missing kernel or a failed check: record, go on
                row["skipped"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                if args.verbose:
                    traceback.print_exc()
            rows.append(row)
        cudnn_row = {"shape": _label(shape), "B": shape.B, "S": shape.Sq, "H": shape.H,
                     "D": shape.D, "causal": shape.causal, "variant": "cudnn", "flops": flops}
        try:
            cfn = jax.jit(bench._jax_nn_fn(shape, "cudnn"))
            ccompiled = cfn.lower(q0, k0, v0).compile()
            programs.append(bench.make_program(cfn, ccompiled, arg_sets, 1))
            entries.append(cudnn_row)
        except Exception as err:
            cudnn_row["skipped"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        rows.append(cudnn_row)
        del base_out
        timings = bench.time_programs(programs, repeats=args.repeats,
                                      target_s=args.target_ms / 1e3, sync_each=False)
        for row, t in zip(entries, timings):
            row.update(ms=t.ms, spread=t.spread, iters=t.iters, tflops=flops / (t.ms * 1e-3) / 1e12)
        cud = cudnn_row.get("tflops")
        v1 = next((r.get("tflops") for r in rows if r["shape"] == _label(shape)
                   and r["variant"] == "v1"), None)
        for row in rows:
            if row["shape"] == _label(shape) and "tflops" in row:
                row["ratio_vs_cudnn"] = row["tflops"] / cud if cud else None
                row["ratio_vs_v1"] = row["tflops"] / v1 if v1 else None
        line = "  ".join(f"{r['variant']} {r['tflops']:.0f}" for r in rows
                         if r["shape"] == _label(shape) and "tflops" in r)
        print(f"[{si + 1}/{len(shapes)}] {_label(shape)}: {line}  "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
        del arg_sets, programs
    return {"gpu": device.device_kind, "jax": jax.__version__,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": list(sys.orig_argv),
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "wall_s": round(time.perf_counter() - start, 1), "rows": rows}


def print_table(report: dict[str, Any]) -> None:
    rows = report["rows"]
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
    bad = [r for r in rows if r.get("ok") is False or "skipped" in r]
    for r in bad:
        why = r.get("skipped") or r.get("why") or (
            f"ref_err {r['ref_err']:.3g} (bound {r['ref_bound']:.3g}), "
            f"diff vs v1 {r['max_diff_vs_v1']:.3g}")
        print(f"  {r['shape']} {r['variant']}: {why}")


def precompile(args) -> int:
    from jax_fa4.ffi.cache import KernelCache
    from jax_fa4.precompile import build
    from jax_fa4.variants import Variant

    names = args.variants.split(",") if args.variants else None
    configs = variant_configs(args.shapes, names)
    if args.with_tests:  # the GPU tests' option configs (tests/gpu/test_sm90_fwd.py)
        from jax_fa4.kernels.sm90.fwd_config import option_test_configs

        configs += [c for c in option_test_configs() if c not in configs]
    records = build([Variant(c, "sm_90a") for c in configs], KernelCache(args.cache_dir))
    for r in records:
        print(r)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", choices=sorted(SHAPE_GROUPS), default="all")
    p.add_argument("--variants", help="comma-separated names (default: all; v1 always runs)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--target-ms", type=float, default=60.0, help="length of one timed round")
    p.add_argument("--ref-rows", type=int, default=256)
    p.add_argument("--max-diff", type=float, default=0.0625,
                   help="largest |out - out_v1| accepted (bf16 outputs, rounding differences)")
    p.add_argument("--out", type=Path)
    p.add_argument("--list", action="store_true", help="print the configs needed and exit")
    p.add_argument("--precompile", action="store_true", help="build the configs into the cache")
    p.add_argument("--cache-dir", help="kernel cache for --precompile (default: the package's)")
    p.add_argument("--with-tests", action="store_true",
                   help="--precompile also builds fwd_config.option_test_configs() (GPU tests)")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.list:
        configs = variant_configs(args.shapes, args.variants.split(",") if args.variants else None)
        if args.with_tests:
            from jax_fa4.kernels.sm90.fwd_config import option_test_configs

            configs += [c for c in option_test_configs() if c not in configs]
        for cfg in configs:
            print(cfg.describe())
        return 0
    if args.precompile:
        return precompile(args)
    report = run(args)
    print_table(report)
    out = args.out
    if out is None:
        slug = "".join(ch if ch.isalnum() else "-" for ch in report["gpu"].lower()).strip("-")
        out = Path("benchmarks/results") / f"fwd-variants-{slug}-{datetime.date.today()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {out} ({report['wall_s']} s)")
    failed = any(r.get("ok") is False for r in report["rows"])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
