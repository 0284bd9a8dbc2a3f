"""The SASS instructions with the most warp-stall samples, from Nsight Compute's source page.

    ncu -i report.ncu-rep --page source --csv --print-source sass > report_sass.csv
    python benchmarks/probes/sass_stalls.py report_sass.csv [--top 30]

Prints each of the top instructions with its address, its share of all stall samples and
its text, so that a profile's per-instruction table travels back in a few lines (the CSV
itself is several MB). scripts/flash_profile.sh and scripts/decode_profile.sh append this
to their reports. Where the CSV has no stall-sampling column it says so and prints the
columns it found.
"""

from __future__ import annotations

import argparse
import csv
import sys
from typing import Iterable, TextIO

SAMPLES = "Warp Stall Sampling (All"  # "(All Samples)"; not-issued samples are a subset


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def top_stalls(lines: Iterable[str], top: int) -> list[str]:
    """Report lines: the `top` instructions by stall samples, or why there are none."""
    rows = list(csv.reader(lines))
    header_at = next((i for i, row in enumerate(rows) if any(SAMPLES in cell for cell in row)), None)
    if header_at is None:
        found = next((row for row in rows if len(row) > 2), [])
        return [f"sass_stalls: no '{SAMPLES}...' column; columns found: {found}"]
    header = rows[header_at]
    samples_at = next(i for i, cell in enumerate(header) if SAMPLES in cell)
    source_at = next((i for i, cell in enumerate(header) if cell.strip() == "Source"), None)
    address_at = next((i for i, cell in enumerate(header) if cell.strip() == "Address"), None)
    body = [row for row in rows[header_at + 1:] if len(row) > samples_at]
    total = sum(_number(row[samples_at]) for row in body)
    if total == 0:
        return ["sass_stalls: no stall samples in the table"]
    ranked = sorted(body, key=lambda row: -_number(row[samples_at]))[:top]
    out = [f"top {len(ranked)} of {len(body)} instructions by stall samples ({total:.0f} in all):"]
    for row in ranked:
        address = row[address_at] if address_at is not None else "?"
        source = row[source_at].strip() if source_at is not None else ""
        out.append(f"{100 * _number(row[samples_at]) / total:6.2f}%  {address:>8}  {source}")
    return out


def main(argv: list[str] | None = None, stdout: TextIO = sys.stdout) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    with open(args.csv, newline="") as f:
        for line in top_stalls(f, args.top):
            print(line, file=stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
