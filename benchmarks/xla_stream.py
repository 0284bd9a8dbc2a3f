"""XLA's plainest streaming kernels moving the bytes of a small-seq kernel: a measured HBM
rate to hold the small-seq kernels against, besides the 4.8 TB/s peak of the byte floor.

The byte floor of benchmarks/small_seq.py divides bytes by the H200's peak, which no kernel
reaches, and a kernel that writes as much as it reads reaches less than one that mostly
reads. So for each key count N this times elementwise XLA fusions over flat arrays of one
q-row block each (b * h * d elements), as many as the small-seq kernel reads and writes:
  forward:  reads q, k_0..k_{N-1}, v_0..v_{N-1} (1 + 2N blocks), writes o (1);
  backward: reads q, o, dO, k, v (3 + 2N), writes dq, dk, dv (1 + 2N).
Each input element is read once and each output element written once (the `kernels`
column counts the fusions XLA compiled: the forward's is one kernel, as the attention's;
the backward's are one per written block, each a plain 1:1 or n:1 stream, run back to back).
A fwd+bwd call's stream time is the sum of the two. With --small-seq the table also gives
the small-seq kernels' times (impl small_seq_kernel of that result file) against them.

    python benchmarks/xla_stream.py --out benchmarks/results/xla_stream.json \
        --small-seq benchmarks/results/small_seq.json
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp

from common import H200_HBM_BYTES_PER_S, median_ms, parse_args, random_normal, write_results

HEADS = 16
S_KV = (2, 4, 6, 8, 12, 16)


def block_counts(s_kv: int, pass_name: str) -> tuple[int, int]:
    """(blocks read, blocks written) of one small-seq kernel; a block is b * h * d elements."""
    if pass_name == "fwd":
        return 1 + 2 * s_kv, 1
    return 3 + 2 * s_kv, 1 + 2 * s_kv


def stream(reads: int, writes: int):
    """A jitted fn of `reads` arrays [n] (reads >= writes) returning `writes` arrays [n]:
    output 0 the sum of inputs 0 and writes..reads-1, output w input w doubled. Each input
    element is read once and each output element written once, by plain streaming fusions.
    (Outputs that all read every input make XLA materialise their sum first, and one
    [writes, n] concatenate of them streams at a fifth of the rate from 13 operands on.)"""
    def fn(*inputs):
        return (sum(inputs[writes:], inputs[0]),) + tuple(x * 2 for x in inputs[1:writes])
    return jax.jit(fn)


def fusions(fn, *args) -> int:
    """The number of fusion kernels in fn's compiled entry computation."""
    text = fn.lower(*args).compile().as_text()
    entry = text[text.index("ENTRY"):]
    return len(re.findall(r"\bfusion\(", entry))


def stream_row(b: int, d: int, s_kv: int, pass_name: str, repeats: int, iters: int) -> dict:
    reads, writes = block_counts(s_kv, pass_name)
    keys = jax.random.split(jax.random.key(1000 * s_kv + reads), reads)
    inputs = [random_normal(key, (b * HEADS * d,), jnp.bfloat16) for key in keys]
    fn = stream(reads, writes)
    ms = median_ms(fn, *inputs, repeats=repeats, iters=iters)
    moved = (reads + writes) * b * HEADS * d * 2
    return {"name": f"b{b}_d{d}_skv{s_kv}", "shape": {"b": b, "h": HEADS, "d": d, "s_kv": s_kv},
            "impl": "xla_stream", "pass": pass_name, "ms": round(ms, 4),
            "blocks_read": reads, "blocks_written": writes, "kernels": fusions(fn, *inputs),
            "tb_per_s": round(moved / ms / 1e9, 3),
            "fraction_of_peak": round(moved / H200_HBM_BYTES_PER_S * 1e3 / ms, 3)}


def with_fwd_bwd(rows: list[dict]) -> list[dict]:
    """Adds, per shape, the fwd+bwd stream time: the forward's and the backward's summed."""
    by_key = {(r["name"], r["pass"]): r for r in rows}
    out = []
    for r in rows:
        out.append(r)
        if r["pass"] == "bwd":
            fwd = by_key[(r["name"], "fwd")]
            out.append({"name": r["name"], "shape": r["shape"], "impl": "xla_stream",
                        "pass": "fwd+bwd", "ms": round(fwd["ms"] + r["ms"], 4)})
    return out


def against_small_seq(rows: list[dict], path: str) -> list[dict]:
    """The small-seq kernels' times (impl small_seq_kernel) against the streams'."""
    ours = {(r["name"], r["pass"]): r["ms"] for r in json.load(open(path))["rows"]
            if r["impl"] == "small_seq_kernel" and r.get("ms")}
    out = []
    for r in rows:
        ms = ours.get((r["name"], r["pass"]))
        if ms is not None:
            out.append({"name": r["name"], "pass": r["pass"], "small_seq_kernel_ms": ms,
                        "xla_stream_ms": r["ms"], "speedup_vs_xla_stream": round(r["ms"] / ms, 3)})
    return out


def add_arguments(parser):
    parser.add_argument("--small-seq", default=None,
                        help="a benchmarks/small_seq.py result file to compare with the streams")


def main():
    args = parse_args("benchmarks/results/xla_stream.json", add_arguments)
    shapes = [(30720, 128)] if args.quick else [(30720, 128), (30720, 256)]
    rows = []
    for b, d in shapes:
        for s_kv in S_KV:
            for pass_name in ("fwd", "bwd"):
                rows.append(stream_row(b, d, s_kv, pass_name, args.repeats, args.iters))
                print(rows[-1], flush=True)
    rows = with_fwd_bwd(rows)
    comparison = against_small_seq(rows, args.small_seq) if args.small_seq else []
    write_results(args.out, rows, small_seq_against_xla_stream=comparison,
                  peak="4.8 TB/s (H200 HBM3e)")
    print(f"\n{'shape':<20}{'pass':<9}{'stream ms':>10}{'TB/s':>7}{'peak%':>7}{'kernels':>8}")
    for r in rows:
        if "tb_per_s" in r:
            print(f"{r['name']:<20}{r['pass']:<9}{r['ms']:>10.3f}{r['tb_per_s']:>7.2f}"
                  f"{100 * r['fraction_of_peak']:>6.0f}%{r['kernels']:>8}")
    if comparison:
        print(f"\n{'shape':<20}{'pass':<9}{'kernel ms':>10}{'stream ms':>10}{'speedup':>9}")
        for c in comparison:
            print(f"{c['name']:<20}{c['pass']:<9}{c['small_seq_kernel_ms']:>10.3f}"
                  f"{c['xla_stream_ms']:>10.3f}{c['speedup_vs_xla_stream']:>8.2f}x")


if __name__ == "__main__":
    main()
