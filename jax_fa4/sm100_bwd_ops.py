"""JAX side of the Blackwell backward: picks the config, allocates dq_accum, calls the kernel.

Mirrors ``sm90_bwd_ops`` (same inputs, same outputs) so the API switches families by arch
(``ops.backward`` runs it for ``implementation="sm100"`` calls its config accepts):
``backward(q, k, v, out, lse, dout, delta, lse_log2, opts)`` -> (dq, dk, dv), with ``delta`` and
``lse_log2`` from the preprocess kernel (``ops.bwd_preprocess``). ``opts`` needs
``.softmax_scale`` (None = 1/sqrt(D)), ``.window`` ((left, right), None = unbounded; causal is
(None, 0)), ``.softcap`` (0 = off) and optionally ``.deterministic``.

Kernel (jax_fa4/kernels/sm100/bwd_config.py): ``sm100_bwd`` with dq_accum (zeros, float32,
(B, H, Sq_pad·D), row-major, updated in place through an input/output alias) and, for
deterministic calls, dq_semaphore (zeros, int32, (B, H, ceil(Sq/128)·slots), aliased too;
2 slots per query block for the 2-CTA kernel). The dQ
postprocess is a plain scale-and-cast of dq_accum's rows, left to XLA (one fused elementwise op):
the sm100 kernel's dq_accum is row-major, so no fragment reordering kernel is needed.

GQA/MQA (H > Hkv): float32 dK/dV per *query* head, summed over each group of H/Hkv heads here,
as the Hopper v1 does (deterministic: XLA's reduction has a fixed order).

Compile-verified only: no Blackwell GPU has run this kernel yet.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_fa4.kernels.sm100.bwd_config import Sm100BwdConfig
from jax_fa4.ops import backward_kind, config_refusal, kernel_params

ARCH = "sm_100a"


def configs(q, k, v, opts) -> tuple[Sm100BwdConfig, None]:
    """(main config, None) for this call (no postprocess kernel on sm100); raises ValueError if
    unsupported."""
    cfg = Sm100BwdConfig.make(**backward_kind(q, k, v, opts))
    return cfg, None


def unsupported(q, k, v, opts) -> str | None:
    """Why the sm100 backward kernel cannot serve this call (None when it can)."""
    return config_refusal(configs, q, k, v, opts)


def backward(q, k, v, out, lse, dout, delta, lse_log2, opts):
    """(dq, dk, dv) in the dtypes of q, k, v. ``out`` and ``lse`` are unused (their information
    is in delta and lse_log2) but kept for the ops.backward signature."""
    del out, lse
    from jax_fa4.ffi.call import call_kernel

    cfg, _ = configs(q, k, v, opts)
    b, sq, h, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    params = kernel_params(opts, d)
    num_m = cfg.num_m_blocks(sq)
    sq_pad = num_m * cfg.tile_m
    dq_accum = jnp.zeros((b, h, sq_pad * d), jnp.float32)
    hdk = h if cfg.gqa else hkv
    dkv_dtype = jnp.float32 if cfg.gqa else q.dtype
    inputs = [q, k, v, dout, lse_log2.astype(jnp.float32), delta.astype(jnp.float32), params,
              dq_accum]
    out_shapes = [jax.ShapeDtypeStruct(dq_accum.shape, jnp.float32),
                  jax.ShapeDtypeStruct((b, sk, hdk, d), dkv_dtype),
                  jax.ShapeDtypeStruct((b, sk, hdk, dv), dkv_dtype)]
    if cfg.deterministic:
        sem = jnp.zeros((b, h, num_m * cfg.semaphore_slots), jnp.int32)
        inputs.append(sem)
        out_shapes.append(jax.ShapeDtypeStruct(sem.shape, jnp.int32))
    outs = call_kernel(cfg, ARCH, *inputs, out_shapes=tuple(out_shapes))
    dq_accum, dk, dvv = outs[0], outs[1], outs[2]
    # the sm90 postprocess kernel's rule: dq = dq_accum · params[0] (softmax_scale) in float32
    dq = dq_accum.reshape(b, h, sq_pad, d)[:, :, :sq] * params[0]
    dq = dq.transpose(0, 2, 1, 3).astype(q.dtype)
    if cfg.gqa:
        g = h // hkv
        dk = dk.reshape(b, sk, hkv, g, d).sum(axis=3)
        dvv = dvv.reshape(b, sk, hkv, g, dv).sum(axis=3)
    return dq, dk.astype(k.dtype), dvv.astype(v.dtype)
