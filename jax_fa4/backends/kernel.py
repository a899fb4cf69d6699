"""What every GPU family's backend shares: the FFI calls around its kernels.

A :class:`KernelBackend` runs the CuTe-DSL kernels compiled for its ``arch`` through
:func:`jax_fa4.ffi.call.call_kernel`. The call contracts of the forward (dense, decode-shaped,
varlen, paged) and of the backward preprocess are the same for every family; what differs is
which kernel config serves a call. A family says that in its ``make_*`` hooks (each builds the
config of a problem kind, raising ``ValueError`` when none serves it) and runs its own backward
(:meth:`KernelBackend.backward`), whose chains differ (a postprocess kernel, or none).

Decode-shaped dense and paged calls are rewritten around the same forward kernel (GQA packing,
split-KV: :mod:`jax_fa4.backends.decode`).

Learnable sinks: a family whose forward kernel takes them (``kernel_sinks``: they ride at the
end of the kernel's params) joins them inside the kernel's softmax on dense and varlen calls.
Decode-rewritten and paged calls (whose tile rows may be several heads, and whose split chunks
must not each count the sink) take the kernel's out in float32 (``out_f32`` configs) and join
the sink in the float32 merge, so the output is rounded once either way.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Hashable

import jax
import jax.numpy as jnp

from jax_fa4.backends import decode
from jax_fa4.backends.base import Backend, join_sink, join_sink_outs, mask_kind, token_layout
from jax_fa4.kernels.preprocess_config import PreprocessConfig
from jax_fa4.kernels.spec import (NUM_PARAMS, PARAM_SCALE, PARAM_SOFTCAP, PARAM_WINDOW_LEFT,
                                  PARAM_WINDOW_RIGHT)

#: The input dtypes of the attention kernels.
KERNEL_DTYPES = ("bfloat16", "float16")


def kernel_params(opts, head_dim: int | None = None, sink: jax.Array | None = None
                  ) -> jax.Array:
    """Run-time scalars of the attention kernels at the slots of ``jax_fa4.kernels.spec``
    (``PARAM_SCALE``, ``PARAM_SOFTCAP``, ``PARAM_WINDOW_LEFT``, ``PARAM_WINDOW_RIGHT``), followed
    at ``PARAM_SINKS`` by the learnable sink of each query head when ``sink`` (H,) is given
    (kernels of ``kernel_sinks`` families).

    ``opts`` needs ``.softmax_scale`` (None: ``1/sqrt(head_dim)``), ``.softcap`` (0 or None: off)
    and ``.window`` ((left, right), None = unbounded).
    """
    scale = opts.softmax_scale
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    left, right = opts.window
    values = [0.0] * NUM_PARAMS
    values[PARAM_SCALE] = scale
    values[PARAM_SOFTCAP] = opts.softcap or 0.0
    values[PARAM_WINDOW_LEFT] = -1 if left is None else left
    values[PARAM_WINDOW_RIGHT] = -1 if right is None else right
    # Scalars stay literals in the jaxpr (no captured constant array: custom_partitioning
    # bodies must not close over constants).
    params = jnp.stack([jnp.float32(x) for x in values])
    if sink is None:
        return params
    return jnp.concatenate([params, sink.astype(jnp.float32)])


def backward_kind(q, k, v, opts) -> dict:
    """The problem kind a backward kernel config is made for (the keyword arguments of
    ``BwdConfig.make`` / ``Sm100BwdConfig.make``). ``opts`` needs ``.window`` and ``.softcap``;
    ``.deterministic`` is optional (False)."""
    return dict(dtype=jnp.dtype(q.dtype).name, head_dim=q.shape[3], head_dim_v=v.shape[3],
                mask=mask_kind(opts.window), has_softcap=bool(opts.softcap and opts.softcap > 0),
                gqa=q.shape[2] != k.shape[2],
                deterministic=bool(getattr(opts, "deterministic", False)))


def _config_or_reason(make, *args, **kwargs):
    """``make(*args, **kwargs)``, or the ValueError's message when no config serves."""
    try:
        return make(*args, **kwargs)
    except ValueError as err:
        return str(err)


def _fitting_pages(config, k_cache, kernel: str):
    """A paged kernel ``config``, or why it does not serve this cache (a str: ``config``
    itself, or its key block not dividing the pages)."""
    if isinstance(config, str):
        return config
    page_size = k_cache.shape[1]
    if page_size % config.tile_n:
        return (f"page_size {page_size} is not a multiple of the {kernel} kernel's key block "
                f"{config.tile_n}")
    return config


def _dense_config(make, q, v, opts):
    """``make``'s config (a family's ``make_*`` hook) for a dense (B, S, H, D) call, or the
    reason none serves it (a str); with ``opts.max_logits`` a config that also writes each
    row's max logit."""
    dtype = jnp.dtype(q.dtype).name
    if dtype not in KERNEL_DTYPES:
        return f"the kernels take bfloat16 or float16 inputs, got {dtype}"
    extra = dict(max_logits=True) if getattr(opts, "max_logits", False) else {}
    return _config_or_reason(make, dtype, q.shape[3], v.shape[3], mask_kind(opts.window),
                             opts.softcap > 0, **extra)


