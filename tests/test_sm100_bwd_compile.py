"""The sm100 backward kernel compiles for sm_100a on a CPU-only machine, with clean SASS.

Nothing here runs a kernel (no Blackwell GPU exists in this project). Each config of
``bwd_config.test_configs()`` (every head dim, every mask kind, softcap, GQA, deterministic, fp16)
is compiled through the binding's own path (``compile_config(config, "sm_100a")``: dynamic B/S/H)
and its SASS read with jax_fa4.tools.sass (the quick tier: the representative configs,
tests/compiled.py; ``--exhaustive``: all of them; every shipped variant:
tests/test_shipped_kernels.py):

  * tcgen05 MMAs (UTCHMMA: 5 GEMMs × their k-blocks), commits (UTCBAR), TMEM loads / stores
    (LDTM / STTM), TMA loads (UTMALDG), the dQ TMA reduce-adds (UTMAREDG), MUFU.EX2 (MUFU.TANH
    iff softcap), setmaxnreg both ways;
  * TMEM allocation balanced: ``UTCATOMSWS.FIND_AND_SET`` twice per allocation site (first try
    and retry loop) = 2 × ``UTCATOMSWS.AND`` (dealloc), relinquish ``UVIRTCOUNT.DEALLOC.SMPOOL``
    once per dealloc;
  * deterministic configs: the semaphore's acquire load and release reduction are present;
  * no local memory (LDL/STL), no stack, registers <= 255, shared memory within 227 KB.

Plus CPU-only checks of what would fail silently on a GPU: the query-block ranges, the "needs a
mask" test, each key's visible query rows and the deterministic dQ order (BwdBlocks) against brute
force; the config contract (signature, aliases, no compiler import, validator messages, budgets).
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jax_fa4.kernels.common.geometry import BwdBlocks
from jax_fa4.kernels.sm100.bwd_config import (TMEM_COLUMNS, Sm100BwdConfig, shipped_configs,
                                              segments_config, test_configs, varlen_config)
from jax_fa4.kernels.sm100.bwd_tuning import SEGMENTS_TUNING, TUNING_TABLE, VARLEN_TUNING
from jax_fa4.kernels.spec import MASK_KINDS, SMEM_BUDGET_BYTES

from compiled import compiled_report, needs_disassembler, per_class, tiered

REPO = Path(__file__).resolve().parents[1]
ARCH = "sm_100a"


def _compiler_available() -> bool:
    from jax_fa4.ffi.compiler import compiler_available

    return compiler_available()


needs_compiler = pytest.mark.skipif(not _compiler_available(), reason="needs nvidia-cutlass-dsl")


def _compile_and_report(cfg, cache):
    """(the kernel's SASS, its listing, compile seconds); the object from ``shipped_cache``."""
    k, seconds = compiled_report(cache, cfg, ARCH)
    assert "FlashAttentionBackwardSm100" in k.name, k.name
    return k, k.sass, seconds


def _id(c: Sm100BwdConfig) -> str:
    return (f"{c.dtype[:4]}-d{c.head_dim}-{c.mask}{'-cap' if c.has_softcap else ''}"
            f"{'-gqa' if c.gqa else ''}{'-det' if c.deterministic else ''}"
            f"{'-varlen' if c.varlen else ''}{'-seg' if c.segments else ''}")


@needs_compiler
@needs_disassembler
@pytest.mark.parametrize("cfg", tiered(test_configs(), ARCH), ids=_id)
def test_compiles_with_clean_sass(cfg, shipped_cache):
    k, sass, seconds = _compile_and_report(cfg, shipped_cache)
    n = lambda pat: len(re.findall(pat, sass))  # noqa: E731
    print(f"\n{cfg.describe()}: {seconds:.1f} s, {k.registers} regs (launch; setmaxnreg "
          f"72/160/120), smem {cfg.smem_bytes()} B, TMEM {cfg.tmem_columns()} -> "
          f"{cfg.tmem_alloc_columns()} cols; UTCHMMA {k.count('UTCHMMA')}")
    assert k.arch == ARCH
    d, tm, tn = cfg.head_dim, cfg.tile_m, cfg.tile_n
    # Sᵀ, dPᵀ (K = D), dV, dK (K = tile_m), dQ (K = the keys of the CTA, or of the pair):
    # one UTCHMMA per 16-deep k-block; the 2-CTA kernel's are all cta_group::2
    keys = 2 * tn if cfg.two_cta else tn
    assert k.count("UTCHMMA") == (d + cfg.head_dim_v) // 16 + 2 * tm // 16 + keys // 16
    assert n(r"UTCHMMA\.2CTA") == (k.count("UTCHMMA") if cfg.two_cta else 0)
    assert k.count("UTCBAR") > 0
    assert n(r"UTCBAR\.2CTA\.MULTICAST") == (k.count("UTCBAR") if cfg.two_cta else 0)
    assert k.count("LDTM") > 0 and k.count("STTM") > 0
    assert k.count("UTMALDG") >= (7 if cfg.two_cta else 4)  # K, V, Q, dO (+ Kᵀ, Qᵀ, dOᵀ)
    assert n(r"UTMALDG\.\w+\.2CTA") == (k.count("UTMALDG") if cfg.two_cta else 0)
    # dQ reduce-adds, one per column chunk (2-CTA: two (64, dq_cols) boxes per chunk of the
    # folded D/2 columns)
    assert k.count("UTMAREDG") == d // cfg.dq_cols
    # 2-CTA: the dS half sent to the peer (one DSMEM bulk copy), cluster barriers at start / end
    assert n(r"UBLKCP\.S\.S") == (1 if cfg.two_cta else 0)
    assert n(r"UCGABAR_ARV") == n(r"UCGABAR_WAIT") == (2 if cfg.two_cta else 0)
    assert k.count("MUFU.EX2") > 0
    assert (n(r"MUFU\.TANH") > 0) == cfg.has_softcap
    assert n(r"USETMAXREG\.DEALLOC") > 0 and n(r"USETMAXREG\.TRY_ALLOC") > 0
    # TMEM allocation balanced (see the module docstring for the SASS names)
    alloc, dealloc = n(r"UTCATOMSWS\.(?:2CTA\.)?FIND_AND_SET"), n(r"UTCATOMSWS\.AND\b")
    assert n(r"UTCATOMSWS\.2CTA\.FIND_AND_SET") == (alloc if cfg.two_cta else 0)
    relinquish = n(r"UVIRTCOUNT\.DEALLOC\.SMPOOL")
    assert dealloc == 1 and alloc == 2 * dealloc and relinquish == dealloc, (alloc, dealloc,
                                                                           relinquish)
    # deterministic: ld.global.acquire.gpu spin + red.release.gpu of the dQ semaphore
    assert (n(r"REDG\.E\.ADD\.S32\.STRONG\.GPU") > 0) == cfg.deterministic, "semaphore release"
    assert (n(r"LDG\.E\.STRONG\.GPU") > 0) == cfg.deterministic, "semaphore acquire"
    # no spills, no stack, registers and shared memory within sm_100's limits
    assert k.count("LDL") == 0 and k.count("STL") == 0
    assert k.local == 0 and k.stack == 0
    assert k.registers <= 255
    assert k.shared_static + cfg.smem_bytes() <= 227 * 1024


# ------------------------------------------------------------------------------------------------
# config contract
# ------------------------------------------------------------------------------------------------
def test_config_modules_do_not_import_the_compiler():
    code = ("import sys; import jax_fa4.kernels.sm100.bwd_config as m; "
            "import jax_fa4.kernels.common.geometry as b; "
            "m.Sm100BwdConfig.make('bfloat16', 128); m.shipped_configs(); m.test_configs(); "
            "b.BwdBlocks(128, 128, True, False, 300, 200, 0, 0).m_block_range(1); "
            "assert not any(k == 'cutlass' or k.startswith('cutlass.') for k in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@pytest.mark.parametrize("kwargs,word", [
    (dict(dtype="float32", head_dim=128), "dtype"),
    (dict(dtype="bfloat16", head_dim=80), "head_dim"),
    (dict(dtype="bfloat16", head_dim=192, head_dim_v=192), "head_dim"),
    (dict(dtype="bfloat16", head_dim=256), "2-CTA"),
    (dict(dtype="bfloat16", head_dim=192, head_dim_v=128, two_cta=False), "1-CTA"),
    (dict(dtype="bfloat16", head_dim=128, mask="alibi"), "mask"),
    (dict(dtype="bfloat16", head_dim=64, varlen=True, deterministic=True), "varlen"),
    (dict(dtype="bfloat16", head_dim=192, head_dim_v=128, varlen=True, deterministic=True),
     "deterministic"),  # (the 2-CTA kernel's varlen mode neither)
])
def test_validator_names_the_unsupported_feature(kwargs, word):
    with pytest.raises(ValueError, match=word):
        Sm100BwdConfig.make(**kwargs)


