"""How the timing method reads a small_seq call: median_ms over repeats of back-to-back calls
lasting at least 0, 20 or 200 ms, a loop that drops each output at once, and a jax.profiler
trace of 30 calls (device time per call: the kernels' summed durations; span: first kernel
start to last kernel end, per call). A repeat pays its first dispatch and its final sync
once, so a short window reads that fixed cost as per-call time; this measures how much.

    python benchmarks/probes/timing_windows.py --out benchmarks/results/timing_windows.json
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import _benchmarks_on_path  # noqa: F401  (benchmarks/ on sys.path)
import small_seq
from common import median_ms, parse_args, random_normal, write_results
from kernel_profile import device_events, profile_call, read_trace

CASES = ((8, "small_seq_kernel", "fwd+bwd"), (8, "xla", "fwd+bwd"), (2, "small_seq_kernel", "fwd"),
         (2, "xla", "fwd"))
WINDOWS_MS = (0.0, 20.0, 200.0)
CALLS = 30


def dropped_outputs_ms(fn, args, repeats: int) -> float:
    """Median per-call time of CALLS calls whose outputs are dropped at once, the last kept."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(CALLS - 1):
            fn(*args)
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) / CALLS * 1e3)
    return statistics.median(times)


def main():
    args = parse_args("benchmarks/results/timing_windows.json")
    b, d = 30720, 128
    rows = []
    for s_kv, impl, pass_name in CASES:
        keys = jax.random.split(jax.random.key(s_kv), 4)
        q, do = (random_normal(key, (b, 1, small_seq.HEADS, d), jnp.bfloat16) for key in keys[::3])
        k, v = (random_normal(key, (b, s_kv, small_seq.HEADS, d), jnp.bfloat16)
                for key in keys[1:3])
        inputs = (q, k, v, jnp.full((b,), s_kv, jnp.int32), do)
        fn = small_seq.passes(small_seq.IMPLS[impl])[pass_name]
        row = {"name": f"b{b}_d{d}_skv{s_kv}", "shape": {"b": b, "h": small_seq.HEADS, "d": d,
                                                        "s_kv": s_kv, "s_q": 1},
               "impl": impl, "pass": pass_name}
        for window in WINDOWS_MS:
            ms = median_ms(fn, *inputs, repeats=args.repeats, iters=args.iters,
                           min_window_ms=window)
            row[f"ms_window_{window:g}"] = round(ms, 4)
        row["ms_dropped_outputs"] = round(dropped_outputs_ms(fn, inputs, args.repeats), 4)
        with tempfile.TemporaryDirectory() as trace_dir:
            profile = profile_call(fn, inputs, Path(trace_dir), CALLS)
            if "error" in profile:
                row["trace_error"] = profile["error"]
            else:
                events = device_events(read_trace(Path(trace_dir)))
                span_us = max(e.start_us + e.us for e in events) - min(e.start_us for e in events)
                row.update(device_ms=profile["device_ms_per_step"],
                           span_ms=round(span_us / CALLS / 1e3, 4))
        rows.append(row)
        print(row, flush=True)
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
