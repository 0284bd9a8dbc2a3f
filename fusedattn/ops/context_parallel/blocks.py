"""The per-device loops of context parallelism and the slicing they share.

_over_blocks visits every device's K/V block (ring: blocks circulate with ppermute and
accumulators travel with them; all_gather: blocks sliced from the gathered K/V,
accumulators reduce-scattered); _over_pairs visits every (query piece, key piece) pair
of a block as a canonical call, with its dropout mask drawn at global indices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fusedattn.ops import philox
from fusedattn.ops.backends.base import CanonicalArgs, TokenInfo, visible_mask
from fusedattn.ops.context_parallel.plan import _Plan


def _seq_slice(x: jax.Array, start, width: int) -> jax.Array:
    """x[:, start:start + width] along the sequence axis (axis 0 of a 1-D index vector)."""
    return jax.lax.dynamic_slice_in_dim(x, start, width, 0 if x.ndim == 1 else 1)


def _seq_update(x: jax.Array, part: jax.Array, start) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, part, start, 0 if x.ndim == 1 else 1)


def _rotate(plan: _Plan, tree):
    """Sends every device's arrays to the next device along the axis."""
    perm = [(i, (i + 1) % plan.size) for i in range(plan.size)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, plan.axis, perm), tree)


def _over_blocks(plan: _Plan, operands: dict, travel, state, visit):
    """Runs visit(source, kv, travel, state) -> (travel, state) over every device's K/V block.

    kv = (k, v, kv_seg, kv_pos, kv_index) of the block of device `source` (traced).
    travel: accumulators shaped like a K/V block (the backward's dK/dV; () in the
    forward). Under the ring the blocks circulate with jax.lax.ppermute (the next one is
    sent before the current one is used) and each accumulator travels with its block,
    arriving home after the last step; under all_gather the blocks are sliced from the
    gathered K/V and the accumulators are reduce-scattered. Returns (travel, state), travel
    for this device's own block.
    """
    kv = (operands["k"], operands["v"], *operands["kv_tok"])
    width = kv[0].shape[1]
    if not plan.ring:
        gathered = tuple(jax.lax.all_gather(x, plan.axis, axis=0 if x.ndim == 1 else 1,
                                            tiled=True) for x in kv)
        full = jax.tree.map(lambda x: jnp.zeros(x.shape[:1] + (width * plan.size,) + x.shape[2:],
                                                x.dtype), travel)

        def gathered_step(carry, source):
            full, state = carry
            start = source * width
            part, state = visit(source, tuple(_seq_slice(x, start, width) for x in gathered),
                                jax.tree.map(lambda x: _seq_slice(x, start, width), full), state)
            full = jax.tree.map(lambda x, p: _seq_update(x, p, start), full, part)
            return (full, state), None

        (full, state), _ = jax.lax.scan(gathered_step, (full, state), jnp.arange(plan.size))
        travel = jax.tree.map(
            lambda x: jax.lax.psum_scatter(x, plan.axis, scatter_dimension=1, tiled=True), full)
        return travel, state

    me = jax.lax.axis_index(plan.axis)

    def ring_step(kv, travel, state, step, last: bool):
        following = None if last else _rotate(plan, kv)
        travel, state = visit((me - step) % plan.size, kv, travel, state)
        return following, _rotate(plan, travel), state

    def scanned(carry, step):
        return ring_step(*carry, step, last=False), None

    (kv, travel, state), _ = jax.lax.scan(scanned, (kv, travel, state),
                                          jnp.arange(plan.size - 1))
    _, travel, state = ring_step(kv, travel, state, plan.size - 1, last=True)
    return travel, state


def _over_pairs(plan: _Plan, operands: dict, source, kv: tuple, carry, visit):
    """Runs visit(args, keep, rows, column, j, carry) -> carry over every (query piece, key
    piece) pair of one block (a lax.scan: one copy of the pair's computation), where
    rows is the query piece's first local row and j the key piece within the block
    (both traced), column its first device-layout column; args is the pair's canonical
    call and keep its dropout mask (None without dropout)."""
    pieces = plan.pieces
    q_width, kv_width = operands["q"].shape[1] // pieces, kv[0].shape[1] // pieces

    def step(carry, pair):
        i, j = pair // pieces, pair % pieces
        rows, start = i * q_width, j * kv_width
        q, q_seg, q_pos, q_diag, q_index = (_seq_slice(x, rows, q_width) for x in
                                            (operands["q"], *operands["q_tok"]))
        k, v, kv_seg, kv_pos, kv_index = (_seq_slice(x, start, kv_width) for x in kv)
        column = source * kv[0].shape[1] + start
        bias = operands.get("bias")
        if plan.bias_array:
            bias = jax.lax.dynamic_slice_in_dim(_rows(bias, rows, q_width), column, kv_width, 3)
        args = CanonicalArgs(q=q, k=k, v=v, bias=bias,
                             tokens=TokenInfo(q_seg, q_pos, q_diag, kv_seg, kv_pos))
        keep = None
        if "seed" in operands and plan.spec.dropout_rate > 0:
            keep = philox.dropout_keep_mask(operands["seed"], plan.spec.dropout_rate,
                                            (q.shape[0], q.shape[2], q_width, kv_width),
                                            q_index, kv_index)
        return visit(args, keep, rows, column, start, carry), None

    carry, _ = jax.lax.scan(step, carry, jnp.arange(pieces * pieces))
    return carry


def _rows(x: jax.Array, start, width: int) -> jax.Array:
    """Rows [start, start + width) of a bias-shaped [b, h, sq, skv] array."""
    return jax.lax.dynamic_slice_in_dim(x, start, width, 2)


def _visible_anywhere(plan: _Plan, args: CanonicalArgs) -> jax.Array:
    return jnp.any(visible_mask(plan.spec, args.tokens))
