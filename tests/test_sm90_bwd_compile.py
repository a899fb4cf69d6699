"""The sm90 backward kernels compile for sm_90a on a CPU-only machine, with clean SASS.

Variants of the main kernel (every head dim × mask kind, softcap, GQA, fp16, deterministic,
swap_sdp) and every postprocess are compiled through the binding's own path
(``compile_config``: dynamic B/S/H) and their SASS inspected (jax_fa4.tools.sass): HGMMA, TMA loads
(UTMALDG), the dQ reduce-add (the dQ warp's bulk UBLKRED, or with dq_red the MMA threads'
REDG.F32x4), setmaxnreg both ways, no local memory (LDL/STL,
stack). Registers, shared memory and compile time are printed per variant (``pytest -s``).
The quick tier runs one config per arch × kind × mode of each list (tests/compiled.py),
``--exhaustive`` all of them; every shipped variant's SASS:
tests/test_shipped_kernels.py.

Plus CPU-only checks of what would fail silently on the GPU: the query-block ranges, the
"needs a mask" test and the per-row visible columns (common/geometry.py) against brute force; the
config contract (signature, alias, no compiler import, validator messages, smem budget).
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from compiled import assert_no_local_memory, compiled_report, needs_disassembler, tiered
from jax_fa4.kernels.sm90.bwd_config import (GROUP_HEADS_ANY, TUNING_TABLE, BwdConfig,
                                             BwdPostprocessConfig, shipped_configs,
                                             varlen_config)
from jax_fa4.kernels.sm90.bwd_tuning import GROUP_HEADS_MIN_CTAS
from jax_fa4.kernels.sm90.bwd_config import (swap_sdp_config, with_stats_smem, with_swap_sdp,
                                             without_swap_sdp)
from jax_fa4.kernels.spec import MASK_KINDS, SMEM_BUDGET_BYTES
from jax_fa4.tools.variants import (OPT_IN_FORMS, SM90_BWD_GPU_SWAP, sm90_bwd_d192_candidates,
                                    sm90_bwd_gpu_configs)

REPO = Path(__file__).resolve().parents[1]
ARCH = "sm_90a"


def assert_dq_reduce(k, cfg: BwdConfig) -> None:
    """dQ reaches dq_accum one way only: the dQ warp's bulk reduce from shared memory (UBLKRED,
    one per MMA warpgroup chunk), or with dq_red each MMA thread's 8 × REDG.E.ADD.F32x4."""
    if cfg.dq_red:
        assert k.count("UBLKRED") == 0, "dq_red kernel still bulk-reduces dQ"
        assert k.count("REDG.E.ADD.F32x4") == cfg.tile_m * cfg.head_dim // 256 // 4, \
            "dq_red: one 16-byte reduction per 4 dQ floats of each MMA thread"
    else:
        assert k.count("UBLKRED") > 0, "dQ bulk reduce-add missing"
        assert k.count("REDG") == 0


def _main_configs() -> list[BwdConfig]:
    out = [BwdConfig.make("bfloat16", d, dv, mask) for (d, dv) in TUNING_TABLE
           for mask in MASK_KINDS]
    out += [BwdConfig.make("bfloat16", d, dv, "causal", True) for (d, dv) in TUNING_TABLE]
    out += [BwdConfig.make("bfloat16", d, dv, "local", gqa=True) for (d, dv) in TUNING_TABLE]
    out += [BwdConfig.make("float16", 128, 128, mask) for mask in MASK_KINDS]
    out += [OPT_IN_FORMS["group"](BwdConfig.make("bfloat16", d, dv, "causal", gqa=True))
            for (d, dv) in ((96, 96), (128, 128), (192, 128))]
    out += [BwdConfig.make("bfloat16", d, dv, "causal", gqa=True, sink_grad=True)
            for (d, dv) in TUNING_TABLE]
    out += [BwdConfig.make("float16", 128, 128, "local", sink_grad=True)]
    return out + [BwdConfig.make("float16", 64, 64, "local", True, True)]


