"""Shared benchmark plumbing: timing, device facts, the result file."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

H200_HBM_BYTES_PER_S = 4.8e12
H200_MEASURED_MATMUL_FLOPS = 790e12  # a large bf16 matmul measured on the H200 (ANCHORS.md)


def parse_args(default_out: str, add_arguments=None) -> argparse.Namespace:
    """The common flags, plus a benchmark's own through add_arguments(parser)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=default_out, help="where to write the JSON results")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats (median reported)")
    parser.add_argument("--iters", type=int, default=10, help="calls per timed repeat (at least)")
    parser.add_argument("--min-window-ms", type=float, default=100.0,
                        help="more calls per repeat where --iters of them take less (median_ms)")
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    if add_arguments is not None:
        add_arguments(parser)
    return parser.parse_args()


def timing(args: argparse.Namespace) -> dict:
    """median_ms's keyword arguments from the common flags."""
    return {"repeats": args.repeats, "iters": args.iters, "min_window_ms": args.min_window_ms}


def median_ms(fn, *args, repeats: int = 7, iters: int = 10, min_window_ms: float = 100.0) -> float:
    """Median over `repeats` of mean_call_ms, after warm-up, over calls_per_repeat calls."""
    jax.block_until_ready(fn(*args))
    calls = calls_per_repeat(fn, args, iters, min_window_ms)
    return statistics.median(mean_call_ms(fn, args, calls) for _ in range(repeats))


def calls_per_repeat(fn, args: tuple, iters: int, min_window_ms: float) -> int:
    """`iters`, or more so that a repeat of back-to-back calls lasts at least min_window_ms
    (from one timed call, after warm-up). A repeat pays its first dispatch and its final
    sync once, which a short window reads as per-call time: a 0.18 ms small_seq forward
    read 0.200, 0.185 and 0.179 ms over windows of 10 calls, 20 ms and 200 ms
    (benchmarks/probes/timing_windows.py, results/timing_windows.json)."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one_call_ms = (time.perf_counter() - start) * 1e3
    return max(iters, math.ceil(min_window_ms / max(one_call_ms, 1e-3)))


def mean_call_ms(fn, args: tuple, calls: int) -> float:
    """Milliseconds per call of `calls` back-to-back calls ending in block_until_ready."""
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls * 1e3


def interleaved_ms(fns: dict, args: tuple, repeats: int, iters: int,
                   min_window_ms: float) -> tuple[dict, dict]:
    """Median ms per call of each fn(*args) over `repeats` rounds; each round times every fn
    once, in an order rotated from round to round. Returns ({name: ms}, {name: error}): fns
    that fail are reported by their error."""
    runnable, errors = {}, {}
    for name, fn in fns.items():
        try:
            jax.block_until_ready(fn(*args))
            runnable[name] = (fn, calls_per_repeat(fn, args, iters, min_window_ms))
        except Exception as error:  # an implementation that cannot run the case
            errors[name] = str(error).splitlines()[0][:300]
    samples = {name: [] for name in runnable}
    names = list(runnable)
    for round_index in range(repeats):
        shift = round_index % max(len(names), 1)
        for name in names[shift:] + names[:shift]:
            fn, calls = runnable[name]
            samples[name].append(mean_call_ms(fn, args, calls))
    return {name: statistics.median(times) for name, times in samples.items()}, errors


def environment() -> dict:
    device = jax.devices()[0]
    versions = {"jax": jax.__version__, "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__")
                else __import__("jaxlib").__version__, "numpy": np.__version__}
    try:
        versions["platform"] = device.client.platform_version
    except AttributeError:
        pass
    return {"device": getattr(device, "device_kind", str(device)), "versions": versions,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write_results(path: str, rows: list[dict], **extra) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({**environment(), **extra, "rows": rows}, indent=1) + "\n")


def random_normal(key, shape, dtype):
    return jax.random.normal(key, shape, jax.numpy.float32).astype(dtype)


@dataclasses.dataclass(frozen=True)
class WithParams:
    """An attention fn(q, k, v, *params) and its params: arrays it learns (a bias), which the
    "fwd+bwd" pass of `passes` differentiates as well."""
    attend: Callable
    params: tuple


def passes(attend) -> dict:
    """The two timed passes of an attention fn(q, k, v) (or a WithParams): "fwd" (jitted
    forward) and "fwd+bwd" (the VJP with cotangent do, with respect to q, k, v and the
    params), both called as fn(q, k, v, do)."""
    if not isinstance(attend, WithParams):
        attend = WithParams(attend, ())
    fn, params = attend.attend, attend.params
    forward = jax.jit(lambda q, k, v: fn(q, k, v, *params))

    @jax.jit
    def forward_backward(q, k, v, do):
        out, vjp = jax.vjp(fn, q, k, v, *params)
        return out, vjp(do)

    return {"fwd": lambda q, k, v, do: forward(q, k, v), "fwd+bwd": forward_backward}
