"""The sm90 forward kernel compiles for sm_90a on a CPU-only machine, with clean SASS.

Variants are compiled with dynamic B/S/H (symbolic dims) and their cubins inspected
(jax_fa4.tools.sass): HGMMA (warpgroup MMA), UTMALDG/UTMASTG (TMA), setmaxnreg in both directions,
MUFU.EX2, no local memory (LDL/STL, stack). Registers, shared memory and compile time are
printed per variant (run with -s to see them). The quick tier runs one config per arch × kind ×
mode of each list (tests/compiled.py), ``--exhaustive`` all of them;
every shipped variant's SASS: tests/test_shipped_kernels.py.

Plus CPU-only checks of the pieces whose mistakes would be silent on the GPU:
  * the key-block ranges and mask regions (common/geometry.py) against brute force;
  * the accumulator views (common/layout.py) against the MMA's own thread/value layouts, for
    every thread: rows/columns of the softmax view, the P register operand of the PV GEMM.
"""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from compiled import assert_no_local_memory, compiled_sass, needs_disassembler, tiered
from jax_fa4.kernels.common.geometry import FwdBlocks, resolve_windows
from jax_fa4.kernels.sm90.fwd_config import (FwdConfig, TUNING_TABLE, decode_config,
                                              decode_option_configs, shipped_configs)
from jax_fa4.kernels.sm90.v_transpose_plan import VTransposePlan
from jax_fa4.kernels.spec import SMEM_BUDGET_BYTES
from jax_fa4.tools.variants import (sm90_fwd_fallback_configs, sm90_fwd_option_configs,
                                    sm90_fwd_segments_persistent_configs)

REPO = Path(__file__).resolve().parents[1]
ARCH = "sm_90a"


def _training_configs() -> list[FwdConfig]:
    """Every table row and mask kind, with and without softcap (bf16), fp16 at head dim 128,
    and the serial-mainloop fallbacks."""
    out = [FwdConfig.make("bfloat16", d, dv, mask, softcap)
           for (d, dv), masks in TUNING_TABLE.items() for mask in masks
           for softcap in (False, True)]
    out += [FwdConfig.make("float16", 128, 128, mask, softcap)
            for mask in ("none", "causal", "local") for softcap in (False, True)]
    return out + list(sm90_fwd_fallback_configs())


def _id(cfg: FwdConfig) -> str:
    parts = [cfg.dtype[:4], f"{cfg.head_dim}/{cfg.head_dim_v}", cfg.mask]
    parts += ["softcap"] * cfg.has_softcap + ["serial"] * (not cfg.intra_wg_overlap)
    return "-".join(parts)


@needs_disassembler
@pytest.mark.parametrize("cfg", tiered(_training_configs(), ARCH), ids=_id)
def test_compiles_with_clean_sass(cfg, shipped_cache):
    k = compiled_sass(shipped_cache, cfg, ARCH)
    print(f"\n{cfg.describe()}: regs {k.registers}, smem {cfg.smem_bytes()} B, "
          f"HGMMA {k.count('HGMMA')}, MUFU.EX2 {k.count('MUFU.EX2')}")
    assert k.arch == ARCH
    assert k.count("HGMMA") > 0, "no warpgroup MMA in SASS"
    assert k.count("UTMALDG") > 0 and k.count("UTMASTG") > 0, "TMA loads/stores missing"
    assert_no_local_memory(k)
    assert k.count("USETMAXREG.DEALLOC") > 0 and k.count("USETMAXREG.TRY_ALLOC") > 0, \
        "setmaxnreg ignored"
    assert k.count("MUFU.EX2") > 0
    assert k.count("STSM") > 0, "O epilogue should use stmatrix"
    assert (k.count("MUFU.TANH") > 0) == cfg.has_softcap


