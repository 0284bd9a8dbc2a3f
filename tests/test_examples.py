"""Smoke and exactness tests of the example trainers (examples/, configs/).

Tiny models, a few steps each, on whatever platform JAX has (CPU in CI):
- each trainer runs end to end (the LM through its command line, flags and all)
  and writes metrics.jsonl, loss.png, summary.json and checkpoints;
- a run stopped after its checkpoint and restarted in the same workdir logs
  exactly the losses of an uninterrupted run;
- backend "xla" and backend "auto" give matching loss curves;
- the generated data keeps its invariants (packing, exact best losses).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fusedattn.ops import AttentionSpec

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytest.importorskip("orbax.checkpoint")
pytest.importorskip("matplotlib")


def load_config(name: str, arg: str = ""):
    path = ROOT / "configs" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_test_config_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def _tiny_trainer(config, steps: int, checkpoint_every: int = 4):
    config.trainer.num_steps = steps
    config.trainer.log_every = 1
    config.trainer.eval_every = steps
    config.trainer.eval_batches = 1
    config.trainer.checkpoint_every = checkpoint_every
    config.trainer.progress = False
    config.trainer.prefetch = 1
    config.optim.warmup_steps = 2
    return config


def tiny_lm(framework: str = "nnx", steps: int = 6, **attention):
    config = load_config("lm_equinox" if framework == "equinox" else "lm_nnx")
    config.data.batch_size = 4
    config.data.seq_len = 64
    config.data.max_pairs = 3
    config.data.max_sentence_len = 12
    config.model.num_layers = 1
    config.model.d_model = 32
    config.model.num_heads = 2
    config.model.num_kv_heads = 1
    config.model.mlp_dim = 64
    for key, value in attention.items():
        setattr(config.model.attention, key, value)
    return _tiny_trainer(config, steps)


def tiny_recommender(steps: int = 6, **attention):
    config = load_config("small_seq")
    config.data.batch_size = 4
    config.data.users_per_row = 4
    config.data.num_items = 64
    config.model.num_layers = 1
    config.model.d_model = 64
    config.model.num_heads = 1
    config.model.num_kv_heads = 1
    config.model.mlp_dim = 64
    for key, value in attention.items():
        setattr(config.model.attention, key, value)
    return _tiny_trainer(config, steps)


def run_lm(config, workdir):
    from examples.lm import train
    return train.train_and_evaluate(config, workdir)


def run_recommender(config, workdir):
    from examples.small_seq import train
    return train.train_and_evaluate(config, workdir)


def read_metrics(workdir) -> list[dict]:
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def losses(workdir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(workdir)}


def check_outputs(workdir, steps: int):
    workdir = pathlib.Path(workdir)
    records = read_metrics(workdir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(math.isfinite(r["loss"]) for r in records)
    assert "eval_loss" in records[-1] and math.isfinite(records[-1]["eval_loss"])
    assert (workdir / "loss.png").stat().st_size > 1000
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["step"] == steps and math.isfinite(summary["final_loss"])
    assert (workdir / "checkpoints" / str(steps)).is_dir()
    return records


# ----------------------------------------------------------------------------- smoke


def test_lm_nnx_command_line(tmp_path):
    """The documented command, with --config overrides through ml_collections flags."""
    workdir = tmp_path / "lm"
    overrides = {
        "trainer.num_steps": 4, "trainer.log_every": 1, "trainer.eval_every": 4,
        "trainer.eval_batches": 1, "trainer.checkpoint_every": 4, "trainer.progress": False,
        "data.batch_size": 2, "data.seq_len": 64, "data.max_pairs": 3,
        "data.max_sentence_len": 12, "model.num_layers": 1, "model.d_model": 32,
        "model.num_heads": 2, "model.num_kv_heads": 2, "model.mlp_dim": 64,
        "model.attention.backend": "xla",
    }
    command = [sys.executable, str(ROOT / "examples" / "lm" / "main.py"),
               f"--workdir={workdir}", f"--config={ROOT / 'configs' / 'lm_nnx.py'}"]
    command += [f"--config.{k}={v}" for k, v in overrides.items()]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "requested backend: xla; chosen: xla" in result.stdout
    assert "summary: step 4" in result.stdout
    check_outputs(workdir, 4)
    config = json.loads((workdir / "config.json").read_text())
    assert config["model"]["attention"]["backend"] == "xla"
    assert config["model"]["d_model"] == 32


def test_lm_equinox_smoke(tmp_path, capsys):
    summary = run_lm(tiny_lm("equinox"), tmp_path)
    records = check_outputs(tmp_path, 6)
    assert records[-1]["loss"] < records[0]["loss"]
    assert "eval_best_loss" in summary and summary["eval_best_loss"] > 0
    out = capsys.readouterr().out
    assert "model: equinox" in out and "summary: step 6" in out


def test_profiled_steps_write_a_trace_and_kernel_times_sum_by_kind(tmp_path):
    """trainer.profile_steps traces those steps; kernel_profile sums a GPU trace by kind."""
    import gzip

    config = tiny_lm("nnx", steps=4)
    config.trainer.profile_start, config.trainer.profile_steps = 1, 2
    run_lm(config, tmp_path)
    traces = list((tmp_path / "profile").glob("plugins/profile/*/perfetto_trace.json.gz"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import kernel_profile

    gpu, host, stream, ops = 7, 1, 20, 3
    events = [{"ph": "M", "pid": gpu, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "pid": host, "name": "process_name", "args": {"name": "/host:CPU"}},
              {"ph": "M", "pid": gpu, "tid": stream, "name": "thread_name",
               "args": {"name": "Stream #20(Compute)"}},
              {"ph": "M", "pid": gpu, "tid": ops, "name": "thread_name",
               "args": {"name": "XLA Ops"}}]
    kernels = [("sm90_xmma_gemm_bf16", 300.0), ("cudnn_generated_sdpa_fwd", 200.0),
               ("loop_add_fusion", 50.0), ("Memcpy HtoD", 10.0), ("sm90_xmma_gemm_bf16", 100.0)]
    events += [{"ph": "X", "pid": gpu, "tid": stream, "name": n, "dur": us, "ts": 0}
               for n, us in kernels]
    # The same time seen as an XLA op, and a host event: neither counts.
    events.append({"ph": "X", "pid": gpu, "tid": ops, "name": "gemm_fusion_dot", "dur": 400.0,
                   "ts": 0})
    events.append({"ph": "X", "pid": host, "name": "sm90_xmma_gemm_bf16", "dur": 9e6, "ts": 0})
    # Host events nest: a dispatch, the execution inside it, a custom call inside that.
    python = 5
    events.append({"ph": "M", "pid": host, "tid": python, "name": "thread_name",
                   "args": {"name": "python"}})
    events += [{"ph": "X", "pid": host, "tid": python, "name": n, "ts": ts, "dur": us}
               for n, ts, us in [("PjitFunction", 0.0, 100.0), ("Execute", 10.0, 60.0),
                                 ("CustomCall", 20.0, 30.0), ("PjitFunction", 200.0, 50.0)]]
    fake = tmp_path / "fake" / "plugins" / "profile" / "run"
    fake.mkdir(parents=True)
    with gzip.open(fake / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = kernel_profile.summarize(tmp_path / "fake", steps=2)
    assert summary["ms_per_step"] == {"matmul": 0.2, "attention": 0.1, "other": 0.025,
                                      "copy": 0.005}
    assert summary["device_ms_per_step"] == 0.33
    assert summary["top_kernels_ms_per_step"][0] == ["sm90_xmma_gemm_bf16", 0.2]
    # [name, own ms, ms in all, calls] per step; the untitled host line above is no thread.
    assert summary["host_top_ms_per_step"] == [["PjitFunction", 0.045, 0.075, 1.0],
                                               ["CustomCall", 0.015, 0.015, 0.5],
                                               ["Execute", 0.015, 0.03, 0.5]]


def test_hbm_stream_moves_the_bytes_of_the_small_seq_floor():
    """benchmarks/probes/hbm_stream.py's streams read and write exactly the bytes small_seq.py's
    floor counts, per pass, and its XLA stream reads every input and writes every output."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "probes"))
    import hbm_stream
    import small_seq

    b, d, block = 30720, 128, 30720 * small_seq.HEADS * 128 * 2
    for s_kv in hbm_stream.S_KV:
        blocks = {p: sum(hbm_stream.block_counts(s_kv, p)) for p in ("fwd", "bwd")}
        assert blocks["fwd"] * block == small_seq.floor_bytes(b, s_kv, d, 2, "fwd")
        assert ((blocks["fwd"] + blocks["bwd"]) * block
                == small_seq.floor_bytes(b, s_kv, d, 2, "fwd+bwd"))

    reads, writes = hbm_stream.block_counts(2, "bwd")
    inputs = [np.full((8,), i + 1, np.float32) for i in range(reads)]
    outputs = hbm_stream.xla_stream(reads, writes)(*inputs)
    assert len(outputs) == writes
    np.testing.assert_array_equal(outputs[0], sum(range(writes + 1, reads + 1)) + 1)
    for w in range(1, writes):
        np.testing.assert_array_equal(outputs[w], 2 * (w + 1))

    rows = [{"name": "x", "shape": {}, "impl": "cuda_stream", "pass": p, "ms": ms}
            for p, ms in (("fwd", 0.25), ("bwd", 0.5))]
    assert hbm_stream.with_fwd_bwd(rows)[-1] == {"name": "x", "shape": {}, "impl": "cuda_stream",
                                                 "pass": "fwd+bwd", "ms": 0.75}



