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

from examples.common import cli  # noqa: E402
from examples.small_seq import train  # noqa: E402

if __name__ == "__main__":
    cli.run(train.train_and_evaluate, "Trainer config file, e.g. configs/small_seq.py.")
