"""The Hopper backend (``implementation="sm90"``, compute capability 9.0): configs and calls.

Forward (jax_fa4/kernels/sm90/fwd_config.py): the training tile of every head dim
(``FwdConfig.make``); decode-shaped calls, rewritten around the kernel by
:mod:`jax_fa4.backends.decode`, run the decode tile (``decode_config``: 64 rows, one consumer
warpgroup, two CTAs per SM where they fit, q and out head-major so that a decode step's packing
is a free reshape) when the packed rows fit it. ``JAX_FA4_DECODE_TILE`` (read at trace time, for
comparisons) selects the training tile (``0``) or a decode-tile alternative (a name in
``fwd_config.DECODE_OPTIONS``, also for paged calls). Paged KV calls run the 64-row decode tile
in its paged mode (``paged_config``; page_size a multiple of its 64-key block); varlen calls the
varlen forward (``varlen_config``). Speed: docs/kernels/sm90-forward.md (decode). A persistent
config with dynamic tiles (``FwdConfig.dynamic_tiles``, which no table row picks) takes a zeroed
int32 tile counter as one more operand, updated in place (:func:`call_forward`).

Dense backward (jax_fa4/kernels/sm90/bwd_config.py), :meth:`Sm90Backend.backward`:

  1. ``sm90_bwd``: dq_accum (zeros, float32, (B, H, Sq_pad·D), updated in place through an
     input/output alias), dk, dv;
  2. ``sm90_bwd_postprocess``: dq = dq_accum · softmax_scale in q's dtype.

Deterministic configs (``opts.deterministic``) also take ``dq_sem`` (B, H, Sq_pad/tile_m) int32
zeros: the counters that make the key blocks add into each query block's dQ in a fixed order.

GQA/MQA (H > Hkv): the main kernel writes float32 dK/dV per *query* head, (B, Sk, H, D), summed
over each group here (cost: 4·B·Sk·H·(D+Dv) bytes written by the kernel and read back by XLA's
reduction, instead of 2·B·Sk·Hkv·(D+Dv)). BwdConfig.make takes the ``group_heads`` form instead
(one CTA per (key block, kv head) walking the G = H/Hkv query heads of its group, dK/dV written
once per kv head in the input dtype) where the tuning row allows it and B·Hkv·key blocks reaches
bwd_tuning.GROUP_HEADS_MIN_CTAS; no row allows it until it has run on a GPU.

Varlen backward (:meth:`Sm90Backend.varlen_backward`): one CTA per (key block of a sequence,
head), listed by a work list built here from cu_seqlens (:func:`work_table`), so every sequence
costs only its own blocks; its dQ partial sums go to tiles no other sequence shares
(:func:`dq_accum_rows`), which the varlen postprocess turns into the packed dq
(:func:`tile_owners`).
"""

from __future__ import annotations

import os
from collections.abc import Hashable

import jax
import jax.numpy as jnp

from jax_fa4 import reference
from jax_fa4.backends import base
from jax_fa4.backends.kernel import (KernelBackend, backward_kind, dense_dq_accum_shape,
                                     dense_sq_pad, kernel_params, sum_gqa_groups)
from jax_fa4.kernels.common import geometry
from jax_fa4.kernels.sm90 import bwd_config, fwd_config
from jax_fa4.kernels.sm90.bwd_config import BwdConfig
from jax_fa4.kernels.sm90.bwd_pair_config import with_pair

ARCH = "sm_90a"


def decode_tile_option() -> dict | None:
    """The Hopper decode tile serving rewritten calls, from ``JAX_FA4_DECODE_TILE``: None for
    the 128-row training tile (``0``), else overrides of the decode tile's config (``{}``: the
    shipped decode tile, ``1`` or unset; a ``DECODE_OPTIONS`` name: that option)."""
    value = os.environ.get("JAX_FA4_DECODE_TILE", "1")
    if value == "0":
        return None
    if value == "1":
        return {}
    if value not in fwd_config.DECODE_OPTIONS:
        raise ValueError(f"JAX_FA4_DECODE_TILE must be 0, 1 or one of "
                         f"{sorted(fwd_config.DECODE_OPTIONS)}, got {value!r}")
    return fwd_config.DECODE_OPTIONS[value]


