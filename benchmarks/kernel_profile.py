"""Device time per kernel kind from a jax.profiler trace (its Perfetto JSON).

Sums the durations of the GPU's kernel and memory events in
<trace dir>/plugins/profile/*/perfetto_trace.json.gz, per kind (attention,
matmul, our own kernels, copies, other XLA fusions), lists the longest kernels
with their calls per step, and where the GPU sits idle between kernels (the idle
gaps by the kernel that ends before them and the one that starts after). On the
host side it lists where the CPU threads spend their time per step (host_summary:
each traced event's own time, without the events nested in it). Over several GPUs
it tells how much of each GPU's communication (NCCL kernels) runs while compute
kernels run on its other streams (communication_overlap). Used by
benchmarks/lm_train.py --profile, benchmarks/layers.py --profile DIR and
benchmarks/small_seq.py --profile DIR (through profile_call); also on its own:

    python benchmarks/kernel_profile.py WORKDIR/profile --steps 5
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import tempfile
from pathlib import Path
from typing import NamedTuple

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


class Event(NamedTuple):
    name: str
    start_us: float
    us: float


class Trace(NamedTuple):
    """A jax.profiler trace: each line's complete ("X") events in start order, by
    (pid, tid); the lines' thread names; the GPU processes' pids; each process's name
    by pid (e.g. "/device:GPU:0")."""

    lines: dict[tuple, list[Event]]
    threads: dict[tuple, str]
    gpu_pids: set
    processes: dict


def read_trace(trace_dir: Path) -> Trace:
    """The trace in trace_dir (written by jax.profiler with create_perfetto_trace=True)."""
    with gzip.open(_trace_file(trace_dir)) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    meta = [e for e in events if e.get("ph") == "M"]
    processes = {e["pid"]: str(e.get("args", {}).get("name", "")) for e in meta
                 if e.get("name") == "process_name"}
    gpu_pids = {pid for pid, name in processes.items() if "/device:GPU" in name}
    threads = {(e["pid"], e.get("tid")): str(e.get("args", {}).get("name", "")) for e in meta
               if e.get("name") == "thread_name"}
    lines: dict[tuple, list[Event]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            lines[(e.get("pid"), e.get("tid"))].append(
                Event(e["name"], float(e.get("ts", 0.0)), float(e.get("dur", 0.0))))
    for line in lines.values():
        line.sort(key=lambda event: event.start_us)
    return Trace(dict(lines), threads, gpu_pids, processes)


def device_events(trace: Trace) -> list[Event]:
    """Every kernel and copy on a GPU stream of the trace, in start order.

    A GPU process also has lines of XLA ops and modules spanning the same time as
    its kernels; only the "Stream ..." threads are counted, so nothing counts twice.
    """
    streams = [key for key, name in trace.threads.items()
               if key[0] in trace.gpu_pids and name.startswith("Stream")]
    if not streams:
        raise ValueError("no 'Stream' thread among the GPU's trace lines "
                         f"{sorted({n for key, n in trace.threads.items() if key[0] in trace.gpu_pids})}")
    return sorted((event for key in streams for event in trace.lines.get(key, [])),
                  key=lambda event: event.start_us)


# A device event moves data between GPUs when its name matches (case-insensitive): NCCL's
# kernels (ncclDevKernel_SendRecv, ncclKernel_AllGather_RING_LL, ...), XLA's names of its
# collectives, and peer-to-peer copies.
COMMUNICATION = (r"nccl|send_?recv|all[-_]?gather|reduce[-_]?scatter|all[-_]?reduce|all[-_]?to[-_]?all"
                 r"|collective[-_]?permute|memcpy ?p(2|to)p|peer")


def is_communication(name: str) -> bool:
    return re.search(COMMUNICATION, name, re.IGNORECASE) is not None


def _union(intervals) -> list[tuple[float, float]]:
    """The union of [start, end) intervals as disjoint intervals in start order."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _intersection_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The length of the intersection of two unions of disjoint intervals in start order."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def communication_overlap(trace: Trace, calls: int, top: int = 5) -> dict:
    """How much of each GPU's communication runs alongside its compute, per traced call.

    For each GPU process of the trace: communication is the union in time of the events on
    its "Stream ..." lines whose names match COMMUNICATION (an NCCL kernel's time includes
    its wait for the peer); compute is the union of its other events (kernels and copies).
    A stream runs one event at a time, so only other streams' kernels can overlap a
    communication kernel. Returns {"gpus": [per GPU: "gpu" (the process name),
    "communication_ms_per_call", "overlapped_ms_per_call" (communication while compute
    runs), "exposed_ms_per_call" (the rest), "overlap_fraction" (overlapped / communication,
    None without communication), "compute_ms_per_call", "communication_kernels" (the `top`
    names by time)], and over all GPUs together "overlap_fraction" and the mean
    "exposed_ms_per_call"}. Raises ValueError when no GPU has a "Stream" line.
    """
    per_call = 1e-3 / calls
    gpus, totals = [], [0.0, 0.0]  # totals: communication and overlapped microseconds
    for pid in sorted(trace.gpu_pids, key=lambda p: trace.processes.get(p, str(p))):
        streams = [key for key, name in trace.threads.items()
                   if key[0] == pid and name.startswith("Stream")]
        if not streams:
            continue
        events = [event for key in streams for event in trace.lines.get(key, [])]
        talk = [e for e in events if is_communication(e.name)]
        communication = _union((e.start_us, e.start_us + e.us) for e in talk)
        compute = _union((e.start_us, e.start_us + e.us) for e in events
                         if not is_communication(e.name))
        talk_us, overlapped_us = _length(communication), _intersection_length(communication, compute)
        totals[0] += talk_us
        totals[1] += overlapped_us
        by_name: dict[str, float] = collections.defaultdict(float)
        for event in talk:
            by_name[event.name] += event.us
        gpus.append({"gpu": trace.processes.get(pid, str(pid)),
                     "communication_ms_per_call": round(talk_us * per_call, 4),
                     "overlapped_ms_per_call": round(overlapped_us * per_call, 4),
                     "exposed_ms_per_call": round((talk_us - overlapped_us) * per_call, 4),
                     "overlap_fraction": round(overlapped_us / talk_us, 4) if talk_us else None,
                     "compute_ms_per_call": round(_length(compute) * per_call, 4),
                     "communication_kernels": [name[:100] for name, _ in sorted(
                         by_name.items(), key=lambda item: -item[1])[:top]]})
    if not gpus:
        raise ValueError("no GPU process of the trace has a 'Stream' line (no GPU events)")
    return {"gpus": gpus,
            "overlap_fraction": round(totals[1] / totals[0], 4) if totals[0] else None,
            "exposed_ms_per_call": round((totals[0] - totals[1]) * per_call / len(gpus), 4)}


