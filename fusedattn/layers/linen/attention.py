"""`MultiHeadDotProductAttention` and `MultiHeadAttention`, the Flax linen drop-ins over
`fusedattn.ops.fused_attn` (their fields and call; the submodules and parameters, caches,
FP8 state and dropout key live in this package's other modules)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from fusedattn.layers import common, paged, stock
from fusedattn.layers.linen import caches, dropout, fp8, parameters

Array = jax.Array

__all__ = ["MultiHeadAttention", "MultiHeadDotProductAttention"]


class MultiHeadDotProductAttention(nn.Module):
    """Multi-head attention, a drop-in for `flax.linen.MultiHeadDotProductAttention`.

    The stock module's fields in the stock order (positional too), then ours (keyword
    only); its call signature, and its default name: unnamed inside a compact module
    this one is scoped `MultiHeadDotProductAttention_{i}` and `MultiHeadAttention`
    (below) `MultiHeadAttention_{i}`, as the stock classes of those names, so a stock
    checkpoint loads unchanged.

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

    Paged decoding (fusedattn.layers.paged): with num_pages and page_size set, a call
    with pages=PageTable (inputs [max_seqs, n, F], self-attention) keeps key_pages /
    value_pages [num_pages, page_size, h_kv, d] in the "cache" collection (apply with
    mutable=["cache"]), writes the step's k/v there and attends to each sequence's
    cached tokens.

    FP8 attention (config.fp8.enabled): the scales and amax histories live in the
    collection flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT ("_overwrite_with_gradient"),
    as the variables fp8_scale float32 [10] and fp8_amax_history float32 [L, 10]
    (fusedattn.ops.fp8). Differentiating the loss with respect to that collection gives
    the state with every amax of the step recorded, and flax.training.train_state.
    TrainState.apply_gradients writes it back (the convention of Flax's own FP8 ops);
    applying with mutable=[OVERWRITE_WITH_GRADIENT] records the forward's amaxes too.

    With return_max_logit=True each call sows max_logit float32 [h] (each head's
    largest logit, fusedattn.ops.max_logit) into the "intermediates" collection.

    Attributes (the stock module's, in its order):
      num_heads: query heads h; qkv_features must be divisible by it.
      dtype: computation dtype (e.g. jnp.bfloat16), default inferred.
      param_dtype: parameter dtype (float32).
      qkv_features: total q/k/v features h * d (default: inputs_q features).
      out_features: output features (default: inputs_q features).
      broadcast_dropout: accepted for the stock signature; the fused op draws one
        dropout mask element per (batch, head, query, key) either way (as the
        stock broadcast_dropout=False does).
      dropout_rate: when given, the dropout rate of the call (replacing
        config.dropout_rate); None keeps the config's.
      deterministic: construction-time default merged with the call's (only
        needed with dropout), as in the stock module.
      precision, kernel_init, out_kernel_init, bias_init, out_bias_init, use_bias:
        as in the stock module (for the projections).
      attention_fn: must stay None: this layer is the attention (an error says so).
      decode: use the autoregressive KV cache.
      normalize_qk: LayerNorm on q and k per head (query_ln, key_ln).
      force_fp32_for_softmax: accepted; the fused op's softmax is float32 always.
      qkv_dot_general, out_dot_general, qkv_dot_general_cls, out_dot_general_cls:
        the projections' dot_general, as in the stock module.
      qk_attn_weights_einsum_cls, attn_weights_value_einsum_cls: must stay None
        (the fused op forms no weights to einsum; an error says so).

    Attributes of ours (keyword only):
      config: the attention ConfigDict (fusedattn.configs.attention_config()):
        backend, qkv_layout (its bshd/sbhd/thd family), mask, bias, softmax,
        dropout_rate, scale, window_size, sequence bounds, small_seq opt-in.
        None: the stock module's semantics (`fusedattn.layers.stock.stock_config()`:
        mask "no_mask", the call's `mask` being the only one).
      num_kv_heads: key/value heads h_kv (GQA/MQA), default num_heads.
      fused_qkv: one `qkv` projection for self-attention (selects the packed
        layout of the config's family: bs3hd, or bshd_bs2hd under GQA).
      rope: rotary embeddings on q and k (positions: 0..s-1, the descriptor's
        segment positions when `sequence` is given, + cache_index when decoding).
      rope_theta: RoPE base.
      num_pages, page_size: the paged cache's pool (needed by calls with pages=).
      return_max_logit: sow each call's max_logit (above).
    """

    num_heads: int
    dtype: Any = None
    param_dtype: Any = jnp.float32
    qkv_features: int | None = None
    out_features: int | None = None
    broadcast_dropout: bool = True
    dropout_rate: float | None = None
    deterministic: bool | None = None
    precision: Any = None
    kernel_init: Callable = nn.linear.default_kernel_init
    out_kernel_init: Callable | None = None
    bias_init: Callable = nn.initializers.zeros_init()
    out_bias_init: Callable | None = None
    use_bias: bool = True
    attention_fn: Callable | None = None
    decode: bool = False
    normalize_qk: bool = False
    force_fp32_for_softmax: bool = False
    qkv_dot_general: Any = None
    out_dot_general: Any = None
    qkv_dot_general_cls: Any = None
    out_dot_general_cls: Any = None
    qk_attn_weights_einsum_cls: Callable | None = None
    attn_weights_value_einsum_cls: Callable | None = None
    _: dataclasses.KW_ONLY
    config: Any = None
    num_kv_heads: int | None = None
    fused_qkv: bool = False
    rope: bool = False
    rope_theta: float = 10000.0
    num_pages: int | None = None
    page_size: int | None = None
    return_max_logit: bool = False

    @nn.compact
    def __call__(self, inputs_q: Array, inputs_k: Array | None = None,
                 inputs_v: Array | None = None, *, inputs_kv: Array | None = None,
                 mask: Array | None = None, bias: Array | None = None, sequence=None,
                 deterministic: bool | None = None, dropout_rng=None,
                 sow_weights: bool = False, pages: paged.PageTable | None = None) -> Array:
        """Attention of inputs_q over inputs_k / inputs_v (self-attention when None).

        Args (the stock call's, then ours):
          inputs_q: [batch..., sq, F].
          inputs_k: [batch..., skv, Fkv] keys (default inputs_q).
          inputs_v: [batch..., skv, Fkv] values (default inputs_k).
          inputs_kv: keys and values in one (instead of inputs_k / inputs_v), as the
            stock keyword.
          mask: broadcastable to [batch..., h, sq, skv], True = attend (bool; 0/1
            numeric masks as made by flax.linen.make_attention_mask also work),
            ANDed with config.mask (passed to the op as a bias array: see
            fusedattn.layers.masks on backend eligibility).
          deterministic: False applies dropout (when the dropout rate is > 0) with
            the "dropout" RNG stream.
          dropout_rng: an explicit dropout key instead of the "dropout" stream.
          sow_weights: must be False: the fused op never forms the weights.
          bias: per config.bias: [batch..., h|1, sq, skv] for pre/post-scale
            bias, optional [h] slopes for "alibi".
          sequence: fusedattn.ops.SequenceDescriptor (one batch axis) for padding
            masks, packing (segment ids) and THD layouts.
          pages: a paged step (fusedattn.layers.paged.PageTable after `allocate`):
            inputs_q [max_seqs, n, F]; uses the paged cache (see above).

        Returns:
          [batch..., sq, out_features].
        """
        stock.check_attention_fn(self.attention_fn)
        stock.check_weight_einsums(qk_attn_weights_einsum_cls=self.qk_attn_weights_einsum_cls,
                                   attn_weights_value_einsum_cls=self.attn_weights_value_einsum_cls)
        stock.check_sow_weights(sow_weights)
        spec = stock.layer_spec(self.config, self.dropout_rate)
        if inputs_kv is not None:
            if inputs_k is not None or inputs_v is not None:
                raise ValueError("inputs_kv: pass either inputs_kv or inputs_k/inputs_v, not both.")
            inputs_k = inputs_kv
        inputs_k, inputs_v = common.default_key_value(inputs_q, inputs_k, inputs_v, "inputs_k",
                                                      "inputs_v")
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
        query, key, value = parameters.project(self, options, head_dim, inputs_q, inputs_k,
                                               inputs_v)
        q_norm, k_norm = parameters.qk_norms(self)
        softmax_offset = parameters.softmax_offset(self, spec, options.num_heads)

        if pages is not None:
            x = caches.paged_step(
                self, spec, options, query, key, value, pages, tuple(inputs_q.shape),
                q_norm=q_norm, k_norm=k_norm, softmax_offset=softmax_offset, mask=mask,
                bias=bias, sequence=sequence,
                separate_kv=not (inputs_k is inputs_q and inputs_v is inputs_q))
            return parameters.output(self, x, features)

        cache = cache_vars = None
        if self.decode:
            cache_vars, cache = caches.decode_cache(self, key, value)
        dropout_rng, deterministic = dropout.dropout_key(self, spec, deterministic, dropout_rng)
        fp8_vars = fp8.variables(self, spec)
        x, new_cache, extras = common.core(
            spec, options, query, key, value, q_norm=q_norm, k_norm=k_norm, cache=cache,
            mask=mask, bias=bias, softmax_offset=softmax_offset, sequence=sequence,
            dropout_rng=dropout_rng, deterministic=deterministic, fp8_state=fp8.read(fp8_vars),
            return_max_logit=self.return_max_logit)
        if new_cache is not None:
            caches.write(cache_vars, new_cache)
        if fp8_vars is not None:
            fp8.write(self, fp8_vars, extras.fp8_state)
        if self.return_max_logit:
            self.sow("intermediates", "max_logit", extras.max_logit)
        return parameters.output(self, x, features)


class MultiHeadAttention(MultiHeadDotProductAttention):
    """The same module, a drop-in for `flax.linen.MultiHeadAttention`: unnamed inside a
    compact module it is scoped `MultiHeadAttention_{i}`, as that stock class is (while
    `MultiHeadDotProductAttention` is scoped `MultiHeadDotProductAttention_{i}`)."""

