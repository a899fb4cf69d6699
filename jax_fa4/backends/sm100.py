"""The Blackwell backend (``implementation="sm100"``, compute capability 10.x): configs and calls.

Opt-in: its kernels are compiled and inspected (SASS-checked) but have never run on a Blackwell
GPU in this project, so ``implementation=None`` picks them only with ``JAX_FA4_ENABLE_SM100=1``
(else the reference, with a one-time warning); ``implementation="sm100"`` forces them.

Forward (jax_fa4/kernels/sm100/fwd_config.py): the table's config (``FwdConfig.make``), persistent,
with the same varlen (``varlen=True``), paged (``paged=True``) and segment-id (``segments=True``,
:meth:`KernelBackend.segments_forward`'s tables) modes, and max logits (``max_logits=True``, dense
and segment-id calls), under the same call contracts as Hopper's; decode-shaped calls run the
training tile, rewritten by :mod:`jax_fa4.backends.decode`.

Dense backward (jax_fa4/kernels/sm100/bwd_config.py), :meth:`Sm100Backend.backward`: ``sm100_bwd``
with dq_accum (zeros, float32, (B, H, Sq_pad·D), row-major, updated in place through an
input/output alias) and, for deterministic calls, dq_semaphore (zeros, int32,
(B, H, ceil(Sq/128)·slots), aliased too; 2 slots per query block for the 2-CTA kernel). The dQ
postprocess is a plain scale-and-cast of dq_accum's rows, left to XLA (one fused elementwise op):
the sm100 kernel's dq_accum is row-major, so no fragment reordering kernel is needed. Head dims
64, 96, 128 with ``Dv == D`` and 192 with ``Dv`` 128 (the last two with 2-CTA MMAs); others run the
reference's backward with a one-time ``RuntimeWarning`` naming the reason.

Head dims 192/192 and 256 (:meth:`Sm100Backend.split_backward`,
jax_fa4/kernels/sm100/bwd_split_config.py, ``serves``): the split backward, two kernels on the
same inputs: ``sm100_bwd_split`` part "dkdv" (dk, dv; GQA: float32 per query head, summed here;
one CTA per key block at 192/192, two at 256, the config's ``col_splits``) and part "dq" (dq
scaled, in q's dtype, written once: no dq_accum, no postprocess). Both write each output once
without atomics, so ``deterministic=True`` takes the same configs.

Varlen backward (:meth:`Sm100Backend.varlen_backward`): the varlen mode of the 1-CTA kernel
(``bwd_config.varlen_config``, head dims 64, 96, 128) or of the 2-CTA kernel (192/128; 192/192
and 256: the split kernels' varlen mode, :meth:`Sm100Backend.split_varlen_backward`) on
Hopper's work list (:func:`jax_fa4.backends.sm90.work_table`, the same launch order setting; one
item per 128-key block of a sequence, or per 256-key pair span for the 2-CTA kernel,
``work_tile_n``) and dq_accum tiles (:func:`~jax_fa4.backends.sm90.dq_accum_rows`); dq is a row
gather of dq_accum and a scale in XLA. The kernel's tiles load up to 127 query rows and up to
``work_tile_n`` − 1 key rows past their sequence: another sequence's (finite, masked in the
kernel) or, past the last sequence, padding tokens, which may hold anything, NaN included, and
would reach the gradients through the kernel's products with P = dS = 0; so the 128 query rows
and ``work_tile_n`` key rows after ``cu_seqlens[-1]`` are zeroed here first (a scatter: no full
pass over the inputs where XLA updates them in place; Hopper's kernel zeroes them in shared
memory instead).

Segment-id backward (:meth:`Sm100Backend.segments_backward`): the segment-id mode of the 1-CTA
kernel (``bwd_config.segments_config``, head dims 64, 96, 128) or of the 2-CTA kernel (192/128)
on :func:`jax_fa4.segments.backward_tables` for their 128 × 128 tile: each key block visits only
the query blocks that share an id with it (a 2-CTA pair: the union of its two blocks'); dq from
dq_accum and a sink's share from delta as in the dense backward. ``deterministic=True`` (the
kernels add dQ in no fixed order) and other head dims run the reference's backward with the
warning.

GQA/MQA (H > Hkv): float32 dK/dV per *query* head, summed over each group of H/Hkv heads here,
as the Hopper v1 does (deterministic: XLA's reduction has a fixed order).
"""

