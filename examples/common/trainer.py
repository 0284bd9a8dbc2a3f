"""A small, complete training loop shared by the example trainers.

A trainer builds a `Task` (its model's parameters as a nested dict of arrays,
a loss function, batches as a pure function of the step, FLOP counts) and calls
`train_and_evaluate(config, workdir, task)`, which runs

* optax AdamW with linear warmup, cosine decay and global-norm gradient clipping,
* a tqdm progress bar showing the loss and tokens/s,
* periodic evaluation,
* metrics as JSON lines in WORKDIR/metrics.jsonl (every line has "step" and "loss"),
* orbax checkpoints in WORKDIR/checkpoints with exact resume: batches and dropout
  keys are functions of (seed, step), so a run killed and restarted with the same
  workdir logs the same later losses as one that never stopped,
* a loss-curve PNG (WORKDIR/loss.png) and a summary line (final loss, tokens/s
  and, off the CPU, model FLOP utilisation against config.trainer.peak_flops).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import pathlib
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import checkify

from examples.common.checkpoints import Checkpoints
from examples.common.pipeline import Prefetch, StepProfiler
from examples.common.plots import plot_losses
from examples.common.trees import trained_part
from examples.common.workdir import MetricsLog, WorkdirLock

Batch = dict[str, np.ndarray]
# Evaluation returns, per metric name, a (numerator, denominator) pair of sums so that
# metrics over several batches are exact token-weighted means.
EvalSums = dict[str, tuple[jax.Array, jax.Array]]


@dataclasses.dataclass
class Task:
    """What a trainer hands to `train_and_evaluate`.

    params: the trainable parameters, a nested dict of float arrays (see `named_leaves`).
    loss_fn: (params, batch, dropout_key or None) -> (scalar loss, dict of scalar metrics).
    eval_fn: (params, batch) -> EvalSums; "loss" is required.
    train_batch: step (0-based) -> Batch of host (NumPy) arrays, a pure function of the
      step; picklable (e.g. a bound method) when config.trainer.data_workers > 0, which
      makes the batches in worker processes.
    place_batch: None, or Batch -> Batch run on each batch in this process before the step
      (e.g. device_put over the mesh).
    eval_batch: index -> Batch.
    tokens_per_step: tokens (or examples) one training step consumes, for throughput.
    flops_per_step: model FLOPs of one training step (forward and backward).
    reference: known-best numbers for the summary, e.g. {"eval_best_loss": 1.1}.
    unit: what tokens_per_step counts ("tokens", "examples").
    mesh: None, or the jax.sharding.Mesh the steps run under (jax.set_mesh); the
      batches then come laid out over it.
    overwrite_with_gradient: top-level keys of params that are state, not weights: each
      step replaces them by their gradient (the FP8 scales and amax histories, whose
      gradient is their new value: fusedattn.ops.fp8), and the optimizer never sees them.
    after_update: None, or (updated params, loss_fn's metrics) -> (params, metrics), run
      in each step after the optimizer (e.g. QK-clip); the metrics it returns are logged.
    """

    params: Any
    loss_fn: Callable
    eval_fn: Callable
    train_batch: Callable[[int], Batch]
    eval_batch: Callable[[int], Batch]
    tokens_per_step: int
    flops_per_step: float
    reference: dict[str, float] = dataclasses.field(default_factory=dict)
    unit: str = "tokens"
    mesh: Any = None
    overwrite_with_gradient: tuple[str, ...] = ()
    after_update: Callable | None = None
    place_batch: Callable[[Batch], Batch] | None = None

    def batch(self, step: int) -> Batch:
        """The training batch of `step`, placed."""
        return self.placed(self.train_batch(step))

    def placed(self, batch: Batch) -> Batch:
        return batch if self.place_batch is None else self.place_batch(batch)

    def trained(self, params: dict) -> dict:
        return trained_part(params, self.overwrite_with_gradient)


# ----------------------------------------------------------------------------- optimizer


def make_optimizer(optim, num_steps: int):
    """(AdamW with global-norm clipping, its schedule): linear warmup, cosine decay to
    end_lr_ratio * peak."""
    warmup = min(optim.warmup_steps, max(num_steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=optim.learning_rate, warmup_steps=warmup,
        decay_steps=max(num_steps, warmup + 1), end_value=optim.learning_rate * optim.end_lr_ratio)

    def decay_mask(params):  # weight decay on matrices only, not on biases or norm scales
        return jax.tree.map(lambda x: x.ndim >= 2, params)

    return optax.chain(
        optax.clip_by_global_norm(optim.grad_clip),
        optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                    weight_decay=optim.weight_decay, mask=decay_mask),
    ), schedule


class TrainerError(RuntimeError):
    """A run that stops for a reason the user can act on (the message says which)."""


def check_positive(config, *keys: str) -> None:
    """ValueError naming the key unless each dotted `key` of config is an int >= 1
    (counts, sizes and cadences that the loop, the data or the model divide by)."""
    for key in keys:
        value = config
        for part in key.split("."):
            value = value[part]
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            hint = (" (the final checkpoint is always kept)"
                    if key == "trainer.keep_checkpoints" else "")
            raise ValueError(f"config.{key}: got {value!r}; expected an int >= 1{hint}.")


def check_trainer_config(config) -> None:
    """Validates config.trainer's counts and cadences; ValueError naming the key."""
    check_positive(config, *(f"trainer.{key}" for key in (
        "num_steps", "log_every", "eval_every", "eval_batches", "checkpoint_every",
        "keep_checkpoints")))
    workers = config.trainer.data_workers
    if not isinstance(workers, int) or workers < 0:
        raise ValueError(f"config.trainer.data_workers must be an int >= 0 (0: batches made in "
                         f"the trainer's own thread), got {workers!r}.")


def train_and_evaluate(config, workdir: str | pathlib.Path, task: Task,
                       title: str = "training") -> dict:
    """Trains `task` per config.trainer / config.optim; returns the summary dict.

    Holds WORKDIR/.lock for the run (a second trainer on the workdir stops with
    TrainerError). Each step's loss and gradient norm are checked on the device: the
    first non-finite one freezes the parameters and, at the next logging point, stops
    the run with TrainerError naming the step (and the broken bound, where the op's
    checkify checks explain it); no checkpoint after that step is written.
    """
    workdir = pathlib.Path(workdir)
    check_trainer_config(config)
    workdir.mkdir(parents=True, exist_ok=True)
    with WorkdirLock(workdir):
        return _train(config, workdir, task, title)


def _train(config, workdir: pathlib.Path, task: Task, title: str) -> dict:
    tc = config.trainer
    num_steps = tc.num_steps
    tx, schedule = make_optimizer(config.optim, num_steps)
    platform = jax.devices()[0].platform
    devices = 1 if task.mesh is None else task.mesh.size   # MFU is per device

    opt_state = tx.init(task.trained(task.params))
    checkpoints = Checkpoints(workdir / "checkpoints", tc.keep_checkpoints)
    start_step, state = checkpoints.restore_latest({"params": task.params, "opt_state": opt_state},
                                                   _print)
    params, opt_state = state["params"], state["opt_state"]
    log = MetricsLog(workdir / "metrics.jsonl", start_step)
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))

    dropout_root = jax.random.key(config.seed + 1)

    def train_step(params, opt_state, batch, step, first_bad):
        key = jax.random.fold_in(dropout_root, step)
        (loss, aux), grads = jax.value_and_grad(task.loss_fn, has_aux=True)(params, batch, key)
        trained = task.trained(params)
        grad_norm = optax.tree.norm(task.trained(grads))
        updates, new_opt_state = tx.update(task.trained(grads), opt_state, trained)
        new_params = {**grads, **optax.apply_updates(trained, updates)}
        if task.after_update is not None:
            new_params, aux = task.after_update(new_params, aux)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # From the first non-finite step on, nothing changes: the parameters stay those
        # before it (so no checkpoint can hold NaN, and the step can be diagnosed).
        apply = finite & (first_bad < 0)
        keep = lambda new, old: jnp.where(apply, new, old)  # noqa: E731
        params = jax.tree.map(keep, new_params, params)
        opt_state = jax.tree.map(keep, new_opt_state, opt_state)
        first_bad = jnp.where((first_bad < 0) & ~finite, step, first_bad)
        metrics = dict(aux, loss=loss, grad_norm=grad_norm, lr=schedule(step))
        return params, opt_state, metrics, first_bad

    train_step = _under_mesh(task.mesh, jax.jit(train_step, donate_argnums=(0, 1)))
    eval_step = _under_mesh(task.mesh, jax.jit(task.eval_fn))
    first_bad = jnp.asarray(-1, jnp.int32)   # 0-based index of the first non-finite step
    if task.mesh is not None:
        # The step's carried state starts on the mesh, replicated, as each step returns it:
        # otherwise the second step compiles the training step again for the new placement.
        on_mesh = jax.sharding.NamedSharding(task.mesh, jax.sharding.PartitionSpec())
        params, opt_state, first_bad = jax.device_put((params, opt_state, first_bad), on_mesh)

    def stop_if_broken(first_bad_step: int) -> None:
        if first_bad_step >= 0:
            raise TrainerError(_non_finite_message(task, params, first_bad_step, dropout_root,
                                                   checkpoints.latest_step()))

    def evaluate(params) -> dict[str, float]:
        totals: dict[str, list[float]] = {}
        for i in range(tc.eval_batches):
            sums = jax.device_get(eval_step(params, task.eval_batch(i)))
            for name, (num, den) in sums.items():
                acc = totals.setdefault(name, [0.0, 0.0])
                acc[0] += float(num)
                acc[1] += float(den)
        return {f"eval_{k}": n / max(d, 1e-9) for k, (n, d) in totals.items()}

    stop = num_steps if tc.halt_after_step < 0 else min(num_steps, tc.halt_after_step)
    data = Prefetch(task, start_step, stop, tc.prefetch, tc.data_workers)
    bar = None
    if tc.progress:
        from tqdm import tqdm

        bar = tqdm(total=num_steps, initial=start_step, desc=title, unit="step",
                   dynamic_ncols=True, file=sys.stderr)
    last = {"loss": float("nan")}
    train_seconds, train_steps = 0.0, 0          # steady-state (after the first interval)
    interval_start, interval_steps, overhead = time.perf_counter(), 0, 0.0
    first_interval = True
    profiler = StepProfiler(workdir / "profile", tc.profile_start, tc.profile_steps)
    try:
        for step in range(start_step, stop):
            profiler.at_step(step)
            batch = data.next()
            params, opt_state, metrics, first_bad = train_step(
                params, opt_state, batch, jnp.asarray(step, jnp.int32), first_bad)
            done = step + 1
            profiler.after_step(done)
            interval_steps += 1
            is_eval = done % tc.eval_every == 0 or done == num_steps
            if done % tc.log_every == 0 or done == 1 or is_eval:
                metrics, bad = jax.device_get((metrics, first_bad))
                stop_if_broken(int(bad))
                elapsed = time.perf_counter() - interval_start - overhead
                record = {"step": done, **{k: float(v) for k, v in metrics.items()}}
                if not first_interval and elapsed > 0:
                    rate = interval_steps * task.tokens_per_step / elapsed
                    record[f"{task.unit}_per_s"] = rate
                    train_seconds += elapsed
                    train_steps += interval_steps
                    if platform != "cpu" and task.flops_per_step:
                        record["mfu"] = (interval_steps * task.flops_per_step / elapsed
                                         / (tc.peak_flops * devices))
                first_interval = False
                if is_eval:
                    record.update(evaluate(params))
                log.write(record)
                last = record
                if bar is not None:
                    postfix = {"loss": f"{record['loss']:.3f}"}
                    if f"{task.unit}_per_s" in record:
                        postfix[f"{task.unit[:3]}/s"] = f"{record[f'{task.unit}_per_s']:.0f}"
                    if "eval_loss" in record:
                        postfix["eval"] = f"{record['eval_loss']:.3f}"
                    bar.set_postfix(postfix, refresh=False)
                interval_start, interval_steps, overhead = time.perf_counter(), 0, 0.0
            if bar is not None:
                bar.update(1)
            if done % tc.checkpoint_every == 0 or done == num_steps:
                t0 = time.perf_counter()
                stop_if_broken(int(first_bad))
                checkpoints.save(done, {"params": params, "opt_state": opt_state})
                overhead += time.perf_counter() - t0
        stop_if_broken(int(first_bad))
    finally:
        profiler.stop()
        data.close()
        if bar is not None:
            bar.close()
        checkpoints.close()

    records = log.read()
    if records and records[-1]["step"] >= last.get("step", 0):
        last = records[-1]   # also when resuming a run that had already finished
    if records:
        plot_losses(records, workdir / "loss.png", title, task.reference)
    summary = _summary(records, last, train_seconds, train_steps, task, tc, platform, devices)
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _print(_summary_line(summary, task.unit))
    return summary


