"""Tuning table of the Blackwell (sm_100a) backward: which pipeline depths, dQ tiles and 1- or
2-CTA kernel each problem kind (head dims, mask kind) gets.

The table only chooses configs: its choices reach the generated code solely as
``Sm100BwdConfig`` fields, and every field is part of a kernel's cache key. So this module is
not in any kernel's key (``jax_fa4.ffi.sources.TUNING_MODULES``): a table edit recompiles only the
configs whose fields it changed, not the whole family. Keep it that way: nothing here may be
read by kernel code (tests/test_cache_keys.py checks that only config modules import it).
"""

from __future__ import annotations

from dataclasses import dataclass

from jax_fa4.kernels.spec import MASK_KINDS, lookup_tuning


@dataclass(frozen=True)
class Sm100BwdTuning:
    q_stages: int = 2  # Q (and lse / delta) pipeline depth
    do_stages: int = 1  # dO pipeline depth
    dq_cols: int = 32  # columns of one dQ reduce-add tile (128 rows × dq_cols float32)
    dq_stages: int = 2  # shared-memory staging buffers of the dQ reduce-adds
    two_cta: bool = False  # 2-CTA MMAs: a cluster of two CTAs per 256 keys (bwd_2cta.py)


# THE tuning table: (head_dim, head_dim_v) -> {mask kind: tuning}. tile_m = tile_n = 128 (one
# TMEM lane per key row, one MMA per tile). Sized by shared memory (bwd_config.smem_bytes);
# start points only: nothing here was measured (no Blackwell GPU in this project).
# Head dims 128 and 192/128 run the 2-CTA kernel (FA4's choice there): each CTA reads half of
# the Q / dO operand bytes per FLOP and adds half of the dQ rows; its shared memory holds one
# stage of Q, Qᵀ, dO and dOᵀ (sQ/sdO are query halves, sQᵀ/sdOᵀ column halves; at 192 Q and Qᵀ
# share one buffer, dO and dOᵀ another) and 8-column dQ boxes. 192/128 needs 2-CTA: the 1-CTA
# TMEM accumulators dK + dV + Sᵀ + dPᵀ(=dQ) would take 192+128+128+192 = 640 columns > 512; the
# 2-CTA layout overlaps dPᵀ with Sᵀ's upper half (bwd_2cta.py, "serial").
# Not here: (192, 192) and (256, 256), served by the split backward (bwd_split_config.py: a dK/dV
# kernel and a dQ kernel; the fused kernels' dK + dV with Sᵀ and dPᵀ exceed the 512 TMEM columns).
_T = Sm100BwdTuning
TUNING_TABLE: dict[tuple[int, int], dict[str, Sm100BwdTuning]] = {
    (64, 64): {k: _T(2, 2, 32, 2) for k in MASK_KINDS},
    (96, 96): {k: _T(2, 2, 32, 2) for k in MASK_KINDS},
    (128, 128): {k: _T(1, 1, 8, 2, two_cta=True) for k in MASK_KINDS},
    (192, 128): {k: _T(1, 1, 8, 2, two_cta=True) for k in MASK_KINDS},
}


#: The varlen backward's rows (bwd_config.varlen_config): the 1-CTA kernel at every head dim it
#: fits. 64 and 96 are the dense table's rows; 128 (2-CTA in the dense table) the 1-CTA form of
#: tests/test_sm100_bwd_protocol.py's model (two Q stages, one dO stage, 16-column dQ boxes:
#: 210 KB of shared memory; 32-column boxes would take 226 KB). 192/128 (no 1-CTA kernel fits:
#: its TMEM would take 640 columns > 512) runs the 2-CTA kernel's varlen mode with the dense
#: row's tuning (one pair per 256-key span of a sequence, bwd_2cta.py).
VARLEN_TUNING: dict[tuple[int, int], Sm100BwdTuning] = {
    (64, 64): _T(2, 2, 32, 2),
    (96, 96): _T(2, 2, 32, 2),
    (128, 128): _T(2, 1, 16, 2),
    (192, 128): _T(1, 1, 8, 2, two_cta=True),
}

#: The segment-id backward's rows (bwd_config.segments_config): the 1-CTA kernel at every head
#: dim it fits, the varlen rows' 1-CTA ones (the two modes share one 1-CTA tuning until one of
#: them is measured apart). Its row-id stages add 1 KB of shared memory (211 KB at head dim
#: 128). 192/128 (1-CTA TMEM: 640 columns > 512) runs the 2-CTA kernel's segment-id mode with
#: its own row: the dense row's layout takes 231,424 B of the 232,448 B budget, too much for the
#: 1 KB of row-id stages, so one dQ staging buffer instead of two (227,328 B, with the stages
#: 228,368 B). Unmeasured: a single staging buffer makes each dQ chunk's shared-memory stores
#: wait for the previous chunk's reduce-add to have read its buffer.
SEGMENTS_TUNING: dict[tuple[int, int], Sm100BwdTuning] = {
    **{dims: row for dims, row in VARLEN_TUNING.items() if not row.two_cta},
    (192, 128): _T(1, 1, 8, 1, two_cta=True),
}


def tuning_for(head_dim: int, head_dim_v: int, mask: str) -> Sm100BwdTuning:
    return lookup_tuning(TUNING_TABLE, head_dim, head_dim_v, mask, "sm100 backward",
                         unsupported_hint="; 192/192 and 256/256 are not the fused 1-CTA or "
                         "2-CTA kernels' (dK + dV + Sᵀ + dPᵀ exceed 512 TMEM columns) but the "
                         "split backward's (bwd_split_config.py: a dK/dV and a dQ kernel)")
