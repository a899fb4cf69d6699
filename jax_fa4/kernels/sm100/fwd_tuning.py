"""Tuning table of the Blackwell (sm_100a) forward: which key block, K/V ring depth,
software-exp2 share, rescale threshold and Q tiles each problem kind (head dims, mask kind)
gets.

The table only chooses configs: its choices reach the generated code solely as
``FwdConfig`` fields, and every field is part of a kernel's cache key. So this module is not in
any kernel's key (``jax_fa4.ffi.sources.TUNING_MODULES``): a table edit recompiles only the
configs whose fields it changed, not the whole family. Keep it that way: nothing here may be
read by kernel code (tests/test_cache_keys.py checks that only config modules import it).
"""

from __future__ import annotations

from dataclasses import dataclass

from jax_fa4.kernels.spec import lookup_tuning

#: Conditional rescaling threshold in log2 units (FA4): P may reach 2^8 before the 16-bit cast.
RESCALE_THRESHOLD = 8.0


@dataclass(frozen=True)
class Sm100FwdTuning:
    """The tuning choices for one (head_dim, head_dim_v, mask kind) row."""

    tile_n: int = 128  # key block (the MMA N of S = Q·Kᵀ); tile_m is 128 (one row per thread)
    kv_stages: int = 2  # stages of the shared K/V shared-memory ring
    exp2_sw_per_32: int = 4  # of every 32 scores of a row, this many use the FMA-pipe exp2
    rescale_threshold: float = RESCALE_THRESHOLD
    q_tiles: int = 2  # Q tiles of 128 rows per CTA: 2 = two ping-ponging softmax warpgroups


# THE tuning table: (head_dim, head_dim_v) -> {mask kind: tuning}. Start points from FA4's B200
# choices (16/128 emulated exps, 8/128 in some causal cases; 8/128 for
# local masks too, whose softmax with softcap spills at 16/128 in 184 registers), sized for the
# shared memory of this kernel (q_tiles × (Q + O staging) + the K/V ring + 2-3 KB of row
# statistics); not measured (no Blackwell GPU yet). Same for both 16-bit dtypes. Only the rows
# listed here are supported.
_T = Sm100FwdTuning
TUNING_TABLE: dict[tuple[int, int], dict[str, Sm100FwdTuning]] = {
    (64, 64): {"none": _T(128, 10), "causal": _T(128, 10, 2), "local": _T(128, 10, 2)},
    (96, 96): {"none": _T(128, 5), "causal": _T(128, 5, 2), "local": _T(128, 5, 2)},
    (128, 128): {"none": _T(128, 3), "causal": _T(128, 3, 2), "local": _T(128, 3, 2)},
    # two O tiles of 128 columns next to two 128-column S buffers fill TMEM: one Q tile here
    (192, 128): {"none": _T(128, 3, q_tiles=1), "causal": _T(128, 3, 2, q_tiles=1),
                 "local": _T(128, 3, 2, q_tiles=1)},
    # 192/192: one Q tile as well (2·128 S columns + 192 O columns); two K/V stages fit
    (192, 192): {"none": _T(128, 2, q_tiles=1), "causal": _T(128, 2, 2, q_tiles=1),
                 "local": _T(128, 2, 2, q_tiles=1)},
    # hdim 256: one Q tile, S buffers of 64 keys (O alone is 256 columns). FA4 has a dedicated
    # 2-CTA kernel for 256; this row is the generic kernel's fallback.
    (256, 256): {"none": _T(64, 3, q_tiles=1), "causal": _T(64, 3, 2, q_tiles=1),
                 "local": _T(64, 3, 2, q_tiles=1)},
}


def tuning_for(head_dim: int, head_dim_v: int, mask: str) -> Sm100FwdTuning:
    return lookup_tuning(TUNING_TABLE, head_dim, head_dim_v, mask, "sm100 forward")
