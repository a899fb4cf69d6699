"""Compile key and tuning table of the Blackwell (sm_100a) forward attention kernel.

Importable without the compiler: nothing here imports ``cutlass`` at module level.

Same contract as the Hopper forward (``jax_fa4/kernels/sm90/fwd_config.py``): per (batch b, query
head h), with kv head h // (H // Hkv),
    out[b, :, h] = softmax(mask(transform(q·kᵀ))) · v,    lse[b, h, :] = logsumexp of the row
transform = ``scale·s`` or ``softcap·tanh(s·scale/softcap)``; mask = key-length tail plus "causal"
(bottom-right aligned) or "local" (window_left, window_right; -1 = unbounded). Rows with no
visible key give out = 0, lse = -inf. softmax_scale must be positive.

Call: ``fn(stream, q, k, v, params, out, lse)`` with
    q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), params float32 (4,) =
    [softmax_scale, softcap (0 = off), window_left, window_right], out (B, Sq, H, Dv) (q's dtype),
    lse (B, H, Sq) float32. B, S, H dynamic; D, Dv fixed by the config.
Paged (``paged``) and varlen (``varlen``, packed sequences) configs take the calls of
``spec.paged_attention_forward_signature`` and ``spec.varlen_attention_forward_signature``; a
``segments`` config takes the segment-id tables after params, ``fn(stream, q, k, v, params,
seg_tiles, seg_rows, kv_ids, out, lse)``, and a ``max_logits`` config has a third output,
max_logits after lse (``forward_signatures_config``: the Hopper forward's contracts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

# the table chooses configs (whose fields are the key): not part of any kernel's key
from jax_fa4.kernels.forward_signatures_config import (segments_attention_forward_signature,
                                                       with_max_logits)
from jax_fa4.kernels.sm100.fwd_tuning import RESCALE_THRESHOLD, TUNING_TABLE, tuning_for
from jax_fa4.kernels.spec import (FLOAT_DTYPES, SMEM_CAPACITY_BYTES, KernelConfig,
                                  KernelSignature, attention_forward_signature,
                                  check_dtype_and_mask, paged_attention_forward_signature,
                                  varlen_attention_forward_signature)


#: Tensor memory columns per SM (128 lanes × 512 columns × 32 bit).
TMEM_COLUMNS = 512
#: SM count of a B200: the persistent grid size. A configuration value, never queried from the
#: device (compiling needs no GPU). A GPU with fewer SMs still runs correctly (more CTAs than SMs).
DEFAULT_NUM_SMS = 148
#: Software-exp2 share (of 32) at most, with softcap (FwdConfig.make).
SOFTCAP_EXP2_SW_PER_32 = 2
@dataclass(frozen=True)
class FwdConfig(KernelConfig):
    """Compile key of the sm100 forward kernel: everything that changes the generated code."""

    kernel_name: ClassVar[str] = "sm100_fwd"

    dtype: str = "bfloat16"
    head_dim: int = 128
    head_dim_v: int = 128
    mask: str = "none"  # "none" | "causal" | "local"
    has_softcap: bool = False
    # Tuning (from TUNING_TABLE by `FwdConfig.make`; part of the key because it changes code).
    tile_n: int = 128
    kv_stages: int = 2
    exp2_sw_per_32: int = 4
    rescale_threshold: float = RESCALE_THRESHOLD
    q_tiles: int = 2
    num_sms: int = DEFAULT_NUM_SMS
    # Paged KV (as on sm90; jax_fa4/backends/kernel.py calls it): K/V are a cache of tile_n-key
    # tiles, key block n of batch entry b is tile page_table[b, n], and b has seqused_k[b] keys.
    paged: bool = False
    # Varlen (as on sm90; jax_fa4/backends/kernel.py calls it): q, k, v, out packed along one axis,
    # sequence b's rows [cu_seqlens[b], cu_seqlens[b + 1]); lse (batch, H, max_seqlen_q) sets the
    # tile count.
    varlen: bool = False
    # Max logits (as on sm90; jax_fa4/backends/kernel.py calls it): a third output, (B, H, Sq)
    # float32, each row's largest logit (scaled, softcapped with a softcap) over the keys its
    # masks and segments leave visible (-inf: none). The softmax keeps it as a second running
    # max per row (the applied one lags the true max under conditional rescaling). Dense and
    # segment-id calls only.
    max_logits: bool = False
    # Segment ids (as on sm90; jax_fa4/backends/kernel.py calls it): query i sees key j only if
    # their ids are equal, from jax_fa4/segments.py's three tables built for 128-row Q tiles:
    # every role visits the union of its work tile's Q tiles' key-block ranges, and the softmax
    # masks each row to its key span (and compares ids key by key in flagged Q tiles). Dense
    # calls only (segments_attention_forward_signature).
    segments: bool = False

    tile_m: ClassVar[int] = 128  # one TMEM lane (one softmax thread) per query row

    @classmethod
    def make(cls, dtype: str, head_dim: int, head_dim_v: int | None = None, mask: str = "none",
             has_softcap: bool = False, **overrides) -> FwdConfig:
        """The config for a problem kind, tuning from the table (``overrides`` replace table
        fields, for experiments). Raises ValueError if unsupported."""
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        t = tuning_for(head_dim, head_dim_v, mask)
        # softcap: the tanh of every score keeps more of the row in flight; at the table's
        # software-exp2 share the softmax spills in its 184 registers, at 2 of 32 it does not
        sw = min(t.exp2_sw_per_32, SOFTCAP_EXP2_SW_PER_32) if has_softcap else t.exp2_sw_per_32
        fields = dict(tile_n=t.tile_n, kv_stages=t.kv_stages, exp2_sw_per_32=sw,
                      rescale_threshold=t.rescale_threshold, q_tiles=t.q_tiles)
        fields.update(overrides)
        cfg = cls(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, mask=mask,
                  has_softcap=bool(has_softcap), **fields)
        cfg.validate()
        return cfg

    # -- static checks ---------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first unsupported feature."""
        check_dtype_and_mask("sm100 forward", self.dtype, self.mask)
        tuning_for(self.head_dim, self.head_dim_v, self.mask)  # head dims in the table
        if self.head_dim % 16 or self.head_dim_v % 16:
            raise ValueError("sm100 forward: head dims must be multiples of 16")
        if self.tile_n not in (64, 128):
            raise ValueError(f"sm100 forward: tile_n {self.tile_n} not supported (64 or 128)")
        if self.q_tiles not in (1, 2):
            raise ValueError(f"sm100 forward: q_tiles {self.q_tiles} not supported (1 or 2)")
        if self.kv_stages < 2:
            raise ValueError("sm100 forward: kv_stages must be >= 2 (K and V share the ring)")
        if self.exp2_sw_per_32 % 2 or not 0 <= self.exp2_sw_per_32 <= 32:
            raise ValueError("sm100 forward: exp2_sw_per_32 must be even, in [0, 32] "
                             "(element pairs go to the packed software exp2)")
        if not self.rescale_threshold >= 0.0:
            raise ValueError("sm100 forward: rescale_threshold must be >= 0")
        if self.rescale_threshold > 12.0 and self.dtype == "float16":
            raise ValueError("sm100 forward: fp16 P overflows past 2^15; keep the threshold <= 12")
        if self.varlen and self.paged:
            raise ValueError("sm100 forward: varlen and paged KV cannot be combined (packed "
                             "sequences read K/V from cu_seqlens offsets, not from a page table)")
        if self.max_logits and (self.paged or self.varlen):
            raise ValueError("sm100 forward: max logits are implemented for dense and "
                             "segment-id calls only (not paged or varlen)")
        if self.segments and (self.paged or self.varlen):
            raise ValueError("sm100 forward: segment ids are implemented for dense calls only "
                             "(not paged or varlen)")
        if self.num_sms < 1:
            raise ValueError("sm100 forward: num_sms must be >= 1")
        softmax, correction, other = self.registers()
        if not (softmax >= self.launch_registers() >= max(correction, other)
                and 128 * (self.q_tiles * softmax + correction + other) <= 65536):
            raise ValueError(f"sm100 forward: register split {self.registers()} does not fit "
                             f"{self.launch_registers()} registers per thread at launch")
        if self.tmem_columns() > TMEM_COLUMNS:
            raise ValueError(f"sm100 forward: {self.tmem_columns()} TMEM columns exceed "
                             f"{TMEM_COLUMNS}")
        if self.smem_bytes() > SMEM_CAPACITY_BYTES:
            raise ValueError(f"sm100 forward: {self.smem_bytes()} B of shared memory exceeds "
                             f"{SMEM_CAPACITY_BYTES} B ({self.kv_stages} K/V stages)")

    # -- derived ---------------------------------------------------------------------------------
    @property
    def num_threads(self) -> int:
        """q_tiles softmax warpgroups, a correction warpgroup, and MMA / epilogue / load / idle."""
        return 32 * (4 * self.q_tiles + 8)

    def registers(self) -> tuple[int, int, int]:
        """setmaxnreg counts (softmax, correction, MMA / epilogue / load warps): per thread of
        each warpgroup, summing to the register file (64 K) over the CTA's warpgroups. With two
        Q tiles: the fewest that compile without spills (sm_100a, nvcc 13 ptxas): the MMA warp
        spills at 72 (64-bit shared-memory descriptors of both Q tiles), the correction warps
        at 56 (but for segment ids, softcap or max logits with a local mask, or softcap with a
        causal one when paged, where 56 / 88 is the split that compiles clean), which
        leaves 184 for the softmax (FA4 runs 192 / 80 / 48 with hand-written MMA issue). ptxas
        is sensitive here: re-check every shipped variant after any change (the compile tests
        do)."""
        if self.q_tiles == 1:
            return 240, 160, 112
        if (self.segments or ((self.has_softcap or self.max_logits) and self.mask == "local")
                or (self.has_softcap and self.paged and self.mask == "causal")):
            # the MMA warp's window / page / segment-table bookkeeping: it spills at 80 (paged
            # causal softcap: one 64-bit descriptor since the key count is clipped to the
            # page-table row)
            return 184, 56, 88
        return 184, 64, 80

    def launch_registers(self) -> int:
        """Registers per thread at launch (the register file over the CTA's threads, in steps of
        8): the softmax's setmaxnreg raises from it, the other warpgroups' lower from it."""
        return 65536 // self.num_threads // 8 * 8

    def tmem_columns(self) -> int:
        """Two S buffers (P aliases their upper half) + one O per Q tile."""
        return 2 * self.tile_n + self.q_tiles * self.head_dim_v

    def tmem_alloc_columns(self) -> int:
        """Allocation size: a power of two in [32, 512]."""
        n = 32
        while n < self.tmem_columns():
            n *= 2
        return n

    def kv_stage_bytes(self) -> int:
        return 2 * self.tile_n * max(self.head_dim, self.head_dim_v)

    def smem_bytes(self) -> int:
        """The kernel's shared storage, byte for byte: mbarriers, the TMEM address slot and the
        float32 row statistics (rescale factors per S buffer, 1/Σ per Q tile), padded to 1 KB;
        then O staging and Q per Q tile and the K/V ring (16-bit elements)."""
        barriers = 2 * self.q_tiles + 2 * self.kv_stages + 6 + 5 * self.q_tiles
        header = 8 * barriers + 4 + 4 * self.tile_m * (2 + self.q_tiles)
        header = -(-header // 1024) * 1024
        return (header + 2 * self.q_tiles * self.tile_m * (self.head_dim + self.head_dim_v)
                + self.kv_stages * self.kv_stage_bytes())

    # -- KernelConfig contract ------------------------------------------------------------------
    def signature(self) -> KernelSignature:
        if self.segments or self.max_logits:
            make = (segments_attention_forward_signature if self.segments
                    else attention_forward_signature)
            sig = make(self.dtype, self.head_dim, self.head_dim_v)
            return with_max_logits(sig) if self.max_logits else sig
        if self.varlen:
            return varlen_attention_forward_signature(self.dtype, self.head_dim, self.head_dim_v)
        if self.paged:
            return paged_attention_forward_signature(self.dtype, self.head_dim, self.head_dim_v,
                                                     self.tile_n)
        return attention_forward_signature(self.dtype, self.head_dim, self.head_dim_v)


def varlen_config(dtype: str, head_dim: int, head_dim_v: int | None = None, mask: str = "none",
                  has_softcap: bool = False) -> FwdConfig:
    """The varlen forward config of a problem kind: the table's tuning, persistent like every
    sm100 forward (the tile count comes from lse's (batch, H, max_seqlen_q) shape). Raises
    ValueError if the kind is unsupported."""
    return FwdConfig.make(dtype, head_dim, head_dim_v, mask, has_softcap, varlen=True)


def max_logits_config(dtype: str, head_dim: int, head_dim_v: int | None = None,
                      mask: str = "none", has_softcap: bool = False) -> FwdConfig:
    """The dense forward that also writes each row's max logit: the table's tuning."""
    return FwdConfig.make(dtype, head_dim, head_dim_v, mask, has_softcap, max_logits=True)


def segments_config(dtype: str, head_dim: int, head_dim_v: int | None = None,
                    mask: str = "none", has_softcap: bool = False,
                    max_logits: bool = False) -> FwdConfig:
    """The forward with segment ids (and, ``max_logits``, the per-row max output) for a problem
    kind: the table's tuning."""
    return FwdConfig.make(dtype, head_dim, head_dim_v, mask, has_softcap, segments=True,
                          max_logits=max_logits)


def shipped_configs() -> list[FwdConfig]:
    """Every variant the package precompiles: all table rows × mask kinds × softcap, bf16 and
    fp16, each also paged, varlen, with max logits, and with segment ids (with and without
    max logits)."""
    out = []
    for dtype in FLOAT_DTYPES:
        for (d, dv), row in TUNING_TABLE.items():
            for mask in row:
                for softcap in (False, True):
                    for paged in (False, True):
                        out.append(FwdConfig.make(dtype, d, dv, mask, softcap, paged=paged))
                    out.append(varlen_config(dtype, d, dv, mask, softcap))
                    out.append(max_logits_config(dtype, d, dv, mask, softcap))
                    out += [segments_config(dtype, d, dv, mask, softcap, max_logits=ml)
                            for ml in (False, True)]
    return out


def test_configs() -> list[FwdConfig]:
    """The subset the compile test builds on every run: each head-dim row once (bf16, no mask),
    each mask kind and softcap once (bf16, hdim 128), fp16 once; varlen: bf16 hdim 64 and 128
    unmasked and causal, fp16 local + softcap, hdim 192/128 causal and 256; max logits: bf16
    hdim 128 causal, local + softcap (the softmax's tightest register split) and hdim 256
    (one Q tile); segment ids: bf16 hdim 128 unmasked and causal, local + softcap with max
    logits, fp16 hdim 64 and bf16 192/128 causal, bf16 256. The rest: precompile."""
    out = [FwdConfig.make("bfloat16", d, dv) for (d, dv) in TUNING_TABLE]
    out += [FwdConfig.make("bfloat16", 128, 128, "causal"),
            FwdConfig.make("bfloat16", 128, 128, "local", True),
            FwdConfig.make("float16", 64, 64, "causal", True)]
    out += [varlen_config("bfloat16", d, d, mask) for d in (64, 128) for mask in ("none", "causal")]
    out += [varlen_config("float16", 128, 128, "local", True),
            varlen_config("bfloat16", 192, 128, "causal"),
            varlen_config("bfloat16", 256, 256)]
    out += [max_logits_config("bfloat16", 128, 128, "causal"),
            max_logits_config("bfloat16", 128, 128, "local", True),
            max_logits_config("bfloat16", 256, 256)]
    out += [segments_config("bfloat16", 128, 128), segments_config("bfloat16", 128, 128, "causal"),
            segments_config("bfloat16", 128, 128, "local", True, max_logits=True),
            segments_config("float16", 64, 64, "causal"),
            segments_config("bfloat16", 192, 128, "causal"), segments_config("bfloat16", 256, 256)]
    return out
