"""Compile key of the Hopper (sm_90a) forward attention kernel and the configs of each problem kind
(the tuning tables themselves live in fwd_tuning.py, outside every kernel's cache key).

Importable without the compiler: nothing here imports ``cutlass`` at module level.

The kernel computes, per (batch b, query head h), with kv head h // (H // Hkv):
    out[b, :, h] = softmax(mask(transform(q·kᵀ))) · v,    lse[b, h, :] = logsumexp of the row
where transform is ``scale·s`` or ``softcap·tanh(s·scale/softcap)``, and mask is the key-length
tail plus "causal" (bottom-right aligned) or "local" (window_left, window_right; -1 = unbounded).
Rows with no visible key give out = 0, lse = -inf. A learnable sink σ_h (params of length
4 + H) joins every row's denominator inside the softmax: out = Σ_j e^{s_j}·v_j / (e^{σ_h} + Σ_j
e^{s_j}), lse = log(e^{σ_h} + Σ_j e^{s_j}) (rows with no visible key: out 0, lse σ_h).

Call: ``fn(stream, q, k, v, params, out, lse)`` with
    q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), params float32 (4,) or (4 + H,) =
    [softmax_scale, softcap (0 = off), window_left, window_right, (sink of each query head)],
    out (B, Sq, H, Dv) (q's dtype; float32 when out_f32), lse (B, H, Sq) float32. B, S, H
    dynamic; D, Dv fixed by the config. Head-major configs (qo_head_major: the decode tiles)
    take q (B, H, Sq, D) and give out (B, H, Sq, Dv).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import ClassVar

from jax_fa4.kernels.forward_signatures_config import (segments_attention_forward_signature,
                                                       with_max_logits)
# the tables choose configs (whose fields are the key): not part of any kernel's key
from jax_fa4.kernels.sm90.fwd_tuning import (FP8_SOFTCAP_TILE_N, FP8_TUNING_TABLE, TUNING_TABLE,
                                             tuning_for)
from jax_fa4.kernels.spec import (FLOAT_DTYPES, SMEM_BUDGET_BYTES, KernelConfig,
                                  KernelSignature, TensorArg, attention_forward_signature,
                                  check_dtype_and_mask,
                                  paged_attention_forward_signature,
                                  varlen_attention_forward_signature)


#: Shared memory of one sm_90 SM, shared by its resident CTAs (each also reserves 1 KB).
SMEM_PER_SM_BYTES = 228 * 1024


#: The FP8 forward's dtype: e4m3 q, k, v; bfloat16 out (FP8_TUNING_TABLE gives its tiles).
FP8_DTYPE = "float8_e4m3fn"


@dataclass(frozen=True)
class FwdConfig(KernelConfig):
    """Compile key of the sm90 forward kernel: everything that changes the generated code."""

    kernel_name: ClassVar[str] = "sm90_fwd"

    dtype: str = "bfloat16"
    head_dim: int = 128
    head_dim_v: int = 128
    mask: str = "none"  # "none" | "causal" | "local"
    has_softcap: bool = False
    # Tuning (derived from TUNING_TABLE by `FwdConfig.make`; part of the key because it changes
    # code).
    tile_m: int = 128  # 64 rows per consumer warpgroup: 128 = 2 warpgroups, 192 = 3
    tile_n: int = 128
    stages: int = 2
    intra_wg_overlap: bool = True
    # Ping-pong between the consumer warpgroups: named barriers make the warpgroups issue their
    # GEMMs of a key block in turn (round-robin, 2- or 3-way), so one warpgroup's softmax runs
    # under the others' GEMMs. Needs intra_wg_overlap (only the overlapped mainloop is fenced).
    pingpong: bool = False
    # Conditional O rescaling (FA4): keep the stale row max unless it grew by more than this many
    # log2 units of the scaled scores (8.0 for 16-bit inputs); the O rescale is skipped for warps
    # where no row's max moved that much. 0.0 = rescale whenever the max grows (v1).
    rescale_threshold: float = 0.0
    # Persistent scheduling: 0 = one tile per CTA (grid = m_blocks × heads × batch, v1); N > 0 =
    # a grid of min(N, tiles) CTAs looping over tiles, heavy-first under causal/local masks, in
    # L2 sections of (batch, head) pairs (common/tile_scheduler.py). N is the GPU's SM count,
    # given here (never queried: compiling needs no GPU): 132 on H100/H200 SXM. Dense and
    # segment-id calls (each tile's key blocks clipped to its segment table's range).
    num_sms: int = 0
    # Exact conditional rescaling: the row max stays exact (rescale_threshold 0), but a warp
    # none of whose rows' max grew in a key block skips its O multiply (the factors are then
    # exactly 1.0). Implied by rescale_threshold > 0.
    rescale_skip: bool = False
    # Paged KV (called by jax_fa4/backends/kernel.py): K/V are a cache of tile_n-key tiles, key
    # block n of batch entry b is tile page_table[b, n], and b has seqused_k[b] keys
    # (spec.paged_attention_forward_signature).
    paged: bool = False
    # Varlen (called by jax_fa4/backends/kernel.py): q, k, v, out packed along one axis, sequence
    # boundaries from cu_seqlens (spec.varlen_attention_forward_signature).
    varlen: bool = False
    # CTAs resident per SM (1 or 2): 2 halves each CTA's registers (launch bound
    # ``min_blocks_per_mp``; one consumer warpgroup only) and must fit half the shared memory.
    # For the decode tile: two CTAs' K/V streams overlap each other's prologue and epilogue.
    ctas_per_sm: int = 1
    # q and out arrive head-major, (B, H, S, D), instead of (B, S, H, D) (lse is (B, H, S)
    # either way): the decode tiles' layout. backends/decode.py packs the g query heads of a kv
    # head as the rows of one tile; with one query token that packing is a free reshape of q and out
    # in this layout, and a transpose in the other.
    qo_head_major: bool = False
    # out is float32, written from the accumulator registers (no 16-bit rounding, no shared
    # memory staging): the split-KV chunks of jax_fa4/backends/decode.py, merged in float32, and
    # decode / paged calls whose learnable sink joins afterwards (one rounding of the output).
    out_f32: bool = False
    # Segment ids (called by jax_fa4/backends/kernel.py): query i sees key j only if their ids
    # are equal, from three tables the caller derives from the ids (jax_fa4/segments.py): each
    # query tile's key-block range and unmasked bulk, each row's key span [start, end) and id,
    # and the keys' ids (compared one by one only in tiles whose rows' ids are not contiguous
    # runs of the keys). Key blocks outside a tile's range are skipped, not masked
    # (segments_attention_forward_signature). One tile per CTA, or persistent (num_sms).
    segments: bool = False
    # Per-row max logits (QK-Clip / MuonClip): a float32 output (B, H, Sq) beside lse, each
    # row's largest score as the softmax sees it (q·k·scale; softcap·tanh(q·k·scale/softcap)
    # with a softcap), over the keys its masks and segments leave visible (-inf: none). A
    # running max kept apart from the softmax's (which starts at the sink and may stay stale
    # under conditional rescaling). Dense and segment-id calls only.
    max_logits: bool = False
    # Dynamic tile assignment on the persistent grid (needs num_sms > 0): each CTA starts with
    # the tile of its block index and then claims the next linear tile with one atomic add on a
    # zeroed int32 counter, an extra operand (input ``tile_counter``, aliased to the last
    # output; :func:`with_tile_counter`), so a CTA whose tiles ran short takes more of them.
    # The tile order is PersistentTileScheduler's (heaviest causal / local M blocks first);
    # every mask kind may take it. Dense and segment-id 16-bit calls without max logits only.
    dynamic_tiles: bool = False

    @classmethod
    def make(cls, dtype: str, head_dim: int, head_dim_v: int | None = None, mask: str = "none",
             has_softcap: bool = False, **overrides) -> FwdConfig:
        """The config for a problem kind, tuning taken from the table (``overrides`` replace table
        fields, for experiments and the no-overlap fallback). Raises ValueError if unsupported."""
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        fp8 = dtype == FP8_DTYPE
        t = tuning_for(head_dim, head_dim_v, mask, fp8)
        fields = dataclasses.asdict(t)  # the tuning's fields are FwdConfig's
        if fp8 and has_softcap:  # the softcap's own FP8 key block where the table names one
            fields["tile_n"] = FP8_SOFTCAP_TILE_N.get((head_dim, head_dim_v), t.tile_n)
        fields.update(overrides)
        cfg = cls(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, mask=mask,
                  has_softcap=bool(has_softcap), **fields)
        cfg.validate()
        return cfg

    # -- static checks ---------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first unsupported feature."""
        if self.dtype == FP8_DTYPE:
            self.validate_fp8()
        else:
            check_dtype_and_mask("sm90 forward", self.dtype, self.mask)
        tuning_for(self.head_dim, self.head_dim_v, self.mask, self.fp8)  # head dims in table
        if self.head_dim % 16 or self.head_dim_v % 16:
            raise ValueError("sm90 forward: head dims must be multiples of 16")
        if self.head_dim_v > self.head_dim:
            raise ValueError("sm90 forward: head_dim_v > head_dim not supported (O reuses Q's "
                             "shared memory)")
        if self.tile_m not in (64, 128, 192):
            raise ValueError(f"sm90 forward: tile_m {self.tile_m} not supported (64, 128 or 192)")
        if self.pingpong and self.tile_m == 64:
            raise ValueError("sm90 forward: pingpong needs two or three consumer warpgroups "
                             "(tile_m 128 or 192), not tile_m 64")
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            raise ValueError(f"sm90 forward: tile_n {self.tile_n} must be a multiple of 16 in "
                             "[16, 256]")
        if self.stages < 1:
            raise ValueError("sm90 forward: stages must be >= 1")
        if self.pingpong and not self.intra_wg_overlap:
            raise ValueError("sm90 forward: pingpong needs intra_wg_overlap (only the overlapped "
                             "mainloop is fenced by the ping-pong barriers)")
        if not (isinstance(self.rescale_threshold, (int, float)) and 0.0 <= self.rescale_threshold
                <= 16.0):
            raise ValueError(f"sm90 forward: rescale_threshold {self.rescale_threshold!r} must be "
                             "in [0, 16] (log2 units; 0 = always rescale)")
        if self.qo_head_major and self.varlen:
            raise ValueError("sm90 forward: varlen q and out are packed (1, total, H, D), not "
                             "head-major")
        if self.varlen and (self.paged or self.num_sms):
            raise ValueError("sm90 forward: varlen is not implemented with paged KV or persistent "
                             "scheduling")
        if self.out_f32 and (self.varlen or self.num_sms):
            raise ValueError("sm90 forward: a float32 out is implemented for one tile per CTA "
                             "and not varlen (num_sms must be 0, varlen False)")
        if self.segments and (self.paged or self.varlen or self.qo_head_major or self.out_f32):
            raise ValueError("sm90 forward: segment ids are implemented for dense calls (not "
                             "paged, varlen, head-major or with a float32 out)")
        if self.max_logits and (self.paged or self.varlen or self.qo_head_major
                                or self.out_f32):
            raise ValueError("sm90 forward: max logits are implemented for dense and segment-id "
                             "calls (not paged, varlen, head-major or with a float32 out)")
        if self.paged and self.num_sms:
            raise ValueError("sm90 forward: paged KV is not implemented with persistent scheduling "
                             "(num_sms must be 0)")
        if self.dynamic_tiles and not self.num_sms:
            raise ValueError("sm90 forward: dynamic_tiles assigns the tiles of a persistent grid "
                             "(num_sms must be the GPU's SM count, not 0)")
        if self.dynamic_tiles and self.max_logits:
            raise ValueError("sm90 forward: dynamic_tiles is implemented without max logits")
        if not (isinstance(self.num_sms, int) and 0 <= self.num_sms <= 1024):
            raise ValueError(f"sm90 forward: num_sms {self.num_sms!r} must be 0 (not persistent) "
                             "or the GPU's SM count")
        if self.ctas_per_sm not in (1, 2):
            raise ValueError(f"sm90 forward: ctas_per_sm {self.ctas_per_sm!r} must be 1 or 2")
        if self.ctas_per_sm == 2 and self.num_mma_warpgroups != 1:
            raise ValueError("sm90 forward: two CTAs per SM need one consumer warpgroup (tile_m "
                             f"64), not {self.num_mma_warpgroups} (registers)")
        if self.ctas_per_sm == 2 and self.head_dim_v > 192:
            # ptxas allocates every instruction within the launch bound's entry cap of 128
            # registers (setmaxnreg raises it only at run time); the P·V WGMMA alone holds
            # head_dim_v / 2 accumulators per thread (ptxas asked for 158 at 256)
            raise ValueError(f"sm90 forward: head_dim_v {self.head_dim_v} does not fit two CTAs "
                             "per SM (the P·V WGMMA's accumulators exceed the 128-register "
                             "entry cap; at most 192)")
        if self.accumulator_registers() > self.consumer_registers - 24:
            raise ValueError(
                f"sm90 forward: tile {self.tile_m}x{self.tile_n} with head_dim_v {self.head_dim_v} "
                f"needs ~{self.accumulator_registers()} accumulator registers per thread, over the "
                f"{self.consumer_registers} a consumer gets with {self.num_mma_warpgroups} "
                "warpgroups (it would spill)")
        limit = self.smem_limit()
        if self.smem_bytes() > limit:
            raise ValueError(f"sm90 forward: {self.smem_bytes()} B of shared memory exceeds "
                             f"{limit} B (tile {self.tile_m}x{self.tile_n}, {self.stages} stages, "
                             f"{self.ctas_per_sm} CTA(s) per SM)")

    def validate_fp8(self) -> None:
        """The FP8 forward's limits: dense, paged and varlen calls, with the decode tiles'
        head-major q and out and float32 out (no segment ids, max logits, persistent grid or
        two CTAs per SM), key blocks and head dims of 32·k keys."""
        check_dtype_and_mask("sm90 forward", "bfloat16", self.mask)  # the mask kind
        if self.segments or self.max_logits or self.num_sms or self.ctas_per_sm != 1:
            raise ValueError("sm90 forward: float8_e4m3fn is implemented for dense, paged, "
                             "decode and varlen calls (not segment ids, max logits, persistent "
                             "or two CTAs per SM)")
        if self.rescale_threshold:
            # with the exact max, each row's largest P is exactly 1.0 in e4m3; a stale max
            # rounds that dominant term by up to 6 % (3 mantissa bits): up to 1.7x the error in
            # an emulation (no result file kept), and the H200 tests failed FA4's rule with
            # threshold 8 at hdim 256 (benchmarks/results/fp8-nvidia-h200-2026-12-03.json, note)
            raise ValueError("sm90 forward: float8_e4m3fn needs rescale_threshold 0 (a stale "
                             "row max would round the largest P to e4m3)")
        if self.tile_n % 32 or self.head_dim % 32 or self.head_dim_v % 64:
            raise ValueError("sm90 forward: float8_e4m3fn needs tile_n and head_dim multiples "
                             "of 32 (the e4m3 WGMMA's K step) and head_dim_v of 64 (the four "
                             "producer warps' share of the V transpose), got tile_n "
                             f"{self.tile_n}, head dims {self.head_dim}/{self.head_dim_v}")
        if not self.intra_wg_overlap:
            raise ValueError("sm90 forward: float8_e4m3fn needs intra_wg_overlap (the producer "
                             "warps' V transposes follow the overlapped mainloop's load order)")

    @property
    def fp8(self) -> bool:
        return self.dtype == FP8_DTYPE

    # -- derived ---------------------------------------------------------------------------------
    @property
    def num_mma_warpgroups(self) -> int:
        return self.tile_m // 64

    @property
    def num_threads(self) -> int:
        return 128 * (self.num_mma_warpgroups + 1)

    @property
    def consumer_registers(self) -> int:
        """Registers per consumer thread after setmaxnreg."""
        return self.register_split()[0]

    def register_split(self) -> tuple[int, int]:
        """(consumer, producer) registers per thread after setmaxnreg: within the SM's 64K
        registers over all resident CTAs' threads (two CTAs of one consumer warpgroup:
        128·232 + 128·24 = 32K each)."""
        if self.ctas_per_sm == 2:
            return 232, 24
        return {1: (240, 24), 2: (240, 24), 3: (160, 32)}[self.num_mma_warpgroups]

    def accumulator_registers(self) -> int:
        """Live fp32 S, 16-bit (FP8: 8-bit) P and fp32 O fragments per consumer thread (64 rows
        per warpgroup, 128 threads): tile_n/2 + tile_n/4 (tile_n/8) + head_dim_v/2."""
        p = self.tile_n // 8 if self.fp8 else self.tile_n // 4
        return self.tile_n // 2 + p + self.head_dim_v // 2

    def smem_bytes(self) -> int:
        """Q (one stage, reused for O unless ``own_o_buffer``) + K and V stages (+ O): 16-bit
        elements, or (FP8) one-byte q / k / v with Q's buffer as large as the 16-bit O tile, and
        V's staging stages (:attr:`v_staging_stages`)."""
        if self.fp8:
            return self._smem_fp8() + self.v_staging_stages * self.tile_n * self.head_dim_v
        return self._smem_16bit() + (self._o_bytes() if self.own_o_buffer else 0)

    def _smem_fp8(self) -> int:
        """An FP8 config's Q / O buffer and its K and (transposed) V stages, in bytes."""
        q = max(self.tile_m * self.head_dim, 2 * self.tile_m * self.head_dim_v)
        return q + self.stages * self.tile_n * (self.head_dim + self.head_dim_v)

    @property
    def v_staging_stages(self) -> int:
        """FP8: stages of the buffer TMA loads V into as stored, (tile_n, Dv), before the
        producer warps transpose it into the P·V operand (kernels/sm90/v_transpose_plan.py):
        two where they fit the shared memory (V's load then runs one block ahead of the
        transposes), else one (head dim 256); 0 for 16-bit configs. Derived from the fields
        (the cache key), so no field of its own."""
        if not self.fp8:
            return 0
        fits = [n for n in (2, 1) if n <= self.stages and self._smem_fp8()
                + n * self.tile_n * self.head_dim_v <= self.smem_limit()]
        return fits[0] if fits else 1

    def _smem_16bit(self) -> int:
        """Q's one stage and the K and V stages of a 16-bit config, in bytes."""
        q = self.tile_m * self.head_dim
        kv = self.stages * self.tile_n * (self.head_dim + self.head_dim_v)
        return 2 * (q + kv)

    def _o_bytes(self) -> int:
        """The 16-bit O tile's staging buffer, in bytes."""
        return 2 * self.tile_m * self.head_dim_v

    def smem_limit(self) -> int:
        """The shared memory one CTA may plan for: the budget, or half the SM's with two CTAs
        per SM."""
        return SMEM_BUDGET_BYTES if self.ctas_per_sm == 1 else SMEM_PER_SM_BYTES // 2 - 2048

    @property
    def own_o_buffer(self) -> bool:
        """A persistent config stages O in a buffer of its own wherever that fits the shared
        memory (at the table's tiles: head dims 64, 96 and 128, and 192/128 with a window; not
        the other 192 rows nor 256, whose K/V stages leave no room): the next tile's Q then
        loads while this tile's O is stored, and the TMA store drains under the next tile's
        mainloop. Elsewhere O reuses Q's buffer, which the next Q must wait for.
        Derived from the fields (the cache key), so no field of its own."""
        return (self.num_sms > 0 and not self.fp8
                and self._smem_16bit() + self._o_bytes() <= self.smem_limit())

    # -- KernelConfig contract ------------------------------------------------------------------
    def signature(self) -> KernelSignature:
        sig = self._layout_signature()
        if self.qo_head_major or self.out_f32:
            sig = self._decode_layouts(sig)
        return with_tile_counter(sig) if self.dynamic_tiles else sig

    def _layout_signature(self) -> KernelSignature:
        """The signature with q and out sequence-major (B, S, H, D) and out in the output dtype
        (before :meth:`_decode_layouts` and the dynamic scheduler's tile counter)."""
        if self.fp8:
            return fp8_attention_forward_signature(self.head_dim, self.head_dim_v,
                                                   paged_tile_n=self.tile_n if self.paged
                                                   else None, varlen=self.varlen)
        if self.segments or self.max_logits:
            sig = (segments_attention_forward_signature(self.dtype, self.head_dim,
                                                        self.head_dim_v) if self.segments
                   else attention_forward_signature(self.dtype, self.head_dim, self.head_dim_v))
            return with_max_logits(sig) if self.max_logits else sig
        if self.varlen:
            return varlen_attention_forward_signature(self.dtype, self.head_dim, self.head_dim_v)
        if self.paged:
            return paged_attention_forward_signature(self.dtype, self.head_dim,
                                                     self.head_dim_v, self.tile_n)
        return attention_forward_signature(self.dtype, self.head_dim, self.head_dim_v)

    def _decode_layouts(self, sig: KernelSignature) -> KernelSignature:
        """``sig`` with the decode tiles' layouts: q and out head-major (``qo_head_major``),
        out float32 (``out_f32``)."""
        def head_major(arg: TensorArg) -> TensorArg:  # (B, S, H, D) -> (B, H, S, D)
            if arg.name == "out" and self.out_f32:
                arg = dataclasses.replace(arg, dtype="float32")
            if arg.name not in ("q", "out") or not self.qo_head_major:
                return arg
            b, s, h, d = arg.sample_shape
            return dataclasses.replace(arg, sample_shape=(b, h, s, d))

        return dataclasses.replace(sig, inputs=tuple(map(head_major, sig.inputs)),
                                   outputs=tuple(map(head_major, sig.outputs)))


