"""Synthetic user histories for next-item recommendation, with the Bayes-optimal answer.

The catalog: `num_items` items split evenly into `num_categories` categories;
within each category the items form a random cycle (`successor`), and for each
of `num_contexts` contexts (think: time of day) a Zipf popularity order.

A user: a hidden favourite category c (uniform); a history of L items, L uniform
in [min_history, max_history] (<= 16), oldest first, each item from c with
probability `p_in` (uniform within c) and otherwise uniform over the catalog;
a context t (uniform, visible). The next item: with probability `p_follow`, the
successor of the user's most recent history item of category c (when the
history has one), otherwise an item of c drawn from the Zipf popularity of
context t.

So a model must find the user's category from the whole history (a vote among
up to 16 items), attend to the most recent item of it, and combine that with
the query's context: one query token cross-attending to <= 16 history items.

The generator computes the exact posterior over c, hence the Bayes-optimal
next-item distribution P(x | history, context): its NLL of the target
(`best_nll`) and whether its argmax is the target (`best_correct`) are returned
with every batch; their means are the best loss and (in expectation) the best
top-1 accuracy any model can reach on those examples.
"""

from __future__ import annotations

import numpy as np

MAX_HISTORY = 16


class Catalog:
    def __init__(self, *, catalog_seed: int = 0, num_items: int = 256, num_categories: int = 16,
                 num_contexts: int = 4, p_in: float = 0.7, p_follow: float = 0.6,
                 zipf_exponent: float = 1.5, min_history: int = 1,
                 max_history: int = MAX_HISTORY):
        if num_items % num_categories:
            raise ValueError(f"data.num_items ({num_items}) must be a multiple of "
                             f"data.num_categories ({num_categories}).")
        if not 1 <= min_history <= max_history <= MAX_HISTORY:
            raise ValueError(f"data: need 1 <= min_history <= max_history <= {MAX_HISTORY}, got "
                             f"{min_history}, {max_history}.")
        self.num_items, self.num_categories, self.num_contexts = (num_items, num_categories,
                                                                  num_contexts)
        self.p_in, self.p_follow = p_in, p_follow
        self.min_history, self.max_history = min_history, max_history
        rng = np.random.default_rng(catalog_seed)
        per = num_items // num_categories
        members = rng.permutation(num_items).reshape(num_categories, per)  # [C, per], cycle order
        self.members = members
        self.category = np.empty(num_items, np.int64)
        self.successor = np.empty(num_items, np.int64)
        for c in range(num_categories):
            self.category[members[c]] = c
            self.successor[members[c]] = np.roll(members[c], -1)
        zipf = 1.0 / np.arange(1, per + 1) ** zipf_exponent
        zipf /= zipf.sum()
        # popularity[c, t, x]: P(next = x | category c, context t, not following).
        self.popularity = np.zeros((num_categories, num_contexts, num_items))
        for c in range(num_categories):
            for t in range(num_contexts):
                self.popularity[c, t, rng.permutation(members[c])] = zipf

    def sample(self, rng: np.random.Generator, count: int) -> dict[str, np.ndarray]:
        """count users: history [count, 16] (oldest first, item ids, 0 past `length`),
        length, context, target, best_nll, best_correct."""
        n, per = self.num_items, self.num_items // self.num_categories
        c = rng.integers(0, self.num_categories, count)
        length = rng.integers(self.min_history, self.max_history + 1, count)
        context = rng.integers(0, self.num_contexts, count)
        in_cat = rng.random((count, MAX_HISTORY)) < self.p_in
        own = self.members[c[:, None], rng.integers(0, per, (count, MAX_HISTORY))]
        history = np.where(in_cat, own, rng.integers(0, n, (count, MAX_HISTORY)))
        valid = np.arange(MAX_HISTORY)[None, :] < length[:, None]
        history = np.where(valid, history, 0)

        # The most recent history item of each category (or -1): [count, C].
        hist_cat = np.where(valid, self.category[history], -1)
        onehot = hist_cat[:, :, None] == np.arange(self.num_categories)[None, None, :]
        last_index = np.where(onehot, np.arange(MAX_HISTORY)[None, :, None], -1).max(axis=1)
        last_item = np.where(last_index >= 0,
                             np.take_along_axis(history, np.maximum(last_index, 0), axis=1), -1)

        # The next item.
        follow = (rng.random(count) < self.p_follow) & (last_item[np.arange(count), c] >= 0)
        pop = self.popularity[c, context]                                   # [count, n]
        drawn = (pop.cumsum(1) < rng.random(count)[:, None]).sum(1)
        drawn = np.minimum(drawn, n - 1)
        target = np.where(follow, self.successor[np.maximum(last_item[np.arange(count), c], 0)],
                          drawn)

        # Bayes: P(c | history) from the per-item likelihoods, then P(next | history, context).
        counts = onehot.sum(axis=1)                                          # [count, C]
        ratio = 1.0 + self.p_in * n / (per * (1.0 - self.p_in)) if self.p_in < 1 else np.inf
        log_post = counts * np.log(ratio)
        post = np.exp(log_post - log_post.max(1, keepdims=True))
        post /= post.sum(1, keepdims=True)
        has_last = last_item >= 0
        p_follow = np.where(has_last, self.p_follow, 0.0)                    # [count, C]
        next_given_c = (1.0 - p_follow)[:, :, None] * self.popularity[:, context].transpose(1, 0, 2)
        rows = np.repeat(np.arange(count), self.num_categories)
        cols = self.successor[np.maximum(last_item, 0)].reshape(-1)
        np.add.at(next_given_c, (rows, np.tile(np.arange(self.num_categories), count), cols),
                  p_follow.reshape(-1))
        predictive = np.einsum("bc,bcx->bx", post, next_given_c)             # [count, n]
        best_nll = -np.log(predictive[np.arange(count), target])
        best_correct = predictive.argmax(1) == target
        return {"history": history.astype(np.int32), "length": length.astype(np.int32),
                "context": context.astype(np.int32), "target": target.astype(np.int32),
                "best_nll": best_nll.astype(np.float32),
                "best_correct": best_correct.astype(np.float32),
                "best_expected_accuracy": predictive.max(1).astype(np.float32)}