def test_signature_aliases_and_shapes():
    cfg = Sm100BwdConfig.make("bfloat16", 128)
    sig = cfg.signature()
    assert [a.name for a in sig.inputs] == ["q", "k", "v", "dout", "lse_log2", "delta", "params",
                                            "dq_accum"]
    assert [a.name for a in sig.outputs] == ["dq_accum", "dk", "dv"]
    assert sig.aliases == ((7, 0),) and sig.inputs[7] == sig.outputs[0]
    assert not sig.inputs[6].batched and sig.inputs[6].sample_shape == (4,)
    assert sig.inputs[7].divisibility == (1, 1, cfg.tile_m * 128)
    det = Sm100BwdConfig.make("bfloat16", 128, deterministic=True).signature()
    assert det.inputs[8].name == "dq_semaphore" and det.inputs[8].dtype == "int32"
    assert det.aliases == ((7, 0), (8, 3)) and det.inputs[8] == det.outputs[3]
    gqa = Sm100BwdConfig.make("bfloat16", 128, gqa=True).signature()
    assert gqa.outputs[1].dtype == gqa.outputs[2].dtype == "float32"
    # varlen: the Hopper varlen backward's call (packed, cu_seqlens, the work list)
    var = varlen_config("bfloat16", 64, gqa=True).signature()
    assert [a.name for a in var.inputs] == ["q", "k", "v", "dout", "lse_log2", "delta", "params",
                                            "dq_accum", "cu_seqlens_q", "cu_seqlens_k", "work"]
    assert var.aliases == ((7, 0),) and not any(a.batched for a in var.inputs)
    assert var.outputs[1].dtype == "float32"