def _check_decode_tile_sass(cfg: FwdConfig, k) -> None:
    """A decode tile's SASS facts: 256 threads, HGMMA and TMA, no spills; with two CTAs per SM
    the launch bound caps the entry registers at 65536 / (2·256) = 128, setmaxnreg hands the
    consumers 232 (the producer 24) and the shared memory fits half an SM; with one, 240 / 24."""
    print(f"\n{cfg.describe()}: regs {k.registers}, smem {cfg.smem_bytes()} B, "
          f"setmaxnreg {k.setmaxnreg()}")
    assert cfg.num_threads == 256
    assert k.count("HGMMA") > 0 and k.count("UTMALDG") > 0
    assert_no_local_memory(k)
    if cfg.ctas_per_sm == 2:
        assert k.registers == 128, "entry register cap of two CTAs per SM"
        assert k.setmaxnreg() == [24, 232], k.setmaxnreg()
        assert 2 * (k.shared_static + cfg.smem_bytes() + 1024) <= 228 * 1024
    else:
        assert k.setmaxnreg() == [24, 240], k.setmaxnreg()


def _decode_id(cfg: FwdConfig) -> str:
    return (f"{'paged-' if cfg.paged else ''}{cfg.dtype[:4]}-{cfg.head_dim}/{cfg.head_dim_v}"
            f"{'-softcap' if cfg.has_softcap else ''}-{cfg.ctas_per_sm}cta-n{cfg.tile_n}"
            f"x{cfg.stages}")


@needs_disassembler
@pytest.mark.parametrize("cfg", tiered([decode_config("bfloat16", d, dv)
                                        for (d, dv) in TUNING_TABLE]
                                       + [decode_config("float16", 128, 128, has_softcap=True)],
                                       ARCH), ids=_decode_id)
def test_decode_tile_compiles_with_clean_sass(cfg, shipped_cache):
    """The shipped decode tile of every head dim (jax_fa4/backends/sm90.py): head-major q and out,
    TMA-stored O, two CTAs per SM up to head_dim_v 192."""
    assert cfg.ctas_per_sm == (2 if cfg.head_dim_v <= 192 else 1) and cfg.qo_head_major
    k = compiled_sass(shipped_cache, cfg, ARCH)
    _check_decode_tile_sass(cfg, k)
    assert k.count("UTMASTG") > 0


@needs_disassembler
@pytest.mark.parametrize("cfg", tiered(decode_option_configs(), ARCH), ids=_decode_id)
def test_decode_tile_alternatives_compile(cfg, shipped_cache):
    """The decode-tile alternatives the decode benchmark and GPU tests compare
    (fwd_config.DECODE_OPTIONS), dense and paged."""
    _check_decode_tile_sass(cfg, compiled_sass(shipped_cache, cfg, ARCH))


def _fp8_id(cfg: FwdConfig) -> str:
    form = ("paged-" if cfg.paged else "varlen-" if cfg.varlen
            else "decode-" if cfg.qo_head_major else "")
    return (f"fp8-{form}{cfg.head_dim}-{cfg.mask}{'-softcap' if cfg.has_softcap else ''}-"
            f"{cfg.tile_m}x{cfg.tile_n}{'-f32' if cfg.out_f32 else ''}")


@needs_disassembler
@pytest.mark.parametrize("cfg", tiered([c for c in shipped_configs()
                                        if c.fp8 and not (c.paged or c.varlen)], ARCH),
                         ids=_fp8_id)
def test_fp8_compiles_with_clean_sass(cfg, shipped_cache):
    """Every shipped FP8 forward, the decode tile (head-major q and out, float32 out or not)
    included: e4m3 WGMMAs (QGMMA), TMA, no local memory within the register split (the
    producer's V transpose fits its 24 or 32 registers), and the transpose's instructions: at
    each of its call sites (two, three with two staging stages) one ldmatrix.x4.trans and one
    stmatrix.x4 per 512 bytes of a warp's share (v_transpose_plan) and 4 prmt each."""
    _check_fp8_sass(cfg, compiled_sass(shipped_cache, cfg, ARCH), transposes_per_site=1)


