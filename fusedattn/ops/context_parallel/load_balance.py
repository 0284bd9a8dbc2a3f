"""The load-balanced device layout of context parallelism: the sequence cut into
2 * cp_size equal chunks, device i holding chunks i and 2 * cp_size - 1 - i (so causal
work is even), and the reorders of a batch into that order and back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def load_balance_permutation(seqlen: int, cp_size: int) -> np.ndarray:
    """int32 [seqlen]: entry i is the natural position of the token at device-layout slot i.

    The sequence is cut into 2 * cp_size equal chunks; device i holds chunks i and
    2 * cp_size - 1 - i, in that order.
    """
    _check_divisible(seqlen, 2 * cp_size, "seqlen")
    chunk = seqlen // (2 * cp_size)
    order = [c for i in range(cp_size) for c in (i, 2 * cp_size - 1 - i)]
    return (np.asarray(order)[:, None] * chunk + np.arange(chunk)).reshape(-1).astype(np.int32)


def reorder_causal_load_balancing(x, cp_size: int, seq_axis: int = 1) -> jax.Array:
    """x in natural token order -> the device layout of load-balanced context parallelism
    (x's axis `seq_axis`, of a length divisible by 2 * cp_size, is permuted)."""
    x = jnp.asarray(x)
    return jnp.take(x, load_balance_permutation(x.shape[seq_axis], cp_size), axis=seq_axis)


def inverse_reorder_causal_load_balancing(x, cp_size: int, seq_axis: int = 1) -> jax.Array:
    """The inverse of reorder_causal_load_balancing: device layout -> natural order."""
    x = jnp.asarray(x)
    inverse = np.argsort(load_balance_permutation(x.shape[seq_axis], cp_size))
    return jnp.take(x, inverse, axis=seq_axis)


def _check_divisible(length: int, by: int, name: str) -> None:
    if length % by:
        raise ValueError(
            f"{name}: context parallelism cuts the sequence into {by} equal chunks (mesh axis "
            f"size x 2 with config.context_parallel.load_balance, else x 1), but it has "
            f"{length} tokens; pad it to a multiple of {by}."
        )