def test_varlen_configs():
    """The 1-CTA kernel at every head dim it fits (128 too: the dense row is 2-CTA), the 2-CTA
    kernel at 192/128 (only it fits the TMEM; work items of a pair's 256 keys), never
    deterministic; a head dim without a row names the ones that have one."""
    assert set(VARLEN_TUNING) == {(64, 64), (96, 96), (128, 128), (192, 128)}
    for (d, dv) in VARLEN_TUNING:
        cfg = varlen_config("float16", d, dv, "local", True, True)
        assert cfg.varlen and cfg.two_cta == (d == 192) and not cfg.deterministic
        assert cfg.serial == (d == 192) and cfg.work_tile_n == (256 if d == 192 else 128)
        assert (cfg.mask, cfg.has_softcap, cfg.gqa, cfg.dtype) == ("local", True, True,
                                                                   "float16")
    with pytest.raises(ValueError, match="no varlen kernel at head dims 256/256.*192/128"):
        varlen_config("bfloat16", 256, 256)
    with pytest.raises(ValueError, match="deterministic"):
        Sm100BwdConfig.make("bfloat16", 192, 128, two_cta=True, varlen=True,
                            deterministic=True)


def test_segments_configs():
    """Segment ids: the 1-CTA kernel at every head dim it fits (128 too), the 2-CTA kernel at
    192/128 with one dQ staging buffer (the dense layout with two fills the budget, leaving no
    room for the row-id stages); never deterministic or varlen; other head dims name the ones
    it has; the tables come after dq_accum."""
    assert set(SEGMENTS_TUNING) == {(64, 64), (96, 96), (128, 128), (192, 128)}
    for (d, dv) in SEGMENTS_TUNING:
        cfg = segments_config("float16", d, dv, "local", True, True)
        assert cfg.segments and not (cfg.deterministic or cfg.varlen)
        assert cfg.two_cta == ((d, dv) == (192, 128))
        names = [a.name for a in cfg.signature().inputs]
        assert names[7:] == ["dq_accum", "seg_tiles", "seg_keys", "seg_rows", "kv_ids"]
        stages = (cfg.tile_m * cfg.lse_stages + 4) * 4  # row ids and flags per lse stage
        if not cfg.two_cta:
            assert cfg.smem_bytes() == varlen_config("float16", d, dv).smem_bytes() + (
                stages - 8 * 4)
    cfg = segments_config("bfloat16", 192, 128, "causal")
    dense = Sm100BwdConfig.make("bfloat16", 192, 128, "causal")
    assert cfg.serial and cfg.lse_stages == 2 and cfg.dq_stages == 1 < dense.dq_stages
    assert (dense.smem_bytes(), cfg.smem_bytes()) == (231_424, 227_328 + 1040)
    assert dense.smem_bytes() + (cfg.tile_m * cfg.lse_stages + 4) * 4 > SMEM_BUDGET_BYTES
    assert cfg.smem_bytes() <= SMEM_BUDGET_BYTES
    with pytest.raises(ValueError, match="segment-id kernel at head dims 256/256"):
        segments_config("bfloat16", 256, 256)
    with pytest.raises(ValueError, match="segment ids"):
        Sm100BwdConfig.make("bfloat16", 64, 64, deterministic=True, segments=True)
    with pytest.raises(ValueError, match="segment ids"):
        Sm100BwdConfig.make("bfloat16", 192, 128, deterministic=True, segments=True)


