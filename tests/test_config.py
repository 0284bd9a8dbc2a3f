"""The attention config (API.md "Config"): defaults, locking, and validation into a spec."""

from __future__ import annotations

import re

import ml_collections
import pytest

from fusedattn.configs import attention_config
from fusedattn.ops import (
    AttentionSpec,
    BackendName,
    BiasType,
    ContextParallelStrategy,
    MaskType,
    QKVLayout,
    SequenceFormat,
    SoftmaxType,
)

# The table of API.md: key -> (default, every accepted choice or None for numeric keys).
CHOICES = {
    "backend": ("auto", ["auto", "xla", "cudnn", "small_seq", "flash", "decode"]),
    "qkv_layout": ("bshd_bshd_bshd", ["bs3hd", "bshd_bs2hd", "bshd_bshd_bshd", "sb3hd",
                                      "sbhd_sb2hd", "sbhd_sbhd_sbhd", "t3hd", "thd_t2hd",
                                      "thd_thd_thd", "paged_kv_bshd_bshd_bshd",
                                      "paged_kv_thd_bshd_bshd"]),
    "mask": ("causal", ["no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
                        "padding_causal_bottom_right"]),
    "bias": ("no_bias", ["no_bias", "pre_scale_bias", "post_scale_bias", "alibi"]),
    "softmax": ("vanilla", ["vanilla", "off_by_one", "learnable"]),
    "sequence.format": ("none", ["none", "seqlens", "seqlens_offsets", "segment_ids"]),
    "context_parallel.strategy": ("ring", ["ring", "all_gather"]),
    "fp8.format": ("e4m3", ["e4m3", "hybrid"]),
    "fp8.scaling": ("delayed", ["delayed", "current"]),
}
DEFAULTS = {
    **{key: default for key, (default, _) in CHOICES.items()},
    "dropout_rate": 0.0,
    "scale": None,
    "window_size": (-1, -1),
    "deterministic_backward": False,
    "guard_masked_values": False,
    "sequence.max_segments_per_seq": 1,
    "sequence.max_seqlen_q": None,
    "sequence.max_seqlen_kv": None,
    "sequence.check_bounds": True,
    "small_seq.enabled": False,
    "context_parallel.axis": None,
    "context_parallel.load_balance": True,
    "fp8.enabled": False,
    "fp8.amax_history_len": 16,
    "fp8.margin": 0,
}

# key -> bad values (each must raise ValueError naming the key and the value).
BAD_VALUES = {
    "backend": ["cuda", "XLA", "", None, 3],
    "qkv_layout": ["bhsd", "bshd", "thd", None],
    "mask": ["casual", "top_left", "padding_bottom_right", None],
    "bias": ["prescale", "bias", None],
    "softmax": ["offbyone", "sigmoid", None],
    "dropout_rate": [1.0, -0.1, 1.5, "0.1", True, None, float("nan")],
    "scale": [0.0, -1.0, "0.5", True, float("nan")],
    "window_size": [(-2, 0), (0, -5), (1,), (1, 2, 3), "ab", (1.5, 2), (True, 1), None, 3],
    "deterministic_backward": ["yes", 2, None, 0.5],
    "guard_masked_values": ["yes", 2, None, 0.5],
    "sequence.format": ["lengths", "thd", None],
    "sequence.max_segments_per_seq": [0, -1, 1.5, "2", True, None],
    "sequence.max_seqlen_q": [0, -1, 2.5, "8", True],
    "sequence.max_seqlen_kv": [0, -3, 1.0, "16", False],
    "sequence.check_bounds": ["no", 2, None, 0.5],
    "small_seq.enabled": ["yes", 2, None, 0.5],
    "context_parallel.strategy": ["p2p", "allgather", None],
    "context_parallel.axis": ["", 3],
    "context_parallel.load_balance": ["yes", 2, None],
    "fp8.enabled": ["yes", 2, None],
    "fp8.format": ["e5m2", "E4M3", None],
    "fp8.scaling": ["dynamic", None],
    "fp8.amax_history_len": [0, -1, 1.5, "16", True, None],
    "fp8.margin": [-1, 0.5, "0", True, None],
}
# What each key's message must mention as the accepted values.
EXPECTED_HINT = {
    "dropout_rate": "[0, 1)",
    "scale": "positive",
    "window_size": "(left, right)",
    "deterministic_backward": "True or False",
    "guard_masked_values": "True or False",
    "small_seq.enabled": "True or False",
    "fp8.enabled": "True or False",
    "fp8.amax_history_len": ">= 1",
    "fp8.margin": ">= 0",
    "sequence.check_bounds": "True or False",
    "sequence.max_segments_per_seq": ">= 1",
    "sequence.max_seqlen_q": ">= 1",
    "sequence.max_seqlen_kv": ">= 1",
    "context_parallel.axis": "mesh axis",
    "context_parallel.load_balance": "True or False",
}


