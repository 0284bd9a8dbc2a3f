"""Decoder-only LM on the generated grammar corpus (examples/lm), Equinox model.

The same trainer and settings as configs/lm_nnx.py (variants too:
--config=configs/lm_equinox.py:gpu), with config.model.framework = "equinox":
the blocks use fusedattn.layers.equinox.MultiheadAttention, vmapped over the batch.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import config_lib  # noqa: E402  (configs/ is not a package: config files load by path)


def get_config(arg: str = ""):
    config = config_lib.load("lm_nnx.py").get_config(arg)
    config.model.framework = "equinox"
    return config
