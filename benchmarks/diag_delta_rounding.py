"""Why a varlen property case fails FA4's rule on dk: the backward's delta from the bf16 output.

Session 29's GPU run found ``test_varlen_matches_naive`` failing on dk for a sequence of 255
queries over one key with a learnable sink (head dim 192/128). With one visible key and a sink,
the backward's ``dS = P·(dP - delta)`` is a small difference of two close numbers
(``P·(1 - P)·dO·v``), and FlashAttention's ``delta = rowsum(dO * O)`` reads the output rounded
to bf16. This script emulates that arithmetic on the CPU (no kernel): random draws of that shape,
dk from the FlashAttention formulas with delta from the bf16 O, from the float32 O, and with dS
left unrounded, each as a fraction of FA4's bound (tests/numerics.py; the naive bf16
computation is the baseline, float32 the reference).

    python benchmarks/diag_delta_rounding.py --draws 40

Session 29 (seed 0, 100 draws, sinks ~ N(0, 2^2) as in the property tests): over the bound in 7
draws, worst 9.6x, with delta from the bf16 O; in 4, worst 5.4x, from the float32 O; rounding dS
changes nothing. The float32 O still holds the forward's P rounded to bf16 for the P·V MMA, so
delta = P_bf16·dP while dS needs P·dP: with 1 - P ~ 0.01, P's bf16 rounding (2^-9 near 1) is a
~20 % error in dS. Only delta from the unrounded P (a pass over the keys before dS) removes it.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa4 import reference

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from numerics import fa4_error  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32


def draw(rng: np.random.Generator, sq: int, sk: int, d: int, dv: int):
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), F32).astype(BF16)  # noqa: E731
    q, k, v, do = normal(1, sq, 1, d), normal(1, sk, 1, d), normal(1, sk, 1, dv), normal(1, sq, 1, dv)
    sink = jnp.asarray(rng.standard_normal(1) * 2.0, F32)
    return q, k, v, do, sink


def oracle_dk(q, k, v, do, sink, compute_dtype):
    def loss(q, k, v):
        out, _ = reference.attention(q, k, v, compute_dtype=compute_dtype, learnable_sink=sink)
        return jnp.sum(out.astype(F32) * do.astype(F32))

    return jax.grad(loss, argnums=1)(q, k, v)


def flash_dk(q, k, v, do, sink, *, delta_from_bf16: bool, round_ds: bool):
    """dk by FlashAttention's backward formulas (lse with the sink, P rebuilt from it)."""
    scale = 1.0 / np.sqrt(q.shape[-1])
    q32, k32, v32, do32 = (x.astype(F32) for x in (q, k, v, do))
    s = jnp.einsum("bqhd,bkhd->bhqk", q32, k32) * scale
    m = jnp.maximum(s.max(-1), sink[None, :, None])
    lse = m + jnp.log(jnp.exp(s - m[..., None]).sum(-1) + jnp.exp(sink[None, :, None] - m))
    p = jnp.exp(s - lse[..., None])
    out = jnp.einsum("bhqk,bkhd->bqhd", p.astype(BF16).astype(F32), v32)
    if delta_from_bf16:
        out = out.astype(BF16).astype(F32)
    dp = jnp.einsum("bqhd,bkhd->bhqk", do32, v32)
    delta = jnp.einsum("bqhd,bqhd->bhq", do32, out)
    ds = p * (dp - delta[..., None])
    if round_ds:
        ds = ds.astype(BF16).astype(F32)
    return (jnp.einsum("bhqk,bqhd->bkhd", ds, q32) * scale).astype(BF16)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draws", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", default="255,1,192,128", help="Sq,Sk,D,Dv")
    args = p.parse_args(argv)
    sq, sk, d, dv = (int(x) for x in args.shape.split(","))
    rng = np.random.default_rng(args.seed)
    variants = {"bf16 O": dict(delta_from_bf16=True, round_ds=True),
                "f32 O": dict(delta_from_bf16=False, round_ds=True),
                "dS unrounded": dict(delta_from_bf16=True, round_ds=False)}
    worst = dict.fromkeys(variants, 0.0)
    for i in range(args.draws):
        inputs = draw(rng, sq, sk, d, dv)
        ref = oracle_dk(*(x.astype(F32) if j < 4 else x for j, x in enumerate(inputs)), F32)
        ref = ref.astype(BF16)
        pt = oracle_dk(*inputs, BF16)
        ratios = {}
        for name, kw in variants.items():
            e = fa4_error(flash_dk(*inputs, **kw), ref, pt)
            ratios[name] = e.err / e.bound
            worst[name] = max(worst[name], ratios[name])
        print(f"draw {i}: " + ", ".join(f"{n} {r:.2f}" for n, r in ratios.items()))
    print("worst err / bound: " + ", ".join(f"{n} {r:.2f}" for n, r in worst.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