def test_small_seq_summary_adds_device_speedups_where_traced():
    """benchmarks/small_seq.py's summary: wall-time speedups always, device-time speedups
    only where both rows have a --profile trace."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import small_seq

    def row(impl, ms, device_ms=None):
        r = {"name": "x", "impl": impl, "pass": "fwd", "ms": ms, "fraction_of_floor": 0.5}
        if device_ms is not None:
            r["profile"] = {"device_ms_per_step": device_ms}
        return r

    traced = small_seq.summarize([row("small_seq", 0.5, 0.2), row("xla", 0.5, 0.3),
                                  row("cudnn", 2.0)])
    assert traced == [{"name": "x", "impl": "small_seq", "pass": "fwd", "ms": 0.5,
                       "fraction_of_floor": 0.5, "speedup_vs_xla": 1.0,
                       "device_speedup_vs_xla": 1.5, "speedup_vs_cudnn": 4.0}]


def test_median_ms_times_repeats_of_at_least_the_window(monkeypatch):
    """benchmarks' median_ms adds calls to a repeat until --iters of them fill min_window_ms,
    and times exactly --iters calls per repeat without a window (two warm-up calls first).
    A fake clock that each call advances by 2 ms keeps the counts exact on a busy host."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import common

    clock = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])
    calls = []

    def two_ms_call():
        calls.append(1)
        clock[0] += 0.002
        return jnp.zeros(())

    assert common.median_ms(two_ms_call, repeats=3, iters=2, min_window_ms=0.0) == pytest.approx(2.0)
    assert len(calls) == 2 + 3 * 2
    calls.clear()
    # 19 ms of 2 ms calls: 10 per repeat (19 / 2 = 9.5, clear of rounding in the clock's sums)
    assert common.median_ms(two_ms_call, repeats=3, iters=2, min_window_ms=19.0) == pytest.approx(2.0)
    assert len(calls) == 2 + 3 * 10


