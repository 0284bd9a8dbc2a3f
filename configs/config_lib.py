"""Pieces shared by the trainer configs: attention presets and the optimiser and
trainer sections. Config files are loaded by path (ml_collections config_flags),
so they reach this module by putting this directory on sys.path."""

import importlib.util
import pathlib

import ml_collections

CONFIG_DIR = pathlib.Path(__file__).resolve().parent


def load(relative_path: str):
    """Executes a config file of this directory (e.g. "attention/xla.py") as a module."""
    path = CONFIG_DIR / relative_path
    name = "_fusedattn_config_" + relative_path.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def attention_preset(name: str) -> ml_collections.ConfigDict:
    """The attention config of configs/attention/NAME.py."""
    return load(f"attention/{name}.py").get_config()


def optim_config(weight_decay: float) -> ml_collections.ConfigDict:
    """adamw with linear warmup, cosine decay to end_lr_ratio, global-norm clipping."""
    optim = ml_collections.ConfigDict()
    optim.learning_rate = 3e-3
    optim.warmup_steps = 50
    optim.end_lr_ratio = 0.05
    optim.weight_decay = weight_decay
    optim.b1 = 0.9
    optim.b2 = 0.98
    optim.eps = 1e-8
    optim.grad_clip = 1.0
    return optim


def trainer_config(num_steps: int, log_every: int, eval_every: int,
                   checkpoint_every: int) -> ml_collections.ConfigDict:
    """Loop length, logging, evaluation and checkpoint cadence."""
    trainer = ml_collections.ConfigDict()
    trainer.num_steps = num_steps
    trainer.log_every = log_every
    trainer.eval_every = eval_every
    trainer.eval_batches = 8
    trainer.checkpoint_every = checkpoint_every
    trainer.keep_checkpoints = 2
    trainer.progress = True
    trainer.prefetch = 2
    trainer.data_workers = 0      # > 0: worker processes make the batches (a GPU step can
                                  # outpace one CPU core's pure-Python data pipeline)
    trainer.peak_flops = 989e12  # dense bf16 peak of an H100/H200 SXM, for MFU
    trainer.profile_steps = 0     # > 0: trace that many steps with jax.profiler into
    trainer.profile_start = 20    # WORKDIR/profile, from this step (after compilation)
    trainer.halt_after_step = -1  # >= 0: stop there without a final checkpoint
                                  # (simulates a killed run; for tests)
    return trainer
