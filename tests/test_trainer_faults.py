"""The example trainers under faults and bad configs (examples/common, configs/).

- a run killed anywhere (metrics line cut short, checkpoint not committed, SIGKILL at
  random points) resumes to the losses of an uninterrupted run, each step logged once;
- a damaged newest checkpoint falls back to the previous intact one; none intact: one
  clear error;
- a second trainer on a workdir stops; non-finite losses stop the run with the cause;
- config values that would divide by zero or be silently rewritten are errors.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from test_examples import (ROOT, load_config, losses, read_metrics, run_lm, run_recommender,
                           tiny_lm, tiny_recommender)

from examples.common.trainer import TrainerError
from examples.common.workdir import WorkdirLock

STEPS = 8


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted tiny LM run of STEPS steps: its losses are the reference."""
    workdir = tmp_path_factory.mktemp("straight")
    run_lm(tiny_lm("nnx", steps=STEPS), workdir)
    return losses(workdir)


def interrupted(workdir, halt: int, checkpoint_every: int):
    config = tiny_lm("nnx", steps=STEPS)
    config.trainer.checkpoint_every = checkpoint_every
    config.trainer.halt_after_step = halt
    run_lm(config, workdir)


def resume(workdir, checkpoint_every: int = 4):
    config = tiny_lm("nnx", steps=STEPS)
    config.trainer.checkpoint_every = checkpoint_every
    return run_lm(config, workdir)


def assert_each_step_once_and_exact(workdir, straight):
    assert [r["step"] for r in read_metrics(workdir)] == list(range(1, STEPS + 1))
    assert losses(workdir) == straight


# ----------------------------------------------------------------------------- resume


def test_cut_metrics_line_uncommitted_and_damaged_checkpoints(tmp_path, straight, capfd):
    """Checkpoints at 4 and 6, halted at 7; then: the last metrics line cut short, step 6's
    arrays damaged, an uncommitted step 7 directory. Resume uses step 4, exactly."""
    interrupted(tmp_path, halt=7, checkpoint_every=2)
    checkpoints = tmp_path / "checkpoints"
    assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [4, 6]
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 8, "lo')                                  # killed mid-line
    shutil.copytree(checkpoints / "6", checkpoints / "7")
    (checkpoints / "7" / "commit_success.txt").unlink()           # killed before commit
    for array_file in (checkpoints / "6" / "default").rglob("*"):
        if array_file.is_file() and array_file.parent.name == "d":
            array_file.write_bytes(b"damaged")
    capfd.readouterr()
    summary = resume(tmp_path)
    out, err = capfd.readouterr()
    assert "dropped the last line" in out
    assert "checkpoint step 7: not committed" in out
    assert "checkpoint step 6 could not be restored (" in out
    assert "resumed from" in out and "at step 4" in out
    assert "Event loop is closed" not in out + err
    assert_each_step_once_and_exact(tmp_path, straight)
    assert summary["first_loss"] == straight[1]
    aside = sorted(p.name.split("-")[0] for p in (tmp_path / "checkpoints_set_aside").iterdir())
    assert aside == ["6", "7"]


def test_no_intact_checkpoint_is_one_clear_error(tmp_path):
    interrupted(tmp_path, halt=5, checkpoint_every=4)
    shutil.rmtree(tmp_path / "checkpoints" / "4" / "default")        # a missing item folder
    with pytest.raises(TrainerError, match=r"no checkpoint in .* restores \(step 4: "):
        resume(tmp_path)


def test_deleted_metrics_make_the_first_loss_unknown(tmp_path, capsys):
    interrupted(tmp_path, halt=6, checkpoint_every=4)
    (tmp_path / "metrics.jsonl").unlink()
    summary = resume(tmp_path)
    assert [r["step"] for r in read_metrics(tmp_path)] == [5, 6, 7, 8]
    assert summary["first_loss"] is None
    assert "first unknown" in capsys.readouterr().out


def test_a_damaged_metrics_line_before_the_last_is_an_error(tmp_path):
    interrupted(tmp_path, halt=6, checkpoint_every=4)
    path = tmp_path / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = lines[2][:10]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"metrics: line 3 of .* is not JSON"):
        resume(tmp_path)


def test_sigkill_at_random_points_then_resume(tmp_path, straight, seed):
    """SIGKILL the command-line trainer at random moments (checkpoints every 2 steps) until
    it finishes; the record then equals an uninterrupted run's, each step once."""
    rng = np.random.default_rng(seed)
    kills = int(os.environ.get("FUSEDATTN_KILL_POINTS", "3"))
    overrides = {**_tiny_lm_flags(), "trainer.checkpoint_every": 2}
    command = [sys.executable, str(ROOT / "examples" / "lm" / "main.py"),
               f"--workdir={tmp_path}", f"--config={ROOT / 'configs' / 'lm_nnx.py'}"]
    command += [f"--config.{k}={v}" for k, v in overrides.items()]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    # How long a whole run takes, so kill points spread over startup, steps and saves.
    started = time.monotonic()
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    first.wait(timeout=600)
    duration = time.monotonic() - started
    assert first.returncode == 0
    shutil.rmtree(tmp_path)
    for _ in range(kills):
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        try:
            process.wait(timeout=rng.uniform(0.3, 1.0) * duration)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGKILL)
            process.wait()
    final = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert final.returncode == 0, final.stderr[-2000:]
    assert_each_step_once_and_exact(tmp_path, straight)


