"""The stock modules' arguments that the fused layers take, and what each means here.

The layers are drop-ins for flax.linen.MultiHeadDotProductAttention,
flax.nnx.MultiHeadAttention and equinox.nn.MultiheadAttention: a model written
for the stock module runs unchanged with ours. Every stock argument is accepted;
where it has a meaning for a fused call it keeps it, and where it asks for
something the fused op cannot do (another attention function, the attention
weights, custom einsums over them) it raises with what to do instead.
"""

from __future__ import annotations

from typing import Any

from fusedattn.configs import attention_config
from fusedattn.ops.enums import MaskType
from fusedattn.ops.spec import AttentionSpec

__all__ = ["check_attention_fn", "check_sow_weights", "check_weight_einsums", "layer_spec",
           "stock_config", "with_causal_mask"]


def stock_config():
    """The config of a layer built without one: the stock modules' semantics.

    attention_config() with mask "no_mask": the call's `mask` argument is the only
    mask, as in the stock modules (backend "auto", no dropout unless the stock
    dropout argument is given).
    """
    config = attention_config()
    config.mask = "no_mask"
    return config


def layer_spec(config: Any, dropout_rate: float | None = None,
               rate_name: str = "dropout_rate") -> AttentionSpec:
    """The spec of a layer: `config` (None: `stock_config()`) with the stock dropout argument.

    dropout_rate: the stock module's `dropout_rate` (Flax) / `dropout_p` (Equinox),
    named `rate_name` in errors; when given (not None) it is the dropout of the call,
    replacing config.dropout_rate.
    """
    spec = AttentionSpec.from_config(stock_config() if config is None else config)
    if dropout_rate is None:
        return spec
    if (isinstance(dropout_rate, bool) or not isinstance(dropout_rate, (int, float))
            or not 0 <= dropout_rate < 1):
        raise ValueError(f"{rate_name}: expected a number in [0, 1), got {dropout_rate!r}.")
    return spec.replace(dropout_rate=float(dropout_rate))


def with_causal_mask(spec: AttentionSpec) -> AttentionSpec:
    """The spec with a causal mask added (nnx's `is_causal=True`): top-left causal, kept
    with padding ("padding_causal"); an already causal mask is kept as it is."""
    if spec.mask.is_causal:
        return spec
    return spec.replace(mask=MaskType("padding_causal" if spec.mask.is_padding else "causal"))


def check_attention_fn(attention_fn) -> None:
    """Stock `attention_fn=`: this layer is the attention, so any given one is an error."""
    if attention_fn is not None:
        raise TypeError(
            "attention_fn: this layer is the attention (fusedattn.ops.fused_attn under its "
            "config), so it takes no attention function; drop the argument, or keep the stock "
            "Flax module and pass attention_fn=fusedattn.layers.attention_fn(config)."
        )


def check_sow_weights(sow_weights: bool) -> None:
    """Stock `sow_weights=True` asks for the attention weights, which are never formed."""
    if sow_weights:
        raise ValueError(
            "sow_weights: the fused attention never forms the attention weights, so there are "
            "none to sow; call with sow_weights=False. To inspect them, run the stock Flax "
            "module with this layer's parameters (the names and shapes are the same)."
        )


def check_weight_einsums(**einsums) -> None:
    """Stock custom einsums over the attention weights (AQT): the fused op has no such step."""
    given = sorted(name for name, value in einsums.items() if value is not None)
    if given:
        raise ValueError(
            f"{', '.join(given)}: the fused attention never forms the attention weights, so "
            "there is no einsum over them to replace; leave these unset (None)."
        )
