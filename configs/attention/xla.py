"""Attention preset: the XLA backend (pure JAX, every feature, any platform).

    config.model.attention = <this>.get_config()   # or --config.model.attention.backend=xla
"""

from fusedattn.configs import attention_config


def get_config():
    config = attention_config()
    config.backend = "xla"
    return config