def _check_fp8_sass(cfg: FwdConfig, k, transposes_per_site: int) -> None:
    """An FP8 forward's SASS facts: QGMMA (no HGMMA), TMA loads and O's store (a float32 out:
    stored from the accumulators, 8-byte STG, no TMA store and no epilogue stmatrix), no local
    memory, the register split, and per transpose call site ``transposes_per_site`` unrolled
    transposes of ldmatrix.x4.trans / 4 prmt / stmatrix.x4 per 512 bytes of a warp's share."""
    plan = VTransposePlan(cfg.tile_n, cfg.head_dim_v)
    transposes = (2 + (cfg.v_staging_stages - 1)) * transposes_per_site
    print(f"\n{cfg.describe()}: regs {k.registers}, smem {cfg.smem_bytes()} B "
          f"(V staging stages {cfg.v_staging_stages}), setmaxnreg {k.setmaxnreg()}, "
          f"LDSM {k.count('LDSM')}, STSM {k.count('STSM')}, PRMT {k.count('PRMT')}, "
          f"SEL {k.count('SEL')}")
    assert k.arch == ARCH
    assert k.count("QGMMA") > 0 and k.count("HGMMA") == 0
    assert k.count("UTMALDG") > 0 and (k.count("UTMASTG") > 0) != cfg.out_f32
    if cfg.out_f32:
        assert k.count("STG.E.64") > 0
    assert_no_local_memory(k)
    assert k.setmaxnreg() == sorted(cfg.register_split()), k.setmaxnreg()
    assert k.count("LDSM") == k.count("LDSM.16.MT88.4") == transposes * plan.instructions
    # the transpose's stmatrix and the epilogue's (a 16-bit O, one per 16 columns of Dv)
    epilogue = 0 if cfg.out_f32 else cfg.head_dim_v // 16
    assert k.count("STSM.16.M88.4") == transposes * plan.instructions + epilogue
    assert k.count("PRMT") >= 4 * transposes * plan.instructions
    assert cfg.smem_bytes() <= SMEM_BUDGET_BYTES


@needs_disassembler
@pytest.mark.parametrize("cfg", tiered([c for c in shipped_configs()
                                        if c.fp8 and (c.paged or c.varlen)], ARCH),
                         ids=_fp8_id)
def test_fp8_paged_and_varlen_compile_with_clean_sass(cfg, shipped_cache):
    """Every shipped FP8 paged and varlen forward: the dense FP8 facts (no local memory within
    the register split: the producer holds the page-table reads, the highest block's key count
    and the transposes in its 24 or 32 registers), with two transposes at each call site, the
    dense one and the one that clears the keys past the sequence in registers
    (VTransposer.stage's keys_left: selects build its byte masks; no other shared-memory
    instruction or barrier); varlen: the last, partial tile's rows stored in 16-byte pieces."""
    k = compiled_sass(shipped_cache, cfg, ARCH)
    _check_fp8_sass(cfg, k, transposes_per_site=2)
    assert k.count("SEL") > 0  # the byte masks' selects
    if cfg.varlen:
        assert k.count("STG.E.128") > 0


def _option_id(cfg: FwdConfig) -> str:
    parts = [cfg.dtype[:4], f"{cfg.head_dim}/{cfg.head_dim_v}", cfg.mask,
             f"{cfg.tile_m}x{cfg.tile_n}"]
    parts += ["pp"] * cfg.pingpong + [f"rs{cfg.rescale_threshold:g}"] * (cfg.rescale_threshold > 0)
    parts += ["softcap"] * cfg.has_softcap + ["serial"] * (not cfg.intra_wg_overlap)
    parts += [f"persist{cfg.num_sms}"] * (cfg.num_sms > 0) + ["dyn"] * cfg.dynamic_tiles
    return "-".join(parts)