def _id(c) -> str:
    text = f"{c.dtype[:4]}-{c.head_dim}x{getattr(c, 'head_dim_v', c.head_dim)}"
    if isinstance(c, BwdPostprocessConfig):
        return f"{text}-tm{c.tile_m}{'-varlen' if c.varlen else ''}"
    return (f"{text}-{c.mask}{'-cap' if c.has_softcap else ''}{'-gqa' if c.gqa else ''}"
            f"{'-det' if c.deterministic else ''}{'-swap' if c.swap_sdp else ''}"
            f"{'-stats' if c.stats_smem else ''}{'-red' if c.dq_red else ''}"
            f"{'-sink' if getattr(c, 'sink_grad', False) else ''}"
            f"{'-group' if getattr(c, 'group_heads', False) else ''}")


@needs_disassembler
@pytest.mark.parametrize("cfg", tiered(_main_configs(), ARCH), ids=_id)
def test_main_kernel_compiles_with_clean_sass(cfg, shipped_cache):
    k, seconds = compiled_report(shipped_cache, cfg, ARCH)
    print(f"\n{cfg.describe()}: {seconds:.1f} s, regs {k.registers} (setmaxnreg 240/24), "
          f"smem {cfg.smem_bytes()} B, HGMMA {k.count('HGMMA')}, MUFU.EX2 {k.count('MUFU.EX2')}, "
          f"STSM {k.count('STSM')}, UBLKRED {k.count('UBLKRED')}")
    assert k.arch == ARCH
    assert k.count("HGMMA") > 0, "no warpgroup MMA in SASS"
    assert k.count("UTMALDG") > 0, "no TMA loads"
    assert (k.count("UTMASTG") > 0) == (not cfg.gqa), "dK/dV TMA store iff not GQA"
    assert_dq_reduce(k, cfg)
    assert k.count("USETMAXREG.DEALLOC") > 0 and k.count("USETMAXREG.TRY_ALLOC") > 0, \
        "setmaxnreg ignored"
    assert k.count("MUFU.EX2") > 0 and k.count("STSM") > 0
    assert (k.count("MUFU.TANH") > 0) == cfg.has_softcap
    assert_no_local_memory(k)


@needs_disassembler
@pytest.mark.parametrize("cfg", tiered(sm90_bwd_d192_candidates(), ARCH), ids=_id)
def test_head_dim_192_candidates_compile_with_clean_sass(cfg, shipped_cache):
    """192/192 (no table row yet: tools/variants.sm90_bwd_d192_candidates): V's swizzle atom
    tiles each warpgroup's 96 dV columns, so the MHA epilogue's stmatrix store partitions; no
    spills, MHA and GQA, with and without dq_red."""
    k, _ = compiled_report(shipped_cache, cfg, ARCH)
    assert k.count("HGMMA") > 0 and (k.count("UTMASTG") > 0) == (not cfg.gqa)
    assert_dq_reduce(k, cfg)
    assert_no_local_memory(k)


@needs_disassembler
@pytest.mark.parametrize("cfg", tiered(sorted({c.postprocess_config() for c in
                                               (BwdConfig.make(dt, d, dv)
                                                for dt in ("bfloat16", "float16")
                                                for (d, dv) in TUNING_TABLE)},
                                              key=lambda c: (c.dtype, c.head_dim)), ARCH),
                         ids=_id)
def test_postprocess_compiles_with_clean_sass(cfg, shipped_cache):
    k, seconds = compiled_report(shipped_cache, cfg, ARCH)
    print(f"\n{cfg.describe()}: {seconds:.1f} s, regs {k.registers}")
    assert k.arch == ARCH
    assert k.count("UTMASTG") > 0 and k.count("STSM") > 0
    assert_no_local_memory(k)


# ------------------------------------------------------------------------------------------------
# config contract
# ------------------------------------------------------------------------------------------------
def test_config_module_does_not_import_the_compiler():
    code = ("import sys; import jax_fa4.kernels.sm90.bwd_config as m; "
            "m.BwdConfig.make('bfloat16', 128); m.shipped_configs(); "
            "assert not any(k == 'cutlass' or k.startswith('cutlass.') for k in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@pytest.mark.parametrize("kwargs,word", [
    (dict(dtype="float32", head_dim=128), "dtype"),
    (dict(dtype="bfloat16", head_dim=80), "head_dim"),
    (dict(dtype="bfloat16", head_dim=128, head_dim_v=64), "head_dim"),
    (dict(dtype="bfloat16", head_dim=128, mask="alibi"), "mask"),
])
def test_validator_names_the_unsupported_feature(kwargs, word):
    with pytest.raises(ValueError, match=word):
        BwdConfig.make(**kwargs)


