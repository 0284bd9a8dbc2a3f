"""Flax linen MultiHeadAttention over `fusedattn.ops.fused_attn`, driven by the attention config."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from fusedattn.layers import common
from fusedattn.ops.enums import SoftmaxType

Array = jax.Array

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    """Multi-head attention, a drop-in for `flax.linen.MultiHeadDotProductAttention`.

    Parameters (names and shapes as the stock module, with F = inputs_q features,
    Fkv = key/value input features, d = qkv_features // num_heads, h_kv = num_kv_heads):

    - query: DenseGeneral kernel [F, h, d], bias [h, d]
    - key, value: DenseGeneral kernel [Fkv, h_kv, d], bias [h_kv, d]
    - out: DenseGeneral kernel [h, d, out_features], bias [out_features]
    - with fused_qkv=True, instead of query/key/value: qkv, kernel [F, h + 2 h_kv, d],
      bias [h + 2 h_kv, d] (query heads, then key heads, then value heads along axis 1)
    - with normalize_qk=True: query_ln, key_ln LayerNorm scale [d] (no bias)
    - with config.softmax == "learnable": softmax_offset float32 [h] (zeros at init)

    With decode=True the "cache" collection holds cached_key / cached_value
    [batch..., max_len, h_kv, d] and cache_index (int32 []), created by `init`
    with an input of the full length, as in the stock module. Each decode call
    may feed one or more new tokens; they attend bottom-right causally to the
    filled cache (config mask "padding_causal_bottom_right" with kv length
    cache_index + new tokens), so step-by-step decoding equals full-sequence
    causal attention. Writing past max_len raises ValueError eagerly; under jit the
    outputs are NaN and checkify reports it (config.sequence.check_bounds).

    Attributes:
      num_heads: query heads h; qkv_features must be divisible by it.
      config: the attention ConfigDict (fusedattn.configs.attention_config()):
        backend, qkv_layout (its bshd/sbhd/thd family), mask, bias, softmax,
        dropout_rate, scale, window_size, sequence bounds, small_seq opt-in.
      qkv_features: total q/k/v features h * d (default: inputs_q features).
      out_features: output features (default: inputs_q features).
      num_kv_heads: key/value heads h_kv (GQA/MQA), default num_heads.
      use_bias, kernel_init, bias_init, out_kernel_init, out_bias_init,
        precision: as in the stock module (for the projections).
      dtype: computation dtype (e.g. jnp.bfloat16), default inferred.
      param_dtype: parameter dtype (float32).
      normalize_qk: LayerNorm on q and k per head (query_ln, key_ln).
      fused_qkv: one `qkv` projection for self-attention (selects the packed
        layout of the config's family: bs3hd, or bshd_bs2hd under GQA).
      rope: rotary embeddings on q and k (positions: 0..s-1, the descriptor's
        segment positions when `sequence` is given, + cache_index when decoding).
      rope_theta: RoPE base.
      decode: use the autoregressive KV cache.
      deterministic: construction-time default merged with the call's (only
        needed when config.dropout_rate > 0), as in the stock module.
    """

    num_heads: int
    _: dataclasses.KW_ONLY
    config: Any
    qkv_features: int | None = None
    out_features: int | None = None
    num_kv_heads: int | None = None
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Callable = nn.linear.default_kernel_init
    bias_init: Callable = nn.initializers.zeros_init()
    out_kernel_init: Callable | None = None
    out_bias_init: Callable | None = None
    normalize_qk: bool = False
    fused_qkv: bool = False
    rope: bool = False
    rope_theta: float = 10000.0
    decode: bool = False
    deterministic: bool | None = None

    @nn.compact
    def __call__(self, inputs_q: Array, inputs_kv: Array | None = None, *,
                 inputs_k: Array | None = None, inputs_v: Array | None = None,
                 mask: Array | None = None, bias: Array | None = None, sequence=None,
                 deterministic: bool | None = None, dropout_rng=None) -> Array:
        """Attention of inputs_q over inputs_kv (self-attention when None).

        Args:
          inputs_q: [batch..., sq, F].
          inputs_kv: [batch..., skv, Fkv] keys and values (default inputs_q).
          inputs_k, inputs_v: separate key and value inputs instead of inputs_kv
            (inputs_v defaults to inputs_k), as the stock module's keywords.
          mask: broadcastable to [batch..., h, sq, skv], True = attend (bool; 0/1
            numeric masks as made by flax.linen.make_attention_mask also work),
            ANDed with config.mask (passed to the op as a bias array: see
            fusedattn.layers.common on backend eligibility).
          bias: per config.bias: [batch..., h|1, sq, skv] for pre/post-scale
            bias, optional [h] slopes for "alibi".
          sequence: fusedattn.ops.SequenceDescriptor (one batch axis) for padding
            masks, packing (segment ids) and THD layouts.
          deterministic: False applies dropout (config.dropout_rate > 0) with the
            "dropout" RNG stream.
          dropout_rng: an explicit dropout key instead of the "dropout" stream.

        Returns:
          [batch..., sq, out_features].
        """
        spec = common.spec_of(self.config)
        if inputs_kv is not None and (inputs_k is not None or inputs_v is not None):
            raise ValueError("inputs_kv: pass either inputs_kv or inputs_k/inputs_v, not both.")
        if inputs_k is None:
            if inputs_v is not None:
                raise ValueError("inputs_k: must be given when inputs_v is given.")
            inputs_k = inputs_q if inputs_kv is None else inputs_kv
        if inputs_v is None:
            inputs_v = inputs_k
        features = self.out_features or inputs_q.shape[-1]
        qkv_features = self.qkv_features or inputs_q.shape[-1]
        common.check_num_heads(self.num_heads)
        if qkv_features % self.num_heads:
            raise ValueError(
                f"qkv_features: {qkv_features} is not divisible by num_heads {self.num_heads}."
            )
        head_dim = qkv_features // self.num_heads
        options = common.check_options(self.num_heads, self.num_kv_heads, head_dim,
                                       rope=self.rope, rope_theta=self.rope_theta,
                                       fused_qkv=self.fused_qkv)
        h, h_kv = options.num_heads, options.num_kv_heads

        def dense(heads: int, name: str):
            return nn.DenseGeneral(features=(heads, head_dim), axis=-1, dtype=self.dtype,
                                   param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                                   bias_init=self.bias_init, use_bias=self.use_bias,
                                   precision=self.precision, name=name)

        if self.fused_qkv:
            if not (inputs_k is inputs_q and inputs_v is inputs_q):
                raise ValueError(
                    "fused_qkv: the fused projection serves self-attention only; call with "
                    "inputs_kv=None (or build the layer with fused_qkv=False)."
                )
            query, key, value = common.split_fused_qkv(
                dense(h + 2 * h_kv, "qkv")(inputs_q), h, h_kv)
        else:
            query = dense(h, "query")(inputs_q)
            key = dense(h_kv, "key")(inputs_k)
            value = dense(h_kv, "value")(inputs_v)

        q_norm = k_norm = None
        if self.normalize_qk:
            q_norm = nn.LayerNorm(name="query_ln", use_bias=False, dtype=self.dtype,
                                  param_dtype=self.param_dtype)
            k_norm = nn.LayerNorm(name="key_ln", use_bias=False, dtype=self.dtype,
                                  param_dtype=self.param_dtype)
        softmax_offset = None
        if spec.softmax == SoftmaxType.LEARNABLE:
            softmax_offset = self.param("softmax_offset", nn.initializers.zeros_init(), (h,),
                                        jnp.float32)

        cache = cache_vars = None
        if self.decode:
            initialized = self.has_variable("cache", "cached_key")
            cache_vars = (
                self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype),
                self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype),
                self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32)),
            )
            if initialized:
                cache = common.KVCache(*(v.value for v in cache_vars))

        if spec.dropout_rate > 0:
            deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
            if not deterministic and dropout_rng is None:
                if not self.has_rng("dropout"):
                    raise common.missing_dropout_rng(
                        spec, "pass rngs={'dropout': key} to init/apply (or dropout_rng=...), "
                        "or deterministic=True.")
                dropout_rng = self.make_rng("dropout")
        else:
            deterministic = True

        x, new_cache = common.core(spec, options, query, key, value, q_norm=q_norm,
                                   k_norm=k_norm, cache=cache, mask=mask, bias=bias,
                                   softmax_offset=softmax_offset, sequence=sequence,
                                   dropout_rng=dropout_rng, deterministic=deterministic)
        if new_cache is not None:
            for variable, value_ in zip(cache_vars, new_cache):
                variable.value = value_
        return nn.DenseGeneral(features=features, axis=(-2, -1),
                               kernel_init=self.out_kernel_init or self.kernel_init,
                               bias_init=self.out_bias_init or self.bias_init,
                               use_bias=self.use_bias, dtype=self.dtype,
                               param_dtype=self.param_dtype, precision=self.precision,
                               name="out")(x)