from __future__ import annotations

from collections.abc import Hashable

import jax
import jax.numpy as jnp

from jax_fa4 import reference
from jax_fa4.backends import base, sm90
from jax_fa4.backends.kernel import (KernelBackend, backward_kind, dense_dq_accum_shape,
                                     kernel_params, sum_gqa_groups)
from jax_fa4.kernels.sm100 import bwd_config, bwd_split_config, fwd_config
from jax_fa4.kernels.sm100.bwd_config import Sm100BwdConfig
from jax_fa4.kernels.sm100.bwd_split_config import Sm100BwdSplitConfig
from jax_fa4.kernels.spec import PARAM_SCALE

ARCH = "sm_100a"
#: ``JAX_FA4_ENABLE_SM100=1`` lets ``implementation=None`` pick this backend on Blackwell GPUs.
ENABLE_ENV = "JAX_FA4_ENABLE_SM100"


def zero_rows_from(x: jax.Array, start: jax.Array, rows: int) -> jax.Array:
    """``x`` (total, ...) with rows ``[start, start + rows)`` set to 0 (those past the end are
    dropped): the padding rows after the last sequence that a tile can load."""
    idx = start + jnp.arange(rows, dtype=jnp.int32)
    return x.at[idx].set(jnp.zeros((), x.dtype), mode="drop")


def dense_dq(dq_accum: jax.Array, q: jax.Array, sq_pad: int, scale: jax.Array) -> jax.Array:
    """dq (B, Sq, H, D) in q's dtype from the dense kernels' dq_accum (B, H, Sq_pad·D),
    row-major and unscaled: the sm90 postprocess kernel's rule, dq = dq_accum · softmax_scale in
    float32, the rows past Sq dropped."""
    b, sq, h, d = q.shape
    dq = dq_accum.reshape(b, h, sq_pad, d)[:, :, :sq] * scale
    return dq.transpose(0, 2, 1, 3).astype(q.dtype)


def varlen_dq(dq_accum: jax.Array, cu_seqlens_q: jax.Array, total_q: int, head_dim: int,
              tile_m: int, scale: jax.Array, dtype) -> jax.Array:
    """The packed dq (total_q, H, D) from the varlen kernel's dq_accum (1, H, R·D), row-major:
    token t of sequence b is row ``first_tile(b)·tile_m + t − cu_seqlens_q[b]``, times the
    softmax scale; 0 on the tokens outside every sequence."""
    h = dq_accum.shape[1]
    t, seq, valid, start, _ = base.token_layout(cu_seqlens_q, total_q)
    first = sm90.first_tiles(cu_seqlens_q, tile_m)
    row = jnp.where(valid, first[seq] * tile_m + t - start, 0)
    acc = dq_accum.reshape(h, -1, head_dim)[:, row]  # (H, total_q, D)
    dq = jnp.where(valid[None, :, None], acc * scale, 0.0)
    return dq.transpose(1, 0, 2).astype(dtype)


