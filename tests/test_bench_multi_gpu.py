"""The pieces of the multi-GPU run (scripts/multi_gpu.sh): benchmarks/kernel_profile.py's
communication_overlap on small synthetic traces written as jax.profiler writes them,
benchmarks/context_parallel.py's rows, rates and its trace on a CPU (no GPU events: an error
entry, not a crash), benchmarks/lm_train.py's steady rates and scripts/multi_gpu_summary.py's
table."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

sys.path.insert(0, str(ROOT / "scripts"))

import context_parallel  # noqa: E402
import kernel_profile  # noqa: E402
import lm_train  # noqa: E402
import multi_gpu_summary  # noqa: E402

HOST = 1


def write_trace(trace_dir: Path, gpus: dict[int, dict[str, list[tuple[str, float, float]]]]) -> None:
    """A perfetto_trace.json.gz under trace_dir/plugins/profile/run/: for GPU i of `gpus`, a
    process "/device:GPU:i" with one "Stream #..." line per stream name holding its
    (kernel name, start us, duration us) events, and an "XLA Ops" line; plus a host process."""
    events = [{"ph": "M", "pid": HOST, "name": "process_name", "args": {"name": "/host:CPU"}},
              {"ph": "M", "pid": HOST, "tid": 1, "name": "thread_name", "args": {"name": "python"}},
              # a host event named like a collective: never a GPU's communication
              {"ph": "X", "pid": HOST, "tid": 1, "name": "ncclGroupEnd", "ts": 0.0, "dur": 1e6}]
    for gpu, streams in gpus.items():
        pid = 100 + gpu
        events.append({"ph": "M", "pid": pid, "name": "process_name",
                       "args": {"name": f"/device:GPU:{gpu}"}})
        events.append({"ph": "M", "pid": pid, "tid": 1, "name": "thread_name",
                       "args": {"name": "XLA Ops"}})
        # the XLA op line spans the kernels' time again: it must not count
        events.append({"ph": "X", "pid": pid, "tid": 1, "name": "collective-permute-start.1",
                       "ts": 0.0, "dur": 1e6})
        for tid, (stream, kernels) in enumerate(streams.items(), start=10):
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                           "args": {"name": stream}})
            events += [{"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": us}
                       for name, ts, us in kernels]
    folder = trace_dir / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def overlap_of(tmp_path, gpus, calls=1) -> dict:
    write_trace(tmp_path, gpus)
    return kernel_profile.communication_overlap(kernel_profile.read_trace(tmp_path), calls)


SEND = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
GATHER = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32"
FLASH = "fusedattn::flash_forward_sm90"


def test_nothing_overlaps(tmp_path):
    """Communication, then compute on another stream: all of it is exposed."""
    result = overlap_of(tmp_path, {0: {"Stream #13(Compute)": [(FLASH, 100.0, 400.0)],
                                       "Stream #40(Nccl)": [(SEND, 0.0, 100.0),
                                                            (SEND, 500.0, 100.0)]}})
    (gpu,) = result["gpus"]
    assert gpu["gpu"] == "/device:GPU:0"
    assert gpu["communication_ms_per_call"] == 0.2 and gpu["compute_ms_per_call"] == 0.4
    assert gpu["overlapped_ms_per_call"] == 0.0 and gpu["exposed_ms_per_call"] == 0.2
    assert gpu["overlap_fraction"] == 0.0 and result["overlap_fraction"] == 0.0
    assert gpu["communication_kernels"] == [SEND]


def test_everything_overlaps(tmp_path):
    """Each communication kernel lies inside compute on another stream (two compute kernels
    that touch end to start cover the second one)."""
    result = overlap_of(tmp_path, {0: {"Stream #13(Compute)": [(FLASH, 0.0, 300.0),
                                                               (GEMM, 300.0, 200.0)],
                                       "Stream #40(Nccl)": [(SEND, 50.0, 100.0),
                                                            (GATHER, 250.0, 100.0)]}}, calls=2)
    (gpu,) = result["gpus"]
    # per call: 200 us of communication over 2 calls
    assert gpu["communication_ms_per_call"] == 0.1 and gpu["overlapped_ms_per_call"] == 0.1
    assert gpu["exposed_ms_per_call"] == 0.0 and gpu["overlap_fraction"] == 1.0
    assert gpu["compute_ms_per_call"] == 0.25
    assert set(gpu["communication_kernels"]) == {SEND, GATHER}


def test_partial_overlap_counts_each_moment_once_per_gpu(tmp_path):
    """Communication on two streams that overlap each other counts once (their union,
    [0, 150)); compute on two streams likewise ([100, 120) and [140, 400)); the overlap is
    their intersection, 20 + 10 us. Another GPU's compute, running all the while, does not
    hide this GPU's communication, and a GPU without communication has no fraction."""
    result = overlap_of(tmp_path, {
        0: {"Stream #13(Compute)": [(GEMM, 100.0, 20.0), (GEMM, 140.0, 200.0)],
            "Stream #14(Compute)": [(FLASH, 300.0, 100.0)],
            "Stream #40(Nccl)": [(SEND, 0.0, 100.0)],
            "Stream #41(Nccl)": [(GATHER, 50.0, 100.0)]},
        1: {"Stream #13(Compute)": [(FLASH, 0.0, 1000.0)]}})
    first, second = result["gpus"]
    assert first["gpu"] == "/device:GPU:0" and second["gpu"] == "/device:GPU:1"
    assert first["communication_ms_per_call"] == 0.15
    assert first["overlapped_ms_per_call"] == 0.03
    assert first["exposed_ms_per_call"] == 0.12
    assert first["overlap_fraction"] == 0.2
    assert first["compute_ms_per_call"] == 0.28  # [100, 120) and [140, 400)
    assert second["communication_ms_per_call"] == 0.0 and second["overlap_fraction"] is None
    # over both GPUs: 30 of 150 us overlapped; the exposed 120 us shared by 2 GPUs
    assert result["overlap_fraction"] == 0.2 and result["exposed_ms_per_call"] == 0.06