@needs_disassembler
@pytest.mark.parametrize("cfg", tiered(sm90_fwd_option_configs(), ARCH), ids=_option_id)
def test_v2_options_compile_with_clean_sass(cfg, shipped_cache):
    """The v2 tuning options (ping-pong, 3 consumer warpgroups, conditional rescaling): the
    representative configs the GPU tests run, with the SASS facts each option must leave."""
    k = compiled_sass(shipped_cache, cfg, ARCH)
    print(f"\n{cfg.describe()}: regs {k.registers}, smem {cfg.smem_bytes()} B, "
          f"setmaxnreg {k.setmaxnreg()}")
    assert k.arch == ARCH
    assert k.count("HGMMA") > 0 and k.count("UTMALDG") > 0 and k.count("UTMASTG") > 0
    assert_no_local_memory(k)
    # setmaxnreg in both directions, with the budget of the warpgroup count (flash_fwd._REGS)
    consumer, producer = {2: (240, 24), 3: (160, 32)}[cfg.num_mma_warpgroups]
    assert k.count("USETMAXREG.DEALLOC") > 0 and k.count("USETMAXREG.TRY_ALLOC") > 0, \
        "setmaxnreg ignored"
    assert k.setmaxnreg() == sorted({consumer, producer}), k.setmaxnreg()
    assert k.registers == 65536 // cfg.num_threads // 8 * 8, "entry register cap"
    # no WGMMA serialisation: one wait per GEMM group, not one per HGMMA instruction
    assert 2 * k.count("WARPGROUP.DEPBAR") < k.count("HGMMA"), "wgmma serialised by ptxas"
    assert k.count("WARPGROUP.DEPBAR") == k.count("WARPGROUP.ARRIVE")
    # ping-pong: one pre-arrive plus one arrive per loop body (v1: only the epilogue's arrive)
    if cfg.pingpong:
        assert k.count("BAR.ARV") >= 3 and k.count("BAR.SYNC") >= 4, (k.count("BAR.ARV"),
                                                                      k.count("BAR.SYNC"))
    else:
        assert k.count("BAR.ARV") == 1
    # conditional rescaling: the O rescale sits behind a warp vote, once per loop body
    assert (k.count("VOTE.ANY") > 0) == (cfg.rescale_threshold > 0)
    assert (k.count("MUFU.TANH") > 0) == cfg.has_softcap
    assert k.count("STSM") > 0 and k.count("MUFU.EX2") > 0
    # O's TMA store: waited for right after it is issued, unless O has its own buffer in a
    # persistent kernel, which waits only before the next tile's epilogue overwrites the buffer
    # (the first wait precedes the first store) and before exiting
    ops = [line.split(";")[0] for line in k.sass.splitlines()]
    store = next(i for i, op in enumerate(ops) if "UTMASTG" in op)
    wait = next(i for i, op in enumerate(ops) if "DEPBAR.LE SB0" in op)
    assert (wait < store) == cfg.own_o_buffer, (wait, store)
    # dynamic tiles: the producer warp's atomic claims on the global counter (and only there)
    assert (k.count("ATOMG.E.ADD") > 0) == cfg.dynamic_tiles


@needs_disassembler
@pytest.mark.parametrize("cfg", tiered(sm90_fwd_segments_persistent_configs(), ARCH),
                         ids=_option_id)
def test_persistent_segments_compile_with_clean_sass(cfg, shipped_cache):
    """The persistent segment-id forward (variants.persistent_segments, in no table row yet):
    no local memory, the register split of its warpgroups, O in its own buffer with the TMA
    store waited for only before the next tile's epilogue, the atomic claims exactly with
    dynamic tiles, and the segment tables read by both the producer's and the consumers' tile
    loops (more global loads than the one-tile-per-CTA kernel of the same tile)."""
    k = compiled_sass(shipped_cache, cfg, ARCH)
    single = compiled_sass(shipped_cache, dataclasses.replace(cfg, num_sms=0,
                                                              dynamic_tiles=False), ARCH)
    print(f"\n{cfg.describe()}: regs {k.registers}, smem {cfg.smem_bytes()} B, "
          f"LDG {k.count('LDG')} (one tile per CTA: {single.count('LDG')})")
    assert cfg.own_o_buffer
    assert_no_local_memory(k)
    assert k.setmaxnreg() == sorted(set(cfg.register_split())), k.setmaxnreg()
    ops = [line.split(";")[0] for line in k.sass.splitlines()]
    store = next(i for i, op in enumerate(ops) if "UTMASTG" in op)
    wait = next(i for i, op in enumerate(ops) if "DEPBAR.LE SB0" in op)
    assert wait < store
    assert (k.count("ATOMG.E.ADD") > 0) == cfg.dynamic_tiles
    assert k.count("LDG") > single.count("LDG")