def test_every_shipped_variant_fits():
    shipped = shipped_configs()
    dense = 2 * len(TUNING_TABLE) * len(MASK_KINDS) * 2 * 2 * 2  # × softcap, gqa, det
    varlen = 2 * len(VARLEN_TUNING) * len(MASK_KINDS) * 2 * 2  # × softcap, gqa
    segments = 2 * len(SEGMENTS_TUNING) * len(MASK_KINDS) * 2 * 2  # × softcap, gqa
    assert len(shipped) == dense + varlen + segments
    assert sum(c.varlen for c in shipped) == varlen
    assert sum(c.segments for c in shipped) == segments
    assert len(set(shipped)) == len(shipped)
    for c in shipped:
        assert c.smem_bytes() <= SMEM_BUDGET_BYTES, c.describe()
        assert c.tmem_columns() <= TMEM_COLUMNS, c.describe()
        assert c.tmem_alloc_columns() in (32, 64, 128, 256, 512)
        off = c.tmem_offsets()
        if c.serial:
            # dV | dK | Sᵀ; dPᵀ over Sᵀ's upper half (after the s_read signal); dQ (D/2, folded)
            # over dPᵀ's columns [32, 128): over the upper half of the contiguous 16-bit dSᵀ
            # (dK_j reads it, issued before dQ_j) and up to the last allocated column
            assert off["dv"] == 0 and off["dk"] == c.head_dim_v
            assert off["s"] == off["dk"] + c.head_dim and off["dp"] == off["s"] + c.tile_m // 2
            assert off["dq"] == off["dp"] + c.tile_m // 4
            assert off["dq"] + c.head_dim // 2 == off["dp"] + c.tile_m == c.tmem_alloc_columns()
            continue
        # dK | dV | Sᵀ | dPᵀ do not overlap; dQ lies in dPᵀ's columns (1-CTA: all D of them
        # from dPᵀ's first; 2-CTA: the folded D/2 in dPᵀ's upper half, past both warpgroups'
        # 16-bit dSᵀ at [0, 32) and [64, 96) of which only [64, 96) overlaps: dK_j, which reads
        # it, is issued before dQ_j)
        assert off["dv"] >= off["dk"] + c.head_dim and off["s"] >= off["dv"] + c.head_dim_v
        assert off["dp"] >= off["s"] + c.tile_m
        if c.two_cta:
            assert off["dq"] == off["dp"] + c.tile_m // 2
            assert off["dq"] + c.head_dim // 2 == off["dp"] + c.tile_m <= c.tmem_alloc_columns()
        else:
            assert off["dq"] == off["dp"]
            assert off["dq"] + c.head_dim <= c.tmem_alloc_columns()
    assert set(test_configs()) <= set(shipped)


