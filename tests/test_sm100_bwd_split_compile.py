"""The sm100 split backward (head dims 192/192 and 256: bwd_split.py) compiles for sm_100a on a
CPU-only machine, with clean SASS, and its config keeps its contract.

Nothing here runs a kernel (no Blackwell GPU exists in this project). The configs of
``bwd_split_config.test_configs()`` (both parts; the quick tier compiles its sample of them,
``--exhaustive`` all) are compiled into the test run's kernel cache (``shipped_cache``) and their
SASS read with jax_fa4.tools.sass: tcgen05 MMAs (UTCHMMA: GEMM1 and GEMM2 over D / 16 k-blocks each,
the TS GEMMs over 64 / 16; no 2-CTA forms), commits, TMEM loads / stores, TMA loads and no TMA
reduce-add (nothing is accumulated in global memory), MUFU.EX2 (MUFU.TANH iff softcap), TMEM
allocation balanced, no local memory, registers <= 255. Every shipped variant: ``python -m
jax_fa4.tools.precompile --family sm100_bwd_split --check`` (docs/kernels/sm100-backward-split.md).
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from compiled import compiled_report, needs_disassembler, tiered
from jax_fa4.kernels.sm100.bwd_config import TMEM_COLUMNS
from jax_fa4.kernels.sm100.bwd_split_config import (PARTS, SPLIT_HEAD_DIMS, Sm100BwdSplitConfig,
                                                    serves, shipped_configs, split_configs)
from jax_fa4.kernels.sm100.bwd_split_config import test_configs as quick_configs
from jax_fa4.kernels.spec import SMEM_BUDGET_BYTES

ARCH = "sm_100a"


def _compiler_available() -> bool:
    from jax_fa4.ffi.compiler import compiler_available

    return compiler_available()


def _id(c: Sm100BwdSplitConfig) -> str:
    return (f"{c.part}-{c.dtype[:4]}-d{c.head_dim}-{c.mask}{'-cap' if c.has_softcap else ''}"
            f"{'-gqa' if c.gqa else ''}")


@pytest.mark.skipif(not _compiler_available(), reason="needs nvidia-cutlass-dsl")
@needs_disassembler
@pytest.mark.parametrize("cfg", tiered(quick_configs(), ARCH), ids=_id)
def test_compiles_with_clean_sass(cfg, shipped_cache):
    k, _ = compiled_report(shipped_cache, cfg, ARCH)
    n = lambda pat: len(re.findall(pat, k.sass))  # noqa: E731
    assert "FlashAttentionBackwardSm100Split" in k.name, k.name
    d, dv, cols = cfg.head_dim, cfg.head_dim_v, cfg.tile_cols
    ts_gemms = 2 if cfg.part == "dkdv" else 1
    assert k.count("UTCHMMA") == (d + dv) // 16 + ts_gemms * cols // 16
    assert n(r"UTCHMMA\.2CTA") == 0
    assert k.count("UTCBAR") > 0 and k.count("LDTM") > 0 and k.count("STTM") > 0
    assert k.count("UTMALDG") >= 4 and k.count("UTMAREDG") == 0
    assert k.count("MUFU.EX2") > 0
    assert (n(r"MUFU\.TANH") > 0) == cfg.has_softcap
    alloc, dealloc = n(r"UTCATOMSWS\.FIND_AND_SET"), n(r"UTCATOMSWS\.AND\b")
    assert dealloc == 1 and alloc == 2 * dealloc == 2 * n(r"UVIRTCOUNT\.DEALLOC\.SMPOOL")
    assert k.count("LDL") == 0 and k.count("STL") == 0
    assert k.local == 0 and k.stack == 0
    assert k.registers <= 255


def test_shipped_configs_are_valid_and_cover_every_option():
    shipped = shipped_configs()
    # head dims × dtypes × masks × softcap × (dkdv, dkdv with gqa, dq) × (dense, varlen)
    assert len(shipped) == len(set(shipped)) == 2 * 2 * 3 * 2 * 3 * 2
    assert {(c.head_dim, c.head_dim_v) for c in shipped} == set(SPLIT_HEAD_DIMS) == {
        (192, 192), (256, 256)}
    assert {c.varlen for c in shipped} == {False, True}
    assert set(quick_configs()) <= set(shipped)
    assert {c.part for c in shipped} == set(PARTS)
    assert {(c.part, c.gqa) for c in shipped} == {("dkdv", False), ("dkdv", True), ("dq", False)}
    for c in shipped:
        c.validate()
        assert c.tmem_columns() <= c.tmem_alloc_columns() <= 512
        assert c.smem_bytes() <= SMEM_BUDGET_BYTES


def test_config_contract():
    """Signatures (inputs as the fused backward's up to params; dkdv: dk, dv, float32 per query
    head with gqa; dq: dq in the input dtype), no alias, the served head dims, the refusals."""
    dkdv, dq = split_configs("float16", 256, 256, "local", True, gqa=True)
    assert (dkdv.part, dkdv.gqa, dq.part, dq.gqa) == ("dkdv", True, "dq", False)
    sig = dkdv.signature()
    assert [a.name for a in sig.inputs] == ["q", "k", "v", "dout", "lse_log2", "delta", "params"]
    assert [(a.name, a.dtype, a.sample_shape[2]) for a in sig.outputs] == [
        ("dk", "float32", 4), ("dv", "float32", 4)]
    assert not sig.aliases
    sig = dq.signature()
    assert [(a.name, a.dtype, a.sample_shape) for a in sig.outputs] == [
        ("dq", "float16", sig.inputs[0].sample_shape)]
    mha = Sm100BwdSplitConfig.make("dkdv", "bfloat16", 256).signature()
    assert [(a.dtype, a.sample_shape[2]) for a in mha.outputs] == [("bfloat16", 2)] * 2
    assert serves(256, 256) and serves(192, 192)
    assert not serves(192, 128) and not serves(128, 128)
    for d, dv in ((192, 128), (128, 128)):
        with pytest.raises(ValueError, match=f"{d}/{dv} not served"):
            Sm100BwdSplitConfig.make("dkdv", "bfloat16", d, dv)
    with pytest.raises(ValueError, match="part"):
        Sm100BwdSplitConfig.make("dqkv", "bfloat16", 256)
    with pytest.raises(ValueError, match="shared memory"):
        dataclasses.replace(dkdv, stream_stages=3).validate()
    # the column split: dK/dV halves (two CTAs per key block), dQ whole
    assert (dkdv.out_cols, dkdv.col_splits, dq.out_cols, dq.col_splits) == (128, 2, 256, 1)
    assert dkdv.tmem_offsets() == {"dk": 0, "dv": 128, "s": 256, "dp": 320}
    assert dq.tmem_offsets() == {"dq": 0, "s": 256, "dp": 320}
    # (one part at 256 would take dK + dV + Sᵀ + dPᵀ = 640 TMEM columns)
    assert 256 + 256 + 2 * dkdv.tile_cols > TMEM_COLUMNS


@pytest.mark.parametrize("varlen", (False, True))
def test_one_column_part_at_192(varlen):
    """192/192: one dK/dV CTA per key block holds all of dK and dV beside Sᵀ and dPᵀ (512 TMEM
    columns exactly); the dQ CTA 320 of its 512; shared memory: resident K, V (or Q, dO) of 128
    × 192, two stages of the first streamed operand and one of the second (64 × 192 each),
    −lse / −delta of two stages."""
    dkdv, dq = (dataclasses.replace(c, varlen=varlen)
                for c in split_configs("bfloat16", 192, 192, "causal", True, True))
    assert (dkdv.out_cols, dkdv.col_splits, dq.out_cols, dq.col_splits) == (192, 1, 192, 1)
    assert dkdv.tmem_offsets() == {"dk": 0, "dv": 192, "s": 384, "dp": 448}
    assert dkdv.tmem_columns() == dkdv.tmem_alloc_columns() == TMEM_COLUMNS
    assert dq.tmem_offsets() == {"dq": 0, "s": 192, "dp": 256}
    assert (dq.tmem_columns(), dq.tmem_alloc_columns()) == (320, 512)
    want = 128 * 384 * 2 + 64 * (2 * 192 + 192) * 2 + 2 * 2 * 64 * 4
    assert dkdv.smem_bytes() == dq.smem_bytes() == want == 173_056 <= SMEM_BUDGET_BYTES
    assert (dkdv.stream_stages, dkdv.other_stages) == (2, 1)
    # Dv == D only
    with pytest.raises(ValueError, match="192/128 not served"):
        Sm100BwdSplitConfig.make("dq", "bfloat16", 192, 128)