@needs_disassembler
@pytest.mark.parametrize("mask", ["causal", "none"])
def test_dynamic_tiles_claim_with_one_global_atomic(mask, shipped_cache):
    """A persistent kernel with dynamic tiles claims each next tile with one global atomic add
    (one ATOMG in the producer's tile loop), and hands it over through shared memory with
    mbarriers, spill-free within 255 registers; the same config with static tiles has no
    atomic."""
    static = FwdConfig.make("bfloat16", 128, 128, mask, pingpong=True, num_sms=132)
    dynamic = dataclasses.replace(static, dynamic_tiles=True)
    ks, kd = (compiled_sass(shipped_cache, c, ARCH) for c in (static, dynamic))
    print(f"\n{mask}: registers static {ks.registers}, dynamic {kd.registers}")
    assert ks.count("ATOMG") == 0 and ks.count("ATOM") == 0
    assert kd.matches(r"ATOMG\.E\.ADD\S*\.GPU ") == 1, kd.count("ATOMG")
    assert kd.count("SHFL.IDX") > ks.count("SHFL.IDX")  # lane 0's claim, to the whole warp
    for k in (ks, kd):
        assert_no_local_memory(k)
        assert k.registers <= 255
    # the index ring: two more mbarrier arrivals (the producer's commit, the consumers' release)
    assert kd.count("SYNCS.ARRIVE") >= ks.count("SYNCS.ARRIVE") + 2


