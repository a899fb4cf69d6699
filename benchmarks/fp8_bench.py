"""The FP8 (e4m3) forward against cuDNN's FP8 attention and our bfloat16 forward (issue #26).

Per shape (B, S, H, D; self-attention, causal and not), in one process with
``jax_fa4.tools.bench``'s timing (warm-up, rounds rotating which program opens them, median,
input sets rotated past the L2), forward only:

* ``jax-fa4-fp8``: ``flash_attention`` on e4m3 q, k, v with per-(batch, kv head) descales,
  bfloat16 out (the kernel; v's transpose for the kernel is part of the call);
* ``cudnn-fp8``: cuDNN's FP8 flash attention through JAX's private module
  ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(use_fp8=True)`` (per-tensor
  descales, e4m3 out), the only FP8 attention JAX has; ``error`` if it declines;
* ``jax-fa4-bf16`` / ``cudnn-bf16``: the same shape in bfloat16 (our kernel, and
  ``jax.nn.dot_product_attention(implementation="cudnn")``).

TFLOP/s use the anchors' convention (4·B·S²·H·D, halved under a causal mask). Accuracy
(``rmse``, ``max_err``): each FP8 implementation's output against the float32 reference on the
*same* dequantised inputs (per-tensor scales here, so both FP8 implementations read identical
e4m3 values), at the first shape only (the reference is O(S²) memory). Writes JSON with the
command, GPU and date; rows carry ``"dtype": "float8_e4m3fn"`` where FP8 ran.

    python benchmarks/fp8_bench.py --out benchmarks/results/fp8-<gpu>-<date>.json
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa4
from jax_fa4 import fp8
from jax_fa4.tools import bench
from jax_fa4.tools.bench_harness import save, start, timing_parser

#: (B, S, H, D): 16k tokens per call (S >= 8k, the issue's long-prefill regime)
SHAPES = ((2, 8192, 16, 128), (4, 8192, 32, 64), (2, 8192, 8, 256))


def main(argv=None) -> int:
    parser = timing_parser(__doc__)
    args = parser.parse_args(argv)
    device, t0 = start(args)
    rows = []
    for si, (b, s, h, d) in enumerate(SHAPES):
        for causal in (False, True):
            label = f"B{b} S{s} H{h} D{d}" + (" causal" if causal else "")
            flops = 4.0 * b * s * s * h * d / (2 if causal else 1)
            key = jax.random.key(si * 2 + causal)
            n_sets = max(2, -(-bench.ROTATION_BYTES // (3 * b * s * h * d * 2)))
            bf16_sets, fp8_sets, ts_sets = [], [], []
            for set_key in jax.random.split(key, n_sets):
                q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16)
                           for kk in jax.random.split(set_key, 3))
                bf16_sets.append((q, k, v))
                (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(x) for x in (q, k, v))
                fp8_sets.append((q8, k8, v8, qd, kd, vd))
                # per-tensor scales: what cuDNN takes (and the accuracy comparison reads)
                ts = [bench.per_tensor_e4m3(x) for x in (q, k, v)]
                ts_sets.append(tuple(x8 for x8, _ in ts) + tuple(sc for _, sc in ts))
            variants = {
                "jax-fa4-fp8": (fp8_sets, lambda q, k, v, qd, kd, vd: jax_fa4.flash_attention(
                    q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, causal=causal,
                    implementation="sm90")),
                "cudnn-fp8": (ts_sets, bench.cudnn_fp8_fn(causal, d)),
                "jax-fa4-bf16": (bf16_sets, lambda q, k, v: jax_fa4.flash_attention(
                    q, k, v, causal=causal, implementation="sm90")),
                "cudnn-bf16": (bf16_sets, lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, is_causal=causal, implementation="cudnn")),
            }
            programs, names, errors = [], [], {}
            for name, (sets, fn) in variants.items():
                try:
                    compiled = jax.jit(fn).lower(*sets[0]).compile()
                except Exception as err:  # noqa: BLE001 - a peer may decline a shape
                    errors[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                    continue
                programs.append(bench.make_program(None, compiled, sets, 1))
                names.append(name)
            timings = bench.time_programs(programs, repeats=args.repeats,
                                          target_s=args.target_ms / 1e3, sync_each=False)
            ms = {n: t.ms for n, t in zip(names, timings)}
            accuracy = {}
            if si == 0:  # same e4m3 inputs (per-tensor scales) for both FP8 implementations
                q8, k8, v8, qd, kd, vd = ts_sets[0]
                deq = [x.astype(jnp.float32) * sc for x, sc in ((q8, qd), (k8, kd), (v8, vd))]
                ref = jax_fa4.flash_attention(*deq, causal=causal, implementation="reference")
                outs = {"jax-fa4-fp8": jax_fa4.flash_attention(
                    q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=causal,
                    implementation="sm90")}
                if "cudnn-fp8" in ms:
                    outs["cudnn-fp8"] = bench.cudnn_fp8_fn(causal, d)(*ts_sets[0])
                for name, out in outs.items():
                    diff = np.asarray(out, np.float32) - np.asarray(ref, np.float32)
                    accuracy[name] = dict(rmse=float(np.sqrt(np.mean(diff ** 2))),
                                          max_err=float(np.max(np.abs(diff))))
            line = []
            for name in variants:
                row = dict(shape=label, variant=name, B=b, S=s, H=h, D=d, causal=causal,
                           dtype="float8_e4m3fn" if name.endswith("fp8") else "bfloat16",
                           fwd_ms=ms.get(name), error=errors.get(name),
                           fwd_tflops=flops / (ms[name] * 1e-3) / 1e12 if name in ms else None,
                           **accuracy.get(name, {}))
                rows.append(row)
                if name in ms:
                    line.append(f"{name} {row['fwd_tflops']:.0f}")
            mine = {r["variant"]: r for r in rows if r["shape"] == label}
            for r in mine.values():
                for peer in ("cudnn-fp8", "jax-fa4-bf16"):
                    if r["fwd_tflops"] and mine[peer]["fwd_tflops"]:
                        r[f"ratio_vs_{peer}"] = r["fwd_tflops"] / mine[peer]["fwd_tflops"]
            print(f"{label}: " + "  ".join(line) + f"  errors {list(errors)} {accuracy} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
            save(args, device, t0, rows)
    save(args, device, t0, rows, final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
