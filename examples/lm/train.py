"""The LM trainer: grammar corpus + decoder-only transformer + the shared training loop."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from examples.common import model_facts, trainer
from examples.lm import data as lm_data
from examples.lm import models
from examples.lm import qk_clip as qk_clip_lib
from fusedattn import ops


def attention_for_data(config) -> ml_collections.ConfigDict:
    """config.model.attention, made consistent with config.data.packing.

    Packing needs a padding causal mask over segment ids ("causal" becomes
    "padding_causal"; a mask that would let documents or the future leak, such as
    "no_mask", is an error), and declares the data's
    bounds (config.data.max_docs_per_row, max_doc_len) as the attention's static
    sequence bounds (max_segments_per_seq, max_seqlen_q/kv; cuDNN's packed path sizes
    its work by them); without packing the rows
    hold one document each, left-aligned, so plain causal attention is exact (the
    padding after a document is never attended by its tokens, and its loss weight is 0).
    """
    attention = ml_collections.ConfigDict(config.model.attention.to_dict())
    if config.data.packing:
        if attention.mask == "causal":
            attention.mask = "padding_causal"
        if attention.sequence.format == "none":
            attention.sequence.format = "seqlens_offsets"
        attention.sequence.max_segments_per_seq = config.data.max_docs_per_row
        longest = min(config.data.max_doc_len, config.data.seq_len)
        attention.sequence.max_seqlen_q = attention.sequence.max_seqlen_kv = longest
        if attention.mask not in ("padding_causal", "padding_causal_bottom_right"):
            raise ValueError(
                f"config.model.attention.mask: {attention.mask!r} does not keep packed "
                "documents apart; use 'padding_causal' (or set config.data.packing=False).")
    else:
        attention.mask = {"padding_causal": "causal",
                          "padding_causal_bottom_right": "causal"}.get(attention.mask,
                                                                       attention.mask)
        attention.sequence.format = "none"
    if _mesh_shape(config)[1] > 1:
        if attention.sequence.format == "segment_ids":
            raise ValueError(
                "config.mesh.context: context parallelism reorders the tokens, and the "
                "'segment_ids' descriptor would read the reordered positions; use "
                "config.model.attention.sequence.format='seqlens_offsets' (the default).")
        attention.context_parallel.axis = "context"
    attention.lock()
    return attention


def _mesh_shape(config) -> tuple[int, int]:
    """(data, context) devices of config.mesh ((1, 1) without the section)."""
    mesh = config.get("mesh")
    return (1, 1) if mesh is None else (int(mesh.data), int(mesh.context))


def make_mesh(config) -> jax.sharding.Mesh | None:
    """The ("data", "context") mesh of config.mesh, or None for one device."""
    data, context = _mesh_shape(config)
    if data * context == 1:
        return None
    if data * context > jax.device_count() or data < 1 or context < 1:
        raise ValueError(
            f"config.mesh: data x context = {data} x {context} devices, but there are "
            f"{jax.device_count()}; choose sizes whose product is at most that.")
    return jax.make_mesh((data, context), ("data", "context"),
                         axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=jax.devices()[:data * context])


def lay_out(batch: dict, mesh, context: int) -> dict:
    """A batch on the mesh: rows over "data", tokens over "context" in the load-balanced
    order of context parallelism; segment_ids (the descriptor's source) stay in the
    natural order, split over "data" only, as the attention op expects."""
    out = {}
    for name, x in batch.items():
        if name == "segment_ids":
            out[name] = jax.device_put(x, NamedSharding(mesh, P("data")))
            continue
        if context > 1:
            x = np.asarray(ops.reorder_causal_load_balancing(x, context))
        out[name] = jax.device_put(x, NamedSharding(mesh, P("data", "context")))
    return out


def _metrics(logits, batch):
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
    return nll, correct


def make_task(config, verbose: bool = True) -> trainer.Task:
    c = config
    trainer.check_trainer_config(c)
    trainer.check_positive(c, "data.batch_size", "data.seq_len", "model.num_layers",
                           "model.mlp_dim", "model.vocab_size", "model.max_len")
    head_dim = model_facts.head_dim(c)
    attention = attention_for_data(c)
    if c.model.max_len < c.data.seq_len:
        raise ValueError(f"config.model.max_len ({c.model.max_len}) must be >= "
                         f"config.data.seq_len ({c.data.seq_len}).")
    batches = lm_data.Batches(c.data, c.data.batch_size, c.data.seq_len)
    model = models.build(c.model, attention, c.seed)
    eval_batches = [batches.eval(i) for i in range(c.trainer.eval_batches)]
    mesh, place_batch = make_mesh(c), None
    if mesh is not None:
        context = _mesh_shape(c)[1]
        eval_batches = [lay_out(b, mesh, context) for b in eval_batches]
        place_batch = functools.partial(lay_out, mesh=mesh, context=context)

    qk_clip = c.model.qk_clip > 0
    if qk_clip and model.apply_with_max_logit is None:
        raise ValueError(f"config.model.qk_clip: needs the max logits of the "
                         f"{c.model.framework!r} model; use the 'nnx' model (configs/lm_nnx.py).")

    def loss_fn(params, batch, dropout_key):
        inputs = (params, batch["inputs"], batch["positions"], batch["segment_ids"], dropout_key)
        logits, max_logit = (model.apply_with_max_logit(*inputs) if qk_clip
                             else (model.apply(*inputs), None))
        nll, correct = _metrics(logits, batch)
        w = batch["weights"]
        total = jnp.maximum(w.sum(), 1.0)
        loss = (nll * w).sum() / total
        metrics = {"best_loss": (batch["best_nll"] * w).sum() / total,
                   "accuracy": (correct * w).sum() / total}
        if qk_clip:
            metrics["max_logit"] = max_logit   # the op gives it no gradient
        return loss, metrics

    def clip(params, metrics):
        """QK-clip after the optimizer step; logs the largest logit of the step's forward."""
        max_logit = metrics["max_logit"]
        return (qk_clip_lib.rescale(params, max_logit, c.model.qk_clip),
                {**metrics, "max_logit": jnp.max(max_logit)})

    def eval_fn(params, batch):
        logits = model.apply(params, batch["inputs"], batch["positions"], batch["segment_ids"])
        nll, correct = _metrics(logits, batch)
        w, recall = batch["weights"], batch["recall"]
        return {"loss": ((nll * w).sum(), w.sum()),
                "accuracy": ((correct * w).sum(), w.sum()),
                "recall_accuracy": ((correct * recall).sum(), recall.sum())}

    weights = sum(b["weights"].sum() for b in eval_batches)
    reference = {"eval_best_loss": float(sum((b["best_nll"] * b["weights"]).sum()
                                             for b in eval_batches) / weights)}
    tokens = c.data.batch_size * c.data.seq_len
    flops = (6.0 * (model.num_params - model.num_embedding_params) * tokens
             + model_facts.attention_train_flops(c.data.batch_size, c.data.seq_len, c.data.seq_len,
                                                 c.model.num_heads, head_dim, c.model.num_layers,
                                                 causal=True))
    if verbose:
        first = batches.train(0)
        print(f"model: {c.model.framework}, {model.num_params / 1e6:.2f}M parameters "
              f"({model.num_embedding_params / 1e6:.2f}M in embeddings), "
              f"{flops / tokens / 1e6:.1f} MFLOPs per token (train)")
        print(f"data: {c.data.batch_size} x {c.data.seq_len} tokens per step, packing "
              f"{'on' if c.data.packing else 'off'} ({first['weights'].mean():.0%} of tokens "
              f"real); best possible eval loss {reference['eval_best_loss']:.4f} nats/token")
        print("example: " + lm_data.decode(first["inputs"][0][first["segment_ids"][0] == 1]))
        sequence = models.sequence_descriptor(attention, first["segment_ids"],
                                              first["positions"])
        shapes, explained = model_facts.explain_inputs(
            attention, c.data.batch_size, c.data.seq_len, c.data.seq_len, c.model.num_heads,
            c.model.num_kv_heads or c.model.num_heads, head_dim,
            model_facts.compute_dtype(c.model.dtype))
        print(ops.explain(shapes, config=explained, sequence=sequence))
    return trainer.Task(
        params=model.params, loss_fn=loss_fn, eval_fn=eval_fn,
        train_batch=batches.train, place_batch=place_batch,
        eval_batch=lambda i: eval_batches[i],
        tokens_per_step=tokens, flops_per_step=flops, reference=reference, unit="tokens",
        mesh=mesh, overwrite_with_gradient=model.overwrite_with_gradient,
        after_update=clip if qk_clip else None)


def train_and_evaluate(config, workdir) -> dict:
    task = make_task(config)
    title = f"LM ({config.model.framework}, attention backend {config.model.attention.backend})"
    return trainer.train_and_evaluate(config, workdir, task, title=title)

