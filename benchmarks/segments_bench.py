"""Packed rows with segment ids on the GPU, per useful FLOP, against the dense kernels.

Issue #23's bar: ``flash_attention(..., segment_ids=...)`` on rows of 8k tokens packed with
documents of 512–4k tokens at ≥ 0.95× the dense kernel's TFLOP/s, counting only the FLOPs
inside documents (what a packed model needs), forward (and forward+backward once a backward
kernel takes segment ids: ``--with-backward``). Per shape (B rows of S tokens, H heads, hdim D,
bf16; causal and not), in one process with ``jax_fa4.tools.bench``'s timing (warm-up, rounds rotating
which program opens them, median, input sets rotated past the L2):

* ``dense``: ``flash_attention`` on (B, S, H, D), no segment ids (all S² FLOPs useful);
* ``segments``: the same rows with segment ids cutting each into documents of 512–4k tokens
  (each row its own cut points; FLOPs counted per document);
* ``varlen``: the same documents through ``flash_attention_varlen`` (packed (B·S, H, D));
* ``dense+max_logits`` / ``segments+max_logits`` (forward only): the same calls with
  ``return_max_logits=True`` (QK-Clip), for the max-logit overhead (``max_logits_overhead``:
  time over the call without it, minus 1).

The ids (and cu_seqlens) are arguments of the jitted programs, as in a training step, so the
segment tables are built on the GPU in every call (constants would be folded at compile time).

TFLOP/s use the anchors' convention (forward 2·Σ Sq·Sk·H·(D+Dv), halved under a causal mask,
backward 2.5×). Writes JSON with the command, GPU and date; each row has
``"segment_ids": true`` where segment ids ran.

    python benchmarks/segments_bench.py --out benchmarks/results/segments-<gpu>-<date>.json
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa4
from jax_fa4.tools import bench
from variant_harness import labelled_shapes, rotating_sets, save, start, timing_parser

#: (B, S, H, D): rows of 8k tokens (the issue's shape) at hdim 128 and 64
SHAPES = ((2, 8192, 16, 128), (4, 8192, 8, 64))
DOC_MIN, DOC_MAX = 512, 4096


def documents(rng: np.random.Generator, s: int) -> list[int]:
    """Lengths in [DOC_MIN, DOC_MAX] summing to s (the last one takes the rest)."""
    lens = []
    while s - sum(lens) > DOC_MAX:
        lens.append(int(rng.integers(DOC_MIN, DOC_MAX + 1)))
    rest = s - sum(lens)
    if rest < DOC_MIN and lens:  # fold a short tail into the previous document
        lens[-1] += rest
    else:
        lens.append(rest)
    return lens


def flops(lens: list[int], h: int, d: int, causal: bool) -> float:
    f = sum(2.0 * n * n * h * 2 * d for n in lens)
    return f / 2 if causal else f


def main(argv=None) -> int:
    parser = timing_parser(__doc__)
    parser.add_argument("--with-backward", action="store_true",
                        help="also time forward+backward (the backward of segment ids)")
    args = parser.parse_args(argv)
    device, t0 = start(args)
    rows = []
    for label, (b, s, h, d), causal in labelled_shapes(SHAPES):
        rng = np.random.default_rng(b * s + d + causal)
        docs = [documents(rng, s) for _ in range(b)]
        ids = jnp.asarray(np.stack([np.repeat(np.arange(len(x)), x) for x in docs]), jnp.int32)
        flat = [n for row in docs for n in row]
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(flat)]), jnp.int32)
        sets = [(*x, ids, cu) for x in rotating_sets(jax.random.key(b * s + causal),
                                                       (b, s, h, d))]
        shape = (b, s, h, d)
        variants = {
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
        programs, names = [], []
        for name, (lens, attn) in variants.items():
            def fwd(q, k, v, do, ids, cu, attn=attn):
                return attn(q, k, v, ids, cu)

            def fwd_bwd(q, k, v, do, ids, cu, attn=attn):
                out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, ids, cu), q, k, v)
                return out, vjp(do)

            kinds = ("fwd", "fwd+bwd") if args.with_backward and "max" not in name else ("fwd",)
            for kind, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                if kind in kinds:
                    compiled = jax.jit(fn).lower(*sets[0]).compile()
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
                       documents=docs if not name.startswith("dense") else None,
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
        line = "  ".join(f"{r['variant']} fwd {r['useful_fwd_tflops']:.0f} "
                         f"({r['fwd_vs_dense']:.2f})" for r in mine)
        print(f"{label}: {line}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        del sets, programs
        save(args, device, t0, rows)
    save(args, device, t0, rows, final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