def test_interval_helpers_against_a_dense_count():
    """_union and _intersection_length against counting covered microseconds one by one."""
    import numpy as np

    rng = np.random.default_rng(7)
    for _ in range(50):
        a, b = ([(float(s), float(s + d)) for s, d in zip(rng.integers(0, 200, n),
                                                          rng.integers(1, 40, n))]
                for n in rng.integers(1, 8, 2))
        covered = [np.zeros(250, bool) for _ in range(2)]
        for mask, intervals in zip(covered, (a, b)):
            for start, end in intervals:
                mask[int(start):int(end)] = True
        union_a, union_b = kernel_profile._union(a), kernel_profile._union(b)
        assert kernel_profile._length(union_a) == covered[0].sum()
        assert all(end < start for (_, end), (start, _) in zip(union_a, union_a[1:]))
        assert (kernel_profile._intersection_length(union_a, union_b)
                == (covered[0] & covered[1]).sum())


def test_a_trace_without_gpu_streams_says_so(tmp_path):
    with pytest.raises(ValueError, match="no GPU process"):
        overlap_of(tmp_path, {})


def test_communication_names():
    for name in (SEND, GATHER, "ncclKernel_ReduceScatter_RING", "MemcpyP2P", "Memcpy PtoP",
                 "all-reduce-start", "collective-permute-done"):
        assert kernel_profile.is_communication(name), name
    for name in (GEMM, FLASH, "loop_transpose_fusion", "Memcpy DtoD", "input_reduce_fusion"):
        assert not kernel_profile.is_communication(name), name


def test_efficiency_is_against_the_unsharded_row_of_the_same_length_and_pass():
    rows = [dict(batch=1, heads=2, head_dim=8, seqlen=s, devices=4, impl=impl, load_balance=lb,
                 **{"pass": p}, median_ms=ms)
            for s, impl, lb, p, ms in [(64, "unsharded", None, "fwd", 8.0),
                                       (64, "unsharded", None, "fwd+bwd", 40.0),
                                       (128, "unsharded", None, "fwd", 32.0),
                                       (64, "ring", "on", "fwd", 2.5),
                                       (64, "ring", "off", "fwd+bwd", 20.0),
                                       (128, "all_gather", "on", "fwd", 10.0)]]
    context_parallel.add_rates(rows)
    assert [row.get("scaling_efficiency") for row in rows] == [None, None, None, 0.8, 0.5, 0.8]
    # 2 b h s^2 d (half of a full mask's 4 b h s^2 d), x 3.5 with the backward, per device
    assert rows[0]["tflops_per_device"] == pytest.approx(2 * 2 * 64 ** 2 * 8 / 8e-3 / 1e12)
    assert rows[4]["tflops_per_device"] == pytest.approx(
        3.5 * 2 * 2 * 64 ** 2 * 8 / 20e-3 / 4 / 1e12)