# -- the varlen backward's work list and dq_accum layout ------------------------------------------
#: Launch order of the varlen backward's work items: "sequence" (sequence by sequence, each
#: from its last key block down, as the dense kernels launch: a sequence's CTAs run together and
#: share its Q / dO / K / V in L2) or "heavy_first" (the key blocks with the most query blocks to
#: visit first, ties in sequence order). On the H200 "sequence" was 6 % ahead at 64 × 512 causal
#: and within ±2 % elsewhere (benchmarks/results/varlen-work-rows-nvidia-h200-2026-11-30.json).
#: JAX_FA4_VARLEN_BWD_ORDER overrides.
VARLEN_BWD_ORDER = "sequence"


def work_order() -> str:
    """The varlen backward's launch order: ``JAX_FA4_VARLEN_BWD_ORDER`` or the default."""
    order = os.environ.get("JAX_FA4_VARLEN_BWD_ORDER", VARLEN_BWD_ORDER)
    if order not in ("heavy_first", "sequence"):
        raise ValueError(f"JAX_FA4_VARLEN_BWD_ORDER must be 'heavy_first' or 'sequence', got "
                         f"{order!r}")
    return order


#: The work list's sequence value of the item that zeroes dK / dV outside every sequence.
ZERO_PADDING = -2


def work_items(total_k: int, batch: int, tile_n: int) -> int:
    """Rows of the work list: a bound on the key blocks of all sequences (sum of
    ceil(len_k / tile_n) <= total_k // tile_n + batch), and the ZERO_PADDING item."""
    return total_k // tile_n + batch + 1


def dq_accum_rows(total_q: int, batch: int, tile_m: int) -> int:
    """Rows of the varlen dq_accum: sequence b's blocks start at tile
    ``(cu_q[b] + b·tile_m) // tile_m`` and end by tile ``total_q // tile_m + batch``."""
    return (total_q // tile_m + batch) * tile_m


def first_tiles(cu_seqlens_q: jax.Array, tile_m: int) -> jax.Array:
    """(batch,) int32: sequence b's first dq_accum tile, ``(cu_q[b] + b·tile_m) // tile_m``."""
    batch = cu_seqlens_q.shape[0] - 1
    return (cu_seqlens_q[:-1] + jnp.arange(batch, dtype=jnp.int32) * tile_m) // tile_m


def tile_owners(cu_seqlens_q: jax.Array, num_tiles: int, tile_m: int) -> jax.Array:
    """(num_tiles,) int32: the sequence owning each dq_accum tile, -1 for none (sequence b owns
    the ceil(len_q(b) / tile_m) tiles from (cu_q[b] + b·tile_m) // tile_m on)."""
    batch = cu_seqlens_q.shape[0] - 1
    lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    first = first_tiles(cu_seqlens_q, tile_m)
    end = first + (lens + tile_m - 1) // tile_m
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    # the last sequence starting at or before t (empty sequences own no tile)
    seq = jnp.clip(jnp.searchsorted(first, t, side="right") - 1, 0, batch - 1)
    return jnp.where((first[seq] <= t) & (t < end[seq]), seq, -1).astype(jnp.int32)


def visited_query_blocks(len_q, len_k, n_block, tile_m: int, tile_n: int, window):
    """Query blocks key block ``n_block`` of a sequence visits: the kernel's block range
    (``geometry.BwdBlocks.m_block_range``, windows resolved as the kernel resolves its params),
    elementwise on int32 arrays; ``window`` the canonical (left, right), None = unbounded."""
    kind = base.mask_kind(window)
    wl, wr = 0, 0  # what the kernel's resolve_windows gives the causal and unmasked kinds
    if kind == "local":
        left, right = window
        wl, wr = geometry.clamp_windows(-1 if left is None else left,
                                        -1 if right is None else right, len_q, len_k)
    blocks = geometry.BwdBlocks(tile_m, tile_n, kind == "causal", kind == "local", len_q, len_k,
                                wl, wr)
    m_min, m_max = blocks.m_block_range(n_block)
    return jnp.maximum(m_max - m_min, 0)


def work_table(cu_seqlens_q: jax.Array, cu_seqlens_k: jax.Array, num_items: int, tile_m: int,
               tile_n: int, window, order: str = VARLEN_BWD_ORDER) -> jax.Array:
    """The varlen backward's work list, (num_items, 8) int32: row x of CTA x is (sequence b, key
    block, cu_seqlens_q[b], cu_seqlens_k[b], len_q(b), len_k(b), b's first dq_accum tile, 0)
    (sm90.bwd_config.varlen_attention_backward_signature): every key block of every sequence
    once, in launch ``order`` (see VARLEN_BWD_ORDER), then spare rows (-1, 0, …) with lengths
    0, and last (ZERO_PADDING, 0, …), the item that writes the zero gradient of the keys
    outside every sequence."""
    lens_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    lens_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    batch = lens_k.shape[0]
    blocks = (lens_k + tile_n - 1) // tile_n
    ends = jnp.cumsum(blocks)
    x = jnp.arange(num_items - 1, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, x, side="right"), batch - 1)
    used = x < ends[-1]
    # sequence by sequence, each from its last key block down
    n_block = (ends[seq] - 1 - x).astype(jnp.int32)
    columns = (seq, n_block, cu_seqlens_q[seq], cu_seqlens_k[seq], lens_q[seq], lens_k[seq],
               first_tiles(cu_seqlens_q, tile_m)[seq], jnp.zeros_like(seq))
    spare = (-1,) + (0,) * (len(columns) - 1)
    table = jnp.stack([jnp.where(used, c, fill) for c, fill in zip(columns, spare)],
                      axis=-1).astype(jnp.int32)
    if order == "heavy_first":
        cost = visited_query_blocks(lens_q[seq], lens_k[seq], n_block, tile_m, tile_n, window)
        table = table[jnp.argsort(jnp.where(used, -cost, 1), stable=True)]
    padding = jnp.asarray([[ZERO_PADDING] + [0] * (len(columns) - 1)], jnp.int32)
    return jnp.concatenate([table, padding])