def test_launch_order_of_the_deterministic_kernels():
    """The deterministic kernel's dQ order follows its launch order: causal launches from the
    last key block down (descending adds), every other mask from the first up (ascending), and
    the validator refuses a reversed launch there (a key block would wait on a later launch).
    The default plain-loop kernels launch reversed (the table's choice); the swap_sdp ones
    (head dim 128) from the first key block up."""
    from dataclasses import replace

    for mask in ("none", "causal", "local"):
        default = BwdConfig.make("bfloat16", 128, mask=mask)
        det = BwdConfig.make("bfloat16", 128, mask=mask, deterministic=True)
        assert default.swap_sdp and not default.reverse_launch
        assert BwdConfig.make("bfloat16", 128, mask=mask, has_softcap=True).reverse_launch
        assert BwdConfig.make("bfloat16", 64, mask=mask).reverse_launch
        assert det.reverse_launch == (mask == "causal")
        if mask != "causal":
            with pytest.raises(ValueError, match="reverse_launch"):
                replace(det, reverse_launch=True).validate()
    # swap_sdp (opt-in) keeps the forward launch order: reversed, it spills at hdim 128 GQA
    with pytest.raises(ValueError, match="reverse_launch"):
        replace(BwdConfig.make("bfloat16", 128, gqa=True), swap_sdp=True,
                reverse_launch=True).validate()


def _deterministic_variants():
    """Ordered dQ: every head dim, each with the register-tightest options (local, softcap, GQA)
    or plain causal MHA."""
    return ([("bfloat16", d, dv, "local", True, True) for (d, dv) in TUNING_TABLE]
            + [("bfloat16", d, dv, "causal", False, False) for (d, dv) in TUNING_TABLE])


@needs_disassembler
@pytest.mark.parametrize("cfg", tiered([BwdConfig.make(*v, deterministic=True)
                                        for v in _deterministic_variants()], ARCH), ids=_id)
def test_deterministic_kernel_compiles_with_clean_sass(cfg, shipped_cache):
    """The ordered-dQ handshake is in the SASS (an acquire spin before the two bulk reduces of a
    query block, a release store inside the loop and one after it) and costs no spills."""
    k, seconds = compiled_report(shipped_cache, cfg, ARCH)
    print(f"\n{cfg.describe()}: {seconds:.1f} s, regs {k.registers}")
    assert k.count("UBLKRED") == 2
    assert k.count("LDG.E.STRONG.GPU") >= 1 and k.count("STG.E.STRONG.GPU") == 2
    assert_no_local_memory(k)


def _swap_configs() -> list[BwdConfig]:
    """swap_sdp (the table's head dim 128 rows and head dim 96 causal): what the GPU test runs,
    plus deterministic."""
    return [swap_sdp_config(*v) for v in SM90_BWD_GPU_SWAP] + [
        swap_sdp_config("bfloat16", 128, 128, "causal", False, False, True),
        swap_sdp_config("bfloat16", 128, 128, "none", False, True, True)]


@needs_disassembler
@pytest.mark.parametrize("cfg", tiered(_swap_configs(), ARCH), ids=_id)
def test_swap_sdp_kernel_compiles_with_clean_sass(cfg, shipped_cache):
    """Sᵀ / dPᵀ GEMMs with P and dS as register A operands: HGMMA, the dQ bulk reduce, and no
    spills (the per-column lse / delta loads are the register-tight part)."""
    k, seconds = compiled_report(shipped_cache, cfg, ARCH)
    print(f"\n{cfg.describe()}: {seconds:.1f} s, regs {k.registers}, STSM {k.count('STSM')}")
    assert k.count("HGMMA") > 0
    assert_dq_reduce(k, cfg)
    assert_no_local_memory(k)


def _stats_configs() -> list[BwdConfig]:
    """stats_smem (with swap_sdp in the table's rows): its GPU test's problems, plain and swapped,
    plus a deterministic one, softcap and one tile_m 128 table row (four rows per lane)."""
    out = [with_stats_smem(BwdConfig.make(*v)) for v in SM90_BWD_GPU_SWAP]
    out += [with_stats_smem(BwdConfig.make("bfloat16", 128, 128, "causal", True, False, True)),
            with_stats_smem(BwdConfig.make("bfloat16", 64, 64, "local", True, True))]
    return out


