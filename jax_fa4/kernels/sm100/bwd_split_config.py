"""Compile key of the Blackwell (sm_100a) split backward, head dims 192/192 and 256: a dK/dV
kernel and a dQ kernel (``bwd_split.py``). No compiler import.

The fused backward (``bwd_config.py``) holds dK, dV, Sᵀ and dPᵀ of 128 keys in one SM's 512
tensor-memory columns; at head dim 256 dK and dV alone take them all, and at 192/192 the four
exceed them too (with 128 query columns per block). The split backward runs two kernels with
the same math (``bwd_config.py``'s module doc), each holding fewer accumulators:

  part "dkdv": per (key block n of 128 keys, output column part c, query head h, batch b):
      dV[:, c] = Σ_m Pᵀ·dO[:, c],   dK[:, c] = scale · Σ_m dSᵀ·Q[:, c]   (c: all columns at
      192/192, a half at 256: ``col_splits``)
    call: fn(stream, q, k, v, dout, lse_log2, delta, params, dk, dv)
    outputs dk (B, Sk, Hdk, D), dv (B, Sk, Hdk, Dv): Hdk = Hkv, input dtype (gqa=False) or
    Hdk = H, float32 per query head (gqa=True: the caller sums each group of H / Hkv heads).
  part "dq": per (query block m of 128 rows, query head h, batch b):
      dQ = scale · Σ_n dS·K
    call: fn(stream, q, k, v, dout, lse_log2, delta, params, dq)
    output dq (B, Sq, H, D) in the input dtype, scaled: written once, no float32 accumulator,
    no atomics.
  inputs as the fused backward's: q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv),
  dout (B, Sq, H, Dv) in dtype; lse_log2, delta (B, H, Sq) float32 (the preprocess's); params
  (4,) float32 [softmax_scale, softcap, window_left, window_right].

Varlen (``varlen=True``, :func:`split_varlen_configs`): both kernels on packed sequences, the
varlen backward's inputs and work lists (:func:`split_varlen_backward_signature`).

Both kernels write every output element exactly once from one CTA and read nothing they write:
they are deterministic, with or without ``deterministic`` (which the fused kernel needs for its
dQ reduce-adds); the backend uses them for both settings.

Why it fits (``col_splits``, the one rule for the number of column parts): at 192/192 one dK/dV
CTA per key block holds all of dK and dV (192 columns each) beside Sᵀ and dPᵀ of 64 query
columns (64 each): 512 columns exactly. At 256 that would be 640, so each of two CTAs per key
block accumulates half of dK's and dV's columns (D/2 = 128 each) beside Sᵀ and dPᵀ: 384 columns;
it recomputes Sᵀ and dPᵀ for its half (the other half's CTA computes the same ones): twice the
exp2 work and 3D instead of 2D MMA flops per (key, query) pair in the dK/dV kernel. A part must
start on a 128-byte swizzle atom of the transposed streamed view (64 16-bit columns), which
halves of 192 (96 columns) would not. The dQ CTA holds dQ (D columns) beside S and dP of 64
keys: 320 (192) or 384 (256) columns. Shared memory: the resident operands (K, V or Q, dO: 128
rows × D columns, 96 or 128 KiB) and two stages of the streamed one (64 rows) plus one of the
other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from jax_fa4.kernels.spec import (FLOAT_DTYPES, MASK_KINDS, SMEM_BUDGET_BYTES, KernelConfig,
                                  KernelSignature, TensorArg, attention_backward_signature,
                                  check_dtype_and_mask)
# the varlen backward's call contract (split_varlen_backward_signature builds on it)
from jax_fa4.kernels.varlen_bwd_config import varlen_attention_backward_signature
from jax_fa4.kernels.sm100.bwd_config import TMEM_COLUMNS

#: The (head_dim, head_dim_v) pairs the split backward serves.
SPLIT_HEAD_DIMS = ((192, 192), (256, 256))
#: The two kernels of the split backward.
PARTS = ("dkdv", "dq")


@dataclass(frozen=True)
class Sm100BwdSplitConfig(KernelConfig):
    """Compile key of one kernel of the sm100 split backward (module doc)."""

    kernel_name: ClassVar[str] = "sm100_bwd_split"

    part: str = "dkdv"  # "dkdv" | "dq"
    dtype: str = "bfloat16"
    head_dim: int = 256
    head_dim_v: int = 256
    mask: str = "none"  # "none" | "causal" | "local"
    has_softcap: bool = False
    # dkdv: dk/dv float32 per query head (the caller sums the groups); dq: always False
    gqa: bool = False
    # stages of the streamed operands: the one read by the first and the last GEMM of an
    # iteration (Q for dkdv, K for dq: >= 2, the next block's is loaded while it is in use) and
    # the other one (dO for dkdv, V for dq)
    stream_stages: int = 2
    other_stages: int = 1
    # packed sequences: varlen_signature's contract (split_varlen_configs)
    varlen: bool = False

    #: Rows of the resident operands per CTA (the TMEM lanes: keys for dkdv, queries for dq).
    tile_rows: ClassVar[int] = 128
    #: Rows of the streamed operands per iteration (the columns of Sᵀ / dPᵀ or S / dP).
    tile_cols: ClassVar[int] = 64
    #: 384 threads: warps 0-7 compute (two warpgroups, each half of the streamed block's
    #: columns; thread = TMEM lane), 8 MMA (+ TMEM allocation), 9 load, 10-11 idle.
    num_threads: ClassVar[int] = 384

    @classmethod
    def make(cls, part: str, dtype: str, head_dim: int, head_dim_v: int | None = None,
             mask: str = "none", has_softcap: bool = False, gqa: bool = False
             ) -> Sm100BwdSplitConfig:
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        cfg = cls(part=part, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, mask=mask,
                  has_softcap=bool(has_softcap), gqa=bool(gqa) and part == "dkdv")
        cfg.validate()
        return cfg

    # -- static checks ---------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first unsupported feature."""
        check_dtype_and_mask("sm100 split backward", self.dtype, self.mask)
        if self.part not in PARTS:
            raise ValueError(f"sm100 split backward: part {self.part!r} not one of {PARTS}")
        if (self.head_dim, self.head_dim_v) not in SPLIT_HEAD_DIMS:
            raise ValueError("sm100 split backward: head dims "
                             f"{self.head_dim}/{self.head_dim_v} not served (only "
                             f"{SPLIT_HEAD_DIMS}, Dv == D)")
        if self.gqa and self.part != "dkdv":
            raise ValueError("sm100 split backward: gqa is the dK/dV kernel's (dq is per query "
                             "head already)")
        if self.stream_stages < 2 or self.other_stages < 1:
            raise ValueError("sm100 split backward: stream_stages must be >= 2, other_stages "
                             ">= 1")
        if self.tmem_columns() > TMEM_COLUMNS:
            raise ValueError(f"sm100 split backward: {self.tmem_columns()} TMEM columns exceed "
                             f"{TMEM_COLUMNS}")
        if self.smem_bytes() > SMEM_BUDGET_BYTES:
            raise ValueError(f"sm100 split backward: {self.smem_bytes()} B of shared memory "
                             f"exceeds {SMEM_BUDGET_BYTES} B ({self.describe()})")

    # -- derived ---------------------------------------------------------------------------------
    @property
    def col_splits(self) -> int:
        """CTAs per resident block, one per part of the output columns: dkdv 1 where all of dK
        and dV fit one SM's TMEM beside Sᵀ and dPᵀ (D + Dv + 2·tile_cols <= 512: head dims
        192/192 and below), else 2 (each CTA a half of dK's and dV's columns: 256/256); dq 1."""
        fits = self.head_dim + self.head_dim_v + 2 * self.tile_cols <= TMEM_COLUMNS
        return 1 if self.part == "dq" or fits else 2

    @property
    def out_cols(self) -> int:
        """Columns of each output accumulator per CTA: dK's / dV's part (dkdv: D / col_splits),
        all of dQ (dq)."""
        return self.head_dim // self.col_splits

    def tmem_offsets(self) -> dict[str, int]:
        """TMEM column offsets. dkdv: dK half [0, Dh), dV half [Dh, 2Dh), Sᵀ, dPᵀ (64 each; 16-bit
        Pᵀ / dSᵀ of warpgroup w in their columns [32w, 32w + 16)); dq: dQ [0, D), S, dP (16-bit
        dS in dP's columns)."""
        o, tc = self.out_cols, self.tile_cols
        if self.part == "dkdv":
            return {"dk": 0, "dv": o, "s": 2 * o, "dp": 2 * o + tc}
        return {"dq": 0, "s": o, "dp": o + tc}

    def tmem_columns(self) -> int:
        return self.tmem_offsets()["dp"] + self.tile_cols

    def tmem_alloc_columns(self) -> int:
        n = 32
        while n < self.tmem_columns():
            n *= 2
        return n

    def smem_bytes(self) -> int:
        e = 2
        rows, cols = self.tile_rows, self.tile_cols
        d, dv = self.head_dim, self.head_dim_v
        # resident K, V (dkdv) / Q, dO (dq); streamed Q, dO / K, V; -lse, -delta (dkdv's)
        return (rows * (d + dv) * e + cols * (self.stream_stages * d + self.other_stages * dv)
                * e + 2 * self.stream_stages * cols * 4)

    def num_blocks(self, seqlen: int) -> int:
        """Resident blocks along the resident operand's sequence (keys for dkdv, queries for
        dq)."""
        return -(-seqlen // self.tile_rows)

    # -- KernelConfig contract ------------------------------------------------------------------
    def signature(self) -> KernelSignature:
        if self.varlen:
            return split_varlen_backward_signature(self.part, self.dtype, self.head_dim,
                                                   self.head_dim_v, self.gqa)
        return split_backward_signature(self.part, self.dtype, self.head_dim, self.head_dim_v,
                                        self.gqa)


def split_backward_signature(part: str, dtype: str, head_dim: int, head_dim_v: int,
                             gqa: bool) -> KernelSignature:
    """``fn(stream, q, k, v, dout, lse_log2, delta, params, *outputs)`` of the split backward:
    outputs (dk, dv) for part "dkdv" (float32 per query head when ``gqa``), (dq,) for "dq"."""
    d = head_dim
    fused = attention_backward_signature(dtype, d, head_dim_v, 128, gqa)
    # the fused backward's inputs up to params (same names, sample shapes, divisibility)
    inputs = fused.inputs[:7]
    b, sq, h, _ = inputs[0].sample_shape
    assert inputs[-1].name == "params"
    if part == "dq":
        outputs = (TensorArg("dq", dtype, (b, sq, h, d), (1, 1, 1, d)),)
    else:  # the fused backward's dk, dv (after its dq_accum)
        outputs = fused.outputs[1:]
    return KernelSignature(inputs=inputs, outputs=outputs)


def split_varlen_backward_signature(part: str, dtype: str, head_dim: int, head_dim_v: int,
                                    gqa: bool) -> KernelSignature:
    """``fn(stream, q, k, v, dout, lse_log2, delta, params, cu_seqlens_q, cu_seqlens_k, work,
    *outputs)`` of the varlen split backward: the inputs and dk / dv of the varlen backward's
    contract (``varlen_bwd_config.varlen_attention_backward_signature``: sequences packed as one
    batch entry, nothing batched) without its dq_accum; part "dq" writes dq (1, total_q, H, D) in
    the input dtype instead of dk, dv.

    work (W, 8) int32, one row per CTA of a resident block (dkdv: two CTAs, the column halves,
    per row): part "dkdv" takes the varlen backward's work list of key blocks of 128 (row =
    (sequence b, key block, cu_seqlens_q[b], cu_seqlens_k[b], seqlen_q(b), seqlen_k(b), ·, 0));
    part "dq" the same list built over query blocks of 128 with the roles of q and k swapped
    (row = (b, query block, cu_seqlens_k[b], cu_seqlens_q[b], seqlen_k(b), seqlen_q(b), ·, 0)).
    Sequence -1: nothing to do (lengths 0); -2 (ZERO_PADDING): write zeros to the output rows
    outside every sequence (dkdv: dk, dv from cu_seqlens_k; dq: dq from cu_seqlens_q)."""
    fused = varlen_attention_backward_signature(dtype, head_dim, head_dim_v, 128, gqa)
    inputs = fused.inputs[:7] + fused.inputs[8:]  # (no dq_accum)
    assert [a.name for a in inputs[7:]] == ["cu_seqlens_q", "cu_seqlens_k", "work"]
    if part == "dq":
        q = inputs[0]
        outputs = (dataclasses.replace(q, name="dq"),)
    else:  # the varlen backward's dk, dv (after its dq_accum)
        outputs = fused.outputs[1:]
    return KernelSignature(inputs=inputs, outputs=outputs)


def split_varlen_configs(dtype: str, head_dim: int, head_dim_v: int | None = None,
                         mask: str = "none", has_softcap: bool = False, gqa: bool = False
                         ) -> tuple[Sm100BwdSplitConfig, Sm100BwdSplitConfig]:
    """(dK/dV config, dQ config) of a varlen problem kind (split_varlen_backward_signature)."""
    return tuple(dataclasses.replace(c, varlen=True)
                 for c in split_configs(dtype, head_dim, head_dim_v, mask, has_softcap, gqa))


def serves(head_dim: int, head_dim_v: int) -> bool:
    """The split backward serves these head dims (the fused kernels do not)."""
    return (head_dim, head_dim_v) in SPLIT_HEAD_DIMS


def split_configs(dtype: str, head_dim: int, head_dim_v: int | None = None, mask: str = "none",
                  has_softcap: bool = False, gqa: bool = False
                  ) -> tuple[Sm100BwdSplitConfig, Sm100BwdSplitConfig]:
    """(dK/dV config, dQ config) of a problem kind."""
    return (Sm100BwdSplitConfig.make("dkdv", dtype, head_dim, head_dim_v, mask, has_softcap,
                                     gqa),
            Sm100BwdSplitConfig.make("dq", dtype, head_dim, head_dim_v, mask, has_softcap))


def shipped_configs() -> list[Sm100BwdSplitConfig]:
    """Every split backward variant the package precompiles: both parts of each dtype, head dims,
    mask kind and softcap, dense and varlen; the dK/dV part with and without gqa (the dQ part
    has no gqa field)."""
    out = []
    for dtype in FLOAT_DTYPES:
        for d, dv in SPLIT_HEAD_DIMS:
            for mask in MASK_KINDS:
                for softcap in (False, True):
                    for gqa in (False, True):
                        out += split_configs(dtype, d, dv, mask, softcap, gqa)
                        out += split_varlen_configs(dtype, d, dv, mask, softcap, gqa)
    return list(dict.fromkeys(out))  # (the dq configs do not depend on gqa)


def test_configs() -> list[Sm100BwdSplitConfig]:
    """The compile test's configs: both parts at bf16, head dim 256, causal; both varlen parts
    with a local window, softcap and (dK/dV) GQA; the one-part dK/dV kernel (192/192, causal)."""
    return [*split_configs("bfloat16", 256, 256, "causal"),
            *split_varlen_configs("bfloat16", 256, 256, "local", True, True),
            split_configs("bfloat16", 192, 192, "causal")[0]]