def test_benchmark_on_cpu_devices_records_the_trace_error_and_goes_on(tmp_path):
    """Four fake CPU devices, both load balancings, a trace: the rows are all there, each
    names its load balancing, and each traced strategy has an error entry (a CPU trace has no
    GPU events)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                              env.get("XLA_FLAGS", "")) + " --xla_force_host_platform_device_count=4"
    out = tmp_path / "cp.json"
    command = [sys.executable, str(ROOT / "benchmarks/context_parallel.py"), "--devices", "4",
               "--heads", "2", "--kv-heads", "2", "--head-dim", "16", "--seqlens", "64",
               "--repeats", "1", "--iters", "1", "--min-window-ms", "0",
               "--trace-seqlen", "64", "--trace-calls", "1", "--trace-dir", str(tmp_path / "t"),
               "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    keys = [(r["impl"], r["load_balance"], r["pass"]) for r in result["rows"]]
    assert keys == [("unsharded", None, "fwd"), ("unsharded", None, "fwd+bwd")] + [
        (impl, lb, p) for lb in ("on", "off") for impl in ("ring", "all_gather")
        for p in ("fwd", "fwd+bwd")]
    assert all(r["scaling_efficiency"] > 0 for r in result["rows"] if r["impl"] != "unsharded")
    assert [(o["impl"], o["load_balance"]) for o in result["overlap"]] == [
        ("ring", "on"), ("all_gather", "on")]
    assert all("error" in o and o["trace_s"] >= 0 for o in result["overlap"])
    assert all(r["first_call_s"] > 0 for r in result["rows"])
    assert "overlap ring lb=on s=64" in done.stdout


def test_steady_rates_weigh_each_interval_by_its_time():
    """Intervals after the step: total steps over total time (10 steps at 100/s and 10 at
    300/s take 0.1 + 0.033 s: 150/s), not the mean of the rates; none after it: None."""
    metrics = [{"step": 1, "loss": 5.0}, {"step": 10, "loss": 4.0, "tokens_per_s": 5.0, "mfu": 0.005},
               {"step": 20, "loss": 3.0, "tokens_per_s": 100.0, "mfu": 0.1},
               {"step": 30, "loss": 2.0, "tokens_per_s": 300.0, "mfu": 0.3}]
    rates = lm_train.steady_rates(metrics, 10)
    assert rates["after_step"] == 10
    assert rates["tokens_per_s"] == pytest.approx(150.0) and rates["mfu"] == pytest.approx(0.15)
    assert lm_train.steady_rates(metrics, 30) == {"after_step": 30, "tokens_per_s": None, "mfu": None}


def test_summary_table_of_the_result_files(tmp_path, capsys, monkeypatch):
    """One line per context-parallel row, the overlap per GPU, each LM run against one GPU's
    rate; a file cut short is named, not a crash."""
    row = dict(seqlen=131072, impl="ring", load_balance="on", median_ms=100.0, first_call_s=12.5,
               tflops_per_device=250.0, scaling_efficiency=0.9, kernels="forward sm90, backward sm90",
               **{"pass": "fwd+bwd"})
    overlap = {"seqlen": 131072, "impl": "ring", "load_balance": "on", "overlap_fraction": 0.75,
               "exposed_ms_per_call": 1.5,
               "gpus": [{"gpu": "/device:GPU:0", "communication_ms_per_call": 6.0,
                         "overlapped_ms_per_call": 4.5, "compute_ms_per_call": 90.0}]}
    (tmp_path / "context_parallel.json").write_text(json.dumps(
        {"device": "4 x H200", "rows": [row], "overlap": [overlap]}))
    for name, overrides, rate in (("gpu1", [], 400000.0),
                                  ("data2_context2", ["--config.mesh.data=2"], 1200000.0)):
        (tmp_path / f"lm_{name}.json").write_text(json.dumps(
            {"overrides": overrides, "rows": [{"backend": "auto", "summary": {
                "tokens_per_s": rate, "mfu": 0.4, "after_step": 20, "final_loss": 2.0}}]}))
    (tmp_path / "lm_data1_context4.json").write_text('{"rows": [')
    monkeypatch.setattr(sys, "argv", ["multi_gpu_summary.py", str(tmp_path)])
    multi_gpu_summary.main()
    text = capsys.readouterr().out
    assert "ring       on   fwd+bwd     100.00     250.0  0.900   12.5" in text
    assert "flash kernels: forward sm90, backward sm90" in text
    assert "overlap ring lb=on s=131072: fraction 0.75, exposed 1.5 ms" in text
    assert "/device:GPU:0: communication 6.0 ms, overlapped 4.5 ms" in text
    assert "1,200,000 tokens/s (x3.00 of one GPU), MFU per device 40.0%" in text
    assert "lm_data1_context4.json: unreadable" in text
