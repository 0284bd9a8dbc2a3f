"""What the example trainers derive from a model config: the compute dtype, the head
dimension, the attention FLOPs of a step and the arrays `fusedattn.ops.explain` is asked
about."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from examples.common.trainer import check_positive


def compute_dtype(name: str):
    dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
    if name not in dtypes:
        raise ValueError(f"config.model.dtype: got {name!r}; expected one of {sorted(dtypes)}.")
    return dtypes[name]


def attention_train_flops(batch: int, seqlen_q: int, seqlen_kv: int, num_heads: int,
                          head_dim: int, num_layers: int, causal: bool) -> float:
    """FLOPs of the attention matmuls (QK^T and PV), forward plus backward (3x forward).

    Dense count over the [seqlen_q, seqlen_kv] score matrix per row and head, halved for a
    causal mask; packing and padding masks do not reduce it.
    """
    forward = 2 * 2 * seqlen_q * seqlen_kv * num_heads * head_dim
    return 3.0 * forward * batch * num_layers * (0.5 if causal else 1.0)


def explain_inputs(attention, batch: int, seqlen_q: int, seqlen_kv: int, num_heads: int,
                   num_kv_heads: int, head_dim: int, dtype):
    """(q, k, v ShapeDtypeStructs, config) as a layer calls fused_attn, for ops.explain.

    Separate arrays in the layout family of attention.qkv_layout (SBHD: [s, b, h, d],
    else [b, s, h, d]), and a copy of the config naming that family's separate layout
    (a packed layout packs these same arrays, see fusedattn.layers.qkv_layout).
    """
    import ml_collections
    from fusedattn.ops.spec import AttentionSpec

    family = AttentionSpec.from_config(attention).qkv_layout.format

    def struct(seqlen, heads):
        lead = (seqlen, batch) if family == "sbhd" else (batch, seqlen)
        return jax.ShapeDtypeStruct((*lead, heads, head_dim), dtype)

    separate = ml_collections.ConfigDict(attention.to_dict())
    separate.qkv_layout = "_".join([family] * 3)
    kv = struct(seqlen_kv, num_kv_heads)
    return (struct(seqlen_q, num_heads), kv, kv), separate


def head_dim(config) -> int:
    """config.model.d_model // num_heads, after checking both (ValueError naming the key)."""
    check_positive(config, "model.d_model", "model.num_heads")
    d_model, num_heads = config.model.d_model, config.model.num_heads
    if d_model % num_heads:
        raise ValueError(f"config.model.d_model ({d_model}) must be a multiple of "
                         f"config.model.num_heads ({num_heads}): each head gets "
                         "d_model / num_heads features.")
    return d_model // num_heads
