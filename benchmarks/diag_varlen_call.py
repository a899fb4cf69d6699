"""Diagnosis: the varlen forward against dense, API call vs bare kernel, on the GPU.

Times, in one process with ``jax_fa4.tools.bench``'s method, the dense and varlen forward through the
API and as bare ``call_kernel`` calls on the same tokens (16 × 2048 and 64 × 512, H 16, hdim
128, bf16, unmasked); prints µs and TFLOP/s, the compiled programs' op counts, and writes
``$OUT/diag_varlen.json`` and the varlen API program's HLO. Session 14: the bare varlen kernel is
9–11 % slower than the bare dense one; the wrapper adds ≤ 2 % (docs/perf-log.md).

    python benchmarks/diag_varlen_call.py
"""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa4
from jax_fa4.tools import bench
from jax_fa4.backends import sm90
from jax_fa4.ffi.call import call_kernel
from jax_fa4.kernels.sm90.fwd_config import FwdConfig, varlen_config

ARCH = sm90.ARCH
out = {}
for b, s, h, d in ((16, 2048, 16, 128), (64, 512, 16, 128)):
    total = b * s
    params = jnp.array([1 / np.sqrt(d), 0, -1, -1], jnp.float32)
    cu = jnp.asarray(np.arange(b + 1) * s, jnp.int32)
    n = max(2, -(-bench.ROTATION_BYTES // (4 * total * h * d * 2)))
    sets = []
    for key in jax.random.split(jax.random.key(0), n):
        q, k, v = (
            jax.random.normal(kk, (total, h, d), jnp.bfloat16) for kk in jax.random.split(key, 3)
        )
        sets.append((q, k, v))
    jax.block_until_ready(sets)
    dcfg = FwdConfig.make("bfloat16", d, d, "none")
    vcfg = varlen_config("bfloat16", d, d, "none")
    shape = (b, s, h, d)

    def varlen_kernel(q, k, v):
        return call_kernel(
            vcfg,
            ARCH,
            q[None],
            k[None],
            v[None],
            params,
            cu,
            cu,
            out_shapes=(
                jax.ShapeDtypeStruct((1, total, h, d), q.dtype),
                jax.ShapeDtypeStruct((b, h, s), jnp.float32),
            ),
        )

    fns = {
        "dense_api": lambda q, k, v: jax_fa4.flash_attention(
            q.reshape(shape), k.reshape(shape), v.reshape(shape), implementation="sm90"
        ).reshape(total, h, d),
        "dense_bare": lambda q, k, v: call_kernel(
            dcfg,
            ARCH,
            q.reshape(shape),
            k.reshape(shape),
            v.reshape(shape),
            params,
            out_shapes=(
                jax.ShapeDtypeStruct(shape, q.dtype),
                jax.ShapeDtypeStruct((b, h, s), jnp.float32),
            ),
        )[0],
        "varlen_api": lambda q, k, v: jax_fa4.flash_attention_varlen(
            q, k, v, cu, cu, s, s, implementation="sm90"
        ),
        "varlen_bare": lambda q, k, v: varlen_kernel(q, k, v)[0],
        "varlen_bare_lse": varlen_kernel,
    }
    progs, names = [], []
    for nm, fn in fns.items():
        c = jax.jit(fn).lower(*sets[0]).compile()
        txt = c.as_text()
        print(
            nm,
            "custom-calls",
            txt.count("custom_call_target"),
            "fusions",
            len(re.findall(r"^\s*\S+ = \S+ fusion\(", txt, re.M)),
            "sort" in txt,
            "while" in txt,
            flush=True,
        )
        if nm == "varlen_api":
            open(
                os.path.join(os.environ.get("OUT", "."), f"varlen_api_{b}x{s}.hlo.txt"), "w"
            ).write(txt)
        progs.append(bench.make_program(None, c, [tuple(x) for x in sets], 1))
        names.append(nm)
    ts = bench.time_programs(progs, repeats=9, target_s=0.3, sync_each=False)
    f = 4 * b * s * s * h * d
    for nm, t in zip(names, ts):
        print(
            f"B{b} S{s} {nm:16s} {t.ms * 1e3:8.1f} us  {f / (t.ms * 1e-3) / 1e12:6.1f} TFLOP/s  spread {t.spread:.3f}",
            flush=True,
        )
        out[f"{b}x{s}/{nm}"] = t.ms
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "diag_varlen.json"), "w"), indent=1)
