"""The cost of forward-mode autodiff through ``jax_fa4.flash_attention`` on the Hopper kernels.

A JVP's primal output is the forward kernel's; its tangent is the JVP of the float32 reference
(docs/api.md, "Forward mode"): one more attention-sized pass that materialises the scores up to
4096² per head and runs the blocked reference's scan beyond. Per shape (bf16, MHA, causal and
not), in one process with ``jax_fa4.tools.bench``'s timing (warm-up, rounds rotating which
program opens them, median, input sets rotated past the L2):

* ``fwd``: ``flash_attention(q, k, v)``, the forward kernel alone;
* ``jvp``: ``jax.jvp(flash_attention, (q, k, v), (tq, tk, tv))``, primal and tangent;
* ``fwd+bwd``: ``jax.vjp`` and its pullback, the reverse-mode program, for scale;
* ``xla jvp``: ``jax.jvp`` of ``jax.nn.dot_product_attention(implementation="xla")``, the
  forward mode a JAX user has without this package (``"cudnn"`` has none: its rule is a
  custom_vjp; the row records the error).

Writes JSON with the command, GPU and date; each row a (shape, variant) with its median ms and
its ratio to the shape's ``fwd``.

    python benchmarks/jvp_bench.py --out benchmarks/results/jvp-<gpu>-<date>.json
"""

from __future__ import annotations

import sys
import time

import jax

import jax_fa4
from jax_fa4.tools import bench
from jax_fa4.tools.bench_harness import (error_text, labelled_shapes, rotating_sets, save, start,
                                         timing_parser)

#: (B, S, H, D): scores materialised by the reference's tangent (S ≤ 4096), then its scan
SHAPES = ((8, 1024, 16, 128), (2, 4096, 16, 128), (1, 8192, 16, 128))


def programs_for(causal: bool) -> dict[str, object]:
    """The four programs of one shape, each taking (q, k, v, tq, tk, tv)."""
    def ours(q, k, v):
        return jax_fa4.flash_attention(q, k, v, causal=causal, implementation="sm90")

    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")

    def fwd_bwd(q, k, v, tq, tk, tv):
        out, pullback = jax.vjp(ours, q, k, v)
        return out, pullback(tq)

    return {
        "fwd": lambda q, k, v, tq, tk, tv: ours(q, k, v),
        "jvp": lambda q, k, v, tq, tk, tv: jax.jvp(ours, (q, k, v), (tq, tk, tv)),
        "fwd+bwd": fwd_bwd,
        "xla jvp": lambda q, k, v, tq, tk, tv: jax.jvp(xla, (q, k, v), (tq, tk, tv)),
        "cudnn jvp": lambda q, k, v, tq, tk, tv: jax.jvp(cudnn, (q, k, v), (tq, tk, tv)),
    }


def main(argv=None) -> int:
    args = timing_parser(__doc__).parse_args(argv)
    device, t0 = start(args)
    rows = []
    for label, (b, s, h, d), causal in labelled_shapes(SHAPES):
        sets = rotating_sets(jax.random.key(b * s + d + causal), (b, s, h, d), per_set=6)
        programs, names = [], []
        for name, fn in programs_for(causal).items():
            try:
                compiled = jax.jit(fn).lower(*sets[0]).compile()
            except Exception as err:  # noqa: BLE001 - a peer without forward mode is a row
                rows.append(dict(shape=label, variant=name, error=error_text(err)))
                continue
            programs.append(bench.make_program(None, compiled, sets, 1))
            names.append(name)
        timings = bench.time_programs(programs, repeats=args.repeats,
                                      target_s=args.target_ms / 1e3, sync_each=False)
        ms = dict(zip(names, (t.ms for t in timings)))
        for name, t in ms.items():
            rows.append(dict(shape=label, variant=name, ms=t, vs_fwd=t / ms["fwd"]))
        print(f"{label}: " + ", ".join(f"{n} {t:.3f} ms" for n, t in ms.items())
              + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
        del sets, programs
        save(args, device, t0, rows)
    save(args, device, t0, rows, final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
