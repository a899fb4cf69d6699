"""One packed-row step (segment ids, varlen or dense) for a profiler.

    ncu --clock-control none --metrics gpu__time_duration.sum --launch-skip-before-match 0 \
        python benchmarks/profile_segments.py --variant segments --kind fwd

Runs ``--steps`` jitted steps after one warm-up on segments_bench.py's first hd128 shape (or
``--B/--S/--H/--D``), each row cut into the bench's documents: ``segments`` passes the ids as
a traced argument (a training step's case: the tables are computed on the GPU every call, not
constant-folded), ``varlen`` runs the same documents through ``flash_attention_varlen``,
``dense`` the whole rows. Blocks after each step, so a profiler that skips the warm-up's
launches sees steady-state kernels.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa4
from segments_bench import documents


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", choices=("segments", "varlen", "dense"), default="segments")
    p.add_argument("--kind", choices=("fwd", "fwd+bwd"), default="fwd")
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--S", type=int, default=8192)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    b, s, h, d, causal = args.B, args.S, args.H, args.D, args.causal
    rng = np.random.default_rng(b * s + d + causal)  # segments_bench.py's documents
    docs = [documents(rng, s) for _ in range(b)]
    ids = jnp.asarray(np.stack([np.repeat(np.arange(len(x)), x) for x in docs]), jnp.int32)
    flat = [n for row in docs for n in row]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(flat)]), jnp.int32)

    def attn(q, k, v, ids):
        if args.variant == "segments":
            return jax_fa4.flash_attention(q, k, v, causal=causal, segment_ids=ids,
                                           implementation="sm90")
        if args.variant == "varlen":
            shape = q.shape
            flat_q, flat_k, flat_v = (x.reshape(b * s, h, d) for x in (q, k, v))
            return jax_fa4.flash_attention_varlen(
                flat_q, flat_k, flat_v, cu, cu, max(flat), max(flat), causal=causal,
                implementation="sm90").reshape(shape)
        return jax_fa4.flash_attention(q, k, v, causal=causal, implementation="sm90")

    def step(q, k, v, do, ids):
        if args.kind == "fwd":
            return attn(q, k, v, ids)
        out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, ids), q, k, v)
        return out, vjp(do)

    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(key, (b, s, h, d), jnp.bfloat16) for key in keys)
    step = jax.jit(step)
    jax.block_until_ready(step(q, k, v, do, ids))
    for _ in range(args.steps):
        jax.block_until_ready(step(q, k, v, do, ids))
    print(f"{args.variant} {args.kind} B{b} S{s} H{h} D{d} causal={causal} docs={docs}: "
          f"{args.steps} steps after one warm-up")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