def _with_row_max(config, b: int, h: int, sq: int) -> tuple:
    """The per-row max-logit output's shape after (out, lse), for a config with max logits."""
    if getattr(config, "max_logits", False):
        return (jax.ShapeDtypeStruct((b, h, sq), jnp.float32),)
    return ()


def fp8_descale_operand(q_descale, k_descale, v_descale) -> jax.Array:
    """The FP8 forward kernels' descale operand, (B, Hkv, 2) float32 from three (B, Hkv)
    descales (varlen: one row per sequence): q·k's (folded into the softmax scale) and v's
    (into each row's 1/Σ)."""
    return jnp.stack([q_descale * k_descale, v_descale], axis=-1).astype(jnp.float32)


def paged_tiles(k_cache, v_cache, page_table, tile_n: int) -> tuple:
    """(k_tiles, v_tiles, table) of the paged kernels: the cache (num_pages, page_size, Hkv, ·)
    as one batch entry (1, num_pages·page_size, Hkv, ·) of tile_n-key tiles (a free reshape),
    and the page table (B, max_pages) as the cache tile of each key block (B, max_pages·
    page_size / tile_n): a page is page_size / tile_n consecutive tiles."""
    num_pages, page_size, hkv, d = k_cache.shape
    per_page = page_size // tile_n
    k_tiles = k_cache.reshape(1, num_pages * page_size, hkv, d)
    v_tiles = v_cache.reshape(1, num_pages * page_size, hkv, v_cache.shape[3])
    table = page_table
    if per_page > 1:
        table = (page_table[:, :, None] * per_page
                 + jnp.arange(per_page, dtype=jnp.int32)).reshape(page_table.shape[0], -1)
    return k_tiles, v_tiles, table


def packed_lse(lse_pad: jax.Array, cu_seqlens_q: jax.Array, total_q: int) -> jax.Array:
    """The varlen kernels' lse (batch, H, max_seqlen_q) gathered to the packed layout
    (1, H, total_q); -inf for the tokens outside every sequence."""
    max_q = lse_pad.shape[2]
    t, seq, valid, start, _ = token_layout(cu_seqlens_q, total_q)
    lse = lse_pad[seq, :, jnp.clip(t - start, 0, max_q - 1)].T  # (H, total_q)
    return jnp.where(valid, lse, -jnp.inf)[None]  # (the kernel wrote 0 to padding tokens' out)


