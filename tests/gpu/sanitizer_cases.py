"""One small forward + backward of every kernel kind, run under compute-sanitizer by
tests/gpu/test_sanitizers.py (``python tests/gpu/sanitizer_cases.py`` runs them plainly).

Each case is ``jax.value_and_grad`` of a loss through ``flash_attention(implementation="sm90")``,
so it launches the forward, the preprocess, the backward and its dQ postprocess kernels.
Lengths are odd and mismatched so that every tail path (TMA clipping, masked last blocks,
padded dQ rows) runs.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import jax_fa4

# (head_dim, head_dim_v, H, Hkv, causal, window, softcap): every shipped tuning kind
CASES = [
    (64, 64, 4, 4, False, (None, None), 0.0),  # 3 consumer warpgroups
    (64, 64, 4, 2, True, (None, None), 0.0),
    (96, 96, 2, 2, False, (33, 5), 0.0),
    (128, 128, 4, 4, False, (None, None), 0.0),
    (128, 128, 4, 1, True, (None, None), 0.0),  # MQA: float32 per-head dK/dV
    (128, 128, 2, 2, False, (40, 10), 20.0),
    (192, 128, 2, 2, True, (None, None), 0.0),
    (256, 256, 2, 2, True, (None, None), 0.0),  # ping-pong + conditional rescale
    (256, 256, 2, 2, False, (None, None), 10.0),
]
SQ, SK = 77, 131


def run_case(case, seed: int) -> None:
    d, dv, h, hkv, causal, window, softcap = case
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (1, SQ, h, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (1, SK, hkv, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (1, SK, hkv, dv), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(ks[3], (1, SQ, h, dv), jnp.float32)

    def loss(q, k, v):
        out = jax_fa4.flash_attention(q, k, v, causal=causal, window_size=window,
                                      softcap=softcap, implementation="sm90")
        return jnp.sum(out.astype(jnp.float32) * w)

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    jax.block_until_ready(grads)
    assert bool(jnp.isfinite(value)) and all(bool(jnp.all(jnp.isfinite(g))) for g in grads), case


def main() -> int:
    for i, case in enumerate(CASES):
        run_case(case, i)
        print(f"ran {case}", flush=True)
    print(f"{len(CASES)} cases ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
