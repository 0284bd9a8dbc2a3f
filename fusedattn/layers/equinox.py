"""Equinox MultiheadAttention over `fusedattn.ops.fused_attn`, driven by the attention config."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from fusedattn.layers import common
from fusedattn.ops.enums import SequenceFormat, SoftmaxType
from fusedattn.ops.sequence import SequenceDescriptor
from fusedattn.ops.spec import AttentionSpec

Array = jax.Array

__all__ = ["MultiheadAttention"]

# How many axes each descriptor form has with its batch axis (see SequenceDescriptor).
_BATCHED_NDIM = {SequenceFormat.SEQLENS: 1, SequenceFormat.SEQLENS_OFFSETS: 2,
                 SequenceFormat.SEGMENT_IDS: 2}


def _linear(in_size: int, out_size: int, use_bias: bool, dtype, key) -> eqx.nn.Linear:
    return eqx.nn.Linear(in_size, out_size, use_bias=use_bias, dtype=dtype, key=key)


def _project(linear: eqx.nn.Linear, x: Array, heads: int, dtype) -> Array:
    """[s, in] -> [s, heads, out / heads]: x @ W.T + b in `dtype` (one matmul, no vmap)."""
    weight = linear.weight.astype(dtype)
    y = jnp.matmul(x.astype(dtype), weight.T)
    if linear.bias is not None:
        y = y + linear.bias.astype(dtype)
    return y.reshape(x.shape[0], heads, -1)


def _batch_descriptor(sequence):
    """Adds the batch axis (of 1) to a per-example descriptor; batched ones pass unchanged."""
    if sequence is None:
        return None
    if not isinstance(sequence, SequenceDescriptor):
        raise TypeError(
            f"sequence: expected a fusedattn.ops.SequenceDescriptor, got {type(sequence).__name__}."
        )
    leading = (sequence.q_segment_ids if sequence.format == SequenceFormat.SEGMENT_IDS
               else sequence.q_seqlens)
    if leading.ndim == _BATCHED_NDIM[sequence.format]:
        return sequence
    return jax.tree_util.tree_map(lambda x: x[None], sequence)


class MultiheadAttention(eqx.Module):
    """Multi-head attention, a drop-in for `equinox.nn.MultiheadAttention` (unbatched).

    Fields (names and shapes as the stock module, with h_kv = num_kv_heads):

    - query_proj: Linear weight [h * qk_size, query_size]
    - key_proj: Linear weight [h_kv * qk_size, key_size]
    - value_proj: Linear weight [h_kv * vo_size, value_size]
    - output_proj: Linear weight [output_size, h * vo_size]
    - with fused_qkv=True, instead of query/key/value_proj (then None): qkv_proj, Linear
      weight [(h + 2 h_kv) * qk_size, query_size] (query, then key, then value rows)
    - with normalize_qk=True: query_ln, key_ln, eqx.nn.LayerNorm(qk_size) without bias
    - with config.softmax == "learnable": softmax_offset, float32 [h] (zeros at init)

    The call is unbatched like the stock module; `jax.vmap` over a batch adds the
    batch axis to the single fused_attn call inside (the op folds it into its
    batch: one kernel call, no loop).

    Args:
      num_heads: query heads h.
      query_size: features of `query`.
      config: the attention ConfigDict (fusedattn.configs.attention_config()).
      key_size, value_size: features of `key_` / `value` (default query_size).
      output_size: output features (default query_size).
      qk_size, vo_size: per-head q/k and v/output dims (default query_size // num_heads).
      num_kv_heads: key/value heads h_kv (GQA/MQA), default num_heads.
      use_query_bias, use_key_bias, use_value_bias, use_output_bias: as the stock
        module (fused_qkv uses use_query_bias).
      dtype: parameter dtype, as in Equinox (default float32/float64 per x64 mode).
      compute_dtype: dtype of the projections and attention (e.g. jnp.bfloat16);
        default: the promoted dtype of inputs and parameters.
      normalize_qk, fused_qkv, rope, rope_theta: see fusedattn.layers.linen.
      inference: the default for the call's `inference` (True: no dropout); toggled
        by eqx.nn.inference_mode.
      key: PRNG key for parameter initialisation.
    """

    query_proj: eqx.nn.Linear | None
    key_proj: eqx.nn.Linear | None
    value_proj: eqx.nn.Linear | None
    output_proj: eqx.nn.Linear
    qkv_proj: eqx.nn.Linear | None
    query_ln: eqx.nn.LayerNorm | None
    key_ln: eqx.nn.LayerNorm | None
    softmax_offset: Array | None
    inference: bool
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

    def __init__(self, num_heads: int, query_size: int, *, config: Any,
                 key_size: int | None = None, value_size: int | None = None,
                 output_size: int | None = None, qk_size: int | None = None,
                 vo_size: int | None = None, num_kv_heads: int | None = None,
                 use_query_bias: bool = False, use_key_bias: bool = False,
                 use_value_bias: bool = False, use_output_bias: bool = False,
                 dtype: Any = None, compute_dtype: Any = None, normalize_qk: bool = False,
                 fused_qkv: bool = False, rope: bool = False, rope_theta: float = 10000.0,
                 inference: bool = False, key: Array):
        self.spec = common.spec_of(config)
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
            self.qkv_proj = _linear(query_size, (h + 2 * h_kv) * qk_size, use_query_bias,
                                    dtype, qkey)
            self.query_proj = self.key_proj = self.value_proj = None
        else:
            self.qkv_proj = None
            self.query_proj = _linear(query_size, h * qk_size, use_query_bias, dtype, qkey)
            self.key_proj = _linear(key_size, h_kv * qk_size, use_key_bias, dtype, kkey)
            self.value_proj = _linear(value_size, h_kv * vo_size, use_value_bias, dtype, vkey)
        self.output_proj = _linear(h * vo_size, output_size, use_output_bias, dtype, okey)
        if normalize_qk:
            self.query_ln = eqx.nn.LayerNorm(qk_size, use_bias=False, dtype=dtype)
            self.key_ln = eqx.nn.LayerNorm(qk_size, use_bias=False, dtype=dtype)
        else:
            self.query_ln = self.key_ln = None
        self.softmax_offset = (jnp.zeros((h,), jnp.float32)
                               if self.spec.softmax == SoftmaxType.LEARNABLE else None)
        self.inference = inference
        self.num_heads, self.num_kv_heads = h, h_kv
        self.query_size, self.key_size, self.value_size = query_size, key_size, value_size
        self.output_size, self.qk_size, self.vo_size = output_size, qk_size, vo_size
        self.use_query_bias, self.use_key_bias = use_query_bias, use_key_bias
        self.use_value_bias, self.use_output_bias = use_value_bias, use_output_bias
        self.compute_dtype = compute_dtype

    def __call__(self, query: Array, key_: Array | None = None, value: Array | None = None,
                 mask: Array | None = None, *, bias: Array | None = None, sequence=None,
                 key: Array | None = None, inference: bool | None = None) -> Array:
        """Attention of one example's query over its key/value sequence.

        Args:
          query: [sq, query_size].
          key_: [skv, key_size] (default query).
          value: [skv, value_size] (default key_).
          mask: [sq, skv] or [h, sq, skv], True = attend (bool, or 0/1 numeric),
            ANDed with config.mask (given to the op as a bias array; see
            fusedattn.layers.common on backend eligibility).
          bias: per config.bias: [h|1, sq, skv] (or [sq, skv]), or [h] ALiBi slopes.
          sequence: this example's SequenceDescriptor, without the batch axis
            (q_seqlens [], segment ids [s], ...) as jax.vmap hands it over from a
            batched descriptor; a descriptor with a batch axis of 1 is accepted too.
          key: PRNG key for dropout (config.dropout_rate > 0 and not inference).
          inference: True turns dropout off; None means the module's `inference`.

        Returns:
          [sq, output_size].
        """
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
        spec = self.spec
        h, h_kv = self.num_heads, self.num_kv_heads
        params = [p for p in (self.qkv_proj, self.query_proj) if p is not None][0].weight
        dtype = (self.compute_dtype if self.compute_dtype is not None
                 else jnp.result_type(query.dtype, key_.dtype, value.dtype, params.dtype))
        if self.qkv_proj is not None:
            if not (key_ is query and value is query):
                raise ValueError(
                    "fused_qkv: the fused projection serves self-attention only; call with "
                    "key_=None and value=None, or pass the same array as query (e.g. "
                    "jax.vmap(lambda x: mha(x, x, x))), or build the layer with fused_qkv=False."
                )
            q, k, v = common.split_fused_qkv(
                _project(self.qkv_proj, query, h + 2 * h_kv, dtype), h, h_kv)
        else:
            q = _project(self.query_proj, query, h, dtype)
            k = _project(self.key_proj, key_, h_kv, dtype)
            v = _project(self.value_proj, value, h_kv, dtype)

        inference = self.inference if inference is None else inference
        deterministic = bool(inference) or spec.dropout_rate == 0
        if not deterministic and key is None:
            raise common.missing_dropout_rng(
                spec, "pass key=jax.random.key(...) to the call, or inference=True.")
        norm = None
        if self.query_ln is not None:
            def norm(layer):  # per head: [..., d] -> [..., d]
                return lambda x: jax.vmap(layer)(x.reshape(-1, x.shape[-1])).reshape(
                    x.shape).astype(x.dtype)
        if bias is not None and jnp.ndim(bias) > 1:  # [h|1, sq, skv]: add the batch axis
            bias = jnp.asarray(bias)[None]
        x, _ = common.core(
            spec, self.options, q[None], k[None], v[None],
            q_norm=None if norm is None else norm(self.query_ln),
            k_norm=None if norm is None else norm(self.key_ln),
            mask=None if mask is None else jnp.asarray(mask)[None],
            bias=bias,
            softmax_offset=self.softmax_offset, sequence=_batch_descriptor(sequence),
            dropout_rng=None if deterministic else key, deterministic=deterministic)
        x = x[0].reshape(query.shape[0], -1)
        out = jnp.matmul(x, self.output_proj.weight.astype(dtype).T)
        if self.output_proj.bias is not None:
            out = out + self.output_proj.bias.astype(dtype)
        return out
