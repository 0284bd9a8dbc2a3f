"""The NNX layer's parameter modules that depend on its options, and projecting into heads.

Names and shapes are the stock module's (F = in_features, Fkv = in_kv_features,
d = head dim, h / h_kv = query / key-value heads):

- query: LinearGeneral kernel [F, h, d]; key, value: kernel [Fkv, h_kv, d] (biases
  [heads, d]); or with fused_qkv one qkv: kernel [F, h + 2 h_kv, d] (query heads, then
  key heads, then value heads) and query/key/value None;
- with normalize_qk: query_ln, key_ln LayerNorm scale [d] (no bias);
- with softmax "learnable": softmax_offset nnx.Param float32 [h] (zeros).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fusedattn.layers import common
from fusedattn.ops.enums import SoftmaxType
from fusedattn.ops.spec import AttentionSpec

Array = jax.Array

__all__ = ["project", "qk_norms", "qkv_projections", "softmax_offset"]


def qkv_projections(fused_qkv: bool, in_features: int, in_kv_features: int, num_heads: int,
                    num_kv_heads: int, head_dim: int, **linear_args):
    """(qkv, query, key, value): the fused projection and three None attributes (nnx.data),
    or None and the three projections. linear_args go to each nnx.LinearGeneral (dtype,
    initialisers, dot_general, metadata, rngs, ...)."""
    def linear(features: int, heads: int) -> nnx.LinearGeneral:
        return nnx.LinearGeneral(features, (heads, head_dim), **linear_args)

    if fused_qkv:
        return (linear(in_features, num_heads + 2 * num_kv_heads),
                nnx.data(None), nnx.data(None), nnx.data(None))
    return (nnx.data(None), linear(in_features, num_heads),
            linear(in_kv_features, num_kv_heads), linear(in_kv_features, num_kv_heads))


def qk_norms(normalize_qk: bool, head_dim: int, query_scale_metadata: Mapping[str, Any],
             key_scale_metadata: Mapping[str, Any], **norm_args):
    """(query_ln, key_ln): LayerNorms over d without bias when normalize_qk, else two None
    attributes. norm_args go to each nnx.LayerNorm (dtype, param_dtype, promote_dtype,
    rngs)."""
    if not normalize_qk:
        return nnx.data(None), nnx.data(None)
    return tuple(nnx.LayerNorm(head_dim, use_bias=False, scale_metadata=metadata, **norm_args)
                 for metadata in (query_scale_metadata, key_scale_metadata))


def softmax_offset(spec: AttentionSpec, num_heads: int):
    """The learnable softmax offset, nnx.Param float32 [h] of zeros, for softmax
    "learnable"; else a None attribute."""
    if spec.softmax == SoftmaxType.LEARNABLE:
        return nnx.Param(jnp.zeros((num_heads,), jnp.float32))
    return nnx.data(None)


def project(layer: nnx.Module, inputs_q: Array, inputs_k: Array, inputs_v: Array,
            sharding: Any) -> tuple[Array, Array, Array]:
    """q [batch..., sq, h, d], k and v [batch..., skv, h_kv, d] through the layer's
    projections (its qkv, or query/key/value), with `sharding` as their out_sharding.

    The fused projection serves self-attention only: inputs_k and inputs_v must be
    inputs_q (an error says so)."""
    if layer.qkv is None:
        return (layer.query(inputs_q, out_sharding=sharding),
                layer.key(inputs_k, out_sharding=sharding),
                layer.value(inputs_v, out_sharding=sharding))
    common.check_self_attention(inputs_q, inputs_k, inputs_v, "inputs_k", "inputs_v")
    return common.split_fused_qkv(layer.qkv(inputs_q, out_sharding=sharding),
                                  layer.num_heads, layer.num_kv_heads)
