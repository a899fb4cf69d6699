"""The benchmark's report side: the printed table and the progress line of a result row, the
lines that set jax-fa4's ratio to cuDNN beside the best peer's (:func:`bar_lines`), the plot of
TFLOP/s against sequence length, and ``python -m jax_fa4.tools.bench merge``, which joins result
files that split one sweep's shapes into one file.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jax_fa4.tools.bench_shapes import PRESETS, preset_shapes

#: One row of a result file (``jax_fa4.tools.bench.ROW_KEYS`` lists its keys).
Row = dict[str, Any]


def shape_label(r: dict[str, Any]) -> str:
    """Compact shape text of a row (or of ``dataclasses.asdict(shape)``)."""
    heads = f"{r['H']}" if r["H"] == r["Hkv"] else f"{r['H']}/{r['Hkv']}"
    dims = f"{r['D']}" if r["D"] == r["Dv"] else f"{r['D']}/{r['Dv']}"
    seq = f"{r['Sq']}" if r["Sq"] == r["Sk"] else f"{r['Sq']}x{r['Sk']}"
    left, right = r["window"]
    parts = [f"B{r['B']}", f"S{seq}", f"H{heads}", f"D{dims}"]
    parts += ["causal"] if r["causal"] else []
    parts += [] if (left, right) == (None, None) else [f"win{left},{right}"]
    return " ".join(parts)


def _fmt_time(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms * 1e3:.1f}us" if ms < 1 else f"{ms:.3f}ms"


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _rate(row: Row, key: str) -> str:
    """A row's TFLOP/s as printed: only where the row measures attention speed (a launch-
    overhead row's TFLOP/s is not a speed, a decode row's figure is its TB/s)."""
    if row["measures"] == "attention speed":
        return _fmt(row[key], ".3g")
    if row[key] is None:
        return "-"
    if row["measures"] == "K/V bandwidth":
        return f"{row['fwd_tbps']:.3g} TB/s" if key == "fwd_tflops" else "(decode)"
    return "(latency)"


def row_line(row: Row) -> str:
    head = f"{row['impl']:>11} {shape_label(row):<34}"
    if row["skipped"] and row["fwd_ms"] is None:
        return f"{head} skipped: {row['skipped']}"
    line = (f"{head} fwd {_fmt_time(row['fwd_ms'])} {_rate(row, 'fwd_tflops')}  "
            f"bwd {_fmt_time(row['bwd_ms'])} {_rate(row, 'bwd_tflops')}  [{row['measures']}]")
    return line + (f"  ({row['skipped']})" if row["skipped"] else "")


def checks_text(row: Row) -> str:
    """A row's checks as the table prints them: ``ok`` (finite, and passing FA4's rule where it
    was checked), else what is not finite (``NaN dq,dk``) and what fails the rule
    (``rule dq``); ``-`` where nothing ran."""
    found, rule = row.get("finite"), row.get("fa4_rule") or {}
    if not found:
        return "-"
    bad = [n for n, ok in found.items() if not ok]
    failed = [n for n in found if (rule.get(n) or {}).get("passed") is False and n not in bad]
    parts = ([f"NaN {','.join(bad)}"] if bad else []) + (
        [f"rule {','.join(failed)}"] if failed else [])
    return " ".join(parts) or ("ok" if rule.get("passed") else "finite")


def best_peer_text(row: Row) -> str:
    """``IMPL RATIO`` per direction, ``fwd / bwd`` (``-`` where there is none)."""
    parts = []
    for part in ("fwd", "bwd"):
        impl, ratio = row.get(f"best_peer_{part}"), row.get(f"best_peer_{part}_ratio")
        parts.append("-" if impl is None else f"{impl} {ratio:.2f}")
    return "-" if parts == ["-", "-"] else " / ".join(parts)


def print_table(rows: list[Row]) -> None:
    """A plain-text table of every row (times in µs below 1 ms). TFLOP/s are printed for rows
    that measure attention speed only; decode rows show TB/s, latency rows their times. Where a
    peer ran: each row's checks and, on jax-fa4's rows, the shape's best peer (ratio to cuDNN)."""
    peers = any(r.get("best_peer_fwd") or r.get("fa4_rule") for r in rows)
    header = ("shape", "impl", "measures", "fwd", "fwd TF/s", "bwd", "bwd TF/s", "x cuDNN f/b",
              "err", "peak MiB") + (("checks", "best peer f/b") if peers else ()) + ("skipped",)
    lines = [header]
    for r in rows:
        impl = r["impl"] + (f" ({r['resolved_impl']})" if r["resolved_impl"] else "")
        ratio = ("-" if r["fwd_ratio_vs_cudnn"] is None else
                 f"{r['fwd_ratio_vs_cudnn']:.2f}/{_fmt(r['bwd_ratio_vs_cudnn'], '.2f')}")
        peak = None if r["peak_mem_bytes"] is None else r["peak_mem_bytes"] / 2**20
        extra = (checks_text(r), best_peer_text(r) if r["impl"].startswith("jax-fa4") else "")
        lines.append((shape_label(r), impl, r["measures"], _fmt_time(r["fwd_ms"]),
                      _rate(r, "fwd_tflops"), _fmt_time(r["bwd_ms"]), _rate(r, "bwd_tflops"),
                      ratio, _fmt(r["fwd_rel_err"], ".1e"), _fmt(peak, ".0f"))
                     + (extra if peers else ()) + ((r["skipped"] or "")[:70],))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for n, line in enumerate(lines):
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def bar_lines(rows: list[Row]) -> list[str]:
    """Per shape with a best peer: jax-fa4's ratios to cuDNN against the best peer's, and
    whether ours meets that bar (ours >= the best peer's ratio)."""
    lines = []
    for r in rows:
        if r["impl"] != "jax-fa4" or (r.get("best_peer_fwd") is None
                                      and r.get("best_peer_bwd") is None):
            continue
        parts = []
        for part in ("fwd", "bwd"):
            ours, peer = r[f"{part}_ratio_vs_cudnn"], r.get(f"best_peer_{part}_ratio")
            if ours is None or peer is None:
                continue
            verdict = "meets" if ours >= peer else "below"
            parts.append(f"{part} {ours:.2f} vs {r[f'best_peer_{part}']} {peer:.2f} ({verdict})")
        if parts:
            lines.append(f"{shape_label(r)}: jax-fa4 x cuDNN " + "; ".join(parts))
    return lines