# ------------------------------------------------------------------------------------------------
# config contract
# ------------------------------------------------------------------------------------------------
def test_config_module_does_not_import_the_compiler():
    code = ("import sys; import jax_fa4.kernels.sm90.fwd_config as m; "
            "m.FwdConfig.make('bfloat16', 128); "
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
        FwdConfig.make(**kwargs)


def test_default_rows_are_not_persistent():
    """A persistent grid bakes an SM count into the kernel: shipped defaults must not (the same
    cache serves every Hopper part). 3 warpgroups only where the registers allow (hdim 64)."""
    for (d, dv), masks in TUNING_TABLE.items():
        for mask in masks:
            cfg = FwdConfig.make("bfloat16", d, dv, mask)
            assert cfg.num_sms == 0, cfg
            assert cfg.tile_m == 128 or d == 64, cfg


def test_persistent_configs_stage_o_in_their_own_buffer_where_it_fits():
    """A persistent grid gives O a staging buffer of its own (Q then reloads under the
    epilogue) wherever Q + the K/V stages + O fit the shared memory, and counts it; elsewhere,
    and without a persistent grid, O reuses Q's buffer."""
    for (d, dv), masks in TUNING_TABLE.items():
        for mask in masks:
            cfg = FwdConfig.make("bfloat16", d, dv, mask)
            persistent = dataclasses.replace(cfg, num_sms=132)
            o_bytes = 2 * cfg.tile_m * dv
            assert not cfg.own_o_buffer
            fits = cfg.smem_bytes() + o_bytes <= SMEM_BUDGET_BYTES
            assert persistent.own_o_buffer == fits, persistent
            assert persistent.smem_bytes() == cfg.smem_bytes() + o_bytes * fits
    assert FwdConfig.make("bfloat16", 128, num_sms=132).own_o_buffer
    assert not FwdConfig.make("bfloat16", 256, num_sms=132).own_o_buffer  # 128x80, 2 stages


@pytest.mark.parametrize("kwargs,word", [
    (dict(pingpong=True, intra_wg_overlap=False), "pingpong"),
    (dict(rescale_threshold=-1.0), "rescale_threshold"),
    (dict(tile_m=192), "registers"),  # hdim 128 with 3 warpgroups would spill
    (dict(tile_m=256), "tile_m"),
    (dict(paged=True, num_sms=132), "paged KV"),
    (dict(varlen=True, num_sms=132), "varlen"),
    (dict(varlen=True, paged=True), "varlen"),
    (dict(dynamic_tiles=True), "dynamic_tiles"),  # needs a persistent grid
    (dict(dynamic_tiles=True, num_sms=132, max_logits=True), "dynamic_tiles"),
    (dict(dynamic_tiles=True, num_sms=132, paged=True), "paged KV"),
])
def test_validator_rejects_bad_v2_options(kwargs, word):
    with pytest.raises(ValueError, match=word):
        FwdConfig.make("bfloat16", 128, **kwargs)


def test_tuning_comes_from_the_table():
    for (d, dv), masks in TUNING_TABLE.items():
        for mask, t in masks.items():
            cfg = FwdConfig.make("bfloat16", d, dv, mask)
            assert (cfg.tile_m, cfg.tile_n, cfg.stages) == (t.tile_m, t.tile_n, t.stages)
            sig = cfg.signature()
            assert [a.name for a in sig.inputs] == ["q", "k", "v", "params"]
            assert [a.name for a in sig.outputs] == ["out", "lse"]
            assert sig.aliases == ()


@pytest.mark.parametrize("mask", ["none", "causal", "local"])
def test_dynamic_tiles_take_a_zeroed_counter_in_place(mask):
    """Only a config with dynamic tiles has the tile counter: one int32, the last input,
    aliased to the last output (updated in place, not batched); the same persistent config
    with static tiles keeps the plain forward's operands."""
    static = FwdConfig.make("bfloat16", 128, 128, mask, num_sms=132)
    dynamic = FwdConfig.make("bfloat16", 128, 128, mask, num_sms=132, dynamic_tiles=True)
    assert static.signature() == FwdConfig.make("bfloat16", 128, 128, mask).signature()
    assert "tile_counter" not in [a.name for a in static.signature().inputs]
    sig = dynamic.signature()
    assert [a.name for a in sig.inputs] == ["q", "k", "v", "params", "tile_counter"]
    assert [a.name for a in sig.outputs] == ["out", "lse", "tile_counter"]
    assert sig.aliases == ((4, 2),)
    counter = sig.inputs[4]
    assert (counter.dtype, counter.sample_shape, counter.batched) == ("int32", (1,), False)


# ------------------------------------------------------------------------------------------------
# block ranges and mask regions, against brute force (pure Python)
# ------------------------------------------------------------------------------------------------
def _visible(i, j, sq, sk, kind, wl, wr):
    if j >= sk or j < 0:
        return False
    diag = i + sk - sq
    if kind == "causal":
        return j <= diag
    if kind == "local":
        return diag - wl <= j <= diag + wr
    return True


@pytest.mark.parametrize("kind", ["none", "causal", "local"])
@pytest.mark.parametrize("tile_m,tile_n", [(128, 128), (128, 80), (128, 112), (192, 128), (128, 64),
                                           (256, 128),  # sm100: 2 Q tiles of 128 rows per CTA
                                           (128, 176)])
def test_block_ranges_cover_exactly_the_visible_keys(kind, tile_m, tile_n):
    seqlens = [(1, 1), (1, 300), (113, 203), (203, 113), (256, 256), (257, 129), (1000, 17)]
    windows = [(-1, -1)] if kind != "local" else [(-1, 0), (0, 0), (5, -1), (-1, 7), (37, 3),
                                                   (0, 130), (300, 300), (1, 1)]
    for (sq, sk), (wl0, wr0) in itertools.product(seqlens, windows):
        wl, wr = resolve_windows((1.0, 0.0, wl0, wr0), sq, sk, is_local=True)  # the kernels' clamp
        bi = FwdBlocks(tile_m, tile_n, kind == "causal", kind == "local", sq, sk, wl, wr)
        for m in range(-(-sq // tile_m)):
            rows = range(m * tile_m, min((m + 1) * tile_m, sq))
            lo, hi = bi.n_block_range(m)
            vis = {(i, j) for i in rows for j in range(sk)
                   if _visible(i, j, sq, sk, kind, wl0 if wl0 >= 0 else 10**9,
                               wr0 if wr0 >= 0 else 10**9)}
            where = f"sq={sq} sk={sk} window=({wl0},{wr0}) m={m}"
            # 1) every visible key lies in a visited block
            assert all(lo <= j // tile_n < hi for _, j in vis), where
            # 2) visited blocks are all in range (TMA coordinates valid)
            assert 0 <= lo and hi <= -(-sk // tile_n) or hi <= lo, where
            if hi <= lo:
                assert not vis, where
                continue
            # 3) the mask regions: first block = full mask; right-masked [n_right, hi-1);
            #    bulk (unmasked) [n_left, min(hi-1, n_right)); left-masked below n_left.
            n_right = bi.n_block_min_right_mask(m, lo) if kind != "none" else hi - 1
            n_left = bi.n_block_max_left_mask(m, lo)
            bulk = range(max(n_left, lo), min(hi - 1, n_right))
            for n in bulk:
                cols = range(n * tile_n, (n + 1) * tile_n)
                assert all((i, j) in vis for i in rows for j in cols), f"{where} bulk block {n}"
            # 4) only the first visited block may hold columns >= seqlen_k
            for n in range(lo, hi - 1):
                assert (n + 1) * tile_n <= sk, f"{where} block {n} crosses seqlen_k"


# ------------------------------------------------------------------------------------------------
# accumulator views against the MMA layouts (trace only, no compile)
# ------------------------------------------------------------------------------------------------
def _check_views(tv_c, tv_a, tv_o, mn, av, mn_o, nval, tile_m, tile_n):
    """Every view's disagreements with the MMA layouts. CuTe-DSL evaluates a layout in Python
    (slowly), so each layout is evaluated once per argument: the views once, and per thread its
    accumulator coordinates and its 8 P-fragment offsets."""
    import cutlass.cute as cute

    n_rows, n_cols = cute.size(mn.shape[0]), cute.size(mn.shape[1])
    val_mn = [[mn((r, c)) for c in range(n_cols)] for r in range(n_rows)]  # value at (r, c)
    val_a = [av(i) for i in range(nval)]
    val_o = [mn_o((r, 0)) for r in range(n_rows)]

    def coords_c(t):  # (row, column) in the tile of each of thread t's accumulator values
        return [(idx % tile_m, idx // tile_m) for idx in (tv_c((t, v)) for v in range(nval))]

    def coord_a(a8, i):  # the P fragment: 8 values per K=16 block, K blocks outermost
        idx = a8[i % 8]
        return idx % tile_m, idx // tile_m + 16 * (i // 8)

    errors = []
    coords_0 = coords_c(0)
    # all lanes of two warps (one per consumer warpgroup), a few lanes of every other warp
    threads = sorted(set(range(0, 32)) | set(range(160, 192))
                     | {w * 32 + l for w in range(8) for l in (0, 1, 2, 3, 5, 30, 31)})
    for t in threads:
        coords = coords_c(t)
        at = [[coords[v] for v in row] for row in val_mn]  # (row, column) at (r, c)
        for r in range(n_rows):
            for c in range(n_cols):
                m, n = at[r][c]
                if m != at[r][0][0] or n != at[0][c][1]:
                    errors.append(("mn", t, r, c))
                # the mask's trick: column = this thread's first column + thread 0's offset
                if n - at[0][0][1] != coords_0[val_mn[0][c]][1] - coords_0[val_mn[0][0]][1]:
                    errors.append(("col offset", t, c))
            if at[r][0][0] != tv_o((t, val_o[r])) % tile_m:
                errors.append(("O rows", t, r))
        a8 = [tv_a((t, j)) for j in range(8)]
        for i in range(nval):
            if coords[val_a[i]] != coord_a(a8, i):
                errors.append(("P operand", t, i))
    return errors


@pytest.mark.parametrize("tile_n", [128, 112, 80])
def test_accumulator_views_match_mma_layouts(tile_n):
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import warpgroup

    from jax_fa4.ffi.compiler import set_target_arch
    from jax_fa4.kernels.common.layout import acc_layout_as_a_operand, acc_layout_mn

    set_target_arch(ARCH)  # earlier tests in this process may have compiled for sm_100a
    tile_m, dv = 128, 128
    found = {}

    @cute.jit
    def trace():
        dt = cutlass.BFloat16
        k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        qk = sm90_utils.make_trivial_tiled_mma(dt, dt, k_major, k_major, cutlass.Float32,
                                               (2, 1, 1), (64, tile_n))
        pv = sm90_utils.make_trivial_tiled_mma(dt, dt, k_major, mn_major, cutlass.Float32,
                                               (2, 1, 1), (64, dv),
                                               a_source=warpgroup.OperandSource.RMEM)
        acc = cute.make_layout(qk.partition_shape_C((tile_m, tile_n)))
        acc_o = cute.make_layout(pv.partition_shape_C((tile_m, dv)))
        found["errors"] = _check_views(qk.tv_layout_C_tiled, pv.tv_layout_A_tiled,
                                       pv.tv_layout_C_tiled, acc_layout_mn(acc),
                                       acc_layout_as_a_operand(acc), acc_layout_mn(acc_o),
                                       cute.size(acc), tile_m, tile_n)

    trace()
    assert found["errors"] == [], found["errors"][:10]
