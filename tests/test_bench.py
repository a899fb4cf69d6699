"""The benchmark command: FLOP counting, flag parsing, and a tiny CPU sweep end to end."""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_fa4 import bench
from jax_fa4.reference import visible_mask

ON_CPU = jax.devices()[0].platform == "cpu"


@pytest.mark.parametrize("sq,sk,causal,window", [
    (128, 128, False, (32, 0)),
    (100, 256, True, (None, None)),
    (256, 100, True, (None, None)),
    (1, 512, True, (None, None)),
    (200, 200, False, (17, 5)),
    (64, 300, False, (None, 40)),
    (300, 64, True, (10, None)),
])
def test_visible_fraction_matches_the_library_mask(sq, sk, causal, window):
    shape = bench.Shape(1, sq, sk, 1, 1, 64, 64, causal, window)
    mask = np.asarray(visible_mask(sq, sk, shape.mask_window))
    assert shape.visible_fraction() == pytest.approx(mask.mean(), rel=1e-12)


def test_flop_convention():
    full = bench.Shape(4, 8192, 8192, 16, 16, 128, 128, False)
    assert full.fwd_flops() == 4 * 4 * 16 * 8192**2 * 128
    assert bench.Shape(4, 8192, 8192, 16, 16, 128, 128, True).fwd_flops() == full.fwd_flops() / 2
    assert bench.Shape(1, 8, 8, 1, 1, 192, 128, False).fwd_flops() == 2 * 64 * (192 + 128)


def test_shape_flags_need_custom_and_sweep_a_product():
    with pytest.raises(SystemExit):
        bench.parse_args(["--B", "2"])
    args = bench.parse_args(["--shapes", "custom", "--B", "1,2", "--Sq", "256", "--H", "8",
                             "--Hkv", "8,2", "--causal", "no,yes", "--window", "64,0"])
    shapes = bench.custom_shapes(args)
    assert len(shapes) == 8
    assert {(s.B, s.Hkv, s.causal) for s in shapes} == {
        (b, h, c) for b in (1, 2) for h in (8, 2) for c in (False, True)}
    assert all(s.Sk == 256 and s.D == s.Dv == 128 and s.window == (64, 0) for s in shapes)
    assert len(bench.PRESETS["default"]) == 14


def test_static_skip_reasons_on_a_gpu():
    args = argparse.Namespace(reference_max_gb=4.0, xla_max_gb=36.0)
    skip = lambda impl, shape: bench.static_skip_reason(impl, shape, "gpu", args)  # noqa: E731
    assert skip("cudnn", bench.Shape(1, 128, 128, 4, 4, 192, 128, False))
    assert skip("cudnn", bench.Shape(1, 64, 128, 4, 4, 64, 64, True))
    assert skip("cudnn", bench.Shape(1, 1, 128, 4, 1, 64, 64, False)) is None
    assert skip("reference", bench.Shape(16, 2048, 2048, 16, 16, 128, 128, False))
    assert skip("reference", bench.Shape(1, 2048, 2048, 16, 16, 128, 128, False)) is None
    assert skip("jax-fa4", bench.Shape(2, 16384, 16384, 16, 16, 128, 128, False)) is None


def test_custom_call_targets():
    text = ('%0 = stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2(%a) : ...\n'
            '%1 = "stablehlo.custom_call"(%b) {call_target_name = "__cudnn$fmhaSoftmax"}\n'
            '%2 = stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2(%c) : ...\n')
    assert bench.custom_call_targets(text) == {"CuteDSLRT_NvJaxCutlassCall_v2": 2,
                                               "__cudnn$fmhaSoftmax": 1}


def test_chain_length_only_for_short_gpu_calls():
    latency = bench.Shape(1, 128, 128, 16, 16, 128, 128, False)
    assert bench.chain_length(latency, 2, "gpu") > 1
    assert bench.chain_length(latency, 2, "cpu") == 1
    assert bench.chain_length(bench.Shape(4, 8192, 8192, 16, 16, 128, 128, True), 2, "gpu") == 1
    assert bench.chain_length(bench.Shape(64, 1, 8192, 32, 8, 128, 128, False), 2, "gpu") == 1