@needs_disassembler
@pytest.mark.parametrize("cfg", tiered(_stats_configs(), ARCH), ids=_id)
def test_stats_smem_kernel_compiles_with_clean_sass(cfg, shipped_cache):
    """Row statistics through shared memory: the stats warp's cp.async loads (LDGSTS, tile_m / 32
    rows per lane for lse_log2 and delta) replace the MMA threads' global loads; no spills."""
    k, seconds = compiled_report(shipped_cache, cfg, ARCH)
    print(f"\n{cfg.describe()}: {seconds:.1f} s, regs {k.registers}, LDGSTS {k.count('LDGSTS')}, "
          f"LDS {k.count('LDS')}, LDG {k.count('LDG')}")
    assert k.count("LDGSTS") == 2 * cfg.tile_m // 32
    assert k.count("HGMMA") > 0
    assert_dq_reduce(k, cfg)
    assert_no_local_memory(k)


def _wg_fragment_configs() -> list[BwdConfig]:
    """wg_fragments on the table's rows of every head dim (one mask kind each), the plain and
    the swapped loop."""
    rows = [("bfloat16", 64, 64, "none"), ("bfloat16", 96, 96, "causal"),
            ("bfloat16", 128, 128, "causal"), ("bfloat16", 192, 128, "none"),
            ("bfloat16", 256, 256, "causal")]
    return [replace(BwdConfig.make(*r), wg_fragments=True) for r in rows]


@needs_disassembler
@pytest.mark.parametrize("cfg", tiered(_wg_fragment_configs(), ARCH), ids=_id)
def test_wg_fragments_keep_the_descriptors_uniform(cfg, shipped_cache):
    """Operand fragments from warpgroup slices: the same GEMMs, no spills, and the descriptors
    no longer moved from per-thread registers (R2UR) between the WGMMAs of a block: the whole
    kernel keeps at most half the per-thread form's R2URs (head dim 128: 51 -> 4)."""
    k, _ = compiled_report(shipped_cache, cfg, ARCH)
    per_thread, _ = compiled_report(shipped_cache, replace(cfg, wg_fragments=False), ARCH)
    print(f"\n{cfg.describe()}: R2UR {per_thread.count('R2UR')} -> {k.count('R2UR')}")
    assert k.count("HGMMA") == per_thread.count("HGMMA") > 0
    assert 2 * k.count("R2UR") <= per_thread.count("R2UR")
    assert_no_local_memory(k)


def _stats_padded_configs() -> list[BwdConfig]:
    """stats_padded (with wg_fragments, the form it is timed in) on the table's stats_smem rows:
    head dim 128 unmasked and GQA causal, head dim 96 causal."""
    rows = [("bfloat16", 128, 128, "none"), ("bfloat16", 128, 128, "causal", False, True),
            ("bfloat16", 96, 96, "causal")]
    return [replace(BwdConfig.make(*r), wg_fragments=True, stats_padded=True) for r in rows]


@needs_disassembler
@pytest.mark.parametrize("cfg", tiered(_stats_padded_configs(), ARCH), ids=_id)
def test_stats_padded_reads_without_selects(cfg, shipped_cache):
    """Row statistics padded past Sq: the same GEMMs and stats loads, no spills, and the swapped
    loop's 32 per-column selects of +inf / 0 (one per lse and delta column) gone."""
    k, _ = compiled_report(shipped_cache, cfg, ARCH)
    selected, _ = compiled_report(shipped_cache, replace(cfg, stats_padded=False), ARCH)
    print(f"\n{cfg.describe()}: FSEL {selected.count('FSEL')} -> {k.count('FSEL')}")
    assert k.count("HGMMA") == selected.count("HGMMA") > 0
    assert k.count("LDGSTS") == selected.count("LDGSTS") == 2 * cfg.tile_m // 32
    assert selected.count("FSEL") - k.count("FSEL") >= 32
    assert_no_local_memory(k)


def test_stats_smem_validation():
    base = with_stats_smem(BwdConfig.make("bfloat16", 128, mask="causal"), False)
    staged = with_stats_smem(base)
    assert staged.stats_smem and not base.stats_smem
    # two float32 rows of tile_m per Q stage, inside the budget at the tightest head dim
    assert staged.smem_bytes() == base.smem_bytes() + 2 * base.stages * base.tile_m * 4
    assert staged.smem_bytes() <= SMEM_BUDGET_BYTES
    assert staged.key_dict() != base.key_dict()


