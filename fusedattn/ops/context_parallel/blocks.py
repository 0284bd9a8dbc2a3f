"""The per-device loops of context parallelism and the slicing they share.

_over_blocks visits every device's K/V block (ring: blocks circulate with ppermute and
accumulators follow them one step behind; all_gather: blocks sliced from the gathered K/V,
accumulators reduce-scattered); _over_pairs visits every (query piece, key piece) pair
of a block as a canonical call, with its dropout mask drawn at global indices and where
it sits (_Pair); _pair_call runs a backend's call on a pair unless it sees nothing, with
the mask the backend needs (the call's own, or the pair's kind for kernels that read no
positions: _pair_kind).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fusedattn.ops import philox
from fusedattn.ops.backends.base import CanonicalArgs, TokenInfo, visible_mask
from fusedattn.ops.context_parallel.plan import _Plan
from fusedattn.ops.enums import MaskType

# The kinds of a chunk pair under a dense mask, which kernels without token positions
# (plan.chunk_masked) are called by: no visible entry, every entry, the causal diagonal.
SKIP, FULL, DIAGONAL = 0, 1, 2


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
    forward), given as zeros: visit adds one block's contributions to the travel it gets.
    Under the ring the blocks circulate with jax.lax.ppermute and the accumulators of each
    block follow it one step behind (_ring); under all_gather the blocks are sliced from
    the gathered K/V and the accumulators are reduce-scattered. Returns (travel, state),
    travel for this device's own block.
    """
    kv = (operands["k"], operands["v"], *operands["kv_tok"])
    width = kv[0].shape[1]
    if plan.ring:
        return _ring(plan, kv, travel, state, visit)
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


def _ring(plan: _Plan, kv: tuple, zeros, state, visit):
    """_over_blocks under the ring: at step t this device holds the block of device
    me - t. Each step sends that block on (but the last), and sends on the accumulators of
    the block it held the step before (but the first); both sends read only what the step
    starts with, so they can run while the step's attention does. The step's own
    contributions go into fresh accumulators (zeros), added to the ones that arrived from
    the device before (which held this block one step earlier) at the end of the step.
    After the last step the accumulators go home. The steps between are one lax.scan; the
    last, which sends no block, is a copy of its own, and so is the first, which sends no
    accumulators, where there are any (the forward has none: its first step is scanned)."""
    me = jax.lax.axis_index(plan.axis)

    def ring_step(kv, held, state, step, first: bool, last: bool):
        following = None if last else _rotate(plan, kv)
        arrived = None if first else _rotate(plan, held)
        mine, state = visit((me - step) % plan.size, kv, zeros, state)
        held = mine if first else jax.tree.map(jnp.add, arrived, mine)
        return following, held, state

    def scanned(carry, step):
        return ring_step(*carry, step, first=False, last=False), None

    carry, start = (kv, zeros, state), 0
    if jax.tree.leaves(zeros):
        carry, start = ring_step(kv, None, state, 0, first=True, last=plan.size == 1), 1
    if plan.size - 1 > start:
        carry, _ = jax.lax.scan(scanned, carry, jnp.arange(start, plan.size - 1))
    if plan.size > start:
        carry = ring_step(*carry, plan.size - 1, first=False, last=True)
    _, held, state = carry
    return _rotate(plan, held), state


class _Pair(NamedTuple):
    """Where a (query piece, key piece) pair sits, all traced int32 scalars.

    rows: the query piece's first local row; column: the key piece's first device-layout
    column; start: its first key within the block; kind: SKIP, FULL or DIAGONAL
    (_pair_kind) where plan.chunk_masked, else None.
    """

    rows: jax.Array
    column: jax.Array
    start: jax.Array
    kind: jax.Array | None


def _pair_kind(plan: _Plan, q_first, kv_first, q_width: int, kv_width: int) -> jax.Array:
    """SKIP, FULL or DIAGONAL (int32) of the chunk pair whose first query and key are the
    natural-order tokens q_first and kv_first (traced), pieces q_width and kv_width long.

    Without a causal mask every pair is FULL. Under one (verdict: sq == skv, so a piece is
    one chunk of one length) query chunk c against key chunk d is FULL for c > d,
    DIAGONAL for c == d (top-left causal within the pair) and SKIP for c < d.
    """
    if not plan.spec.mask.is_causal:
        return jnp.int32(FULL)
    q_chunk, kv_chunk = q_first // q_width, kv_first // kv_width
    return jnp.where(q_chunk > kv_chunk, FULL,
                     jnp.where(q_chunk == kv_chunk, DIAGONAL, SKIP)).astype(jnp.int32)


def _pair_call(plan: _Plan, args: CanonicalArgs, pair: _Pair, call, skipped):
    """call(spec) on a pair that sees anything, else skipped() (jax.lax control flow).

    A kernel reading the tokens gets the call's spec, skipped where no entry is visible
    (lax.cond); one that reads no positions (plan.chunk_masked) gets the pair's mask:
    lax.switch over its kind, "no_mask" for FULL and top-left "causal" for DIAGONAL
    (without a causal mask every pair is FULL: no switch, one call traced).
    """
    if not plan.chunk_masked:
        return jax.lax.cond(jnp.any(visible_mask(plan.spec, args.tokens)),
                            lambda: call(plan.spec), skipped)
    if not plan.spec.mask.is_causal:
        return call(plan.spec.replace(mask=MaskType.NO_MASK))
    branches = {SKIP: skipped,
                FULL: lambda: call(plan.spec.replace(mask=MaskType.NO_MASK)),
                DIAGONAL: lambda: call(plan.spec.replace(mask=MaskType.CAUSAL))}
    return jax.lax.switch(pair.kind, [branches[kind] for kind in sorted(branches)])


def _over_pairs(plan: _Plan, operands: dict, source, kv: tuple, carry, visit):
    """Runs visit(args, keep, pair, carry) -> carry over every (query piece, key piece)
    pair of one block (a lax.scan: one copy of the pair's computation), where args is
    the pair's canonical call, keep its dropout mask (None without dropout) and pair
    where it sits (_Pair)."""
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
        kind = (_pair_kind(plan, q_index[0], kv_index[0], q_width, kv_width)
                if plan.chunk_masked else None)
        return visit(args, keep, _Pair(rows, column, start, kind), carry), None

    carry, _ = jax.lax.scan(step, carry, jnp.arange(pieces * pieces))
    return carry


def _rows(x: jax.Array, start, width: int) -> jax.Array:
    """Rows [start, start + width) of a bias-shaped [b, h, sq, skv] array."""
    return jax.lax.dynamic_slice_in_dim(x, start, width, 2)
