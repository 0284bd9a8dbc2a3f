"""Streaming kernels that move a small-seq kernel's bytes and nothing else: the HBM rate
the small-seq kernels are held against, besides the 4.8 TB/s peak of the byte floor.

The byte floor of benchmarks/small_seq.py divides bytes by the H200's peak, which no kernel
reaches, and a kernel that writes as much as it reads reaches less than one that mostly
reads. So for each key count N this times streams over flat blocks of one q-row block each
(b * h * d bf16 elements), as many as the small-seq kernel reads and writes:
  forward:  reads q, k_0..k_{N-1}, v_0..v_{N-1} (1 + 2N blocks), writes o (1);
  backward: reads q, o, dO, k, v (3 + 2N), writes dq, dk, dv (1 + 2N).
Each input element is read once and each output element written once, by
  "xla_stream": XLA's plainest elementwise fusions (the `kernels` column counts the fusions
      XLA compiled: the forward's is one, as the attention's; the backward's one per
      written block, each a 1:1 or n:1 stream, run back to back);
  "cuda_stream": one CUDA kernel (benchmarks/probes/hbm_stream.cu, built here with nvcc) that
      issues all reads of an index before its writes, with streaming cache hints; the
      fastest of 2, 4 and 8 blocks of 256 threads per SM.
A fwd+bwd call's stream time is the sum of the two. With --small-seq the table also gives
the small-seq kernels' times (impl small_seq_kernel of that result file) against them: wall
time against the XLA stream's, device time (that file's --profile traces) against the CUDA
stream's.

    python benchmarks/probes/hbm_stream.py --out benchmarks/results/hbm_stream.json \\
        --small-seq benchmarks/results/small_seq.json
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

import _benchmarks_on_path  # noqa: F401  (benchmarks/ on sys.path)
from common import (H200_HBM_BYTES_PER_S, median_ms, parse_args, random_normal, timing,
                    write_results)

HEADS = 16
S_KV = (2, 4, 6, 8, 12, 16)
IMPLS = ("xla_stream", "cuda_stream")
CUDA_SOURCE = Path(__file__).with_name("hbm_stream.cu")


def block_counts(s_kv: int, pass_name: str) -> tuple[int, int]:
    """(blocks read, blocks written) of one small-seq kernel; a block is b * h * d elements."""
    if pass_name == "fwd":
        return 1 + 2 * s_kv, 1
    return 3 + 2 * s_kv, 1 + 2 * s_kv


def xla_stream(reads: int, writes: int):
    """A jitted fn of `reads` arrays [n] (reads >= writes) returning `writes` arrays [n]:
    output 0 the sum of inputs 0 and writes..reads-1, output w input w doubled. Each input
    element is read once and each output element written once, by plain streaming fusions.
    (Outputs that all read every input make XLA materialise their sum first, and one
    [writes, n] concatenate of them streams at a fifth of the rate from 13 operands on.)"""
    def fn(*inputs):
        return (sum(inputs[writes:], inputs[0]),) + tuple(x * 2 for x in inputs[1:writes])
    return jax.jit(fn)


def fusions(compiled) -> int:
    """The number of fusion kernels in a compiled function's entry computation."""
    text = compiled.as_text()
    entry = text[text.index("ENTRY"):]
    return len(re.findall(r"\bfusion\(", entry))


def time_xla_stream(block_elements: int, reads: int, writes: int,
                    timed_as: dict) -> tuple[float, dict]:
    keys = jax.random.split(jax.random.key(reads * 100 + writes), reads)
    inputs = [random_normal(key, (block_elements,), jnp.bfloat16) for key in keys]
    compiled = xla_stream(reads, writes).lower(*inputs).compile()  # timed and counted once
    return (median_ms(compiled, *inputs, **timed_as),
            {"kernels": fusions(compiled)})


def build_cuda_stream(directory: str) -> str:
    binary = str(Path(directory) / "hbm_stream")
    subprocess.run(["nvcc", "-O3", "-gencode=arch=compute_90,code=sm_90", "-o", binary,
                    str(CUDA_SOURCE)], check=True)
    return binary


def time_cuda_stream(binary: str, block_elements: int, reads: int,
                     writes: int) -> tuple[float, dict]:
    """The fastest launch shape's median ms (the binary times 7 x 10 launches per shape)."""
    lines = subprocess.run([binary, str(block_elements * 2), str(reads), str(writes)],
                           check=True, capture_output=True, text=True).stdout.split("\n")
    by_shape = {int(shape): float(ms) for shape, ms in (line.split() for line in lines if line)}
    best = min(by_shape, key=by_shape.get)
    return by_shape[best], {"blocks_per_sm": best}


def stream_row(impl: str, timed: tuple[float, dict], b: int, d: int, s_kv: int,
               pass_name: str) -> dict:
    ms, extra = timed
    reads, writes = block_counts(s_kv, pass_name)
    moved = (reads + writes) * b * HEADS * d * 2
    return {"name": f"b{b}_d{d}_skv{s_kv}", "shape": {"b": b, "h": HEADS, "d": d, "s_kv": s_kv},
            "impl": impl, "pass": pass_name, "ms": round(ms, 4), "blocks_read": reads,
            "blocks_written": writes, **extra, "tb_per_s": round(moved / ms / 1e9, 3),
            "fraction_of_peak": round(moved / H200_HBM_BYTES_PER_S * 1e3 / ms, 3)}