def test_lm_nnx_without_packing(tmp_path, capsys):
    config = tiny_lm("nnx", steps=3)
    config.data.packing = False
    run_lm(config, tmp_path)
    check_outputs(tmp_path, 3)
    # Without packing the layers get plain causal attention and no descriptor.
    assert "packing off" in capsys.readouterr().out


@pytest.mark.parametrize("layout", ["thd_thd_thd", "bshd_bshd_bshd"])
def test_recommender_smoke(tmp_path, capsys, layout):
    summary = run_recommender(tiny_recommender(qkv_layout=layout), tmp_path)
    check_outputs(tmp_path, 6)
    assert 0 < summary["eval_best_accuracy"] <= 1
    out = capsys.readouterr().out
    assert "requested backend: auto" in out and "small_seq" in out   # the explain() table


# ----------------------------------------------------------------------------- resume


@pytest.mark.parametrize("framework", ["nnx", "equinox"])
def test_resume_is_exact(tmp_path, framework):
    """Stop after step 6 (checkpoint at 4), restart: steps 5-8 log the same losses."""
    steps = 8
    straight = tmp_path / "straight"
    run_lm(tiny_lm(framework, steps=steps), straight)

    interrupted = tmp_path / "interrupted"
    config = tiny_lm(framework, steps=steps)
    config.trainer.halt_after_step = 6     # as if killed: no checkpoint after step 4
    run_lm(config, interrupted)
    assert sorted(losses(interrupted)) == list(range(1, 7))
    assert not (interrupted / "checkpoints" / "6").exists()
    run_lm(tiny_lm(framework, steps=steps), interrupted)

    assert [r["step"] for r in read_metrics(interrupted)] == list(range(1, steps + 1))
    assert losses(interrupted) == losses(straight)      # bitwise: same floats
    assert read_metrics(interrupted)[-1]["eval_loss"] == read_metrics(straight)[-1]["eval_loss"]


