"""One attention training step (forward + backward, or ``--fwd-only`` the forward) per
implementation, for a profiler.

    ncu --clock-control none --set full --kernel-name regex:'(?i)bwd|bprop|dgrad' \
        --launch-skip 2 --launch-count 2 --csv --page details \
        python benchmarks/profile_step.py --impl jax-fa4 --B 4 --S 8192 --H 16 --D 128 --causal

Runs ``--steps`` jitted forward+backward steps of one shape (the benchmark's own programs,
``jax_fa4.tools.bench``) after one warm-up step and blocks after each, so a profiler that skips the
warm-up's launches sees steady-state kernels: jax-fa4's (``--impl jax-fa4`` or ``jax-fa4-det``)
or cuDNN's (``--impl cudnn``, through ``jax.nn.dot_product_attention``) in the same process
setup. The kernel-name filters (ours: ``Sm90Bwd``/``BwdPreprocess``/``BwdPostprocess`` in the
CuTe-DSL kernel names; cuDNN's: ``bprop``) pick the backward's kernels.
tools/device/batch.sh's ``profile-bwd`` step runs it under ncu for both implementations.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jax_fa4.tools import bench
from jax_fa4.tools.bench_shapes import Shape


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=("jax-fa4", "jax-fa4-det", "cudnn"), default="jax-fa4")
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
    shape = Shape(args.B, args.S, args.S, args.H, args.Hkv or args.H, args.D, args.Dv or args.D,
                  args.causal)
    if args.impl == "cudnn":
        fn = bench._jax_nn_fn(shape, "cudnn")
    else:
        fn = bench._fa4_fn(shape, None, deterministic=args.impl == "jax-fa4-det")
    q, k, v, do = bench.make_inputs(shape, jnp.bfloat16, jax.random.key(0), 1)[0]
    if args.fwd_only:
        forward = jax.jit(fn)
        step = lambda q, k, v, do: forward(q, k, v)  # noqa: E731
    else:
        step = jax.jit(bench._fwd_bwd(fn))
    jax.block_until_ready(step(q, k, v, do))  # warm-up: compile and first launches
    for _ in range(args.steps):
        jax.block_until_ready(step(q, k, v, do))
    print(f"{args.impl} {shape}: {args.steps} steps after one warm-up")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