def test_without_swap_sdp_restores_the_plain_launch_order():
    """The plain loop of a swapped config launches as make() launches it: the table's order, or
    deterministic: reversed exactly under a causal mask (the validator's rule)."""
    for mask in ("none", "causal", "local"):
        swapped = with_swap_sdp(BwdConfig.make("bfloat16", 128, mask=mask, deterministic=True))
        plain = without_swap_sdp(swapped)
        plain.validate()
        assert not plain.swap_sdp and plain.reverse_launch == (mask == "causal")
        default = BwdConfig.make("bfloat16", 128, mask=mask)
        assert without_swap_sdp(default).reverse_launch  # the head dim 128 row's order


def test_dq_red_where_the_row_allows_it():
    """make() gives dq_red (and the row's red_stages) to the calls it serves, and the row's
    stages without it: head dim 256 (plain loop) two Q/dO stages with dq_red, one deterministic
    or varlen; head dim 128 (swapped loop) dq_red only where the swapped loop applies."""
    d256 = BwdConfig.make("bfloat16", 256, mask="causal", has_softcap=True, gqa=True)
    assert d256.dq_red and d256.stages == 2 and not d256.swap_sdp
    for cfg in (BwdConfig.make("bfloat16", 256, deterministic=True),
                varlen_config("bfloat16", 256, mask="causal")):
        cfg.validate()
        assert not cfg.dq_red and cfg.stages == 1
    assert BwdConfig.make("bfloat16", 128).dq_red
    assert not BwdConfig.make("bfloat16", 128, has_softcap=True).dq_red  # plain loop there
    v128 = varlen_config("bfloat16", 128, mask="causal")
    assert not (v128.dq_red or v128.swap_sdp or v128.reverse_launch or v128.stats_smem)


def test_swap_sdp_validation():
    base = replace(without_swap_sdp(BwdConfig.make("bfloat16", 128, mask="causal")),
                   stats_smem=False, stats_padded=False)
    swapped = replace(swap_sdp_config("bfloat16", 128, 128, "causal"), stats_smem=False,
                      stats_padded=False)
    assert swapped.swap_sdp and not swapped.reverse_launch  # see validate
    assert swapped.smem_bytes() == base.smem_bytes() - base.pds_stages * 64 * 128 * 2  # no sP
    assert swapped.wg_layouts()["sdp"] == (2, 1)  # one 64-key slice of Sᵀ per warpgroup
    for bad, word in ((dict(has_softcap=True), "softcap"), (dict(tile_m=128), "64x128"),
                      (dict(head_dim=192, head_dim_v=128), "head dims")):
        with pytest.raises(ValueError, match=word):
            replace(swapped, **bad).validate()
    # make() never turns it on with softcap (registers) or deterministic, whatever the table says
    assert BwdConfig.make("bfloat16", 128).swap_sdp  # (the table's head dim 128 row)
    assert not BwdConfig.make("bfloat16", 128, has_softcap=True).swap_sdp
    assert not BwdConfig.make("bfloat16", 128, deterministic=True).swap_sdp


def test_sink_grad_config():
    """A learnable sink's backward (sink_grad): the plain loop always (the swapped loop's column
    statistics leave no registers for the sink sums), a distinct compile key, shared memory for
    the per-thread sums, and one more output, sink_part (B, H, key blocks) float32, last (after
    the deterministic counters); validate refuses it with swap_sdp."""
    plain = BwdConfig.make("bfloat16", 128, mask="causal")
    sink = BwdConfig.make("bfloat16", 128, mask="causal", sink_grad=True)
    assert plain.swap_sdp and not sink.swap_sdp and sink != plain
    assert sink.smem_bytes() > replace(sink, sink_grad=False).smem_bytes()
    sig = sink.signature()
    assert [a.name for a in sig.outputs] == ["dq_accum", "dk", "dv", "sink_part"]
    assert sig.outputs[-1].dtype == "float32" and sig.outputs[-1].batched
    assert sig.inputs == plain.signature().inputs and sig.aliases == ((7, 0),)
    det = BwdConfig.make("bfloat16", 64, mask="causal", deterministic=True, sink_grad=True)
    assert [a.name for a in det.signature().outputs] == ["dq_accum", "dk", "dv", "dq_sem",
                                                         "sink_part"]
    var = varlen_config("bfloat16", 128, 128, "local", gqa=True, sink_grad=True)
    assert var.sink_grad and not var.signature().outputs[-1].batched
    with pytest.raises(ValueError, match="sink_grad"):
        replace(sink, swap_sdp=True, stats_smem=False, dq_red=False,
                reverse_launch=False).validate()