# ----------------------------------------------------------------------------- backends


def _curve(workdir):
    return np.array([v for _, v in sorted(losses(workdir).items())])


def test_lm_batches_from_worker_processes_equal_in_thread_ones(tmp_path):
    """config.trainer.data_workers: batches made in 2 spawned processes, in step order:
    the same losses as batches made in the trainer's thread."""
    run_lm(tiny_lm("nnx", steps=5, backend="xla"), tmp_path / "thread")
    config = tiny_lm("nnx", steps=5, backend="xla")
    config.trainer.data_workers = 2
    run_lm(config, tmp_path / "workers")
    np.testing.assert_array_equal(_curve(tmp_path / "workers"), _curve(tmp_path / "thread"))
    config.trainer.data_workers = -1
    with pytest.raises(ValueError, match=r"config.trainer.data_workers must be an int >= 0"):
        run_lm(config, tmp_path / "bad")


def test_lm_xla_and_auto_backends_match(tmp_path):
    run_lm(tiny_lm("nnx", steps=8, backend="xla"), tmp_path / "xla")
    run_lm(tiny_lm("nnx", steps=8, backend="auto"), tmp_path / "auto")
    np.testing.assert_allclose(_curve(tmp_path / "auto"), _curve(tmp_path / "xla"),
                               rtol=2e-3, atol=2e-3)


def test_recommender_xla_and_auto_backends_match(tmp_path):
    run_recommender(tiny_recommender(steps=8, backend="xla"), tmp_path / "xla")
    run_recommender(tiny_recommender(steps=8, backend="auto"), tmp_path / "auto")
    np.testing.assert_allclose(_curve(tmp_path / "auto"), _curve(tmp_path / "xla"),
                               rtol=2e-3, atol=2e-3)


# ----------------------------------------------------------------------------- data


def test_lm_batches_pack_documents_exactly():
    from examples.lm import data
    config = tiny_lm().data
    batches = data.Batches(config, batch_size=4, seq_len=64)
    batch = batches.train(3)
    again = batches.train(3)
    for key in batch:                                   # a pure function of the step
        np.testing.assert_array_equal(batch[key], again[key])
    seg, pos, w = batch["segment_ids"], batch["positions"], batch["weights"]
    assert np.all((seg > 0) == (w > 0))
    for row in range(seg.shape[0]):
        for s in np.unique(seg[row][seg[row] > 0]):
            where = np.nonzero(seg[row] == s)[0]
            assert np.all(np.diff(where) == 1)              # contiguous
            np.testing.assert_array_equal(pos[row, where], np.arange(len(where)))
            assert batch["inputs"][row, where[0]] == data.BOS
    assert np.all(batch["best_nll"] >= 0)
    digits = (batch["targets"] >= ord("0")) & (batch["targets"] <= ord("9"))
    assert np.all(digits[batch["recall"] > 0])
    assert np.all(batch["best_nll"][batch["recall"] > 0] == 0)   # recall is free for the oracle


