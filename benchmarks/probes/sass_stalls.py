"""The SASS instructions with the most warp-stall samples, from Nsight Compute's source page.

    ncu -i report.ncu-rep --page source --csv --print-source sass > report_sass.csv
    python benchmarks/probes/sass_stalls.py report_sass.csv [--top 30]

Prints each of the top instructions with its address, its share of all stall samples and
its text, so that a profile's per-instruction table travels back in a few lines (the CSV
itself is several MB); under each, the nearest earlier instruction (in address order)
that writes a register it reads: what a stalled instruction most likely waits for (a
global load, a product), approximate across branches. scripts/flash_profile.sh and scripts/decode_profile.sh append this
to their reports. Where the CSV has no stall-sampling column it says so and prints the
columns it found.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from typing import Iterable, TextIO

SAMPLES = "Warp Stall Sampling (All"  # "(All Samples)"; not-issued samples are a subset


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


# Opcodes whose operands are all read (no destination register).
_NO_DESTINATION = ("ST", "RED", "BAR", "BRA", "EXIT", "SYNCS.ARRIVE", "WARPGROUP", "NOP", "RET")
_REGISTER = re.compile(r"\b(U?R)(\d+)(\.64)?\b")
_LOOKBACK = 256  # instructions searched for the writer of a register


def _registers(operand: str, width: int = 1) -> set[str]:
    """The registers an operand names (R2.64: R2 and R3; `width` registers from a
    destination of a .64 or .128 opcode); RZ and URZ are none."""
    found = set()
    for kind, number, pair in _REGISTER.findall(operand):
        count = 2 if pair else width
        found.update(f"{kind}{int(number) + k}" for k in range(count))
    return found


def reads_and_writes(text: str) -> tuple[set[str], set[str]]:
    """(registers read, registers written) of one SASS instruction: the first operand is
    the destination except for stores, barriers, branches and the like."""
    text = re.sub(r"^@!?U?P\w+\s+", "", text.strip()).rstrip(" ;")
    opcode, _, rest = text.partition(" ")
    operands = [o.strip() for o in re.split(r",\s*(?![^\[]*\])", rest) if o.strip()]
    if not operands or opcode.startswith(_NO_DESTINATION):
        return set().union(*(_registers(o) for o in operands)) if operands else set(), set()
    parts = opcode.split(".")
    width = 4 if "128" in parts else 2 if "64" in parts or "WIDE" in parts else 1
    product = re.match(r"HGMMA\.64x(\d+)x", opcode)
    if product:  # a warpgroup product's accumulators: N / 2 float32 registers a thread
        width = int(product.group(1)) // (2 if "F32" in parts else 4)
    return set().union(*(_registers(o) for o in operands[1:])), _registers(operands[0], width)


def _writer(body: list[list[str]], at: int, source_at: int) -> list[str] | None:
    """The nearest row before `at` that writes a register that row `at` reads."""
    reads, _ = reads_and_writes(body[at][source_at])
    for row in reversed(body[max(0, at - _LOOKBACK):at]):
        if reads & reads_and_writes(row[source_at])[1]:
            return row
    return None


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
    ranked = sorted(range(len(body)), key=lambda i: -_number(body[i][samples_at]))[:top]
    out = [f"top {len(ranked)} of {len(body)} instructions by stall samples ({total:.0f} in all):"]

    def address(row):
        return row[address_at] if address_at is not None else "?"

    for i in ranked:
        row = body[i]
        source = row[source_at].strip() if source_at is not None else ""
        out.append(f"{100 * _number(row[samples_at]) / total:6.2f}%  {address(row):>8}  {source}")
        writer = _writer(body, i, source_at) if source_at is not None else None
        if writer is not None:
            out.append(f"{'':>7}   <- {address(writer):>8}  {writer[source_at].strip()}")
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