def _under_mesh(mesh, fn: Callable) -> Callable:
    """fn, called under jax.set_mesh(mesh) when a mesh is given."""
    if mesh is None:
        return fn

    def call(*args):
        with jax.set_mesh(mesh):
            return fn(*args)
    return call
def _non_finite_message(task: Task, params, step: int, dropout_root, checkpoint: int | None
                        ) -> str:
    """Why step `step` (0-based) went non-finite: re-runs its loss under checkify.

    The parameters are those before that step (the step and all after it were not
    applied), and the batch and dropout key are functions of the step, so this is the
    same computation; the op's checks (e.g. a declared sequence bound that the data
    breaks) then name the cause.
    """
    checked = checkify.checkify(task.loss_fn, errors=checkify.user_checks)
    error, _ = jax.jit(checked)(params, task.batch(step),
                                jax.random.fold_in(dropout_root, step))
    cause = error.get()
    where = (f"the newest checkpoint is step {checkpoint}" if checkpoint
             else "no checkpoint was written")
    message = (f"training stopped: the loss or the gradients are non-finite (NaN/Inf) at step "
               f"{step + 1}; nothing from that step on was applied or saved ({where}).")
    if cause:
        return (f"{message}\nCause, from the attention op's checks: {cause.strip()}\n(The "
                "attention keys named there live under config.model.attention, e.g. "
                "--config.model.attention.sequence.max_seqlen_kv=...)")
    return (f"{message} No attention check explains it: lower config.optim.learning_rate, "
            "or look at the data of that step.")


