"""A next-item recommender (Flax NNX): one query token per user cross-attends to its history.

    query  = context embedding                                  [b, P, d]   (P users per row)
    memory = item embedding + recency embedding of the history  [b, 16 P, d] (THD, packed)
    num_layers x ( query += MHA(LN(query), LN(memory)) ; query += MLP(LN(query)) )
    logits = Linear(LN(query)) over the catalog                 [b, P, num_items]

The attention is fusedattn.layers.nnx.MultiHeadAttention configured by
config.model.attention (configs/attention/small_seq.py: THD layout, padding mask,
sequence.max_seqlen_q = 1, max_seqlen_kv = 16, small_seq opt-in). With the BSHD
layout the same model runs one user per row: query [b, 1, d], memory [b, 16, d].
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from examples.common import model_facts, trees
from examples.small_seq.data import MAX_HISTORY
from fusedattn.layers import nnx as fa_nnx
from fusedattn.ops import SequenceDescriptor
from fusedattn.ops.spec import AttentionSpec


@dataclasses.dataclass
class Model:
    params: dict
    apply: Callable[..., jax.Array]
    num_params: int
    num_embedding_params: int


def sequence_descriptor(attention, batch) -> SequenceDescriptor:
    """The descriptor for the config's layout: THD lengths + offsets, or BSHD lengths."""
    spec = AttentionSpec.from_config(attention)
    if spec.qkv_layout.is_thd:
        return SequenceDescriptor.from_seqlens_and_offsets(
            batch["q_seqlens"], batch["kv_seqlens"], batch["q_offsets"], batch["kv_offsets"])
    return SequenceDescriptor.from_seqlens(batch["q_seqlens"], batch["kv_seqlens"])


def build(c, attention, seed: int, num_items: int, num_contexts: int) -> Model:
    if c.framework != "nnx":
        raise ValueError(f"config.model.framework: the recommender is written in Flax NNX; got "
                         f"{c.framework!r}, expected 'nnx'.")
    dtype = model_facts.compute_dtype(c.dtype)

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            d = c.d_model
            self.ln_q = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
            self.ln_kv = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
            self.attn = fa_nnx.MultiHeadAttention(
                c.num_heads, d, config=attention, num_kv_heads=c.num_kv_heads, use_bias=False,
                dtype=dtype, keep_rngs=False, rngs=rngs)
            self.ln2 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
            self.fc1 = nnx.Linear(d, c.mlp_dim, dtype=dtype, rngs=rngs)
            self.fc2 = nnx.Linear(c.mlp_dim, d, dtype=dtype, rngs=rngs)

        def __call__(self, q, memory, sequence, dropout_key):
            rngs = None if dropout_key is None else nnx.Rngs(dropout=dropout_key)
            q = q + self.attn(self.ln_q(q), self.ln_kv(memory), sequence=sequence,
                              deterministic=dropout_key is None, rngs=rngs)
            return q + self.fc2(nnx.gelu(self.fc1(self.ln2(q))))

    class Recommender(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            d = c.d_model
            self.item_embed = nnx.Embed(num_items, d, dtype=dtype, rngs=rngs)
            self.recency_embed = nnx.Embed(MAX_HISTORY, d, dtype=dtype, rngs=rngs)
            self.context_embed = nnx.Embed(num_contexts, d, dtype=dtype, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(c.num_layers)])
            self.ln_f = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
            self.head = nnx.Linear(d, num_items, dtype=dtype, rngs=rngs)

        def __call__(self, batch, sequence, dropout_key):
            q = self.context_embed(batch["context"])
            memory = self.item_embed(batch["history"]) + self.recency_embed(batch["recency"])
            for i, block in enumerate(self.blocks):
                key = None if dropout_key is None else jax.random.fold_in(dropout_key, i)
                q = block(q, memory, sequence, key)
            return self.head(self.ln_f(q)).astype(jnp.float32)

    model = Recommender(nnx.Rngs(params=seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    named, rebuild = trees.named_leaves(params)
    dropout = AttentionSpec.from_config(attention).dropout_rate > 0

    def apply(named_params, batch, dropout_key=None):
        m = nnx.merge(graphdef, rebuild(named_params), rest)
        return m(batch, sequence_descriptor(attention, batch), dropout_key if dropout else None)

    embedding = trees.count_params(
        [named["item_embed"], named["recency_embed"], named["context_embed"]])
    return Model(named, apply, trees.count_params(named), embedding)
