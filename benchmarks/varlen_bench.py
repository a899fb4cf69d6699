"""Packed (varlen) training speed on the GPU against the dense kernels at the same total tokens.

The bar (issue #8): forward and forward+backward of ``jax_fa4.flash_attention_varlen`` within
10 % of the dense ``jax_fa4.flash_attention`` TFLOP/s when the packed batch holds the same
tokens.
Per shape (B sequences of S tokens, H heads, hdim D, bf16; causal and not), in one process with
``jax_fa4.tools.bench``'s timing (warm-up, rounds rotating which program opens them, median, input
sets rotated past the L2):

* ``dense``: ``flash_attention`` on (B, S, H, D);
* ``varlen``: ``flash_attention_varlen`` on the same tokens packed as (B·S, H, D) with
  ``cu_seqlens = [0, S, 2S, ...]``;
* ``varlen-mixed``: the same total tokens cut into sequences of unequal lengths (S/4 … 7S/4, so
  max_seqlen = 7S/4; FLOPs counted per sequence);
* ``...-heavy``: the same with the varlen backward's work items launched heaviest first
  (``JAX_FA4_VARLEN_BWD_ORDER=heavy_first``) instead of sequence by sequence (the default).

TFLOP/s use the anchors' convention (forward 2·Σ Sq·Sk·H·(D+Dv), halved under a causal mask,
backward 2.5×). Writes JSON with the command, GPU and date.

    python benchmarks/varlen_bench.py --out benchmarks/results/varlen-<gpu>-<date>.json
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa4
from jax_fa4.tools import bench
from jax_fa4.tools.bench_harness import (labelled_shapes, rotating_sets, save, start,
                                         timing_parser)

#: (B, S, H, D): the anchors' hdim-128 training shapes, and many short documents
SHAPES = ((16, 2048, 16, 128), (4, 8192, 16, 128), (64, 512, 16, 128))


def mixed_lengths(b: int, s: int) -> list[int]:
    """B lengths summing to B·S, from S/4 to 7S/4 (pairs that add up to 2S)."""
    lens = []
    for i in range(b // 2):
        short = s // 4 + (i * s) // max(1, b // 2)
        lens += [short, 2 * s - short]
    return lens + [s] * (b % 2)


def flops(lens: list[int], h: int, d: int, causal: bool) -> float:
    f = sum(2.0 * n * n * h * 2 * d for n in lens)
    return f / 2 if causal else f


def main(argv=None) -> int:
    args = timing_parser(__doc__).parse_args(argv)
    device, t0 = start(args)
    rows = []
    for label, (b, s, h, d), causal in labelled_shapes(SHAPES):
        total = b * s
        sets = rotating_sets(jax.random.key(b * s + causal), (total, h, d))
        variants = {"dense": ([s] * b, None), "varlen": ([s] * b, "sequence"),
                    "varlen-heavy": ([s] * b, "heavy_first"),
                    "varlen-mixed": (mixed_lengths(b, s), "sequence"),
                    "varlen-mixed-heavy": (mixed_lengths(b, s), "heavy_first")}
        programs, names = [], []
        for name, (lens, order) in variants.items():
            if order is not None:  # read when the backward is traced
                os.environ["JAX_FA4_VARLEN_BWD_ORDER"] = order
            cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
            mx = max(lens)
            if name == "dense":
                def attn(q, k, v):
                    shape = (b, s, h, d)
                    return jax_fa4.flash_attention(
                        q.reshape(shape), k.reshape(shape), v.reshape(shape),
                        causal=causal, implementation="sm90").reshape(total, h, d)
            else:
                def attn(q, k, v, cu=cu, mx=mx):
                    return jax_fa4.flash_attention_varlen(q, k, v, cu, cu, mx, mx,
                                                          causal=causal,
                                                          implementation="sm90")

            def fwd(q, k, v, do, attn=attn):
                return attn(q, k, v)

            def fwd_bwd(q, k, v, do, attn=attn):
                out, vjp = jax.vjp(attn, q, k, v)
                return out, vjp(do)

            for kind, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                compiled = jax.jit(fn).lower(*sets[0]).compile()
                programs.append(bench.make_program(None, compiled, sets, 1))
                names.append((name, kind, lens))
        timings = bench.time_programs(programs, repeats=args.repeats,
                                      target_s=args.target_ms / 1e3, sync_each=False)
        ms = {(n, kind): t.ms for (n, kind, _), t in zip(names, timings)}
        for name, (lens, _) in variants.items():
            f = flops(lens, h, d, causal)
            t_f, t_fb = ms[(name, "fwd")], ms[(name, "fwd+bwd")]
            rows.append(dict(shape=label, variant=name, lengths=lens, fwd_ms=t_f,
                             fwdbwd_ms=t_fb, fwd_tflops=f / (t_f * 1e-3) / 1e12,
                             bwd_tflops=2.5 * f / ((t_fb - t_f) * 1e-3) / 1e12,
                             fwdbwd_tflops=3.5 * f / (t_fb * 1e-3) / 1e12))
        mine = [r for r in rows if r["shape"] == label]
        dense = next(r for r in mine if r["variant"] == "dense")
        for r in mine:
            r["fwd_vs_dense"] = r["fwd_tflops"] / dense["fwd_tflops"]
            r["fwdbwd_vs_dense"] = r["fwdbwd_tflops"] / dense["fwdbwd_tflops"]
        line = "  ".join(f"{r['variant']} fwd {r['fwd_tflops']:.0f} ({r['fwd_vs_dense']:.2f}) "
                         f"fwd+bwd {r['fwdbwd_tflops']:.0f} ({r['fwdbwd_vs_dense']:.2f})"
                         for r in mine)
        print(f"{label}: {line}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        del sets, programs  # free the device arrays before the next shape
        save(args, device, t0, rows)
    save(args, device, t0, rows, final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
