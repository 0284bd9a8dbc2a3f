"""Checks of a SequenceDescriptor's values: impossible descriptors never give numbers.

`broken_rows(sequence, spec, seqlen_q, seqlen_kv)` evaluates every rule below on
the device (elementwise work on the [b, m] lengths/offsets or [b, s] ids):

- seqlens form: lengths in [0, array extent];
- seqlens_offsets form (unused slots have length -1): lengths >= -1; a used slot's
  offset >= 0 and offset + length <= the array extent; used slots in increasing,
  non-overlapping order; a used slot ends at or before the next offset (when that
  offset is set, >= 0), so lengths and offsets agree;
- segment_ids form: ids >= 0 (0 is padding), positions >= 0.

With concrete values (eager use) the first broken rule raises ValueError naming the
field, the row and the bad value. Under tracing the same rules report through
base.guard (checkify, when config.sequence.check_bounds is set) and the rows they
break are returned, so the op marks those rows' outputs NaN instead of numbers.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn.ops.backends.base import guard
from fusedattn.ops.enums import SequenceFormat
from fusedattn.ops.spec import AttentionSpec


class Rule(NamedTuple):
    """One descriptor rule: field, bool [b, ...] broken entries, what is expected."""

    field: str
    broken: jax.Array
    expected: str


def broken_rows(sequence, spec: AttentionSpec, seqlen_q: int, seqlen_kv: int) -> jax.Array:
    """bool [b]: rows whose descriptor values are impossible (raises eagerly, see module)."""
    rules = _rules(sequence, seqlen_q, seqlen_kv)
    for rule in rules:
        if not isinstance(rule.broken, jax.core.Tracer):
            _raise_first(rule, getattr(sequence, rule.field))
        guard(rule.broken, f"sequence.{rule.field}: descriptor values break the rule "
              f"'{rule.expected}'; the rows affected are marked NaN.", spec)
    rows = [jnp.any(r.broken.reshape(r.broken.shape[0], -1), axis=1) for r in rules]
    return jnp.any(jnp.stack(rows), axis=0)


def _raise_first(rule: Rule, values) -> None:
    broken = np.asarray(rule.broken)
    if not broken.any():
        return
    index = tuple(int(i) for i in np.argwhere(broken)[0])
    where = f"row {index[0]}" + (f", entry {index[1]}" if len(index) > 1 else "")
    raise ValueError(
        f"sequence.{rule.field}: {where} holds {int(np.asarray(values)[index])}; expected "
        f"{rule.expected}. Fix the descriptor (see fusedattn.ops.SequenceDescriptor's "
        "constructors for each form)."
    )


def _rules(sequence, seqlen_q: int, seqlen_kv: int) -> list[Rule]:
    if sequence.format == SequenceFormat.SEGMENT_IDS:
        rules = [Rule(name, getattr(sequence, name) < 0, expected)
                 for name, expected in (
                     ("q_segment_ids", "ids >= 0 (0 is padding, >= 1 names a segment)"),
                     ("kv_segment_ids", "ids >= 0 (0 is padding, >= 1 names a segment)"),
                     ("q_segment_pos", "positions >= 0"), ("kv_segment_pos", "positions >= 0"))
                 if getattr(sequence, name) is not None]
        return rules
    if sequence.format == SequenceFormat.SEQLENS:
        return [Rule(name, (lengths < 0) | (lengths > extent),
                     f"a length in [0, {extent}] (the array's {side} extent)")
                for name, lengths, extent, side in (
                    ("q_seqlens", sequence.q_seqlens, seqlen_q, "query"),
                    ("kv_seqlens", sequence.kv_seqlens, seqlen_kv, "key/value"))]
    return (_offset_rules("q", sequence.q_seqlens, sequence.q_offsets, seqlen_q)
            + _offset_rules("kv", sequence.kv_seqlens, sequence.kv_offsets, seqlen_kv))


def _offset_rules(side: str, lengths: jax.Array, offsets: jax.Array, extent: int) -> list[Rule]:
    """The THD rules for one side: lengths [b, m], offsets [b, m + 1]."""
    used = lengths >= 0
    start = offsets[:, :-1]
    end = start + lengths
    # The furthest end of the used slots before each slot (0 before the first).
    ends = jnp.where(used, end, 0)
    previous_end = jnp.pad(jax.lax.cummax(ends, axis=1)[:, :-1], ((0, 0), (1, 0)))
    following = offsets[:, 1:]
    return [
        Rule(f"{side}_seqlens", lengths < -1, "a length >= 0, or -1 for an unused slot"),
        Rule(f"{side}_offsets", used & (start < 0), "an offset >= 0 for each used slot"),
        Rule(f"{side}_seqlens", used & (start >= 0) & (end > extent),
             f"offset + length <= {extent} (the array's token extent) for each used slot"),
        Rule(f"{side}_offsets", used & (start >= 0) & (start < previous_end),
             "offsets of used slots in increasing order, each at or after the previous "
             "segment's end (segments may not overlap)"),
        Rule(f"{side}_offsets", used & (following >= 0) & (following < end),
             "offsets[i + 1] >= offsets[i] + lengths[i] for each used slot i (lengths and "
             "offsets agree)"),
    ]