# ------------------------------------------------------------------------------------------------
# block arithmetic against brute force (pure Python: BwdBlocks runs on ints too)
# ------------------------------------------------------------------------------------------------
def _visible(i, j, sq, sk, kind, wl, wr):
    """Row i sees key j (reference.visible_mask's rule; wl/wr None = unbounded)."""
    if not (0 <= j < sk and 0 <= i < sq):
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


_SEQLENS = [(1, 1), (1, 300), (113, 203), (203, 113), (256, 256), (257, 129), (300, 17),
            (64, 200), (129, 385)]
_WINDOWS = [(None, 0), (0, 0), (5, None), (None, 7), (37, 3), (0, 130), (300, 300), (1, 1),
            (64, 0), (200, 5)]


@pytest.mark.parametrize("kind, tn", per_class(  # quick tier: one key-block size per mask kind
    [(k, tn) for tn in (256, 128) for k in MASK_KINDS], key=lambda case: case[0]), ids=str)
def test_block_arithmetic_matches_brute_force(kind, tn):
    """tn = 128: the 1-CTA kernel's key blocks (and the 2-CTA kernel's element masks); tn = 256:
    the 2-CTA kernel's pairs (query-block range and dQ turn of a cluster)."""
    tm = 128
    windows = [(None, None)] if kind != "local" else _WINDOWS
    for (sq, sk), (wl, wr) in itertools.product(_SEQLENS, windows):
        blk = BwdBlocks(tm, tn, kind == "causal", kind == "local", sq, sk,
                        _clamp(wl, sk) if kind == "local" else 0,
                        _clamp(wr, sq) if kind == "local" else 0)
        num_m, num_n = -(-sq // tm), -(-sk // tn)
        assert blk.num_m_blocks() == num_m
        visitors = {m: [] for m in range(num_m)}
        for n in range(num_n):
            lo_m, hi_m = blk.m_block_range(n)
            where = f"sq={sq} sk={sk} window=({wl},{wr}) n={n}"
            # the range stays inside [0, num_m) (TMA coordinates valid)
            assert hi_m <= lo_m or (0 <= lo_m and hi_m <= num_m), where
            for m in range(lo_m, hi_m):
                visitors[m].append(n)
            for m in range(num_m):
                rows = range(m * tm, (m + 1) * tm)  # rows past seqlen_q: never visible
                keys = range(n * tn, (n + 1) * tn)
                vis = [[_visible(i, j, sq, sk, kind, wl, wr) for i in rows] for j in keys]
                if any(any(r) for r in vis):
                    assert lo_m <= m < hi_m, f"{where} m={m} not visited"
                # conservative mask test, on rows < seqlen_q (later rows have P = 0 anyway)
                tail, right, left = blk.mask_reasons(m, n)
                real = [[_visible(i, j, sq, sk, kind, wl, wr) or i >= sq for i in rows]
                        for j in keys]
                if not all(all(r) for r in real):
                    assert tail or right or left, f"{where} m={m} needs a mask"
                # each key's visible rows, exactly (the kernel masks keys past seqlen_k apart)
                for jj, j in enumerate(keys):
                    if j >= sk:
                        continue
                    lo, hi = blk.visible_rows(j, m)
                    for ii, i in enumerate(rows):
                        got = ii >= lo and (kind != "local" or ii <= hi)
                        assert got == (vis[jj][ii] or i >= sq and got), \
                            f"{where} m={m} key {j} row {i}"
                        if i < sq:
                            assert got == vis[jj][ii], f"{where} m={m} key {j} row {i}"
            if kind == "causal" and hi_m > lo_m:  # tight: the first visited block has work
                rows = range(lo_m * tm, min((lo_m + 1) * tm, sq))
                assert any(_visible(i, j, sq, sk, kind, wl, wr) for i in rows
                           for j in range(n * tn, (n + 1) * tn)), where
        # deterministic dQ order: the visitors of m are contiguous key blocks and dq_rank is
        # each one's position, so the semaphore's turns 0, 1, ... are taken by exactly them
        for m, ns in visitors.items():
            if ns:
                assert ns == list(range(ns[0], ns[0] + len(ns))), (sq, sk, wl, wr, m, ns)
                assert [blk.dq_rank(m, n) for n in ns] == list(range(len(ns))), (m, ns)


# ------------------------------------------------------------------------------------------------
# shared-memory aliasing: each buffer's transposed operand view addresses the same bytes
# ------------------------------------------------------------------------------------------------
@needs_compiler
@pytest.mark.parametrize("d", sorted({d for (d, dv), row in TUNING_TABLE.items()
                                      if not row["none"].two_cta}
                                     | {d for (d, _), t in VARLEN_TUNING.items() if not t.two_cta}))
def test_transposed_smem_views_alias_exactly(d):
    """Q / dO (B operand of Sᵀ / dPᵀ, K-major) vs their MN-major views in dK / dV; K (A of Sᵀ) vs
    its MN-major view in dQ; dS (m-major A of dQ) vs dSᵀ (K-major A of dK): the swizzled offset
    of element (r, c) in one equals that of (c, r) in the other (every third row, all columns).
    Evaluated at trace time on the static layouts the kernel builds."""

    from jax_fa4.ffi.compiler import set_target_arch

    set_target_arch(ARCH)  # (the DSL keeps the last compile's arch: maybe sm_90a)
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass import Float32
    from cutlass.cute.nvgpu import tcgen05

    K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
    dt, tm, tn = cutlass.BFloat16, 128, 128
    pairs: dict = {}

    D = d  # a closure constant (annotations are strings in this module)

    @cute.jit
    def trace():
        cta = tcgen05.CtaGroup.ONE
        st = sm100_utils.make_trivial_tiled_mma(dt, dt, K, K, Float32, cta, (tn, tm))
        dvm = sm100_utils.make_trivial_tiled_mma(dt, dt, K, MN, Float32, cta, (tn, D),
                                                 tcgen05.OperandSource.TMEM)
        dkm = sm100_utils.make_trivial_tiled_mma(dt, dt, K, MN, Float32, cta, (tn, D))
        dqm = sm100_utils.make_trivial_tiled_mma(dt, dt, MN, MN, Float32, cta, (tm, D))
        views = {
            "Q": (sm100_utils.make_smem_layout_b(st, (tn, tm, D), dt, 1), (tm, D),
                  sm100_utils.make_smem_layout_b(dkm, (tn, D, tm), dt, 1), (D, tm)),
            "dO": (sm100_utils.make_smem_layout_b(st, (tn, tm, D), dt, 1), (tm, D),
                   sm100_utils.make_smem_layout_b(dvm, (tn, D, tm), dt, 1), (D, tm)),
            "K": (sm100_utils.make_smem_layout_a(st, (tn, tm, D), dt, 1), (tn, D),
                  sm100_utils.make_smem_layout_b(dqm, (tm, D, tn), dt, 1), (D, tn)),
            "dS": (sm100_utils.make_smem_layout_a(dqm, (tm, D, tn), dt, 1), (tm, tn),
                   sm100_utils.make_smem_layout_a(dkm, (tn, D, tm), dt, 1), (tn, tm)),
        }
        for name, (a, ash, b, bsh) in views.items():
            fa = cute.composition(cute.select(a, mode=[0, 1, 2]), cute.make_layout(ash))
            fb = cute.composition(cute.select(b, mode=[0, 1, 2]), cute.make_layout(bsh))
            vals = []
            for r in cutlass.range_constexpr(0, ash[0], 3):
                for c in cutlass.range_constexpr(ash[1]):
                    vals.append((cute.crd2idx((r, c), fa), cute.crd2idx((c, r), fb)))
            pairs[name] = vals

    from jax_fa4.ffi.compiler import _lock, set_target_arch

    with _lock:
        set_target_arch(ARCH)
        cute.compile(trace)
    assert set(pairs) == {"Q", "dO", "K", "dS"}
    for name, vals in pairs.items():
        assert all(isinstance(a, int) and isinstance(b, int) for a, b in vals), name
        assert len({a for a, _ in vals}) == len(vals), f"{name}: offsets not distinct"
        bad = [(a, b) for a, b in vals if a != b]
        assert not bad, f"d={d} {name}: {len(bad)} mismatches, e.g. {bad[:3]}"


# ------------------------------------------------------------------------------------------------
# 2-CTA kernel: what each CTA of a pair holds (trace time, no GPU)
# ------------------------------------------------------------------------------------------------
@needs_compiler
@pytest.mark.parametrize("d, dv", [(128, 128), (192, 128)])
def test_two_cta_operand_and_accumulator_maps(d, dv):
    """The pair MMAs of ``FlashAttentionBackwardSm100TwoCta.tiled_mmas`` split their operands and
    accumulators the way the kernel's roles assume (bwd_2cta.py docstring), for both ranks r:

    * Sᵀ (and dPᵀ, dV, dK: same M split): A rows = keys 128r + i, accumulator lane i = key
      128r + i, column c = query c (the compute warps' and epilogue's lane = own key);
    * Sᵀ / dPᵀ B = queries [64r, 64r + 64) (what sQ / sdO hold), dK / dV B = D / Dv columns
      [r·D/2, (r + 1)·D/2) of all queries (sQᵀ / sdOᵀ);
    * dQ: A = queries [64r, 64r + 64) × all 256 pair keys (sdS), B = D columns
      [r·D/2, (r + 1)·D/2) × all 256 keys (sKᵀ); accumulator (query 64r + i, column c) at TMEM
      lane i + 64·(c // (D/2)), column c % (D/2) (the reduce warps' folded rows and boxes);
    * sdS: the keys of CTA h are the bytes [16 KB·h, 16 KB·(h + 1)) (what the DSMEM copy moves
      and the exchange buffer mirrors), query-contiguous per key (the compute warps' row store).
    """

    from jax_fa4.ffi.compiler import set_target_arch

    set_target_arch(ARCH)  # (the DSL keeps the last compile's arch: maybe sm_90a)
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils

    from jax_fa4.kernels.sm100.bwd_2cta import FlashAttentionBackwardSm100TwoCta

    cfg = Sm100BwdConfig.make("bfloat16", d, dv)
    assert cfg.two_cta
    kernel = FlashAttentionBackwardSm100TwoCta(cfg)
    D, half = cfg.head_dim, cfg.head_dim // 2
    b_half = {"st": 64, "dpt": 64, "dv": dv // 2, "dk": half}  # B columns per CTA
    found: dict = {}

    def coords(t, idx):
        return [t[i] for i in idx]

    @cute.jit
    def trace():
        (st_t, st), (dpt_t, dpt), (dv_t, dv), (dk_t, dk), (dq_t, dq) = kernel.tiled_mmas()
        for r in (0, 1):
            for name, mma, tiler in (("st", st, st_t), ("dpt", dpt, dpt_t), ("dv", dv, dv_t),
                                     ("dk", dk, dk_t)):
                thr = mma.get_slice(r)
                cA = thr.partition_A(cute.make_identity_tensor((tiler[0], tiler[2])))
                cB = thr.partition_B(cute.make_identity_tensor((tiler[1], tiler[2])))
                cC = thr.partition_C(cute.make_identity_tensor((tiler[0], tiler[1])))
                found[(name, r, "A")] = coords(cA, range(0, 128, 7))
                found[(name, r, "B")] = coords(cB, range(0, 64, 5))
                found[(name, r, "C")] = [cC[((i, c), 0, 0)] for i in (0, 5, 127)
                                         for c in (0, 9, tiler[1] - 1)]
            thr = dq.get_slice(r)
            found[("dq", r, "A")] = [thr.partition_A(cute.make_identity_tensor((128, 256)))[
                ((i, k % 16), 0, k // 16)] for i in (0, 17, 63) for k in (0, 127, 128, 255)]
            found[("dq", r, "B")] = [thr.partition_B(cute.make_identity_tensor((D, 256)))[
                ((i, k % 16), 0, k // 16)] for i in (0, 17, half - 1)
                for k in (0, 127, 128, 255)]
            cC = thr.partition_C(cute.make_identity_tensor((128, D)))
            found[("dq", r, "C")] = [cC[((i, c), 0, 0)] for i in (0, 33, 63)
                                     for c in (0, half - 1, half, D - 1)]
        th = dq.get_slice(0)
        frag = th.make_fragment_C(th.partition_shape_C((128, D)))
        found["dq_tmem"] = [cute.crd2idx(((i, c), 0, 0), frag.layout)
                            for i in (0, 33, 63) for c in (0, half - 1, half, D - 1)]
        sdS_l = sm100_utils.make_smem_layout_a(dq, dq_t, cutlass.BFloat16, 1)
        flat = cute.composition(cute.select(sdS_l, mode=[0, 1, 2]), cute.make_layout((64, 256)))
        found["sdS"] = [(q, k, cute.crd2idx((q, k), flat)) for q in range(64)
                        for k in (0, 1, 77, 127, 128, 129, 205, 255)]
        found["sdS_cosize"] = cute.cosize(sdS_l)

    from jax_fa4.ffi.compiler import _lock, set_target_arch

    with _lock:
        set_target_arch(ARCH)
        cute.compile(trace)
    for r in (0, 1):
        for name in ("st", "dpt", "dv", "dk"):
            assert found[(name, r, "A")] == [(128 * r + i, 0) for i in range(0, 128, 7)], name
            assert [row for row, _ in found[(name, r, "C")]] == [128 * r + i for i in (0, 5, 127)
                                                                 for _ in range(3)], name
        for name, w in b_half.items():  # Sᵀ/dPᵀ: query half; dV/dK: Dv / D column half
            assert found[(name, r, "B")] == [(w * r + i, 0) for i in range(0, 64, 5)], name
        assert found[("dq", r, "A")] == [(64 * r + i, k) for i in (0, 17, 63)
                                         for k in (0, 127, 128, 255)]
        assert found[("dq", r, "B")] == [(half * r + i, k) for i in (0, 17, half - 1)
                                         for k in (0, 127, 128, 255)]
        assert found[("dq", r, "C")] == [(64 * r + i, c) for i in (0, 33, 63)
                                         for c in (0, half - 1, half, D - 1)]
    lane = 2 ** 16  # TMEM address: lane in the upper 16 bits, column in the lower
    assert found["dq_tmem"] == [(i + 64 * (c // half)) * lane + c % half for i in (0, 33, 63)
                                for c in (0, half - 1, half, D - 1)]
    assert found["sdS_cosize"] == 64 * 256
    offsets = {(q, k): off for q, k, off in found["sdS"]}
    for (q, k), off in offsets.items():
        assert (off < 64 * 128) == (k < 128), (q, k, off)  # key half h = bytes of half h
        if k >= 128:
            assert off == offsets[(q, k - 128)] + 64 * 128, (q, k)
        # a key's 64 queries: 8 runs of 8 consecutive elements (16-byte stores), 16-byte aligned
        assert off - offsets[(q - q % 8, k)] == q % 8 and offsets[(q - q % 8, k)] % 8 == 0, \
            (q, k)
