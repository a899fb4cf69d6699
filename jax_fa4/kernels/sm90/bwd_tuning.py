"""Tuning table of the Hopper (sm_90a) backward: which tile, pipeline depths and main-loop
options each problem kind (head dims, mask kind) gets.

The table only chooses configs: its choices reach the generated code solely as
``BwdConfig`` fields, and every field is part of a kernel's cache key. So this module is not in
any kernel's key (``jax_fa4.ffi.sources.TUNING_MODULES``): a table edit recompiles only the
configs whose fields it changed, not the whole family. Keep it that way: nothing here may be
read by kernel code (tests/test_cache_keys.py checks that only config modules import it).
"""

from __future__ import annotations

from dataclasses import dataclass

from jax_fa4.kernels.spec import MASK_KINDS, lookup_tuning


@dataclass(frozen=True)
class Sm90BwdTuning:
    tile_m: int  # query rows per iteration (64 or 128)
    tile_n: int  # keys per CTA (64 or 128)
    stages: int  # Q and dO pipeline depth
    pds_stages: int  # P and dS shared-memory buffers (1 or 2)
    swap_sdp: bool = False  # Sᵀ / dPᵀ GEMMs, P and dS stay in registers for dV / dK (BwdConfig)
    reverse_launch: bool = False  # key blocks launched from the last one down (BwdConfig)
    stats_smem: bool = False  # lse_log2 / delta through shared memory, loaded by a producer warp
    dq_red: bool = False  # dQ added to dq_accum by the MMA threads (red.global), no dQ buffer
    # Q and dO pipeline depth where dq_red applies (0: ``stages``): the shared memory of the dQ
    # buffer it frees may hold another stage; ``stages`` stays the depth of the calls dq_red
    # does not serve (deterministic, varlen, a row's swap_sdp that does not apply)
    red_stages: int = 0
    # GQA calls with one CTA per (key block, kv head) summing its group's query heads
    # (BwdConfig.group_heads), when that launches at least GROUP_HEADS_MIN_CTAS CTAs. It passes
    # the GPU tests (its "group" opt-in form, tools/variants.OPT_IN_FORMS) and is off in every
    # row: +2 % over the per-query-head form at B4·S8192·H32/8 D128 on an H100
    # (benchmarks/results/bwd-variants-d128-pair-group-nvidia-h100-2026-12-05.json), too
    # little to choose it without a whole-step A/B. It compiles clean at head dims 96, 128 and
    # 192/128 and puts an accumulator in local memory at 64 and 256 (BwdConfig.validate).
    group_heads: bool = False
    # the split-operand CTA pair (bwd_pair_config.BwdPairConfig, its own kernel) for the dense
    # calls it serves (not deterministic, varlen, segment ids or sink_grad), with its lookahead
    # option and, for GQA calls, its group_heads form (pair_group_heads). Off in every row: it
    # passes the GPU tests (tests/gpu/test_sm90_bwd.py::test_pair_kernel_matches_reference) and
    # is slower than the one-CTA kernel at head dims 128, 192/128 and 256 on an H100
    # (benchmarks/results/bwd-variants-d{128-pair-group,192-pair,256-pair}-nvidia-h100-
    # 2026-12-05.json).
    pair: bool = False
    pair_lookahead: bool = False
    pair_group_heads: bool = False
    # the GEMM descriptors from the warpgroup's slice (BwdConfig.wg_fragments), and with
    # stats_smem the padded statistics rows (BwdConfig.stats_padded): measured per row below
    wg_fragments: bool = False
    stats_padded: bool = False


#: The fewest CTAs (B·Hkv·key blocks) for which a GQA call takes the group_heads form: two per
#: SM of an H100 / H200 (132 SMs, one backward CTA each). Below it the per-query-head form keeps
#: the GPU busier. A starting point, not measured.
GROUP_HEADS_MIN_CTAS = 264


