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
