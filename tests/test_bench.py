"""The benchmark command: FLOP counting, flag parsing, and a tiny CPU sweep end to end."""

from __future__ import annotations

import argparse
import json
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_fa4.tools import bench, bench_env, bench_report, bench_shapes
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
    shape = bench_shapes.Shape(1, sq, sk, 1, 1, 64, 64, causal, window)
    mask = np.asarray(jax.jit(visible_mask, static_argnums=(0, 1, 2))(sq, sk, shape.mask_window))
    assert shape.visible_fraction() == pytest.approx(mask.mean(), rel=1e-12)


def test_flop_convention():
    Shape = bench_shapes.Shape
    full = Shape(4, 8192, 8192, 16, 16, 128, 128, False)
    assert full.fwd_flops() == 4 * 4 * 16 * 8192**2 * 128
    assert Shape(4, 8192, 8192, 16, 16, 128, 128, True).fwd_flops() == full.fwd_flops() / 2
    assert Shape(1, 8, 8, 1, 1, 192, 128, False).fwd_flops() == 2 * 64 * (192 + 128)


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
    assert len(bench_shapes.PRESETS["default"]) == 19
    assert (bench_shapes.preset_shapes("anchors-main,anchors-more,latency")
            == bench_shapes.PRESETS["default"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--shapes", "anchors-main,nope"])
    assert bench.parse_args(["--shapes", "anchors-more, latency"]).shapes == "anchors-more,latency"
    assert bench.parse_args(["--impls", "jax-fa4-det,cudnn"]).impls == ["jax-fa4-det", "cudnn"]


def test_static_skip_reasons_on_a_gpu():
    args = argparse.Namespace(reference_max_gb=4.0, xla_max_gb=36.0)
    skip = lambda impl, shape: bench.static_skip_reason(impl, shape, "gpu", args)  # noqa: E731
    assert skip("cudnn", bench_shapes.Shape(1, 128, 128, 4, 4, 192, 128, False))
    assert skip("cudnn", bench_shapes.Shape(1, 64, 128, 4, 4, 64, 64, True))
    assert skip("cudnn", bench_shapes.Shape(1, 1, 128, 4, 1, 64, 64, False)) is None
    assert skip("reference", bench_shapes.Shape(16, 2048, 2048, 16, 16, 128, 128, False))
    assert skip("reference", bench_shapes.Shape(1, 2048, 2048, 16, 16, 128, 128, False)) is None
    assert skip("jax-fa4", bench_shapes.Shape(2, 16384, 16384, 16, 16, 128, 128, False)) is None


def test_custom_call_targets():
    text = ('%0 = stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2(%a) : ...\n'
            '%1 = "stablehlo.custom_call"(%b) {call_target_name = "__cudnn$fmhaSoftmax"}\n'
            '%2 = stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall_v2(%c) : ...\n')
    assert bench.custom_call_targets(text) == {"CuteDSLRT_NvJaxCutlassCall_v2": 2,
                                               "__cudnn$fmhaSoftmax": 1}


def test_chain_length_only_for_short_gpu_calls():
    Shape = bench_shapes.Shape
    latency = Shape(1, 128, 128, 16, 16, 128, 128, False)
    assert bench.chain_length(latency, 2, "gpu") > 1
    assert bench.chain_length(latency, 2, "cpu") == 1
    assert bench.chain_length(Shape(4, 8192, 8192, 16, 16, 128, 128, True), 2, "gpu") == 1
    assert bench.chain_length(Shape(64, 1, 8192, 32, 8, 128, 128, False), 2, "gpu") == 1


@pytest.fixture
def two_input_sets(monkeypatch):
    """CPU sweeps rotate through two input sets (the fewest ``make_inputs`` makes), not the
    GPU's L2-flushing rotation: on tiny shapes that is 64 sets, whose drawing cost more than
    the rows' timing, and the rows see no cache to flush."""
    monkeypatch.setattr(bench, "ROTATION_BYTES", 0)


def test_chained_program_computes_each_call():
    shape = bench_shapes.Shape(1, 16, 16, 2, 1, 8, 8, True)
    sets = bench.make_inputs(shape, jnp.float32, jax.random.key(1), multiple_of=3)
    assert len(sets) % 3 == 0
    fn = bench._fwd_bwd(bench._fa4_fn(shape, "reference"))
    outs = jax.jit(bench.chained(fn))(*sets[:3])
    for args, got in zip(sets[:3], outs):
        jax.tree.map(np.testing.assert_allclose, got, jax.jit(fn)(*args))


@pytest.mark.skipif(not ON_CPU, reason="a kernel cannot lower on the CPU")
def test_rounds_rotate_which_program_goes_first(monkeypatch):
    """No program always runs right after another one's round: round r starts at program r."""
    calls: list[str] = []
    monkeypatch.setattr(bench, "_round_iters", lambda program, target_s: 1)

    def fake_round(program, iters, first, sync_each):
        calls.append(program)
        return {"a": 1.0, "b": 2.0, "c": 3.0}[program]

    monkeypatch.setattr(bench, "_round_ms", fake_round)
    log: list[list[int]] = []
    timings = bench.time_programs(["a", "b", "c"], repeats=3, target_s=0.01, sync_each=False,
                                  order_log=log)
    rounds = [calls[i:i + 3] for i in range(0, len(calls), 3)]
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert log == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    assert [t.ms for t in timings] == [1.0, 2.0, 3.0]  # each program keeps its own samples


@pytest.mark.usefixtures("two_input_sets")  # (the first set is the one used)
def test_jax_fa4_row_probes_the_forced_kernel():
    shape = bench_shapes.Shape(1, 16, 16, 2, 1, 8, 8, True)
    inputs = bench.make_inputs(shape, jnp.bfloat16, jax.random.key(0), multiple_of=1)[0]
    # A forced implementation that lowers: the row times implementation=None and names it.
    for impl in ("jax-fa4", "jax-fa4-det"):
        lowered = bench.lower_impl(impl, shape, "reference", inputs, False)
        assert lowered.resolved == "reference" and lowered.train_fwd is not None
    # One that cannot (no kernel lowers for the CPU): the row is skipped with the reason.
    with pytest.raises(bench.SkipRow, match="sm90"):
        bench.lower_impl("jax-fa4", shape, "sm90", inputs, False)


@pytest.mark.skipif(not ON_CPU, reason="checks the CPU sweep's rows")
def test_tiny_sweep_on_cpu(tmp_path, capsys, monkeypatch, two_input_sets):
    monkeypatch.setitem(sys.modules, "flash_attn3_jax", None)  # the optional peer: absent
    out = tmp_path / "tiny.json"
    assert bench.main(["--shapes", "tiny", "--repeats", "1", "--target-ms", "5",
                       "--out", str(out)]) == 0

    report = json.loads(out.read_text())
    assert {"gpu", "driver", "versions", "command", "date", "rows"} <= report.keys()
    assert report["gpu"] == "cpu" and report["driver"] is None
    assert report["versions"]["jax"] == jax.__version__
    assert report["command"][-2:] == ["--out", str(out)]
    assert report["complete"] is True and not out.with_suffix(".json.tmp").exists()
    assert report["bwd_method"] == bench.BWD_METHOD and report["bwd_method_text"]
    assert report["gpu_state"] == {"before": None, "after": None}  # no nvidia-smi here
    assert "cute_dsl" in report["versions"]
    assert report["timing"]["rotation"] == bench.TIMING_ROTATION
    fa3 = report["peers"]["fa3-jax"]  # absent: no column, one line saying why
    assert fa3["available"] is False and fa3["timed"] is False
    assert "flash_attn3_jax is not importable" in fa3["reason"] and "\n" not in fa3["reason"]
    assert "fa3-jax" not in report["settings"]["impls"]
    shapes = bench_shapes.PRESETS["tiny"]
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
        if row["impl"] == "jax-fa4-det" and row["Sq"] == 1:
            assert "training shapes only" in row["skipped"] and row["fwd_ms"] is None
            continue
        assert row["skipped"] is None, row
        for key in ("fwd_ms", "fwdbwd_ms", "fwd_tflops", "fwd_tbps", "fwd_us"):
            assert isinstance(row[key], float) and row[key] > 0, (key, row)
        assert row["fwd_tflops"] == pytest.approx(row["fwd_flops"] / row["fwd_ms"] / 1e9)
        assert row["bwd_ms"] == pytest.approx(row["fwdbwd_ms"] - row["train_fwd_ms"])
        assert isinstance(row["train_fwd_ms"], float) and row["residual_bytes"] > 0
        assert row["deterministic"] is (row["impl"] == "jax-fa4-det")
        assert row["measures"] == bench.row_shape(row).measures()
        # On a loaded CPU, noise can exceed these tiny backwards: no rate then, never a negative.
        if row["bwd_ms"] > 0:
            assert row["bwd_tflops"] == pytest.approx(
                2.5 * row["fwd_flops"] / row["bwd_ms"] / 1e9)
        else:
            assert row["bwd_tflops"] is None
        assert row["input_sets"] >= 2 and row["iters"] >= 1 and row["calls_per_dispatch"] == 1
        assert row["fwd_rel_err_vs"] == "reference" and row["fwd_rel_err"] < 1e-6
        assert row["finite"] == {"out": True, "dq": True, "dk": True, "dv": True}
        assert row["fa4_rule"] is None and row["best_peer_bwd"] is None  # no peer ran
        assert row["xla_mem_bytes"] > 0
        if row["impl"] in ("jax-fa4", "jax-fa4-det"):
            assert row["resolved_impl"] == "reference"  # no kernel on the CPU

    # One timing record per shape: every timed impl's three programs, each opening a round.
    records = report["timing"]["shapes"]
    assert len(records) == len(shapes)
    for record, first in zip(records, rows[::len(bench.IMPLS)]):
        timed_impls = [r["impl"] for r in rows if r["fwd_ms"] is not None
                       and bench_report._shape_key(r) == bench_report._shape_key(first)]
        assert record["programs"] == [f"{i} {k}" for i in timed_impls for k in bench.PROGRAM_KINDS]
        n = len(record["programs"])
        assert sorted(o[0] for o in record["round_orders"][1:]) == list(range(n))
        assert all(sorted(o) == list(range(n)) for o in record["round_orders"])

    timed = [r for r in rows if r["skipped"] is None]
    assert sum(r["bwd_tflops"] is not None for r in timed) >= len(timed) // 2

    png = out.with_suffix(".png")
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "total wall time" in printed and "fwd TF/s" in printed


def test_backward_variant_sweep_lists_valid_distinct_configs():
    """benchmarks/bwd_variants.py's configs (jax_fa4.tools.variant_sweeps): per shape, v1 is the
    tuning table's config, every other variant is a distinct config the validator accepts (the
    run precompiles exactly these), the group_heads form where it compiles."""
    from jax_fa4.kernels.sm90.bwd_config import BwdConfig
    from jax_fa4.tools import variant_sweeps

    for shape in variant_sweeps.bwd_shapes("all"):
        gqa = shape.H != shape.Hkv
        mask = "causal" if shape.causal else "none"
        variants = variant_sweeps.bwd_variants_for(shape.D, shape.Dv, mask, gqa)
        names = [n for n, _ in variants]
        assert names[0] == "v1" and "det" in names and len(set(names)) == len(names)
        assert variants[0][1] == BwdConfig.make("bfloat16", shape.D, shape.Dv, mask, False, gqa)
        cfgs = [c for _, c in variants]
        assert len(set(cfgs)) == len(cfgs)
        for cfg in cfgs:
            cfg.validate()
            # (the group_heads form writes dK / dV per kv head: gqa=False's outputs)
            assert cfg.gqa == (gqa and not cfg.group_heads) and cfg.mask == mask
        assert ("group" in names) == (shape.D in (96, 128, 192))
    needed = variant_sweeps.bwd_variant_configs("d128", ["det"])
    assert {c.kernel_name for c in needed} == {"sm90_bwd", "sm90_bwd_postprocess"}


def test_forward_variant_sweep_lists_each_needed_config_once():
    """benchmarks/fwd_variants.py's configs: v1 is the tuning table's, names are unique, and
    ``--list`` / ``--precompile`` cover every listed config once."""
    from jax_fa4.kernels.sm90.fwd_config import FwdConfig
    from jax_fa4.tools import variant_sweeps

    listed = []
    for shape in variant_sweeps.fwd_shapes("d128"):
        mask = "causal" if shape.causal else "none"
        variants = variant_sweeps.fwd_variants_for(shape.D, shape.Dv, mask)
        names = [n for n, _ in variants]
        assert names[0] == "v1" and len(set(names)) == len(names) > 1
        assert variants[0][1] == FwdConfig.make("bfloat16", shape.D, shape.Dv, mask, False)
        listed += [c for _, c in variants]
    needed = variant_sweeps.fwd_variant_configs("d128")
    assert len(set(needed)) == len(needed) and set(needed) == set(listed)


def test_sass_diff_pairs_variants_across_a_new_default_field():
    """A config field added with a default (the code it generated before) keeps the variant's
    key, so the old and the new checkout's variants pair up; a non-default value does not."""
    import dataclasses
    from typing import ClassVar

    from jax_fa4.tools import sass_diff

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


REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def _fake_prepared(impl: str, shape: bench_shapes.Shape, kinds: tuple[str, ...]
                   ) -> bench.Prepared:
    row = bench._empty_row(impl, shape, "bf16")
    return bench.Prepared(row, {kind: f"{impl} {kind}" for kind in kinds})


def test_one_rotation_times_every_implementations_programs(monkeypatch):
    """Per shape, all impls' programs share one time_programs call: each opens a timed round,
    the record lists the programs and every round's order, and bwd = fwd+bwd - training fwd."""
    shape = bench_shapes.Shape(4, 8192, 8192, 16, 16, 128, 128, True)
    ms = {"fwd": 2.0, "train_fwd": 2.5, "fwdbwd": 9.0}
    calls: list[str] = []
    monkeypatch.setattr(bench, "_round_iters", lambda program, target_s: 1)

    def fake_round(program, iters, first, sync_each):
        calls.append(program)
        impl, kind = program.split()
        return ms[kind] * (2 if impl == "cudnn" else 1)

    monkeypatch.setattr(bench, "_round_ms", fake_round)
    prepared = [_fake_prepared("jax-fa4", shape, bench.PROGRAM_KINDS),
                _fake_prepared("cudnn", shape, bench.PROGRAM_KINDS),
                _fake_prepared("xla", shape, ("fwd",)),  # its backward failed
                bench.Prepared(bench._empty_row("reference", shape, "bf16"), {})]  # skipped
    ctx = bench.BenchContext(argparse.Namespace(repeats=5, target_ms=10.0), jax.devices()[0],
                             None, jnp.bfloat16, "bf16")
    record = bench.time_shape(prepared, ctx)
    n = 7
    assert record["programs"] == ["jax-fa4 fwd", "jax-fa4 train_fwd", "jax-fa4 fwdbwd",
                                  "cudnn fwd", "cudnn train_fwd", "cudnn fwdbwd", "xla fwd"]
    orders = record["round_orders"]
    assert len(orders) == 1 + bench.timed_rounds(5, n) == 1 + n
    assert [o[0] for o in orders[1:]] == [r % n for r in range(1, n + 1)]  # each opens a round
    assert calls == [record["programs"][i] for o in orders for i in o]
    fa4, cudnn, xla, ref = (p.row for p in prepared)
    assert fa4["train_fwd_ms"] == 2.5 and fa4["fwd_ms"] == 2.0
    assert fa4["bwd_ms"] == pytest.approx(9.0 - 2.5)  # the training forward, not the inference one
    assert cudnn["bwd_ms"] == pytest.approx(18.0 - 5.0)
    assert fa4["bwd_tflops"] == pytest.approx(2.5 * shape.fwd_flops() / 6.5 / 1e9)
    assert fa4["rounds"] == n and xla["fwd_ms"] == 2.0 and xla["bwd_ms"] is None
    assert ref["fwd_ms"] is None and ref["rounds"] is None
    assert bench.timed_rounds(5, 3) == 6 and bench.timed_rounds(1, 4) == 4


@pytest.mark.usefixtures("two_input_sets")  # (the first set is the one used)
@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_training_forward_returns_the_residuals(impl):
    """The training-forward program returns more than out: the residuals the backward reads (for
    the reference its float32 lse), and none of q, k, v, out (no copies of them are timed)."""
    shape = bench_shapes.Shape(1, 32, 32, 2, 1, 16, 16, True)
    q, k, v, _ = bench.make_inputs(shape, jnp.bfloat16, jax.random.key(2), multiple_of=1)[0]
    fn = (bench._fa4_fn(shape, "reference") if impl == "reference"
          else bench._jax_nn_fn(shape, "xla"))
    out_shape = jax.eval_shape(fn, q, k, v)
    out, residuals = jax.eval_shape(bench._train_fwd(fn), q, k, v)
    assert out == out_shape and len(residuals) >= 1
    if impl == "reference":
        assert any(r.shape == (1, 2, 32) and r.dtype == jnp.float32 for r in residuals)
    lowered = jax.jit(bench._train_fwd(fn)).lower(q, k, v)
    assert len(jax.tree.leaves(lowered.out_info)) == 1 + len(residuals) > 1
    assert bench.residual_bytes(fn, q, k, v) == sum(r.size * r.dtype.itemsize for r in residuals)
    mem = lowered.compile().memory_analysis()
    if mem is not None:
        assert mem.output_size_in_bytes > out_shape.size * out_shape.dtype.itemsize
    # Run: the outputs are new buffers (no input is returned, so none is copied), and the
    # pullback built from the same forward gives the same gradient as the fwd+bwd program.
    got_out, got_res = jax.jit(bench._train_fwd(fn))(q, k, v)
    pointers = {x.unsafe_buffer_pointer() for x in (q, k, v)}
    assert all(r.unsafe_buffer_pointer() not in pointers for r in got_res)
    np.testing.assert_array_equal(np.asarray(got_out, np.float32), np.asarray(fn(q, k, v),
                                                                              np.float32))


def test_rows_say_what_they_measure():
    latency = bench_shapes.Shape(1, 128, 128, 16, 16, 128, 128, False)
    decode = bench_shapes.Shape(64, 1, 8192, 32, 8, 128, 128, False)
    assert latency.measures() == "launch overhead"
    assert decode.measures() == "K/V bandwidth"
    assert all(s.measures() == "attention speed" for s in bench_shapes.ANCHOR_SHAPES)
    assert {s.measures() for s in bench_shapes.PRESETS["default"]} == set(bench_shapes.MEASURES)
    row = bench._empty_row("jax-fa4", latency, "bf16")
    row.update(fwd_ms=0.008, fwd_tflops=16.75, bwd_tflops=13.25)
    assert row["measures"] == "launch overhead"
    assert bench_report._rate(row, "fwd_tflops") == "(latency)"  # no TFLOP/s presented as speed
    line = bench_report.row_line(row)
    assert "16.8" not in line and "13.2" not in line and "launch overhead" in line
    drow = bench._empty_row("cudnn", decode, "bf16")
    drow.update(fwd_ms=0.5, fwd_tflops=17.0, fwd_tbps=4.3)
    assert bench_report._rate(drow, "fwd_tflops") == "4.3 TB/s"


def test_deterministic_rows_on_training_shapes_only():
    args = argparse.Namespace(reference_max_gb=4.0, xla_max_gb=20.0, fwd_only=False)
    skip = lambda shape: bench.static_skip_reason("jax-fa4-det", shape, "gpu", args)  # noqa
    training = [s for s in bench_shapes.PRESETS["default"] if s.measures() == "attention speed"]
    assert len(training) == 16 and all(skip(s) is None for s in training)
    others = [s for s in bench_shapes.PRESETS["default"] if s not in training]
    assert others and all(skip(s) for s in others)
    assert bench.static_skip_reason("jax-fa4-det", training[0], "gpu",
                                    argparse.Namespace(**{**vars(args), "fwd_only": True}))
    assert bench._empty_row("jax-fa4-det", training[0], "bf16")["deterministic"] is True
    assert bench._empty_row("jax-fa4", training[0], "bf16")["deterministic"] is False


def test_default_preset_holds_every_anchor_shape():
    anchors = json.loads((REPO / "benchmarks" / "anchors.json").read_text())["rows"]
    assert len(anchors) == 18
    keys = {(a["B"], a["Sq"], a["Sk"], a["H"], a["Hkv"], a["D"], a["Dv"], a["causal"])
            for a in anchors}
    default = {(s.B, s.Sq, s.Sk, s.H, s.Hkv, s.D, s.Dv, s.causal) for s in
               bench_shapes.PRESETS["default"] if s.window == (None, None)}
    assert keys <= default
    assert keys == {(s.B, s.Sq, s.Sk, s.H, s.Hkv, s.D, s.Dv, s.causal)
                    for s in bench_shapes.preset_shapes("anchors-main,anchors-more")}
    assert set(bench_shapes.LATENCY_SHAPES) <= set(bench_shapes.PRESETS["default"])


def _fake_report(spec: str, **changes) -> dict:
    rows = []
    for shape in bench_shapes.preset_shapes(spec):
        for impl in ("jax-fa4", "cudnn"):
            row = bench._empty_row(impl, shape, "bf16")
            row.update(fwd_ms=1.0)
            rows.append(row)
    report = {"gpu": "NVIDIA H200", "platform": "gpu", "driver": "580", "versions": {"jax": "x"},
              "gpu_state": {"before": None, "after": None}, "command": ["python"],
              "date": "2026-12-02T10:00:00+00:00", "bwd_method": bench.BWD_METHOD,
              "settings": {"shapes": spec, "dtype": "bf16", "impls": ["jax-fa4", "cudnn"],
                           "repeats": 5, "target_ms": 25.0, "fwd_only": False,
                           "rotation_bytes": 1, "backward_flop_factor": 2.5},
              "timing": {"method": "m", "rotation": bench.TIMING_ROTATION,
                         "shapes": [{"shape": spec}]},
              "complete": True, "wall_s": 100.0, "rows": rows}
    report.update(changes)
    return report


def test_merge_joins_a_split_default_sweep(tmp_path):
    a, b = _fake_report("anchors-more,latency"), _fake_report("anchors-main",
                                                              date="2026-12-02T11:00:00+00:00")
    merged = bench_report.merge_reports([a, b], ["a.json", "b.json"])
    assert merged["settings"]["shapes"] == "default" and merged["complete"] is True
    assert merged["date"] == "2026-12-02T11:00:00+00:00" and merged["wall_s"] == 200.0
    got = [bench_report._shape_key(r) for r in merged["rows"][::2]]
    assert got == [bench_report._shape_key(bench._empty_row("x", s, "bf16"))
                   for s in bench_shapes.PRESETS["default"]]  # in the preset's order
    assert len(merged["timing"]["shapes"]) == 2 and len(merged["merged_from"]) == 2
    with pytest.raises(ValueError, match="versions"):
        bench_report.merge_reports([a, _fake_report("anchors-main", versions={"jax": "y"})],
                                   ["a", "b"])
    with pytest.raises(ValueError, match="both"):
        bench_report.merge_reports([a, a], ["a", "b"])
    with pytest.raises(ValueError, match="complete"):
        bench_report.merge_reports([a, _fake_report("anchors-main", complete=False)], ["a", "b"])
    part = bench_report.merge_reports([_fake_report("anchors-main"), _fake_report("latency")],
                                      ["a", "b"])
    assert part["settings"]["shapes"] == "anchors-main+latency"
    for name, rep in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(rep))
    out = tmp_path / "c.json"
    assert bench.main(["merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                       "--out", str(out)]) == 0
    assert json.loads(out.read_text())["settings"]["shapes"] == "default"


def test_gpu_state_falls_back_field_by_field(monkeypatch):
    """A driver that refuses one field: the joint query fails, the others are still read."""
    import subprocess

    monkeypatch.setattr(bench_env.shutil, "which", lambda name: "/usr/bin/nvidia-smi")

    def fake_run(cmd, **kwargs):
        fields = cmd[1].split("=", 1)[1].split(",")
        if "clocks_throttle_reasons.active" in fields:
            raise subprocess.CalledProcessError(2, cmd)
        values = {"name": "NVIDIA H200", "driver_version": "580.1", "clocks.sm": "1980",
                  "power.draw": "[N/A]", "clocks_event_reasons.active": "0x0000000000000000"}
        line = ", ".join(values.get(f, "7") for f in fields)
        return subprocess.CompletedProcess(cmd, 0, stdout=line + "\n" + line + "\n")

    monkeypatch.setattr(bench_env.subprocess, "run", fake_run)
    state = bench_env.gpu_state()
    assert len(state) == 2 and state[0]["name"] == "NVIDIA H200"
    assert state[0]["clocks.sm"] == 1980.0 and state[0]["power.draw"] is None
    assert state[0]["clocks_throttle_reasons.active"] == "0x0000000000000000"
    assert set(state[0]) == set(bench_env.GPU_QUERY_FIELDS)
    assert bench_env.driver_version(state) == "580.1"
    monkeypatch.setattr(bench_env.shutil, "which", lambda name: None)
    assert bench_env.gpu_state() is None and bench_env.driver_version() is None


def test_cute_dsl_versions_come_from_the_kernel_cache(tmp_path, monkeypatch):
    """Without nvidia-cutlass-dsl (the GPU machine), the DSL versions of the cached kernels and
    the runtime library named by the environment are recorded."""
    entry = tmp_path / "sm_90a"
    entry.mkdir()
    (entry / "k1.json").write_text(json.dumps({"dsl_version": "4.8.1"}))
    (entry / "k2.json").write_text(json.dumps({"dsl_version": "4.8.1"}))
    monkeypatch.setenv("JAX_FA4_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("JAX_FA4_CUTE_RUNTIME_LIB", "/opt/lib/libcute_dsl_runtime.so")
    found = bench_env.cute_dsl_versions()
    assert found["kernel_cache"] == str(tmp_path)
    assert found["kernel_cache_dsl_versions"] == {"4.8.1": 2}
    assert found["runtime_library"] == "/opt/lib/libcute_dsl_runtime.so"


def test_fp8_flags():
    args = bench.parse_args(["--dtype", "float8_e4m3fn"])
    assert args.impls == list(bench.FP8_IMPLS) and args.fwd_only  # no FP8 gradient
    assert args.shapes == "anchors-main"
    assert bench.parse_args([]).shapes == "default"
    with pytest.raises(SystemExit):  # xla has no FP8 row
        bench.parse_args(["--dtype", "float8_e4m3fn", "--impls", "jax-fa4,xla"])
    with pytest.raises(SystemExit):  # the bfloat16 comparison row belongs to an FP8 sweep
        bench.parse_args(["--impls", "jax-fa4-bf16"])
    ns = argparse.Namespace(reference_max_gb=4.0, xla_max_gb=36.0, dtype="float8_e4m3fn")
    windowed = bench_shapes.Shape(1, 256, 256, 4, 4, 64, 64, False, (32, 32))
    assert "window" in bench.static_skip_reason("cudnn", windowed, "gpu", ns)
    assert bench.static_skip_reason("cudnn", bench_shapes.Shape(1, 256, 256, 4, 4, 64, 64, True),
                                    "gpu", ns) is None


@pytest.mark.usefixtures("two_input_sets")
def test_fp8_input_sets_share_e4m3_values():
    shape = bench_shapes.Shape(1, 40, 40, 2, 1, 32, 32, False)
    sets = bench.make_inputs(shape, jnp.float8_e4m3fn, jax.random.key(3), multiple_of=1)
    assert sets[0][0].dtype == jnp.bfloat16 and len(sets) >= 2
    fp8_sets = bench.fp8_input_sets(sets)
    for (q, k, v, _), (q8, k8, v8, qd, kd, vd, do) in zip(sets, fp8_sets):
        assert do is None and q8.dtype == jnp.float8_e4m3fn and qd.shape == ()
        for x, x8, d in ((q, q8, qd), (k, k8, kd), (v, v8, vd)):
            back = x8.astype(jnp.float32) * d
            err = jnp.abs(back - x.astype(jnp.float32)).max() / jnp.abs(x.astype(jnp.float32)).max()
            assert 0 < err < 0.07  # e4m3: 3 mantissa bits, one scale per tensor


@pytest.mark.skipif(not ON_CPU, reason="checks the CPU sweep's rows")
def test_tiny_fp8_sweep_on_cpu(tmp_path, two_input_sets):
    out = tmp_path / "fp8.json"
    assert bench.main(["--dtype", "float8_e4m3fn", "--shapes", "tiny", "--repeats", "1",
                       "--target-ms", "5", "--no-plot", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert not out.with_suffix(".png").exists()  # --no-plot
    assert report["settings"]["fwd_only"] is True and report["settings"]["dtype"] == bench.FP8
    rows = report["rows"]
    assert len(rows) == len(bench_shapes.PRESETS["tiny"]) * len(bench.FP8_IMPLS)
    for row in rows:
        assert tuple(row) == bench.ROW_KEYS
        assert row["dtype"] == ("bf16" if row["impl"] == "jax-fa4-bf16" else bench.FP8)
        assert row["fwdbwd_ms"] is None and row["bwd_ms"] is None
        if row["impl"] == "cudnn":
            assert "GPU" in row["skipped"]
            continue
        assert row["skipped"] is None and row["fwd_ms"] > 0, row
        if row["impl"] == "jax-fa4-bf16":
            assert row["fwd_rel_err"] is None and row["fwd_ratio_vs_bf16"] is None
        else:  # the FP8 rows: against the reference on the same e4m3 inputs
            assert row["fwd_rel_err_vs"] == "reference" and row["fwd_rel_err"] < 1e-2
            assert row["fwd_ratio_vs_bf16"] == pytest.approx(
                [r for r in rows if r["impl"] == "jax-fa4-bf16" and bench_report._shape_key(r)
                 == bench_report._shape_key(row)][0]["fwd_ms"] / row["fwd_ms"])


# -- the optional peer fa3-jax, through stand-ins for flash_attn3_jax -------------------------
def _fake_fa3(kind: str = "good") -> types.ModuleType:
    """A stand-in for ``flash_attn3_jax``: ``flash_mha(q, k, v, softmax_scale, is_causal,
    window_size)`` in pure JAX (the float32 reference), BSHD, a custom VJP. ``nan``: its
    gradients are NaN; ``refuse256``: it raises for a head dim above 128."""
    from jax_fa4 import reference

    def flash_mha(q, k, v, softmax_scale=None, is_causal=False, window_size=(-1, -1)):
        if kind == "refuse256" and q.shape[-1] > 128:
            raise ValueError("Check failed: head_size <= max_headdim; FlashAttention forward "
                             "only supports head dimension at most 128")
        left, right = (None if w < 0 else w for w in window_size)
        window = (left, 0) if is_causal else (left, right)

        @jax.custom_vjp
        def attention(q, k, v):
            return reference.attention(q, k, v, softmax_scale=softmax_scale,
                                       window=window)[0].astype(q.dtype)

        def fwd(q, k, v):
            out, pullback = jax.vjp(attention.fun, q, k, v)
            return out, pullback

        def bwd(pullback, do):
            grads = pullback(do)
            return tuple(jnp.full_like(g, jnp.nan) for g in grads) if kind == "nan" else grads

        attention.defvjp(fwd, bwd)
        return attention(q, k, v)

    module = types.ModuleType("flash_attn3_jax")
    module.__version__ = f"0.0-{kind}"
    module.flash_mha = flash_mha
    return module


def test_peer_default_impls_follow_importability(monkeypatch):
    """fa3-jax joins the default --impls when importable and is absent otherwise; asked for
    while absent, its rows are skipped with the one-line reason."""
    monkeypatch.setitem(sys.modules, "flash_attn3_jax", _fake_fa3())
    assert bench.parse_args([]).impls == list(bench.IMPLS) + ["fa3-jax"]
    assert bench.parse_args(["--impls", "jax-fa4,cudnn,fa3-jax"]).impls[-1] == "fa3-jax"
    with pytest.raises(SystemExit):  # no FP8 call in its API
        bench.parse_args(["--dtype", "float8_e4m3fn", "--impls", "jax-fa4,fa3-jax"])
    assert "fa3-jax" not in bench.parse_args(["--dtype", "float8_e4m3fn"]).impls
    monkeypatch.setitem(sys.modules, "flash_attn3_jax", None)
    assert bench.parse_args([]).impls == list(bench.IMPLS)
    peers = bench.bench_peers.load_peers()
    shape = bench_shapes.Shape(1, 64, 64, 2, 2, 32, 32, False)
    args = argparse.Namespace(reference_max_gb=4.0, xla_max_gb=20.0, dtype="bf16")
    reason = bench.static_skip_reason("fa3-jax", shape, "gpu", args, peers)
    assert reason == peers["fa3-jax"].reason and "not importable" in reason
    monkeypatch.setitem(sys.modules, "flash_attn3_jax", _fake_fa3())
    peers = bench.bench_peers.load_peers()
    assert bench.static_skip_reason("fa3-jax", shape, "gpu", args, peers) is None
    gqa192 = bench_shapes.Shape(1, 64, 64, 4, 2, 192, 128, False)
    assert bench.static_skip_reason("fa3-jax", gqa192, "gpu", args, peers).startswith(
        "refused: flash_mha takes k and v of one shape")
    fp16 = argparse.Namespace(**{**vars(args), "dtype": "fp16"})
    assert bench.static_skip_reason("fa3-jax", shape, "gpu", fp16, peers) is None


@pytest.mark.skipif(not ON_CPU, reason="runs the stand-in peers on the CPU")
def test_peer_column_on_cpu(tmp_path, monkeypatch, capsys, two_input_sets):
    """A stand-in fa3-jax is timed in the same rotation as ours, checked by FA4's rule, and a
    head dim it refuses is recorded as refused; one with NaN gradients is flagged. Causal
    shapes only: the mask reaches flash_mha's arguments (test_fa3_call_maps_fa4_masks) and its
    result is checked against the masked reference here."""
    monkeypatch.setitem(sys.modules, "flash_attn3_jax", _fake_fa3("refuse256"))
    out = tmp_path / "peer.json"
    assert bench.main(["--shapes", "custom", "--B", "1", "--Sq", "48", "--H", "2", "--Hkv", "1",
                       "--D", "16,256", "--causal", "yes", "--window", "none,none",
                       "--impls", "jax-fa4,reference,fa3-jax",
                       "--repeats", "1", "--target-ms", "2", "--no-plot", "--out",
                       str(out)]) == 0
    report = json.loads(out.read_text())
    peer = report["peers"]["fa3-jax"]
    assert peer["available"] and peer["timed"] and peer["version"] == "0.0-refuse256"
    rows = {(r["impl"], r["D"], r["causal"], tuple(r["window"])): r for r in report["rows"]}
    assert len(rows) == len(report["rows"]) == 3 * 2  # (masks: test_fa3_call_maps_fa4_masks)
    causal, window = True, (None, None)
    fa3 = rows["fa3-jax", 16, causal, window]
    assert tuple(fa3) == bench.ROW_KEYS and fa3["skipped"] is None, fa3
    assert fa3["fwd_ms"] > 0 and fa3["fwdbwd_ms"] > 0 and fa3["rounds"] >= 1
    assert fa3["finite"] == {"out": True, "dq": True, "dk": True, "dv": True}
    rule = fa3["fa4_rule"]
    assert rule["passed"] is True and "float32 reference" in rule["vs"]
    assert {n: rule[n]["passed"] for n in ("out", "dq", "dk", "dv")} == dict.fromkeys(
        ("out", "dq", "dk", "dv"), True)
    assert fa3["fwd_rel_err_vs"] == "reference" and fa3["fwd_rel_err"] < 1e-2
    ours = rows["jax-fa4", 16, causal, window]
    assert ours["fa4_rule"]["passed"] is True  # every row of the shape, same rule
    refused = rows["fa3-jax", 256, causal, window]
    assert refused["skipped"].startswith("refused: ValueError: Check failed: head_size")
    assert refused["fwd_ms"] is None and refused["finite"] is None
    assert rows["jax-fa4", 256, causal, window]["skipped"] is None
    # the peer's programs joined the shape's one rotation
    record = report["timing"]["shapes"][0]
    assert [p.split()[0] for p in record["programs"]].count("fa3-jax") == 3
    assert len(record["programs"]) == 9 and {o[0] for o in record["round_orders"][1:]} == set(
        range(9))
    assert "checks" in capsys.readouterr().out  # the table shows the checks' column

    monkeypatch.setitem(sys.modules, "flash_attn3_jax", _fake_fa3("nan"))
    out = tmp_path / "nan.json"
    assert bench.main(["--shapes", "custom", "--B", "1", "--Sq", "48", "--H", "2", "--Hkv", "1",
                       "--D", "16", "--causal", "yes", "--impls", "fa3-jax",
                       "--repeats", "1", "--target-ms", "2", "--no-plot", "--out",
                       str(out)]) == 0
    fa3 = [r for r in json.loads(out.read_text())["rows"] if r["impl"] == "fa3-jax"][0]
    assert fa3["skipped"] is None and fa3["bwd_ms"] is not None
    assert fa3["finite"] == {"out": True, "dq": False, "dk": False, "dv": False}
    assert fa3["fa4_rule"]["out"]["passed"] is True and fa3["fa4_rule"]["passed"] is False
    assert fa3["fa4_rule"]["dq"] == {"err": None, "bound": fa3["fa4_rule"]["dq"]["bound"],
                                     "passed": False}
    assert "NaN dq,dk,dv" in capsys.readouterr().out


def test_best_peer_counts_only_finite_results_that_pass_the_rule():
    """The bar per shape: the highest ratio to cuDNN among cuDNN and the peers whose results
    count; a peer whose gradients are NaN (or fail FA4's rule) is not the backward's bar."""
    shape = bench_shapes.Shape(4, 8192, 8192, 16, 16, 128, 128, True)
    ok = {"out": True, "dq": True, "dk": True, "dv": True}
    times = {"jax-fa4": (1.0, 2.0), "cudnn": (1.1, 2.4), "fa3-jax": (1.0, 2.0)}
    rows = []
    for impl, (fwd, bwd) in times.items():
        row = bench._empty_row(impl, shape, "bf16")
        fwdbwd = fwd + bwd
        row.update(fwd_ms=fwd, train_fwd_ms=fwd, fwdbwd_ms=fwdbwd, finite=dict(ok))
        bench._derive(row, 2)
        rows.append(row)
    ours, cudnn, fa3 = rows
    fa3["finite"]["dq"] = False
    bench.compare_rows(rows, {})
    assert fa3["fwd_ratio_vs_cudnn"] == pytest.approx(1.1) and fa3["bwd_ratio_vs_cudnn"] == (
        pytest.approx(1.2))
    for row in rows:  # forward: fa3-jax's (finite); backward: cuDNN's, not fa3-jax's NaN
        assert (row["best_peer_fwd"], row["best_peer_bwd"]) == ("fa3-jax", "cudnn")
        assert row["best_peer_fwd_ratio"] == pytest.approx(1.1)
        assert row["best_peer_bwd_ratio"] == pytest.approx(1.0)
    fa3["finite"]["dq"] = True
    fa3["fa4_rule"] = {"passed": False, "dq": {"passed": False}, "out": {"passed": True}}
    bench.compare_rows(rows, {})
    assert ours["best_peer_bwd"] == "cudnn" and ours["best_peer_fwd"] == "fa3-jax"
    fa3["fa4_rule"] = {"passed": True, "dq": {"passed": True}}
    bench.compare_rows(rows, {})
    assert ours["best_peer_bwd"] == "fa3-jax" and ours["best_peer_bwd_ratio"] == (
        pytest.approx(1.2))
    lines = bench_report.bar_lines(rows)
    assert lines == [f"{bench_report.shape_label(ours)}: jax-fa4 x cuDNN fwd 1.10 vs fa3-jax "
                     "1.10 (meets); bwd 1.20 vs fa3-jax 1.20 (meets)"]
    # Without a peer in the sweep there is no best-peer column (cuDNN alone is its own bar).
    bare = [bench._empty_row(i, shape, "bf16") | {k: r[k] for k in ("fwd_ms", "bwd_tflops")}
            for i, r in (("jax-fa4", ours), ("cudnn", cudnn))]
    bench.compare_rows(bare, {})
    assert all(r["best_peer_fwd"] is None and r["best_peer_bwd"] is None for r in bare)


def test_fa3_call_maps_fa4_masks():
    """The mask FA4's shape means, in flash_mha's terms: causal, or a (left, right) window
    with -1 for an unbounded side."""
    seen = []
    module = types.SimpleNamespace(flash_mha=lambda q, k, v, **kw: seen.append(kw))
    for window, causal, expect in (((None, None), False, (False, (-1, -1))),
                                   ((None, None), True, (True, (-1, -1))),
                                   ((8, None), True, (False, (8, 0))),
                                   ((None, 4), False, (False, (-1, 4)))):
        shape = bench_shapes.Shape(1, 8, 8, 1, 1, 64, 64, causal, window)
        bench.bench_peers.fa3_fn(module, shape)(None, None, None)
        assert (seen[-1]["is_causal"], seen[-1]["window_size"]) == expect
        assert seen[-1]["softmax_scale"] == 0.125
