"""A drop-in `attention_fn` for the stock Flax modules, computed by the layers' core."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from fusedattn.layers import stock
from fusedattn.layers.common import LayerOptions, core, missing_dropout_rng
from fusedattn.ops.enums import BiasType, SoftmaxType
from fusedattn.ops.spec import AttentionSpec

Array = jax.Array

__all__ = ["attention_fn"]


def attention_fn(config) -> Callable[..., Array]:
    """A drop-in `attention_fn` for the stock Flax modules (linen and nnx MultiHeadAttention).

    Returns a function with flax's `dot_product_attention` signature,
    `(query, key, value, bias=None, mask=None, broadcast_dropout=True,
    dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
    precision=None, module=None, force_fp32_for_softmax=False, einsum_dot_general=None,
    qk_attn_weights_einsum=None, attn_weights_value_einsum=None, is_causal=False,
    promote_dtype=None)` (linen's, then nnx's `is_causal` and `promote_dtype`),
    that computes the attention with `fusedattn.ops.fused_attn` under `config`:
    query [batch..., sq, h, d], key [batch..., skv, h_kv, d], value
    [batch..., skv, h_kv, dv] -> [batch..., sq, h, dv] (layout family of
    config.qkv_layout, "bshd" by default).

    - `mask` (bool, True = attend) is ANDed with config.mask; `is_causal`
      (nnx) adds a causal mask to config.mask.
    - `bias` is additive; flax adds it after scaling, so it is passed as a
      post-scale bias unless config.bias is "pre_scale_bias".
    - Dropout: the stock module owns `deterministic` and the "dropout" RNG and
      passes its own `dropout_rate`; it is used when config.dropout_rate is 0 and
      must equal config.dropout_rate otherwise. `broadcast_dropout` is ignored
      (the op draws one Philox mask element per (batch, head, q, kv)).
    - `precision` and `force_fp32_for_softmax` are ignored (the op keeps the
      softmax in float32); `module` (sow_weights) raises: no weights are formed, and
      so do `einsum_dot_general` and the weight einsums when given.
    - `promote_dtype` (nnx), when given, promotes query, key and value as nnx does.
    - Padding masks and THD layouts need a per-call SequenceDescriptor, which a
      stock module cannot pass: use an explicit `mask` instead.
    """
    spec = AttentionSpec.from_config(config)
    if spec.softmax == SoftmaxType.LEARNABLE:
        raise ValueError(
            "config.softmax: 'learnable' needs a per-head softmax_offset parameter, which stock "
            "Flax modules do not have; use fusedattn.layers.linen/nnx.MultiHeadAttention, or "
            "config.softmax 'vanilla' / 'off_by_one'."
        )

    def fused_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                        dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                        precision=None, module=None, force_fp32_for_softmax=False,
                        einsum_dot_general=None, qk_attn_weights_einsum=None,
                        attn_weights_value_einsum=None, is_causal=False, promote_dtype=None):
        del broadcast_dropout, precision, force_fp32_for_softmax
        if module is not None:
            raise ValueError(
                "module: sow_weights=True asks for the attention weights, which the fused op "
                "never forms; call the module with sow_weights=False."
            )
        stock.check_weight_einsums(einsum_dot_general=einsum_dot_general,
                                   qk_attn_weights_einsum=qk_attn_weights_einsum,
                                   attn_weights_value_einsum=attn_weights_value_einsum)
        call_spec = spec
        if dropout_rate:
            if spec.dropout_rate not in (0.0, dropout_rate):
                raise ValueError(
                    f"dropout_rate: the module passes {dropout_rate} but config.dropout_rate is "
                    f"{spec.dropout_rate}; set them equal (or config.dropout_rate = 0.0)."
                )
            call_spec = spec.replace(dropout_rate=float(dropout_rate))
        elif spec.dropout_rate > 0:
            raise ValueError(
                f"dropout_rate: config.dropout_rate is {spec.dropout_rate} but the module's "
                "dropout_rate is 0.0, so it never supplies a dropout RNG; set the module's "
                f"dropout_rate={spec.dropout_rate} as well (it owns deterministic and the RNG)."
            )
        if is_causal:
            call_spec = stock.with_causal_mask(call_spec)
        if call_spec.dropout_rate > 0 and not deterministic and dropout_rng is None:
            raise missing_dropout_rng(call_spec, "pass dropout_rng (the stock module takes it "
                                                 "from its 'dropout' RNG stream).")
        if promote_dtype is not None:  # nnx's: promotes q, k, v to one dtype
            query, key, value = promote_dtype((query, key, value), dtype=dtype)
        if dtype is None:
            dtype = jnp.result_type(query.dtype, key.dtype, value.dtype)
        query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
        options = LayerOptions(query.shape[-2], key.shape[-2])
        if bias is not None and call_spec.bias == BiasType.NO_BIAS:
            call_spec = call_spec.replace(bias=BiasType.POST_SCALE_BIAS)
        out, _, _ = core(call_spec, options, query, key, value, mask=mask, bias=bias,
                         dropout_rng=dropout_rng,
                         deterministic=bool(deterministic) or call_spec.dropout_rate == 0)
        return out

    fused_attention.__doc__ = attention_fn.__doc__
    return fused_attention
