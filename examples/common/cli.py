"""The command line shared by the trainers: --workdir, --config (ml_collections
config file, overridable with --config.a.b=value), absl app plumbing."""

from __future__ import annotations

import sys
from typing import Callable

from absl import app, flags, logging
from ml_collections import config_flags

from examples.common.trainer import TrainerError


def run(train_and_evaluate: Callable, config_help: str) -> None:
    """Parses the flags and calls train_and_evaluate(config, workdir)."""
    flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots.")
    config_flags.DEFINE_config_file("config", None, config_help, lock_config=True)
    flags.mark_flags_as_required(["config", "workdir"])

    def main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"Too many command-line arguments: {argv[1:]}")
        if not flags.FLAGS["verbosity"].present:  # orbax logs every checkpoint step at INFO
            logging.set_verbosity(logging.WARNING)
        try:
            train_and_evaluate(flags.FLAGS.config, flags.FLAGS.workdir)
        except TrainerError as error:   # a stop the message explains: no traceback
            print(f"error: {error}", file=sys.stderr, flush=True)
            sys.exit(1)

    app.run(main)