def _summary(records, last, seconds, steps, task: Task, tc, platform, devices: int) -> dict:
    # The first loss only when the record starts at step 1 (metrics.jsonl may have been
    # removed before a resume); otherwise it is unknown and the summary says so.
    first = records[0]["loss"] if records and records[0]["step"] == 1 else None
    summary = {"step": last.get("step", 0), "final_loss": last.get("loss"),
               "first_loss": first}
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        summary.update({k: v for k, v in evals[-1].items() if k.startswith("eval_")})
    summary.update(task.reference)
    if steps:
        summary[f"{task.unit}_per_s"] = steps * task.tokens_per_step / seconds
        if platform != "cpu" and task.flops_per_step:
            summary["mfu"] = steps * task.flops_per_step / seconds / (tc.peak_flops * devices)
    summary["platform"] = platform
    return summary


def _summary_line(s: dict, unit: str) -> str:
    parts = [f"summary: step {s['step']}"]
    if s.get("first_loss") is not None:
        parts.append(f"loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}")
    elif s.get("final_loss") is not None:
        parts.append(f"loss (first unknown: metrics.jsonl lacks step 1) -> "
                     f"{s['final_loss']:.4f}")
    if "eval_loss" in s:
        parts.append(f"eval_loss {s['eval_loss']:.4f}")
    if "eval_best_loss" in s:
        parts.append(f"best possible {s['eval_best_loss']:.4f}")
    for key in sorted(s):
        if key.startswith("eval_") and key not in ("eval_loss", "eval_best_loss"):
            parts.append(f"{key} {s[key]:.4f}")
    if f"{unit}_per_s" in s:
        parts.append(f"{unit}/s {s[f'{unit}_per_s']:.0f}")
    if "mfu" in s:
        parts.append(f"MFU {100 * s['mfu']:.1f}%")
    parts.append(f"on {s['platform']}")
    return ", ".join(parts)


def _print(message: str) -> None:
    print(message, flush=True)
