"""Compile key of the Hopper (sm_90a) backward's split-operand CTA pair (``sm90_bwd_pair``,
bwd_pair.py). No compiler import here.

The call contract, dq_accum layout and postprocess are the one-CTA backward's
(``bwd_config``): a pair config is a ``BwdConfig`` whose kernel is another. What differs is the
main kernel's inside: a cluster of two CTAs per block of 128 keys, rank 0 holding Q, K and dK,
rank 1 dO, V, K's second half and dV, exchanging dP − delta and P, dS through distributed
shared memory; every dQ addition covers 128 keys (bwd_pair.py's docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from jax_fa4.kernels.sm90.bwd_config import BwdConfig
# the table chooses configs (whose fields are the key): not part of any kernel's key
from jax_fa4.kernels.sm90.bwd_tuning import tuning_for
from jax_fa4.kernels.spec import SMEM_BUDGET_BYTES, check_dtype_and_mask

#: (head_dim, head_dim_v) the pair serves: the tuning table's rows whose dQ quarter per MMA
#: warpgroup (D / 4 columns: 32, 48, 64) is a WGMMA N extent and a swizzle-atom multiple
PAIR_HEAD_DIMS = ((128, 128), (192, 128), (256, 256))


@dataclass(frozen=True)
class BwdPairConfig(BwdConfig):
    """A ``BwdConfig`` (same fields, same call) of the split-operand pair: ``tile_n`` keys per
    cluster, ``stages`` Q (rank 0) / dO (rank 1) pipeline stages, ``pds_stages`` P / dS exchange
    buffers, ``group_heads`` (GQA: one cluster per kv head walking its group's query heads, dK /
    dV per kv head in the input dtype, as ``BwdConfig.group_heads``). The one-CTA kernel's loop
    options (swap_sdp, stats_smem, dq_red, reverse_launch) stay off: the pair has its own loop,
    and adds dQ from its registers."""

    kernel_name: ClassVar[str] = "sm90_bwd_pair"

    tile_m: int = 64
    tile_n: int = 128
    stages: int = 2
    pds_stages: int = 2
    # each rank issues the next block's first GEMM (S or dP) before this block's accumulated
    # and dQ GEMMs, so that rank 0's exponentials of block j + 1 run under its dK / dQ GEMMs
    # of block j, and rank 1's dP of block j + 1 while P and dS of block j come (bwd_pair.py);
    # needs two exchange buffers (rank 0 writes P of block j + 1 while block j's GEMMs read D)
    lookahead: bool = False

    @classmethod
    def of(cls, cfg: BwdConfig, stages: int = 2, pds_stages: int = 2,
           lookahead: bool = False, group_heads: bool | None = None) -> BwdPairConfig:
        """The pair form of ``cfg``'s problem kind (dtype, head dims, mask, softcap, gqa or
        group_heads: ``cfg``'s unless ``group_heads`` says, which for a GQA problem takes the
        one cluster per kv head form)."""
        grouped = cfg.group_heads if group_heads is None else group_heads
        if grouped and not (cfg.gqa or cfg.group_heads):
            raise ValueError("sm90 backward pair: group_heads is a form of a GQA problem")
        out = cls(dtype=cfg.dtype, head_dim=cfg.head_dim, head_dim_v=cfg.head_dim_v,
                  mask=cfg.mask, has_softcap=cfg.has_softcap,
                  gqa=(cfg.gqa or cfg.group_heads) and not grouped, group_heads=grouped,
                  stages=stages, pds_stages=pds_stages, lookahead=lookahead)
        out.validate()
        return out

    def validate(self) -> None:
        """Raise ValueError naming the first unsupported feature."""
        check_dtype_and_mask("sm90 backward pair", self.dtype, self.mask)
        if (self.tile_m, self.tile_n) != (64, 128):
            raise ValueError("sm90 backward pair: needs a 64x128 tile (64 keys of dK or dV per "
                             f"MMA warpgroup), not {self.tile_m}x{self.tile_n}")
        if (self.head_dim, self.head_dim_v) not in PAIR_HEAD_DIMS:
            raise ValueError("sm90 backward pair: head_dim/head_dim_v in "
                             f"{PAIR_HEAD_DIMS} required, not {self.head_dim}/{self.head_dim_v}")
        if self.stages < 1 or self.pds_stages not in (1, 2):
            raise ValueError("sm90 backward pair: stages >= 1 and pds_stages in {1, 2} required")
        if self.lookahead and (self.pds_stages != 2 or self.stages < 2):
            raise ValueError("sm90 backward pair: lookahead needs pds_stages == 2 (P of the next "
                             "block is written while this block's GEMMs read D) and stages >= 2")
        off = [name for name in ("deterministic", "varlen", "segments", "sink_grad", "swap_sdp",
                                 "stats_smem", "dq_red", "reverse_launch")
               if getattr(self, name)]
        if off:
            raise ValueError(f"sm90 backward pair: {', '.join(off)} not implemented (dense calls, "
                             "the pair's own loop, dQ added from registers)")
        if self.group_heads and self.gqa:
            raise ValueError("sm90 backward pair: group_heads writes dK / dV per kv head itself "
                             "(gqa=False's outputs), not with gqa")
        if self.smem_bytes() > SMEM_BUDGET_BYTES:
            raise ValueError(f"sm90 backward pair: {self.smem_bytes()} B of shared memory exceeds "
                             f"{SMEM_BUDGET_BYTES} B ({self.describe()})")

    def smem_bytes(self) -> int:
        """Per CTA, the two ranks' buffers overlaid (bwd_pair.py): Q or dO stages, K or V,
        float32 dP − delta or K's second half, P and dS per exchange stage."""
        e, tm, tn, D = 2, self.tile_m, self.tile_n, self.head_dim
        wide = max(D, self.head_dim_v)
        return (self.stages * tm * wide * e + tn * wide * e + max(tm * tn * 4, tn * D // 2 * e)
                + 2 * self.pds_stages * tm * tn * e)


def with_pair(cfg: BwdConfig) -> BwdConfig:
    """``cfg`` (``BwdConfig.make``'s choice for a call), or its split-operand pair form where the
    tuning row of its problem kind picks the pair (``Sm90BwdTuning.pair``) and the pair serves
    the call: a dense one, not deterministic and without segment ids or sink_grad, at head dims
    in PAIR_HEAD_DIMS. The row's ``pair_lookahead`` and, for GQA calls, ``pair_group_heads``
    choose its options."""
    row = tuning_for(cfg.head_dim, cfg.head_dim_v, cfg.mask)
    if (not row.pair or (cfg.head_dim, cfg.head_dim_v) not in PAIR_HEAD_DIMS
            or cfg.deterministic or cfg.varlen or cfg.segments or cfg.sink_grad):
        return cfg
    grouped = (cfg.gqa or cfg.group_heads) and row.pair_group_heads
    return BwdPairConfig.of(cfg, lookahead=row.pair_lookahead, group_heads=grouped)
