"""`MultiheadAttention`, the Equinox drop-in over `fusedattn.ops.fused_attn` (its constructor,
call and paged step; one example's projections and the per-example adaptation live in
`heads`)."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from fusedattn.layers import common, paged, stock
from fusedattn.layers.equinox import heads
from fusedattn.ops.enums import SoftmaxType
from fusedattn.ops.spec import AttentionSpec

Array = jax.Array

__all__ = ["MultiheadAttention"]


class MultiheadAttention(eqx.Module):
    """Multi-head attention, a drop-in for `equinox.nn.MultiheadAttention` (unbatched).

    Fields (names and shapes as the stock module, with h_kv = num_kv_heads):

    - query_proj: Linear weight [h * qk_size, query_size]
    - key_proj: Linear weight [h_kv * qk_size, key_size]
    - value_proj: Linear weight [h_kv * vo_size, value_size]
    - output_proj: Linear weight [output_size, h * vo_size]
    - dropout: eqx.nn.Dropout(p, inference), as the stock module's (p is the layer's
      dropout rate; eqx.nn.inference_mode toggles its `inference`), so the leaves of a
      stock module serialised with eqx.tree_serialise_leaves load into this one
    - with fused_qkv=True, instead of query/key/value_proj (then None): qkv_proj, Linear
      weight [(h + 2 h_kv) * qk_size, query_size] (query, then key, then value rows)
    - with normalize_qk=True: query_ln, key_ln, eqx.nn.LayerNorm(qk_size) without bias
    - with config.softmax == "learnable": softmax_offset, float32 [h] (zeros at init)

    The call is unbatched like the stock module; `jax.vmap` over a batch adds the
    batch axis to the single fused_attn call inside (the op folds it into its
    batch: one kernel call, no loop).

    Args (the stock module's, in its order, positional too; then ours, keyword only):
      num_heads: query heads h.
      query_size: features of `query`.
      key_size, value_size: features of `key_` / `value` (default query_size).
      output_size: output features (default query_size).
      qk_size, vo_size: per-head q/k and v/output dims (default query_size // num_heads).
      use_query_bias, use_key_bias, use_value_bias, use_output_bias: as the stock
        module (fused_qkv uses use_query_bias).
      dropout_p: when given, the dropout rate of the call (replacing
        config.dropout_rate); None keeps the config's.
      inference: the default for the call's `inference` (True: no dropout); toggled
        by eqx.nn.inference_mode.
      dtype: parameter dtype, as in Equinox (default float32/float64 per x64 mode).
      key: PRNG key for parameter initialisation.
      config: the attention ConfigDict (fusedattn.configs.attention_config()); None:
        the stock module's semantics (`fusedattn.layers.stock.stock_config()`: mask
        "no_mask", the call's `mask` being the only one).
      num_kv_heads: key/value heads h_kv (GQA/MQA), default num_heads.
      compute_dtype: dtype of the projections and attention (e.g. jnp.bfloat16);
        default: the promoted dtype of inputs and parameters.
      normalize_qk, fused_qkv, rope, rope_theta: see fusedattn.layers.linen.
    """

    query_proj: eqx.nn.Linear | None
    key_proj: eqx.nn.Linear | None
    value_proj: eqx.nn.Linear | None
    output_proj: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    qkv_proj: eqx.nn.Linear | None
    query_ln: eqx.nn.LayerNorm | None
    key_ln: eqx.nn.LayerNorm | None
    softmax_offset: Array | None
    spec: AttentionSpec = eqx.field(static=True)
    options: common.LayerOptions = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    query_size: int = eqx.field(static=True)
    key_size: int = eqx.field(static=True)
    value_size: int = eqx.field(static=True)
    output_size: int = eqx.field(static=True)
    qk_size: int = eqx.field(static=True)
    vo_size: int = eqx.field(static=True)
    use_query_bias: bool = eqx.field(static=True)
    use_key_bias: bool = eqx.field(static=True)
    use_value_bias: bool = eqx.field(static=True)
    use_output_bias: bool = eqx.field(static=True)
    compute_dtype: Any = eqx.field(static=True)

    def __init__(self, num_heads: int, query_size: int, key_size: int | None = None,
                 value_size: int | None = None, output_size: int | None = None,
                 qk_size: int | None = None, vo_size: int | None = None,
                 use_query_bias: bool = False, use_key_bias: bool = False,
                 use_value_bias: bool = False, use_output_bias: bool = False,
                 dropout_p: float | None = None, inference: bool = False, dtype: Any = None,
                 *, key: Array, config: Any = None, num_kv_heads: int | None = None,
                 compute_dtype: Any = None, normalize_qk: bool = False,
                 fused_qkv: bool = False, rope: bool = False, rope_theta: float = 10000.0):
        self.spec = stock.layer_spec(config, dropout_p, "dropout_p")
        if self.spec.fp8_enabled:
            raise ValueError(
                "config.fp8.enabled: the Equinox layer keeps no FP8 state yet (its calls, one "
                "example each under jax.vmap, would each record their own amax); call "
                "fusedattn.ops.fused_attn with fp8_state= on the whole batch, or use the linen "
                "or nnx layer, or set config.fp8.enabled = False.")
        dtype = jnp.zeros(()).dtype if dtype is None else dtype  # float32, float64 under x64
        key_size = query_size if key_size is None else key_size
        value_size = query_size if value_size is None else value_size
        output_size = query_size if output_size is None else output_size
        common.check_num_heads(num_heads)
        qk_size = query_size // num_heads if qk_size is None else qk_size
        vo_size = query_size // num_heads if vo_size is None else vo_size
        self.options = common.check_options(num_heads, num_kv_heads, qk_size, rope=rope,
                                            rope_theta=rope_theta, fused_qkv=fused_qkv,
                                            head_dim_v=vo_size)
        h, h_kv = num_heads, self.options.num_kv_heads
        if fused_qkv and not key_size == value_size == query_size:
            raise ValueError(
                f"fused_qkv: one projection of the query serves self-attention only, so "
                f"key_size and value_size must equal query_size ({query_size}); got "
                f"{key_size} and {value_size}."
            )
        qkey, kkey, vkey, okey = jax.random.split(key, 4)
        if fused_qkv:
            self.qkv_proj = heads.linear(query_size, (h + 2 * h_kv) * qk_size, use_query_bias,
                                    dtype, qkey)
            self.query_proj = self.key_proj = self.value_proj = None
        else:
            self.qkv_proj = None
            self.query_proj = heads.linear(query_size, h * qk_size, use_query_bias, dtype, qkey)
            self.key_proj = heads.linear(key_size, h_kv * qk_size, use_key_bias, dtype, kkey)
            self.value_proj = heads.linear(value_size, h_kv * vo_size, use_value_bias, dtype, vkey)
        self.output_proj = heads.linear(h * vo_size, output_size, use_output_bias, dtype, okey)
        if normalize_qk:
            self.query_ln = eqx.nn.LayerNorm(qk_size, use_bias=False, dtype=dtype)
            self.key_ln = eqx.nn.LayerNorm(qk_size, use_bias=False, dtype=dtype)
        else:
            self.query_ln = self.key_ln = None
        self.softmax_offset = (jnp.zeros((h,), jnp.float32)
                               if self.spec.softmax == SoftmaxType.LEARNABLE else None)
        self.dropout = eqx.nn.Dropout(self.spec.dropout_rate, inference=inference)
        self.num_heads, self.num_kv_heads = h, h_kv
        self.query_size, self.key_size, self.value_size = query_size, key_size, value_size
        self.output_size, self.qk_size, self.vo_size = output_size, qk_size, vo_size
        self.use_query_bias, self.use_key_bias = use_query_bias, use_key_bias
        self.use_value_bias, self.use_output_bias = use_value_bias, use_output_bias
        self.compute_dtype = compute_dtype

    def __call__(self, query: Array, key_: Array | None = None, value: Array | None = None,
                 mask: Array | None = None, *, key: Array | None = None,
                 inference: bool | None = None, deterministic: bool | None = None,
                 process_heads: Callable | None = None, bias: Array | None = None,
                 sequence=None, return_max_logit: bool = False):
        """Attention of one example's query over its key/value sequence.

        Args (the stock call's, then ours):
          query: [sq, query_size].
          key_: [skv, key_size] (default query).
          value: [skv, value_size] (default key_).
          mask: [sq, skv] or [h, sq, skv], True = attend (bool, or 0/1 numeric),
            ANDed with config.mask (given to the op as a bias array; see
            fusedattn.layers.masks on backend eligibility).
          key: PRNG key for dropout (dropout rate > 0 and not inference).
          inference: True turns dropout off; None means the module's
            (`self.dropout.inference`).
          deterministic: deprecated name of `inference`, as in the stock module (warns).
          process_heads: as the stock module's: a function of the projected heads
            (q [sq, h, qk_size], k [skv, h_kv, qk_size], v [skv, h_kv, vo_size]) returning
            new heads of the same shapes (e.g. rotary embeddings), applied before QK
            normalisation and `rope`.
          bias: per config.bias: [h|1, sq, skv] (or [sq, skv]), or [h] ALiBi slopes.
          sequence: this example's SequenceDescriptor, without the batch axis
            (q_seqlens [], segment ids [s], ...) as jax.vmap hands it over from a
            batched descriptor; a descriptor with a batch axis of 1 is accepted too.
          return_max_logit: also return this example's max_logit float32 [h] (each head's
            largest logit, fusedattn.ops.max_logit; under jax.vmap [batch, h]: take the
            max over the batch axis).

        Returns:
          [sq, output_size]; (that, max_logit) with return_max_logit.
        """
        if deterministic is not None:
            inference = deterministic
            warnings.warn("MultiheadAttention()(deterministic=...) is deprecated in favour of "
                          "MultiheadAttention()(inference=...)", DeprecationWarning, stacklevel=2)
        key_, value = common.default_key_value(query, key_, value, "key_", "value")
        if key_.shape[0] != value.shape[0]:
            raise ValueError(
                f"key_, value: must have equal sequence lengths, got {key_.shape[0]} and "
                f"{value.shape[0]}."
            )
        if query.ndim != 2:
            raise ValueError(
                f"query: expected one example of shape [sq, query_size], got "
                f"{tuple(query.shape)}; use jax.vmap over a batch."
            )
        spec = self._spec()
        dtype = heads.compute_dtype(self, query, key_, value)
        q, k, v = heads.project_qkv(self, query, key_, value, dtype)

        if process_heads is not None:
            q, k, v = heads.processed_heads(process_heads, q, k, v)
        inference = self.dropout.inference if inference is None else inference
        deterministic = bool(inference) or spec.dropout_rate == 0
        if not deterministic and key is None:
            raise common.missing_dropout_rng(
                spec, "pass key=jax.random.key(...) to the call, or inference=True.")
        q_norm, k_norm = heads.qk_norms(self)
        if bias is not None and jnp.ndim(bias) > 1:  # [h|1, sq, skv]: add the batch axis
            bias = jnp.asarray(bias)[None]
        x, _, extras = common.core(
            spec, self.options, q[None], k[None], v[None],
            q_norm=q_norm, k_norm=k_norm,
            mask=None if mask is None else jnp.asarray(mask)[None],
            bias=bias,
            softmax_offset=self.softmax_offset, sequence=heads.batch_descriptor(sequence),
            dropout_rng=None if deterministic else key, deterministic=deterministic,
            return_max_logit=return_max_logit)
        out = heads.output(self, x[0].reshape(query.shape[0], -1), dtype)
        return (out, extras.max_logit) if return_max_logit else out

    def _spec(self) -> AttentionSpec:
        """The layer's spec; `dropout.p` (a leaf, as in the stock module) must still be the
        dropout rate the layer was built with."""
        rate = self.dropout.p
        if not isinstance(rate, jax.core.Tracer) and float(rate) != self.spec.dropout_rate:
            raise ValueError(
                f"dropout.p: {float(rate)} differs from the layer's dropout rate "
                f"{self.spec.dropout_rate} (set at construction from dropout_p or "
                f"config.dropout_rate, and static); build the layer with dropout_p={float(rate)}."
            )
        return self.spec

    def paged_step(self, query: Array, cache: paged.PagedKVCache,
                   pages: paged.PageTable) -> tuple[Array, paged.PagedKVCache]:
        """A paged decoding step (fusedattn.layers.paged) for every sequence slot at once.

        Args:
          query: [max_seqs, n, query_size], each sequence's new tokens left-aligned
            (self-attention; no vmap: the slots are the batch).
          cache: this layer's PagedKVCache, e.g. paged.kv_cache(num_pages, page_size,
            layer.num_kv_heads, layer.qk_size, dtype, head_dim_v=layer.vo_size).
          pages: the model's PageTable after paged.allocate.

        Returns:
          (out [max_seqs, n, output_size], the updated cache).
        """
        paged.check_step(pages, tuple(query.shape), "query", mask=None, bias=None,
                         sequence=None)
        slots, n, _ = query.shape
        dtype = heads.compute_dtype(self, query)
        flat = query.reshape(slots * n, -1)
        q, k, v = (x.reshape(slots, n, *x.shape[1:])
                   for x in heads.project_qkv(self, flat, flat, flat, dtype))
        q_norm, k_norm = heads.qk_norms(self)
        x, cache = paged.step(self.spec, self.options, q, k, v, q_norm=q_norm, k_norm=k_norm,
                              cache=cache, pages=pages, softmax_offset=self.softmax_offset)
        return heads.output(self, x.reshape(slots, n, -1), dtype), cache