@pytest.fixture
def group_heads_rows(monkeypatch):
    """The tuning table with group_heads on in the rows whose kernels compile clean with it
    (head dims 96, 128, 192/128; no row has it on before a GPU run has chosen it)."""
    for key in ((96, 96), (128, 128), (192, 128)):
        monkeypatch.setitem(TUNING_TABLE, key, {mask: replace(t, group_heads=True)
                                                for mask, t in TUNING_TABLE[key].items()})


def test_group_heads_config(group_heads_rows):
    """A GQA call takes the group_heads form (one CTA per kv head, dK / dV in the input dtype
    per kv head: gqa=False's outputs) where its row allows it and it launches at least
    GROUP_HEADS_MIN_CTAS CTAs; validate refuses the form where it spills or has no code."""
    tn = BwdConfig.make("bfloat16", 128, mask="causal").tile_n
    enough = (GROUP_HEADS_MIN_CTAS, tn)  # (B·Hkv, Sk): exactly the threshold
    few = (GROUP_HEADS_MIN_CTAS - 1, tn)
    grouped = BwdConfig.make("bfloat16", 128, mask="causal", gqa=True, group_shape=enough)
    assert grouped.group_heads and not grouped.gqa
    assert grouped == OPT_IN_FORMS["group"](BwdConfig.make("bfloat16", 128, mask="causal",
                                                           gqa=True))
    assert not BwdConfig.make("bfloat16", 128, mask="causal", gqa=True,
                              group_shape=few).group_heads
    mha = BwdConfig.make("bfloat16", 128, mask="causal", group_shape=enough)
    assert not mha.group_heads  # (MHA has no group to walk)
    assert grouped != replace(mha, group_heads=False)  # a distinct compile key
    for d in (64, 256):  # (rows without the form)
        assert not BwdConfig.make("bfloat16", d, gqa=True, group_shape=GROUP_HEADS_ANY).group_heads
        with pytest.raises(ValueError, match="local memory"):
            replace(BwdConfig.make("bfloat16", d), group_heads=True).validate()
    assert not BwdConfig.make("bfloat16", 128, gqa=True, sink_grad=True,
                              group_shape=GROUP_HEADS_ANY).group_heads
    for bad in (dict(gqa=True), dict(sink_grad=True, swap_sdp=False, stats_smem=False,
                                     stats_padded=False, dq_red=False)):
        with pytest.raises(ValueError, match="group_heads"):
            replace(grouped, **bad).validate()
    with pytest.raises(ValueError, match="group_heads"):
        replace(varlen_config("bfloat16", 128, gqa=False), group_heads=True).validate()
    sig = grouped.signature()
    assert sig == replace(grouped, group_heads=False).signature()  # gqa=False's outputs
    assert sig.outputs[1].dtype == "bfloat16" and sig.outputs[1].sample_shape[2] == 2  # Hkv
    shipped = [c for c in shipped_configs() if getattr(c, "group_heads", False)]
    # each GQA kind without a sink of those rows, default and deterministic
    assert len(shipped) == 2 * 3 * len(MASK_KINDS) * 2 * 2
    assert all(c.head_dim in (96, 128, 192) and not c.sink_grad for c in shipped)
    assert all(c.smem_bytes() <= SMEM_BUDGET_BYTES for c in shipped)


def test_no_row_takes_group_heads_before_a_step_ab():
    """group_heads passes the GPU tests (its "group" form runs there) and has won only +2 % in
    the attention-alone A/B: no tuning row picks it, so no call and no shipped variant uses it.
    A row that turns it on comes with its whole-step A/B, and replaces this check."""
    assert not any(t.group_heads for row in TUNING_TABLE.values() for t in row.values())
    assert not any(getattr(c, "group_heads", False) for c in shipped_configs())
    assert any(getattr(c, "group_heads", False) for c in sm90_bwd_gpu_configs())


