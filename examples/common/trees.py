"""Parameter pytrees as the example trainers keep them: nested dicts of arrays named by
their paths, whichever framework (NNX state, Equinox module) the leaves came from."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


def trained_part(params: dict, overwrite_with_gradient: tuple[str, ...]) -> dict:
    """The part of params the optimizer updates: all top-level keys but those named."""
    return {k: v for k, v in params.items() if k not in overwrite_with_gradient}


def named_leaves(tree) -> tuple[dict, Callable[[dict], Any]]:
    """A pytree's array leaves as a nested dict keyed by their path names, and its inverse.

    Optimizer states and orbax checkpoints of a nested dict are plain and portable,
    whichever framework (NNX state, Equinox module) the leaves came from.
    """
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [tuple(_key_name(k) for k in path) for path, _ in with_path]
    # NNX variables add a trailing ".value"; it names nothing.
    paths = [p[:-1] if len(p) > 1 and p[-1] == "value" else p for p in paths]
    named: dict = {}
    for path, (_, leaf) in zip(paths, with_path):
        node = named
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = leaf

    def rebuild(named_tree: dict):
        leaves = []
        for path in paths:
            node = named_tree
            for part in path:
                node = node[part]
            leaves.append(node)
        return jax.tree_util.tree_unflatten(treedef, leaves)

    return named, rebuild


def _key_name(key) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def count_params(tree) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


def cast_floating(tree, dtype):
    """Casts the floating-point leaves of a pytree (mixed precision: f32 master weights)."""
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)
