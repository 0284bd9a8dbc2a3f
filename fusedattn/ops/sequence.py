"""SequenceDescriptor: padding and packing, in any of three self-describing forms.

All three reduce to the same per-token vectors (`TokenInfo`, see
backends/base.py), so every backend handles every form with one mask predicate.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fusedattn.ops.backends.base import TokenInfo
from fusedattn.ops.enums import SequenceFormat
from fusedattn.ops.spec import AttentionSpec


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SequenceDescriptor:
    """Describes which tokens of each batch row belong to which sequence.

    Make one with a constructor; fields that a form does not use are None.
    seqlens:     q_seqlens/kv_seqlens [b] (one sequence per row, left-aligned),
                 or [b, m] with offsets [b, m + 1] (THD packing; unused slots -1).
    segment_ids: q_segment_ids [b, sq], kv_segment_ids [b, skv]; ids >= 1 name
                 segments, 0 is padding; segment_pos defaults to 0..len-1 over
                 each segment's tokens in row order.
    """

    q_seqlens: jax.Array | None = None
    kv_seqlens: jax.Array | None = None
    q_offsets: jax.Array | None = None
    kv_offsets: jax.Array | None = None
    q_segment_ids: jax.Array | None = None
    kv_segment_ids: jax.Array | None = None
    q_segment_pos: jax.Array | None = None
    kv_segment_pos: jax.Array | None = None

    @classmethod
    def from_seqlens(cls, q_seqlens, kv_seqlens) -> "SequenceDescriptor":
        """One sequence per row: q_seqlens, kv_seqlens int [b]."""
        q, kv = _int_array(q_seqlens, "q_seqlens"), _int_array(kv_seqlens, "kv_seqlens")
        _expect_ndim(q, 1, "q_seqlens", "[b]")
        _expect_same_shape(q, kv, "q_seqlens", "kv_seqlens")
        return cls(q_seqlens=q, kv_seqlens=kv)

    @classmethod
    def from_seqlens_and_offsets(cls, q_seqlens, kv_seqlens, q_offsets, kv_offsets
                                 ) -> "SequenceDescriptor":
        """THD packing: lengths [b, m] and token offsets [b, m + 1]; unused slots -1.

        As in TransformerEngine, q and kv may have different slot counts (q lengths
        [b, m_q] with offsets [b, m_q + 1], kv lengths [b, m_kv] with offsets
        [b, m_kv + 1]): the narrower pair is padded with unused slots (-1) to the wider
        one's width. Slot i of q pairs with slot i of kv. The width may exceed
        config.sequence.max_segments_per_seq when the slots past it are unused.
        """
        q, kv = _int_array(q_seqlens, "q_seqlens"), _int_array(kv_seqlens, "kv_seqlens")
        qo, kvo = _int_array(q_offsets, "q_offsets"), _int_array(kv_offsets, "kv_offsets")
        _expect_ndim(q, 2, "q_seqlens", "[b, max_segments]")
        _expect_ndim(kv, 2, "kv_seqlens", "[b, max_segments]")
        if q.shape[0] != kv.shape[0]:
            raise ValueError(
                f"kv_seqlens: batch {kv.shape[0]} differs from q_seqlens batch {q.shape[0]}."
            )
        for lengths, offsets, name in ((q, qo, "q"), (kv, kvo, "kv")):
            if offsets.shape != (lengths.shape[0], lengths.shape[1] + 1):
                raise ValueError(
                    f"{name}_offsets: expected shape [b, max_segments + 1] = "
                    f"{(lengths.shape[0], lengths.shape[1] + 1)} to match {name}_seqlens "
                    f"{tuple(lengths.shape)}, got {tuple(offsets.shape)}."
                )
        width = max(q.shape[1], kv.shape[1])
        q, kv, qo, kvo = (_pad_slots(x, width + extra) for x, extra in
                          ((q, 0), (kv, 0), (qo, 1), (kvo, 1)))
        return cls(q_seqlens=q, kv_seqlens=kv, q_offsets=qo, kv_offsets=kvo)

    @classmethod
    def from_segment_ids_and_pos(cls, q_segment_ids, kv_segment_ids, q_segment_pos=None,
                                 kv_segment_pos=None) -> "SequenceDescriptor":
        """Packing by segment ids [b, s] (>= 1 segments, 0 padding), optional positions."""
        q, kv = _int_array(q_segment_ids, "q_segment_ids"), _int_array(kv_segment_ids,
                                                                         "kv_segment_ids")
        _expect_ndim(q, 2, "q_segment_ids", "[b, sq]")
        _expect_ndim(kv, 2, "kv_segment_ids", "[b, skv]")
        if q.shape[0] != kv.shape[0]:
            raise ValueError(
                f"kv_segment_ids: batch {kv.shape[0]} differs from q_segment_ids batch {q.shape[0]}."
            )
        qp = None if q_segment_pos is None else _int_array(q_segment_pos, "q_segment_pos")
        kvp = None if kv_segment_pos is None else _int_array(kv_segment_pos, "kv_segment_pos")
        if qp is not None:
            _expect_same_shape(q, qp, "q_segment_ids", "q_segment_pos")
        if kvp is not None:
            _expect_same_shape(kv, kvp, "kv_segment_ids", "kv_segment_pos")
        return cls(q_segment_ids=q, kv_segment_ids=kv, q_segment_pos=qp, kv_segment_pos=kvp)

    @property
    def format(self) -> SequenceFormat:
        if self.q_segment_ids is not None:
            return SequenceFormat.SEGMENT_IDS
        if self.q_offsets is not None:
            return SequenceFormat.SEQLENS_OFFSETS
        return SequenceFormat.SEQLENS

    def check(self, spec: AttentionSpec, batch: int, seqlen_q: int, seqlen_kv: int) -> None:
        """Raises ValueError when the descriptor does not fit the config or the arrays."""
        if spec.sequence_format not in (SequenceFormat.NONE, self.format):
            raise ValueError(
                f"sequence: config.sequence.format is {str(spec.sequence_format)!r} but the "
                f"descriptor is of form {str(self.format)!r}; build it with the matching "
                "SequenceDescriptor constructor or change config.sequence.format."
            )
        leading = (self.q_segment_ids if self.format == SequenceFormat.SEGMENT_IDS
                   else self.q_seqlens)
        if leading.shape[0] != batch:
            raise ValueError(
                f"sequence: descriptor batch {leading.shape[0]} differs from the q batch {batch}."
            )
        if self.format == SequenceFormat.SEGMENT_IDS:
            if self.q_segment_ids.shape[1] != seqlen_q or self.kv_segment_ids.shape[1] != seqlen_kv:
                raise ValueError(
                    f"sequence: segment ids cover {self.q_segment_ids.shape[1]} query and "
                    f"{self.kv_segment_ids.shape[1]} key tokens; the arrays have {seqlen_q} and "
                    f"{seqlen_kv}. Give one id per token."
                )

    def token_info(self, spec: AttentionSpec, seqlen_q: int, seqlen_kv: int) -> TokenInfo:
        """Per-token segment ids, positions and diagonal shifts (see base.TokenInfo)."""
        if self.format == SequenceFormat.SEGMENT_IDS:
            q_seg, kv_seg = self.q_segment_ids, self.kv_segment_ids
            q_pos = (_positions_within_segments(q_seg) if self.q_segment_pos is None
                     else self.q_segment_pos)
            kv_pos = (_positions_within_segments(kv_seg) if self.kv_segment_pos is None
                      else self.kv_segment_pos)
            q_diag = (_tokens_in_own_segment(q_seg, kv_seg) - _tokens_in_own_segment(q_seg, q_seg)
                      if spec.mask.is_bottom_right else jnp.zeros_like(q_seg))
            return _int32_tokens(q_seg, q_pos, q_diag, kv_seg, kv_pos)
        if self.format == SequenceFormat.SEQLENS_OFFSETS:
            q_seg, q_pos, q_len = _segments_from_offsets(self.q_seqlens, self.q_offsets, seqlen_q)
            kv_seg, kv_pos, _ = _segments_from_offsets(self.kv_seqlens, self.kv_offsets, seqlen_kv)
            kv_len_of_q = jnp.take_along_axis(
                jnp.pad(jnp.maximum(self.kv_seqlens, 0), ((0, 0), (1, 0))), q_seg, axis=1)
            q_diag = kv_len_of_q - q_len if spec.mask.is_bottom_right else jnp.zeros_like(q_seg)
            return _int32_tokens(q_seg, q_pos, q_diag, kv_seg, kv_pos)
        q_pos = jnp.broadcast_to(jnp.arange(seqlen_q), (self.q_seqlens.shape[0], seqlen_q))
        kv_pos = jnp.broadcast_to(jnp.arange(seqlen_kv), (self.kv_seqlens.shape[0], seqlen_kv))
        q_seg = (q_pos < self.q_seqlens[:, None]).astype(jnp.int32)
        kv_seg = (kv_pos < self.kv_seqlens[:, None]).astype(jnp.int32)
        shift = (self.kv_seqlens - self.q_seqlens)[:, None]
        q_diag = jnp.broadcast_to(shift if spec.mask.is_bottom_right else 0, q_pos.shape)
        return _int32_tokens(q_seg, q_pos, q_diag, kv_seg, kv_pos)


def dense_token_info(spec: AttentionSpec, batch: int, seqlen_q: int, seqlen_kv: int) -> TokenInfo:
    """TokenInfo without a descriptor: one full-length sequence per row."""
    q_pos = jnp.broadcast_to(jnp.arange(seqlen_q, dtype=jnp.int32), (batch, seqlen_q))
    kv_pos = jnp.broadcast_to(jnp.arange(seqlen_kv, dtype=jnp.int32), (batch, seqlen_kv))
    shift = seqlen_kv - seqlen_q if spec.mask.is_bottom_right else 0
    return TokenInfo(q_seg=jnp.ones_like(q_pos), q_pos=q_pos,
                     q_diag=jnp.full_like(q_pos, shift),
                     kv_seg=jnp.ones_like(kv_pos), kv_pos=kv_pos)


def _int32_tokens(q_seg, q_pos, q_diag, kv_seg, kv_pos) -> TokenInfo:
    return TokenInfo(*(jnp.asarray(x, jnp.int32) for x in (q_seg, q_pos, q_diag, kv_seg, kv_pos)))


def _segments_from_offsets(seqlens, offsets, seqlen):
    """(segment id 1..m or 0, position in segment, own segment length) per token: [b, seqlen]."""
    token = jnp.arange(seqlen)[None, :, None]
    start = offsets[:, None, :-1]
    length = seqlens[:, None, :]
    inside = (length > 0) & (start >= 0) & (token >= start) & (token < start + length)
    slot = jnp.arange(1, seqlens.shape[1] + 1)
    segment = jnp.sum(jnp.where(inside, slot, 0), axis=-1)
    position = jnp.sum(jnp.where(inside, token - start, 0), axis=-1)
    own_length = jnp.sum(jnp.where(inside, length, 0), axis=-1)
    return segment, position, own_length


def _positions_within_segments(segment_ids):
    """0, 1, 2, ... over the tokens of each segment id in row order, per row: [b, s]."""
    def per_row(ids):
        order = jnp.argsort(ids, stable=True)
        ordered = ids[order]
        rank = jnp.arange(ids.shape[0]) - _search(ordered, ordered, "left")
        return jnp.zeros_like(ids).at[order].set(rank)
    return jax.vmap(per_row)(segment_ids)


def _search(ordered, values, side):
    """jnp.searchsorted unrolled: its default lowers to a while loop, which on a GPU waits for
    the host at every trip (0.37 ms a call measured on the H200 at [4, 2048], 0.06 unrolled)."""
    return jnp.searchsorted(ordered, values, side=side, method="scan_unrolled")


def _tokens_in_own_segment(ids, pool):
    """For each token of `ids` [b, s], how many tokens of `pool` [b, p] carry its id."""
    count, _, _ = jax.vmap(segment_occurrences)(ids, pool)
    return count


def segment_occurrences(ids: jax.Array, pool: jax.Array):
    """For each id of one row [s]: how often it occurs in `pool` [p], first and last index.

    A [s, p] comparison when the row has one id (the common case, cheapest);
    otherwise a stable sort of the pool and binary searches.
    """
    if ids.shape[0] == 1:
        same = pool[None, :] == ids[:, None]
        index = jnp.arange(pool.shape[0])
        count = jnp.sum(same, axis=-1)
        first = jnp.min(jnp.where(same, index, pool.shape[0]), axis=-1)
        last = jnp.max(jnp.where(same, index, -1), axis=-1)
        return count, first, last
    order = jnp.argsort(pool, stable=True)
    ordered = pool[order]
    left = _search(ordered, ids, "left")
    right = _search(ordered, ids, "right")
    top = pool.shape[0] - 1
    return right - left, order[jnp.clip(left, 0, top)], order[jnp.clip(right - 1, 0, top)]


class SegmentRuns(NamedTuple):
    """Each row's segments as runs of consecutive tokens, in row order (int32).

    start, length, id, first_pos: [b, slots] per run (length 0 and id 0 in unused
    slots); count: [b] runs in the row (may exceed slots); slot: [b, s] each
    token's run index, -1 for padding tokens.
    """

    start: jax.Array
    length: jax.Array
    id: jax.Array
    first_pos: jax.Array
    count: jax.Array
    slot: jax.Array


def segment_runs(ids: jax.Array, positions: jax.Array, slots: int) -> SegmentRuns:
    """Splits rows of per-token segment ids and positions [b, s] into runs.

    A run starts at a non-padding token whose id differs from the previous
    token's or whose position does not continue it (previous + 1); runs past
    `slots` are counted but not tabled.
    """
    b, s = ids.shape
    prev_id = jnp.pad(ids[:, :-1], ((0, 0), (1, 0)))
    prev_pos = jnp.pad(positions[:, :-1], ((0, 0), (1, 0)))
    starts = (ids != 0) & ((ids != prev_id) | (positions != prev_pos + 1))
    run = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1
    slot = jnp.where(ids != 0, run, -1)
    # One-hot reductions over [b, s, slots] (fused by XLA; scatters would be separate kernels).
    member = slot[:, :, None] == jnp.arange(slots, dtype=jnp.int32)
    token = jnp.arange(s, dtype=jnp.int32)[None, :, None]
    length = jnp.sum(member, axis=1, dtype=jnp.int32)
    start = jnp.min(jnp.where(member, token, s), axis=1)
    start = jnp.where(length > 0, start, 0).astype(jnp.int32)
    run_id = jnp.max(jnp.where(member, ids[:, :, None], 0), axis=1).astype(jnp.int32)
    first_pos = jnp.take_along_axis(positions, start, axis=1).astype(jnp.int32)
    return SegmentRuns(start=start, length=length, id=run_id,
                       first_pos=jnp.where(length > 0, first_pos, 0),
                       count=jnp.sum(starts, axis=1, dtype=jnp.int32), slot=slot)


def _pad_slots(x: jax.Array, width: int) -> jax.Array:
    """[b, n] -> [b, width]: the slots added are unused (-1)."""
    return jnp.pad(x, ((0, 0), (0, width - x.shape[1])), constant_values=-1)


def _int_array(value, name: str) -> jax.Array:
    array = jnp.asarray(value)
    if not jnp.issubdtype(array.dtype, jnp.integer):
        raise TypeError(f"{name}: expected an integer array, got dtype {array.dtype}.")
    return array.astype(jnp.int32)


def _expect_ndim(array, ndim: int, name: str, shape: str) -> None:
    if array.ndim != ndim:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(array.shape)}.")


def _expect_same_shape(a, b, name_a: str, name_b: str) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"{name_b}: expected the shape of {name_a} {tuple(a.shape)}, got {tuple(b.shape)}."
        )

