"""JAX side of the Hopper backward: picks the configs, allocates dq_accum, calls the two kernels.

``backward(q, k, v, out, lse, dout, delta, lse_log2, opts)`` -> (dq, dk, dv), with ``delta`` and
``lse_log2`` from the preprocess kernel (``ops.bwd_preprocess``). ``opts`` needs
``.softmax_scale`` (None = 1/sqrt(D)), ``.window`` ((left, right), None = unbounded; causal is
(None, 0)) and ``.softcap`` (0 = off).

Kernels (jax_fa4/kernels/sm90/bwd_config.py):
  1. ``sm90_bwd``: dq_accum (zeros, float32, (B, H, Sq_pad·D), updated in place through an
     input/output alias), dk, dv;
  2. ``sm90_bwd_postprocess``: dq = dq_accum · softmax_scale in q's dtype.

Deterministic configs (``opts.deterministic``) also take ``dq_sem`` (B, H, Sq_pad/tile_m) int32
zeros: the counters that make the key blocks add into each query block's dQ in a fixed order.

GQA/MQA (H > Hkv): the main kernel writes float32 dK/dV per *query* head, (B, Sk, H, D), and they
are summed over each group of G = H/Hkv heads here (cost: 4·B·Sk·H·(D+Dv) bytes written by the
kernel and read back by XLA's reduction, instead of 2·B·Sk·Hkv·(D+Dv); an in-kernel fp32 reduce
into (B, Sk, Hkv, D) accumulators is the planned replacement).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_fa4.kernels.sm90.bwd_config import BwdConfig
from jax_fa4.ops import backward_kind, config_refusal, kernel_params

ARCH = "sm_90a"


def configs(q, k, v, opts) -> tuple[BwdConfig, object]:
    """(main config, postprocess config) for this call; raises ValueError if unsupported."""
    cfg = BwdConfig.make(**backward_kind(q, k, v, opts))
    return cfg, cfg.postprocess_config()


def unsupported(q, k, v, opts) -> str | None:
    """Why the sm90 backward kernels cannot serve this call (None when they can)."""
    return config_refusal(configs, q, k, v, opts)


def backward(q, k, v, out, lse, dout, delta, lse_log2, opts, config: BwdConfig | None = None):
    """(dq, dk, dv) in the dtypes of q, k, v. ``out`` and ``lse`` are unused (their information
    is in delta and lse_log2) but kept for the ops.backward signature. ``config`` replaces the
    tuning table's main-kernel config (benchmarks/bwd_variants.py); it must describe the same
    problem (dtype, head dims, mask kind, softcap, GQA)."""
    del out, lse
    from jax_fa4.ffi.call import call_kernel

    cfg, post = configs(q, k, v, opts)
    if config is not None:
        same = ("dtype", "head_dim", "head_dim_v", "mask", "has_softcap", "gqa")
        if any(getattr(config, f) != getattr(cfg, f) for f in same):
            raise ValueError(f"config {config.describe()} does not match the call ({cfg.describe()})")
        cfg, post = config, config.postprocess_config()
    b, sq, h, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    params = kernel_params(opts, d)
    sq_pad = -(-sq // cfg.tile_m) * cfg.tile_m
    dq_accum = jnp.zeros((b, h, sq_pad * d), jnp.float32)
    hdk = h if cfg.gqa else hkv
    dkv_dtype = jnp.float32 if cfg.gqa else q.dtype
    out_shapes = (jax.ShapeDtypeStruct(dq_accum.shape, jnp.float32),
                  jax.ShapeDtypeStruct((b, sk, hdk, d), dkv_dtype),
                  jax.ShapeDtypeStruct((b, sk, hdk, dv), dkv_dtype))
    inputs = [q, k, v, dout, lse_log2.astype(jnp.float32), delta.astype(jnp.float32), params,
              dq_accum]
    if cfg.deterministic:  # one ordering counter per query block
        dq_sem = jnp.zeros((b, h, sq_pad // cfg.tile_m), jnp.int32)
        inputs.append(dq_sem)
        out_shapes += (jax.ShapeDtypeStruct(dq_sem.shape, jnp.int32),)
    dq_accum, dk, dvv = call_kernel(cfg, ARCH, *inputs, out_shapes=out_shapes)[:3]
    (dq,) = call_kernel(post, ARCH, dq_accum, params,
                        out_shapes=(jax.ShapeDtypeStruct(q.shape, q.dtype),))
    if cfg.gqa:
        g = h // hkv
        dk = dk.reshape(b, sk, hkv, g, d).sum(axis=3)
        dvv = dvv.reshape(b, sk, hkv, g, dv).sum(axis=3)
    return dq, dk.astype(k.dtype), dvv.astype(v.dtype)
