"""Side-by-side table of benchmarks/flash.py result files: an A/B comparison.

Each file is one run (e.g. the tree as it is, then scripts/flash_ab.sh's ab_1.json,
ab_2.json: the tree without its newest changes). For every case and pass the table gives
each run's TF/s of one impl (default flash), its speed relative to the first run, and,
where the runs also timed a reference impl (default fa3), the impl's speed as a fraction of
the reference's in the same run: a ratio that a run-to-run change of the machine moves less.

    python benchmarks/flash_compare.py with.json ab_1.json ab_2.json --names new,mid,old
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load_tflops(path: Path) -> dict[tuple[str, str], dict[str, float]]:
    """{(case name, pass): {impl: TF/s}} of one flash.py result file."""
    rows = json.loads(Path(path).read_text())["rows"]
    table: dict[tuple[str, str], dict[str, float]] = {}
    for row in rows:
        if row.get("tflops") is not None:
            table.setdefault((row["name"], row["pass"]), {})[row["impl"]] = row["tflops"]
    return table


def compare(runs: list[dict], impl: str = "flash", reference: str = "fa3") -> list[dict]:
    """One row per (case, pass) that the first run timed for impl, in its order:
    {"case", "pass", "tflops": [per run, None where missing], "vs_first": [TF/s / first's],
    "of_reference": [TF/s / reference's TF/s in the same run]}."""
    rows = []
    for key, first in runs[0].items():
        if impl not in first:
            continue
        tflops = [run.get(key, {}).get(impl) for run in runs]
        references = [run.get(key, {}).get(reference) for run in runs]
        rows.append({
            "case": key[0], "pass": key[1], "tflops": tflops,
            "vs_first": [None if t is None else t / first[impl] for t in tflops],
            "of_reference": [None if t is None or r is None else t / r
                             for t, r in zip(tflops, references)],
        })
    return rows


def format_table(rows: list[dict], names: list[str], reference: str) -> str:
    def cell(value, spec):  # spec: "<width>.<digits>f"
        return format(value, spec) if value is not None else "-".rjust(int(spec.split(".")[0]))

    header = f"{'case':30s} {'pass':8s}" + "".join(
        f" {name + ' TF/s':>14s} {'x first':>8s} {'/' + reference:>8s}" for name in names)
    lines = [header]
    for row in rows:
        line = f"{row['case']:30s} {row['pass']:8s}"
        for t, v, r in zip(row["tflops"], row["vs_first"], row["of_reference"]):
            line += f" {cell(t, '14.1f')} {cell(v, '8.3f')} {cell(r, '8.3f')}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="flash.py result files, the first the base")
    parser.add_argument("--names", default="", help="comma-separated run names (default: file names)")
    parser.add_argument("--impl", default="flash")
    parser.add_argument("--reference", default="fa3")
    args = parser.parse_args(argv)
    names = args.names.split(",") if args.names else [f.stem for f in args.files]
    if len(names) != len(args.files):
        parser.error(f"--names gives {len(names)} names for {len(args.files)} files; give one per file")
    runs = [load_tflops(f) for f in args.files]
    rows = compare(runs, args.impl, args.reference)
    if not rows:
        print(f"{args.files[0]} has no rows of impl {args.impl!r}", file=sys.stderr)
        return 1
    print(format_table(rows, names, args.reference))
    return 0


if __name__ == "__main__":
    sys.exit(main())