def host_self_times(trace: Trace) -> dict[str, tuple[float, float, int]]:
    """{event name: (own microseconds, microseconds in all, calls)} over the host threads.

    An event's own time is its duration less that of the events directly nested in
    it on the same thread, so a dispatch's time splits into its parts without any
    part counting twice.
    """
    totals: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for key in trace.threads:
        if key[0] in trace.gpu_pids:
            continue
        open_events: list[list] = []  # [event, own us] of the events enclosing the current one
        for event in sorted(trace.lines.get(key, []), key=lambda e: (e.start_us, -e.us)):
            while open_events and open_events[-1][0].start_us + open_events[-1][0].us <= event.start_us:
                _close(totals, *open_events.pop())
            if open_events:
                open_events[-1][1] -= event.us
            open_events.append([event, event.us])
        while open_events:
            _close(totals, *open_events.pop())
    return {name: tuple(value) for name, value in totals.items()}


def _close(totals: dict, event: Event, own_us: float) -> None:
    total = totals[event.name]
    total[0] += own_us
    total[1] += event.us
    total[2] += 1


def host_summary(trace: Trace, steps: int, top: int = 15) -> dict:
    """The `top` host events by own time: [name, own ms, ms in all, calls], per step."""
    per_step = 1e-3 / steps
    times = sorted(host_self_times(trace).items(), key=lambda item: (-item[1][0], item[0]))[:top]
    return {"host_top_ms_per_step": [[name[:100], round(own * per_step, 3), round(total * per_step, 3),
                                      round(calls / steps, 2)] for name, (own, total, calls) in times]}


def idle_gaps(events: list[Event]) -> dict[tuple[str, str], float]:
    """Microseconds the GPU runs nothing, from the first event's start to the last one's
    end, by (the event that ended last before the gap, the event that starts it)."""
    gaps: dict[tuple[str, str], float] = collections.defaultdict(float)
    busy_until, last = None, None
    for event in events:
        if busy_until is not None and event.start_us > busy_until:
            gaps[(last.name, event.name)] += event.start_us - busy_until
        if busy_until is None or event.start_us + event.us >= busy_until:
            busy_until, last = event.start_us + event.us, event
    return gaps


def summarize_events(events: list[Event], steps: int, top: int = 15) -> dict:
    """Device milliseconds per step by kind, and the `top` longest kernels: their ms
    per step, and in the same order their calls per step; the idle ms per step and the
    `top` largest idle gaps by their neighbours (idle_gaps). events: device_events(read_trace(dir))."""
    if not events:
        raise ValueError("the trace has no GPU events")
    by_kind: dict[str, float] = collections.defaultdict(float)
    by_name: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    for name, _, us in events:
        by_kind[_kind(name)] += us
        by_name[name] += us
        calls[name] += 1
    per_step = 1e-3 / steps
    longest = sorted(by_name.items(), key=lambda item: -item[1])[:top]
    gaps = idle_gaps(events)
    widest = sorted(gaps.items(), key=lambda item: -item[1])[:top]
    return {"steps": steps,
            "kernels_per_step": round(len(events) / steps, 2),
            "idle_ms_per_step": round(sum(gaps.values()) * per_step, 3),
            "top_idle_ms_per_step": [[before[:60], after[:60], round(us * per_step, 3)]
                                     for (before, after), us in widest],
            "ms_per_step": {kind: round(us * per_step, 3) for kind, us in
                            sorted(by_kind.items(), key=lambda item: -item[1])},
            "device_ms_per_step": round(sum(by_kind.values()) * per_step, 3),
            "top_kernels_ms_per_step": [[name[:120], round(us * per_step, 3)]
                                        for name, us in longest],
            "top_kernels_calls_per_step": [[name[:120], round(calls[name] / steps, 2)]
                                           for name, _ in longest]}


