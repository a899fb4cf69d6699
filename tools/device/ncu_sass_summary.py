"""Where a kernel's warps stall, per SASS instruction, from Nsight Compute's source page.

    python tools/device/ncu_sass_summary.py ncu-NAME-sass.csv.xz [--top 40]

Reads the export of tools/device/ncu_kernel.sh (``ncu --page source --csv --print-source sass``)
and prints the instructions with the most warp-state samples, each with its stall-reason columns,
plus the samples summed per opcode. The column names come from the file (they vary with the
Nsight Compute version), so this prints what is there rather than assuming a fixed set.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import lzma


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_rows(path: str) -> tuple[list[str], list[dict[str, str]]]:
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"')
                 or line.startswith('"#"') or '"Source"' in line)
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    return list(reader.fieldnames or []), list(reader)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    fields, rows = read_rows(args.path)
    total_col = next((c for c in fields if "Sampling (All" in c), None)
    if total_col is None:
        raise SystemExit(f"no warp-sampling column; columns are: {fields}")
    stall_cols = [c for c in fields if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(_number(r[total_col]) for r in rows) or 1.0
    print(f"{len(rows)} instructions, {total:.0f} samples ({total_col})")
    per_op: dict[str, float] = collections.Counter()
    for r in rows:
        op = r.get("Source", "").split()[0:1]
        op = (op[0] if op and not op[0].startswith("@")
              else " ".join(r.get("Source", "").split()[:2]))
        per_op[op.split(".")[0]] += _number(r[total_col])
    print("\nsamples per opcode:")
    for op, n in sorted(per_op.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {100 * n / total:5.1f} %  {op}")
    print(f"\ntop {args.top} instructions (address, % of samples, source, main reasons):")
    for r in sorted(rows, key=lambda r: -_number(r[total_col]))[:args.top]:
        reasons = sorted(((c, _number(r[c])) for c in stall_cols), key=lambda kv: -kv[1])
        why = ", ".join(f"{c.replace('stall_', '')} {v:.0f}" for c, v in reasons[:3] if v > 0)
        print(f"  {r.get('Address', '?'):>8} {100 * _number(r[total_col]) / total:5.1f} %  "
              f"{r.get('Source', '')[:60]:60}  {why}")


if __name__ == "__main__":
    main()
