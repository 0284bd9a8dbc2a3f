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

from examples.common import cli  # noqa: E402
from examples.lm import train  # noqa: E402

if __name__ == "__main__":
    cli.run(train.train_and_evaluate, "Trainer config file, e.g. configs/lm_nnx.py or configs/lm_nnx.py:gpu.")
