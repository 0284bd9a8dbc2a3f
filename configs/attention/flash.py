"""Attention preset: the project's flash-attention backend (tiled online softmax)."""

from fusedattn.configs import attention_config


def get_config():
    config = attention_config()
    config.backend = "flash"
    config.qkv_layout = "bshd_bshd_bshd"
    return config
