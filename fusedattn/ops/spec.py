"""AttentionSpec: the validated, frozen (hashable, static) form of the config."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping

from fusedattn.ops.enums import (
    BackendName,
    BiasType,
    ContextParallelStrategy,
    Fp8Format,
    Fp8Scaling,
    MaskType,
    QKVLayout,
    SequenceFormat,
    SoftmaxType,
)

_TOP_KEYS = (
    "backend", "qkv_layout", "mask", "bias", "softmax", "dropout_rate", "scale",
    "window_size", "deterministic_backward", "guard_masked_values", "sequence", "small_seq", "context_parallel", "fp8",
)
_SEQUENCE_KEYS = ("format", "max_segments_per_seq", "max_seqlen_q", "max_seqlen_kv",
                  "check_bounds")
_SMALL_SEQ_KEYS = ("enabled",)
_CONTEXT_PARALLEL_KEYS = ("axis", "strategy", "load_balance")
_FP8_KEYS = ("enabled", "format", "scaling", "amax_history_len", "margin")
# Token positions are int32 in every backend, and a window's edges (position +- side)
# must stay in int32 too; a window wider than any sequence is simply unbounded (-1).
MAX_WINDOW = 2**30 - 1


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Everything static about an attention call; made by `AttentionSpec.from_config`."""

    backend: BackendName = BackendName.AUTO
    qkv_layout: QKVLayout = QKVLayout.BSHD_BSHD_BSHD
    mask: MaskType = MaskType.CAUSAL
    bias: BiasType = BiasType.NO_BIAS
    softmax: SoftmaxType = SoftmaxType.VANILLA
    dropout_rate: float = 0.0
    scale: float | None = None
    window_size: tuple[int, int] = (-1, -1)
    deterministic_backward: bool = False
    guard_masked_values: bool = False
    sequence_format: SequenceFormat = SequenceFormat.NONE
    max_segments_per_seq: int = 1
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None
    # Under tracing, report data that breaks the declared bounds through checkify
    # (base.guard); the kernels' NaN marks and the eager error stay either way.
    check_bounds: bool = True
    small_seq_enabled: bool = False
    # Context parallelism (ops/context_parallel/): the mesh axis the sequence is
    # sharded over (None: off), how K/V reach the queries, and the causal reordering.
    context_axis: str | None = None
    context_strategy: ContextParallelStrategy = ContextParallelStrategy.RING
    context_load_balance: bool = True
    # FP8 attention (ops/fp8.py): formats, where the scales come from, the amax history's
    # length and the scale's margin (scale = fp8_max / amax / 2**margin).
    fp8_enabled: bool = False
    fp8_format: Fp8Format = Fp8Format.E4M3
    fp8_scaling: Fp8Scaling = Fp8Scaling.DELAYED
    fp8_amax_history_len: int = 16
    fp8_margin: int = 0

    @classmethod
    def from_config(cls, config: Any) -> "AttentionSpec":
        """Validates an attention ConfigDict (or plain mapping) into a spec.

        Raises ValueError naming the key, the bad value and what is accepted.
        """
        if isinstance(config, AttentionSpec):
            return config
        top = _as_mapping(config, "config")
        _check_keys(top, _TOP_KEYS, "config")
        sequence = _as_mapping(top.get("sequence", {}), "config.sequence")
        _check_keys(sequence, _SEQUENCE_KEYS, "config.sequence")
        small_seq = _as_mapping(top.get("small_seq", {}), "config.small_seq")
        _check_keys(small_seq, _SMALL_SEQ_KEYS, "config.small_seq")
        context = _as_mapping(top.get("context_parallel", {}), "config.context_parallel")
        _check_keys(context, _CONTEXT_PARALLEL_KEYS, "config.context_parallel")
        fp8 = _as_mapping(top.get("fp8", {}), "config.fp8")
        _check_keys(fp8, _FP8_KEYS, "config.fp8")

        defaults = cls()
        spec = cls(
            backend=BackendName.parse(top.get("backend", defaults.backend), "backend"),
            qkv_layout=QKVLayout.parse(top.get("qkv_layout", defaults.qkv_layout), "qkv_layout"),
            mask=MaskType.parse(top.get("mask", defaults.mask), "mask"),
            bias=BiasType.parse(top.get("bias", defaults.bias), "bias"),
            softmax=SoftmaxType.parse(top.get("softmax", defaults.softmax), "softmax"),
            dropout_rate=_dropout_rate(top.get("dropout_rate", 0.0)),
            scale=_scale(top.get("scale", None)),
            window_size=_window(top.get("window_size", (-1, -1))),
            deterministic_backward=_bool(top.get("deterministic_backward", False),
                                         "deterministic_backward"),
            guard_masked_values=_bool(top.get("guard_masked_values", False),
                                      "guard_masked_values"),
            sequence_format=SequenceFormat.parse(sequence.get("format", "none"), "sequence.format"),
            max_segments_per_seq=_positive_int(sequence.get("max_segments_per_seq", 1),
                                               "sequence.max_segments_per_seq"),
            max_seqlen_q=_optional_positive_int(sequence.get("max_seqlen_q"), "sequence.max_seqlen_q"),
            max_seqlen_kv=_optional_positive_int(sequence.get("max_seqlen_kv"),
                                                 "sequence.max_seqlen_kv"),
            check_bounds=_bool(sequence.get("check_bounds", True), "sequence.check_bounds"),
            small_seq_enabled=_bool(small_seq.get("enabled", False), "small_seq.enabled"),
            context_axis=_axis_name(context.get("axis")),
            context_strategy=ContextParallelStrategy.parse(
                context.get("strategy", defaults.context_strategy), "context_parallel.strategy"),
            context_load_balance=_bool(context.get("load_balance", True),
                                       "context_parallel.load_balance"),
            fp8_enabled=_bool(fp8.get("enabled", False), "fp8.enabled"),
            fp8_format=Fp8Format.parse(fp8.get("format", defaults.fp8_format), "fp8.format"),
            fp8_scaling=Fp8Scaling.parse(fp8.get("scaling", defaults.fp8_scaling), "fp8.scaling"),
            fp8_amax_history_len=_positive_int(fp8.get("amax_history_len", 16),
                                               "fp8.amax_history_len"),
            fp8_margin=_non_negative_int(fp8.get("margin", 0), "fp8.margin"),
        )
        return spec

    def replace(self, **changes) -> "AttentionSpec":
        return dataclasses.replace(self, **changes)

    @property
    def uses_segments(self) -> bool:
        """Whether the call needs a SequenceDescriptor (padding mask or THD layout)."""
        return self.mask.is_padding or self.qkv_layout.is_thd


