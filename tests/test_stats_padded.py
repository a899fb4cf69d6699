"""``BwdConfig.stats_padded``: the sm90 backward reads its row statistics past Sq unselected.

The config's stats warp loads lse_log2 / delta rows up to Sq_pad without clamping them to Sq,
and its MMA threads read them without the per-column compare-and-select of +inf / 0 for
queries past Sq; ``KernelBackend.backward_main`` pads both arrays to Sq_pad (+inf / 0) for such a
config. Lowered for CUDA without compiling (tests/cuda_lowering.py); the SASS side is in
tests/test_sm90_bwd_compile.py.
"""

from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple

import jax
import pytest
from cuda_lowering import backward_specs, recording_kernels

from jax_fa4 import backends
from jax_fa4.kernels.sm90.bwd_config import BwdConfig


class Opts(NamedTuple):
    softmax_scale: float | None = None
    window: tuple = (None, 0)
    softcap: float = 0.0
    deterministic: bool = False


def test_stats_padded_is_a_form_of_stats_smem():
    plain = BwdConfig.make("bfloat16", 64, 64, "none")  # (no stats_smem in that row)
    with pytest.raises(ValueError, match="stats_padded"):
        dataclasses.replace(plain, stats_padded=True).validate()
    dataclasses.replace(BwdConfig.make("bfloat16", 128, 128, "causal"),
                        stats_padded=True).validate()


def test_the_table_takes_the_forms_where_the_ab_chose_them():
    """wg_fragments (+ stats_padded where the statistics come through shared memory) in the rows
    bwd_tuning.TUNING_TABLE's A/B chose; stats_padded leaves with the swapped loop (softcap,
    deterministic, segment ids, varlen, sink_grad), wg_fragments stays."""
    def forms(*args, **kwargs):
        cfg = BwdConfig.make("bfloat16", *args, **kwargs)
        return cfg.wg_fragments, cfg.stats_padded

    assert forms(128, 128, "none") == forms(128, 128, "causal") == (True, True)
    assert forms(128, 128, "causal", gqa=True) == (True, True)
    assert forms(128, 128, "causal", has_softcap=True) == (True, False)
    assert forms(128, 128, "causal", deterministic=True) == (True, False)
    assert forms(128, 128, "causal", varlen=True) == (True, False)
    assert forms(128, 128, "local") == (False, False)
    assert forms(96, 96, "causal") == (True, True) and forms(96, 96, "none") == (False, False)
    assert forms(64, 64, "none") == forms(64, 64, "causal") == (True, False)
    assert forms(256, 256, "causal") == (True, False) and forms(256, 256, "none") == (False, False)
    assert forms(192, 128, "causal") == (False, False)


@pytest.mark.parametrize("padded", [False, True])
def test_backward_main_pads_the_row_statistics_for_the_config(padded):
    """Sq = 300 on 64-row query blocks: the main kernel reads 320 rows of lse_log2 and delta
    when the config is stats_padded, the call's 300 otherwise."""
    b, sq, h, d = 2, 300, 4, 128
    cfg = dataclasses.replace(BwdConfig.make("bfloat16", d, d, "causal"), stats_padded=padded)
    args = backward_specs(b, sq, sq, h, d)
    f = jax.jit(lambda *a: backends.get("sm90").backward(*a, Opts(), config=cfg))
    with recording_kernels("9.0") as kernels:
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert [c for c, _ in kernels if c.kernel_name == "sm90_bwd"] == [cfg]
    main = next(line for line in text.splitlines() if "sm90_bwd(" in line)
    operands = main.rsplit(" : (", 1)[1].split(") -> ")[0]
    rows = re.findall(rf"tensor<{b}x{h}x(\d+)xf32>", operands)
    assert rows[:2] == ([str(320)] * 2 if padded else [str(sq)] * 2), rows
