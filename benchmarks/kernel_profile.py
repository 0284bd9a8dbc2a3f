"""Device time per kernel kind from a jax.profiler trace (its Perfetto JSON).

Sums the durations of the GPU's kernel and memory events in
<trace dir>/plugins/profile/*/perfetto_trace.json.gz, per kind (attention,
matmul, our own kernels, copies, other XLA fusions), and lists the longest
kernels with their calls per step. Used by benchmarks/lm_train.py --profile and
benchmarks/layers.py --profile DIR; also on its own:

    python benchmarks/kernel_profile.py WORKDIR/profile --steps 5
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
from pathlib import Path

# Kind of a device event, by the first pattern its name matches (case-insensitive).
KINDS = (
    ("attention", r"fmha|sdpa|flash|cudnn|attention"),
    ("fusedattn", r"small_seq|dropout_mask|philox"),
    ("matmul", r"gemm|xmma|cutlass|nvjet|matmul|cublas|dot"),
    ("copy", r"memcpy|memset|copy"),
    ("other", r""),
)


def _kind(name: str) -> str:
    return next(kind for kind, pattern in KINDS if re.search(pattern, name, re.IGNORECASE))


def _trace_file(trace_dir: Path) -> Path:
    files = sorted(Path(trace_dir).glob("plugins/profile/*/perfetto_trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"{trace_dir}: no plugins/profile/*/perfetto_trace.json.gz; "
                                "was it written by jax.profiler with create_perfetto_trace=True?")
    return files[-1]


def device_events(trace_dir: Path) -> list[tuple[str, float]]:
    """(name, microseconds) of every kernel and copy on a GPU stream of the trace.

    A GPU process also has lines of XLA ops and modules spanning the same time as
    its kernels; only the "Stream ..." threads are counted, so nothing counts twice.
    """
    with gzip.open(_trace_file(trace_dir)) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    meta = [e for e in events if e.get("ph") == "M"]
    gpu_pids = {e["pid"] for e in meta if e.get("name") == "process_name"
                and "/device:GPU" in str(e.get("args", {}).get("name", ""))}
    threads = {(e["pid"], e.get("tid")): str(e.get("args", {}).get("name", "")) for e in meta
               if e.get("name") == "thread_name" and e["pid"] in gpu_pids}
    streams = {key for key, name in threads.items() if name.startswith("Stream")}
    if not streams:
        raise ValueError(f"{trace_dir}: no 'Stream' thread among the GPU's trace lines "
                         f"{sorted(set(threads.values()))}")
    return [(e["name"], float(e.get("dur", 0.0))) for e in events
            if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams]


def summarize_events(events: list[tuple[str, float]], steps: int, top: int = 15) -> dict:
    """Device milliseconds per step by kind, and the `top` longest kernels: their ms
    per step, and in the same order their calls per step. events: device_events()."""
    if not events:
        raise ValueError("the trace has no GPU events")
    by_kind: dict[str, float] = collections.defaultdict(float)
    by_name: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    for name, us in events:
        by_kind[_kind(name)] += us
        by_name[name] += us
        calls[name] += 1
    per_step = 1e-3 / steps
    longest = sorted(by_name.items(), key=lambda item: -item[1])[:top]
    return {"steps": steps,
            "ms_per_step": {kind: round(us * per_step, 3) for kind, us in
                            sorted(by_kind.items(), key=lambda item: -item[1])},
            "device_ms_per_step": round(sum(by_kind.values()) * per_step, 3),
            "top_kernels_ms_per_step": [[name[:120], round(us * per_step, 3)]
                                        for name, us in longest],
            "top_kernels_calls_per_step": [[name[:120], round(calls[name] / steps, 2)]
                                           for name, _ in longest]}


def summarize(trace_dir: Path, steps: int, top: int = 15) -> dict:
    """summarize_events() of the trace in trace_dir (written by jax.profiler)."""
    events = device_events(trace_dir)
    if not events:
        raise ValueError(f"{trace_dir}: the trace has no GPU events")
    return summarize_events(events, steps, top)


def print_summary(summary: dict) -> None:
    print(f"device time per step: {summary['device_ms_per_step']:.2f} ms "
          f"(over {summary['steps']} traced steps)")
    for kind, ms in summary["ms_per_step"].items():
        print(f"  {kind:<10}{ms:>9.2f} ms")
    print_top_kernels(summary, "longest kernels")


def print_top_kernels(summary: dict, title: str) -> None:
    """The longest kernels of a summarize() result: ms and calls per step, kind, name."""
    calls = [c for _, c in summary.get("top_kernels_calls_per_step", [])]
    print(f"{title} (ms per step, calls per step, kind, name):")
    for i, (name, ms) in enumerate(summary["top_kernels_ms_per_step"]):
        count = f"{calls[i]:g}" if i < len(calls) else "?"
        print(f"  {ms:>8.3f}  {count:>6}  {_kind(name):<10} {name}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trace_dir", type=Path)
    parser.add_argument("--steps", type=int, default=1, help="steps the trace covers")
    args = parser.parse_args()
    print_summary(summarize(args.trace_dir, args.steps))


if __name__ == "__main__":
    main()