def test_deterministic_signature_adds_the_counters():
    cfg = BwdConfig.make("bfloat16", 128, mask="causal", deterministic=True)
    sig = cfg.signature()
    assert [a.name for a in sig.inputs][-2:] == ["dq_accum", "dq_sem"]
    assert [a.name for a in sig.outputs] == ["dq_accum", "dk", "dv", "dq_sem"]
    assert sig.aliases == ((7, 0), (8, 3))
    sem = sig.inputs[8]
    assert sem.dtype == "int32" and sem.sample_shape[2] == 256 // cfg.tile_m
    assert BwdConfig.make("bfloat16", 128, mask="causal") != cfg  # a distinct compile key


def test_signature_alias_and_shapes():
    cfg = BwdConfig.make("bfloat16", 128)
    sig = cfg.signature()
    assert [a.name for a in sig.inputs] == ["q", "k", "v", "dout", "lse_log2", "delta", "params",
                                            "dq_accum"]
    assert [a.name for a in sig.outputs] == ["dq_accum", "dk", "dv"]
    assert sig.aliases == ((7, 0),)
    assert sig.inputs[7] == sig.outputs[0]
    assert not sig.inputs[6].batched and sig.inputs[6].sample_shape == (4,)
    assert sig.inputs[7].divisibility == (1, 1, cfg.tile_m * 128)
    gqa = BwdConfig.make("bfloat16", 128, gqa=True).signature()
    assert gqa.outputs[1].dtype == gqa.outputs[2].dtype == "float32"
    post = cfg.postprocess_config()
    assert isinstance(post, BwdPostprocessConfig) and post.tile_m == cfg.tile_m
    assert [a.name for a in post.signature().inputs] == ["dq_accum", "params"]


def test_every_shipped_variant_fits_shared_memory():
    every = [c for c in shipped_configs() if isinstance(c, BwdConfig)]
    mains = [c for c in every if not c.group_heads]
    # dtypes × rows × masks × softcap × gqa × sink × (default, deterministic, varlen, segments)
    assert len(mains) == 2 * len(TUNING_TABLE) * len(MASK_KINDS) * 2 * 2 * 2 * 4
    # (and the group_heads form of the rows that pick it: test_group_heads_config)
    assert len(every) - len(mains) == 2 * sum(
        row["none"].group_heads for row in TUNING_TABLE.values()) * len(MASK_KINDS) * 2 * 2
    assert sum(c.deterministic for c in mains) == len(mains) // 4
    assert sum(c.sink_grad for c in mains) == len(mains) // 2
    assert not any(c.sink_grad and c.swap_sdp for c in mains)
    varlen = [c for c in mains if c.varlen]
    assert len(varlen) == len(mains) // 4
    # segment ids: the plain loop with 64-row query tiles, never deterministic or varlen
    segments = [c for c in mains if c.segments]
    assert len(segments) == len(mains) // 4
    assert not any(c.swap_sdp or c.deterministic or c.varlen or c.tile_m > 64
                   for c in segments)
    # every varlen variant is the table's default kernel of its kind in the plain loop (no
    # swap_sdp, statistics from registers, dQ through the dQ warp with the row's stages, not its
    # red_stages), launched by the work list
    plain = {replace(c, swap_sdp=False, stats_smem=False, stats_padded=False, dq_red=False,
                     reverse_launch=False,
                     stages=TUNING_TABLE[c.head_dim, c.head_dim_v][c.mask].stages)
             for c in mains if not c.varlen and not c.deterministic}
    assert all(replace(c, varlen=False) in plain for c in varlen)
    assert all(c.smem_bytes() <= SMEM_BUDGET_BYTES for c in mains)
    posts = [c for c in shipped_configs() if isinstance(c, BwdPostprocessConfig)]
    assert all(c.postprocess_config() in posts for c in mains)
    tv = sm90_bwd_gpu_configs()
    assert all(c.postprocess_config() in tv for c in tv if isinstance(c, BwdConfig))


# ------------------------------------------------------------------------------------------------
# block arithmetic against brute force (pure Python: BwdBlocks runs on ints too)
# ------------------------------------------------------------------------------------------------
def _visible(i, j, sq, sk, kind, wl, wr):
    """Row i sees key j (reference.visible_mask's rule; wl/wr None = unbounded)."""
    if not 0 <= j < sk:
        return False
    diag = i + sk - sq
    if kind == "causal":
        return j <= diag
    if kind == "local":
        return (wl is None or j >= diag - wl) and (wr is None or j <= diag + wr)
    return True


