"""The attention section of an ml-collections config (API.md, "Config")."""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict


def attention_config() -> ml_collections.ConfigDict:
    """Returns the default attention config, locked against unknown keys.

    Setting a key that does not exist raises AttributeError listing the valid
    keys; values are validated when the config is turned into an
    `AttentionSpec` (every layer and `fused_attn` call does that).
    """
    config = ml_collections.ConfigDict()
    config.backend = "auto"
    config.qkv_layout = "bshd_bshd_bshd"
    config.mask = "causal"
    config.bias = "no_bias"
    config.softmax = "vanilla"
    config.dropout_rate = 0.0
    config.scale = config_dict.placeholder(float)
    config.window_size = (-1, -1)
    config.deterministic_backward = False
    config.guard_masked_values = False

    config.sequence = ml_collections.ConfigDict()
    config.sequence.format = "none"
    config.sequence.max_segments_per_seq = 1
    config.sequence.max_seqlen_q = config_dict.placeholder(int)
    config.sequence.max_seqlen_kv = config_dict.placeholder(int)
    config.sequence.check_bounds = True

    config.small_seq = ml_collections.ConfigDict()
    config.small_seq.enabled = False

    config.context_parallel = ml_collections.ConfigDict()
    config.context_parallel.axis = config_dict.placeholder(str)
    config.context_parallel.strategy = "ring"
    config.context_parallel.load_balance = True

    config.fp8 = ml_collections.ConfigDict()
    config.fp8.enabled = False
    config.fp8.format = "e4m3"
    config.fp8.scaling = "delayed"
    config.fp8.amax_history_len = 16
    config.fp8.margin = 0

    config.lock()
    return config
