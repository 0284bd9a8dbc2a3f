"""Attention preset: the cuDNN backend (cuDNN frontend SDPA; CUDA GPUs, bf16/fp16).

A call the cuDNN backend cannot serve raises with the reason (no silent fallback);
use the "auto" backend to fall through to the next eligible backend instead.
"""

from fusedattn.configs import attention_config


def get_config():
    config = attention_config()
    config.backend = "cudnn"
    config.qkv_layout = "bshd_bshd_bshd"
    config.deterministic_backward = False
    return config
