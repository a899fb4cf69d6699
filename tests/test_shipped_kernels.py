"""Every shipped kernel variant ships clean; the quick tier's representative rule;
jax_fa4.tools.sass.

* ``test_shipped_variants_have_clean_sass``: the quick tier checks one shipped variant per arch ×
  kernel kind × mode (tests/compiled.py), ``--exhaustive`` every shipped variant of both archs
  (the same check as ``python -m jax_fa4.tools.precompile --check``): no local memory, at most 255
  registers, shared memory within 227 KB, the instructions of ``variants.REQUIRED_SASS``.
* The representative rule covers what it promises (every class, every option value), and the
  quick tier's sample one kernel per arch × kind × mode.
* The SASS parser (``jax_fa4.tools.sass``) on a listing of known content and on a real object.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

import compiled
from compiled import needs_disassembler, shipped_problems
from jax_fa4.tools import precompile, sass
from jax_fa4.kernels.preprocess_config import PreprocessConfig
from jax_fa4.tools.variants import (REQUIRED_SASS, Variant, family_mode_class, representative,
                                    variant_class, variant_features, variant_mode, variants)

REPO = Path(__file__).resolve().parents[1]


@needs_disassembler
def test_shipped_variants_have_clean_sass(shipped_cache):
    selected = variants("default") if compiled.EXHAUSTIVE else compiled.shipped_representatives()
    problems = shipped_problems(shipped_cache, list(selected), jobs=os.cpu_count() or 1)
    assert not problems, "\n".join(problems)


def test_representatives_cover_every_class_and_option_value():
    """``variants.representative`` (``--representative`` of precompile and sass_diff): every
    class and every option value of each family, deterministically, a small share of the set."""
    shipped = variants("default")
    chosen = representative(shipped)
    assert set(chosen) <= set(shipped) and len(chosen) == len(set(chosen))
    assert {variant_class(v) for v in chosen} == {variant_class(v) for v in shipped}
    kinds = {variant_class(v)[:2] for v in shipped}
    for kind in kinds:
        every = set().union(*(variant_features(v) for v in shipped if variant_class(v)[:2] == kind))
        got = set().union(*(variant_features(v) for v in chosen if variant_class(v)[:2] == kind))
        assert got == every, (kind, every - got)
    assert len(chosen) < 0.15 * len(shipped)
    assert representative(shipped) == chosen  # the rule is deterministic


def test_quick_tier_compiles_one_shipped_kernel_per_arch_kind_and_mode():
    """The quick tier's shipped sample: exactly one variant of every arch × kernel kind × mode
    of the shipped set (so its size grows with families and modes, not with options or head
    dims), both archs, every kernel kind and every mode present."""
    shipped = variants("default")
    chosen = list(compiled.shipped_representatives())
    assert set(chosen) <= set(shipped) and len(chosen) == len(set(chosen))
    classes = {family_mode_class(v) for v in shipped}
    assert sorted(map(family_mode_class, chosen)) == sorted(classes)
    assert {v.arch for v in chosen} == {"sm_90a", "sm_100a"}
    assert {variant_mode(v.config) for v in chosen} == {"dense", "varlen", "paged", "decode",
                                                        "deterministic"}
    # every kernel kind but the test-only ones: the exp2 probe, and the sm90 backward pair
    # until a tuning row picks it (its configs are the GPU tests' and the sweeps')
    assert ({v.config.kernel_name for v in chosen} == {v.config.kernel_name for v in shipped}
            == set(REQUIRED_SASS) - {"exp2_probe", "sm90_bwd_pair"})
    # a new option value or head dim adds nothing to the tier
    wider = shipped + [Variant(PreprocessConfig("float16", 80), "sm_90a")]
    assert len(compiled.quick_sample(wider)) == len(compiled.quick_sample(shipped))


def test_representative_prefers_what_is_compiled_anyway():
    configs = [PreprocessConfig(dtype, 128) for dtype in ("bfloat16", "float16")]
    listed = [Variant(c, "sm_90a") for c in configs]
    # one class (same head dim, mode): dtype values must both appear, so both are chosen
    assert representative(listed) == listed
    one_dtype = [Variant(PreprocessConfig("bfloat16", d), "sm_90a") for d in (64, 128)]
    assert representative(one_dtype) == one_dtype  # two head-dim classes
    same = [Variant(PreprocessConfig("bfloat16", 128), "sm_90a")] * 3
    assert representative(same) == same[:1]


def test_quick_tier_keeps_one_listed_config_per_class():
    """A tiered list marks every config (all run with --exhaustive); the quick tier keeps one
    per class of the list, a shipped representative where the list has one."""
    from jax_fa4.tools.variants import sm90_fwd_option_configs

    configs = sm90_fwd_option_configs()
    params = compiled.tiered(configs, "sm_90a")
    assert [p.values[0] for p in params] == list(dict.fromkeys(configs))
    index = params[0].marks[0].args[0]
    listed = set(compiled._LISTS[index])
    quick = compiled.quick_choice(index)
    assert quick <= listed
    classes = {family_mode_class(v) for v in listed}
    assert {family_mode_class(v) for v in quick} == classes and len(quick) == len(classes)
    shipped = set(compiled.shipped_representatives())
    for cls in classes:
        if any(v in shipped for v in listed if family_mode_class(v) == cls):
            assert any(v in shipped for v in quick if family_mode_class(v) == cls)


# -- jax_fa4.tools.sass ---------------------------------------------------------------------------
_LISTING = """
Resource usage:
 Common:
  GLOBAL:0
 Function kern_a:
  REG:168 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:1282 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function kern_b:
  REG:40 STACK:16 SHARED:0 LOCAL:8 CONSTANT[0]:900 TEXTURE:0 SURFACE:0 SAMPLER:0

