"""Time the Hopper forward kernel under several tuning configs per anchor shape, in one process.

    python benchmarks/fwd_variants.py                     # on the H200 (kernels precompiled)
    python benchmarks/fwd_variants.py --list              # the configs it needs, one per line
    CUTE_DSL_ARCH=sm_90a python benchmarks/fwd_variants.py --precompile --with-tests \
        --cache-dir .device/kernel-cache                  # build them (CPU machine, no GPU)
    python benchmarks/fwd_variants.py --shapes d64 --variants v1,3wg+pp --repeats 9

For every anchor shape (``jax_fa4.tools.bench_shapes.ANCHOR_SHAPES``: B·S·H·D of the peers'
table, and ``D96_SHAPES``, the extra table's head dim 96 pair; causal and not, bf16) it runs the
kernel directly (``jax_fa4.backends.sm90.call_forward``: ``call_kernel`` plus the tile counter of
a dynamic-tiles config, bypassing the dispatch, so a config that is not the table's default can
run) under each config of
``jax_fa4.tools.variant_sweeps.fwd_variants_for(D, Dv, mask)``, and cuDNN
(``jax.nn.dot_product_attention(implementation="cudnn")``) in the same process. ``--list``
prints exactly the kernels it needs.

Timing (``jax_fa4.tools.bench``'s method): every program is compiled and warmed up, then the
rounds of all programs of one shape alternate (v1, pp, ..., cuDNN, v1, ...), so a drift in
clocks biases the ratios little; each round is as many back-to-back dispatches as fill
``--target-ms``, synchronised with ``block_until_ready``; the figure is the median round.
Dispatches rotate over several random input sets (together > 2 × the 60 MB L2).

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
import traceback
from typing import Any

from jax_fa4.tools import bench_harness, variant_sweeps as sweeps
from jax_fa4.tools.variant_sweeps import shape_label


# ---------------------------------------------------------------------------------------------
# running (the configs: jax_fa4.tools.variant_sweeps.fwd_variants_for)
# ---------------------------------------------------------------------------------------------
def _kernel_fn(cfg, shape):
    import jax
    import jax.numpy as jnp

    from jax_fa4.backends.sm90 import call_forward

    scale = 1.0 / math.sqrt(shape.D)
    window = (-1.0, 0.0) if shape.causal else (-1.0, -1.0)  # as the API passes them

    def attention(q, k, v):
        params = jnp.array([scale, 0.0, *window], jnp.float32)
        b, sq, h, _ = q.shape
        out, lse = call_forward(cfg, q, k, v, params, out_shapes=(
            jax.ShapeDtypeStruct((b, sq, h, v.shape[3]), q.dtype),
            jax.ShapeDtypeStruct((b, h, sq), jnp.float32)))
        return out, lse
    return attention


def _reference_check(out, q, k, v, shape, rows: int) -> dict[str, float]:
    """FA4's rule on the last ``rows`` query rows of batch 0, heads 0-1 (all keys)."""
    import numpy as np

    from jax_fa4 import reference
    from jax_fa4.tools.fa4_rule import fa4_error

    hs = slice(0, min(2, shape.H))
    qs, ks, vs = q[:1, -rows:, hs], k[:1, :, hs], v[:1, :, hs]
    kw = dict(softmax_scale=1.0 / math.sqrt(shape.D),
              window=(None, 0) if shape.causal else (None, None))
    ref, _ = reference.attention(qs, ks, vs, **kw)
    pt, _ = reference.attention(qs, ks, vs, compute_dtype=q.dtype, **kw)
    got = out[:1, -rows:, hs]
    e = fa4_error(got, np.asarray(ref, np.float32), pt)  # atol at float32's granularity
    return {"ref_err": e.err, "ref_bound": e.bound,
            "ref_nan": bool(np.isnan(np.asarray(got, np.float32)).any())}


def run(args) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from jax_fa4.tools import bench

    names = sweeps.variant_names(args)
    shapes = sweeps.fwd_shapes(args.shapes)
    device, start = bench_harness.start(args, len(shapes))
    rows: list[dict[str, Any]] = []
    for si, shape in enumerate(shapes):
        mask = "causal" if shape.causal else "none"
        variants = [(n, c) for n, c in sweeps.fwd_variants_for(shape.D, shape.Dv, mask)
                    if names is None or n in names or n == "v1"]
        arg_sets = bench.make_inputs(shape, jnp.bfloat16, jax.random.key(1000 + si), 1)
        arg_sets = [(q, k, v) for q, k, v, _ in arg_sets]
        q0, k0, v0 = arg_sets[0]
        flops = shape.fwd_flops()
        programs, entries = [], []
        base_out = None
        for name, cfg in variants:
            row = {"shape": shape_label(shape), "B": shape.B, "S": shape.Sq, "H": shape.H,
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
                row["skipped"] = bench_harness.error_text(err)
                if args.verbose:
                    traceback.print_exc()
            rows.append(row)
        cudnn_row = {"shape": shape_label(shape), "B": shape.B, "S": shape.Sq, "H": shape.H,
                     "D": shape.D, "causal": shape.causal, "variant": "cudnn", "flops": flops}
        try:
            cfn = jax.jit(bench._jax_nn_fn(shape, "cudnn"))
            ccompiled = cfn.lower(q0, k0, v0).compile()
            programs.append(bench.make_program(cfn, ccompiled, arg_sets, 1))
            entries.append(cudnn_row)
        except Exception as err:
            cudnn_row["skipped"] = bench_harness.error_text(err)
        rows.append(cudnn_row)
        del base_out
        timings = bench.time_programs(programs, repeats=args.repeats,
                                      target_s=args.target_ms / 1e3, sync_each=False)
        for row, t in zip(entries, timings):
            row.update(ms=t.ms, spread=t.spread, iters=t.iters, tflops=flops / (t.ms * 1e-3) / 1e12)
        sweeps.finish_shape(rows, shape_label(shape), si, len(shapes), start)
        del arg_sets, programs
    return bench_harness.report(device, args, start, rows)


def configs_for(args) -> list[Any]:
    configs = sweeps.fwd_variant_configs(args.shapes, sweeps.variant_names(args))
    if args.with_tests:  # the GPU tests' option configs (tests/gpu/test_sm90_fwd.py)
        from jax_fa4.tools.variants import sm90_fwd_option_configs

        configs += [c for c in sm90_fwd_option_configs() if c not in configs]
    return configs


def main(argv=None) -> int:
    p = sweeps.parser(__doc__)
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
        return sweeps.precompile(configs_for(args), args)
    return sweeps.write(run(args), "fwd-variants", args.out)


if __name__ == "__main__":
    raise SystemExit(main())
