"""Compile key and tuning table of the Blackwell (sm_100a) attention backward. No compiler import.

Same contract as the Hopper backward (``jax_fa4/kernels/sm90/bwd_config.py``), so the API switches
families by arch only. Per (batch b, query head h, key block n):

    P  = exp2(S·scale_log2 − lse_log2)          S = q·kᵀ (or softcap·tanh(q·kᵀ·scale/softcap))
    dV = Σ_m Pᵀ·dO,   dP = dO·Vᵀ,   dS = P∘(dP − delta) [∘ (1 − tanh²)]
    dK = Σ_m dSᵀ·Q · scale,   dq_accum += dS·K (float32, unscaled, row-major, see below)

    call: fn(stream, q, k, v, dout, lse_log2, delta, params, dq_accum, [dq_semaphore,] dk, dv)
      q        (B, Sq, H, D)      dtype
      k        (B, Sk, Hkv, D)    dtype
      v        (B, Sk, Hkv, Dv)   dtype
      dout     (B, Sq, H, Dv)     dtype
      lse_log2 (B, H, Sq)         float32  (+inf on rows that saw no key: from the preprocess)
      delta    (B, H, Sq)         float32  rowsum(out·dout)
      params   (4,)               float32  [softmax_scale, softcap (0 = off), window_left,
                                            window_right] (-1 = unbounded), batched=False
      dq_accum (B, H, Sq_pad·D)   float32  zero-filled by the caller, Sq_pad = ceil(Sq/128)·128.
                                            Input 7, aliased to output 0 (updated in place).
      dq_semaphore (B, H, slots·ceil(Sq/128)) int32, deterministic configs only: zero-filled by the
                                            caller; input 8, aliased to output 3.
    outputs (after the aliases): dk (B, Sk, Hdk, D), dv (B, Sk, Hdk, Dv) with Hdk = Hkv for MHA
      configs (gqa=False, dtype = input dtype) and Hdk = H for GQA configs (gqa=True, float32,
      one slice per query head; the caller sums each group of H/Hkv heads).

dq_accum layout: **plain row-major** (Sq_pad, D) per (b, h) (unlike the Hopper kernel's fragment
order): the main kernel adds into it with TMA tensor reduce-adds of (128, dq_cols) tiles, so the
postprocess is a plain ``dq = dq_accum[:Sq] · softmax_scale`` cast, done in JAX (one fused XLA
elementwise op, ``jax_fa4/backends/sm100.py``); no separate postprocess kernel is needed.

Deterministic configs: CTA (n_block, h, b) adds its dQ partial of query block m only when
dq_semaphore[b, h, m] equals its rank among the key blocks that visit m (key blocks in
increasing order, ``common/geometry.BwdBlocks.dq_rank``), then increments it (release) once
its reduce-adds completed, so the float32 sums happen in one fixed order on every run. The 2-CTA
kernel (``two_cta``) orders each 64-row half of a query block on its own slot, dq_semaphore (B, H,
2·ceil(Sq/128)) slot 2m + r, by the rank of the key *pair* among the pairs that visit m.

Varlen configs (``varlen=True``, :func:`varlen_config`; the 1-CTA kernel, and the 2-CTA kernel
at 192/128) take the Hopper varlen backward's call contract
(``varlen_bwd_config.varlen_attention_backward_signature``: packed sequences, cu_seqlens, the
caller's work list, one CTA per (work item, query head)) with this kernel's dq_accum rows:
sequence b's query block m adds into the row-major (128, D) tile ``work[x, 6] + m`` of (R, D)
per head, so the caller's postprocess is a row gather and a scale. The 2-CTA kernel's work item
is a pair's 256-key span of a sequence (the list built with ``work_tile_n`` = 256 keys per item;
work[x, 1] the pair index in the sequence) and takes two CTAs, x' = 2x + rank: grid (2W, H).

Segment-id configs (``segments=True``, :func:`segments_config`; the 1-CTA kernel, and the 2-CTA
kernel at 192/128; not deterministic) take the dense contract plus jax_fa4/segments.py's
backward tables for this tile (``segments_config.with_segment_tables``, the Hopper backward's
contract too), after dq_accum:

    call: fn(stream, q, k, v, dout, lse_log2, delta, params, dq_accum, seg_tiles, seg_keys,
             seg_rows, kv_ids, dk, dv)
      seg_tiles (B, ceil(Sq/128), 8) int32   per query block: its bulk [SEG_BULK_LO, SEG_BULK_HI)
      seg_keys  (B, ceil(Sk/128), 8) int32   per key block: the query blocks [SEG_KEY_M_LO,
                                             SEG_KEY_M_HI) it visits
      seg_rows  (B, Sq, 4) int32             per query row: its id (SEG_ROW_ID)
      kv_ids    (B, Sk) int32                the keys' ids

CTA n visits the query blocks of the mask's range within [m_lo, m_hi); a (query block, key
block) pair outside the query block's bulk compares each row's id with the key's (bwd.py). The
2-CTA kernel reads the same 128-key tables: both CTAs of the pair p walk the mask's range of
its 256 keys within the union of key blocks 2p and 2p + 1's [m_lo, m_hi) (one range for both,
the pair MMAs need it), and each CTA compares ids against its own block's bulk (bwd_2cta.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

# the table chooses configs (whose fields are the key): not part of any kernel's key
from jax_fa4.kernels.segments_config import with_segment_tables
from jax_fa4.kernels.sm100.bwd_tuning import (SEGMENTS_TUNING, TUNING_TABLE, VARLEN_TUNING,
                                              tuning_for)
from jax_fa4.kernels.spec import (FLOAT_DTYPES, SMEM_BUDGET_BYTES, KernelConfig, KernelSignature,
                                  attention_backward_signature, check_dtype_and_mask)
# the varlen backward's call contract, shared with the Hopper kernels (one work list for both)
from jax_fa4.kernels.varlen_bwd_config import varlen_attention_backward_signature


#: Tensor memory columns per SM (128 lanes × 512 columns × 32 bit).
TMEM_COLUMNS = 512


@dataclass(frozen=True)
class Sm100BwdConfig(KernelConfig):
    """Compile key of the sm100 backward main kernel: everything that changes the generated code."""

    kernel_name: ClassVar[str] = "sm100_bwd"

    dtype: str = "bfloat16"
    head_dim: int = 128
    head_dim_v: int = 128
    mask: str = "none"  # "none" | "causal" | "local"
    has_softcap: bool = False
    # dk/dv float32 per query head (the caller sums the groups) instead of dtype per kv head
    gqa: bool = False
    deterministic: bool = False  # ordered dQ reduce-adds through dq_semaphore
    # tuning (from TUNING_TABLE via `make`)
    q_stages: int = 2
    do_stages: int = 1
    dq_cols: int = 32
    dq_stages: int = 2
    two_cta: bool = False
    # packed sequences (module doc, varlen_config): the 1-CTA kernel, the 2-CTA one at 192/128
    varlen: bool = False
    # segment ids (module doc, segments_config): the 1-CTA kernel, the 2-CTA one at 192/128;
    # not deterministic
    segments: bool = False

    tile_m: ClassVar[int] = 128  # query rows per iteration (the N of Sᵀ = K·Qᵀ)
    tile_n: ClassVar[int] = 128  # keys per CTA (the M of Sᵀ: one TMEM lane per key)

    @classmethod
    def make(cls, dtype: str, head_dim: int, head_dim_v: int | None = None, mask: str = "none",
             has_softcap: bool = False, gqa: bool = False, deterministic: bool = False,
             **overrides) -> Sm100BwdConfig:
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        t = tuning_for(head_dim, head_dim_v, mask)
        fields = dict(q_stages=t.q_stages, do_stages=t.do_stages, dq_cols=t.dq_cols,
                      dq_stages=t.dq_stages, two_cta=t.two_cta)
        fields.update(overrides)
        cfg = cls(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, mask=mask,
                  has_softcap=bool(has_softcap), gqa=bool(gqa), deterministic=bool(deterministic),
                  **fields)
        cfg.validate()
        return cfg

    # -- static checks ---------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first unsupported feature."""
        check_dtype_and_mask("sm100 backward", self.dtype, self.mask)
        tuning_for(self.head_dim, self.head_dim_v, self.mask)
        if self.varlen and self.deterministic:
            raise ValueError("sm100 backward: varlen has no deterministic mode")
        if self.segments and (self.deterministic or self.varlen):
            raise ValueError("sm100 backward: segment ids are a dense mode without "
                             "deterministic")
        if self.head_dim != self.head_dim_v and not self.two_cta:
            raise ValueError("sm100 backward: head_dim_v must equal head_dim (1-CTA kernel)")
        if self.head_dim % 32:
            raise ValueError("sm100 backward: head_dim must be a multiple of 32 (each compute "
                             "warpgroup takes half of dK / dV in 16-column chunks)")
        if self.two_cta:
            if (self.head_dim, self.head_dim_v) not in ((128, 128), (192, 128)):
                raise ValueError("sm100 backward: the 2-CTA kernel serves head dims 128 and "
                                 f"192/128, got {self.head_dim}/{self.head_dim_v}")
            if min(self.q_stages, self.do_stages, self.dq_stages) < 1:
                raise ValueError("sm100 backward: q_stages, do_stages, dq_stages must be >= 1")
            if self.dq_cols not in (8, 16, 32) or (self.head_dim // 2) % self.dq_cols:
                raise ValueError(f"sm100 backward: dq_cols {self.dq_cols} must be 8, 16 or 32 "
                                 f"and divide head_dim / 2 = {self.head_dim // 2} (2-CTA dQ is "
                                 "folded: each lane half holds half of the columns)")
        else:
            if self.q_stages < 2:
                # the MMA warp waits for Q_{j+1} (Sᵀ_{j+1}) before the commit after dK_j
                # releases Q_j's stage: with one stage the load warp can never refill it
                # (deadlock found by tests/test_sm100_bwd_protocol.py)
                raise ValueError("sm100 backward: q_stages must be >= 2 (Q_{j+1} is loaded "
                                 "while Q_j is still in use)")
            if self.do_stages < 1 or self.dq_stages < 1:
                raise ValueError("sm100 backward: do_stages, dq_stages must be >= 1")
            if self.dq_cols not in (16, 32) or self.head_dim % self.dq_cols:
                raise ValueError(f"sm100 backward: dq_cols {self.dq_cols} must be 16 or 32 and "
                                 f"divide head_dim {self.head_dim}")
        if self.tmem_columns() > TMEM_COLUMNS:
            raise ValueError(f"sm100 backward: {self.tmem_columns()} TMEM columns exceed "
                             f"{TMEM_COLUMNS}")
        if self.smem_bytes() > SMEM_BUDGET_BYTES:
            raise ValueError(f"sm100 backward: {self.smem_bytes()} B of shared memory exceeds "
                             f"{SMEM_BUDGET_BYTES} B ({self.describe()})")

    # -- derived ---------------------------------------------------------------------------------
    #: 16 warps: 0-3 dQ reduce, 4-11 compute (two warpgroups, each half of the query columns),
    #: 12 MMA (+ TMEM allocation), 13 load, 14 relay (2-CTA) or idle, 15 idle (setmaxnreg acts
    #: per warpgroup).
    num_threads: ClassVar[int] = 512

    def tmem_offsets(self) -> dict[str, int]:
        """Column offsets of the TMEM accumulators: dK, dV, Sᵀ (Pᵀ in its columns), dPᵀ, dQ.
        1-CTA: dQ (128 lanes × D) reuses dPᵀ's columns once dS has been computed from it.
        2-CTA: dSᵀ (16-bit) goes into dPᵀ's columns too, and the folded dQ (D/2 columns) into
        dPᵀ's upper 64 (bwd_2cta.py)."""
        d, dv, tm = self.head_dim, self.head_dim_v, self.tile_m
        if self.serial:
            # dV | dK | Sᵀ, with dPᵀ over Sᵀ's upper half and the folded dQ (D/2) at the end
            s = dv + d
            return {"dv": 0, "dk": dv, "s": s, "dp": s + tm // 2,
                    "dq": s + tm // 2 + tm - d // 2}
        dp = d + dv + tm
        return {"dk": 0, "dv": d, "s": d + dv, "dp": dp,
                "dq": dp + tm // 2 if self.two_cta else dp}

    @property
    def serial(self) -> bool:
        """2-CTA layout with dPᵀ over Sᵀ's upper half (head dim 192): one iteration at a time,
        contiguous 16-bit Pᵀ / dSᵀ, Q / Qᵀ and dO / dOᵀ sharing their buffers (bwd_2cta.py)."""
        return self.two_cta and self.head_dim + self.head_dim_v + 2 * self.tile_m > TMEM_COLUMNS

    def tmem_columns(self) -> int:
        if self.serial:
            off = self.tmem_offsets()
            return off["dq"] + self.head_dim // 2
        if self.two_cta:
            return self.head_dim + self.head_dim_v + 2 * self.tile_m
        return self.head_dim + self.head_dim_v + self.tile_m + max(self.tile_m, self.head_dim)

    def tmem_alloc_columns(self) -> int:
        n = 32
        while n < self.tmem_columns():
            n *= 2
        return n

    @property
    def lse_stages(self) -> int:
        """Stages of the -lse_log2 / -delta rows (1-CTA: they follow the Q stage)."""
        return 2 if self.two_cta else self.q_stages

    @property
    def semaphore_slots(self) -> int:
        """dq_semaphore slots per query block (2-CTA: one per 64-row half of the block)."""
        return 2 if self.two_cta else 1

    def smem_bytes(self) -> int:
        e = 2
        tm, tn, d, dv = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v
        stats = 2 * self.lse_stages * tm * 4  # -lse_log2, -delta per query row
        staging = self.dq_stages * tm * self.dq_cols * 4  # dQ reduce staging
        if self.two_cta:
            # per CTA: K, V (own keys), Kᵀ (D/2 columns × 256 keys); Q, dO (a query half × D)
            # and Qᵀ, dOᵀ (D/2 columns × all rows) per stage, one buffer for both when serial;
            # sdS (a query half × 256 keys), sdS_xchg (a query half × own keys)
            qdo = (self.q_stages * tm * d * e + self.do_stages * tm * dv * e) // (
                2 if self.serial else 1)
            return (tn * (d + dv) * e + tn * d * e + qdo
                    + tm * tn * e + tm // 2 * tn * e + staging + stats
                    + (self.segment_smem_bytes() if self.segments else 0))
        return (tn * (d + dv) * e  # K, V
                + self.q_stages * tm * d * e + self.do_stages * tm * dv * e  # Q, dO rings
                + tm * tn * e  # dS
                + staging + stats + self.segment_smem_bytes())

    def segment_smem_bytes(self) -> int:
        """Shared memory of the segment-id stages: each query row's id and the block's mask
        flag per lse stage; the 1-CTA kernel's placeholder of 4 + 4 int32 without segment ids
        (the 2-CTA kernel has none)."""
        if not self.segments:
            return 2 * 4 * 4
        return (self.tile_m * self.lse_stages + max(self.lse_stages, 4)) * 4

    @property
    def work_tile_n(self) -> int:
        """Keys of one varlen work item: a CTA's 128, or a 2-CTA pair's 256."""
        return 2 * self.tile_n if self.two_cta else self.tile_n

    def num_m_blocks(self, seqlen_q: int) -> int:
        return -(-seqlen_q // self.tile_m)

    # -- KernelConfig contract ------------------------------------------------------------------
    def signature(self) -> KernelSignature:
        if self.varlen:
            return varlen_attention_backward_signature(self.dtype, self.head_dim,
                                                       self.head_dim_v, self.tile_m, self.gqa)
        if self.segments:
            return with_segment_tables(attention_backward_signature(
                self.dtype, self.head_dim, self.head_dim_v, self.tile_m, self.gqa),
                self.tile_m, self.tile_n)
        return attention_backward_signature(
            self.dtype, self.head_dim, self.head_dim_v, self.tile_m, self.gqa,
            counters=("dq_semaphore", self.semaphore_slots) if self.deterministic else None)


def shipped_configs() -> list[Sm100BwdConfig]:
    """Every sm100 backward variant the package precompiles (no separate postprocess kernel)."""
    out = []
    for dtype in FLOAT_DTYPES:
        for (d, dv), row in TUNING_TABLE.items():
            for mask in row:
                for softcap in (False, True):
                    for gqa in (False, True):
                        for det in (False, True):
                            out.append(Sm100BwdConfig.make(dtype, d, dv, mask, softcap, gqa, det))
                        if (d, dv) in VARLEN_TUNING:
                            out.append(varlen_config(dtype, d, dv, mask, softcap, gqa))
                        if (d, dv) in SEGMENTS_TUNING:
                            out.append(segments_config(dtype, d, dv, mask, softcap, gqa))
    return out


def varlen_config(dtype: str, head_dim: int, head_dim_v: int | None = None, mask: str = "none",
                  has_softcap: bool = False, gqa: bool = False) -> Sm100BwdConfig:
    """The varlen backward config of a problem kind, with the varlen tuning
    (``bwd_tuning.VARLEN_TUNING``): the 1-CTA kernel at head dims 64, 96 and 128 (the dense
    table's 1-CTA rows, and a 1-CTA row at 128, whose dense row is 2-CTA), the 2-CTA kernel at
    192/128 (where no 1-CTA kernel fits: dK + dV + Sᵀ + dPᵀ would take 640 TMEM columns);
    raises ValueError at other head dims."""
    return _mode_config(VARLEN_TUNING, "varlen", dtype, head_dim, head_dim_v, mask,
                        has_softcap, gqa, varlen=True)


def segments_config(dtype: str, head_dim: int, head_dim_v: int | None = None,
                    mask: str = "none", has_softcap: bool = False, gqa: bool = False
                    ) -> Sm100BwdConfig:
    """The segment-id backward config of a problem kind (module doc) with the segments tuning
    (``bwd_tuning.SEGMENTS_TUNING``): the 1-CTA kernel at head dims 64, 96 and 128 (as varlen,
    a 1-CTA row at 128 too), the 2-CTA kernel at 192/128 (one dQ staging buffer, to fit the
    row-id stages); raises ValueError at other head dims. Never deterministic."""
    return _mode_config(SEGMENTS_TUNING, "segment-id", dtype, head_dim, head_dim_v, mask,
                        has_softcap, gqa, segments=True)


def _mode_config(table: dict, mode: str, dtype: str, head_dim: int, head_dim_v: int | None,
                 mask: str, has_softcap: bool, gqa: bool, **flags) -> Sm100BwdConfig:
    """The config of a mode (``flags``: ``varlen=True`` or ``segments=True``) with ``table``'s
    tuning row (the 1- or 2-CTA kernel, as the row says); ValueError naming the ``mode`` and
    the head dims it has where the table has no row for these."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    tuning = table.get((head_dim, head_dim_v))
    if tuning is None:
        has = ", ".join(f"{d}/{dv}" + (" (2-CTA)" if row.two_cta else "")
                        for (d, dv), row in table.items())
        if not any(row.two_cta for row in table.values()):
            has += f"; the 2-CTA kernel has no {mode} mode"
        raise ValueError(f"sm100 backward: no {mode} kernel at head dims "
                         f"{head_dim}/{head_dim_v} (the {mode} mode has {has})")
    return Sm100BwdConfig.make(dtype, head_dim, head_dim_v, mask, has_softcap, gqa,
                               q_stages=tuning.q_stages, do_stages=tuning.do_stages,
                               dq_cols=tuning.dq_cols, dq_stages=tuning.dq_stages,
                               two_cta=tuning.two_cta, **flags)


def test_configs() -> list[Sm100BwdConfig]:
    """The subset the compile test builds on every run: each head dim once (bf16, no mask), each
    mask kind, softcap, GQA and deterministic once, fp16 once, varlen at head dims 64, 128 and
    192/128 (the 2-CTA kernel's varlen mode), segment ids at head dim 128 (the 1-CTA kernel
    where the dense table is 2-CTA) and 192/128 (the 2-CTA kernel's segment-id mode)."""
    out = [Sm100BwdConfig.make("bfloat16", d, dv) for (d, dv) in TUNING_TABLE]
    out += [Sm100BwdConfig.make("bfloat16", 128, 128, "causal", deterministic=True),
            Sm100BwdConfig.make("bfloat16", 128, 128, "local", True, True),
            Sm100BwdConfig.make("float16", 64, 64, "causal", True, False, True),
            varlen_config("bfloat16", 64, 64, "causal", gqa=True),
            varlen_config("bfloat16", 128, 128, "local", True),
            varlen_config("bfloat16", 192, 128, "causal"),
            segments_config("float16", 128, 128, "causal", gqa=True),
            segments_config("bfloat16", 192, 128, "local", True)]
    return out


test_configs.__test__ = False  # not a pytest test