def catalog_from_config(data_config) -> Catalog:
    d = data_config
    return Catalog(catalog_seed=d.catalog_seed, num_items=d.num_items,
                   num_categories=d.num_categories, num_contexts=d.num_contexts, p_in=d.p_in,
                   p_follow=d.p_follow, zipf_exponent=d.zipf_exponent,
                   min_history=d.min_history, max_history=d.max_history)


def to_thd(users: dict[str, np.ndarray], users_per_row: int) -> dict[str, np.ndarray]:
    """Packs users into THD rows: per row, users_per_row queries and their histories.

    q tokens [b, P] (one per user: its context); kv tokens [b, 16 P] (the histories
    back to back, then padding); lengths/offsets for
    SequenceDescriptor.from_seqlens_and_offsets: q_seqlens [b, P] = 1, kv_seqlens [b, P]
    = history lengths, q_offsets [b, P + 1] = 0..P, kv_offsets [b, P + 1] cumulative.
    """
    count = users["target"].shape[0]
    p = users_per_row
    b = count // p
    length = users["length"].reshape(b, p)
    kv_offsets = np.concatenate([np.zeros((b, 1), np.int64), np.cumsum(length, 1)], 1)
    t = MAX_HISTORY * p
    history = np.zeros((b, t), np.int32)
    recency = np.zeros((b, t), np.int32)
    valid = np.zeros((b, t), np.float32)
    hist = users["history"].reshape(b, p, MAX_HISTORY)
    for j in range(p):
        for r in range(b):
            start, n = kv_offsets[r, j], length[r, j]
            history[r, start: start + n] = hist[r, j, :n]
            recency[r, start: start + n] = np.arange(n - 1, -1, -1)
            valid[r, start: start + n] = 1.0
    out = {k: v.reshape(b, p) for k, v in users.items() if k not in ("history", "length")}
    out.update({
        "history": history, "recency": recency, "history_valid": valid,
        "q_seqlens": np.ones((b, p), np.int32), "kv_seqlens": length.astype(np.int32),
        "q_offsets": np.arange(p + 1, dtype=np.int32)[None].repeat(b, 0),
        "kv_offsets": kv_offsets.astype(np.int32),
    })
    return out


def to_bshd(users: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One user per row: q [b, 1] (context), kv [b, 16] (history, left-aligned, padded)."""
    length = users["length"]
    valid = (np.arange(MAX_HISTORY)[None, :] < length[:, None])
    recency = np.where(valid, length[:, None] - 1 - np.arange(MAX_HISTORY)[None, :], 0)
    out = {k: v[:, None] for k, v in users.items() if k not in ("history", "length")}
    out.update({"history": users["history"], "recency": recency.astype(np.int32),
                "history_valid": valid.astype(np.float32),
                "q_seqlens": np.ones_like(length), "kv_seqlens": length})
    return out


class Batches:
    """Train batches as a pure function of the step; eval batches from a separate stream."""

    def __init__(self, data_config, layout_family: str):
        self.catalog = catalog_from_config(data_config)
        self.config = data_config
        self.family = layout_family

    def _make(self, stream: int, index: int) -> dict[str, np.ndarray]:
        d = self.config
        rng = np.random.default_rng([d.seed, stream, index])
        users = self.catalog.sample(rng, d.batch_size * d.users_per_row)
        return to_thd(users, d.users_per_row) if self.family == "thd" else to_bshd(users)

    def train(self, step: int):
        return self._make(0, step)

    def eval(self, index: int):
        return self._make(1, index)
