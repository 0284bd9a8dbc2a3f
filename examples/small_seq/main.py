r"""Trains a next-item recommender whose queries attend to <= 16 history items (small_seq).

    python examples/small_seq/main.py --workdir=/tmp/recsys --config=configs/small_seq.py
    python examples/small_seq/main.py --workdir=/tmp/recsys_bshd --config=configs/small_seq.py \
        --config.model.attention.qkv_layout=bshd_bshd_bshd

Prints fusedattn.ops.explain() for the attention call at start-up: which backend
"auto" picked and why every other one (small_seq included) could or could not.

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

from examples.small_seq import train  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots.")
config_flags.DEFINE_config_file(
    "config", None, "Trainer config file, e.g. configs/small_seq.py.",
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
