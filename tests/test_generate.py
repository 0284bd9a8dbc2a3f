"""examples/lm/generate.py: paged-cache text generation with the example LM (tiny config).

The script's own check (every greedy token is the full-sequence model's argmax) is
what these tests lean on, so one test shows that the check catches a wrong token.
"""

from __future__ import annotations

import subprocess
import sys

import jax
import numpy as np
import pytest
from test_examples import ROOT, run_lm, tiny_lm

pytest.importorskip("orbax.checkpoint")

from examples.lm import generate  # noqa: E402

TINY = ["--config.data.batch_size=4", "--config.data.seq_len=64", "--config.data.max_pairs=3",
        "--config.data.max_sentence_len=12", "--config.model.num_layers=1",
        "--config.model.d_model=32", "--config.model.num_heads=2",
        "--config.model.num_kv_heads=1", "--config.model.mlp_dim=64"]


def test_generate_trains_when_no_checkpoint_and_greedy_equals_full_model(tmp_path, capsys):
    config = tiny_lm("nnx", steps=4)
    result = generate.run(config, tmp_path, num_prompts=3, max_new_tokens=10, page_size=4,
                          train_steps=4)
    out = capsys.readouterr().out
    assert "training 4 steps first" in out and "loaded the checkpoint of step 4" in out
    assert result["checked"] == sum(len(c) for c in result["greedy"]) > 3
    assert result["exact"] >= result["checked"] - 1
    assert any(len(g) != len(s) or (g != s).any()
               for g, s in zip(result["greedy"], result["sampled"]))
    assert result["tokens_per_second"] > 0


def test_greedy_check_catches_a_wrong_token(tmp_path):
    config = tiny_lm("nnx", steps=2)
    run_lm(config, tmp_path)
    model, params = generate.load_params(config, tmp_path, train_steps=2)
    prompts = generate.make_prompts(config, 2, seed=1)
    decoder = model.paged_decoder(params, num_pages=8, page_size=8)
    run = generate.generate(decoder, prompts, 5, page_size=8, num_pages=8, temperature=0.0,
                            key=jax.random.key(0))
    checked, exact, wrong = generate.check_greedy(model, params, prompts, run.continuations)
    assert wrong == 0 and checked == sum(map(len, run.continuations))
    broken = [c.copy() for c in run.continuations]
    broken[0][0] = (broken[0][0] + 1) % config.model.vocab_size
    assert generate.check_greedy(model, params, prompts, broken)[2] >= 1


def test_generate_command_line_loads_the_trainers_checkpoint(tmp_path):
    workdir = tmp_path / "lm"
    run_lm(tiny_lm("nnx", steps=3), workdir)
    command = [sys.executable, str(ROOT / "examples" / "lm" / "generate.py"),
               f"--workdir={workdir}", f"--config={ROOT / 'configs' / 'lm_nnx.py'}", *TINY,
               "--num_prompts=2", "--max_new_tokens=6", "--page_size=8"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loaded the checkpoint of step 3" in done.stdout
    assert "tokens/s" in done.stdout and "0 off by more than" in done.stdout
    assert np.sum(["->" in line for line in done.stdout.splitlines()]) == 4
