"""One example's heads in the Equinox layer: its projections into heads and back, the
per-head QK norms, and what a per-example call hands to the batched op (the descriptor's
batch axis, the stock `process_heads` hook).

Shapes: one example, s tokens; h / h_kv query / key-value heads; the layer's qk_size and
vo_size per-head dims.
"""

from __future__ import annotations

from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from fusedattn.layers import common
from fusedattn.ops.enums import SequenceFormat
from fusedattn.ops.sequence import SequenceDescriptor

Array = jax.Array

__all__ = ["batch_descriptor", "compute_dtype", "linear", "output", "processed_heads",
           "project", "project_qkv", "qk_norms"]

# How many axes each descriptor form has with its batch axis (see SequenceDescriptor).
_BATCHED_NDIM = {SequenceFormat.SEQLENS: 1, SequenceFormat.SEQLENS_OFFSETS: 2,
                 SequenceFormat.SEGMENT_IDS: 2}


def linear(in_size: int, out_size: int, use_bias: bool, dtype, key) -> eqx.nn.Linear:
    """A projection's eqx.nn.Linear (weight [out_size, in_size])."""
    return eqx.nn.Linear(in_size, out_size, use_bias=use_bias, dtype=dtype, key=key)


def project(layer: eqx.nn.Linear, x: Array, heads: int, dtype) -> Array:
    """[s, in] -> [s, heads, out / heads]: x @ W.T + b in `dtype` (one matmul, no vmap)."""
    weight = layer.weight.astype(dtype)
    y = jnp.matmul(x.astype(dtype), weight.T)
    if layer.bias is not None:
        y = y + layer.bias.astype(dtype)
    return y.reshape(x.shape[0], heads, -1)


def compute_dtype(mha, *inputs: Array):
    """The dtype of the projections and attention: the layer's compute_dtype, else the
    promoted dtype of `inputs` and the projection parameters."""
    if mha.compute_dtype is not None:
        return mha.compute_dtype
    params = (mha.query_proj if mha.qkv_proj is None else mha.qkv_proj).weight
    return jnp.result_type(*(x.dtype for x in inputs), params.dtype)


def project_qkv(mha, query: Array, key_: Array, value: Array, dtype
                ) -> tuple[Array, Array, Array]:
    """q [sq, h, qk_size], k [skv, h_kv, qk_size], v [skv, h_kv, vo_size] through the
    layer's qkv_proj (self-attention only: an error otherwise) or its three projections."""
    h, h_kv = mha.num_heads, mha.num_kv_heads
    if mha.qkv_proj is None:
        return (project(mha.query_proj, query, h, dtype),
                project(mha.key_proj, key_, h_kv, dtype),
                project(mha.value_proj, value, h_kv, dtype))
    common.check_self_attention(
        query, key_, value, "key_", "value",
        alternative=" or pass the same array as query (e.g. jax.vmap(lambda x: mha(x, x, x)))")
    return common.split_fused_qkv(project(mha.qkv_proj, query, h + 2 * h_kv, dtype), h, h_kv)


def output(mha, x: Array, dtype) -> Array:
    """[..., h * vo_size] -> [..., output_size] through the layer's output_proj, in `dtype`."""
    out = jnp.matmul(x, mha.output_proj.weight.astype(dtype).T)
    if mha.output_proj.bias is not None:
        out = out + mha.output_proj.bias.astype(dtype)
    return out


def _per_head(layer) -> Callable[[Array], Array]:
    """A LayerNorm over the last axis as a function of [..., d] arrays (QK norm per head)."""
    return lambda x: jax.vmap(layer)(x.reshape(-1, x.shape[-1])).reshape(x.shape).astype(x.dtype)


def qk_norms(mha):
    """(q_norm, k_norm) for common.core: the layer's query_ln / key_ln per head, or Nones."""
    if mha.query_ln is None:
        return None, None
    return _per_head(mha.query_ln), _per_head(mha.key_ln)


def batch_descriptor(sequence):
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


def processed_heads(process_heads: Callable, q: Array, k: Array, v: Array):
    """The stock `process_heads` hook on [s, heads, dim] q, k, v; shapes must not change."""
    shapes = (q.shape, k.shape, v.shape)
    q, k, v = process_heads(q, k, v)
    if (q.shape, k.shape, v.shape) != shapes:
        raise ValueError(
            f"process_heads: must return q, k, v of the shapes it was given {shapes}, got "
            f"{(q.shape, k.shape, v.shape)}."
        )
    return q, k, v
