"""Tuning tables of the Hopper (sm_90a) forward: which tile, pipeline depth and mainloop
options each problem kind (head dims, mask kind; 16-bit or FP8) gets.

These tables only choose configs: their choices reach the generated code solely as
``FwdConfig`` fields, and every field is part of a kernel's cache key. So this module is not in
any kernel's key (``jax_fa4.ffi.sources.TUNING_MODULES``): a table edit recompiles only the
configs whose fields it changed, not the whole forward family. Keep it that way: nothing here
may be read by kernel code (tests/test_cache_keys.py checks that only config modules import it).
"""

from __future__ import annotations

from dataclasses import dataclass

from jax_fa4.kernels.spec import lookup_tuning


@dataclass(frozen=True)
class Sm90FwdTuning:
    """The tuning choices for one (head_dim, head_dim_v, mask kind) row."""

    tile_m: int  # 64 rows per consumer warpgroup
    tile_n: int
    stages: int = 2  # K and V pipeline depth
    # issue S_j = Q·K_jᵀ and O += P_{j-1}·V_{j-1} back to back, softmax S_j while the PV GEMM runs
    intra_wg_overlap: bool = True
    # v2 options (see FwdConfig for their meaning)
    pingpong: bool = False
    rescale_threshold: float = 0.0
    num_sms: int = 0
    rescale_skip: bool = False


# THE tuning table: (head_dim, head_dim_v) -> {mask kind: tuning}. Start points from FA4's H100
# choices; the hdim 64 and 256 rows of "none"/"causal" are the winners of
# benchmarks/fwd_variants.py on the H200 (three consumer warpgroups at hdim 64, ping-pong with
# the rescale threshold at hdim 256: benchmarks/results/fwd-variants-nvidia-h200-2026-11-30.json;
# the same on the causal hdim-64 tile, 479 against 447 TFLOP/s:
# benchmarks/results/fwd-variants-d64-pp-nvidia-h200-2026-11-30.json); hdim 96 "none" is
# ping-pong (559-560 TFLOP/s against 431-432 without, tile 128x144 552-567, two H200 runs; causal
# keeps the plain tile: 512-516 against 501-504 with ping-pong; in benchmarks/results/:
# fwd-variants-d96-nvidia-h200-2026-12-02.json, fwd-variants-d96-nvidia-h200-2026-12-02-2.json).
# Same for both 16-bit dtypes. Only the rows listed here are supported (and compiled by the
# tests).
# docs/kernels/sm90-forward.md has the options measured and not shipped.
_T = Sm90FwdTuning
_PP_RS = dict(pingpong=True, rescale_threshold=8.0)
TUNING_TABLE: dict[tuple[int, int], dict[str, Sm90FwdTuning]] = {
    (64, 64): {"none": _T(192, 128), "causal": _T(192, 128, **_PP_RS), "local": _T(128, 128)},
    (96, 96): {"none": _T(128, 128, pingpong=True), "causal": _T(128, 128), "local": _T(128, 128)},
    (128, 128): {"none": _T(128, 128), "causal": _T(128, 128), "local": _T(128, 128)},
    (192, 128): {"none": _T(128, 128), "causal": _T(128, 128), "local": _T(128, 96)},
    (192, 192): {"none": _T(128, 112), "causal": _T(128, 112), "local": _T(128, 96)},
    (256, 256): {"none": _T(128, 80, **_PP_RS), "causal": _T(128, 80, **_PP_RS),
                 "local": _T(128, 64)},
}


#: The FP8 forward's tuning table (e4m3 q, k, v; bfloat16 out): key blocks of 32·k
#: keys (the e4m3 P·V WGMMA's K step), half the shared memory per element of the 16-bit tiles.
#: Measured on the H200 (benchmarks/results/fp8-tiles-nvidia-h200-2026-12-03.json): hdim 128
#: three consumer warpgroups (192 rows) on 96-key blocks, 3 stages, 3-way ping-pong and the
#: exact rescale skip (854-863 TFLOP/s against 729 for a 128x128 ping-pong tile, 787-838 for
#: 128x160), hdim 64 a 160-key block of 192 rows (+4-6 %), hdim 256 ping-pong with the rescale
#: skip; hdim 128 causal without the skip (749 / 774 against 712 / 690 with it in two
#: in-process comparisons, measured, no result file kept, while the bench across runs is flat;
#: not understood). No conditional rescale threshold (it fails the accuracy rule, see
#: validate_fp8); software exp2 lost everywhere (-3 ... -18 %:
#: benchmarks/results/fp8-tuning-nvidia-h200-2026-12-03.json).
_PP_S3_SK = dict(pingpong=True, stages=3, rescale_skip=True)  # 3-way with tile_m 192
_PP_SK = dict(pingpong=True, rescale_skip=True)
FP8_TUNING_TABLE: dict[tuple[int, int], dict[str, Sm90FwdTuning]] = {
    (64, 64): {"none": _T(192, 160), "causal": _T(192, 160), "local": _T(128, 128)},
    (128, 128): {"none": _T(192, 96, **_PP_S3_SK), "causal": _T(192, 96, pingpong=True, stages=3),
                 "local": _T(128, 128)},
    (256, 256): {"none": _T(128, 128, **_PP_SK), "causal": _T(128, 128, **_PP_SK),
                 "local": _T(128, 128)},
}


def tuning_for(head_dim: int, head_dim_v: int, mask: str, fp8: bool = False) -> Sm90FwdTuning:
    """The row of TUNING_TABLE (16-bit inputs) or FP8_TUNING_TABLE (``fp8``) for a problem kind;
    ValueError when the table has no such row."""
    table = FP8_TUNING_TABLE if fp8 else TUNING_TABLE
    return lookup_tuning(table, head_dim, head_dim_v, mask, "sm90 forward")


#: FP8 key blocks with a softcap, where the table's block leaves the softcap's tanh too few
#: registers: hdim 64's 192x160 spills (ptxas: 63 LDL / 49 STL in `precompile --check`),
#: 192x128 does not.
FP8_SOFTCAP_TILE_N: dict[tuple[int, int], int] = {(64, 64): 128}