def _get(config, dotted):
    node = config
    for part in dotted.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def _with(dotted: str, value) -> dict:
    """The default config as a plain dict with one (possibly ill-typed) value replaced."""
    config = attention_config().to_dict()
    node = config
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value
    return config


@pytest.mark.parametrize("key", sorted(DEFAULTS))
def test_defaults_match_api_table(key):
    assert _get(attention_config(), key) == DEFAULTS[key]


def test_config_has_exactly_the_documented_keys():
    config = attention_config().to_dict()
    flat = set()
    for key, value in config.items():
        if isinstance(value, dict):
            flat |= {f"{key}.{sub}" for sub in value}
        else:
            flat.add(key)
    assert flat == set(DEFAULTS)


def test_each_call_returns_a_fresh_config():
    a = attention_config()
    a.mask = "no_mask"
    assert attention_config().mask == "causal"


@pytest.mark.parametrize("path,typo,valid", [
    ("", "bakend", "backend"), ("", "qkv_layuot", "qkv_layout"), ("", "droput_rate", "dropout_rate"),
    ("sequence", "max_seqlen", "max_seqlen_q"), ("small_seq", "enable", "enabled"),
])
def test_locked_typo_raises_listing_valid_keys(path, typo, valid):
    config = attention_config()
    node = _get(config, path) if path else config
    with pytest.raises(AttributeError) as info:
        setattr(node, typo, 1)
    message = str(info.value)
    assert typo in message
    assert valid in message
    # the valid names of that section are listed
    for name in node.keys():
        assert name in message


def test_locked_config_still_accepts_documented_keys():
    config = attention_config()
    config.backend = "xla"
    config.scale = 0.125
    config.window_size = (4, 0)
    config.sequence.max_seqlen_q = 1
    config.sequence.max_seqlen_kv = 16
    config.small_seq.enabled = True
    spec = AttentionSpec.from_config(config)
    assert spec.backend == BackendName.XLA
    assert spec.scale == 0.125
    assert spec.window_size == (4, 0)
    assert (spec.max_seqlen_q, spec.max_seqlen_kv, spec.small_seq_enabled) == (1, 16, True)


def test_default_spec():
    spec = AttentionSpec.from_config(attention_config())
    assert spec == AttentionSpec()
    assert spec.backend == BackendName.AUTO
    assert spec.qkv_layout == QKVLayout.BSHD_BSHD_BSHD
    assert spec.mask == MaskType.CAUSAL
    assert spec.bias == BiasType.NO_BIAS
    assert spec.softmax == SoftmaxType.VANILLA
    assert spec.sequence_format == SequenceFormat.NONE
    assert (spec.dropout_rate, spec.scale, spec.window_size) == (0.0, None, (-1, -1))
    assert (spec.max_segments_per_seq, spec.max_seqlen_q, spec.max_seqlen_kv) == (1, None, None)
    assert spec.deterministic_backward is False and spec.small_seq_enabled is False


def test_spec_is_hashable_frozen_and_idempotent():
    config = attention_config()
    config.mask = "padding"
    spec = AttentionSpec.from_config(config)
    assert AttentionSpec.from_config(spec) is spec
    assert hash(spec) == hash(AttentionSpec.from_config(config))
    with pytest.raises(Exception):
        spec.mask = MaskType.CAUSAL  # frozen
    assert {spec: 1}[AttentionSpec.from_config(config)] == 1


@pytest.mark.parametrize("key,value", [(k, v) for k, (_, vs) in CHOICES.items() for v in vs])
def test_every_documented_choice_is_accepted(key, value):
    config = attention_config()
    *parents, leaf = key.split(".")
    setattr(_get(config, ".".join(parents)) if parents else config, leaf, value)
    spec = AttentionSpec.from_config(config)
    field = {"sequence.format": "sequence_format",
             "context_parallel.strategy": "context_strategy"}.get(key, key.replace(".", "_"))
    assert str(getattr(spec, field)) == value