def test_chained_program_computes_each_call():
    shape = bench.Shape(1, 16, 16, 2, 1, 8, 8, True)
    sets = bench.make_inputs(shape, jnp.float32, jax.random.key(1), multiple_of=3)
    assert len(sets) % 3 == 0
    fn = bench._fwd_bwd(bench._fa4_fn(shape, "reference"))
    outs = jax.jit(bench.chained(fn))(*sets[:3])
    for args, got in zip(sets[:3], outs):
        jax.tree.map(np.testing.assert_allclose, got, fn(*args))


@pytest.mark.skipif(not ON_CPU, reason="a kernel cannot lower on the CPU")
def test_rounds_rotate_which_program_goes_first(monkeypatch):
    """No program always runs right after another one's round: round r starts at program r."""
    calls: list[str] = []
    monkeypatch.setattr(bench, "_round_iters", lambda program, target_s: 1)

    def fake_round(program, iters, first, sync_each):
        calls.append(program)
        return {"a": 1.0, "b": 2.0, "c": 3.0}[program]

    monkeypatch.setattr(bench, "_round_ms", fake_round)
    timings = bench.time_programs(["a", "b", "c"], repeats=3, target_s=0.01, sync_each=False)
    rounds = [calls[i:i + 3] for i in range(0, len(calls), 3)]
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert [t.ms for t in timings] == [1.0, 2.0, 3.0]  # each program keeps its own samples


def test_jax_fa4_row_probes_the_forced_kernel():
    shape = bench.Shape(1, 16, 16, 2, 1, 8, 8, True)
    inputs = bench.make_inputs(shape, jnp.bfloat16, jax.random.key(0), multiple_of=1)[0]
    # A forced implementation that lowers: the row times implementation=None and names it.
    assert bench.lower_impl("jax-fa4", shape, "reference", inputs, False)[3] == "reference"
    # One that cannot (no kernel lowers for the CPU): the row is skipped with the reason.
    with pytest.raises(bench.SkipRow, match="sm90"):
        bench.lower_impl("jax-fa4", shape, "sm90", inputs, False)


@pytest.mark.skipif(not ON_CPU, reason="checks the CPU sweep's rows")
def test_tiny_sweep_on_cpu(tmp_path, capsys):
    out = tmp_path / "tiny.json"
    assert bench.main(["--shapes", "tiny", "--repeats", "3", "--target-ms", "10",
                       "--out", str(out)]) == 0

    report = json.loads(out.read_text())
    assert {"gpu", "driver", "versions", "command", "date", "rows"} <= report.keys()
    assert report["gpu"] == "cpu" and report["driver"] is None
    assert report["versions"]["jax"] == jax.__version__
    assert report["command"][-2:] == ["--out", str(out)]
    assert report["complete"] is True and not out.with_suffix(".json.tmp").exists()
    shapes = bench.PRESETS["tiny"]
    rows = report["rows"]
    assert len(rows) == len(shapes) * len(bench.IMPLS)
    for row in rows:
        assert tuple(row) == bench.ROW_KEYS
        assert row["dtype"] == "bf16"
        for key in ("B", "Sq", "Sk", "H", "Hkv", "D", "Dv"):
            assert isinstance(row[key], int) and row[key] > 0
        assert isinstance(row["causal"], bool) and len(row["window"]) == 2
        assert row["fwd_ratio_vs_cudnn"] is None and row["bwd_ratio_vs_cudnn"] is None
        assert row["peak_mem_bytes"] is None  # no allocator statistics on the CPU
        if row["impl"] in ("cudnn", "xla"):
            assert isinstance(row["skipped"], str) and "GPU" in row["skipped"]
            assert row["fwd_ms"] is None and row["fwd_tflops"] is None
            continue
        assert row["skipped"] is None, row
        for key in ("fwd_ms", "fwdbwd_ms", "fwd_tflops", "fwd_tbps", "fwd_us"):
            assert isinstance(row[key], float) and row[key] > 0, (key, row)
        assert row["fwd_tflops"] == pytest.approx(row["fwd_flops"] / row["fwd_ms"] / 1e9)
        assert row["bwd_ms"] == pytest.approx(row["fwdbwd_ms"] - row["fwd_ms"])
        # On a loaded CPU, noise can exceed these tiny backwards: no rate then, never a negative.
        if row["bwd_ms"] > 0:
            assert row["bwd_tflops"] == pytest.approx(
                2.5 * row["fwd_flops"] / row["bwd_ms"] / 1e9)
        else:
            assert row["bwd_tflops"] is None
        assert row["input_sets"] >= 2 and row["iters"] >= 1 and row["calls_per_dispatch"] == 1
        assert row["fwd_rel_err_vs"] == "reference" and row["fwd_rel_err"] < 1e-6
        assert row["xla_mem_bytes"] > 0
        if row["impl"] == "jax-fa4":
            assert row["resolved_impl"] == "reference"  # no kernel on the CPU

    timed = [r for r in rows if r["skipped"] is None]
    assert sum(r["bwd_tflops"] is not None for r in timed) >= len(timed) // 2

    png = out.with_suffix(".png")
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "total wall time" in printed and "fwd TF/s" in printed


