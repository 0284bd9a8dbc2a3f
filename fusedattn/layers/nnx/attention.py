"""`MultiHeadAttention`, the Flax NNX drop-in over `fusedattn.ops.fused_attn` (its constructor
and call; the parameter modules, caches, FP8 state and dropout key live in this package's
other modules)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from fusedattn.layers import common, paged, stock
from fusedattn.layers.nnx import caches, dropout, fp8, parameters

Array = jax.Array

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nnx.Module):
    """Multi-head attention, a drop-in for `flax.nnx.MultiHeadAttention`.

    Parameters (names and shapes as the stock module, with F = in_features,
    Fkv = in_kv_features, d = qkv_features // num_heads, h_kv = num_kv_heads):

    - query: LinearGeneral kernel [F, h, d], bias [h, d]
    - key, value: LinearGeneral kernel [Fkv, h_kv, d], bias [h_kv, d]
    - out: LinearGeneral kernel [h, d, out_features], bias [out_features]
    - with fused_qkv=True, instead of query/key/value: qkv, kernel [F, h + 2 h_kv, d],
      bias [h + 2 h_kv, d] (query heads, then key heads, then value heads); query/key/value
      are then None
    - with normalize_qk=True: query_ln, key_ln LayerNorm scale [d] (no bias)
    - with config.softmax == "learnable": softmax_offset, nnx.Param float32 [h] (zeros)

    Decoding: `init_cache(input_shape, dtype)` creates nnx.Cache variables
    cached_key / cached_value [batch..., max_len, h_kv, d] and cache_index
    (int32 []), as in the stock module; calls with decode=True (argument or
    attribute) write the new tokens at cache_index and attend bottom-right
    causally to the filled cache, so step-by-step decoding equals the
    full-sequence causal attention. Writing past max_len raises ValueError eagerly;
    under jit the outputs are NaN and checkify reports it (config.sequence.check_bounds).

    Paged decoding (fusedattn.layers.paged): `init_paged_cache(num_pages, page_size,
    dtype)` creates nnx.Cache key_pages / value_pages [num_pages, page_size, h_kv, d];
    a call with pages=PageTable (inputs [max_seqs, n, in_features], self-attention)
    writes the step's k/v into them and attends to each sequence's cached tokens.

    Args (the stock module's, in its order; the first six may be positional):
      num_heads: query heads h.
      in_features: features F of inputs_q.
      qkv_features: h * d (default in_features). out_features: default in_features.
      num_kv_heads: key/value heads h_kv (GQA/MQA), default num_heads.
      in_kv_features: features of inputs_k/inputs_v (default in_features).
      dtype: computation dtype (e.g. jnp.bfloat16); param_dtype: parameter dtype.
      broadcast_dropout: accepted for the stock signature; the fused op draws one
        dropout mask element per (batch, head, query, key) either way.
      dropout_rate: when given, the dropout rate of the call (replacing
        config.dropout_rate); None keeps the config's.
      deterministic: default for the call's deterministic flag (needed only with dropout).
      precision, kernel_init, out_kernel_init, bias_init, out_bias_init, use_bias:
        as the stock module, for the projections.
      attention_fn: must stay None: this layer is the attention (an error says so).
      decode: default for the call's decode flag.
      normalize_qk: LayerNorm on q and k per head (query_ln, key_ln).
      qkv_promote_dtype, out_promote_dtype, ln_promote_dtype, qkv_dot_general,
        out_dot_general, qkv_dot_general_cls, out_dot_general_cls, kernel_metadata,
        out_kernel_metadata, bias_metadata, out_bias_metadata, query_ln_scale_metadata,
        key_ln_scale_metadata: given to the projections and norms as the stock module does.
      rngs, keep_rngs: nnx.Rngs for parameter init; its "dropout" stream is kept
        (forked) for dropout when the dropout rate is > 0 and keep_rngs is True.
      config: the attention ConfigDict (fusedattn.configs.attention_config()); None:
        the stock module's semantics (`fusedattn.layers.stock.stock_config()`: mask
        "no_mask", the call's `mask` being the only one).
      fused_qkv, rope, rope_theta: see fusedattn.layers.linen.
      return_max_logit: sow each call's max_logit float32 [h] (each head's largest logit,
        fusedattn.ops.max_logit) as the nnx.Intermediate "max_logit" (read it with
        nnx.capture(model, nnx.Intermediate)).

    FP8 attention (config.fp8.enabled): fp8_scale float32 [10] and fp8_amax_history
    float32 [L, 10] (fusedattn.ops.fp8) are Fp8Meta variables. Each call records the
    forward's amaxes in them; the gradient with respect to them is the state with the
    backward's amaxes recorded as well: `apply_fp8_gradients(model, grads)` writes it
    (differentiate with nnx.DiffState(0, (nnx.Param, Fp8Meta))). Without that, dO and dP
    are scaled from their own amax each step.
    """

    def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
                 out_features: int | None = None, num_kv_heads: int | None = None,
                 in_kv_features: int | None = None, *, dtype: Any = None,
                 param_dtype: Any = jnp.float32, broadcast_dropout: bool = True,
                 dropout_rate: float | None = None, deterministic: bool | None = None,
                 precision: Any = None,
                 kernel_init: Callable = nnx.nn.linear.default_kernel_init,
                 out_kernel_init: Callable | None = None,
                 bias_init: Callable = nnx.initializers.zeros_init(),
                 out_bias_init: Callable | None = None, use_bias: bool = True,
                 attention_fn: Callable | None = None, decode: bool | None = None,
                 normalize_qk: bool = False,
                 qkv_promote_dtype: Callable = dtypes.promote_dtype,
                 out_promote_dtype: Callable = dtypes.promote_dtype,
                 ln_promote_dtype: Callable = dtypes.promote_dtype,
                 qkv_dot_general: Any = None, out_dot_general: Any = None,
                 qkv_dot_general_cls: Any = None, out_dot_general_cls: Any = None,
                 rngs: nnx.Rngs, keep_rngs: bool = True,
                 kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
                 out_kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
                 bias_metadata: Mapping[str, Any] = MappingProxyType({}),
                 out_bias_metadata: Mapping[str, Any] = MappingProxyType({}),
                 query_ln_scale_metadata: Mapping[str, Any] = MappingProxyType({}),
                 key_ln_scale_metadata: Mapping[str, Any] = MappingProxyType({}),
                 config: Any = None, fused_qkv: bool = False, rope: bool = False,
                 rope_theta: float = 10000.0, return_max_logit: bool = False):
        del broadcast_dropout  # the op's dropout masks are per element either way
        stock.check_attention_fn(attention_fn)
        self.spec = stock.layer_spec(config, dropout_rate)
        self.num_heads = num_heads
        self.in_features = in_features
        self.qkv_features = qkv_features if qkv_features is not None else in_features
        self.out_features = out_features if out_features is not None else in_features
        self.in_kv_features = in_kv_features if in_kv_features is not None else in_features
        common.check_num_heads(num_heads)
        if self.qkv_features % num_heads:
            raise ValueError(
                f"qkv_features: {self.qkv_features} is not divisible by num_heads {num_heads}."
            )
        self.head_dim = self.qkv_features // num_heads
        self.options = common.check_options(num_heads, num_kv_heads, self.head_dim, rope=rope,
                                            rope_theta=rope_theta, fused_qkv=fused_qkv)
        self.num_kv_heads = self.options.num_kv_heads
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.decode = decode
        self.deterministic = deterministic
        h, h_kv, d = num_heads, self.num_kv_heads, self.head_dim
        self.qkv, self.query, self.key, self.value = parameters.qkv_projections(
            fused_qkv, in_features, self.in_kv_features, h, h_kv, d, dtype=dtype,
            param_dtype=param_dtype, kernel_init=kernel_init, bias_init=bias_init,
            use_bias=use_bias, precision=precision, promote_dtype=qkv_promote_dtype,
            dot_general=qkv_dot_general, dot_general_cls=qkv_dot_general_cls,
            kernel_metadata=kernel_metadata, bias_metadata=bias_metadata, rngs=rngs)
        self.query_ln, self.key_ln = parameters.qk_norms(
            normalize_qk, d, query_ln_scale_metadata, key_ln_scale_metadata, dtype=dtype,
            param_dtype=param_dtype, promote_dtype=ln_promote_dtype, rngs=rngs)
        self.softmax_offset = parameters.softmax_offset(self.spec, h)
        self.out = nnx.LinearGeneral((h, d), self.out_features, axis=(-2, -1),
                                     kernel_init=out_kernel_init or kernel_init,
                                     bias_init=out_bias_init or bias_init, use_bias=use_bias,
                                     dtype=dtype, param_dtype=param_dtype, precision=precision,
                                     promote_dtype=out_promote_dtype, dot_general=out_dot_general,
                                     dot_general_cls=out_dot_general_cls,
                                     kernel_metadata=out_kernel_metadata or kernel_metadata,
                                     bias_metadata=out_bias_metadata or bias_metadata, rngs=rngs)
        self.rngs = (rngs.dropout.fork() if keep_rngs and self.spec.dropout_rate > 0
                     else nnx.data(None))
        self.cached_key = self.cached_value = self.cache_index = nnx.data(None)
        self.key_pages = self.value_pages = nnx.data(None)
        self.fp8_scale, self.fp8_amax_history = fp8.variables(self.spec)
        self.return_max_logit = return_max_logit

    def __call__(self, inputs_q: Array, inputs_k: Array | None = None,
                 inputs_v: Array | None = None, *, mask: Array | None = None,
                 deterministic: bool | None = None,
                 rngs: nnx.Rngs | nnx.RngStream | None = None, sow_weights: bool = False,
                 decode: bool | None = None, is_causal: bool = False, out_sharding=None,
                 qkv_sharding=None, bias: Array | None = None, sequence=None,
                 pages: paged.PageTable | None = None) -> Array:
        """Attention of inputs_q over inputs_k / inputs_v (self-attention when None).

        Args (the stock call's, then ours):
          inputs_q: [batch..., sq, in_features].
          inputs_k: [batch..., skv, in_kv_features] (default inputs_q).
          inputs_v: [batch..., skv, in_kv_features] (default inputs_k).
          mask: broadcastable to [batch..., h, sq, skv], True = attend (bool; 0/1
            numeric masks as made by flax.linen.make_attention_mask also work), ANDed
            with config.mask (given to the op as a bias array; see
            fusedattn.layers.masks on backend eligibility).
          deterministic: False applies dropout (overrides the attribute).
          rngs: nnx.Rngs or RngStream for dropout (overrides the kept rngs).
          sow_weights: must be False: the fused op never forms the weights.
          decode: use the KV cache (overrides the attribute).
          is_causal: True adds a causal mask to config.mask (top-left; with padding,
            "padding_causal"), as the stock call overlays one.
          out_sharding, qkv_sharding: the sharding of the output / q, k, v projections'
            results, given to them as the stock module does.
          bias: per config.bias: [batch..., h|1, sq, skv], or [h] ALiBi slopes.
          sequence: fusedattn.ops.SequenceDescriptor (one batch axis).
          pages: a paged step (fusedattn.layers.paged.PageTable after `allocate`): use the
            paged cache of init_paged_cache instead; inputs_q [max_seqs, n, in_features].

        Returns:
          [batch..., sq, out_features].
        """
        stock.check_sow_weights(sow_weights)
        spec = stock.with_causal_mask(self.spec) if is_causal else self.spec
        inputs_k, inputs_v = common.default_key_value(inputs_q, inputs_k, inputs_v, "inputs_k",
                                                      "inputs_v")
        if inputs_q.shape[-1] != self.in_features:
            raise ValueError(
                f"inputs_q: got {inputs_q.shape[-1]} features, the layer expects in_features="
                f"{self.in_features}."
            )
        query, key, value = parameters.project(self, inputs_q, inputs_k, inputs_v, qkv_sharding)
        softmax_offset = None if self.softmax_offset is None else self.softmax_offset[...]
        if pages is not None:
            x = caches.paged_step(
                self.spec, self.options, query, key, value, (self.key_pages, self.value_pages),
                pages, inputs_q.shape, q_norm=self.query_ln, k_norm=self.key_ln,
                softmax_offset=softmax_offset, mask=mask, bias=bias, sequence=sequence,
                separate_kv=not (inputs_k is inputs_q and inputs_v is inputs_q))
            return self.out(x)
        decode = self.decode if decode is None else decode
        cache = (caches.read(self.cached_key, self.cached_value, self.cache_index) if decode
                 else None)
        dropout_rng, deterministic = dropout.dropout_key(spec, deterministic, self.deterministic,
                                                         rngs, self.rngs)
        fp8_state = fp8.read(self.fp8_scale, self.fp8_amax_history)
        x, new_cache, extras = common.core(
            spec, self.options, query, key, value,
            q_norm=self.query_ln, k_norm=self.key_ln, cache=cache, mask=mask, bias=bias,
            softmax_offset=softmax_offset, sequence=sequence, dropout_rng=dropout_rng,
            deterministic=deterministic, fp8_state=fp8_state,
            return_max_logit=self.return_max_logit)
        if new_cache is not None:
            caches.write((self.cached_key, self.cached_value, self.cache_index), new_cache)
        if fp8_state is not None:
            fp8.write(self.fp8_scale, self.fp8_amax_history, extras.fp8_state)
        if self.return_max_logit:
            self.sow(nnx.Intermediate, "max_logit", extras.max_logit)
        return self.out(x, out_sharding=out_sharding)

    def init_paged_cache(self, num_pages: int, page_size: int, dtype: Any = None) -> None:
        """Creates the paged cache: nnx.Cache key_pages / value_pages, zeros
        [num_pages, page_size, h_kv, d] in `dtype` (default: the layer's dtype, else float32)."""
        self.key_pages, self.value_pages = caches.paged_cache(
            num_pages, page_size, self.num_kv_heads, self.head_dim,
            dtype or self.dtype or jnp.float32)

    def init_cache(self, input_shape: tuple[int, ...], dtype: Any = jnp.float32) -> None:
        """Creates the decode cache for inputs of shape [batch..., max_len, features].

        cached_key / cached_value: nnx.Cache zeros [batch..., max_len, h_kv, d] in
        `dtype`; cache_index: nnx.Cache int32 0.
        """
        self.cached_key, self.cached_value, self.cache_index = caches.decode_cache(
            input_shape, self.num_kv_heads, self.head_dim, dtype)

    def set_view(self, deterministic: bool | None = None, decode: bool | None = None,
                 batch_size: int | tuple[int, ...] | None = None,
                 max_length: int | None = None) -> None:
        """Used by `nnx.view(model, deterministic=..., decode=...)`, as in the stock module.

        Turning decode on without a cache creates one of shape
        [*batch_size, max_length, h_kv, d] in the layer's dtype (float32 if None).
        """
        if deterministic is not None:
            self.deterministic = deterministic
        if decode is not None:
            self.decode = decode
            if decode and self.cached_key is None:
                self.init_cache(caches.decode_cache_shape(batch_size, max_length,
                                                          self.in_features),
                                self.dtype or jnp.float32)
