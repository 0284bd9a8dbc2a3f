"""Packed and padded calls: from the sequence descriptor to cuDNN's segment slots.

cuDNN runs one batch entry per segment slot (config.sequence.max_segments_per_seq per
row). _segments builds the slot table int32 [b, 4, M] (per slot: q start, q length,
kv start, kv length) from any form of the descriptor, the per-token masks the backend
applies around cuDNN's results, and the rows that break what cuDNN can express.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fusedattn.ops.backends.base import CanonicalArgs, TokenInfo
from fusedattn.ops.backends.cudnn.graph_key import _Static
from fusedattn.ops.enums import SequenceFormat
from fusedattn.ops.sequence import segment_runs


class _Segments(NamedTuple):
    """cuDNN's view of a packed or padded call, and what the backend masks around it.

    slots: int32 [b, 4, M]: per segment slot its q start, q length, kv start and kv
    length (q slot i pairs with the kv segment of the same id). q_keys: bool [b, sq],
    the query sees at least one key; kv_used: bool [b, skv], the key belongs to a
    paired segment. broken: bool [b], the row breaks what cuDNN can express; None when no
    row can (the lengths forms of the descriptor without declared bounds): no guard then.
    """

    slots: jax.Array
    q_keys: jax.Array
    kv_used: jax.Array
    broken: jax.Array | None


def _segments(static: _Static, args: CanonicalArgs) -> _Segments:
    """The slot table of a call, its per-token masks, and the rows that break it.

    The lengths (and offsets) forms of the descriptor give the table directly; the
    segment-ids form is read from the per-token vectors (`_paired_runs`). Either
    way a row is also broken when a segment exceeds a declared length bound.
    """
    b, sq = args.q.shape[:2]
    skv = args.k.shape[1]
    sequence = args.sequence
    flags = []
    if sequence is not None and sequence.format != SequenceFormat.SEGMENT_IDS:
        table, overflow = _declared_slots(static, sequence, sq, skv)
        if overflow is not None:
            flags.append(overflow)
    else:
        table, broken = _paired_runs(static, args.tokens)
        flags.append(broken)
    _, q_len, _, kv_len = (table[:, i] for i in range(4))
    if static.max_seqlen_q:
        flags.append(jnp.any(q_len > static.max_seqlen_q, axis=1))
    if static.max_seqlen_kv:
        flags.append(jnp.any(kv_len > static.max_seqlen_kv, axis=1))
    broken = functools.reduce(jnp.logical_or, flags) if flags else None
    q_keys, kv_used = _token_masks(static, table, sq, skv)
    return _Segments(slots=table, q_keys=q_keys, kv_used=kv_used, broken=broken)


def _declared_slots(static: _Static, sequence, seqlen_q: int, seqlen_kv: int
                    ) -> tuple[jax.Array, jax.Array | None]:
    """int32 [b, 4, M] straight from the seqlens [b] or seqlens [b, m] + offsets form,
    and bool [b], the rows that use a slot past the M that cuDNN serves (None when the
    descriptor has no more than M slots).

    Slot i of q pairs with slot i of kv. Unused slots (-1) get length 0; a segment
    is cut at the end of its row, as the per-token reading of the descriptor does.
    """
    def slot_starts_and_lengths(seqlens, offsets, extent):
        if offsets is None:
            seqlens = seqlens[:, None]
            starts = jnp.zeros_like(seqlens)
        else:
            starts = offsets[:, :-1]
        used = (seqlens > 0) & (starts >= 0) & (starts < extent)
        starts = jnp.where(used, starts, 0)
        lengths = jnp.where(used, jnp.minimum(seqlens, extent - starts), 0)
        return starts, lengths

    q_start, q_len = slot_starts_and_lengths(sequence.q_seqlens, sequence.q_offsets, seqlen_q)
    kv_start, kv_len = slot_starts_and_lengths(sequence.kv_seqlens, sequence.kv_offsets,
                                               seqlen_kv)
    table = jnp.stack([q_start, q_len, kv_start, kv_len], axis=1).astype(jnp.int32)
    slots = static.batch_per_row
    overflow = None
    if table.shape[2] > slots:  # TransformerEngine's wider arrays: unused slots past M
        overflow = jnp.any(table[:, (1, 3), slots:] > 0, axis=(1, 2))
        table = table[:, :, :slots]
    return jnp.pad(table, ((0, 0), (0, 0), (0, slots - table.shape[2]))), overflow


def _paired_runs(static: _Static, tokens: TokenInfo) -> tuple[jax.Array, jax.Array]:
    """The slot table [b, 4, M] of per-token segment ids, pairing q and kv runs by id.

    Also returns bool [b], the rows with more segments than slots, a segment that
    does not start at position 0, two segments with one id, or (without ragged
    offsets) a segment that does not start at the row's first token.
    """
    slots = static.segments
    q = segment_runs(tokens.q_seg, tokens.q_pos, slots)
    kv = segment_runs(tokens.kv_seg, tokens.kv_pos, slots)
    pair = (q.id[:, :, None] == kv.id[:, None, :]) & (q.id[:, :, None] != 0)
    kv_start = jnp.sum(jnp.where(pair, kv.start[:, None, :], 0), axis=2)
    kv_len = jnp.sum(jnp.where(pair, kv.length[:, None, :], 0), axis=2)

    def repeated_ids(ids):
        same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] != 0)
        return jnp.any(same & ~jnp.eye(slots, dtype=bool), axis=(1, 2))

    broken = ((q.count > slots) | (kv.count > slots) | repeated_ids(q.id) | repeated_ids(kv.id)
              | jnp.any(q.first_pos != 0, axis=1) | jnp.any(kv.first_pos != 0, axis=1))
    if not static.ragged:
        broken |= jnp.any(q.start != 0, axis=1) | jnp.any(kv.start != 0, axis=1)
    return jnp.stack([q.start, q.length, kv_start, kv_len], axis=1), broken


def _token_masks(static: _Static, table: jax.Array, seqlen_q: int, seqlen_kv: int):
    """(q_keys bool [b, sq], kv_used bool [b, skv]) of a slot table [b, 4, M].

    q_keys: the query lies in a slot and sees at least one of its slot's keys
    under the mask and window; kv_used: the key lies in some slot's kv range.
    """
    q_start, q_len, kv_start, kv_len = (table[:, i, None, :] for i in range(4))  # [b, 1, M]
    token = jnp.arange(seqlen_q, dtype=jnp.int32)[None, :, None]
    position = token - q_start
    inside = (position >= 0) & (position < q_len)
    diagonal = position + (kv_len - q_len if static.bottom_right else 0)
    high = kv_len - 1
    if static.causal:
        high = jnp.minimum(high, diagonal)
    elif static.window_right >= 0:
        high = jnp.minimum(high, diagonal + static.window_right)
    low = jnp.maximum(diagonal - static.window_left, 0) if static.window_left >= 0 else 0
    q_keys = jnp.any(inside & (low <= high), axis=-1)
    key = jnp.arange(seqlen_kv, dtype=jnp.int32)[None, :, None]
    kv_used = jnp.any((key >= kv_start) & (key < kv_start + kv_len), axis=-1)
    return q_keys, kv_used
