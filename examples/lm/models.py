"""Decoder-only transformer LMs in Flax NNX and in Equinox over fusedattn's attention layers.

Both are the same pre-LayerNorm GPT: token + learned position embeddings
(positions restart at 0 in every packed document), `num_layers` blocks of
self-attention (fusedattn.layers.{nnx,equinox}) and a GELU MLP, a final
LayerNorm and an untied output projection. The attention core is configured
entirely by config.model.attention (backend, mask, sequence format...).

`build(model_config, attention_config, seed)` returns a `Model`: the trainable
parameters as a nested dict (examples.common.trees.named_leaves) and
`apply(params, inputs, positions, segment_ids, dropout_key) -> logits float32
[b, s, vocab]`; for the NNX model also `paged_decoder(params, num_pages, page_size)`,
a decoding step over a paged KV cache (fusedattn.layers.paged; examples/lm/generate.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from examples.common import model_facts, trees
from fusedattn.ops import SequenceDescriptor
from fusedattn.ops.enums import SequenceFormat
from fusedattn.ops.spec import AttentionSpec


@dataclasses.dataclass
class Model:
    params: dict
    apply: Callable[..., jax.Array]
    num_params: int
    num_embedding_params: int
    # (params, num_pages, page_size) -> step(tokens int [S, n], pages) -> logits [S, n, vocab]
    paged_decoder: Callable | None = None
    # Top-level keys of params replaced by their gradient each step (trainer.Task's).
    overwrite_with_gradient: tuple[str, ...] = ()
    # NNX: apply that also returns each layer's max_logit [num_layers, h] (config.model.qk_clip).
    apply_with_max_logit: Callable | None = None


# The NNX model's FP8 attention states (config.model.attention.fp8.enabled): a part of the
# params the trainer overwrites with its gradient (fusedattn.layers.nnx.Fp8Meta).
FP8_STATE = "fp8_state"


def sequence_descriptor(attention, segment_ids, positions) -> SequenceDescriptor | None:
    """The descriptor the attention config asks for, from packed rows.

    segment_ids, positions: int [b, s] as the data packs them (documents 1, 2, ...
    one after another from each row's first token, 0 for padding). The
    "seqlens_offsets" form (per-document lengths and offsets, computed once here
    for all layers) lets the cudnn backend skip reading the rows token by token.
    """
    spec = AttentionSpec.from_config(attention)
    if not spec.uses_segments:
        return None
    if spec.sequence_format == SequenceFormat.SEQLENS_OFFSETS:
        documents = jnp.arange(1, spec.max_segments_per_seq + 1, dtype=segment_ids.dtype)
        lengths = jnp.sum(segment_ids[:, :, None] == documents, axis=1, dtype=jnp.int32)
        offsets = jnp.pad(jnp.cumsum(lengths, axis=1, dtype=jnp.int32), ((0, 0), (1, 0)))
        lengths = jnp.where(lengths > 0, lengths, -1)
        return SequenceDescriptor.from_seqlens_and_offsets(lengths, lengths, offsets, offsets)
    return SequenceDescriptor.from_segment_ids_and_pos(segment_ids, segment_ids, positions,
                                                       positions)


def lookup(table: jax.Array, ids: jax.Array, dtype) -> jax.Array:
    """Rows `ids` [...] of `table` [n, d] in `dtype`, as a one-hot matmul -> [..., d].

    The gradient of a gather is a scatter-add into the table, which the GPU runs on
    atomics that collide when many tokens share a row: with a byte vocabulary and
    positions restarting in every packed document it took about a fifth of a step on
    the H200. The one-hot matmul gives the same rows, and its gradient is a matmul.
    """
    return jax.nn.one_hot(ids, table.shape[0], dtype=dtype) @ table.astype(dtype)


def build(model_config, attention, seed: int) -> Model:
    builders = {"nnx": _build_nnx, "equinox": _build_equinox}
    if model_config.framework not in builders:
        raise ValueError(f"config.model.framework: got {model_config.framework!r}; expected "
                         f"one of {sorted(builders)}.")
    return builders[model_config.framework](model_config, attention, seed)


# ----------------------------------------------------------------------------- NNX


def _build_nnx(c, attention, seed: int) -> Model:
    from flax import nnx
    from fusedattn.layers import nnx as fa_nnx
    from fusedattn.layers import paged as fa_paged

    dtype = model_facts.compute_dtype(c.dtype)

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            d = c.d_model
            self.ln1 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
            self.attn = fa_nnx.MultiHeadAttention(
                c.num_heads, d, config=attention, num_kv_heads=c.num_kv_heads, use_bias=False,
                dtype=dtype, keep_rngs=False, rngs=rngs, return_max_logit=c.qk_clip > 0)
            self.ln2 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
            self.fc1 = nnx.Linear(d, c.mlp_dim, dtype=dtype, rngs=rngs)
            self.fc2 = nnx.Linear(c.mlp_dim, d, dtype=dtype, rngs=rngs)

        def __call__(self, x, sequence, dropout_key, pages=None):
            rngs = None if dropout_key is None else nnx.Rngs(dropout=dropout_key)
            x = x + self.attn(self.ln1(x), sequence=sequence, deterministic=dropout_key is None,
                              rngs=rngs, pages=pages)
            return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))

    class Transformer(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(c.vocab_size, c.d_model, dtype=dtype, rngs=rngs)
            self.pos_embed = nnx.Embed(c.max_len, c.d_model, dtype=dtype, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(c.num_layers)])
            self.ln_f = nnx.LayerNorm(c.d_model, dtype=dtype, rngs=rngs)
            self.head = nnx.Linear(c.d_model, c.vocab_size, dtype=dtype, rngs=rngs)

        def __call__(self, inputs, positions, sequence, dropout_key, pages=None):
            x = (lookup(self.embed.embedding[...], inputs, dtype)
                 + lookup(self.pos_embed.embedding[...], positions, dtype))
            for i, block in enumerate(self.blocks):
                key = None if dropout_key is None else jax.random.fold_in(dropout_key, i)
                call = (nnx.remat(lambda b, y: b(y, sequence, key)) if c.remat and pages is None
                        else lambda b, y: b(y, sequence, key, pages))
                x = call(block, x)
            return self.head(self.ln_f(x)).astype(jnp.float32)

    model = Transformer(nnx.Rngs(params=seed))
    graphdef, params, fp8_state, rest = nnx.split(model, nnx.Param, fa_nnx.Fp8Meta, ...)
    named, rebuild = trees.named_leaves(params)
    named_fp8, rebuild_fp8 = trees.named_leaves(fp8_state)
    dropout = AttentionSpec.from_config(attention).dropout_rate > 0

    def merged(named_params):
        return nnx.merge(graphdef, rebuild(named_params),
                         rebuild_fp8(named_params.get(FP8_STATE, {})), rest)

    def apply_with_max_logit(named_params, inputs, positions, segment_ids, dropout_key=None):
        """(logits, each layer's max_logit float32 [num_layers, h]; None unless qk_clip)."""
        m = merged(named_params)
        args = (inputs, positions, sequence_descriptor(attention, segment_ids, positions),
                dropout_key if dropout else None)
        if c.qk_clip <= 0:
            return m(*args), None
        logits, sown = nnx.capture(m, nnx.Intermediate)(*args)
        per_layer = nnx.to_pure_dict(sown)["blocks"]
        return logits, jnp.stack([per_layer[i]["attn"]["max_logit"][0]
                                  for i in sorted(per_layer)])

    def apply(named_params, inputs, positions, segment_ids, dropout_key=None):
        return apply_with_max_logit(named_params, inputs, positions, segment_ids, dropout_key)[0]

    def paged_decoder(named_params, num_pages: int, page_size: int):
        """A model with a paged cache of num_pages pages per layer; returns
        step(tokens int [S, n], pages: PageTable after allocate) -> logits [S, n, vocab],
        writing the step's keys/values into the model's caches."""
        m = merged(named_params)
        for block in m.blocks:
            block.attn.init_paged_cache(num_pages, page_size)

        @nnx.jit
        def step(m, tokens, pages):
            return m(tokens, fa_paged.positions(pages, tokens.shape[1]), None, None, pages)

        return lambda tokens, pages: step(m, tokens, pages)

    embedding = trees.count_params([named["embed"], named["pos_embed"]])
    params = {**named, **({FP8_STATE: named_fp8} if named_fp8 else {})}
    return Model(params, apply, trees.count_params(named), embedding, paged_decoder,
                 overwrite_with_gradient=(FP8_STATE,) if named_fp8 else (),
                 apply_with_max_logit=apply_with_max_logit)


# ----------------------------------------------------------------------------- Equinox


def _build_equinox(c, attention, seed: int) -> Model:
    import equinox as eqx
    from fusedattn.layers import equinox as fa_eqx

    if c.qk_clip > 0:
        raise ValueError("config.model.qk_clip: QK-clip is served by the 'nnx' model; use "
                         "configs/lm_nnx.py or set config.model.qk_clip = 0.")

    dtype = model_facts.compute_dtype(c.dtype)

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        attn: fa_eqx.MultiheadAttention
        ln2: eqx.nn.LayerNorm
        fc1: eqx.nn.Linear
        fc2: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            d = c.d_model
            self.ln1 = eqx.nn.LayerNorm(d)
            self.attn = fa_eqx.MultiheadAttention(c.num_heads, d, config=attention,
                                                  num_kv_heads=c.num_kv_heads, key=k1)
            self.ln2 = eqx.nn.LayerNorm(d)
            self.fc1 = eqx.nn.Linear(d, c.mlp_dim, key=k2)
            self.fc2 = eqx.nn.Linear(c.mlp_dim, d, key=k3)

        def __call__(self, x, sequence, key):
            """x [s, d] (one example)."""
            h = jax.vmap(self.ln1)(x)
            x = x + self.attn(h, h, h, sequence=sequence, key=key, inference=key is None)
            h = jax.vmap(self.fc1)(jax.vmap(self.ln2)(x))
            return x + jax.vmap(self.fc2)(jax.nn.gelu(h))

    class Transformer(eqx.Module):
        embed: eqx.nn.Embedding
        pos_embed: eqx.nn.Embedding
        blocks: list
        ln_f: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key):
            keys = jax.random.split(key, c.num_layers + 3)
            self.embed = eqx.nn.Embedding(c.vocab_size, c.d_model, key=keys[0])
            self.pos_embed = eqx.nn.Embedding(c.max_len, c.d_model, key=keys[1])
            self.blocks = [Block(k) for k in keys[3:]]
            self.ln_f = eqx.nn.LayerNorm(c.d_model)
            self.head = eqx.nn.Linear(c.d_model, c.vocab_size, key=keys[2])

        def __call__(self, inputs, positions, sequence, key):
            """inputs, positions [s] int; sequence: this example's descriptor -> [s, vocab]."""
            x = (lookup(self.embed.weight, inputs, self.embed.weight.dtype)
                 + lookup(self.pos_embed.weight, positions, self.embed.weight.dtype))
            for i, block in enumerate(self.blocks):
                block_key = None if key is None else jax.random.fold_in(key, i)
                call = eqx.filter_checkpoint(Block.__call__) if c.remat else Block.__call__
                x = call(block, x, sequence, block_key)
            x = jax.vmap(self.ln_f)(x)
            return jax.vmap(self.head)(x).astype(jnp.float32)

    model = Transformer(jax.random.key(seed))
    params_tree, static = eqx.partition(model, eqx.is_inexact_array)
    named, rebuild = trees.named_leaves(params_tree)
    dropout = AttentionSpec.from_config(attention).dropout_rate > 0

    def apply(named_params, inputs, positions, segment_ids, dropout_key=None):
        params = rebuild(named_params)
        if dtype != jnp.float32:   # mixed precision: float32 master weights, compute in dtype
            params = trees.cast_floating(params, dtype)
        m = eqx.combine(params, static)
        sequence = sequence_descriptor(attention, segment_ids, positions)
        keys = (None if not dropout or dropout_key is None
                else jax.random.split(dropout_key, inputs.shape[0]))
        return jax.vmap(m, in_axes=(0, 0, 0, None if keys is None else 0))(
            inputs, positions, sequence, keys)

    embedding = trees.count_params([named["embed"], named["pos_embed"]])
    return Model(named, apply, trees.count_params(named), embedding)