def print_bar(rows: list[Row]) -> None:
    """:func:`bar_lines` under a heading, when there are any."""
    lines = bar_lines(rows)
    if lines:
        print("\nthe best peer's ratio to cuDNN, the bar (finite results passing FA4's rule):")
        for line in lines:
            print("  " + line)


def plot(rows: list[Row], path: Path, title: str) -> None:
    """TFLOP/s against key length per implementation: forward and backward panels, for the rows
    that measure attention speed only (decode and latency rows are in the table, not here).

    Colour: implementation; marker: head dims; hollow and dashed: causal. A line joins rows that
    differ only in batch and length.
    """
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    colors = {"jax-fa4": "tab:red", "jax-fa4-det": "tab:orange", "cudnn": "tab:green",
              "xla": "tab:blue", "reference": "tab:gray", "fa3-jax": "tab:purple"}
    measured = [r for r in rows
                if r["fwd_tflops"] is not None and r.get("measures") == "attention speed"]
    head_dims = sorted({(r["D"], r["Dv"]) for r in measured})
    markers = "os^DvPX*"
    marker_of = {hd: markers[i % len(markers)] for i, hd in enumerate(head_dims)}
    fig = Figure(figsize=(13, 5.5), layout="constrained")
    axes = fig.subplots(1, 2, sharex=True)
    for ax, key, name in ((axes[0], "fwd_tflops", "forward"), (axes[1], "bwd_tflops", "backward")):
        lines: dict[tuple, list[Row]] = {}
        for r in measured:
            if r[key] is not None:
                line = (r["impl"], r["H"], r["Hkv"], r["D"], r["Dv"], r["causal"],
                        tuple(r["window"]), r["Sq"] == 1)
                lines.setdefault(line, []).append(r)
        for members in lines.values():
            members.sort(key=lambda r: r["Sk"])
            first = members[0]
            color = colors.get(first["impl"], "black")
            ax.plot([r["Sk"] for r in members], [r[key] for r in members], color=color,
                    linestyle="--" if first["causal"] else "-",
                    marker=marker_of[(first["D"], first["Dv"])], markersize=7,
                    markerfacecolor="none" if first["causal"] else color)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length Sk")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        if not lines:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center")
    handles = [Line2D([], [], color=c, label=i) for i, c in colors.items()
               if any(r["impl"] == i for r in measured)]
    handles += [Line2D([], [], color="black", linestyle="none", marker=marker_of[hd],
                       label=f"D={hd[0]}" + (f"/Dv={hd[1]}" if hd[0] != hd[1] else ""))
                for hd in head_dims]
    handles.append(Line2D([], [], color="black", marker="o", markerfacecolor="none",
                          linestyle="--", label="causal"))
    axes[1].legend(handles=handles, loc="best", fontsize=8)
    fig.suptitle(f"{title} (attention-speed rows; decode and latency rows: see the table)")
    fig.savefig(path, dpi=110)


