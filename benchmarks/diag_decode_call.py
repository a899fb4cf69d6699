"""Diagnosis: where a decode call's time goes (API call vs the bare kernel), on the GPU.

Times, in one process with ``jax_fa4.tools.bench``'s method, the API's decode call against the same
forward kernel called on pre-packed inputs (``call_kernel``), a transpose pair alone, the paged
API (64- and 128-key tiles) against its bare kernel, and cuDNN; prints µs and K/V TB/s and
writes ``$OUT/diag.json``. Session 14 ran it at the two-CTA decode option (before it became the
default) and found 4.6 of 131 µs in the packing transposes (docs/perf-log.md).

    python benchmarks/diag_decode_call.py
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa4
from jax_fa4.tools import bench
from jax_fa4.backends import sm90
from jax_fa4.ffi.call import call_kernel
from jax_fa4.kernels.sm90.fwd_config import decode_config, paged_config, DECODE_OPTIONS

H, HKV, D, PAGE = 32, 8, 128, 128
out = {}
for b, sk in ((32, 4096), (64, 8192)):
    cfg = decode_config("bfloat16", D, D)  # the shipped decode tile (head-major q / out)
    pcfg = paged_config("bfloat16", D, D, **DECODE_OPTIONS["2cta-n128-s1"])  # 128-key blocks
    params = jnp.array([1 / np.sqrt(D), 0, -1, -1], jnp.float32)
    n = max(2, -(-bench.ROTATION_BYTES // (b * sk * HKV * 4 * D)))
    rng = np.random.default_rng(0)
    sets = []
    for key in jax.random.split(jax.random.key(0), n):
        kq, kk, kv = jax.random.split(key, 3)
        q = jax.random.normal(kq, (b, 1, H, D), jnp.bfloat16)
        k = jax.random.normal(kk, (b, sk, HKV, D), jnp.bfloat16)
        v = jax.random.normal(kv, (b, sk, HKV, D), jnp.bfloat16)
        qp = q.reshape(b, HKV, 4, D)  # head-major packed rows
        table = np.stack([i * (sk // PAGE) + rng.permutation(sk // PAGE) for i in range(b)])
        sets.append(
            dict(
                q=q,
                k=k,
                v=v,
                qp=qp,
                table=jnp.asarray(table, jnp.int32),
                used=jnp.full((b,), sk, jnp.int32),
            )
        )
    jax.block_until_ready(sets)

    def api(s):
        return (s["q"], s["k"], s["v"]), lambda q, k, v: jax_fa4.flash_attention(
            q, k, v, implementation="sm90"
        )

    def bare(s):
        def f(qp, k, v):
            return call_kernel(
                cfg,
                sm90.ARCH,
                qp,
                k,
                v,
                params,
                out_shapes=(
                    jax.ShapeDtypeStruct((b, HKV, 4, D), jnp.bfloat16),
                    jax.ShapeDtypeStruct((b, HKV, 4), jnp.float32),
                ),
            )[0]

        return (s["qp"], s["k"], s["v"]), f

    def transp(s):
        def f(q, k, v):
            qp = q.reshape(b, HKV, 4, D)  # head-major packed rows
            return qp.transpose(0, 2, 1, 3).reshape(b, 1, H, D) + 1

        return (s["q"], s["k"], s["v"]), f

    def paged_api(s):
        def f(q, k, v, t, u):
            pages = b * sk // PAGE
            return jax_fa4.flash_attention_paged(
                q,
                k.reshape(pages, PAGE, HKV, D),
                v.reshape(pages, PAGE, HKV, D),
                t,
                u,
                implementation="sm90",
            )

        return (s["q"], s["k"], s["v"], s["table"], s["used"]), f

    def paged_bare(s):
        def f(qp, k, v, t, u):
            return call_kernel(
                pcfg,
                sm90.ARCH,
                qp,
                k.reshape(1, b * sk, HKV, D),
                v.reshape(1, b * sk, HKV, D),
                params,
                t,
                u,
                out_shapes=(
                    jax.ShapeDtypeStruct((b, HKV, 4, D), jnp.bfloat16),
                    jax.ShapeDtypeStruct((b, HKV, 4), jnp.float32),
                ),
            )[0]

        return (s["qp"], s["k"], s["v"], s["table"], s["used"]), f

    paged_api128 = paged_api

    def cudnn(s):
        return (s["q"], s["k"], s["v"]), lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, implementation="cudnn"
        )

    names = ["api", "bare", "transp", "paged_api", "paged_api128", "paged_bare", "cudnn"]
    progs = []
    for nm in names:
        mk = locals()[nm]
        os.environ["JAX_FA4_DECODE_TILE"] = "2cta-n128-s1" if nm == "paged_api128" else "1"
        args = [mk(s)[0] for s in sets]
        fn = mk(sets[0])[1]
        c = jax.jit(fn).lower(*args[0]).compile()
        if nm in ("api", "paged_api", "paged_api128"):
            print(
                nm,
                c.as_text().count("custom-call"),
                "custom calls;",
                c.as_text().count("fusion"),
                "fusion mentions",
            )
        progs.append(bench.make_program(None, c, args, 1))
    ts = bench.time_programs(progs, repeats=9, target_s=0.3, sync_each=False)
    for nm, t in zip(names, ts):
        tb = b * sk * HKV * 4 * D / (t.ms * 1e-3) / 1e12
        print(f"B{b} Sk{sk} {nm:11s} {t.ms * 1e3:8.1f} us  {tb:5.2f} TB/s  spread {t.spread:.3f}")
        out[f"{b}x{sk}/{nm}"] = t.ms
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "diag.json"), "w"), indent=1)
