"""The example LM trainer's FP8 attention (config.model.attention.fp8.enabled, emulated on
the CPU: within 2% of the bfloat16 run's loss at the same step, the attention layers'
FP8 state written back from its gradient each step) and QK-clip (config.model.qk_clip)."""

from __future__ import annotations

import numpy as np
import pytest
from test_examples import losses, read_metrics, run_lm, tiny_lm

pytest.importorskip("orbax.checkpoint")

from examples.lm import generate, models  # noqa: E402

STEPS = 12


def _config(fp8: bool):
    config = tiny_lm("nnx", steps=STEPS)
    config.model.dtype = "bfloat16"
    config.trainer.checkpoint_every = STEPS
    config.model.attention.fp8.enabled = fp8
    return config


def test_fp8_trains_within_two_percent_of_bf16_and_keeps_its_state(tmp_path):
    run_lm(_config(False), tmp_path / "bf16")
    run_lm(_config(True), tmp_path / "fp8")
    bf16, fp8 = losses(tmp_path / "bf16"), losses(tmp_path / "fp8")
    assert fp8[1] != bf16[1], "the FP8 run computed the same loss: is FP8 on?"
    assert abs(fp8[STEPS] - bf16[STEPS]) <= 0.02 * bf16[STEPS], (fp8[STEPS], bf16[STEPS])
    assert fp8[STEPS] < fp8[1]

    _, params = generate.load_params(_config(True), tmp_path / "fp8", train_steps=0)
    (layer,) = params[models.FP8_STATE]["blocks"].values()
    history = np.asarray(layer["attn"]["fp8_amax_history"])
    # One row per step, newest first, every tensor (do and dp from the gradient) recorded.
    assert np.all(history[:STEPS] > 0) and np.all(history[STEPS:] == 0), history[:, 5]
    scale = np.asarray(layer["attn"]["fp8_scale"])
    np.testing.assert_allclose(scale[:3], 448.0 / history[:, :3].max(axis=0), rtol=1e-5)



def test_qk_clip_rescale_brings_every_head_to_the_threshold():
    """On the batch whose max logits it was given, the rescaled weights' logits are at most
    min(their old max, the threshold) per head (GQA: a group's keys take its smallest
    factor, so heads under the threshold may shrink too)."""
    import jax

    from examples.lm import qk_clip, train

    config = tiny_lm("nnx", steps=1)
    config.model.qk_clip = 1e9     # builds the layers that report their max logit
    config.model.num_layers = 2
    model = models.build(config.model, train.attention_for_data(config), config.seed)
    batch = train.make_task(config, verbose=False).train_batch(0)
    inputs = (batch["inputs"], batch["positions"], batch["segment_ids"])
    logits_of = jax.jit(model.apply_with_max_logit)
    params = jax.tree.map(lambda x: 4.0 * x, model.params)   # logits well above 1
    _, before = logits_of(params, *inputs)
    threshold = float(np.median(np.asarray(before)))
    _, after = logits_of(qk_clip.rescale(params, before, threshold), *inputs)
    before, after = np.asarray(before), np.asarray(after)
    assert before.shape == (2, 2) and (before > threshold).any() and (before < threshold).any()
    assert np.all(after <= np.minimum(before, threshold) + 1e-4), (before, after)
    assert np.all(np.isclose(after, threshold, rtol=1e-4)[before > threshold])


def test_trainer_runs_qk_clip_and_logs_the_max_logit(tmp_path):
    config = tiny_lm("nnx", steps=4)
    config.model.qk_clip = 0.5
    run_lm(config, tmp_path)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(np.isfinite(r["max_logit"]) for r in records)