def dense_sq_pad(cfg, sq: int) -> int:
    """Sq rounded up to a dense backward main config's tile_m: the query rows its dQ
    accumulator and row statistics cover (every family's rule)."""
    return -(-sq // cfg.tile_m) * cfg.tile_m


def dense_dq_accum_shape(cfg, q) -> tuple[int, int, int]:
    """(B, H, Sq_pad·D) of a dense backward main kernel's float32 dQ accumulator for q
    (B, Sq, H, D) (:func:`dense_sq_pad`)."""
    b, sq, h, d = q.shape
    return (b, h, dense_sq_pad(cfg, sq) * d)


def sum_gqa_groups(dk, dv, hkv: int, head_axis: int):
    """Per-query-head float32 dK / dV summed over each group of H/Hkv heads (``head_axis``: the
    heads' axis; a fixed-order XLA reduction, so deterministic)."""
    h = dk.shape[head_axis]

    def fold(x):
        shape = (*x.shape[:head_axis], hkv, h // hkv, *x.shape[head_axis + 1:])
        return x.reshape(shape).sum(axis=head_axis + 1)

    return fold(dk), fold(dv)


class KernelBackend(Backend):
    """A GPU family's kernels behind the :class:`~jax_fa4.backends.base.Backend` interface.

    Subclasses set ``name``, ``arch``, ``compute_capability`` (and the other class attributes of
    :class:`Backend` that apply) and implement the ``make_*`` hooks and :meth:`backward`.
    """

    #: The compile target of the kernels (``"sm_90a"``).
    arch: str = ""
    #: The paged kernel clamps ``seqused_k`` to its page-table row's keys itself (so an unsplit
    #: call passes it as it is).
    paged_clamps_seqused: bool = False
    #: The forward kernels take learnable sinks in their params and have float32-out decode and
    #: paged configs (module doc); else sinks join the 16-bit out afterwards.
    kernel_sinks: bool = False
    #: The backward kernels compute the sink's share of the float32 output's rowsum themselves
    #: (``backward_with_sink``); else the sink's gradient comes from delta (the 16-bit output).
    kernel_sink_grad: bool = False

    # -- hooks: the config of a problem kind (raise ValueError when no kernel serves it) ---------
    def make_forward(self, dtype: str, head_dim: int, head_dim_v: int, mask: str,
                     has_softcap: bool, max_logits: bool = False):
        """The dense forward config; ``max_logits``: one that also writes each row's max
        logit."""
        raise NotImplementedError

    def make_decode(self, dtype: str, head_dim: int, head_dim_v: int, has_softcap: bool,
                    rows: int, out_f32: bool = False):
        """The forward config for a rewritten decode call of ``rows`` packed query rows
        (unmasked; q and out head-major if its ``qo_head_major``), None for the training tile;
        ``out_f32`` (only asked of ``kernel_sinks`` families): a float32-out config."""
        return None

    def make_varlen(self, dtype: str, head_dim: int, head_dim_v: int, mask: str,
                    has_softcap: bool):
        raise ValueError(f"there is no varlen kernel for implementation={self.name!r}")

    def make_paged(self, dtype: str, head_dim: int, head_dim_v: int, mask: str,
                   has_softcap: bool):
        raise ValueError(f"there is no paged kernel for implementation={self.name!r}")

    def make_segments(self, dtype: str, head_dim: int, head_dim_v: int, mask: str,
                      has_softcap: bool, max_logits: bool = False):
        """The forward config with segment ids (jax_fa4.segments' tables); ``max_logits`` as
        in :meth:`make_forward`."""
        raise ValueError(f"there is no {self.name} kernel with segment ids yet")

    def backward_configs(self, q, k, v, opts) -> tuple:
        """(main config, postprocess config or None) of the dense backward; raises ValueError if
        unsupported."""
        raise ValueError(f"no backward kernel is enabled for implementation={self.name!r}")

    def make_varlen_backward(self, dtype: str, head_dim: int, head_dim_v: int, mask: str,
                             has_softcap: bool, gqa: bool):
        raise ValueError(f"there is no varlen backward kernel for implementation={self.name!r}")

    # -- dense forward ---------------------------------------------------------------------------
    def forward_config(self, q, k, v, opts):
        """The forward kernel config serving this call, or the reason none does (a str)."""
        if getattr(opts, "max_logits", False) and decode.plan(q.shape, k.shape,
                                                              opts.window) is not None:
            return ("max logits are not written by the decode-shaped kernels (few query rows "
                    "per key)")
        return _dense_config(self.make_forward, q, v, opts)

    def supports_forward(self, q, k, v, opts) -> str | None:
        config = self.forward_config(q, k, v, opts)
        return config if isinstance(config, str) else None

    def forward(self, q, k, v, opts, sink: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
        """The forward kernel, with the learnable ``sink`` (H,) joined (module doc);
        decode-shaped calls run it on GQA-packed, split-KV inputs
        (:mod:`jax_fa4.backends.decode`)."""
        plan = decode.plan(q.shape, k.shape, opts.window)
        if plan is not None:
            out, lse = decode.run(q, k, v, opts, plan, functools.partial(
                self._decode_forward, out_f32=self.rewritten_out_f32(plan.splits, sink)))
            return join_sink(out, lse, sink, dtype=q.dtype)
        if self.kernel_sinks:
            return self.kernel_forward(q, k, v, opts, sink=sink)
        return join_sink_outs(self.kernel_forward(q, k, v, opts), sink)

    def rewritten_out_f32(self, splits: int, sink: jax.Array | None) -> bool:
        """Whether a decode-rewritten or paged call takes the kernel's out in float32: split
        chunks merge in float32 (``decode.SPLIT_PARTIALS_F32``) and a sink joins in float32,
        both rounded once; only ``kernel_sinks`` families have float32-out tiles."""
        return self.kernel_sinks and ((splits > 1 and decode.SPLIT_PARTIALS_F32)
                                      or sink is not None)

    def kernel_forward(self, q, k, v, opts, config=None, sink: jax.Array | None = None
                       ) -> tuple[jax.Array, jax.Array]:
        """(out, lse) by the forward kernel (``config``: :meth:`forward_config`'s, which must
        serve; ``sink``: the learnable sink of each query head, ``kernel_sinks`` families).
        q and out are (B, S, H, ·), or (B, H, S, ·) for a head-major config (the decode tiles);
        out is float32 for an ``out_f32`` config."""
        config = self.forward_config(q, k, v, opts) if config is None else config
        assert not isinstance(config, str), config
        if getattr(config, "qo_head_major", False):
            b, h, sq, _ = q.shape
            out_shape = (b, h, sq, v.shape[3])
        else:
            b, sq, h, _ = q.shape
            out_shape = (b, sq, h, v.shape[3])
        out_dtype = jnp.float32 if getattr(config, "out_f32", False) else q.dtype
        return self.call_forward(
            config, q, k, v, kernel_params(opts, q.shape[3], sink),
            out_shapes=(jax.ShapeDtypeStruct(out_shape, out_dtype),
                        jax.ShapeDtypeStruct((b, h, sq), jnp.float32),
                        *_with_row_max(config, b, h, sq)))

    def call_forward(self, config, *inputs: jax.Array,
                     out_shapes: tuple[jax.ShapeDtypeStruct, ...]) -> list[jax.Array]:
        """The dense forward kernel's call: ``call_kernel`` on the signature's inputs and
        outputs (a family whose configs take more operands, e.g. Hopper's tile counter, adds
        them here)."""
        from jax_fa4.ffi.call import call_kernel

        return call_kernel(config, self.arch, *inputs, out_shapes=out_shapes)

    def _decode_forward(self, qp, k, v, opts, out_f32: bool = False
                        ) -> tuple[jax.Array, jax.Array]:
        """The forward kernel on a rewritten decode call (unmasked; qp, out head-major as
        decode.run passes and takes them): the family's decode tile (:meth:`make_decode`) when
        it has one for these rows, else the training tile on transposed q and out. ``out_f32``:
        out in float32 (the decode tile serves every row count then)."""
        config = self.make_decode(jnp.dtype(qp.dtype).name, qp.shape[3], v.shape[3],
                                  opts.softcap > 0, qp.shape[2], out_f32=out_f32)
        if config is not None and config.qo_head_major:
            return self.kernel_forward(qp, k, v, opts, config)
        out, lse = self.kernel_forward(qp.transpose(0, 2, 1, 3), k, v, opts, config)
        return out.transpose(0, 2, 1, 3), lse

    # -- backward --------------------------------------------------------------------------------
    def supports_preprocess(self, out) -> str | None:
        dtype, dv = jnp.dtype(out.dtype).name, out.shape[-1]
        if dtype in KERNEL_DTYPES and dv % 8 == 0 and dv <= 512:
            return None
        return (f"dtype {dtype}, head_dim_v {dv} (the kernel takes bfloat16 / float16 and a "
                "multiple of 8 up to 512)")

    def backward_preprocess(self, out, dout, lse) -> tuple[jax.Array, jax.Array]:
        """The preprocess kernel (the same for every family)."""
        delta, lse_log2 = self._preprocess_kernel(out, dout, lse)
        return delta, lse_log2

    def backward_preprocess_with_accum(self, out, dout, lse, dq_accum_shape: tuple[int, ...]
                                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The preprocess kernel that also returns the dQ accumulator of ``dq_accum_shape``
        zero-filled (``PreprocessConfig.zero_dq_accum``)."""
        return self._preprocess_kernel(out, dout, lse, dq_accum_shape)

    def _preprocess_kernel(self, out, dout, lse, dq_accum_shape: tuple[int, ...] | None = None
                           ) -> list[jax.Array]:
        from jax_fa4.ffi.call import call_kernel

        b, sq, h, dv = out.shape
        rows = jax.ShapeDtypeStruct((b, h, sq), jnp.float32)
        zero = dq_accum_shape is not None
        accum = (jax.ShapeDtypeStruct(dq_accum_shape, jnp.float32),) if zero else ()
        return call_kernel(PreprocessConfig(jnp.dtype(out.dtype).name, dv, zero), self.arch,
                           out, dout, lse, out_shapes=(rows, rows, *accum))

    def supports_backward(self, q, k, v, opts) -> str | None:
        if not (q.dtype == k.dtype == v.dtype):
            return "q, k, v dtypes differ"
        try:
            self.backward_configs(q, k, v, opts)
        except ValueError as e:
            return str(e)
        return None

    def backward(self, q, k, v, out, lse, dout, delta, lse_log2, opts, dq_accum=None):
        raise NotImplementedError(f"{type(self).__name__} has no backward kernel chain")

    def backward_with_sink(self, q, k, v, out, lse, dout, delta, lse_log2, opts, sink,
                           dq_accum=None):
        """The backward, and ``sink_rows`` where the family's kernel computes them
        (``kernel_sink_grad``; else None, base.Backend's rule)."""
        if not self.kernel_sink_grad:
            return super().backward_with_sink(q, k, v, out, lse, dout, delta, lse_log2, opts,
                                              sink, dq_accum)
        return self.backward(q, k, v, out, lse, dout, delta, lse_log2, opts, sink=sink,
                             with_sink_rows=True, dq_accum=dq_accum)

    def backward_main(self, cfg, q, k, v, dout, delta, lse_log2, params, sq_pad: int,
                      semaphores: int, extra_inputs: tuple = (),
                      dq_accum: jax.Array | None = None):
        """The dense backward's main kernel (the same contract on every family): returns
        dq_accum (B, H, sq_pad·D) float32 (zeros in: the preprocess's ``dq_accum`` where it
        has that shape, else an XLA fill; updated in place through an input/output alias)
        and dk, dv per kv head (GQA configs: float32 per *query* head from the kernel,
        summed over each group here). Deterministic configs also take ``semaphores`` int32
        zero counters per (B, H): the ordering of the key blocks' dQ adds. A ``sink_grad``
        config (params then carry the sinks) also returns its sink_part summed over the key
        blocks, (B, H) float32; else None. ``extra_inputs`` follow the others (the segment-id
        tables of a ``segments`` config)."""
        from jax_fa4.ffi.call import call_kernel

        b, sq, h, d = q.shape
        sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
        if dq_accum is None or dq_accum.shape != (b, h, sq_pad * d):
            dq_accum = jnp.zeros((b, h, sq_pad * d), jnp.float32)
        lse_log2, delta = lse_log2.astype(jnp.float32), delta.astype(jnp.float32)
        if getattr(cfg, "stats_padded", False) and sq_pad > lse_log2.shape[-1]:
            # the config reads Sq_pad rows: +inf / 0 past Sq (P = dS = 0 there)
            pad = ((0, 0), (0, 0), (0, sq_pad - lse_log2.shape[-1]))
            lse_log2 = jnp.pad(lse_log2, pad, constant_values=jnp.inf)
            delta = jnp.pad(delta, pad)
        hdk = h if cfg.gqa else hkv
        dkv_dtype = jnp.float32 if cfg.gqa else q.dtype
        inputs = [q, k, v, dout, lse_log2, delta, params, dq_accum]
        out_shapes = [jax.ShapeDtypeStruct(dq_accum.shape, jnp.float32),
                      jax.ShapeDtypeStruct((b, sk, hdk, d), dkv_dtype),
                      jax.ShapeDtypeStruct((b, sk, hdk, dv), dkv_dtype)]
        if cfg.deterministic:
            sem = jnp.zeros((b, h, semaphores), jnp.int32)
            inputs.append(sem)
            out_shapes.append(jax.ShapeDtypeStruct(sem.shape, jnp.int32))
        inputs += list(extra_inputs)
        sink_grad = getattr(cfg, "sink_grad", False)
        if sink_grad:  # one entry per CTA: (B, H, key blocks)
            out_shapes.append(jax.ShapeDtypeStruct((b, h, -(-sk // cfg.tile_n)), jnp.float32))
        outs = call_kernel(cfg, self.arch, *inputs, out_shapes=tuple(out_shapes))
        dq_accum, dk, dvv = outs[:3]
        if cfg.gqa:
            dk, dvv = sum_gqa_groups(dk, dvv, hkv, head_axis=2)
        return dq_accum, dk, dvv, (outs[-1].sum(axis=-1) if sink_grad else None)

    def supports_extras(self, what: str) -> str | None:
        return (f"there is no {self.name} kernel for {what} yet (implementation=None or "
                "'reference' runs the pure-JAX reference)")

    # -- segment ids -----------------------------------------------------------------------------
    def segments_config(self, q, k, v, opts):
        """The forward kernel config with segment ids serving this call, or the reason none
        does (a str)."""
        return _dense_config(self.make_segments, q, v, opts)

    def supports_segments(self, q, k, v, opts) -> str | None:
        config = self.segments_config(q, k, v, opts)
        return config if isinstance(config, str) else None

    def make_segments_backward(self, dtype, head_dim, head_dim_v, mask, has_softcap, gqa,
                               **extra):
        """The family's backward config with segment ids for a problem kind (``extra``:
        ``sink_grad=True`` for a ``kernel_sink_grad`` family's sink call); raises ValueError
        where none serves."""
        raise ValueError(f"there is no {self.name} backward kernel with segment ids yet")

    def segments_backward_config(self, q, k, v, opts, sink_grad: bool = False):
        """The backward config with segment ids for this call (:meth:`make_segments_backward`),
        or the reason none serves it (a str); deterministic calls are declined (the segment-id
        kernels add dQ in no fixed order)."""
        kind = backward_kind(q, k, v, opts)
        deterministic = kind.pop("deterministic")
        extra = dict(sink_grad=True) if sink_grad else {}
        config = _config_or_reason(self.make_segments_backward, **kind, **extra)
        if deterministic and not isinstance(config, str):
            return (f"the {self.name} backward kernel with segment ids adds dQ in no fixed order "
                    "(deterministic=True runs the reference's backward)")
        return config

    def supports_segments_backward(self, q, k, v, opts) -> str | None:
        """None when a backward kernel takes this call's segment ids
        (:meth:`segments_backward`), else why not (the reference's backward then runs)."""
        config = self.segments_backward_config(q, k, v, opts)
        return config if isinstance(config, str) else None

    def segments_backward(self, q, k, v, out, lse, dout, dlse, q_ids, kv_ids, opts,
                          sink: jax.Array | None = None):
        """(dq, dk, dv, sink_rows) of a call with segment ids, by the family's kernels;
        ``sink_rows`` (B, H) float32 (with a sink, else None): ``sum_i P_sink_i *
        rowsum(dout * out)_i``, the output's share of the sink's gradient."""
        raise NotImplementedError

    def segments_forward(self, q, k, v, q_ids, kv_ids, opts, sink: jax.Array | None = None
                         ) -> tuple[jax.Array, jax.Array]:
        """(out, lse) of the forward kernel with segment ids ``q_ids`` (B, Sq) / ``kv_ids``
        (B, Sk) (:mod:`jax_fa4.segments`' tables; key blocks sharing no id with a query tile
        are skipped) and the learnable ``sink`` (H,) joined (in the kernel's softmax for
        ``kernel_sinks`` families)."""
        from jax_fa4 import segments

        config = self.segments_config(q, k, v, opts)
        assert not isinstance(config, str), config
        tiles, rows, kv_ids = segments.forward_tables(q_ids, kv_ids, config.tile_m,
                                                      config.tile_n)
        b, sq, h, _ = q.shape
        in_kernel = sink if self.kernel_sinks else None
        outs = self.call_forward(
            config, q, k, v, kernel_params(opts, q.shape[3], in_kernel), tiles,
            rows, kv_ids,
            out_shapes=(jax.ShapeDtypeStruct((b, sq, h, v.shape[3]), q.dtype),
                        jax.ShapeDtypeStruct((b, h, sq), jnp.float32),
                        *_with_row_max(config, b, h, sq)))
        return tuple(outs) if self.kernel_sinks else join_sink_outs(tuple(outs), sink)

    # -- FP8 (forward only) ----------------------------------------------------------------------
    def make_fp8(self, head_dim: int, head_dim_v: int, mask: str, has_softcap: bool):
        """The family's FP8 forward config (raises ValueError where it has none)."""
        raise ValueError(f"there is no {self.name} FP8 forward kernel")

    def fp8_plan(self, q, k, v, opts):
        """The FP8 forward kernel config serving this call, or the reason none does (a str)."""
        if jnp.dtype(q.dtype) != jnp.dtype(jnp.float8_e4m3fn):
            return f"the FP8 kernels take float8_e4m3fn, got {q.dtype}"
        return _config_or_reason(self.make_fp8, q.shape[3], v.shape[3], mask_kind(opts.window),
                                 opts.softcap > 0)

    def make_fp8_decode(self, head_dim: int, head_dim_v: int, has_softcap: bool,
                        out_f32: bool = False):
        """The family's FP8 forward config for a rewritten decode call (unmasked, q and out
        head-major; ``out_f32`` as in :meth:`make_decode`), or None where it has none (the
        call then runs as it is on :meth:`make_fp8`'s)."""
        return None

    def fp8_forward(self, q, k, v, q_descale, k_descale, v_descale, opts, plan):
        """The FP8 forward kernel: q, k, v as given (the kernel transposes V in shared
        memory), q·k's and v's descales as one (B, Hkv, 2) float32 operand; out bfloat16.
        Decode-shaped calls run the family's FP8 decode tile (:meth:`make_fp8_decode`) on
        GQA-packed, split-KV inputs (:mod:`jax_fa4.backends.decode`), each chunk with its
        batch entry's descales."""
        from jax_fa4.ffi.call import call_kernel

        descale = fp8_descale_operand(q_descale, k_descale, v_descale)
        d, dv = q.shape[3], v.shape[3]
        rewrite = decode.plan(q.shape, k.shape, opts.window)
        config = None if rewrite is None else self.make_fp8_decode(
            d, dv, opts.softcap > 0, out_f32=self.rewritten_out_f32(rewrite.splits, None))
        if config is not None:
            chunks = jnp.repeat(descale, rewrite.splits, axis=0)  # entry b·S + s: b's
            out_dtype = jnp.float32 if config.out_f32 else jnp.bfloat16

            def on_decode(qp, kc, vc, kernel_opts):
                b, h, rows, _ = qp.shape
                return call_kernel(
                    config, self.arch, qp, kc, vc, kernel_params(kernel_opts, d), chunks,
                    out_shapes=(jax.ShapeDtypeStruct((b, h, rows, dv), out_dtype),
                                jax.ShapeDtypeStruct((b, h, rows), jnp.float32)))

            out, lse = decode.run(q, k, v, opts, rewrite, on_decode)
            return out.astype(jnp.bfloat16), lse
        b, sq, h, _ = q.shape
        out, lse = call_kernel(
            plan, self.arch, q, k, v, kernel_params(opts, d), descale,
            out_shapes=(jax.ShapeDtypeStruct((b, sq, h, dv), jnp.bfloat16),
                        jax.ShapeDtypeStruct((b, h, sq), jnp.float32)))
        return out, lse

    def make_fp8_paged(self, head_dim: int, head_dim_v: int, mask: str, has_softcap: bool):
        """The family's FP8 paged forward config (raises ValueError where it has none)."""
        raise ValueError(f"there is no {self.name} FP8 paged forward kernel")

    def make_fp8_varlen(self, head_dim: int, head_dim_v: int, mask: str, has_softcap: bool):
        """The family's FP8 varlen forward config (raises ValueError where it has none)."""
        raise ValueError(f"there is no {self.name} FP8 varlen forward kernel")

    def fp8_paged_plan(self, q, k_cache, v_cache, page_table, opts) -> Hashable | str:
        """The FP8 paged forward kernel config serving this call (e4m3 q and cache), or the
        reason none does (a str)."""
        window = decode.kernel_window(q.shape[1], opts.window)  # as paged_plan's
        return _fitting_pages(_config_or_reason(self.make_fp8_paged, q.shape[3],
                                                v_cache.shape[3], mask_kind(window),
                                                opts.softcap > 0), k_cache, "FP8 paged")

    def fp8_paged_forward(self, q, k_cache, v_cache, page_table, seqused_k, q_descale,
                          k_descale, v_descale, opts, plan):
        """The FP8 paged forward kernel, with decode steps rewritten around it as the 16-bit
        one's are (:meth:`paged_forward`: GQA heads packed into a tile's rows, the page table
        split into chunks merged in float32): q's (B, Hkv) descale and the cache's (Hkv,) ones
        (broadcast over the batch) as the (B, Hkv, 2) operand, repeated for each chunk; out
        bfloat16, rounded once."""
        # the cache's (Hkv,) descales, the same in every batch row
        k_descale, v_descale = (jnp.broadcast_to(x, q_descale.shape) for x in (k_descale,
                                                                               v_descale))
        out, lse = self._paged_rewritten(
            plan, q, k_cache, v_cache, page_table, seqused_k, opts, sink=None,
            out_dtype=jnp.bfloat16,
            descale=fp8_descale_operand(q_descale, k_descale, v_descale))
        return out.astype(jnp.bfloat16), lse

    def fp8_varlen_plan(self, q, k, v, opts, max_seqlen_q: int, max_seqlen_k: int
                        ) -> Hashable | str:
        """(config, max_seqlen_q, max_seqlen_k) of the FP8 varlen forward kernel serving this
        call (packed e4m3 q, k, v), or the reason none does (a str)."""
        if max_seqlen_q == 0:
            return "max_seqlen_q is 0 (no query rows to launch)"
        config = _config_or_reason(self.make_fp8_varlen, q.shape[2], v.shape[2],
                                   mask_kind(opts.window), opts.softcap > 0)
        return config if isinstance(config, str) else (config, max_seqlen_q, max_seqlen_k)

    def fp8_varlen_forward(self, q, k, v, segments, cu_seqlens_q, cu_seqlens_k, q_descale,
                           k_descale, v_descale, opts, plan):
        """The FP8 varlen forward kernel: (out (1, total_q, H, Dv) bfloat16, lse (1, H,
        total_q)), the (num_sequences, Hkv) descales as one (num_sequences, Hkv, 2) operand;
        tokens outside every sequence: out 0 (written by the kernel), lse -inf."""
        from jax_fa4.ffi.call import call_kernel

        del segments
        config, max_q = plan[:2]
        total_q, h, d = q.shape
        out, lse_pad = call_kernel(
            config, self.arch, q[None], k[None], v[None], kernel_params(opts, d),
            cu_seqlens_q, cu_seqlens_k, fp8_descale_operand(q_descale, k_descale, v_descale),
            out_shapes=(jax.ShapeDtypeStruct((1, total_q, h, v.shape[2]), jnp.bfloat16),
                        jax.ShapeDtypeStruct((cu_seqlens_q.shape[0] - 1, h, max_q),
                                             jnp.float32)))
        return out, packed_lse(lse_pad, cu_seqlens_q, total_q)

    # -- varlen ----------------------------------------------------------------------------------
    def varlen_config(self, q, v, opts, max_seqlen_q: int):
        """The varlen forward kernel config serving this call (q (total_q, H, D), v (total_k,
        Hkv, Dv)), or the reason none does (a str)."""
        dtype = jnp.dtype(q.dtype).name
        if dtype not in KERNEL_DTYPES:
            return f"the kernels take bfloat16 or float16 inputs, got {dtype}"
        if max_seqlen_q == 0:
            return "max_seqlen_q is 0 (no query rows to launch)"
        return _config_or_reason(self.make_varlen, dtype, q.shape[2], v.shape[2],
                                 mask_kind(opts.window), opts.softcap > 0)

    def varlen_plan(self, q, k, v, opts, max_seqlen_q: int, max_seqlen_k: int
                    ) -> Hashable | str:
        """(config, max_seqlen_q, max_seqlen_k, the backward's settings), or why not."""
        config = self.varlen_config(q, v, opts, max_seqlen_q)
        if isinstance(config, str):
            return config
        return (config, max_seqlen_q, max_seqlen_k, self.varlen_backward_settings())

    def varlen_backward_settings(self) -> Hashable:
        """What the varlen backward reads from the environment (read outside the jit, so that
        it keys the jitted call's cache)."""
        return None

    def varlen_forward(self, q, k, v, sink, segments, cu_seqlens_q, cu_seqlens_k, opts, plan):
        """The varlen forward kernel: one CTA per (query tile, head, sequence) of the longest
        sequence's grid; its lse comes back as (batch, H, max_seqlen_q) and is gathered to the
        packed layout. Tokens outside every sequence: out 0 (written by the kernel), lse -inf."""
        from jax_fa4.ffi.call import call_kernel

        config, max_q = plan[:2]
        total_q, h, d = q.shape
        batch = cu_seqlens_q.shape[0] - 1
        in_kernel = sink if self.kernel_sinks else None
        out, lse_pad = call_kernel(
            config, self.arch, q[None], k[None], v[None], kernel_params(opts, d, in_kernel),
            cu_seqlens_q, cu_seqlens_k,
            out_shapes=(jax.ShapeDtypeStruct((1, total_q, h, v.shape[2]), q.dtype),
                        jax.ShapeDtypeStruct((batch, h, max_q), jnp.float32)))
        lse = packed_lse(lse_pad, cu_seqlens_q, total_q)
        if self.kernel_sinks:
            return out, lse
        return join_sink(out, lse, sink)

    def varlen_backward_config(self, q, k, v, opts, sink_grad: bool = False):
        """The varlen backward kernel config serving this call (q (total_q, H, D), k (total_k,
        Hkv, D), v (total_k, Hkv, Dv)), or the reason none does (a str). ``sink_grad``: the
        config summing the sink's share (``kernel_sink_grad`` families only)."""
        dtype = jnp.dtype(q.dtype).name
        if dtype not in KERNEL_DTYPES or not (q.dtype == k.dtype == v.dtype):
            return f"the kernels take bfloat16 or float16 inputs of one dtype, got {dtype}"
        extra = dict(sink_grad=True) if sink_grad else {}
        return _config_or_reason(self.make_varlen_backward, dtype, q.shape[2], v.shape[2],
                                 mask_kind(opts.window), opts.softcap > 0,
                                 gqa=q.shape[1] != k.shape[1], **extra)

    def supports_varlen_backward(self, q, k, v, opts) -> str | None:
        config = self.varlen_backward_config(q, k, v, opts)
        return config if isinstance(config, str) else None

    # -- paged KV ---------------------------------------------------------------------------------
    def paged_plan(self, q, k_cache, v_cache, page_table, opts) -> Hashable | str:
        """The paged forward kernel config serving this call, or the reason none does (a str)."""
        dtype = jnp.dtype(q.dtype).name
        if dtype not in KERNEL_DTYPES:
            return f"the kernels take bfloat16 or float16 inputs, got {dtype}"
        # the mask of the rewritten call (paged_forward packs a decode step's GQA heads)
        window = decode.kernel_window(q.shape[1], opts.window)
        return _fitting_pages(_config_or_reason(self.make_paged, dtype, q.shape[3],
                                                v_cache.shape[3], mask_kind(window),
                                                opts.softcap > 0), k_cache, "paged")

    def paged_forward(self, q, k_cache, v_cache, page_table, seqused_k, sink, opts, plan):
        """The paged forward kernel: each key block of a batch entry is one TMA load of the
        cache tile its page table entry names, and the kernel stops at ``seqused_k[b]``. Decode
        steps are rewritten around it as dense decode is (:mod:`jax_fa4.backends.decode`): the
        ``g`` query heads of a kv head packed into one tile's rows and, when the tiles would not
        fill the GPU, the page table split into chunks (one batch entry each, with its own
        ``seqused_k``) merged by their lse. The sink joins afterwards in float32 (``kernel_sinks``
        families: on the kernel's float32 out, so the output is rounded once)."""
        out, lse = self._paged_rewritten(plan, q, k_cache, v_cache, page_table, seqused_k,
                                         opts, sink, out_dtype=q.dtype)
        return join_sink(out, lse, sink, dtype=q.dtype)

    def _paged_rewritten(self, config, q, k_cache, v_cache, page_table, seqused_k, opts, sink,
                         out_dtype, descale: jax.Array | None = None):
        """(out, lse) of a paged kernel ``config`` on the call, decode-rewritten
        (:meth:`paged_forward`); ``descale`` (B, Hkv, 2): the FP8 kernels' operand, repeated
        for each chunk. out is the kernel's ``out_dtype``, or float32 where split chunks merge
        or a sink joins (:meth:`rewritten_out_f32`)."""
        from jax_fa4.ffi.call import call_kernel

        b, sq, h, d = q.shape
        hkv, dv = k_cache.shape[2], v_cache.shape[3]
        tile_n = config.tile_n
        k_tiles, v_tiles, table = paged_tiles(k_cache, v_cache, page_table, tile_n)
        blocks = table.shape[1]
        plan = decode.plan(q.shape, (b, blocks * tile_n, hkv, d), opts.window, key_block=tile_n)
        if plan is None:
            plan = decode.DecodePlan(group=1, splits=1,
                                     window=decode.kernel_window(sq, opts.window))
        s = plan.splits
        chunk = blocks // s * tile_n  # keys per chunk
        if self.rewritten_out_f32(s, sink):
            config = dataclasses.replace(config, out_f32=True)
        if getattr(config, "out_f32", False):
            out_dtype = jnp.float32
        # chunk c of batch entry i is entry i·S + c: its descales are entry i's
        extra = () if descale is None else (jnp.repeat(descale, s, axis=0),)

        def on_packed(qp, kernel_opts):
            # chunk c of batch entry i: table columns [c·blocks/S, (c+1)·blocks/S), its keys
            # clipped (unless the kernel clamps an unsplit call's seqused_k itself)
            used = seqused_k if s == 1 and self.paged_clamps_seqused else jnp.clip(
                seqused_k[:, None] - jnp.arange(s, dtype=jnp.int32) * chunk, 0, chunk)
            head_major = getattr(config, "qo_head_major", False)  # else (B, S, H, D)
            heads, rows = qp.shape[1], qp.shape[2]
            out_shape = (b * s, heads, rows, dv) if head_major else (b * s, rows, heads, dv)
            out, lse = call_kernel(
                config, self.arch,
                qp if head_major else qp.transpose(0, 2, 1, 3), k_tiles, v_tiles,
                kernel_params(kernel_opts, d), table.reshape(b * s, blocks // s),
                used.reshape(b * s).astype(jnp.int32), *extra,
                out_shapes=(jax.ShapeDtypeStruct(out_shape, out_dtype),
                            jax.ShapeDtypeStruct((b * s, heads, rows), jnp.float32)))
            return (out if head_major else out.transpose(0, 2, 1, 3)), lse

        return decode.rewrite(q, opts, plan, on_packed)