def test_lm_descriptor_forms_describe_the_same_packing():
    """The lengths + offsets the LM computes from segment ids mean what the ids mean."""
    from examples.lm import data, models
    from examples.lm.train import attention_for_data
    config = tiny_lm()
    batch = data.Batches(config.data, batch_size=4, seq_len=64).train(1)
    infos = []
    for fmt in ("seqlens_offsets", "segment_ids"):
        config.model.attention.sequence.format = fmt
        attention = attention_for_data(config)
        sequence = models.sequence_descriptor(attention, jnp.asarray(batch["segment_ids"]),
                                              jnp.asarray(batch["positions"]))
        assert str(sequence.format) == fmt
        infos.append(sequence.token_info(AttentionSpec.from_config(attention), 64, 64))
    for name, from_offsets, from_ids in zip(infos[0]._fields, *infos):
        np.testing.assert_array_equal(from_offsets, from_ids, name)
    assert np.max(infos[0].q_seg) > 1  # rows really pack several documents


def test_lm_grammar_best_loss_is_a_true_likelihood():
    """The oracle NLLs are those of the sampling process: the per-position mean NLL of
    the sentence's first letter matches its empirical entropy."""
    from examples.lm import data
    grammar = data.Grammar(max_pairs=2, min_pairs=2)
    docs = grammar.sample(np.random.default_rng(0), 20000)
    # Document layout with exactly 2 pairs: BOS K=v,K=v; <first letter> ...
    first = np.array([d.tokens[9] for d in docs])
    first_nll = np.array([d.nll[8] for d in docs])
    counts = np.bincount(first, minlength=data.VOCAB_SIZE)
    empirical = counts[counts > 0] / counts.sum()
    entropy = -(empirical * np.log(empirical)).sum()
    assert abs(first_nll.mean() - entropy) < 0.05


def test_recommender_thd_rows_match_their_descriptor():
    from examples.small_seq import data
    config = tiny_recommender().data
    batch = data.Batches(config, "thd").train(0)
    b, p = batch["kv_seqlens"].shape
    np.testing.assert_array_equal(batch["kv_offsets"][:, 1:] - batch["kv_offsets"][:, :-1],
                                  batch["kv_seqlens"])
    assert np.all((batch["kv_seqlens"] >= 1) & (batch["kv_seqlens"] <= 16))
    np.testing.assert_array_equal(batch["history_valid"].sum(1), batch["kv_seqlens"].sum(1))
    assert batch["context"].shape == (b, p) and batch["history"].shape == (b, 16 * p)
    assert np.all(batch["best_nll"] > 0) and np.all(batch["best_expected_accuracy"] <= 1)


# ----------------------------------------------------------------------------- meshes


@pytest.mark.skipif(jax.device_count() < 2, reason="needs two (host) devices")
def test_lm_on_a_mesh_compiles_the_training_step_once(tmp_path, caplog):
    """The carried state starts on the mesh as each step returns it: no second compilation
    at step 2 (it once made the summary's tokens/s on two GPUs a seventh of the steady rate)."""
    config = tiny_lm("nnx", steps=3, backend="xla")
    config.mesh.data = 2
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        run_lm(config, tmp_path)
    compiles = [r.getMessage() for r in caplog.records
                if re.search(r"Compiling (jit\()?train_step\b", r.getMessage())]
    assert len(compiles) == 1, compiles


@pytest.mark.skipif(jax.device_count() < 4, reason="needs four (host) devices")
@pytest.mark.parametrize("data,context,backend", [(1, 4, "xla"), (1, 4, "flash"),
                                                  (2, 2, "flash")])
def test_lm_context_parallel_matches_one_device(tmp_path, data, context, backend):
    """config.mesh: the sequence split over "context" (ring, load-balanced tokens), the batch
    over "data"; the losses of every step equal the one-device run's."""
    run_lm(tiny_lm("nnx", steps=4, backend=backend), tmp_path / "one")
    config = tiny_lm("nnx", steps=4, backend=backend)
    config.mesh.data, config.mesh.context = data, context
    run_lm(config, tmp_path / "mesh")
    np.testing.assert_allclose(_curve(tmp_path / "mesh"), _curve(tmp_path / "one"),
                               rtol=2e-5, atol=2e-5)