# THE tuning table: (head_dim, head_dim_v) -> {mask kind: tuning}. Warpgroup layouts of the five
# GEMMs follow from the tile (BwdConfig.wg_layouts). Start points from FA4's H100 choices
# restricted to what the kernel implements (P and dS through shared memory, except swap_sdp).
# hdim 64, 128 and 256 re-measured on the H200 over every valid tile / stage combination
# (benchmarks/bwd_variants.py: benchmarks/results/bwd-variants-nvidia-h200-2026-11-30.json, and
# bwd-variants-d128-rotated-rounds-nvidia-h200-2026-11-30.json for the P / dS buffers): these
# start points are the fastest; hdim 96 and 192 are not re-measured. Key blocks launch from the
# last one down (reverse_launch): +1–8 % on 11 of the 12 anchor shapes
# (benchmarks/results/bwd-variants-rev-nvidia-h200-2026-11-30.json).
# Waiting for a block's dK GEMM only after the next block's S / dP measured 0.3–4 % slower than
# the plain loop on all 8 head dim 128 shapes (measured, no result file kept): the option was
# removed (docs/kernels/sm90-backward.md, "Options measured and not shipped").
# hdim 128: swap_sdp with stats_smem, +1 … +5 % on all 8 head dim 128 shapes against the plain
# loop (benchmarks/results/bwd-variants-stats-nvidia-h200-2026-12-02.json), and dq_red on top,
# +1 … +5 % more (bwd-variants-red-nvidia-h200-2026-12-02.json); hdim 96 causal: swap_sdp with
# stats_smem, +5.5 % (unmasked: 2 % slower, off;
# benchmarks/results/bwd-variants-d96-forms-nvidia-h200-2026-12-02.json). hdim 256: dq_red in
# the plain loop with a second Q/dO stage in the dQ buffer's place, 1.46 / 1.49x the one-stage
# row at B4·S8192·H8 on an H100 (benchmarks/results/bwd-variants-d256-red-nvidia-h100-
# 2026-12-05.json). A row's swap_sdp applies without softcap and when not deterministic (make);
# its reverse_launch only where swap_sdp is off, its stats_smem only with it, its dq_red with
# it where the row has both, and never deterministic or varlen. docs/kernels/sm90-backward.md.
# wg_fragments (+ stats_padded where the row reads its statistics through shared memory), on an
# H100, same process against the row without them, two runs at head dim 128
# (benchmarks/results/bwd-variants-d128-wgfrag-nvidia-h100-2026-12-05.json, its -2 rerun, and
# the d64 / d96 / d256 / d192 files of that date):
# hdim 128 none and causal +0 … +9.6 % on all 8 shapes in both runs (wg_fragments alone fell
# 1–2 % at GQA 32/8 unmasked); hdim 64 +0.9 / +4.6 %; hdim 96 causal +5.0 % (unmasked −4.3 %
# with wg_fragments: off); hdim 256 causal +5.6 % (unmasked −1.5 %: off); 192/128 +0.3 / +0.6 %
# (noise: off). Local-window rows were not measured: off.
_T = Sm90BwdTuning
_REV = dict(reverse_launch=True)
_WG = dict(wg_fragments=True)
_WG_PAD = dict(wg_fragments=True, stats_padded=True)
TUNING_TABLE: dict[tuple[int, int], dict[str, Sm90BwdTuning]] = {
    (64, 64): {k: _T(128, 128, 2, 1, **_REV, **(_WG if k != "local" else {}))
               for k in MASK_KINDS},
    (96, 96): {k: _T(64, 128, 2, 2, swap_sdp=k == "causal", stats_smem=k == "causal", **_REV,
                     **(_WG_PAD if k == "causal" else {}))
               for k in MASK_KINDS},
    (128, 128): {k: _T(64, 128, 2, 2, swap_sdp=True, stats_smem=True, dq_red=True, **_REV,
                       **(_WG_PAD if k != "local" else {}))
                 for k in MASK_KINDS},
    (192, 128): {k: _T(64, 64, 2, 2, **_REV) for k in MASK_KINDS},
    (256, 256): {k: _T(64, 64, 1, 1, dq_red=True, red_stages=2, **_REV,
                       **(_WG if k == "causal" else {}))
                 for k in MASK_KINDS},
}


def tuning_for(head_dim: int, head_dim_v: int, mask: str) -> Sm90BwdTuning:
    return lookup_tuning(TUNING_TABLE, head_dim, head_dim_v, mask, "sm90 backward")