\tcode for sm_90a
\t\tFunction : kern_a
\t.headerflags\t@"EF_CUDA_SM90"
        /*0000*/                   LDC R1, c[0x0][0x28] ;       /* 0x00000a00ff017b82 */
                                                                /* 0x000fe20000000800 */
        /*0010*/              @!P0 HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0 ;
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24, gsb0 ;
        /*0030*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0 ;
        /*0040*/                   USETMAXREG.DEALLOC.CTAPOOL 0x18 ;
        /*0050*/              @UP1 UTMALDG.2D [UR8], [UR4] ;
        /*0060*/                   FFMA2 R2, R2, R4, R6 ;
        /*0070*/                   FFMA R3, R3, R5, R7 ;
        /*0080*/                   EXIT ;
\t\t..........

\t\tFunction : kern_b
        /*0000*/                   STL [R1], R2 ;
        /*0010*/                   LDL R2, [R1] ;
        /*0020*/                   EXIT ;
"""


def test_listing_parser(monkeypatch):
    monkeypatch.setattr(sass, "_run_cuobjdump", lambda path: _LISTING)
    a, b = sass._disassemble(b"")
    assert (a.name, a.arch, a.registers, a.shared_static, a.stack, a.local) == (
        "kern_a", "sm_90a", 168, 1024, 0, 0)
    assert a.count("HGMMA") == 2 and a.count("UTMALDG") == 1 and a.count("USETMAXREG") == 2
    assert a.count("FFMA") == 1 and a.count("FFMA2") == 1  # FFMA2 is its own opcode
    assert a.setmaxnreg() == [24, 240] and not a.spills
    assert a.matches(r"HGMMA\.\S+ R24, gdesc\[UR8\]") == 1
    assert a.normalised()[:2] == ["LDC R1, c[X][X]", "@!P0 HGMMA.64x128x16.F32.BF16 R24, "
                                                     "gdesc[UR4], RZ, !UPT, gsb0"]
    assert b.spills and (b.stack, b.local, b.count("LDL"), b.count("STL")) == (16, 8, 1, 1)
    assert sass.problems(a, dynamic_smem_bytes=227 * 1024, must_have=("HGMMA",)) == []
    lines = sass.problems(b, dynamic_smem_bytes=228 * 1024, must_have=("HGMMA",), label="b")
    assert [line.split(":")[1].split()[0] for line in lines] == ["local", "233472", "no"]


def test_normalised_sass_compares_instructions_only():
    """What jax_fa4/tools/sass_diff.py compares: two listings of the same code at other addresses,
    with other encodings and immediates, normalise to the same lines; another opcode or
    predicate does not."""
    a = ("        /*0010*/                   IMAD R4, R7, 0x400, R0 ;   /* 0x0000040007047824 */\n"
         "        /*0020*/                   HGMMA.64x64x16.F32.BF16 R184, gdesc[UR8], RZ ;\n")
    b = ("        /*0a10*/                   IMAD R4, R7, 0x800, R0 ;   /* 0x0000080007047824 */\n"
         "        /*0a20*/                   HGMMA.64x64x16.F32.BF16 R184, gdesc[UR8], RZ ;\n")

    def lines(text: str) -> list[str]:
        return sass.Kernel("k", "sm_90a", 0, 0, 0, 0, text).normalised()

    assert lines(a) == lines(b) and len(lines(a)) == 2
    assert lines(a) != lines(a.replace("IMAD", "IADD3"))
    assert lines(a) != lines(a.replace("   IMAD", "@P0 IMAD"))


def test_sass_diff_tells_register_allocation_from_changed_instructions():
    """A manifest entry keeps enough to classify a difference without the old listing."""
    from jax_fa4.tools import sass_diff

    old = ["IMAD R4, R7, X, R0", "@P0 BRA X", "UIADD3 UR6, UP1, UPT, UR14, X, URZ"]
    renamed = ["IMAD R5, R9, X, R0", "@P1 BRA X", "UIADD3 UR4, UP0, UPT, UR14, X, URZ"]
    more = old + ["VIMNMX R4, R4, R2, PT", "@!P2 VIMNMX R4, R4, RZ, PT"]
    base = sass_diff.digest(old)
    assert sass_diff.difference(base, sass_diff.digest(old)) is None
    assert sass_diff.difference(base, sass_diff.digest(renamed)) == "register allocation only"
    assert sass_diff.difference(base, sass_diff.digest(more)) == "+2 instructions: VIMNMX 0->2"
    assert sass_diff.difference(base, sass_diff.digest(old[::-1])) == (
        "instruction order (same opcode counts)")
    assert sass_diff.difference(base["sha256"], sass_diff.digest(renamed)) == (
        "listing (older manifest: no detail)")


def test_cuda_elves_finds_whole_embedded_cubins():
    elf = bytearray(256)
    elf[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<H", elf, 18, sass.EM_CUDA)
    struct.pack_into("<QQ", elf, 0x20, 0, 192)  # no program headers; sections at 192
    struct.pack_into("<HHHH", elf, 0x36, 0, 0, 64, 1)  # one 64-byte section header
    struct.pack_into("<IQQ", elf, 192 + 4, 1, 0, 0)  # its header: PROGBITS
    struct.pack_into("<QQ", elf, 192 + 0x18, 100, 50)  # data at [100, 150)
    host = bytearray(b"\x7fELF\x02\x01" + bytes(58))  # a host ELF header (e_machine 0): skipped
    data = bytes(host) + b"pad" + bytes(elf) + b"tail"
    assert sass.cuda_elves(data) == [bytes(elf)]
    assert sass.cuda_elves(data[:-10 - len(b"tail")]) == []  # cut off: not a whole cubin


@needs_disassembler
def test_a_real_object(shipped_cache):
    obj = compiled.compiled_object(shipped_cache, PreprocessConfig("bfloat16", 128), "sm_90a")
    (kernel,) = sass.kernels(obj)
    assert kernel.arch == "sm_90a" and "BwdPreprocess" in kernel.name
    assert 0 < kernel.registers <= 255 and not kernel.spills and kernel.count("EXIT") >= 1
    assert precompile.variant_problems(Variant(PreprocessConfig("bfloat16", 128), "sm_90a"),
                                       obj) == []


def test_missing_disassembler_says_how_to_install(monkeypatch, tmp_path):
    sass.cuobjdump_path.cache_clear()
    monkeypatch.setenv(sass.ENV_CUOBJDUMP, str(tmp_path / "nope"))
    with pytest.raises(sass.DisassemblerNotFoundError, match="JAX_FA4_CUOBJDUMP"):
        sass.cuobjdump_path()
    sass.cuobjdump_path.cache_clear()
