"""The sm90 backward's split-operand CTA pair (``sm90_bwd_pair``) on a CPU-only machine.

Compiled for sm_90a through the binding's own path, its SASS inspected: both ranks' GEMMs
(HGMMA), the dQ quarter added from the registers (REDG.E.ADD.F32x4, q / 4 per rank and thread),
dP − delta sent with st.async (STAS, one per 4 floats of a thread's dP), P / dS with one bulk
copy, no local memory. Plus the config contract: the validator's messages, the shared-memory
budget, the same call signature and postprocess as the one-CTA kernel, its own kernel name (a
cache key of its own) and launcher.
"""

from __future__ import annotations

import dataclasses

import pytest

from compiled import assert_no_local_memory, compiled_report, needs_disassembler, tiered
from jax_fa4.kernels import registry
from jax_fa4.kernels.sm90 import bwd_tuning
from jax_fa4.kernels.sm90.bwd_config import BwdConfig
from jax_fa4.kernels.sm90.bwd_pair_config import BwdPairConfig, with_pair
from jax_fa4.kernels.spec import SMEM_BUDGET_BYTES
from jax_fa4.tools.variants import sm90_bwd_gpu_configs, sm90_bwd_pair_candidates

ARCH = "sm_90a"


def _id(cfg: BwdPairConfig) -> str:
    return (f"{cfg.dtype[:4]}-d{cfg.head_dim}-{cfg.mask}{'-cap' if cfg.has_softcap else ''}"
            f"{'-gqa' if cfg.gqa else ''}{'-group' if cfg.group_heads else ''}"
            f"-s{cfg.stages}p{cfg.pds_stages}"
            f"{'-la' if cfg.lookahead else ''}")


def _configs() -> list[BwdPairConfig]:
    out = sm90_bwd_pair_candidates()
    base = BwdConfig.make("bfloat16", 256, 256, "causal")
    out += [BwdPairConfig.of(base, stages=2, pds_stages=1),
            BwdPairConfig.of(base, stages=3, pds_stages=1)]
    return out


@needs_disassembler
@pytest.mark.parametrize("cfg", tiered(_configs(), ARCH), ids=_id)
def test_pair_kernel_compiles_with_clean_sass(cfg, shipped_cache):
    k, seconds = compiled_report(shipped_cache, cfg, ARCH)
    print(f"\n{cfg.describe()}: {seconds:.1f} s, regs {k.registers}")
    quarter = cfg.tile_m * cfg.head_dim // 2 // 256  # dQ floats of one MMA thread per rank
    # dQ adds: q / 4 per rank (lookahead: rank 0's in the loop and after it)
    assert k.count("REDG.E.ADD.F32x4") == (3 if cfg.lookahead else 2) * quarter // 4
    assert k.count("STAS") == cfg.tile_m * cfg.tile_n // 256 // 4, "dP − delta: one st.async per 4"
    assert k.count("UBLKCP") == 1 and k.count("UBLKRED") == 0
    assert k.count("HGMMA") > 0 and (k.count("UTMASTG") > 0) == (not cfg.gqa)
    assert_no_local_memory(k)


@pytest.mark.parametrize("change,word", [
    (dict(tile_n=64), "64x128"),
    (dict(head_dim=192, head_dim_v=192), "head_dim"),
    (dict(head_dim_v=128), "head_dim"),
    (dict(deterministic=True), "deterministic"),
    (dict(varlen=True), "varlen"),
    (dict(dq_red=True), "dq_red"),
    (dict(pds_stages=3), "pds_stages"),
    (dict(stages=4), "shared memory"),
    (dict(lookahead=True, pds_stages=1), "lookahead"),
    (dict(gqa=True, group_heads=True), "group_heads"),
])
def test_validator_names_the_unsupported_feature(change, word):
    cfg = dataclasses.replace(BwdPairConfig.of(BwdConfig.make("bfloat16", 256, 256)), **change)
    with pytest.raises(ValueError, match=word):
        cfg.validate()


def test_contract_is_the_one_cta_kernels():
    """Same call (signature, alias, postprocess) as the one-CTA config of the problem kind, its
    own kernel name and launcher module, within the shared-memory budget."""
    for cfg in sm90_bwd_pair_candidates():
        one = BwdConfig.make(cfg.dtype, cfg.head_dim, cfg.head_dim_v, cfg.mask,
                             cfg.has_softcap, cfg.gqa)
        if cfg.group_heads:  # (the one-CTA kernel's group_heads form has the same contract)
            one = dataclasses.replace(one, group_heads=True)
        assert cfg.signature() == one.signature()
        assert cfg.postprocess_config() == one.postprocess_config()
        assert cfg.smem_bytes() <= SMEM_BUDGET_BYTES
        assert cfg.kernel_name == "sm90_bwd_pair" != one.kernel_name
        assert registry.launcher_module(cfg) == "jax_fa4.kernels.sm90.bwd_pair"
        assert cfg in sm90_bwd_gpu_configs()  # the GPU test runs it against the reference


def test_no_row_takes_the_pair_before_a_gpu_run():
    """The pair has run on no GPU yet: no tuning row may pick it (with_pair leaves every
    table config as it is)."""
    assert not any(t.pair for row in bwd_tuning.TUNING_TABLE.values() for t in row.values())
    for (d, dv) in bwd_tuning.TUNING_TABLE:
        cfg = BwdConfig.make("bfloat16", d, dv, "causal", gqa=True)
        assert with_pair(cfg) is cfg


def test_a_row_that_picks_the_pair(monkeypatch):
    """With a row's ``pair`` on: dense calls take the pair with the row's options (GQA in its
    group_heads form when the row says so); deterministic, segment-id and sink_grad calls keep
    the one-CTA kernel, and so do head dims the pair does not serve."""
    table = dict(bwd_tuning.TUNING_TABLE)
    for key in ((256, 256), (96, 96)):
        table[key] = {m: dataclasses.replace(t, pair=True, pair_lookahead=True,
                                             pair_group_heads=True)
                      for m, t in table[key].items()}
    monkeypatch.setattr(bwd_tuning, "TUNING_TABLE", table)
    mha = with_pair(BwdConfig.make("bfloat16", 256, 256, "causal"))
    assert isinstance(mha, BwdPairConfig) and mha.lookahead and not mha.group_heads
    gqa = with_pair(BwdConfig.make("bfloat16", 256, 256, "none", gqa=True))
    assert isinstance(gqa, BwdPairConfig) and gqa.group_heads and not gqa.gqa
    for kwargs in (dict(deterministic=True), dict(segments=True), dict(sink_grad=True)):
        cfg = BwdConfig.make("bfloat16", 256, 256, "causal", **kwargs)
        assert with_pair(cfg) is cfg
    d96 = BwdConfig.make("bfloat16", 96, 96, "causal")
    assert with_pair(d96) is d96
