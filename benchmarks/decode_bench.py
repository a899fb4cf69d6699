"""Decode speed on the GPU: K/V bytes read per second, dense and paged, against cuDNN.

Issue #8's decode shapes: one query token (``Sq = 1``), GQA 32/8, head dim 128, bf16, batch
32–128 and 4k–128k keys. Per shape, in one process and with ``jax_fa4.tools.bench``'s timing
(warm-up, rounds rotating which program opens them, median; input sets rotated so that together
they exceed twice the L2):

* ``dense``: ``jax_fa4.flash_attention(implementation="sm90")`` (decode rewrite: GQA packing,
  split-KV, the shipped decode tile: two CTAs per SM, head-major q and out);
* ``dense-tile128``: the same with the 128-row training tile (``JAX_FA4_DECODE_TILE=0``);
* ``paged``: ``jax_fa4.flash_attention_paged(implementation="sm90")`` over a cache of 128-token
  pages, each sequence's pages in shuffled order, every sequence using all ``Sk`` keys;
* ``dense-<option>``, ``paged-<option>``: the same with a decode-tile alternative
  (``sm90.fwd_config.DECODE_OPTIONS``; ``JAX_FA4_DECODE_TILE=<option>``): ``1cta`` the decode
  tile shipped before (one CTA per SM), ``2cta-n128-s1`` one 128-key stage;
* ``paged-inorder``: the shipped paged call with each sequence's pages in order (DRAM-page
  locality between consecutive key blocks, as dense has);
* ``...-2tile``: split-KV until the tiles give each SM two (``decode.TILES_PER_SM = 2``;
  default 1);
* ``...-16bit``: the split chunks' outputs in the input dtype before the float32 merge
  (``decode.SPLIT_PARTIALS_F32 = False``, what ran before float32 partials: the A/B of their
  cost);
* ``paged-fp8``: the same paged call over an e4m3 copy of the cache (``fp8.quantize_paged_cache``:
  one descale per kv head) with the bfloat16 q, which the call quantises (what a serving stack
  with an FP8 KV cache runs): the FP8 decode tile on the same rewrite;
* ``dense-fp8``: ``flash_attention`` on e4m3 q (``fp8.quantize_grouped``), k and v (that copy);
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` on the dense K/V.

The figure is ``TB/s`` of K/V read: ``B·Sk·Hkv·(D + Dv)`` elements of 2 bytes (1 for the
``-fp8`` variants) over the time per call (what the peers reach: 4.2–4.4 TB/s on the H200,
``benchmarks/anchors.json``); ``tokens_vs_paged``: the variant's calls per second over the
bfloat16 ``paged`` one's. Every variant's output is compared with cuDNN's (``rel_err``; the
FP8 ones carry e4m3's rounding of q, K and V). Writes JSON with the command, GPU and date.

    python benchmarks/decode_bench.py --out benchmarks/results/decode-<gpu>-<date>.json
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa4
from jax_fa4 import fp8
from jax_fa4.tools import bench
from jax_fa4.backends import decode
from jax_fa4.kernels.sm90.fwd_config import DECODE_OPTIONS
from jax_fa4.tools.bench_harness import save, start, timing_parser

H, HKV, D = 32, 8, 128
PAGE = 128
#: (B, Sk): issue #8's range, each input set 0.25–8.6 GB of K/V
SHAPES = ((32, 4096), (64, 8192), (128, 8192), (32, 32768), (128, 32768), (32, 131072))
VARIANTS = ("dense", "dense-16bit", "dense-2tile", "dense-tile128",
            *(f"dense-{o}" for o in DECODE_OPTIONS),
            "paged", "paged-16bit", "paged-inorder", "paged-2tile",
            *(f"paged-{o}" for o in DECODE_OPTIONS), "paged-fp8", "dense-fp8", "cudnn")


def kv_bytes(b: int, sk: int, element_bytes: int = 2) -> int:
    return b * sk * HKV * 2 * D * element_bytes


@jax.jit
def _quantized(q, k, v):
    """(q8, q_descale (B, Hkv)), (k8, v8) (B, Sk, Hkv, D) e4m3 and their (Hkv,) descales: the
    cache quantised as a serving stack would, one descale per kv head for every page."""
    b, sk = k.shape[:2]
    pages = b * sk // PAGE
    k8, v8, kd, vd = fp8.quantize_paged_cache(k.reshape(pages, PAGE, HKV, D),
                                              v.reshape(pages, PAGE, HKV, D))
    return fp8.quantize_grouped(q, HKV), (k8.reshape(k.shape), v8.reshape(v.shape), kd, vd)


def make_sets(b: int, sk: int, key: jax.Array, with_fp8: bool = False) -> list[dict]:
    """Input sets (dense q, k, v, and the same keys as a paged cache; ``with_fp8``: their e4m3
    copies too) exceeding 2× L2.

    The paged cache is the dense K/V itself, reshaped to (B·Sk/128, 128, Hkv, D) inside the timed
    program (a free bitcast there; an eager reshape would copy up to 17 GB), with each batch
    entry's page table a random permutation of its own pages: its keys are read in shuffled page
    order, and as attention without a mask does not depend on the order of its keys, the output
    still equals the dense one.
    """
    n = max(2, -(-bench.ROTATION_BYTES // kv_bytes(b, sk)))
    rng = np.random.default_rng(0)
    per_seq = sk // PAGE
    sets = []
    for set_key in jax.random.split(key, n):
        kq, kk, kv = jax.random.split(set_key, 3)
        q = jax.random.normal(kq, (b, 1, H, D), jnp.bfloat16)
        k = jax.random.normal(kk, (b, sk, HKV, D), jnp.bfloat16)
        v = jax.random.normal(kv, (b, sk, HKV, D), jnp.bfloat16)
        table = np.stack([i * per_seq + rng.permutation(per_seq) for i in range(b)])
        used = jnp.full((b,), sk, jnp.int32)
        paged = (q, k, v, jnp.asarray(table, jnp.int32), used)
        inorder = (q, k, v, jnp.arange(b * per_seq, dtype=jnp.int32).reshape(b, per_seq), used)
        sets.append(dict(dense=(q, k, v), paged=paged, inorder=inorder))
        if with_fp8:
            (q8, qd), (k8, v8, kd, vd) = _quantized(q, k, v)
            sets[-1]["paged-fp8"] = (q, k8, v8, paged[3], used, kd, vd)
            sets[-1]["dense-fp8"] = (q8, k8, v8, qd, jnp.broadcast_to(kd, (b, HKV)),
                                     jnp.broadcast_to(vd, (b, HKV)))
    jax.block_until_ready(sets)
    return sets


def variant_fn(name: str):
    if name == "paged-fp8":
        def paged_fp8(q, k8, v8, table, used, kd, vd):
            pages = k8.shape[0] * k8.shape[1] // PAGE
            return jax_fa4.flash_attention_paged(
                q, k8.reshape(pages, PAGE, HKV, D), v8.reshape(pages, PAGE, HKV, D), table,
                used, k_descale=kd, v_descale=vd, implementation="sm90")
        return paged_fp8
    if name == "dense-fp8":
        return lambda q8, k8, v8, qd, kd, vd: jax_fa4.flash_attention(
            q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, implementation="sm90")
    if name.startswith("dense"):
        return lambda q, k, v: jax_fa4.flash_attention(q, k, v, implementation="sm90")
    if name.startswith("paged"):
        def paged(q, k, v, table, used):
            pages = k.shape[0] * k.shape[1] // PAGE
            return jax_fa4.flash_attention_paged(
                q, k.reshape(pages, PAGE, HKV, D), v.reshape(pages, PAGE, HKV, D), table, used,
                implementation="sm90")
        return paged
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")


def compile_variant(name: str, args: tuple):
    old = os.environ.get("JAX_FA4_DECODE_TILE")
    option = name.split("-", 1)[1] if "-" in name and not name.endswith("-fp8") else ""
    two_tiles = option == "2tile"
    os.environ["JAX_FA4_DECODE_TILE"] = ("0" if option == "tile128" else
                                         option if option in DECODE_OPTIONS else "1")
    default_tiles = decode.TILES_PER_SM
    decode.TILES_PER_SM = 2 if two_tiles else default_tiles
    decode.SPLIT_PARTIALS_F32 = option != "16bit"
    try:  # the switches are read while tracing
        return jax.jit(variant_fn(name)).lower(*args).compile()
    finally:
        decode.TILES_PER_SM = default_tiles
        decode.SPLIT_PARTIALS_F32 = True
        if old is None:
            del os.environ["JAX_FA4_DECODE_TILE"]
        else:
            os.environ["JAX_FA4_DECODE_TILE"] = old


def main(argv=None) -> int:
    p = timing_parser(__doc__)
    p.add_argument("--variants", help=f"comma-separated names of {VARIANTS} (default: all)")
    args = p.parse_args(argv)
    variants = args.variants.split(",") if args.variants else VARIANTS
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; known: {VARIANTS}")
    device, t0 = start(args)
    rows = []
    for index, (b, sk) in enumerate(SHAPES):
        label = f"B{b} Sk{sk} H{H}/{HKV} D{D}"
        sets = make_sets(b, sk, jax.random.key(index),
                         with_fp8=any(n.endswith("-fp8") for n in variants))
        programs, outs, names = [], {}, []
        for name in variants:
            kind = (name if name.endswith("-fp8") else
                    "inorder" if name == "paged-inorder" else
                    "paged" if name.startswith("paged") else "dense")
            arg_sets = [s[kind] for s in sets]
            try:
                compiled = compile_variant(name, arg_sets[0])
                outs[name] = np.asarray(compiled(*arg_sets[0]), np.float32)
            except Exception as err:  # noqa: BLE001 - a variant that cannot run is reported
                rows.append(dict(shape=label, variant=name, error=f"{type(err).__name__}: "
                                 f"{str(err).splitlines()[0][:300]}"))
                continue
            programs.append(bench.make_program(None, compiled, arg_sets, 1))
            names.append(name)
        timings = bench.time_programs(programs, repeats=args.repeats,
                                      target_s=args.target_ms / 1e3, sync_each=False)
        base = outs.get("cudnn")
        for name, t in zip(names, timings):
            rel = (float(np.linalg.norm(outs[name] - base) / np.linalg.norm(base))
                   if base is not None else None)
            element_bytes = 1 if name.endswith("-fp8") else 2
            rows.append(dict(shape=label, variant=name, B=b, Sk=sk, ms=t.ms, spread=t.spread,
                             kv_tbps=kv_bytes(b, sk, element_bytes) / (t.ms * 1e-3) / 1e12,
                             kv_element_bytes=element_bytes, rel_err=rel))
        mine = {r["variant"]: r for r in rows if r["shape"] == label and "ms" in r}
        ref = mine.get("cudnn", {}).get("kv_tbps")
        paged_ms = mine.get("paged", {}).get("ms")
        for r in mine.values():
            r["ratio_vs_cudnn"] = r["kv_tbps"] / ref if ref else None
            r["tokens_vs_paged"] = paged_ms / r["ms"] if paged_ms else None
        line = "  ".join(f"{n} {r['kv_tbps']:.2f} TB/s" for n, r in mine.items())
        print(f"[{index + 1}/{len(SHAPES)}] {label}: {line}  ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        del sets, programs  # free the device arrays before the next shape
        save(args, device, t0, rows)
    save(args, device, t0, rows, final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
