"""Decoder-only LM on the generated grammar corpus (examples/lm), Equinox model.

The same trainer and settings as configs/lm_nnx.py (variants too:
--config=configs/lm_equinox.py:gpu), with config.model.framework = "equinox":
the blocks use fusedattn.layers.equinox.MultiheadAttention, vmapped over the batch.
"""

import importlib.util
import pathlib


def get_config(arg: str = ""):
    path = pathlib.Path(__file__).resolve().parent / "lm_nnx.py"
    spec = importlib.util.spec_from_file_location("_lm_nnx_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg)
    config.model.framework = "equinox"
    return config