def _clamp(w, bound):
    """The kernel's resolution of a window side: None / negative / oversize -> bound."""
    return bound if w is None or w < 0 or w > bound else w


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("tile_m,tile_n", [(64, 128), (128, 128), (64, 64)])
def test_block_info_matches_brute_force(kind, tile_m, tile_n):
    from jax_fa4.kernels.common.geometry import BwdBlocks

    seqlens = [(1, 1), (1, 300), (113, 203), (203, 113), (256, 256), (257, 129), (300, 17),
               (64, 200)]
    windows = [(None, None)] if kind != "local" else [
        (None, 0), (0, 0), (5, None), (None, 7), (37, 3), (0, 130), (300, 300), (1, 1), (64, 0)]
    for (sq, sk), (wl, wr) in itertools.product(seqlens, windows):
        bi = BwdBlocks(tile_m, tile_n, kind == "causal", kind == "local", sq, sk,
                          _clamp(wl, sk) if kind == "local" else 0,
                          _clamp(wr, sq) if kind == "local" else 0)
        for n in range(-(-sk // tile_n)):
            where = f"sq={sq} sk={sk} window=({wl},{wr}) n={n}"
            cols = range(n * tile_n, (n + 1) * tile_n)
            lo_m, hi_m = bi.m_block_range(n)
            for m in range(-(-sq // tile_m)):
                rows = range(m * tile_m, min((m + 1) * tile_m, sq))
                vis = [[_visible(i, j, sq, sk, kind, wl, wr) for j in cols] for i in rows]
                any_vis = any(any(r) for r in vis)
                # every block with a visible pair is visited (extra visited blocks are allowed:
                # their P is masked to 0, but check we do not visit far outside)
                if any_vis:
                    assert lo_m <= m < hi_m, f"{where} m={m} not visited"
                # the mask test is conservative: a block with an invisible pair is masked
                _, cut_r, cut_l = bi.mask_reasons(m, n)
                needs = bi.kv_tail(n) or (kind != "none" and cut_r) or (kind == "local" and cut_l)
                if not all(all(r) for r in vis):
                    assert needs, f"{where} m={m} needs a mask"
                # per-row visible columns
                for r_i, i in enumerate(rows):
                    lo, hi = bi.visible_cols(i, n)
                    for c, j in enumerate(cols):
                        got = c < hi and (kind != "local" or c >= lo)
                        assert got == vis[r_i][c], f"{where} row {i} col {j}"
            # the range stays inside [0, m_blocks) (TMA coordinates valid)
            assert hi_m <= lo_m or (0 <= lo_m and hi_m <= -(-sq // tile_m)), where
            # and visits no block without a visible pair for causal (tight range)
            if kind == "causal" and hi_m > lo_m:
                rows = range(lo_m * tile_m, min((lo_m + 1) * tile_m, sq))
                assert any(_visible(i, j, sq, sk, kind, wl, wr) for i in rows for j in cols), where


@pytest.mark.parametrize("batch,grouped", [(8, True), (2, False)])
def test_gqa_gradient_takes_the_group_heads_kernel_at_large_grids(batch, grouped,
                                                                   group_heads_rows):
    """With the row on: jax.grad of a causal GQA call (16 query heads over 4 kv heads, head dim
    128, 2048 tokens) lowers to the group_heads main kernel once B·Hkv·key blocks reaches the
    threshold
    (B 8: 512 CTAs; dK / dV come out of it per kv head in bfloat16, no float32 slice per query
    head) and to the per-query-head kernel below it (B 2: 128 CTAs)."""
    import jax
    import jax.numpy as jnp

    import jax_fa4
    from cuda_lowering import lower_for_cuda

    q = jax.ShapeDtypeStruct((batch, 2048, 16, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, 2048, 4, 128), jnp.bfloat16)

    def loss(q, k, v):
        out = jax_fa4.flash_attention(q, k, v, causal=True, implementation="sm90")
        return jnp.sum(out.astype(jnp.float32))

    lowered = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv,
                             compute_capability="9.0")
    mains = [c for c, _ in lowered.kernels if isinstance(c, BwdConfig)]
    assert len(mains) == 1
    assert mains[0].group_heads == grouped and mains[0].gqa == (not grouped)
    assert (batch * 4 * (2048 // mains[0].tile_n) >= GROUP_HEADS_MIN_CTAS) == grouped
