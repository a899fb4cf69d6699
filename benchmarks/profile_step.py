"""One attention training step (forward + backward, or ``--fwd-only`` the forward) per
implementation, for a profiler.

    ncu --clock-control none --set full --kernel-name regex:'(?i)bwd|bprop|dgrad' \\
        --launch-skip 2 --launch-count 2 --csv --page details \\
        python benchmarks/profile_step.py --impl jax-fa4 --B 4 --S 8192 --H 16 --D 128 --causal
    ncu --clock-control none --metrics gpu__time_duration.sum --launch-skip-before-match 0 \\
        python benchmarks/profile_step.py --packed segments --fwd-only --B 2

Runs ``--steps`` jitted forward+backward steps of one shape (the benchmark's own programs,
``jax_fa4.tools.bench``) after one warm-up step and blocks after each, so a profiler that skips the
warm-up's launches sees steady-state kernels: jax-fa4's (``--impl jax-fa4`` or ``jax-fa4-det``)
or cuDNN's (``--impl cudnn``, through ``jax.nn.dot_product_attention``) in the same process
setup. The kernel-name filters (ours: ``Sm90Bwd``/``BwdPreprocess``/``BwdPostprocess`` in the
CuTe-DSL kernel names; cuDNN's: ``bprop``) pick the backward's kernels.
tools/device/batch.sh's ``profile-bwd`` step runs it under ncu for both implementations.

``--packed`` cuts each row into ``benchmarks/segments_bench.py``'s documents (512–4k tokens, the
same cuts as that benchmark's; its first shape is ``--B 2 --S 8192 --H 16 --D 128``) and runs
jax-fa4's Hopper kernels on them: ``segments`` passes the segment ids as a traced argument (a
training step's case: the tables are computed on the GPU every call, not constant-folded),
``varlen`` runs the same documents through ``flash_attention_varlen``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa4
from jax_fa4.tools import bench
from jax_fa4.tools.bench_shapes import Shape
from segments_bench import packed_rows


def packed_attention(kind: str, shape: Shape) -> tuple[Callable, jax.Array, list[list[int]]]:
    """(attention on (q, k, v, ids), the ids, the documents) of ``--packed kind``."""
    docs = packed_rows(shape.B, shape.Sq, shape.D, shape.causal)
    ids = jnp.asarray(np.stack([np.repeat(np.arange(len(x)), x) for x in docs]), jnp.int32)
    flat = [n for row in docs for n in row]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(flat)]), jnp.int32)

    def attention(q: jax.Array, k: jax.Array, v: jax.Array, ids: jax.Array) -> jax.Array:
        if kind == "segments":
            return jax_fa4.flash_attention(q, k, v, causal=shape.causal, segment_ids=ids,
                                           implementation="sm90")
        b, s = q.shape[:2]
        out = jax_fa4.flash_attention_varlen(
            *(x.reshape(b * s, *x.shape[2:]) for x in (q, k, v)), cu, cu, max(flat), max(flat),
            causal=shape.causal, implementation="sm90")
        return out.reshape(*q.shape[:3], v.shape[3])

    return attention, ids, docs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=("jax-fa4", "jax-fa4-det", "cudnn"), default="jax-fa4")
    p.add_argument("--packed", choices=("segments", "varlen"),
                   help="rows cut into segments_bench.py's documents (jax-fa4 only)")
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--S", type=int, default=8192)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--Hkv", type=int, default=None)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--Dv", type=int, default=None)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--fwd-only", action="store_true",
                   help="the inference forward alone (no residuals kept, no backward)")
    args = p.parse_args(argv)
    if args.packed and args.impl != "jax-fa4":
        p.error("--packed runs jax-fa4's kernels: drop --impl or pass --impl jax-fa4")
    shape = Shape(args.B, args.S, args.S, args.H, args.Hkv or args.H, args.D, args.Dv or args.D,
                  args.causal)
    extra: tuple[jax.Array, ...] = ()
    what = f"{args.impl} {shape}"
    if args.packed:
        fn, ids, docs = packed_attention(args.packed, shape)
        extra, what = (ids,), f"{args.packed} {shape} docs={docs}"
    elif args.impl == "cudnn":
        fn = bench._jax_nn_fn(shape, "cudnn")
    else:
        fn = bench._fa4_fn(shape, None, deterministic=args.impl == "jax-fa4-det")

    def forward(q, k, v, do, *extra):
        return fn(q, k, v, *extra)

    def fwd_bwd(q, k, v, do, *extra):
        out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, *extra), q, k, v)
        return out, pullback(do)

    step = jax.jit(forward if args.fwd_only else fwd_bwd)
    inputs = (*bench.make_inputs(shape, jnp.bfloat16, jax.random.key(0), 1)[0], *extra)
    jax.block_until_ready(step(*inputs))  # warm-up: compile and first launches
    for _ in range(args.steps):
        jax.block_until_ready(step(*inputs))
    print(f"{what}: {args.steps} steps after one warm-up")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