class Sm100Backend(KernelBackend):
    """Blackwell: the sm100 forward (dense, varlen, paged, segment ids), the preprocess and the
    sm100 dense, varlen and segment-id backward kernels (compile-verified only)."""

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

    def backward_configs(self, q, k, v, opts) -> (tuple[Sm100BwdConfig, None]
                                                  | tuple[Sm100BwdSplitConfig,
                                                          Sm100BwdSplitConfig]):
        """(main config, None) for this call (no postprocess kernel on sm100); raises ValueError
        if unsupported. Head dims of the split backward (192/192, 256): (dK/dV config, dQ
        config)."""
        if bwd_split_config.serves(q.shape[3], v.shape[3]):
            return self.split_backward_configs(q, k, v, opts)
        return Sm100BwdConfig.make(**backward_kind(q, k, v, opts)), None

    def dq_accum_shape(self, q, k, v, opts) -> tuple[int, ...] | None:
        """(B, H, Sq_pad·D) of the main-kernel config for this call; None for the split
        backward (head dims 192/192 and 256), which has no dq_accum."""
        if bwd_split_config.serves(q.shape[3], v.shape[3]):
            return None
        return dense_dq_accum_shape(self.backward_configs(q, k, v, opts)[0], q)

    def backward(self, q, k, v, out, lse, dout, delta, lse_log2, opts, dq_accum=None):
        """(dq, dk, dv) in the dtypes of q, k, v. ``out`` and ``lse`` are unused (their
        information is in delta and lse_log2); ``dq_accum``: the preprocess's zeros."""
        del out, lse
        if bwd_split_config.serves(q.shape[3], v.shape[3]):
            return self.split_backward(q, k, v, dout, delta, lse_log2, opts)
        cfg, _ = self.backward_configs(q, k, v, opts)
        sq, d = q.shape[1], q.shape[3]
        params = kernel_params(opts, d)
        num_m = cfg.num_m_blocks(sq)
        sq_pad = num_m * cfg.tile_m
        dq_accum, dk, dvv, _ = self.backward_main(cfg, q, k, v, dout, delta, lse_log2, params,
                                                  sq_pad, num_m * cfg.semaphore_slots,
                                                  dq_accum=dq_accum)
        dq = dense_dq(dq_accum, q, sq_pad, params[PARAM_SCALE])
        return dq, dk.astype(k.dtype), dvv.astype(v.dtype)

    # -- segment ids backward ---------------------------------------------------------------------
    def make_segments_backward(self, dtype, head_dim, head_dim_v, mask, has_softcap, gqa):
        """The segment-id mode of the 1-CTA kernel (head dims 64, 96, 128) or of the 2-CTA
        kernel (192/128) (bwd_config.segments_config; no sink_grad: the sink's share comes from
        delta, :meth:`segments_backward`)."""
        return bwd_config.segments_config(dtype, head_dim, head_dim_v, mask, has_softcap, gqa)

    def segments_backward(self, q, k, v, out, lse, dout, dlse, q_ids, kv_ids, opts,
                          sink: jax.Array | None = None):
        """(dq, dk, dv, sink_rows) by the segment-id chain: the preprocess, the 1- or 2-CTA
        kernel's segment-id mode (each key block visits only the query blocks jax_fa4.segments'
        tables list for it; both CTAs of a 2-CTA pair the union of their blocks', read from the
        same 128-key tables) and dq from its row-major dq_accum as in :meth:`backward`. With a
        ``sink``, ``sink_rows`` (B, H) = ``sum_i P_sink_i * rowsum(dout * out)_i`` from the
        preprocess's delta in JAX (as the dense sm100 backward: no kernel sums it), else
        None."""
        from jax_fa4 import segments

        cfg = self.segments_backward_config(q, k, v, opts)
        assert not isinstance(cfg, str), cfg
        rowsum, lse_log2, _ = base.preprocess(self, out, dout, lse, opts)
        sq, d = q.shape[1], q.shape[3]
        params = kernel_params(opts, d)
        sq_pad = cfg.num_m_blocks(sq) * cfg.tile_m
        tables = segments.backward_tables(q_ids, kv_ids, cfg.tile_m, cfg.tile_n)
        # a cotangent on lse enters as -dlse (jax_fa4.autodiff)
        dq_accum, dk, dvv, _ = self.backward_main(cfg, q, k, v, dout, rowsum - dlse, lse_log2,
                                                  params, sq_pad, 0, extra_inputs=tables)
        dq = dense_dq(dq_accum, q, sq_pad, params[PARAM_SCALE])
        sink_rows = None
        if sink is not None:  # (rows without a key: P_sink = 0, selected out)
            sink_rows = jnp.where(jnp.isneginf(lse), 0.0,
                                  reference.sink_probability(sink, lse) * rowsum).sum(axis=-1)
        return dq, dk.astype(k.dtype), dvv.astype(v.dtype), sink_rows

    # -- split backward (head dims 192/192 and 256) --------------------------------------------
    def split_backward_configs(self, q, k, v, opts) -> tuple[Sm100BwdSplitConfig,
                                                            Sm100BwdSplitConfig]:
        """(dK/dV config, dQ config) of the split backward (bwd_split_config.py); the
        ``deterministic`` option needs no config of its own: both kernels write each output
        element once, without atomics."""
        kind = backward_kind(q, k, v, opts)
        del kind["deterministic"]
        return bwd_split_config.split_configs(**kind)

    def split_backward(self, q, k, v, dout, delta, lse_log2, opts):
        """(dq, dk, dv) from the two kernels of the split backward: the dK/dV kernel (GQA
        configs: float32 per query head, summed over each group here) and the dQ kernel (dq
        scaled, in q's dtype)."""
        from jax_fa4.ffi.call import call_kernel

        dkdv_cfg, dq_cfg = self.split_backward_configs(q, k, v, opts)
        b, sk, hkv, dv = v.shape
        h, d = q.shape[2], q.shape[3]
        params = kernel_params(opts, d)
        inputs = (q, k, v, dout, lse_log2.astype(jnp.float32), delta.astype(jnp.float32),
                  params)
        hdk = h if dkdv_cfg.gqa else hkv
        dkv_dtype = jnp.float32 if dkdv_cfg.gqa else k.dtype
        dk, dvv = call_kernel(dkdv_cfg, self.arch, *inputs, out_shapes=(
            jax.ShapeDtypeStruct((b, sk, hdk, d), dkv_dtype),
            jax.ShapeDtypeStruct((b, sk, hdk, dv), dkv_dtype)))
        (dq,) = call_kernel(dq_cfg, self.arch, *inputs,
                            out_shapes=(jax.ShapeDtypeStruct(q.shape, q.dtype),))
        if dkdv_cfg.gqa:
            dk, dvv = sum_gqa_groups(dk, dvv, hkv, head_axis=2)
        return dq, dk.astype(k.dtype), dvv.astype(v.dtype)

    # -- varlen backward --------------------------------------------------------------------------
    def make_varlen_backward(self, dtype, head_dim, head_dim_v, mask, has_softcap, gqa):
        if bwd_split_config.serves(head_dim, head_dim_v):  # (its dK/dV kernel's config)
            return bwd_split_config.split_varlen_configs(dtype, head_dim, head_dim_v, mask,
                                                         has_softcap, gqa)[0]
        return bwd_config.varlen_config(dtype, head_dim, head_dim_v, mask, has_softcap, gqa)

    def varlen_backward_settings(self) -> Hashable:
        return sm90.work_order()

    def varlen_backward(self, q, k, v, sink, segments, cu_seqlens_q, cu_seqlens_k, out, lse,
                        dout, dlse, opts, plan):
        """The varlen backward chain: the preprocess on the packed out / dout, the varlen main
        kernel (every sequence's own blocks only, Hopper's work list with one item per
        ``work_tile_n`` keys: 128, or a 2-CTA pair's 256 at 192/128) and dq gathered from its
        dq_accum rows; a sink's gradient from the preprocess's delta (``kernel_sink_grad`` is
        off: as the dense sm100 backward)."""
        from jax_fa4.ffi.call import call_kernel

        if bwd_split_config.serves(q.shape[2], v.shape[2]):
            return self.split_varlen_backward(q, k, v, sink, segments, cu_seqlens_q,
                                              cu_seqlens_k, out, lse, dout, dlse, opts, plan)
        config = self.varlen_backward_config(q, k, v, opts)
        total_q, h, d = q.shape
        total_k, hkv, dv = v.shape
        batch = cu_seqlens_q.shape[0] - 1
        tm, tn = config.tile_m, config.work_tile_n  # keys per work item (a 2-CTA pair's: 256)
        delta, lse_log2, _ = base.preprocess(self, out, dout, lse, opts)
        # a cotangent on lse enters as -dlse (jax_fa4.autodiff); padding tokens' delta (their
        # dout may be NaN) is read by no kernel and selected out for the sink's gradient
        in_sequence = segments.q_segment_ids[:, None, :] >= 0
        delta = jnp.where(in_sequence, delta - dlse, 0.0)
        params = kernel_params(opts, d)
        rows = sm90.dq_accum_rows(total_q, batch, tm)
        work = sm90.work_table(cu_seqlens_q, cu_seqlens_k, sm90.work_items(total_k, batch, tn),
                               tm, tn, opts.window, plan[3])
        q_in, dout_in = (zero_rows_from(x, cu_seqlens_q[-1], tm) for x in (q, dout[0]))
        k_in, v_in = (zero_rows_from(x, cu_seqlens_k[-1], tn) for x in (k, v))
        hdk = h if config.gqa else hkv
        dkv_dtype = jnp.float32 if config.gqa else q.dtype
        dq_accum = jnp.zeros((1, h, rows * d), jnp.float32)
        dq_accum, dk, dvv = call_kernel(
            config, self.arch, q_in[None], k_in[None], v_in[None], dout_in[None], lse_log2,
            delta, params, dq_accum, cu_seqlens_q, cu_seqlens_k, work,
            out_shapes=(jax.ShapeDtypeStruct(dq_accum.shape, jnp.float32),
                        jax.ShapeDtypeStruct((1, total_k, hdk, d), dkv_dtype),
                        jax.ShapeDtypeStruct((1, total_k, hdk, dv), dkv_dtype)))
        dq = varlen_dq(dq_accum, cu_seqlens_q, total_q, d, tm, params[PARAM_SCALE], q.dtype)
        dk, dvv = dk[0], dvv[0]  # (the kernel wrote zeros to the keys outside every sequence)
        if config.gqa:
            dk, dvv = sum_gqa_groups(dk, dvv, hkv, head_axis=1)
        dsink = None if sink is None else reference.sink_gradient(sink, lse, delta)
        return dq, dk.astype(k.dtype), dvv.astype(v.dtype), dsink

    def split_varlen_backward(self, q, k, v, sink, segments, cu_seqlens_q, cu_seqlens_k, out,
                              lse, dout, dlse, opts, plan):
        """The varlen backward at head dims 192/192 and 256: the preprocess, then the split
        backward's two kernels in their varlen mode
        (bwd_split_config.split_varlen_backward_signature): the dK/dV kernel on the varlen
        backward's work list of key blocks (launch order ``plan[3]``, its cost counted in the
        kernel's 64-row query blocks), the dQ kernel on the same list built over query blocks
        with q and k swapped. dq comes out scaled and zero outside every sequence; the padding
        rows after the last sequence are zeroed first, as for the 1-CTA kernel's varlen
        mode."""
        from jax_fa4.ffi.call import call_kernel

        dkdv_cfg, dq_cfg = bwd_split_config.split_varlen_configs(
            jnp.dtype(q.dtype).name, q.shape[2], v.shape[2], base.mask_kind(opts.window),
            opts.softcap > 0, q.shape[1] != k.shape[1])
        total_q, h, d = q.shape
        total_k, hkv, dv = v.shape
        batch = cu_seqlens_q.shape[0] - 1
        rows, cols = dkdv_cfg.tile_rows, dkdv_cfg.tile_cols
        delta, lse_log2, _ = base.preprocess(self, out, dout, lse, opts)
        in_sequence = segments.q_segment_ids[:, None, :] >= 0  # (as varlen_backward)
        delta = jnp.where(in_sequence, delta - dlse, 0.0)
        params = kernel_params(opts, d)
        work_kv = sm90.work_table(cu_seqlens_q, cu_seqlens_k,
                                  sm90.work_items(total_k, batch, rows), cols, rows, opts.window,
                                  plan[3])
        work_q = sm90.work_table(cu_seqlens_k, cu_seqlens_q,
                                 sm90.work_items(total_q, batch, rows), cols, rows, opts.window,
                                 "sequence")
        q_in, dout_in = (zero_rows_from(x, cu_seqlens_q[-1], rows) for x in (q, dout[0]))
        k_in, v_in = (zero_rows_from(x, cu_seqlens_k[-1], rows) for x in (k, v))
        inputs = (q_in[None], k_in[None], v_in[None], dout_in[None], lse_log2, delta, params,
                  cu_seqlens_q, cu_seqlens_k)
        hdk = h if dkdv_cfg.gqa else hkv
        dkv_dtype = jnp.float32 if dkdv_cfg.gqa else q.dtype
        dk, dvv = call_kernel(dkdv_cfg, self.arch, *inputs, work_kv, out_shapes=(
            jax.ShapeDtypeStruct((1, total_k, hdk, d), dkv_dtype),
            jax.ShapeDtypeStruct((1, total_k, hdk, dv), dkv_dtype)))
        (dq,) = call_kernel(dq_cfg, self.arch, *inputs, work_q,
                            out_shapes=(jax.ShapeDtypeStruct((1, total_q, h, d), q.dtype),))
        dk, dvv = dk[0], dvv[0]
        if dkdv_cfg.gqa:
            dk, dvv = sum_gqa_groups(dk, dvv, hkv, head_axis=1)
        dsink = None if sink is None else reference.sink_gradient(sink, lse, delta)
        return dq[0], dk.astype(k.dtype), dvv.astype(v.dtype), dsink
