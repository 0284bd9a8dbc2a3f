"""The linen layer's submodules and parameters, created inside its compact call, and
projecting into heads.

Names and shapes are the stock module's (F = inputs_q features, Fkv = key/value input
features, d = head dim, h / h_kv = query / key-value heads):

- query: DenseGeneral kernel [F, h, d]; key, value: kernel [Fkv, h_kv, d] (biases
  [heads, d]); or with fused_qkv one qkv: kernel [F, h + 2 h_kv, d] (query heads, then
  key heads, then value heads);
- out: DenseGeneral kernel [h, d, out_features], bias [out_features];
- with normalize_qk: query_ln, key_ln LayerNorm scale [d] (no bias);
- with softmax "learnable": softmax_offset float32 [h] (zeros).

Each function takes the layer (`fusedattn.layers.linen.MultiHeadDotProductAttention`)
and must run inside its compact `__call__`, whose scope the submodules join.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from fusedattn.layers import common
from fusedattn.layers.projections import LayerOptions
from fusedattn.ops.enums import SoftmaxType
from fusedattn.ops.spec import AttentionSpec

Array = jax.Array

__all__ = ["output", "project", "qk_norms", "softmax_offset"]


def _dense(layer: nn.Module, heads: int, head_dim: int, name: str) -> nn.DenseGeneral:
    """A q/k/v-side projection [..., features] -> [..., heads, head_dim] named `name`."""
    return nn.DenseGeneral(features=(heads, head_dim), axis=-1, dtype=layer.dtype,
                           param_dtype=layer.param_dtype, kernel_init=layer.kernel_init,
                           bias_init=layer.bias_init, use_bias=layer.use_bias,
                           precision=layer.precision, dot_general=layer.qkv_dot_general,
                           dot_general_cls=layer.qkv_dot_general_cls, name=name)


def project(layer: nn.Module, options: LayerOptions, head_dim: int, inputs_q: Array,
            inputs_k: Array, inputs_v: Array) -> tuple[Array, Array, Array]:
    """q [batch..., sq, h, d], k and v [batch..., skv, h_kv, d] through the layer's qkv
    projection (fused_qkv) or its query/key/value projections.

    The fused projection serves self-attention only: inputs_k and inputs_v must be
    inputs_q (an error says so)."""
    h, h_kv = options.num_heads, options.num_kv_heads
    if not options.fused_qkv:
        return (_dense(layer, h, head_dim, "query")(inputs_q),
                _dense(layer, h_kv, head_dim, "key")(inputs_k),
                _dense(layer, h_kv, head_dim, "value")(inputs_v))
    common.check_self_attention(inputs_q, inputs_k, inputs_v, "inputs_k", "inputs_v")
    return common.split_fused_qkv(_dense(layer, h + 2 * h_kv, head_dim, "qkv")(inputs_q),
                                  h, h_kv)


def qk_norms(layer: nn.Module) -> tuple[nn.LayerNorm | None, nn.LayerNorm | None]:
    """(query_ln, key_ln): LayerNorms over d without bias when normalize_qk, else None."""
    if not layer.normalize_qk:
        return None, None
    return tuple(nn.LayerNorm(name=name, use_bias=False, dtype=layer.dtype,
                              param_dtype=layer.param_dtype)
                 for name in ("query_ln", "key_ln"))


def softmax_offset(layer: nn.Module, spec: AttentionSpec, num_heads: int) -> Array | None:
    """The learnable softmax offset, param float32 [h] of zeros, for softmax "learnable";
    else None."""
    if spec.softmax != SoftmaxType.LEARNABLE:
        return None
    return layer.param("softmax_offset", nn.initializers.zeros_init(), (num_heads,),
                       jnp.float32)


def output(layer: nn.Module, x: Array, features: int) -> Array:
    """[batch..., sq, h, d] -> [batch..., sq, features] through the layer's out projection."""
    return nn.DenseGeneral(features=features, axis=(-2, -1),
                           kernel_init=layer.out_kernel_init or layer.kernel_init,
                           bias_init=layer.out_bias_init or layer.bias_init,
                           use_bias=layer.use_bias, dtype=layer.dtype,
                           param_dtype=layer.param_dtype, precision=layer.precision,
                           dot_general=layer.out_dot_general,
                           dot_general_cls=layer.out_dot_general_cls, name="out")(x)