def _as_mapping(value: Any, name: str) -> Mapping[str, Any]:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, Mapping):
        return value
    raise TypeError(
        f"{name}: expected an ml_collections.ConfigDict (from fusedattn.configs.attention_config()) "
        f"or an AttentionSpec, got {type(value).__name__}."
    )


def _check_keys(mapping: Mapping[str, Any], valid: tuple[str, ...], name: str) -> None:
    unknown = sorted(set(mapping) - set(valid))
    if unknown:
        raise ValueError(
            f"{name}: unknown key(s) {', '.join(map(repr, unknown))}; valid keys are "
            f"{', '.join(valid)}. Start from fusedattn.configs.attention_config()."
        )


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, (bool, int)) or value not in (0, 1):
        raise ValueError(f"config.{key}: got {value!r}; expected True or False.")
    return bool(value)


def _dropout_rate(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value < 1.0:
        raise ValueError(
            f"config.dropout_rate: got {value!r}; expected a number in [0, 1). "
            "Use 0.0 to turn dropout off."
        )
    return float(value)


def _scale(value: Any) -> float | None:
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0
            or not math.isfinite(value)):
        raise ValueError(
            f"config.scale: got {value!r}; expected a positive finite number, or None for "
            "1/sqrt(head_dim)."
        )
    return float(value)


def _window(value: Any) -> tuple[int, int]:
    try:
        left, right = value
    except (TypeError, ValueError):
        left = right = None
    for side in (left, right):
        if (isinstance(side, bool) or not isinstance(side, numbers.Integral) or side < -1
                or side > MAX_WINDOW):
            raise ValueError(
                f"config.window_size: got {value!r}; expected a pair (left, right) of ints, "
                f"each in [0, {MAX_WINDOW}] (window edges are int32 token positions) or -1 "
                "for unbounded, e.g. (-1, -1) for no window."
            )
    return int(left), int(right)


def _axis_name(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(
            f"config.context_parallel.axis: got {value!r}; expected None (no context "
            "parallelism) or the name of the device-mesh axis the sequence is sharded over, "
            "e.g. 'context'."
        )
    return value


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"config.{key}: got {value!r}; expected an int >= 1.")
    return int(value)


def _non_negative_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"config.{key}: got {value!r}; expected an int >= 0.")
    return int(value)


def _optional_positive_int(value: Any, key: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"config.{key}: got {value!r}; expected None (no bound) or an int >= 1.")
    return int(value)
