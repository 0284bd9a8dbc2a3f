"""The recommender trainer: synthetic histories + cross-attention model + the shared loop."""

from __future__ import annotations

import jax.numpy as jnp
import ml_collections
import optax

from examples.common import model_facts, trainer
from examples.small_seq import data as ss_data
from examples.small_seq import models
from fusedattn import ops
from fusedattn.ops.spec import AttentionSpec


def attention_for_data(config) -> ml_collections.ConfigDict:
    """config.model.attention, with the sequence form matching its layout family.

    THD rows pack config.data.users_per_row users (lengths + offsets, so
    max_segments_per_seq must cover them: checked, never rewritten); BSHD runs one
    user per row (lengths).
    """
    attention = ml_collections.ConfigDict(config.model.attention.to_dict())
    spec = AttentionSpec.from_config(attention)
    if spec.qkv_layout.is_thd:
        attention.sequence.format = "seqlens_offsets"
        if attention.sequence.max_segments_per_seq < config.data.users_per_row:
            raise ValueError(
                f"config.model.attention.sequence.max_segments_per_seq "
                f"({attention.sequence.max_segments_per_seq}) must be >= config.data.users_per_row "
                f"({config.data.users_per_row}): each THD row packs that many users; raise it or "
                "lower users_per_row.")
    else:
        attention.sequence.format = "seqlens"
    if not spec.mask.is_padding:
        raise ValueError(f"config.model.attention.mask: {attention.mask!r} lets queries see "
                         "other users' (or padded) history; use 'padding'.")
    attention.lock()
    return attention


def make_task(config, verbose: bool = True) -> trainer.Task:
    c = config
    trainer.check_trainer_config(c)
    trainer.check_positive(c, "data.batch_size", "data.users_per_row", "data.num_items",
                           "model.num_layers", "model.mlp_dim")
    head_dim = model_facts.head_dim(c)
    attention = attention_for_data(c)
    family = "thd" if AttentionSpec.from_config(attention).qkv_layout.is_thd else "bshd"
    batches = ss_data.Batches(c.data, family)
    model = models.build(c.model, attention, c.seed, c.data.num_items, c.data.num_contexts)
    eval_batches = [batches.eval(i) for i in range(c.trainer.eval_batches)]

    def outputs(params, batch, dropout_key=None):
        logits = model.apply(params, batch, dropout_key)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["target"])
        correct = (jnp.argmax(logits, -1) == batch["target"]).astype(jnp.float32)
        return nll, correct

    def loss_fn(params, batch, dropout_key):
        nll, correct = outputs(params, batch, dropout_key)
        return nll.mean(), {"accuracy": correct.mean(), "best_loss": batch["best_nll"].mean()}

    def eval_fn(params, batch):
        nll, correct = outputs(params, batch)
        n = jnp.asarray(nll.size, jnp.float32)
        return {"loss": (nll.sum(), n), "accuracy": (correct.sum(), n)}

    n_eval = sum(b["target"].size for b in eval_batches)
    reference = {
        "eval_best_loss": float(sum(b["best_nll"].sum() for b in eval_batches) / n_eval),
        "eval_best_accuracy": float(sum(b["best_correct"].sum() for b in eval_batches) / n_eval),
    }
    users = c.data.batch_size * c.data.users_per_row
    d, L = c.model.d_model, c.model.num_layers
    kv_dim = (c.model.num_kv_heads or c.model.num_heads) * head_dim
    kv_tokens = users * ss_data.MAX_HISTORY if family == "bshd" else (
        c.data.batch_size * c.data.users_per_row * ss_data.MAX_HISTORY)
    kv_params = L * 2 * d * kv_dim
    flops = (6.0 * (model.num_params - model.num_embedding_params - kv_params) * users
             + 6.0 * kv_params * kv_tokens
             + model_facts.attention_train_flops(users, 1, ss_data.MAX_HISTORY, c.model.num_heads,
                                                 head_dim, L, causal=False))
    if verbose:
        first = batches.train(0)
        print(f"model: recommender ({c.model.framework}), {model.num_params / 1e6:.2f}M "
              f"parameters; {users} users per step, layout {attention.qkv_layout}"
              + (f" ({c.data.users_per_row} users per row)" if family == "thd" else ""))
        print(f"data: {c.data.num_items} items in {c.data.num_categories} categories; best "
              f"possible eval loss {reference['eval_best_loss']:.4f}, accuracy "
              f"{reference['eval_best_accuracy']:.4f}")
        (b, sq), skv = first["context"].shape, first["history"].shape[1]
        shapes, explained = model_facts.explain_inputs(
            attention, b, sq, skv, c.model.num_heads, c.model.num_kv_heads or c.model.num_heads,
            head_dim, model_facts.compute_dtype(c.model.dtype))
        print(ops.explain(shapes, config=explained,
                          sequence=models.sequence_descriptor(attention, first)))
    return trainer.Task(
        params=model.params, loss_fn=loss_fn, eval_fn=eval_fn, train_batch=batches.train,
        eval_batch=lambda i: eval_batches[i], tokens_per_step=users, flops_per_step=flops,
        reference=reference, unit="examples")


def train_and_evaluate(config, workdir) -> dict:
    task = make_task(config)
    title = f"recommender (attention backend {config.model.attention.backend})"
    return trainer.train_and_evaluate(config, workdir, task, title=title)
