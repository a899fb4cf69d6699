"""The cost of a learnable sink on the Hopper kernels: the same call with and without one.

Per shape (bf16, the anchors' training shapes at head dims 64, 128 and 256, causal and not), in
one process with ``jax_fa4.tools.bench``'s timing (warm-up, rounds rotating which program opens
them, median, input sets rotated past the L2), forward and forward+backward of
``jax_fa4.flash_attention(..., implementation="sm90")``:

* ``plain``: no sink;
* ``sink``: ``learnable_sink`` (H,) float32: in the forward kernel's softmax, and in the backward
  the ``sink_grad`` kernel (each thread sums ``e^{sink - lse}·P·dP`` for the sink's gradient; the
  plain loop only, so at head dim 128 it also gives up the swapped loop).

TFLOP/s use the anchors' convention (forward 2·B·Sq·Sk·H·(D+Dv), halved under a causal mask,
backward 2.5×, over t(fwd+bwd) − t(fwd)). Writes JSON with the command, GPU and date.

    python benchmarks/sink_bench.py --out benchmarks/results/sink-<gpu>-<date>.json
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp

import jax_fa4
from jax_fa4.tools import bench
from jax_fa4.tools.bench_harness import (labelled_shapes, rotating_sets, save, start,
                                         timing_parser)

#: (B, S, H, D)
SHAPES = ((4, 8192, 32, 64), (4, 8192, 16, 128), (4, 8192, 8, 256))


def main(argv=None) -> int:
    args = timing_parser(__doc__).parse_args(argv)
    device, t0 = start(args)
    rows = []
    for label, (b, s, h, d), causal in labelled_shapes(SHAPES):
        sets = rotating_sets(jax.random.key(b * s + d + causal), (b, s, h, d))
        sink = jnp.linspace(-1.0, 2.0, h, dtype=jnp.float32)
        programs, names = [], []
        for name, with_sink in (("plain", False), ("sink", True)):
            def attn(q, k, v, s_=None):
                return jax_fa4.flash_attention(q, k, v, causal=causal, learnable_sink=s_,
                                               implementation="sm90")

            def fwd(q, k, v, do, with_sink=with_sink):
                return attn(q, k, v, sink) if with_sink else attn(q, k, v)

            def fwd_bwd(q, k, v, do, with_sink=with_sink):
                if with_sink:
                    out, vjp = jax.vjp(attn, q, k, v, sink)
                else:
                    out, vjp = jax.vjp(attn, q, k, v)
                return out, vjp(do)

            for kind, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                compiled = jax.jit(fn).lower(*sets[0]).compile()
                programs.append(bench.make_program(None, compiled, sets, 1))
                names.append((name, kind))
        timings = bench.time_programs(programs, repeats=args.repeats,
                                      target_s=args.target_ms / 1e3, sync_each=False)
        ms = {key: t.ms for key, t in zip(names, timings)}
        f = 2.0 * b * s * s * h * 2 * d / (2 if causal else 1)
        for name in ("plain", "sink"):
            t_f, t_fb = ms[(name, "fwd")], ms[(name, "fwd+bwd")]
            rows.append(dict(shape=label, variant=name, fwd_ms=t_f, fwdbwd_ms=t_fb,
                             fwd_tflops=f / (t_f * 1e-3) / 1e12,
                             bwd_tflops=2.5 * f / ((t_fb - t_f) * 1e-3) / 1e12))
        plain, with_sink = rows[-2], rows[-1]
        for key in ("fwd_tflops", "bwd_tflops"):
            with_sink[key.replace("tflops", "vs_plain")] = with_sink[key] / plain[key]
        print(f"{label}: fwd {plain['fwd_tflops']:.0f} -> {with_sink['fwd_tflops']:.0f} "
              f"({with_sink['fwd_vs_plain']:.3f}), bwd {plain['bwd_tflops']:.0f} -> "
              f"{with_sink['bwd_tflops']:.0f} ({with_sink['bwd_vs_plain']:.3f})  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        del sets, programs
        save(args, device, t0, rows)
    save(args, device, t0, rows, final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