#: The dynamic tile scheduler's counter (FwdConfig.dynamic_tiles): one int32, zeros in.
TILE_COUNTER = TensorArg("tile_counter", "int32", (1,), (1,), batched=False)


def with_tile_counter(sig: KernelSignature) -> KernelSignature:
    """``sig`` with the dynamic tile scheduler's counter (:data:`TILE_COUNTER`) as its last
    input, aliased to a last output: the caller passes zeros and the kernel's atomic adds update
    the buffer in place (the launcher takes it once, after the other inputs:
    ``fn(stream, q, k, v, params, tile_counter, out, lse)``)."""
    inputs, outputs = sig.inputs + (TILE_COUNTER,), sig.outputs + (TILE_COUNTER,)
    return dataclasses.replace(sig, inputs=inputs, outputs=outputs,
                               aliases=sig.aliases + ((len(inputs) - 1, len(outputs) - 1),))


#: Keys per group of the FP8 forward's value permutation (the e4m3 P·V WGMMA's K step).
FP8_KEY_GROUP = 32


def fp8_value_permutation() -> tuple[int, ...]:
    """perm[l]: the key (within each group of 32) whose value row the FP8 forward reads as its
    l-th. The QK accumulator leaves each thread the column pairs {2t, 2t+1} of every 8-column
    group; the e4m3 register-A operand of the P·V WGMMA wants columns {4t .. 4t+3} of each
    16-column half. The kernel packs its accumulator values as they lie (no shuffles), so the
    operand's logical key l = 16h + 4t + e holds the score of key 16h + 8(e // 2) + 2t + e % 2,
    and V must present its rows in that order."""
    return tuple(16 * (l // 16) + 8 * ((l % 4) // 2) + 2 * ((l % 16) // 4) + l % 2
                 for l in range(FP8_KEY_GROUP))


def fp8_attention_forward_signature(head_dim: int, head_dim_v: int,
                                    paged_tile_n: int | None = None, varlen: bool = False
                                    ) -> KernelSignature:
    """``fn(stream, q, k, v, params, descale, out, lse)`` of the FP8 forward: q (B, Sq, H, D),
    k (B, Sk, Hkv, D) and v (B, Sk, Hkv, Dv) float8_e4m3fn, as the 16-bit kernel takes them (the
    kernel transposes V in shared memory); descale (B, Hkv, 2) float32: the q·k descale
    (q_descale · k_descale, folded into the softmax scale) and v's (folded into the output's
    normalisation); out (B, Sq, H, Dv) bfloat16; params and lse as in
    :func:`spec.attention_forward_signature`. Paged (``paged_tile_n``: the key block) and
    varlen: their 16-bit signatures' operands (spec.paged_attention_forward_signature,
    spec.varlen_attention_forward_signature) in e4m3, the descale after them: (B, Hkv, 2) for
    paged (batch entry b's row), (num_sequences, Hkv, 2) for varlen (sequence b's row)."""
    if paged_tile_n is not None:
        base = paged_attention_forward_signature(FP8_DTYPE, head_dim, head_dim_v, paged_tile_n)
    elif varlen:
        base = varlen_attention_forward_signature(FP8_DTYPE, head_dim, head_dim_v)
    else:
        base = attention_forward_signature(FP8_DTYPE, head_dim, head_dim_v)
    _, _, hkv, _ = base.inputs[2].sample_shape  # v's
    b = (base.inputs[4].sample_shape[0] - 1 if varlen  # cu_seqlens_q's (batch + 1,)
         else base.inputs[0].sample_shape[0])
    descale = TensorArg("descale", "float32", (b, hkv, 2), (1, 1, 2), batched=not varlen)
    out, lse = base.outputs
    return dataclasses.replace(base, inputs=(*base.inputs, descale),
                               outputs=(dataclasses.replace(out, dtype="bfloat16"), lse))


#: Query rows of the decode tile (one consumer warpgroup): the rows of a decode call after GQA
#: packing (backends/decode.py) rarely fill more, and a 128-row tile would spend twice the GEMM
#: time per key block on empty rows; with 64 the kernel is bound by its K/V bytes.
DECODE_TILE_M = 64


#: The decode tile's shapes, best first (the first that fits a head dim is shipped): two CTAs per
#: SM, each with two stages of 64 keys (one CTA's K/V stream runs through the other's prologue
#: and epilogue: 4.13 against 4.09 TB/s for one CTA per SM at B32·Sk4096, both one wave of
#: tiles, benchmarks/results/decode-options-nvidia-h200-2026-11-30.json);
#: one stage where two do not fit half an SM's shared memory (head dims 192/192); one CTA per
#: SM with the table's key block where two CTAs do not fit at all (head dim 256: registers).
DECODE_TILES: tuple[dict, ...] = (
    dict(ctas_per_sm=2, tile_n=64, stages=2),
    dict(ctas_per_sm=2, tile_n=64, stages=1),
    dict(ctas_per_sm=1),
)

#: Decode-tile alternatives for comparisons (benchmarks/decode_bench.py;
#: ``JAX_FA4_DECODE_TILE=<name>`` selects one at trace time, backends/sm90.decode_tile_option):
#: FwdConfig overrides of decode_config and paged_config. "1cta" is the decode tile shipped
#: before the two-CTA one.
DECODE_OPTIONS: dict[str, dict] = {
    "1cta": dict(ctas_per_sm=1),
    "2cta-n128-s1": dict(ctas_per_sm=2, tile_n=128, stages=1),
}

#: Key-block sizes a paged kernel may take where its tile shape leaves it open: cache pages must
#: hold a multiple of the key block (a 128-token page is one block of 128 or two of 64).
PAGED_TILE_N = (128, 64)


def _first_fitting(dtype: str, head_dim: int, head_dim_v: int | None, mask: str,
                   has_softcap: bool, base: dict, candidates) -> FwdConfig:
    """The config of the first candidate overrides (on top of ``base``) that validates; the
    last candidate's ValueError if none does."""
    err = None
    for overrides in candidates:
        try:
            return FwdConfig.make(dtype, head_dim, head_dim_v, mask, has_softcap,
                                  **{**base, **overrides})
        except ValueError as e:
            err = e
    raise err


def decode_config(dtype: str, head_dim: int, head_dim_v: int | None = None,
                  has_softcap: bool = False, out_f32: bool = False, **overrides) -> FwdConfig:
    """The forward config for decode-shaped calls (unmasked after backends/decode.py's rewrite, at
    most DECODE_TILE_M query rows, head-major q and out): one consumer warpgroup (so no
    ping-pong), no persistence, the first of DECODE_TILES that fits; ``overrides`` (a
    DECODE_OPTIONS entry) replace DECODE_TILES; ``out_f32``: a float32 out (split-KV chunks,
    sinks joined afterwards). ValueError if the kind is unsupported."""
    base = dict(tile_m=DECODE_TILE_M, pingpong=False, num_sms=0, qo_head_major=True,
                out_f32=out_f32)
    return _first_fitting(dtype, head_dim, head_dim_v, "none", has_softcap, base,
                          [overrides] if overrides else DECODE_TILES)


def paged_config(dtype: str, head_dim: int, head_dim_v: int | None = None, mask: str = "none",
                 has_softcap: bool = False, out_f32: bool = False, **overrides) -> FwdConfig:
    """The paged forward config of a problem kind: the decode tile (DECODE_TILE_M query rows,
    enough for decode steps after GQA packing and, with more tiles, for chunked prefill; the
    first of DECODE_TILES that fits, a key block of PAGED_TILE_N where it names none);
    ``overrides`` (a DECODE_OPTIONS entry) replace DECODE_TILES; ``out_f32`` as in
    :func:`decode_config`. ValueError if the kind is unsupported."""
    base = dict(tile_m=DECODE_TILE_M, pingpong=False, num_sms=0, paged=True, qo_head_major=True,
                out_f32=out_f32)
    candidates = [c if "tile_n" in c else {**c, "tile_n": n}
                  for c in ([overrides] if overrides else DECODE_TILES)
                  for n in ((None,) if "tile_n" in c else PAGED_TILE_N)]
    return _first_fitting(dtype, head_dim, head_dim_v, mask, has_softcap, base, candidates)


def varlen_config(dtype: str, head_dim: int, head_dim_v: int | None = None, mask: str = "none",
                  has_softcap: bool = False) -> FwdConfig:
    """The varlen forward config of a problem kind: the table's tile, not persistent."""
    return FwdConfig.make(dtype, head_dim, head_dim_v, mask, has_softcap, num_sms=0, varlen=True)


#: The query tile of the forward with segment ids where the table's does not fit: the 192-row
#: tile (three consumer warpgroups of 160 registers) spills with the per-row spans and ids plus
#: a softcap (head dim 64 causal) or the max-logit running max (LDL 24; `precompile --check`).
#: Without those it fits and is the faster one (hd64 unmasked 0.596 vs 0.698 ms:
#: benchmarks/results/segments-hd64-tile192-nvidia-h200-2026-12-03.json against
#: segments-hd64-tile128-nvidia-h200-2026-12-03.json), so only those configs take this tile.
SEGMENTS_MAX_TILE_M = 128


def fp8_config(head_dim: int, head_dim_v: int | None = None, mask: str = "none",
               has_softcap: bool = False, varlen: bool = False) -> FwdConfig:
    """The FP8 (e4m3 in, bfloat16 out) forward of a problem kind: FP8_TUNING_TABLE's tile
    (with a softcap, FP8_SOFTCAP_TILE_N's key block where it names one: :meth:`FwdConfig.make`);
    ``varlen``: the varlen form of the same tile (as :func:`varlen_config` is of the 16-bit
    table's)."""
    return FwdConfig.make(FP8_DTYPE, head_dim, head_dim_v, mask, has_softcap, varlen=varlen)


def fp8_paged_config(head_dim: int, head_dim_v: int | None = None, mask: str = "none",
                     has_softcap: bool = False, out_f32: bool = False) -> FwdConfig:
    """The FP8 paged forward of a problem kind (an e4m3 KV cache): :func:`paged_config`'s tile
    where FP8 allows it: DECODE_TILE_M query rows (one consumer warpgroup), head-major q and
    out (the decode rewrite's packed rows), the first key block of PAGED_TILE_N that fits
    (cache pages hold a multiple of it), the FP8 row's stages and rescale skip, one CTA per SM
    (FP8 has no two-CTA form); ``out_f32`` as in :func:`decode_config`."""
    return _first_fitting(FP8_DTYPE, head_dim, head_dim_v, mask, has_softcap,
                          dict(tile_m=DECODE_TILE_M, pingpong=False, num_sms=0, paged=True,
                               qo_head_major=True, out_f32=out_f32),
                          [dict(tile_n=n) for n in PAGED_TILE_N])


def fp8_decode_config(head_dim: int, head_dim_v: int | None = None, has_softcap: bool = False,
                      out_f32: bool = False) -> FwdConfig:
    """The FP8 forward for decode-shaped calls (:func:`decode_config`'s role for e4m3 q, k, v):
    DECODE_TILE_M query rows, head-major q and out, unmasked (after the decode rewrite), the FP8
    row's key block (with a softcap, FP8_SOFTCAP_TILE_N's) and stages, one CTA per SM;
    ``out_f32`` as in :func:`decode_config`."""
    return FwdConfig.make(FP8_DTYPE, head_dim, head_dim_v, "none", has_softcap,
                          tile_m=DECODE_TILE_M, pingpong=False, num_sms=0, qo_head_major=True,
                          out_f32=out_f32)


def segments_config(dtype: str, head_dim: int, head_dim_v: int | None = None,
                    mask: str = "none", has_softcap: bool = False,
                    max_logits: bool = False) -> FwdConfig:
    """The forward with segment ids for a problem kind: the table's tile (at most
    SEGMENTS_MAX_TILE_M rows with a softcap or max logits), one tile per CTA;
    ``max_logits``: with the per-row max output."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    tile_m = tuning_for(head_dim, head_dim_v, mask).tile_m
    if has_softcap or max_logits:
        tile_m = min(tile_m, SEGMENTS_MAX_TILE_M)
    return FwdConfig.make(dtype, head_dim, head_dim_v, mask, has_softcap, num_sms=0,
                          segments=True, tile_m=tile_m, max_logits=max_logits)


def max_logits_config(dtype: str, head_dim: int, head_dim_v: int | None = None,
                      mask: str = "none", has_softcap: bool = False) -> FwdConfig:
    """The dense forward of a problem kind (the table's tuning) with the per-row max logits."""
    return FwdConfig.make(dtype, head_dim, head_dim_v, mask, has_softcap, max_logits=True)


def shipped_configs() -> list[FwdConfig]:
    """Every variant the package precompiles: all table rows × mask kinds × softcap, bf16 and
    fp16, the decode config of each row, and the paged, varlen and segment-id configs of each
    row and mask kind; the decode and paged ones also with a float32 out, the dense and
    segment-id ones also with max logits; the FP8 forward of every FP8 table row, mask kind and
    softcap, dense, varlen and paged (with a float32 out too), and its decode config."""
    out = [make(d, dv, mask, softcap) for (d, dv), row in FP8_TUNING_TABLE.items()
           for mask in row for softcap in (False, True)
           for make in (fp8_config, functools.partial(fp8_config, varlen=True),
                        fp8_paged_config, functools.partial(fp8_paged_config, out_f32=True))]
    out += [fp8_decode_config(d, dv, softcap, out_f32=f32) for d, dv in FP8_TUNING_TABLE
            for softcap in (False, True) for f32 in (False, True)]
    for dtype in FLOAT_DTYPES:
        for (d, dv), row in TUNING_TABLE.items():
            for softcap in (False, True):
                out += [FwdConfig.make(dtype, d, dv, mask, softcap) for mask in row]
                out += [decode_config(dtype, d, dv, softcap, out_f32=f32)
                        for f32 in (False, True)]
                out += [paged_config(dtype, d, dv, mask, softcap, out_f32=f32)
                        for mask in row for f32 in (False, True)]
                out += [varlen_config(dtype, d, dv, mask, softcap) for mask in row]
                out += [segments_config(dtype, d, dv, mask, softcap, max_logits=ml)
                        for mask in row for ml in (False, True)]
                out += [max_logits_config(dtype, d, dv, mask, softcap) for mask in row]
    return out


def decode_option_configs() -> list[FwdConfig]:
    """The dense and paged decode configs of every DECODE_OPTIONS entry at hdim 128 bf16 (what
    the decode benchmark compares and the GPU decode tests run)."""
    return [c for o in DECODE_OPTIONS.values()
            for c in (decode_config("bfloat16", 128, 128, **o),
                      paged_config("bfloat16", 128, 128, **o))]