# -- the forward's call ---------------------------------------------------------------------------
def call_forward(config, *inputs: jax.Array, out_shapes: tuple[jax.ShapeDtypeStruct, ...]
                 ) -> list[jax.Array]:
    """``call_kernel`` of a Hopper forward config on ``inputs`` (its signature's, without the
    tile counter), returning the ``out_shapes`` outputs. A ``dynamic_tiles`` config also takes
    its tile counter (``fwd_config.TILE_COUNTER``): zeros made here for each call, passed as the
    last input and aliased to a last output the kernel's atomic adds update in place, dropped
    from the results; every other config, no extra operand."""
    from jax_fa4.ffi.call import call_kernel

    if not getattr(config, "dynamic_tiles", False):
        return call_kernel(config, ARCH, *inputs, out_shapes=out_shapes)
    counter = jnp.zeros(fwd_config.TILE_COUNTER.sample_shape, fwd_config.TILE_COUNTER.dtype)
    outs = call_kernel(config, ARCH, *inputs, counter,
                       out_shapes=(*out_shapes, jax.ShapeDtypeStruct(counter.shape,
                                                                     counter.dtype)))
    return outs[:-1]


# -- the backend ---------------------------------------------------------------------------------
class Sm90Backend(KernelBackend):
    """Hopper: the sm90 forward (training, decode, varlen and paged tiles), the preprocess, and
    the backward main + dQ postprocess kernels (dense and varlen)."""

    name = "sm90"
    arch = ARCH
    compute_capability = "9"
    capability_text = "9.0"
    gpu_family = "Hopper"
    paged_clamps_seqused = True  # an unsplit call passes seqused_k as it is
    kernel_sinks = True  # sinks in the forward's params; float32-out decode and paged tiles
    kernel_sink_grad = True  # the backward sums the sink's share (BwdConfig.sink_grad)

    def make_forward(self, dtype, head_dim, head_dim_v, mask, has_softcap, max_logits=False):
        if max_logits:
            return fwd_config.max_logits_config(dtype, head_dim, head_dim_v, mask, has_softcap)
        return fwd_config.FwdConfig.make(dtype, head_dim, head_dim_v, mask, has_softcap)

    def call_forward(self, config, *inputs, out_shapes):
        return call_forward(config, *inputs, out_shapes=out_shapes)

    def make_segments(self, dtype, head_dim, head_dim_v, mask, has_softcap, max_logits=False):
        return fwd_config.segments_config(dtype, head_dim, head_dim_v, mask, has_softcap,
                                          max_logits=max_logits)

    def make_decode(self, dtype, head_dim, head_dim_v, has_softcap, rows, out_f32=False):
        option = decode_tile_option()
        if out_f32:  # the decode tile only has float32-out configs (more rows: more m blocks)
            return fwd_config.decode_config(dtype, head_dim, head_dim_v, has_softcap,
                                            out_f32=True, **(option or {}))
        if option is None or rows > fwd_config.DECODE_TILE_M:
            return None
        return fwd_config.decode_config(dtype, head_dim, head_dim_v, has_softcap, **option)

    def make_fp8(self, head_dim, head_dim_v, mask, has_softcap):
        return fwd_config.fp8_config(head_dim, head_dim_v, mask, has_softcap)

    def make_fp8_paged(self, head_dim, head_dim_v, mask, has_softcap):
        return fwd_config.fp8_paged_config(head_dim, head_dim_v, mask, has_softcap)

    def make_fp8_decode(self, head_dim, head_dim_v, has_softcap, out_f32=False):
        return fwd_config.fp8_decode_config(head_dim, head_dim_v, has_softcap, out_f32=out_f32)

    def make_fp8_varlen(self, head_dim, head_dim_v, mask, has_softcap):
        return fwd_config.fp8_config(head_dim, head_dim_v, mask, has_softcap, varlen=True)

    def make_varlen(self, dtype, head_dim, head_dim_v, mask, has_softcap):
        return fwd_config.varlen_config(dtype, head_dim, head_dim_v, mask, has_softcap)

    def make_paged(self, dtype, head_dim, head_dim_v, mask, has_softcap):
        return fwd_config.paged_config(dtype, head_dim, head_dim_v, mask, has_softcap,
                                       **(decode_tile_option() or {}))

    def backward_configs(self, q, k, v, opts, sink_grad: bool = False
                         ) -> tuple[BwdConfig, object]:
        """(main config, postprocess config) for this call (``sink_grad``: the config that
        also sums the sink's share of the output's rowsum); raises ValueError if unsupported."""
        cfg = with_pair(BwdConfig.make(**backward_kind(q, k, v, opts), sink_grad=sink_grad,
                                       group_shape=(q.shape[0] * k.shape[2], k.shape[1])))
        return cfg, cfg.postprocess_config()

    def dq_accum_shape(self, q, k, v, opts) -> tuple[int, ...]:
        """(B, H, Sq_pad·D) of the table's main-kernel config for this call (its tile_m)."""
        return dense_dq_accum_shape(self.backward_configs(q, k, v, opts)[0], q)

    def backward(self, q, k, v, out, lse, dout, delta, lse_log2, opts,
                 config: BwdConfig | None = None, sink: jax.Array | None = None,
                 with_sink_rows: bool = False, dq_accum: jax.Array | None = None):
        """(dq, dk, dv) in the dtypes of q, k, v. ``out`` and ``lse`` are unused (their
        information is in delta and lse_log2). ``config`` replaces the tuning table's
        main-kernel config (benchmarks/bwd_variants.py); it must describe the same problem
        (dtype, head dims, mask kind, softcap, GQA). ``sink`` (H,) with ``with_sink_rows``:
        the ``sink_grad`` kernel, and ``sink_rows`` (B, H) appended (``backward_with_sink``)."""
        del out, lse
        from jax_fa4.ffi.call import call_kernel

        sink_grad = with_sink_rows and sink is not None
        if config is None:
            cfg, post = self.backward_configs(q, k, v, opts, sink_grad=sink_grad)
        else:  # (also a config the table does not pick, e.g. its head dims have no row yet)
            kind = {**backward_kind(q, k, v, opts), "sink_grad": sink_grad}
            kind.pop("deterministic")
            if config.group_heads:  # (a GQA call's form with gqa=False's outputs)
                kind["gqa"] = False
            wrong = {f: getattr(config, f) for f, want in kind.items()
                     if getattr(config, f) != want}
            if wrong:
                raise ValueError(f"config {config.describe()} does not match the call: {wrong} "
                                 f"where the call has {({f: kind[f] for f in wrong})}")
            cfg, post = config, config.postprocess_config()
        b, sq, h, d = q.shape
        params = kernel_params(opts, d, sink if sink_grad else None)
        sq_pad = dense_sq_pad(cfg, sq)
        dq_accum, dk, dvv, sink_rows = self.backward_main(cfg, q, k, v, dout, delta, lse_log2,
                                                          params, sq_pad, sq_pad // cfg.tile_m,
                                                          dq_accum=dq_accum)
        (dq,) = call_kernel(post, self.arch, dq_accum, kernel_params(opts, d),
                            out_shapes=(jax.ShapeDtypeStruct(q.shape, q.dtype),))
        grads = (dq, dk.astype(k.dtype), dvv.astype(v.dtype))
        return (*grads, sink_rows) if with_sink_rows else grads

    # -- segment ids backward ---------------------------------------------------------------------
    def make_segments_backward(self, dtype, head_dim, head_dim_v, mask, has_softcap, gqa,
                               sink_grad: bool = False):
        return bwd_config.segments_config(dtype, head_dim, head_dim_v, mask, has_softcap, gqa,
                                          sink_grad=sink_grad)

    def segments_backward(self, q, k, v, out, lse, dout, dlse, q_ids, kv_ids, opts,
                          sink: jax.Array | None = None):
        """(dq, dk, dv, sink_rows) by the backward chain with segment ids: the preprocess, the
        main kernel visiting only the query blocks that share an id with each key block
        (jax_fa4.segments' tables for its tile) and the postprocess; with a ``sink`` the
        kernel's ``sum_i P_sink_i * rowsum(dout * out)_i`` per (batch, head) from its float32
        view of the output (``sink_grad``; float32 (B, H)), else None."""
        from jax_fa4 import segments
        from jax_fa4.ffi.call import call_kernel

        cfg = self.segments_backward_config(q, k, v, opts, sink_grad=sink is not None)
        assert not isinstance(cfg, str), cfg
        b, sq, h, d = q.shape
        sq_pad = dense_sq_pad(cfg, sq)
        delta, lse_log2, dq_accum = base.preprocess(self, out, dout, lse, opts,
                                                    dq_accum_shape=dense_dq_accum_shape(cfg, q))
        delta = delta - dlse  # a cotangent on lse enters as -dlse (jax_fa4.autodiff)
        tables = segments.backward_tables(q_ids, kv_ids, cfg.tile_m, cfg.tile_n)
        params = kernel_params(opts, d, sink)
        dq_accum, dk, dvv, sink_rows = self.backward_main(
            cfg, q, k, v, dout, delta, lse_log2, params, sq_pad, sq_pad // cfg.tile_m,
            extra_inputs=tables, dq_accum=dq_accum)
        (dq,) = call_kernel(cfg.postprocess_config(), self.arch, dq_accum,
                            kernel_params(opts, d),
                            out_shapes=(jax.ShapeDtypeStruct(q.shape, q.dtype),))
        return dq, dk.astype(k.dtype), dvv.astype(v.dtype), sink_rows

    # -- varlen backward --------------------------------------------------------------------------
    def make_varlen_backward(self, dtype, head_dim, head_dim_v, mask, has_softcap, gqa,
                             sink_grad: bool = False):
        return bwd_config.varlen_config(dtype, head_dim, head_dim_v, mask, has_softcap, gqa=gqa,
                                        sink_grad=sink_grad)

    def varlen_backward_settings(self) -> Hashable:
        return work_order()

    def varlen_backward(self, q, k, v, sink, segments, cu_seqlens_q, cu_seqlens_k, out, lse,
                        dout, dlse, opts, plan):
        """The varlen backward chain: the preprocess on the packed out / dout, the varlen main
        kernel (every sequence's own blocks only) and the varlen postprocess, which writes each
        sequence's dQ rows in place; the sink's gradient from the preprocess's delta."""
        config = self.varlen_backward_config(q, k, v, opts, sink_grad=sink is not None)
        dq, dk, dv, delta, sink_rows = self.varlen_backward_chain(
            q, k, v, out[0], lse[0], dout[0], dlse[0], cu_seqlens_q, cu_seqlens_k, opts, config,
            order=plan[3], sink=sink)
        # (padding tokens have lse -inf, which the sink's gradient leaves out whatever their
        # dlse)
        dsink = None if sink is None else reference.sink_gradient_from_rows(
            sink, lse, sink_rows, dlse)
        return dq, dk, dv, dsink

    def varlen_backward_chain(self, q, k, v, out, lse, dout, dlse, cu_seqlens_q, cu_seqlens_k,
                              opts, config, order: str = VARLEN_BWD_ORDER,
                              sink: jax.Array | None = None):
        """(dq, dk, dv) packed, ``delta = rowsum(dout * out) - dlse`` (1, H, total_q) and, for
        a ``sink_grad`` config (``sink`` (H,) given), ``sink_rows`` (1, H) (else None: see
        base.Backend.backward_with_sink). ``lse``, ``dlse``: (H, total_q); ``order``: the work
        list's launch order (VARLEN_BWD_ORDER)."""
        from jax_fa4.ffi.call import call_kernel

        total_q, h, d = q.shape
        total_k, hkv, dv = v.shape
        batch = cu_seqlens_q.shape[0] - 1
        tm = config.tile_m
        delta, lse_log2, _ = base.preprocess(self, out[None], dout[None], lse[None], opts)
        delta = delta - dlse[None]  # a cotangent on lse enters as -dlse (jax_fa4.autodiff)
        sink_grad = getattr(config, "sink_grad", False)
        params = kernel_params(opts, d, sink if sink_grad else None)
        rows = dq_accum_rows(total_q, batch, tm)
        work = work_table(cu_seqlens_q, cu_seqlens_k, work_items(total_k, batch, config.tile_n),
                          tm, config.tile_n, opts.window, order)
        hdk = h if config.gqa else hkv
        dkv_dtype = jnp.float32 if config.gqa else q.dtype
        dq_accum = jnp.zeros((1, h, rows * d), jnp.float32)
        out_shapes = (jax.ShapeDtypeStruct(dq_accum.shape, jnp.float32),
                      jax.ShapeDtypeStruct((1, total_k, hdk, d), dkv_dtype),
                      jax.ShapeDtypeStruct((1, total_k, hdk, dv), dkv_dtype))
        if sink_grad:  # one entry per CTA: (1, H, work rows)
            out_shapes += (jax.ShapeDtypeStruct((1, h, work.shape[0]), jnp.float32),)
        outs = call_kernel(
            config, self.arch, q[None], k[None], v[None], dout[None], lse_log2, delta, params,
            dq_accum, cu_seqlens_q, cu_seqlens_k, work, out_shapes=out_shapes)
        dq_accum, dk, dvv = outs[:3]
        sink_rows = outs[3].sum(axis=-1) if sink_grad else None
        # the postprocess writes each sequence's dQ rows in place and zeros outside them
        (dq,) = call_kernel(config.postprocess_config(), self.arch, dq_accum,
                            kernel_params(opts, d),
                            cu_seqlens_q, tile_owners(cu_seqlens_q, rows // tm, tm),
                            out_shapes=(jax.ShapeDtypeStruct((1, total_q, h, d), q.dtype),))
        dq = dq[0]
        dk, dvv = dk[0], dvv[0]  # (the kernel wrote zeros to the keys outside every sequence)
        if config.gqa:
            dk, dvv = sum_gqa_groups(dk, dvv, hkv, head_axis=1)
        return dq, dk.astype(k.dtype), dvv.astype(v.dtype), delta, sink_rows
