"""jax_fa4.tools.readme_tables: README's speed sections are what the newest result file gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from jax_fa4.tools import readme_tables


def test_readme_matches_the_generator():
    current, generated, result = readme_tables.build()
    assert result == readme_tables.newest_result()
    assert current == generated, "README is stale: run python -m jax_fa4.tools.readme_tables"
    assert readme_tables.main(["--check"]) == 0


def _copy(tmp_path: Path) -> tuple[Path, Path, dict]:
    """A results folder holding a copy of the newest file, and a README copy."""
    result = readme_tables.newest_result()
    results = tmp_path / "results"
    results.mkdir()
    report = json.loads(result.read_text())
    readme = tmp_path / "README.md"
    shutil.copy(readme_tables.README, readme)
    return results, readme, report


def test_a_changed_figure_changes_the_readme(tmp_path):
    results, readme, report = _copy(tmp_path)
    copy = results / "gpu-2026-01-01.json"
    copy.write_text(json.dumps(report))
    args = ["--readme", str(readme), "--results", str(results)]
    assert readme_tables.main(args) == 0
    assert readme_tables.main([*args, "--check"]) == 0
    first = readme.read_text()

    row = next(r for r in report["rows"] if r["impl"] == "jax-fa4" and r["fwd_tflops"]
               and readme_tables.measures(r) == "attention speed")
    # a new figure that the first README does not already show somewhere else (another row's
    # figure may equal 1.5 × this one's once rounded)
    new = next(x for x in (row["fwd_tflops"] * f for f in (1.5, 1.47, 1.53, 1.41, 1.59))
               if f"| {x:.0f} |" not in first)
    row["fwd_tflops"] = new
    copy.write_text(json.dumps(report))
    assert readme_tables.main([*args, "--check"]) == 1  # README no longer matches the file
    assert readme_tables.main(args) == 0
    second = readme.read_text()
    assert second != first and f"| {row['fwd_tflops']:.0f} |" in second
    assert f"| {row['fwd_tflops']:.0f} |" not in first
    assert readme_tables.main([*args, "--check"]) == 0


def test_the_newest_complete_default_file_is_chosen(tmp_path):
    results, _, report = _copy(tmp_path)
    old = dict(report, date="2026-01-01T00:00:00+00:00")
    new = dict(report, date="2026-02-01T00:00:00+00:00")
    (results / "a-2026-01-01.json").write_text(json.dumps(old))
    (results / "b-2026-02-01.json").write_text(json.dumps(new))
    (results / "c-2026-03-01.json").write_text(json.dumps(dict(
        report, date="2026-03-01T00:00:00+00:00", complete=False)))
    (results / "d-2026-03-01.json").write_text(json.dumps(dict(
        report, date="2026-03-01T00:00:00+00:00",
        settings={**report["settings"], "shapes": "anchors-main"})))
    (results / "e-2026-03-01.json").write_text(json.dumps(dict(  # no backward rows
        report, date="2026-03-01T00:00:00+00:00",
        settings={**report["settings"], "fwd_only": True})))
    assert readme_tables.newest_result(results).name == "b-2026-02-01.json"


def test_captions_and_status_come_from_the_files_fields():
    anchors = json.loads(readme_tables.ANCHORS.read_text())
    report = json.loads(readme_tables.newest_result().read_text())
    old = readme_tables.generate(report, "x.json", anchors)
    if "timing" not in report:
        assert "order not rotated across implementations" in old["bench"]
    if report.get("bwd_method") != "fwdbwd_minus_training_fwd":
        assert "t(inference fwd)" in old["bench"]
    new = readme_tables.generate(
        dict(report, bwd_method="fwdbwd_minus_training_fwd",
             timing={"rotation": "round r starts at program r mod n"}), "x.json", anchors)
    assert "t(training fwd" in new["bench"] and "round r starts at program r mod n" in new["bench"]
    # The bar count is counted: pushing every jax-fa4 forward up puts every barred row at it.
    boosted = json.loads(json.dumps(report))
    for r in boosted["rows"]:
        if r["impl"] == "jax-fa4" and r.get("fwd_tflops"):
            r["fwd_tflops"] *= 2
    status = readme_tables.generate(boosted, "x.json", anchors)["bench-status-fwd"]
    barred = status.rsplit(" of ", 1)[1]
    assert status.endswith(f"at FA4's bar on {barred} of {barred}")
    assert old["bench-status-fwd"] != status


def test_render_needs_each_marker_pair_once():
    with pytest.raises(SystemExit, match="bench"):
        readme_tables.render("no markers", {"bench": "x"})
    text = "a <!-- s:begin -->old<!-- s:end --> b"
    assert readme_tables.render(text, {"s": "new"}) == "a <!-- s:begin -->new<!-- s:end --> b"


# -- the whole-step section -----------------------------------------------------------------------
def _step_config(name: str, packed: bool = False, **impls: dict) -> dict:
    return {"config": name, "B": 2, "S": 8192, "d_model": 2048, "H": 16, "Hkv": 4, "D": 128,
            "layers": 4, "packed": packed, "impls": impls, "skipped": {}}


def _step_report(date: str = "2026-01-02T10:00:00+00:00", **changes) -> dict:
    """A step_bench result of two configs: one timed against cuDNN, one packed (ours only)."""
    dense = _step_config(
        "b2s8k-16-4-d128",
        **{"jax-fa4": {"step_ms": 40.0, "attn_train_fwd_ms": 1.0, "attn_bwd_ms": 2.0},
           "cudnn": {"step_ms": 50.0, "attn_train_fwd_ms": 1.1, "attn_bwd_ms": 3.0}})
    dense.update(baseline="cudnn", check={"agree": True})
    packed = _step_config("b2s8k-16-4-d128-packed", packed=True,
                          **{"jax-fa4": {"step_ms": 38.0, "attn_train_fwd_ms": 0.9}})
    packed.update(baseline=None, skipped={"cudnn": "jax.nn.dot_product_attention has no segment "
                                                   "ids: packed rows time jax-fa4 only"})
    failed = {"config": "b8s2k-32-8-d64", "impls": {}, "error": "RuntimeError: out of memory\nx"}
    report = {"gpu": "NVIDIA H200", "date": date, "complete": True, "wall_s": 300.0,
              "settings": {"steps": 10, "smoke": False}, "model": "pre-norm decoder",
              "configs": [dense, packed, failed]}
    return report | changes


def _cells(text: str, config: str) -> list[str]:
    line = next(x for x in text.splitlines() if x.startswith(f"| `{config}` |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_the_step_table_from_a_step_result(tmp_path):
    (tmp_path / "step-nvidia-h200-2026-01-02.json").write_text(json.dumps(_step_report()))
    sections, path = readme_tables.step_sections(tmp_path)
    assert path == tmp_path / "step-nvidia-h200-2026-01-02.json"
    text = sections["step"]
    caption = text.splitlines()[0]
    assert "`step-nvidia-h200-2026-01-02.json`" in caption
    assert "NVIDIA H200" in caption and "2026-01-02" in caption
    assert "4 layers, d_model 2048" in caption
    # config, B·S, H/Hkv, D, packed, step ms ours, cuDNN, step / fwd / bwd speed-up (cuDNN / ours)
    assert _cells(text, "b2s8k-16-4-d128") == [
        "`b2s8k-16-4-d128`", "2·8192", "16/4", "128", "no", "40.00", "50.00", "1.25×", "1.10×",
        "1.50×", "yes"]
    assert _cells(text, "b2s8k-16-4-d128-packed") == [
        "`b2s8k-16-4-d128-packed`", "2·8192", "16/4", "128", "yes", "38.00", "-", "ours only",
        "ours only", "ours only", "-"]
    assert _cells(text, "b8s2k-32-8-d64")[1:] == ["-"] * 10
    assert ("- `b2s8k-16-4-d128-packed`: cudnn not timed: jax.nn.dot_product_attention has no "
            "segment ids: packed rows time jax-fa4 only") in text.splitlines()
    assert "- `b8s2k-32-8-d64` failed: RuntimeError: out of memory" in text.splitlines()
    # a first step that disagrees says so
    report = _step_report()
    report["configs"][0]["check"]["agree"] = False
    assert _cells(readme_tables.step_section(report, "x.json"), "b2s8k-16-4-d128")[-1] == "**no**"


def test_the_newest_complete_step_file_is_chosen(tmp_path):
    assert readme_tables.newest_step_result(tmp_path) is None
    (tmp_path / "step-b-2026-01-01.json").write_text(json.dumps(
        _step_report("2026-01-01T00:00:00+00:00")))
    (tmp_path / "step-a-2026-02-01.json").write_text(json.dumps(  # newer date, earlier name
        _step_report("2026-02-01T00:00:00+00:00")))
    (tmp_path / "step-c-2026-03-01.json").write_text(json.dumps(
        _step_report("2026-03-01T00:00:00+00:00", complete=False)))
    (tmp_path / "step-d-2026-03-01.json").write_text(json.dumps(
        _step_report("2026-03-01T00:00:00+00:00", settings={"smoke": True})))
    (tmp_path / "e-2026-03-01.json").write_text(json.dumps(  # not a step file by name
        _step_report("2026-03-01T00:00:00+00:00")))
    (tmp_path / "step-f-2026-03-01.json").write_text("not json")
    assert readme_tables.newest_step_result(tmp_path).name == "step-a-2026-02-01.json"


def test_without_a_step_file_the_section_says_where_it_comes_from(tmp_path):
    sections, path = readme_tables.step_sections(tmp_path)
    assert path is None and sections == {"step": readme_tables.NO_STEP_TEXT}
    assert "python -m jax_fa4.tools.step_bench" in sections["step"]
    figures = sections["step"].replace("jax_fa4", "")  # one line, and no figures in it
    assert "\n" not in figures and not any(c.isdigit() for c in figures)


def test_the_step_table_is_rendered_into_the_readme(tmp_path):
    results, readme, report = _copy(tmp_path)
    (results / "gpu-2026-01-01.json").write_text(json.dumps(report))
    step = results / "step-nvidia-h200-2026-01-02.json"
    step.write_text(json.dumps(_step_report()))
    # the sweep's own rule does not take a step file
    assert readme_tables.newest_result(results).name == "gpu-2026-01-01.json"
    args = ["--readme", str(readme), "--results", str(results)]
    assert readme_tables.main(args) == 0
    assert readme_tables.main([*args, "--check"]) == 0
    text = readme.read_text()
    body = text.split("<!-- step:begin -->\n", 1)[1].split("\n<!-- step:end -->", 1)[0]
    assert body == readme_tables.step_sections(results)[0]["step"]
    assert "| `b2s8k-16-4-d128` |" in body and readme_tables.NO_STEP_TEXT not in text
    step.unlink()
    assert readme_tables.main([*args, "--check"]) == 1
    assert readme_tables.main(args) == 0
    assert (f"<!-- step:begin -->{readme_tables.NO_STEP_TEXT}<!-- step:end -->"
            in readme.read_text())
