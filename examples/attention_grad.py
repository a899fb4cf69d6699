"""Attention and its gradient with jax-fa4, checked against the pure-JAX reference.

    python examples/attention_grad.py [--batch 2 --seqlen 1024 --heads 8 --kv-heads 2 \
                                       --head-dim 128]

On a Hopper GPU this runs jax-fa4's kernels; on a CPU (or an unsupported GPU) the same call runs
the reference implementation, so the script works anywhere.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import jax_fa4
from jax_fa4 import reference
from jax_fa4.backends import select


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--no-causal", dest="causal", action="store_false")
    args = p.parse_args()

    kq, kk, kv, kc = jax.random.split(jax.random.key(0), 4)
    b, s, h, hkv, d = args.batch, args.seqlen, args.heads, args.kv_heads, args.head_dim
    q = jax.random.normal(kq, (b, s, h, d), jnp.bfloat16)
    k = jax.random.normal(kk, (b, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(kv, (b, s, hkv, d), jnp.bfloat16)
    cotangent = jax.random.normal(kc, (b, s, h, d), jnp.float32)

    def loss(q, k, v):
        out = jax_fa4.flash_attention(q, k, v, causal=args.causal)
        return jnp.sum(out.astype(jnp.float32) * cotangent)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    print(f"device: {jax.devices()[0].device_kind}; implementation: "
          f"{select(None)}")
    start = time.perf_counter()
    value, grads = jax.block_until_ready(step(q, k, v))
    print(f"first call (compile + run): {time.perf_counter() - start:.2f} s")
    start = time.perf_counter()
    value, grads = jax.block_until_ready(step(q, k, v))
    print(f"second call: {1e3 * (time.perf_counter() - start):.1f} ms")

    window = (None, 0) if args.causal else (None, None)
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    ref_out, _ = reference.attention(*up, window=window)
    out = jax_fa4.flash_attention(q, k, v, causal=args.causal)
    print(f"loss {float(value):.4f}; max |out - float32 reference| = "
          f"{float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref_out))):.2e}")
    for name, g in zip(("dq", "dk", "dv"), grads):
        print(f"{name}: shape {g.shape}, dtype {g.dtype}, |{name}|max = "
              f"{float(jnp.max(jnp.abs(g.astype(jnp.float32)))):.3f}")


if __name__ == "__main__":
    main()