def with_fwd_bwd(rows: list[dict]) -> list[dict]:
    """Adds, per shape and impl, the fwd+bwd stream time: the forward's and backward's summed."""
    by_key = {(r["name"], r["impl"], r["pass"]): r for r in rows}
    out = []
    for r in rows:
        out.append(r)
        if r["pass"] == "bwd":
            fwd = by_key[(r["name"], r["impl"], "fwd")]
            out.append({"name": r["name"], "shape": r["shape"], "impl": r["impl"],
                        "pass": "fwd+bwd", "ms": round(fwd["ms"] + r["ms"], 4)})
    return out


def against_small_seq(rows: list[dict], path: str) -> list[dict]:
    """The small-seq kernels (impl small_seq_kernel of a small_seq.py result file) against
    each stream, like for like: their wall time per call (median_ms, as the XLA stream's)
    against the XLA stream's, and, where the file has --profile traces, their device time
    per call (the "fusedattn" kernels alone, as the CUDA stream's event timing) against the
    CUDA stream's."""
    measured = {"xla_stream": {}, "cuda_stream": {}}
    for r in json.load(open(path))["rows"]:
        if r["impl"] == "small_seq_kernel" and r.get("ms"):
            measured["xla_stream"][(r["name"], r["pass"])] = r["ms"]
            device_ms = r.get("profile", {}).get("ms_per_step", {}).get("fusedattn")
            if device_ms:
                measured["cuda_stream"][(r["name"], r["pass"])] = device_ms
    ours_key = {"xla_stream": "small_seq_kernel_ms", "cuda_stream": "small_seq_kernel_device_ms"}
    streams = {(r["name"], r["pass"], r["impl"]): r["ms"] for r in rows}
    out = []
    for name, pass_name in measured["xla_stream"]:
        entry = {"name": name, "pass": pass_name}
        for impl in IMPLS:
            ms = measured[impl].get((name, pass_name))
            stream_ms = streams.get((name, pass_name, impl))
            if ms is not None and stream_ms is not None:
                entry.update({ours_key[impl]: ms, f"{impl}_ms": stream_ms,
                              f"speedup_vs_{impl}": round(stream_ms / ms, 3)})
        if len(entry) > 2:
            out.append(entry)
    return out


def add_arguments(parser):
    parser.add_argument("--small-seq", default=None,
                        help="a benchmarks/small_seq.py result file to compare with the streams")


def main():
    args = parse_args("benchmarks/results/hbm_stream.json", add_arguments)
    shapes = [(30720, 128)] if args.quick else [(30720, 128), (30720, 256)]
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        binary = build_cuda_stream(directory)
        for b, d in shapes:
            for s_kv in S_KV:
                for pass_name in ("fwd", "bwd"):
                    reads, writes = block_counts(s_kv, pass_name)
                    for impl, timed in (
                            ("xla_stream", lambda: time_xla_stream(b * HEADS * d, reads, writes,
                                                                   timing(args))),
                            ("cuda_stream", lambda: time_cuda_stream(binary, b * HEADS * d,
                                                                     reads, writes))):
                        rows.append(stream_row(impl, timed(), b, d, s_kv, pass_name))
                        print(rows[-1], flush=True)
    rows = with_fwd_bwd(rows)
    comparison = against_small_seq(rows, args.small_seq) if args.small_seq else []
    write_results(args.out, rows, small_seq_against_streams=comparison,
                  peak="4.8 TB/s (H200 HBM3e)")
    print(f"\n{'shape':<20}{'pass':<6}{'impl':<13}{'ms':>8}{'TB/s':>7}{'peak%':>7}")
    for r in rows:
        if "tb_per_s" in r:
            print(f"{r['name']:<20}{r['pass']:<6}{r['impl']:<13}{r['ms']:>8.3f}"
                  f"{r['tb_per_s']:>7.2f}{100 * r['fraction_of_peak']:>6.0f}%")
    if comparison:
        print(f"\n{'shape':<20}{'pass':<9}{'ours wall':>10}{'xla ms':>8}{'vs xla':>8}"
              f"{'ours device':>12}{'cuda ms':>9}{'vs cuda':>9}")
        for c in comparison:
            print(f"{c['name']:<20}{c['pass']:<9}" + "".join(
                _cell(c.get(key), width, digits) for key, width, digits in (
                    ("small_seq_kernel_ms", 10, 3), ("xla_stream_ms", 8, 3),
                    ("speedup_vs_xla_stream", 8, 2), ("small_seq_kernel_device_ms", 12, 3),
                    ("cuda_stream_ms", 9, 3), ("speedup_vs_cuda_stream", 9, 2))))


def _cell(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


if __name__ == "__main__":
    main()
