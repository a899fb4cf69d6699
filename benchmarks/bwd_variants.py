"""Time the Hopper backward kernels under several tuning configs per anchor shape, in one process.

    python benchmarks/bwd_variants.py                     # on the H200 (kernels precompiled)
    python benchmarks/bwd_variants.py --list              # the configs it needs, one per line
    CUTE_DSL_ARCH=sm_90a python benchmarks/bwd_variants.py --precompile \\
        --cache-dir .device/kernel-cache                  # build them (CPU machine, no GPU)
    python benchmarks/bwd_variants.py --shapes d128 --variants det,m128n128s1p1

For every anchor shape, the GQA 32/8 and the head dim 96 shapes
(``jax_fa4.tools.bench_shapes``), bf16, causal and not, it runs the backward chain the library
runs (preprocess kernel, ``sm90_bwd`` main kernel, dQ postprocess, the GQA head sum) under each
main-kernel config of ``jax_fa4.tools.variant_sweeps.bwd_variants_for``: the tuning table's
(``v1``), every other tile / stage combination the config validator accepts
(``m{tile_m}n{tile_n}s{stages}p{pds_stages}``, with ``+swap`` for the swap_sdp form of the
same tile), the table's tile in the other launch order (``rev``: from the last key block down;
``fwd-launch``: from the first up), the loop forms (``swap``: ``BwdConfig.swap_sdp``;
``stats``: ``BwdConfig.stats_smem``; ``swap+stats``; ``red``: ``BwdConfig.dq_red``, and
``red+s3`` with one more Q stage; ``plain``: none of them) that the table does not pick,
the deterministic kernel (``det``, ``det+swap``).
Each is timed as its own program on saved forward outputs (out, lse from the forward kernel),
so the figure is the backward alone (the preprocess, with the config's zeroed dq_accum, the main
kernel and the postprocess): TFLOP/s = 2.5 × forward FLOPs / time. cuDNN's backward, and
FlashAttention-3's JAX binding's (row ``fa3-jax``) where ``flash_attn3_jax`` imports
(``jax_fa4.tools.bench_peers``), are timed the way ``jax_fa4.tools.bench`` does it,
t(fwd + bwd) − t(fwd), in the same rounds; the ratio is to cuDNN's. Timing is
``jax_fa4.tools.bench``'s (warm-up, alternating rounds, median, rotated inputs).

Checks per variant, on the first input set: dq, dk, dv against v1's (the GPU-tested default):
``max|x − x_v1| / max|x_v1|`` must stay below ``--max-rel-diff`` (bf16 rounding of differently
ordered sums), no NaN; ``det`` must also repeat bit for bit over two runs. A failed check marks
the cell ``FAIL``.

Output: a JSON (``--out``, default ``benchmarks/results/bwd-variants-<gpu>-<date>.json``) and a
table variant × shape of TFLOP/s (ratio to cuDNN's backward).
"""

from __future__ import annotations

import math
import traceback
from typing import Any, NamedTuple

from jax_fa4.tools import bench_harness, variant_sweeps as sweeps
from jax_fa4.tools.variant_sweeps import shape_label


class Opts(NamedTuple):
    """What the sm90 backend's backward reads of the API's options."""

    softmax_scale: float
    window: tuple
    softcap: float = 0.0
    deterministic: bool = False


# ---------------------------------------------------------------------------------------------
# running (the configs: jax_fa4.tools.variant_sweeps.bwd_variants_for)
# ---------------------------------------------------------------------------------------------
def _backward_fn(cfg, opts: Opts):
    from jax_fa4 import backends
    from jax_fa4.backends.kernel import dense_dq_accum_shape

    sm90 = backends.get("sm90")

    def backward(q, k, v, do, out, lse):
        # as the API runs it: the preprocess also returns the config's zeroed dq_accum
        delta, lse_log2, dq_accum = sm90.backward_preprocess_with_accum(
            out, do, lse, dense_dq_accum_shape(cfg, q))
        return sm90.backward(q, k, v, out, lse, do, delta, lse_log2, opts, config=cfg,
                             dq_accum=dq_accum)
    return backward


def _check(got, base, *, max_rel: float) -> tuple[bool, str]:
    import numpy as np

    worst = 0.0
    for name, g, b in zip(("dq", "dk", "dv"), got, base):
        g, b = np.asarray(g, np.float32), np.asarray(b, np.float32)
        if np.isnan(g).any():
            return False, f"{name}: NaN"
        worst = max(worst, float(np.max(np.abs(g - b)) / max(float(np.max(np.abs(b))), 1e-30)))
    return worst <= max_rel, f"max rel diff vs v1 {worst:.3g}"


def _peer_fns(shape, fa3) -> list[tuple[str, Any]]:
    """(row name, attention fn) of the peers timed beside the variants: cuDNN, and FA3-JAX
    where its module imports and its API expresses the shape."""
    from jax_fa4.tools import bench, bench_peers

    fns = [("cudnn", bench._jax_nn_fn(shape, "cudnn"))]
    # (its kernels raise past FA3_MAX_HEAD_DIM at run time, which would end the sweep here)
    if (fa3.available and bench_peers.static_refusal(bench_peers.FA3, shape, "bf16") is None
            and shape.D <= bench_peers.FA3_MAX_HEAD_DIM):
        fns.append((bench_peers.FA3, bench_peers.fa3_fn(fa3.module, shape)))
    return fns