def summarize(trace_dir: Path, steps: int, top: int = 15) -> dict:
    """summarize_events() of the trace in trace_dir (written by jax.profiler), with its
    host_summary()."""
    trace = read_trace(trace_dir)
    try:
        device = summarize_events(device_events(trace), steps, top)
    except ValueError as error:
        raise ValueError(f"{trace_dir}: {error}") from None
    return {**device, **host_summary(trace, steps, top)}


def profile_call(fn, args: tuple, trace_dir: Path, steps: int, top: int = 15) -> dict:
    """Traces `steps` back-to-back calls of fn(*args) (compiled and warmed up already)
    with jax.profiler into trace_dir, and returns summarize() of the trace with its
    "trace_dir", or {"error": ..., "trace_dir": ...} where the trace could not be taken
    or read (on a CPU there are no GPU events to read)."""
    import jax  # here: reading and summarising a trace needs no JAX

    try:
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            for _ in range(steps):
                out = fn(*args)
            jax.block_until_ready(out)
        return {"trace_dir": str(trace_dir), **summarize(trace_dir, steps, top=top)}
    except Exception as error:
        message = (str(error).splitlines() or [""])[0][:300]
        return {"error": f"{type(error).__name__}: {message}", "trace_dir": str(trace_dir)}


def print_summary(summary: dict) -> None:
    print(f"device time per step: {summary['device_ms_per_step']:.2f} ms "
          f"(over {summary['steps']} traced steps)")
    for kind, ms in summary["ms_per_step"].items():
        print(f"  {kind:<10}{ms:>9.2f} ms")
    print_top_kernels(summary, "longest kernels")
    print_idle(summary)
    print_host(summary)


def print_top_kernels(summary: dict, title: str) -> None:
    """The longest kernels of a summarize() result: ms and calls per step, kind, name."""
    calls = [c for _, c in summary.get("top_kernels_calls_per_step", [])]
    print(f"{title} (ms per step, calls per step, kind, name):")
    for i, (name, ms) in enumerate(summary["top_kernels_ms_per_step"]):
        count = f"{calls[i]:g}" if i < len(calls) else "?"
        print(f"  {ms:>8.3f}  {count:>6}  {_kind(name):<10} {name}")


def timeline(fn, args: tuple, label: str, calls: int) -> dict:
    """Profiles `calls` back-to-back calls of fn(*args) (compiled and warmed up first),
    prints the device time per call, the longest kernels and the idle gaps under `label`,
    and returns the summary without its host part (the timeline probes' rows)."""
    import jax  # as in profile_call

    jax.block_until_ready(fn(*args))
    summary = profile_call(fn, args, Path(tempfile.mkdtemp(prefix="timeline_")), calls)
    print(f"== {label}")
    if "error" in summary:
        print("  ", summary["error"])
    else:
        print(f"device time per call: {summary['device_ms_per_step']:.3f} ms")
        print_top_kernels(summary, "kernels")
        print_idle(summary)
    return {k: v for k, v in summary.items() if not k.startswith("host")}


def print_idle(summary: dict) -> None:
    """The idle time of a summarize() result and its largest gaps by neighbours."""
    print(f"{summary['kernels_per_step']:g} kernels and {summary['idle_ms_per_step']:.3f} ms "
          "idle per step; the largest gaps (ms per step: the kernel before -> the one after):")
    for before, after, ms in summary["top_idle_ms_per_step"]:
        print(f"  {ms:>8.3f}  {before}  ->  {after}")


def print_host(summary: dict) -> None:
    """The host events of a summarize() result with the most own time. Events that
    happen once in the traced window (the profiler's start and stop, the final
    block_until_ready) show at 1/steps calls per step: they are not a step's cost."""
    print("host threads, by own time (ms per step: own, in all; calls per step; event):")
    for name, own, total, calls in summary.get("host_top_ms_per_step", []):
        print(f"  {own:>8.3f} {total:>8.3f} {calls:>6g}  {name}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trace_dir", type=Path)
    parser.add_argument("--steps", type=int, default=1, help="steps the trace covers")
    args = parser.parse_args()
    print_summary(summarize(args.trace_dir, args.steps))


if __name__ == "__main__":
    main()
