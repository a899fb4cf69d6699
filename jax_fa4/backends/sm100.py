"""The Blackwell backend (``implementation="sm100"``, compute capability 10.x): configs and calls.

Opt-in: its kernels are compiled and inspected (SASS-checked) but have never run on a Blackwell
GPU in this project, so ``implementation=None`` picks them only with ``JAX_FA4_ENABLE_SM100=1``
(else the reference, with a one-time warning); ``implementation="sm100"`` forces them.

Forward (jax_fa4/kernels/sm100/fwd_config.py): the table's config (``FwdConfig.make``), persistent,
with the same varlen (``varlen=True``), paged (``paged=True``) and segment-id (``segments=True``,
:meth:`KernelBackend.segments_forward`'s tables) modes, and max logits (``max_logits=True``, dense
and segment-id calls), under the same call contracts as Hopper's; decode-shaped calls run the
training tile, rewritten by :mod:`jax_fa4.backends.decode`. Segment ids have no sm100 backward
kernel: their gradient runs the reference's backward with a one-time ``RuntimeWarning``.

Dense backward (jax_fa4/kernels/sm100/bwd_config.py), :meth:`Sm100Backend.backward`: ``sm100_bwd``
with dq_accum (zeros, float32, (B, H, Sq_pad·D), row-major, updated in place through an
input/output alias) and, for deterministic calls, dq_semaphore (zeros, int32,
(B, H, ceil(Sq/128)·slots), aliased too; 2 slots per query block for the 2-CTA kernel). The dQ
postprocess is a plain scale-and-cast of dq_accum's rows, left to XLA (one fused elementwise op):
the sm100 kernel's dq_accum is row-major, so no fragment reordering kernel is needed. Head dims
64, 96, 128 with ``Dv == D`` and 192 with ``Dv`` 128 (the last two with 2-CTA MMAs); others (e.g.
256, which needs FA4's split 2-CTA kernels) run the reference's backward with a one-time
``RuntimeWarning`` naming the reason, as does every varlen backward (no varlen mode yet).

GQA/MQA (H > Hkv): float32 dK/dV per *query* head, summed over each group of H/Hkv heads here,
as the Hopper v1 does (deterministic: XLA's reduction has a fixed order).
"""

from __future__ import annotations

from jax_fa4.backends.kernel import KernelBackend, backward_kind, kernel_params
from jax_fa4.kernels.sm100 import fwd_config
from jax_fa4.kernels.sm100.bwd_config import Sm100BwdConfig
from jax_fa4.kernels.spec import PARAM_SCALE

ARCH = "sm_100a"
#: ``JAX_FA4_ENABLE_SM100=1`` lets ``implementation=None`` pick this backend on Blackwell GPUs.
ENABLE_ENV = "JAX_FA4_ENABLE_SM100"


class Sm100Backend(KernelBackend):
    """Blackwell: the sm100 forward (dense, varlen, paged, segment ids), the preprocess and the
    sm100 dense backward kernel (compile-verified only)."""

    name = "sm100"
    arch = ARCH
    compute_capability = "10"
    capability_text = "10.x"
    gpu_family = "Blackwell"
    enable_env = ENABLE_ENV
    warns_reference_backward = True

    def make_forward(self, dtype, head_dim, head_dim_v, mask, has_softcap, max_logits=False):
        return fwd_config.FwdConfig.make(dtype, head_dim, head_dim_v, mask, has_softcap,
                                         max_logits=bool(max_logits))

    def make_segments(self, dtype, head_dim, head_dim_v, mask, has_softcap, max_logits=False):
        return fwd_config.segments_config(dtype, head_dim, head_dim_v, mask, has_softcap,
                                          max_logits=bool(max_logits))

    def make_varlen(self, dtype, head_dim, head_dim_v, mask, has_softcap):
        return fwd_config.varlen_config(dtype, head_dim, head_dim_v, mask, has_softcap)

    def make_paged(self, dtype, head_dim, head_dim_v, mask, has_softcap):
        return fwd_config.FwdConfig.make(dtype, head_dim, head_dim_v, mask, has_softcap,
                                         paged=True)

    def backward_configs(self, q, k, v, opts) -> tuple[Sm100BwdConfig, None]:
        """(main config, None) for this call (no postprocess kernel on sm100); raises ValueError
        if unsupported."""
        return Sm100BwdConfig.make(**backward_kind(q, k, v, opts)), None

    def backward(self, q, k, v, out, lse, dout, delta, lse_log2, opts):
        """(dq, dk, dv) in the dtypes of q, k, v. ``out`` and ``lse`` are unused (their
        information is in delta and lse_log2)."""
        del out, lse
        cfg, _ = self.backward_configs(q, k, v, opts)
        b, sq, h, d = q.shape
        params = kernel_params(opts, d)
        num_m = cfg.num_m_blocks(sq)
        sq_pad = num_m * cfg.tile_m
        dq_accum, dk, dvv, _ = self.backward_main(cfg, q, k, v, dout, delta, lse_log2, params,
                                                  sq_pad, num_m * cfg.semaphore_slots)
        # the sm90 postprocess kernel's rule: dq = dq_accum · softmax_scale in float32
        dq = dq_accum.reshape(b, h, sq_pad, d)[:, :, :sq] * params[PARAM_SCALE]
        dq = dq.transpose(0, 2, 1, 3).astype(q.dtype)
        return dq, dk.astype(k.dtype), dvv.astype(v.dtype)
