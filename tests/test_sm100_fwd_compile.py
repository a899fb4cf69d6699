"""The sm100 forward kernel compiles for sm_100a on a CPU-only machine, with clean SASS.

Nothing here runs a kernel (no Blackwell GPU exists in this project): it proves the kernel
traces, lowers and assembles for sm_100a, and that the machine code has the structure the design
needs. Each config of ``fwd_config.test_configs()`` is compiled through the project's own
``compile_config(config, "sm_100a")`` (the binding's path: dynamic B/S/H; objects from the
test run's ``shipped_cache``; the quick tier: the representative configs, tests/compiled.py;
``--exhaustive``: all of them; every shipped variant: tests/test_shipped_kernels.py) and its SASS
read with jax_fa4.tools.sass:

  * tcgen05 MMAs (UTCHMMA for bf16/fp16), tcgen05.commit (UTCBAR), TMEM loads/stores (LDTM/STTM),
    TMA loads and stores (UTMALDG/UTMASTG; varlen: no TMA store but exactly the 16-byte row
    stores of O), MUFU.EX2 *and* the software exp2's FFMA2 polynomial;
  * TMEM allocation balanced: on sm_100a ``tcgen05.alloc`` assembles to
    ``UTCATOMSWS.FIND_AND_SET`` (twice per allocation site: the first try and the retry loop),
    ``tcgen05.relinquish_alloc_permit`` to ``UVIRTCOUNT.DEALLOC.SMPOOL`` and ``tcgen05.dealloc`` to
    ``UTCATOMSWS.AND`` (read from the SASS listing: ``python -m jax_fa4.tools.sass --sass-out``);
  * no local memory (LDL/STL), no stack, shared memory within 227 KB; warp specialisation:
    launched at 65536 / threads registers, ``USETMAXREG`` to exactly the config's split.

Registers, shared memory and compile time per variant are printed (pytest -s).
``test_tmem_fragment_maps`` checks the TMEM register maps at trace time;
tests/test_sm100_fwd_protocol.py model-checks the synchronisation.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from compiled import compiled_report, needs_disassembler, tiered
from jax_fa4.ffi.compiler import compiler_available
from jax_fa4.kernels.sm100.fwd_config import FwdConfig, shipped_configs, test_configs
from jax_fa4.kernels.spec import SMEM_CAPACITY_BYTES

ARCH = "sm_100a"

pytestmark = pytest.mark.skipif(not compiler_available(), reason="needs nvidia-cutlass-dsl")


def _compile_and_report(config: FwdConfig, cache):
    """(the kernel's SASS, its listing, compile seconds); the object from ``shipped_cache``."""
    k, seconds = compiled_report(cache, config, ARCH)
    assert "FlashAttentionForwardSm100" in k.name, k.name
    return k, k.sass, seconds


def test_configs_are_shipped_and_valid():
    shipped = set(shipped_configs())
    for cfg in test_configs():
        assert cfg in shipped
        cfg.validate()
        assert cfg.smem_bytes() <= SMEM_CAPACITY_BYTES
    # each dense variant also paged, varlen, with max logits, and with segment ids (with and
    # without max logits)
    assert len(shipped) == 432 and sum(c.paged for c in shipped) == 72
    assert sum(c.varlen for c in shipped) == 72 and not any(c.paged and c.varlen for c in shipped)
    assert sum(c.max_logits for c in shipped) == 144 and sum(c.segments for c in shipped) == 144
    assert not any((c.max_logits or c.segments) and (c.paged or c.varlen) for c in shipped)

    def kinds(select):
        return {(c.dtype, c.head_dim, c.head_dim_v, c.mask, c.has_softcap) for c in shipped
                if select(c)}

    dense = kinds(lambda c: not (c.paged or c.varlen or c.max_logits or c.segments))
    assert len(dense) == 72  # 6 head-dim rows × 2 dtypes × 3 masks × softcap or not
    assert kinds(lambda c: c.varlen) == kinds(lambda c: c.max_logits and not c.segments) == dense
    assert kinds(lambda c: c.segments and c.max_logits) == kinds(
        lambda c: c.segments and not c.max_logits) == dense
    assert sum(c.varlen for c in test_configs()) == 7
    assert {(c.head_dim, c.q_tiles) for c in test_configs() if c.max_logits} == {(128, 2),
                                                                               (256, 1)}
    assert {c.q_tiles for c in test_configs() if c.segments} == {1, 2}


def test_max_logits_config_and_signature():
    """max_logits: the dense tuning plus a third output, the Hopper forward's contract; dense
    calls only."""
    from jax_fa4.kernels.sm100.fwd_config import max_logits_config
    from jax_fa4.kernels.sm90 import fwd_config as sm90_fwd_config

    cfg = max_logits_config("bfloat16", 128, 128, "causal", True)
    assert cfg == dataclasses.replace(FwdConfig.make("bfloat16", 128, 128, "causal", True),
                                      max_logits=True)
    sig = cfg.signature()
    assert [a.name for a in sig.inputs] == ["q", "k", "v", "params"]
    assert [a.name for a in sig.outputs] == ["out", "lse", "max_logits"]
    hopper = sm90_fwd_config.max_logits_config("bfloat16", 128, 128, "causal", True).signature()
    assert sig.outputs[1:] == hopper.outputs[1:]  # lse and max_logits: (B, H, Sq) float32
    for mode in ("paged", "varlen"):
        with pytest.raises(ValueError, match="max logits"):
            FwdConfig.make("bfloat16", 128, max_logits=True, **{mode: True})


def test_segments_config_and_signature():
    """segments: the dense tuning plus the three tables after params, the Hopper forward's
    contract (with max logits: the third output too); dense calls only."""
    from jax_fa4.kernels.sm100.fwd_config import segments_config
    from jax_fa4.kernels.sm90 import fwd_config as sm90_fwd_config

    for max_logits in (False, True):
        cfg = segments_config("bfloat16", 64, 64, "local", True, max_logits=max_logits)
        assert cfg == dataclasses.replace(FwdConfig.make("bfloat16", 64, 64, "local", True),
                                          segments=True, max_logits=max_logits)
        hopper = sm90_fwd_config.segments_config("bfloat16", 64, 64, "local", True,
                                                 max_logits=max_logits).signature()
        sig = cfg.signature()
        assert [a.name for a in sig.inputs] == ["q", "k", "v", "params", "seg_tiles",
                                                "seg_rows", "kv_ids"]
        assert sig.inputs[4:] == hopper.inputs[4:] and sig.outputs[1:] == hopper.outputs[1:]
        assert [a.name for a in sig.outputs][2:] == (["max_logits"] if max_logits else [])
    for mode in ("paged", "varlen"):
        with pytest.raises(ValueError, match="segment ids"):
            FwdConfig.make("bfloat16", 128, segments=True, **{mode: True})


def test_varlen_config_validation():
    """varlen: the varlen call signature; never combined with paged KV."""
    from jax_fa4.kernels.sm100.fwd_config import varlen_config

    cfg = varlen_config("bfloat16", 128, 128, "causal")
    sig = cfg.signature()
    assert [a.name for a in sig.inputs] == ["q", "k", "v", "params", "cu_seqlens_q",
                                            "cu_seqlens_k"]
    assert [a.name for a in sig.outputs] == ["out", "lse"]
    assert cfg.num_sms == FwdConfig.make("bfloat16", 128).num_sms  # persistent, as dense
    with pytest.raises(ValueError, match="varlen and paged"):
        FwdConfig.make("bfloat16", 128, varlen=True, paged=True)


@needs_disassembler
@pytest.mark.parametrize("config", tiered(test_configs(), ARCH), ids=lambda c: (
    f"{c.dtype}-d{c.head_dim}-dv{c.head_dim_v}-{c.mask}{'-softcap' if c.has_softcap else ''}"
    f"{'-varlen' if c.varlen else ''}{'-paged' if c.paged else ''}"
    f"{'-maxlogits' if c.max_logits else ''}{'-segments' if c.segments else ''}"))
def test_compiles_with_clean_sass(config, shipped_cache):
    k, sass, seconds = _compile_and_report(config, shipped_cache)
    print(f"\n{config.describe()}: {k.registers} regs, {config.smem_bytes() / 1024:.0f} KB smem "
          f"(static {k.shared_static} B), {seconds:.1f} s; UTCHMMA {k.count('UTCHMMA')}")
    assert k.arch == ARCH
    # tcgen05 MMAs (16-bit inputs: UTCHMMA), their commits, TMEM traffic, TMA both ways
    assert k.count("UTCHMMA") > 0
    assert k.count("UTCBAR") > 0
    assert k.count("LDTM") > 0 and k.count("STTM") > 0
    assert k.count("UTMALDG") > 0
    if config.varlen:
        # O goes out row-predicated from registers, 16 bytes a store: no TMA store of a tile
        # (it would overwrite the next sequence's rows): each thread writes its row in
        # 16-column chunks, two 16-byte stores each, in the epilogue and in the padding zeros;
        # the one other global store is lse's (32-bit)
        assert k.count("UTMASTG") == 0
        stores = re.findall(r"\bSTG(?:\.[A-Z0-9]+)*", sass)
        wide = stores.count("STG.E.128")
        assert wide == 2 * 2 * config.q_tiles * (config.head_dim_v // 16), stores
        assert sorted(set(stores)) == ["STG.E", "STG.E.128"] and len(stores) == wide + 1, stores
    else:
        assert k.count("UTMASTG") > 0
        # from registers only the softmax's 32-bit row statistics: lse, and the max logit
        stores = re.findall(r"\bSTG(?:\.[A-Z0-9]+)*", sass)
        assert stores == ["STG.E"] * (2 if config.max_logits else 1), stores
    assert k.count("MUFU.EX2") > 0  # (the software exp2's share: the test below)
    # TMEM allocation balanced (see the module docstring for the SASS names)
    alloc = len(re.findall(r"UTCATOMSWS\.FIND_AND_SET", sass))
    dealloc = len(re.findall(r"UTCATOMSWS\.AND\b", sass))
    relinquish = len(re.findall(r"UVIRTCOUNT\.DEALLOC\.SMPOOL", sass))
    assert dealloc >= 1 and alloc == 2 * dealloc and relinquish == dealloc, (alloc, dealloc,
                                                                            relinquish)
    # no spills, no stack, registers and shared memory within sm_100's limits
    assert k.count("LDL") == 0 and k.count("STL") == 0
    assert k.local == 0 and k.stack == 0
    # warp specialisation: launched at the register file / threads, then the softmax warpgroups
    # raise their count and the correction and MMA / epilogue / load warpgroup lower theirs
    assert k.registers == config.launch_registers()
    softmax, correction, other = config.registers()
    assert re.findall(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d+, (0x[0-9a-f]+)", sass) == [
        hex(softmax)]
    assert sorted(int(v, 16) for v in re.findall(r"USETMAXREG\.DEALLOC\.CTAPOOL (0x[0-9a-f]+)",
                                                 sass)) == sorted([correction, other])
    # the reserved 1 KB is the system's (.nv.shared.reserved); the kernel checks while tracing
    # that its shared storage is exactly config.smem_bytes(), which validate() bounds
    assert k.shared_static <= 1024 and config.smem_bytes() <= SMEM_CAPACITY_BYTES


@needs_disassembler
def test_software_exp2_moves_its_share_off_mufu(shipped_cache):
    """exp2_sw_per_32 = n moves n of every 32 exponentials of a row (tile_n per thread) from
    MUFU.EX2 to the FMA pipes: exactly tile_n·n/32 fewer MUFU.EX2, and 3 more FFMA2 per pair
    (the degree-3 polynomial, two lanes per FFMA2) than the same kernel with n = 0."""
    config = FwdConfig.make("bfloat16", 128)
    assert config.exp2_sw_per_32 > 0
    with_sw, _, _ = _compile_and_report(config, shipped_cache)
    without, _, _ = _compile_and_report(dataclasses.replace(config, exp2_sw_per_32=0),
                                        shipped_cache)
    moved = config.tile_n * config.exp2_sw_per_32 // 32
    assert without.count("MUFU.EX2") - with_sw.count("MUFU.EX2") == moved
    assert with_sw.count("FFMA2") - without.count("FFMA2") == 3 * moved // 2


@pytest.mark.parametrize("head_dim,head_dim_v", [(128, 128), (64, 64), (192, 192), (256, 256)])
def test_tmem_fragment_maps(head_dim, head_dim_v):
    """The kernel's TMEM register maps, evaluated at trace time on the objects the kernel builds
    (``FlashAttentionForwardSm100.make_mmas`` / ``softmax_tmem_copies`` / ``o_tmem_copies`` /
    ``pv_operand_a``), for a few lanes:

    * S load: register i of thread L is score (row L, key i): the masks' column test and the
      P packing rely on it;
    * P store: chunk c, register i of thread L lands in P's 32-bit column 16c + i of row L;
    * the P·V MMA reads P element (m, k) from lane m, 32-bit column k // 2, half k % 2 (16-bit
      units: offset m·2^17 + k), so column c must hold keys (2c, 2c + 1) with the even key in the
      low half, which is what ``cvt_pack_f32x2(s[2c], s[2c+1])`` writes;
    * O load / store (rescale and epilogue): chunk c, register i of thread L is O (L, 16c + i).

    No Blackwell GPU exists here: this is the part of "the first B200 run shows P in the wrong
    place" that can be settled without one."""

    from jax_fa4.ffi.compiler import set_target_arch

    set_target_arch(ARCH)  # (the DSL keeps the last compile's arch: maybe sm_90a)
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32

    from jax_fa4.kernels.sm100.flash_fwd import FlashAttentionForwardSm100

    kernel = FlashAttentionForwardSm100(FwdConfig.make("bfloat16", head_dim, head_dim_v))
    tile_n, lanes = kernel.tile_n, (0, 1, 31, 32, 77, 127)
    found: dict = {}

    @cute.jit
    def trace():
        qk_mma, pv_mma, tP_layout = kernel.make_mmas()
        tmem_ptr = cute.make_ptr(Float32, 0, cute.AddressSpace.tmem, assumed_align=16)
        for lane in lanes:
            ld_s, tTtS0, tTcS, p_io = kernel.softmax_tmem_copies(qk_mma, tmem_ptr, lane)
            found[("S", lane)] = [tTcS[i] for i in range(cute.size(tTcS))]
            _, _, tTcP, p_chunk = p_io
            found[("P", lane)] = [tTcP[None, 0, 0, c][i]
                                  for c in range(cute.size(tTcP, mode=[3]))
                                  for i in range(cute.size(tTcP[None, 0, 0, c]))]
            tTcO = kernel.o_tmem_copies(pv_mma, tmem_ptr, lane)[-1]
            found[("O", lane)] = [tTcO[None, 0, 0, c][i]
                                  for c in range(cute.size(tTcO, mode=[3]))
                                  for i in range(cute.size(tTcO[None, 0, 0, c]))]
        tOrP = kernel.pv_operand_a(pv_mma, tP_layout, tmem_ptr)[0]
        # (mma atom (m, k-in-block), 1, k block): offsets relative to P_0's base, 16-bit units
        flat = cute.make_tensor(cute.make_ptr(cutlass.BFloat16, 0, cute.AddressSpace.generic),
                                tOrP.layout)
        found["A"] = [[cute.crd2idx(((m, k % 16), 0, k // 16), flat.layout) for k in range(tile_n)]
                      for m in (0, 1, 63, 127)]

    from jax_fa4.ffi.compiler import _lock, set_target_arch

    with _lock:
        set_target_arch(ARCH)
        cute.compile(trace)
    for lane in lanes:
        assert found[("S", lane)] == [(lane, i) for i in range(tile_n)], lane
        assert found[("P", lane)] == [(lane, c) for c in range(tile_n // 2)], lane
        assert found[("O", lane)] == [(lane, c) for c in range(head_dim_v)], lane
    for m, offsets in zip((0, 1, 63, 127), found["A"]):
        assert offsets == [m * 2 ** 17 + k for k in range(tile_n)], m