def slug(text: str) -> str:
    """A GPU name as it goes into a result file's name (``NVIDIA H200`` -> ``nvidia-h200``)."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def result_path(out: Path | None, device_kind: str, prefix: str = "") -> Path:
    """``out``, or ``benchmarks/results/<prefix><gpu>-<today>.json``; its folder created."""
    today = datetime.date.today().isoformat()
    path = out or Path("benchmarks/results") / f"{prefix}{slug(device_kind)}-{today}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def run_command(module: str, argv: Sequence[str] | None) -> list[str]:
    """The command a result file records: this process's, or ``python -m module argv`` when
    ``main`` was called with arguments."""
    return list(sys.orig_argv) if argv is None else ["python", "-m", module, *argv]


# -- merging result files ----------------------------------------------------------------------
#: Settings two result files must share to be merged (the shapes are what they split).
MERGE_SAME_SETTINGS = ("dtype", "impls", "repeats", "target_ms", "fwd_only", "rotation_bytes",
                       "backward_flop_factor")


def _shape_key(row: Row) -> tuple:
    return (row["B"], row["Sq"], row["Sk"], row["H"], row["Hkv"], row["D"], row["Dv"],
            row["causal"], tuple(row["window"]))


def _merge_view(key: str, value: Any) -> Any:
    """What must agree between merged runs: the versions, with the CuTe-DSL entry reduced to its
    versions (the kernel cache's entry counts may differ between two machines)."""
    if key != "versions" or not isinstance(value, dict) or "cute_dsl" not in value:
        return value
    dsl = value["cute_dsl"] or {}
    return {**value, "cute_dsl": (dsl.get("nvidia-cutlass-dsl"),
                                  sorted(dsl.get("kernel_cache_dsl_versions") or {}))}


def merge_reports(reports: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """One result file from several runs of the same stack that split a sweep's shapes.

    The runs must agree on GPU, driver, versions, the timing settings and the method fields; a
    shape may appear in one run only; every run must be complete. The merged ``settings.shapes``
    is the preset whose shapes the parts cover exactly (e.g. ``anchors-main`` +
    ``anchors-more,latency`` give ``default``), else the parts' specs joined by ``+``.
    """
    if len(reports) < 2:
        raise ValueError("merge needs two or more result files")
    first = reports[0]
    for name, rep in zip(names, reports):
        if not rep.get("complete"):
            raise ValueError(f"{name} is not complete (a stopped run)")
        for key in ("gpu", "platform", "driver", "versions", "bwd_method"):
            if _merge_view(key, rep.get(key)) != _merge_view(key, first.get(key)):
                raise ValueError(f"{name} differs from {names[0]} in {key!r}: "
                                 f"{rep.get(key)!r} vs {first.get(key)!r}")
        for key in MERGE_SAME_SETTINGS:
            if rep["settings"].get(key) != first["settings"].get(key):
                raise ValueError(f"{name} differs from {names[0]} in settings.{key}")
    seen: dict[tuple, str] = {}
    for name, rep in zip(names, reports):
        for key in {_shape_key(r) for r in rep["rows"]}:
            if key in seen:
                raise ValueError(f"shape {key} is in both {seen[key]} and {name}")
            seen[key] = name
    specs = [rep["settings"]["shapes"] for rep in reports]
    covered = {_shape_key(r) for rep in reports for r in rep["rows"]}
    merged_spec = "+".join(specs)
    for preset, members in PRESETS.items():
        keys = {_shape_key(dataclasses.asdict(s) | {"window": list(s.window)}) for s in members}
        if "custom" not in specs and keys == covered:
            merged_spec = preset
            break
    order = {_shape_key(dataclasses.asdict(s) | {"window": list(s.window)}): i
             for i, s in enumerate(preset_shapes(merged_spec))} if merged_spec in PRESETS else {}
    rows = [r for rep in reports for r in rep["rows"]]
    rows.sort(key=lambda r: order.get(_shape_key(r), len(order)))  # stable: impl order kept
    merged = {key: first[key] for key in first if key not in ("rows", "timing", "gpu_state",
                                                              "command", "date", "wall_s")}
    merged.update(
        settings={**first["settings"], "shapes": merged_spec},
        date=max(rep["date"] for rep in reports),
        wall_s=round(sum(rep.get("wall_s") or 0 for rep in reports), 1),
        command=[rep.get("command") for rep in reports],
        gpu_state=[rep.get("gpu_state") for rep in reports],
        timing={**(first.get("timing") or {}),
                "shapes": [s for rep in reports for s in (rep.get("timing") or {}).get(
                    "shapes", [])]},
        merged_from=[{"file": name, "shapes": rep["settings"]["shapes"], "date": rep["date"],
                      "wall_s": rep.get("wall_s")} for name, rep in zip(names, reports)],
        complete=True,
        rows=rows,
    )
    return merged


def merge_main(argv: Sequence[str]) -> int:
    """``python -m jax_fa4.tools.bench merge A.json B.json [...] --out C.json``."""
    p = argparse.ArgumentParser(prog="python -m jax_fa4.tools.bench merge",
                                description=merge_reports.__doc__.split("\n\n")[0])
    p.add_argument("files", type=Path, nargs="+")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    reports = [json.loads(f.read_text()) for f in args.files]
    try:
        merged = merge_reports(reports, [f.name for f in args.files])
    except ValueError as err:
        p.error(str(err))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(merged, indent=1) + "\n")
    plot(merged["rows"], args.out.with_suffix(".png"),
         f"{merged['gpu']}, {merged['settings']['dtype']}, {merged['date'][:10]}")
    print(f"wrote {args.out}: {len(merged['rows'])} rows, shapes {merged['settings']['shapes']}")
    return 0