def test_backward_variant_sweep_lists_valid_distinct_configs():
    """benchmarks/bwd_variants.py: per shape, v1 is the tuning table's config, every other
    variant is a distinct config the validator accepts (the run precompiles exactly these)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import bwd_variants
    finally:
        sys.path.pop(0)
    from jax_fa4.kernels.sm90.bwd_config import BwdConfig

    for shape in bwd_variants.shapes_for("all"):
        gqa = shape.H != shape.Hkv
        mask = "causal" if shape.causal else "none"
        variants = bwd_variants.variants_for(shape.D, shape.Dv, mask, gqa)
        names = [n for n, _ in variants]
        assert names[0] == "v1" and "det" in names and len(set(names)) == len(names)
        assert variants[0][1] == BwdConfig.make("bfloat16", shape.D, shape.Dv, mask, False, gqa)
        cfgs = [c for _, c in variants]
        assert len(set(cfgs)) == len(cfgs)
        for cfg in cfgs:
            cfg.validate()
            assert cfg.gqa == gqa and cfg.mask == mask
    needed = bwd_variants.variant_configs("d128", ["det"])
    assert {c.kernel_name for c in needed} == {"sm90_bwd", "sm90_bwd_postprocess"}


def test_sass_diff_compares_instructions_only():
    """benchmarks/sass_diff.py: two dumps of the same code at other addresses, with other
    encodings and immediates, normalise to the same lines; another opcode does not."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import sass_diff
    finally:
        sys.path.pop(0)
    a = ("        /*0010*/                   IMAD R4, R7, 0x400, R0 ;   /* 0x0000040007047824 */\n"
         "        /*0020*/                   HGMMA.64x64x16.F32.BF16 R184, gdesc[UR8], RZ ;\n")
    b = ("        /*0a10*/                   IMAD R4, R7, 0x800, R0 ;   /* 0x0000080007047824 */\n"
         "        /*0a20*/                   HGMMA.64x64x16.F32.BF16 R184, gdesc[UR8], RZ ;\n")
    assert sass_diff.normalised_sass(a) == sass_diff.normalised_sass(b)
    assert len(sass_diff.normalised_sass(a)) == 2
    assert sass_diff.normalised_sass(a) != sass_diff.normalised_sass(a.replace("IMAD", "IADD3"))


def test_sass_diff_pairs_variants_across_a_new_default_field():
    """A config field added with a default (the code it generated before) keeps the variant's
    key, so the old and the new checkout's variants pair up; a non-default value does not."""
    import dataclasses
    import sys
    from pathlib import Path
    from typing import ClassVar

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import sass_diff
    finally:
        sys.path.pop(0)

    @dataclasses.dataclass(frozen=True)
    class Old:
        kernel_name: ClassVar[str] = "k"
        head_dim: int = 128
        mask: str = "none"

    @dataclasses.dataclass(frozen=True)
    class New(Old):
        paged: bool = False

    def variant(config):
        return type("V", (), {"arch": "sm_90a", "config": config})()

    old = sass_diff.variant_key(variant(Old(head_dim=64, mask="causal")))
    assert old == sass_diff.variant_key(variant(New(head_dim=64, mask="causal")))
    assert old != sass_diff.variant_key(variant(New(head_dim=64, mask="causal", paged=True)))
    assert old != sass_diff.variant_key(variant(Old(head_dim=64)))