def run(args) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_fa4
    from jax_fa4.tools import bench, bench_peers

    fa3 = bench_peers.load_peer(bench_peers.FA3)

    names = sweeps.variant_names(args)
    shapes = sweeps.bwd_shapes(args.shapes)
    device, start = bench_harness.start(args, len(shapes))
    rows: list[dict[str, Any]] = []
    for si, shape in enumerate(shapes):
        label = shape_label(shape) + ("" if shape.H == shape.Hkv else f" Hkv{shape.Hkv}")
        opts = Opts(1.0 / math.sqrt(shape.D), (None, 0) if shape.causal else (None, None))
        fwd = jax.jit(lambda q, k, v: jax_fa4.flash_attention(  # noqa: E731
            q, k, v, causal=shape.causal, return_lse=True, implementation="sm90"))
        inputs = bench.make_inputs(shape, jnp.bfloat16, jax.random.key(2000 + si), 1)
        arg_sets = [(q, k, v, do, *fwd(q, k, v)) for q, k, v, do in inputs]
        flops = 2.5 * shape.fwd_flops()
        programs, entries, base = [], [], None
        for name, cfg in sweeps.bwd_shape_variants(shape, names):
            row = {"shape": label, "B": shape.B, "S": shape.Sq, "H": shape.H, "Hkv": shape.Hkv,
                   "D": shape.D, "causal": shape.causal, "variant": name,
                   "config": cfg.describe(), "flops": flops}
            try:
                fn = jax.jit(_backward_fn(cfg, opts))
                compiled = fn.lower(*arg_sets[0]).compile()
                got = [np.asarray(g) for g in jax.block_until_ready(compiled(*arg_sets[0]))]
                if base is None:
                    base, row["ok"] = got, bool(all(np.isfinite(g.astype(np.float32)).all()
                                                    for g in got))
                else:
                    row["ok"], row["why"] = _check(got, base, max_rel=args.max_rel_diff)
                if cfg.deterministic:
                    again = [np.asarray(g) for g in compiled(*arg_sets[0])]
                    bitwise = all(np.array_equal(a, b) for a, b in zip(got, again))
                    row["bitwise_repeatable"] = bitwise
                    if not bitwise:
                        row["ok"], row["why"] = False, "not bitwise repeatable"
                programs.append(bench.make_program(fn, compiled, arg_sets, 1))
                entries.append(row)
            except Exception as err:  # a missing kernel or a failed launch: record, go on
                row["skipped"] = bench_harness.error_text(err)
                if args.verbose:
                    traceback.print_exc()
            rows.append(row)
        # the peers' backward (cuDNN's, and FA3-JAX's where importable): t(fwd + bwd) - t(fwd),
        # timed in the same rounds
        n_ours = len(programs)
        peer_rows = []
        for peer, pfn in _peer_fns(shape, fa3):
            prow = {"shape": label, "B": shape.B, "S": shape.Sq, "H": shape.H,
                    "Hkv": shape.Hkv, "D": shape.D, "causal": shape.causal, "variant": peer,
                    "flops": flops}
            try:
                f1, f2 = jax.jit(pfn), jax.jit(bench._fwd_bwd(pfn))
                pair = [bench.make_program(f1, f1.lower(*inputs[0][:3]).compile(),
                                           [s[:3] for s in inputs], 1),
                        bench.make_program(f2, f2.lower(*inputs[0]).compile(), inputs, 1)]
                prow["at"] = len(programs)
                programs += pair
            except Exception as err:
                prow["skipped"] = bench_harness.error_text(err)
            peer_rows.append(prow)
        timings = bench.time_programs(programs, repeats=args.repeats,
                                      target_s=args.target_ms / 1e3, sync_each=False)
        for row, t in zip(entries, timings[:n_ours]):
            row.update(ms=t.ms, spread=t.spread, iters=t.iters,
                       tflops=flops / (t.ms * 1e-3) / 1e12)
        for prow in peer_rows:
            at = prow.pop("at", None)
            if at is not None:
                ms = timings[at + 1].ms - timings[at].ms
                prow.update(ms=ms, fwd_ms=timings[at].ms, tflops=flops / (ms * 1e-3) / 1e12)
        rows += peer_rows
        sweeps.finish_shape(rows, label, si, len(shapes), start)
        del arg_sets, inputs, programs
    return bench_harness.report(device, args, start, rows)


def main(argv=None) -> int:
    p = sweeps.parser(__doc__)
    p.add_argument("--max-rel-diff", type=float, default=2e-2,
                   help="largest max|x - x_v1| / max|x_v1| accepted for dq, dk, dv")
    args = p.parse_args(argv)
    configs = sweeps.bwd_variant_configs(args.shapes, sweeps.variant_names(args))
    if args.list:
        for cfg in configs:
            print(cfg.describe())
        return 0
    if args.precompile:
        return sweeps.precompile(configs, args)
    return sweeps.write(run(args), "bwd-variants", args.out)


if __name__ == "__main__":
    raise SystemExit(main())
