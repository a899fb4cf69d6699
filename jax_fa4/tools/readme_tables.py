"""Write README's speed tables from the newest default-sweep result file.

Usage::

    python -m jax_fa4.tools.readme_tables            # rewrite README.md's generated sections
    python -m jax_fa4.tools.readme_tables --check    # exit 1 when README.md differs from them

The result file: among ``benchmarks/results/*.json`` whose ``settings.shapes`` is ``default``
and which are ``complete`` (a run of ``python -m jax_fa4.tools.bench``, or two halves joined by
``python -m jax_fa4.tools.bench merge``), the one with the newest ``date`` (ties: the later name).
``--result`` names one instead. FA4's figures come from ``benchmarks/anchors.json``. Paths are
those of the checkout this module lies in (README.md and benchmarks/ at its root).

Generated sections, between markers (nothing in them is typed by hand):

* ``<!-- bench:begin -->`` ... ``<!-- bench:end -->``: the Speed section's tables (training
  shapes, decode, latency), their caption (method, taken from the file's own fields) and a summary.
* ``<!-- bench-status-fwd:begin -->`` ... and ``<!-- bench-status-bwd:begin -->`` ...: the
  status table's forward and backward figures (ratio range to cuDNN, rows at FA4's bar).
* ``<!-- step:begin -->`` ... ``<!-- step:end -->``: the whole training step's table, one row per
  config, from the newest complete ``benchmarks/results/step-*.json`` (a run of
  ``python -m jax_fa4.tools.step_bench`` on a GPU, not ``--smoke``; newest ``date``, ties: the
  later name) in the same results folder; one line saying where it comes from while there is none.

"FA4's bar" for a row is ``BAR_FACTOR`` × FA4's speed ratio to cuDNN in the anchors (FA4 in
PyTorch and cuDNN in JAX, measured by the peers on the same GPU model): a row is at the bar when
jax-fa4's ratio to cuDNN, measured in one process, is at least that.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the checkout: jax_fa4/tools/ is two below
RESULTS = ROOT / "benchmarks" / "results"
ANCHORS = ROOT / "benchmarks" / "anchors.json"
README = ROOT / "README.md"
#: The bar: at least FA4's ratio to cuDNN (issue #22; its goal is 5 % beyond).
BAR_FACTOR = 1.00
SECTIONS = ("bench", "bench-status-fwd", "bench-status-bwd", "bench-status-det",
            "bench-status-decode", "step")
#: The whole-step section while no step result file exists.
NO_STEP_TEXT = ("The whole-step table comes from `python -m jax_fa4.tools.step_bench` (on a GPU); "
                "no whole-step result file is in `benchmarks/results/` yet.")
Row = dict[str, Any]


# -- choosing the file -------------------------------------------------------------------------
def _date(report: dict[str, Any]) -> datetime.datetime:
    value = datetime.datetime.fromisoformat(report["date"])
    return value if value.tzinfo else value.replace(tzinfo=datetime.UTC)


def _newest(paths: Sequence[Path], wanted: Callable[[dict[str, Any]], bool]) -> Path | None:
    """Among the complete, dated JSON reports in ``paths`` that ``wanted`` takes, the one with the
    newest ``date`` (ties: the later name); None when there is none."""
    found: list[tuple[datetime.datetime, str, Path]] = []
    for path in paths:
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if (isinstance(report, dict) and report.get("complete") is True and "date" in report
                and wanted(report)):
            found.append((_date(report), path.name, path))
    return max(found)[2] if found else None


def newest_result(results: Path = RESULTS) -> Path:
    """The newest complete default-sweep file in ``results`` (forward and backward: a
    ``--fwd-only`` sweep has no backward rows for the tables)."""
    path = _newest(sorted(results.glob("*.json")), lambda report: (
        (report.get("settings") or {}).get("shapes") == "default"
        and not (report.get("settings") or {}).get("fwd_only") and "rows" in report))
    if path is None:
        raise SystemExit(f"no complete default-sweep result file in {results}")
    return path


def newest_step_result(results: Path = RESULTS) -> Path | None:
    """The newest complete whole-step file (``step-*.json``) in ``results`` that is not a
    ``--smoke`` run (tiny sizes, no cuDNN); None when there is none."""
    return _newest(sorted(results.glob("step-*.json")), lambda report: (
        not (report.get("settings") or {}).get("smoke")
        and isinstance(report.get("configs"), list)))


# -- rows --------------------------------------------------------------------------------------
def _key(r: Row) -> tuple:
    return (r["B"], r["Sq"], r["Sk"], r["H"], r["Hkv"], r["D"], r["Dv"], bool(r["causal"]))


def measures(row: Row) -> str:
    """The row's ``measures`` key; files from before it: decode (``Sq = 1``) is K/V bandwidth,
    a chained latency shape (``calls_per_dispatch > 1``) launch overhead."""
    if row.get("measures"):
        return row["measures"]
    if row["Sq"] == 1:
        return "K/V bandwidth"
    return "launch overhead" if (row.get("calls_per_dispatch") or 1) > 1 else "attention speed"


def kv_tbps(row: Row) -> float | None:
    """K and V bytes read per second of the forward (decode's figure)."""
    if row.get("fwd_ms") is None:
        return None
    item = {"bf16": 2, "fp16": 2}.get(row.get("dtype"), 2)
    return row["B"] * row["Sk"] * row["Hkv"] * (row["D"] + row["Dv"]) * item / row["fwd_ms"] / 1e9


def _by_impl(rows: Sequence[Row]) -> dict[tuple, dict[str, Row]]:
    shapes: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        if list(r.get("window") or [None, None]) != [None, None]:
            continue
        shapes.setdefault(_key(r), {})[r["impl"]] = r
    return shapes


def _val(row: Row | None, key: str) -> float | None:
    return None if row is None or row.get("fwd_ms") is None else row.get(key)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _f(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def _shape_cells(k: tuple) -> list[str]:
    B, Sq, Sk, H, Hkv, D, Dv, causal = k
    return [str(B), str(Sq) if Sq == Sk else f"{Sq}×{Sk}", str(H) if H == Hkv else f"{H}/{Hkv}",
            str(D) if D == Dv else f"{D}/{Dv}", "yes" if causal else "no"]


def markdown_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table's lines."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(cells) + " |" for cells in body)]


def _range(values: Sequence[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}×" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}×"


# -- the generated text ------------------------------------------------------------------------
def _caption(report: dict[str, Any], name: str, anchors: dict[str, Any]) -> str:
    settings = report.get("settings", {})
    versions = report.get("versions", {})
    parts = [f"The default sweep on one {report['gpu']}, {settings.get('dtype', 'bf16')}, "
             f"{report['date'][:10]} (`{name}`"]
    if report.get("merged_from"):
        parts.append(", " + " + ".join(f"`--shapes {m['shapes']}`" for m in report["merged_from"])
                     + " joined by `python -m jax_fa4.tools.bench merge`")
    impls = settings.get("impls", [])
    others = [name for impl, name in (("xla", "XLA"), ("reference", "reference")) if impl in impls]
    tail = ""
    if others:
        tail = f"; {' and '.join(others)} rows there too"
    elif impls:
        tail = f"; implementations {', '.join(impls)}"
    parts.append(f", {report.get('wall_s', 0):.0f} s of sweep{tail}).")
    stack = [f"jax {versions['jax']}"] if "jax" in versions else []
    if "cudnn" in versions:
        v = int(versions["cudnn"])
        stack.append(f"cuDNN {v // 10000}.{v // 100 % 100}.{v % 100}")
    dsl = versions.get("cute_dsl") or {}
    dsl_versions = sorted(dsl.get("kernel_cache_dsl_versions") or {})
    if dsl.get("nvidia-cutlass-dsl") or versions.get("nvidia-cutlass-dsl"):
        dsl_version = dsl.get("nvidia-cutlass-dsl") or versions["nvidia-cutlass-dsl"]
        stack.append(f"nvidia-cutlass-dsl {dsl_version}")
    elif dsl_versions:
        stack.append("kernels compiled with CuTe-DSL " + ", ".join(dsl_versions))
    else:
        stack.append("CuTe-DSL version not recorded")
    if report.get("driver"):
        stack.append(f"driver {report['driver']}")
    parts.append(" Stack: " + ", ".join(stack) + ".")
    timing = report.get("timing")
    if timing:
        parts.append(f" Timing: all implementations' programs of a shape timed together, "
                     f"{timing.get('rotation', 'rotated')}.")
    else:
        parts.append(" Timing: each implementation timed on its own, one after another (order "
                     "not rotated across implementations).")
    if report.get("bwd_method") == "fwdbwd_minus_training_fwd":
        bwd = "t(fwd+bwd) − t(training fwd, which keeps the residuals)"
    else:
        bwd = ("t(fwd+bwd) − t(inference fwd): that forward may skip the softmax statistics "
               "the training forward keeps, which flatters the backward figures")
    state = report.get("gpu_state") or []
    runs = [r for r in (state if isinstance(state, list) else [state])  # merged: one per run
            if isinstance(r, dict) and r.get("before") and r.get("after")]
    if runs:
        sm = lambda s: _f(s[0].get("clocks.sm"))  # noqa: E731
        clocks = "; ".join(f"{sm(r['before'])} before, {sm(r['after'])} after" for r in runs)
        parts.append(f" SM clock (MHz, max {_f(runs[0]['before'][0].get('clocks.max.sm'))}) "
                     f"{clocks} {'each run' if len(runs) > 1 else 'the run'}.")
    else:
        parts.append(" GPU clocks not recorded in this file.")
    parts.append(
        f" TFLOP/s with the anchors' FLOP convention (backward = 2.5 × forward FLOPs over {bwd}); "
        f"\"ratio\" is jax-fa4 / cuDNN in the same process; \"bar\" is {BAR_FACTOR} × FA4's ratio "
        f"to cuDNN from `benchmarks/anchors.json` (FA4 in PyTorch on the same GPU model, another "
        f"process, {anchors['date']}), the bar of issue #22.")
    return "".join(parts)


def generate(report: dict[str, Any], name: str, anchors: dict[str, Any],
             png: str | None = None) -> dict[str, str]:
    """The text of each generated section, by marker name."""
    shapes = _by_impl(report["rows"])
    anchor = {_key(a): a for a in anchors["rows"]}
    has_det = any("jax-fa4-det" in impls and impls["jax-fa4-det"].get("fwd_ms") is not None
                  for impls in shapes.values())
    train_rows, decode_rows, latency_rows = [], [], []
    fwd_ratios, bwd_ratios, det_ratios, decode_ratios = [], [], [], []
    fwd_at, bwd_at, barred = 0, 0, 0
    for k, impls in shapes.items():
        ours, cudnn = impls.get("jax-fa4"), impls.get("cudnn")
        kind = measures(ours or cudnn or next(iter(impls.values())))
        a = anchor.get(k, {})
        fa4, acu = a.get("fa4", {}), a.get("cudnn", {})
        if kind == "attention speed":
            fr = _ratio(_val(ours, "fwd_tflops"), _val(cudnn, "fwd_tflops"))
            br = _ratio(_val(ours, "bwd_tflops"), _val(cudnn, "bwd_tflops"))
            fbar = _ratio(fa4.get("fwd_tflops"), acu.get("fwd_tflops"))
            bbar = _ratio(fa4.get("bwd_tflops"), acu.get("bwd_tflops"))
            fbar = None if fbar is None else BAR_FACTOR * fbar
            bbar = None if bbar is None else BAR_FACTOR * bbar
            if fr is not None:
                fwd_ratios.append(fr)
            if br is not None:
                bwd_ratios.append(br)
            if fr is not None and fbar is not None:
                barred += 1
                fwd_at += fr >= fbar
                bwd_at += br is not None and bbar is not None and br >= bbar
            cells = _shape_cells(k) + [
                _f(_val(ours, "fwd_tflops")), _f(_val(cudnn, "fwd_tflops")), _f(fr, ".2f"),
                _f(fbar, ".2f"), _f(fa4.get("fwd_tflops")),
                _f(_val(ours, "bwd_tflops")), _f(_val(cudnn, "bwd_tflops")), _f(br, ".2f"),
                _f(bbar, ".2f"), _f(fa4.get("bwd_tflops"))]
            if has_det:
                det = _val(impls.get("jax-fa4-det"), "bwd_tflops")
                cells.append(_f(det))
                r = _ratio(det, _val(ours, "bwd_tflops"))
                if r is not None:
                    det_ratios.append(r)
            train_rows.append(cells)
        elif kind == "K/V bandwidth":
            ours_bw, cu_bw = kv_tbps(ours) if ours else None, kv_tbps(cudnn) if cudnn else None
            if _ratio(ours_bw, cu_bw) is not None:
                decode_ratios.append(_ratio(ours_bw, cu_bw))
            bar = _ratio(fa4.get("kv_read_TBps"), acu.get("kv_read_TBps"))
            decode_rows.append(_shape_cells(k)[:4] + [
                _f(ours_bw, ".2f"), _f(cu_bw, ".2f"), _f(_ratio(ours_bw, cu_bw), ".2f"),
                _f(None if bar is None else BAR_FACTOR * bar, ".2f"),
                _f(fa4.get("kv_read_TBps"), ".2f")])
        else:
            latency_rows.append(_shape_cells(k) + [
                _f(_val(ours, "fwd_us"), ".1f"), _f(_val(cudnn, "fwd_us"), ".1f"),
                _f(_val(ours, "bwd_us"), ".1f"), _f(_val(cudnn, "bwd_us"), ".1f")])
    header = ["B", "S", "H/Hkv", "D", "causal", "fwd jax-fa4", "fwd cuDNN", "ratio", "bar",
              "fwd FA4", "bwd jax-fa4", "bwd cuDNN", "ratio", "bar", "bwd FA4"]
    if has_det:
        header.append("bwd jax-fa4 deterministic")
    lines = [_caption(report, name, anchors), "",
             "Training shapes (attention speed, TFLOP/s; \"FA4\" is the anchors' figure from "
             "another process, for reference):", "", *markdown_table(header, train_rows)]
    if decode_rows:
        lines += ["", "Decode (Sq = 1): K/V bytes read per second (TB/s), the figure that "
                  "matters there:", "",
                  *markdown_table(["B", "Sq×Sk", "H/Hkv", "D", "jax-fa4", "cuDNN", "ratio", "bar",
                           "FA4"], decode_rows)]
    if latency_rows:
        lines += ["", "Latency shapes: µs per call, which time launch and dispatch overhead, not "
                  "attention speed (their TFLOP/s are in the file but mean nothing here):", "",
                  *markdown_table(["B", "S", "H/Hkv", "D", "causal", "fwd jax-fa4", "fwd cuDNN",
                           "bwd jax-fa4", "bwd cuDNN"], latency_rows)]
    fwd_sum = (f"{_range(fwd_ratios)} cuDNN, at FA4's bar on {fwd_at} of {barred}"
               if fwd_ratios else "not measured")
    bwd_sum = (f"{_range(bwd_ratios)} cuDNN, at FA4's bar on {bwd_at} of {barred}"
               if bwd_ratios else "not measured")
    fwd_status = (f"{fwd_sum.replace(' cuDNN,', ' cuDNN on the training shapes (see Speed),')}"
                  if fwd_ratios else fwd_sum)
    bwd_status = bwd_sum
    lines += ["", f"In this file, on the training shapes: forward {fwd_sum}; backward {bwd_sum}."]
    if png:
        lines += ["", f"![TFLOP/s against sequence length]({png})"]
    det_status = (f"{_range(det_ratios)} the default kernel's backward speed"
                  if det_ratios else "its speed not measured in this file")
    decode_status = (f"{_range(decode_ratios)} cuDNN's K/V bandwidth on the sweep's "
                     f"{len(decode_ratios)} decode shapes" if decode_ratios
                     else "decode speed not measured in this file")
    return {"bench": "\n".join(lines), "bench-status-fwd": fwd_status,
            "bench-status-decode": decode_status,
            "bench-status-bwd": bwd_status, "bench-status-det": det_status}


def _one_line(text: str, limit: int = 300) -> str:
    """``text``'s first line, cut to ``limit`` characters, safe in a Markdown table cell."""
    line = (text.strip().splitlines() or [""])[0].replace("|", "\\|")
    return line if len(line) <= limit else line[:limit - 1] + "…"


def _speedup(base: Row, ours: Row, key: str) -> str:
    """The baseline's time over ours for ``key`` ("-" when either is missing)."""
    ratio = _ratio(base.get(key), ours.get(key))
    return "-" if ratio is None else f"{ratio:.2f}×"


def step_section(report: dict[str, Any], name: str) -> str:
    """The whole-step section's text from a ``step_bench`` result: a caption and one table row
    per config (speed-ups are cuDNN's time / ours; a config cuDNN did not run shows ours only)."""
    settings = report.get("settings", {})
    sizes = {(e["layers"], e["d_model"]) for e in report["configs"]
             if "layers" in e and "d_model" in e}
    size = ""
    if len(sizes) == 1:
        layers, d_model = sizes.pop()
        size = f"{layers} layers, d_model {d_model}, "
    lines = [
        f"The whole training step on one {report['gpu']}, {report['date'][:10]} (`{name}`, "
        f"{report.get('wall_s', 0):.0f} s of run): {size}"
        f"{report.get('model', 'a small decoder')}. "
        f"\"step ms\" is the median round's time per step (rounds of {settings.get('steps', '?')} "
        f"back-to-back steps, the implementations' rounds rotated); \"speed-up\" is cuDNN's time "
        f"/ jax-fa4's (`jax.nn.dot_product_attention(implementation=\"cudnn\")` in the same "
        f"model, same process); \"attention alone\" times the attention call at the config's "
        f"shape (training forward; backward = forward+backward − training forward); \"agrees\": "
        f"the first step's loss and QKV gradient norms match cuDNN's.", ""]
    header = ["config", "B·S", "H/Hkv", "D", "packed", "step ms jax-fa4", "step ms cuDNN",
              "step speed-up", "attention alone fwd speed-up", "attention alone bwd speed-up",
              "agrees"]
    body, notes = [], []
    for e in report["configs"]:
        impls = e.get("impls") or {}
        ours, base = impls.get("jax-fa4") or {}, impls.get("cudnn") or {}
        model = ([f"{e['B']}·{e['S']}", f"{e['H']}/{e['Hkv']}", str(e["D"]),
                  "yes" if e.get("packed") else "no"]
                 if all(k in e for k in ("B", "S", "H", "Hkv", "D")) else ["-"] * 4)
        if "step_ms" not in ours:
            ratios = ["-"] * 3
        elif "step_ms" not in base:
            ratios = ["ours only"] * 3
        else:
            ratios = [_speedup(base, ours, k)
                      for k in ("step_ms", "attn_train_fwd_ms", "attn_bwd_ms")]
        agree = (e.get("check") or {}).get("agree") if e.get("baseline") == "cudnn" else None
        body.append([f"`{e['config']}`", *model, _f(ours.get("step_ms"), ".2f"),
                     _f(base.get("step_ms"), ".2f"), *ratios,
                     "-" if agree is None else ("yes" if agree else "**no**")])
        if e.get("error"):
            notes.append(f"`{e['config']}` failed: {_one_line(e['error'])}")
        for impl, why in (e.get("skipped") or {}).items():
            if impl in ("jax-fa4", "cudnn"):
                notes.append(f"`{e['config']}`: {impl} not timed: {_one_line(why)}")
    lines += markdown_table(header, body)
    if notes:
        lines += ["", *(f"- {n}" for n in notes)]
    return "\n".join(lines)


def step_sections(results: Path = RESULTS) -> tuple[dict[str, str], Path | None]:
    """The whole-step section from the newest step file in ``results`` (the one-line
    ``NO_STEP_TEXT`` when there is none), and that file."""
    path = newest_step_result(results)
    if path is None:
        return {"step": NO_STEP_TEXT}, None
    try:
        name = path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        name = path.name
    return {"step": step_section(json.loads(path.read_text()), name)}, path


# -- README ------------------------------------------------------------------------------------
def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- {re.escape(name)}:begin -->)(.*?)(<!-- {re.escape(name)}:end -->)",
                      re.S)


def render(readme: str, sections: dict[str, str]) -> str:
    """``readme`` with each marked section replaced (a block section on lines of its own)."""
    for name, text in sections.items():
        pattern = _pattern(name)
        found = pattern.findall(readme)
        if len(found) != 1:
            raise SystemExit(f"README needs exactly one <!-- {name}:begin --> ... "
                             f"<!-- {name}:end --> pair, found {len(found)}")
        body = f"\n{text}\n" if "\n" in text else text
        readme = pattern.sub(lambda m: m.group(1) + body + m.group(3), readme)
    return readme


def build(readme_path: Path = README, result: Path | None = None, results: Path = RESULTS,
          anchors_path: Path = ANCHORS) -> tuple[str, str, Path]:
    """(current README, generated README, result file used)."""
    result = result or newest_result(results)
    report = json.loads(result.read_text())
    anchors = json.loads(anchors_path.read_text())
    try:
        name = result.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        name = result.name
    png_path = result.with_suffix(".png")
    png = None
    if png_path.exists():
        try:
            png = png_path.resolve().relative_to(readme_path.resolve().parent).as_posix()
        except ValueError:
            png = None
    current = readme_path.read_text()
    sections = generate(report, name, anchors, png) | step_sections(results)[0]
    return current, render(current, sections), result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true",
                   help="exit 1 (with a diff) when README differs from what would be written")
    p.add_argument("--readme", type=Path, default=README)
    p.add_argument("--result", type=Path, default=None, help="this result file, not the newest")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--anchors", type=Path, default=ANCHORS)
    args = p.parse_args(argv)
    current, new, result = build(args.readme, args.result, args.results, args.anchors)
    if args.check:
        if current != new:
            sys.stdout.writelines(difflib.unified_diff(
                current.splitlines(True), new.splitlines(True), str(args.readme), "generated"))
            print(f"{args.readme} is not what {result.name} generates: run "
                  f"python -m jax_fa4.tools.readme_tables", file=sys.stderr)
            return 1
        return 0
    if current != new:
        args.readme.write_text(new)
    step = newest_step_result(args.results)
    print(f"{args.readme}: speed tables from {result.name}, whole step from "
          f"{step.name if step else 'no step file'}"
          + ("" if current != new else " (unchanged)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
