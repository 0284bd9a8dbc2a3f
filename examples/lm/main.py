r"""Trains a decoder-only LM on a generated corpus with a known best loss.

    python examples/lm/main.py --workdir=/tmp/lm_nnx --config=configs/lm_nnx.py
    python examples/lm/main.py --workdir=/tmp/lm_eqx --config=configs/lm_equinox.py
    python examples/lm/main.py --workdir=/tmp/lm --config=configs/lm_nnx.py \
        --config.model.attention.backend=xla --config.trainer.num_steps=300

Writes WORKDIR/metrics.jsonl, WORKDIR/loss.png, WORKDIR/summary.json and orbax
checkpoints in WORKDIR/checkpoints; rerunning with the same workdir resumes.
"""

import pathlib
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from examples.lm import train  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots.")
config_flags.DEFINE_config_file(
    "config", None, "Trainer config file, e.g. configs/lm_nnx.py or configs/lm_nnx.py:gpu.",
    lock_config=True)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Too many command-line arguments: {argv[1:]}")
    if not FLAGS["verbosity"].present:   # orbax logs every checkpoint step at INFO
        logging.set_verbosity(logging.WARNING)
    train.train_and_evaluate(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main)