def _tiny_lm_flags() -> dict:
    config = tiny_lm("nnx", steps=STEPS)
    flat = {}
    for section in ("data", "model", "trainer", "optim"):
        for key, value in config[section].items():
            if not hasattr(value, "items"):
                flat[f"{section}.{key}"] = value
    return flat


# ----------------------------------------------------------------------------- one run


def test_second_trainer_on_a_workdir_stops(tmp_path):
    with WorkdirLock(tmp_path):
        with pytest.raises(RuntimeError, match=rf"workdir: .* is in use by another trainer "
                           rf"\(process {os.getpid()}\)"):
            run_lm(tiny_lm("nnx", steps=2), tmp_path)
    run_lm(tiny_lm("nnx", steps=2), tmp_path)            # released: runs


def test_non_finite_loss_stops_with_the_broken_bound(tmp_path):
    """Histories of up to 16 items with a declared bound of 8: the op marks NaN; the
    trainer stops at step 1 naming the bound, and writes no checkpoint."""
    config = tiny_recommender(steps=6)
    config.model.attention.sequence.max_seqlen_kv = 8
    with pytest.raises(TrainerError, match=r"(?s)non-finite \(NaN/Inf\) at step 1; .*no checkpoint "
                       r"was written.*Cause.*max_seqlen_kv=8") as error:
        run_recommender(config, tmp_path)
    assert "config.model.attention" in str(error.value)
    assert not any((tmp_path / "checkpoints").glob("[0-9]*"))
    assert not (tmp_path / "metrics.jsonl").read_text().strip()


def test_non_finite_loss_without_an_attention_cause(tmp_path):
    config = tiny_lm("nnx", steps=6)
    config.optim.learning_rate = float("inf")
    with pytest.raises(TrainerError, match=r"(?s)non-finite .* at step 2.*No attention check"):
        run_lm(config, tmp_path)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize("key,value,message", [
    ("trainer.keep_checkpoints", 0, r"config.trainer.keep_checkpoints: got 0; expected an int "
     r">= 1 \(the final checkpoint is always kept\)"),
    ("trainer.num_steps", -3, r"config.trainer.num_steps: got -3"),
    ("trainer.log_every", 0, r"config.trainer.log_every: got 0"),
    ("trainer.eval_every", 0, r"config.trainer.eval_every: got 0"),
    ("trainer.checkpoint_every", 0, r"config.trainer.checkpoint_every: got 0"),
    ("data.batch_size", 0, r"config.data.batch_size: got 0"),
    ("model.num_heads", 0, r"config.model.num_heads: got 0"),
    ("model.d_model", 2, r"config.model.d_model \(2\) must be a multiple of "
     r"config.model.num_heads \(4\)"),
])
@pytest.mark.parametrize("trainer", ["lm", "recommender"])
def test_bad_counts_are_errors(tmp_path, trainer, key, value, message):
    config = tiny_lm("nnx") if trainer == "lm" else tiny_recommender()
    if trainer == "recommender" and key == "model.d_model":
        value, message = 1, message.replace(r"\(2\)", r"\(1\)").replace(r"\(4\)", r"\(2\)")
        config.model.num_heads = 2
    if trainer == "lm":
        config.model.num_heads = 4
    section, name = key.split(".")
    config[section][name] = value
    run = run_lm if trainer == "lm" else run_recommender
    with pytest.raises(ValueError, match=message):
        run(config, tmp_path)


def test_config_keys_are_independent():
    lm = load_config("lm_nnx")
    lm.model.max_len = 64
    assert lm.data.seq_len == 128
    recommender = load_config("small_seq")
    recommender.model.attention.sequence.max_segments_per_seq = 2
    assert recommender.data.users_per_row == 4
    gpu = load_config("lm_nnx", "gpu")
    assert gpu.model.max_len >= gpu.data.seq_len


def test_disagreeing_keys_are_errors(tmp_path):
    lm = tiny_lm("nnx")
    lm.model.max_len = 32
    with pytest.raises(ValueError, match=r"config.model.max_len \(32\) must be >= "
                       r"config.data.seq_len \(64\)"):
        run_lm(lm, tmp_path)
    recommender = tiny_recommender()
    recommender.model.attention.sequence.max_segments_per_seq = 2
    with pytest.raises(ValueError, match=r"max_segments_per_seq \(2\) must be >= "
                       r"config.data.users_per_row \(4\)"):
        run_recommender(recommender, tmp_path)


def test_no_mask_with_packing_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"config.model.attention.mask: 'no_mask' does not "
                       r"keep packed documents apart"):
        run_lm(tiny_lm("nnx", mask="no_mask"), tmp_path)


def test_lm_honours_the_sbhd_layout(tmp_path):
    run_lm(tiny_lm("nnx", steps=2, qkv_layout="sbhd_sbhd_sbhd", backend="xla"), tmp_path / "s")
    run_lm(tiny_lm("nnx", steps=2, backend="xla"), tmp_path / "b")
    np.testing.assert_allclose([losses(tmp_path / "s")[i] for i in (1, 2)],
                               [losses(tmp_path / "b")[i] for i in (1, 2)], rtol=1e-5)


def test_recommender_honours_the_sbhd_layout(tmp_path):
    run_recommender(tiny_recommender(steps=2, qkv_layout="sbhd_sbhd_sbhd", backend="xla"),
                    tmp_path / "s")
    run_recommender(tiny_recommender(steps=2, qkv_layout="bshd_bshd_bshd", backend="xla"),
                    tmp_path / "b")
    np.testing.assert_allclose([losses(tmp_path / "s")[i] for i in (1, 2)],
                               [losses(tmp_path / "b")[i] for i in (1, 2)], rtol=1e-5)
