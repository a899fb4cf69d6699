"""Time the Hopper forward kernel under several tuning configs per anchor shape, in one process.

    python benchmarks/fwd_variants.py                     # on the H200 (kernels precompiled)
    python benchmarks/fwd_variants.py --list              # the configs it needs, one per line
    CUTE_DSL_ARCH=sm_90a python benchmarks/fwd_variants.py --precompile --with-tests \
        --cache-dir .device/kernel-cache                  # build them (CPU machine, no GPU)
    python benchmarks/fwd_variants.py --shapes d64 --variants v1,3wg+pp --repeats 9

For every anchor shape (``jax_fa4.tools.bench_shapes.ANCHOR_SHAPES``: B·S·H·D of the peers' table,
and ``D96_SHAPES``, the extra table's head dim 96 pair; causal and not, bf16) it runs the
kernel directly (``jax_fa4.ffi.call.call_kernel``, bypassing the dispatch, so a config that is not the table's default can run) under each config of
``variants_for(D, Dv, mask)``, and cuDNN (``jax.nn.dot_product_attention(implementation=
"cudnn")``) in the same process. ``variant_configs()`` lists exactly the kernels it needs.

Timing (``jax_fa4.tools.bench``'s method): every program is compiled and warmed up, then the rounds of
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

import math
import sys
import traceback
from typing import Any

import variant_harness as harness
from variant_harness import SHAPE_GROUPS

H200_SMS = 132  # the persistent variants' grid (an H100 SXM has 132 SMs too)


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
    if head_dim in (64, 128):
        add("rs8", rescale_threshold=8.0)
    if head_dim == 64:
        add("3wg", tile_m=192)
        add("3wg+pp", tile_m=192, pingpong=True)
        add("3wg+pp+rs8", tile_m=192, pingpong=True, rescale_threshold=8.0)
        add("3wg+pp+rs8+persist", tile_m=192, pingpong=True, rescale_threshold=8.0,
            num_sms=H200_SMS)
        for per_32 in (4, 6, 8):  # partial software exp2 (FMA pipe), tile 192
            add(f"3wg+sx{per_32}", tile_m=192, exp2_sw_per_32=per_32)
        add("3wg+pp+rs8+sx6", tile_m=192, pingpong=True, rescale_threshold=8.0, exp2_sw_per_32=6)
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


def shapes_for(group: str = "all"):
    from jax_fa4.tools.bench_shapes import ANCHOR_SHAPES, D96_SHAPES

    return [s for s in ANCHOR_SHAPES + D96_SHAPES if s.D in SHAPE_GROUPS[group]]


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

    from jax_fa4.tools import bench

    names = harness.variant_names(args)
    shapes = shapes_for(args.shapes)
    device, start = harness.start(args, len(shapes))
    rows: list[dict[str, Any]] = []
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
                row["why"] = (f"ref_err {row['ref_err']:.3g} (bound {row['ref_bound']:.3g}), "
                              f"diff vs v1 {row['max_diff_vs_v1']:.3g}")
                del out, lse
                programs.append(bench.make_program(fn, compiled, arg_sets, 1))
                entries.append(row)
            except Exception as err:  # a missing kernel or a failed check: record, go on
                row["skipped"] = harness.error_text(err)
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
            cudnn_row["skipped"] = harness.error_text(err)
        rows.append(cudnn_row)
        del base_out
        timings = bench.time_programs(programs, repeats=args.repeats,
                                      target_s=args.target_ms / 1e3, sync_each=False)
        for row, t in zip(entries, timings):
            row.update(ms=t.ms, spread=t.spread, iters=t.iters, tflops=flops / (t.ms * 1e-3) / 1e12)
        harness.finish_shape(rows, _label(shape), si, len(shapes), start)
        del arg_sets, programs
    return harness.report(device, args, start, rows)


def configs_for(args) -> list[Any]:
    configs = variant_configs(args.shapes, harness.variant_names(args))
    if args.with_tests:  # the GPU tests' option configs (tests/gpu/test_sm90_fwd.py)
        from jax_fa4.tools.variants import sm90_fwd_option_configs

        configs += [c for c in sm90_fwd_option_configs() if c not in configs]
    return configs


def main(argv=None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--ref-rows", type=int, default=256)
    p.add_argument("--max-diff", type=float, default=0.0625,
                   help="largest |out - out_v1| accepted (bf16 outputs, rounding differences)")
    p.add_argument("--with-tests", action="store_true",
                   help="--list / --precompile also cover variants.sm90_fwd_option_configs()")
    args = p.parse_args(argv)
    if args.list:
        for cfg in configs_for(args):
            print(cfg.describe())
        return 0
    if args.precompile:
        return harness.precompile(configs_for(args), args.cache_dir)
    return harness.write(run(args), "fwd-variants", args.out)


if __name__ == "__main__":
    raise SystemExit(main())