@pytest.mark.parametrize("key,value", [
    ("dropout_rate", 0.0), ("dropout_rate", 0.999), ("scale", 1e-3), ("scale", 4.0),
    ("window_size", (0, 0)), ("window_size", (-1, 5)), ("window_size", (7, -1)),
    ("deterministic_backward", True), ("sequence.max_segments_per_seq", 8),
    ("sequence.max_seqlen_q", 1), ("sequence.max_seqlen_kv", 4096), ("sequence.check_bounds", False),
    ("small_seq.enabled", True), ("context_parallel.axis", "context"),
    ("context_parallel.load_balance", False),
])
def test_numeric_values_in_range_are_accepted(key, value):
    spec = AttentionSpec.from_config(_with(key, value))
    field = {"sequence.max_segments_per_seq": "max_segments_per_seq",
             "sequence.max_seqlen_q": "max_seqlen_q", "sequence.max_seqlen_kv": "max_seqlen_kv",
             "sequence.check_bounds": "check_bounds", "small_seq.enabled": "small_seq_enabled",
             "context_parallel.axis": "context_axis",
             "context_parallel.load_balance": "context_load_balance"}.get(key, key)
    assert getattr(spec, field) == value


@pytest.mark.parametrize("key,value", [(k, v) for k, vs in BAD_VALUES.items() for v in vs],
                         ids=lambda x: repr(x))
def test_bad_value_raises_naming_key_value_and_choices(key, value):
    with pytest.raises(ValueError) as info:
        AttentionSpec.from_config(_with(key, value))
    message = str(info.value)
    assert f"config.{key}" in message, message
    assert repr(value) in message, message
    if key in CHOICES:
        for choice in CHOICES[key][1]:
            assert repr(choice) in message, f"{choice!r} missing from: {message}"
    else:
        assert EXPECTED_HINT[key] in message, message


@pytest.mark.parametrize("section,valid", [
    ("", ["backend", "qkv_layout", "mask", "bias", "softmax", "dropout_rate", "scale",
          "window_size", "deterministic_backward", "sequence", "small_seq", "context_parallel"]),
    ("sequence", ["format", "max_segments_per_seq", "max_seqlen_q", "max_seqlen_kv"]),
    ("small_seq", ["enabled"]),
    ("context_parallel", ["axis", "strategy", "load_balance"]),
])
def test_unknown_key_in_a_mapping_lists_valid_keys(section, valid):
    config = attention_config().to_dict()
    (config[section] if section else config)["colour"] = "blue"
    with pytest.raises(ValueError) as info:
        AttentionSpec.from_config(config)
    message = str(info.value)
    assert "'colour'" in message
    assert ("config." + section if section else "config") in message
    for name in valid:
        assert re.search(rf"\b{name}\b", message), f"{name} missing from: {message}"


@pytest.mark.parametrize("config", [None, 3, "causal", ["mask"]])
def test_config_of_wrong_type(config):
    with pytest.raises(TypeError, match="config"):
        AttentionSpec.from_config(config)


def test_partial_mapping_takes_defaults():
    spec = AttentionSpec.from_config({"mask": "no_mask", "sequence": {"max_seqlen_q": 1}})
    assert spec.mask == MaskType.NO_MASK
    assert spec.max_seqlen_q == 1
    assert spec.qkv_layout == QKVLayout.BSHD_BSHD_BSHD


def test_frozen_config_dict_accepted():
    config = attention_config()
    config.qkv_layout = "t3hd"
    spec = AttentionSpec.from_config(ml_collections.FrozenConfigDict(config))
    assert spec.qkv_layout == QKVLayout.T3HD


@pytest.mark.parametrize("enum,key", [(BackendName, "backend"), (QKVLayout, "qkv_layout"),
                                      (MaskType, "mask"), (BiasType, "bias"),
                                      (SoftmaxType, "softmax"),
                                      (SequenceFormat, "sequence.format"),
                                      (ContextParallelStrategy, "context_parallel.strategy")])
def test_enums_are_exactly_the_documented_strings(enum, key):
    assert sorted(m.value for m in enum) == sorted(CHOICES[key][1])
    for member in enum:
        assert str(member) == member.value
        assert enum(member.value) is member
