"""A paged KV cache for decoding with the attention layers (fusedattn.ops.paged underneath).

Two objects, both pytrees of arrays (pass them through jax.jit freely):

- `PageTable`, one per model, shared by its layers: which pool pages hold which
  sequence's tokens, how many tokens each sequence has cached, how many the current
  step adds, and which pages are free. Sequences live in a fixed number of slots
  (max_seqs, the layers' batch axis).
- `PagedKVCache`, one per attention layer: its key and value page pools.

One step (prefill of whole prompts, or one or more decode tokens per sequence):

    pages = allocate(pages, new_tokens, page_size)  # pages for lengths + new_tokens
    out = layer(x, pages=pages)                      # each layer: write its k/v, attend
    pages = advance(pages)                           # lengths += new_tokens
    pages = free(pages, finished)                    # return finished sequences' pages

x is [max_seqs, n, features] with sequence s's new tokens left-aligned in x[s, :new_tokens[s]]
(rows past them, and slots with new_tokens 0, output zeros). The new tokens are the last
ones of their sequences, so they attend bottom-right causally (config masks "causal",
"padding_causal", ...: padding_causal_bottom_right) or to every cached token (no_mask,
padding: padding) of their own sequence: token by token this equals the full-sequence
attention.

Allocation is jit-friendly: under jit, running out of pages (or of page-table columns)
leaves -1 entries among a sequence's pages, which the op reports as broken data (NaN
outputs, and a checkify error); eagerly it raises ValueError at once.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fusedattn import ops as _ops
from fusedattn.layers import common
from fusedattn.ops.enums import MaskType, QKVLayout, SequenceFormat
from fusedattn.ops.spec import AttentionSpec

Array = jax.Array


class PageTable(NamedTuple):
    """The pages of every sequence slot (shared by a model's layers).

    table: int32 [max_seqs, max_pages_per_seq], pool page of each sequence page, -1 = none
      (a sequence's pages are a prefix of its row).
    lengths: int32 [max_seqs], tokens cached per sequence.
    pending: int32 [max_seqs], tokens the current step adds (set by `allocate`).
    free: bool [num_pages], pages no sequence holds.
    """

    table: Array
    lengths: Array
    pending: Array
    free: Array


class PagedKVCache(NamedTuple):
    """One layer's page pools: key_pages [num_pages, page_size, h_kv, d], value_pages
    [num_pages, page_size, h_kv, dv]."""

    key_pages: Array
    value_pages: Array

    @property
    def page_size(self) -> int:
        return self.key_pages.shape[1]


def page_table(num_pages: int, max_seqs: int, max_pages_per_seq: int) -> PageTable:
    """An empty PageTable: every page free, every sequence slot empty."""
    for name, value in (("num_pages", num_pages), ("max_seqs", max_seqs),
                        ("max_pages_per_seq", max_pages_per_seq)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}.")
    return PageTable(table=jnp.full((max_seqs, max_pages_per_seq), -1, jnp.int32),
                     lengths=jnp.zeros((max_seqs,), jnp.int32),
                     pending=jnp.zeros((max_seqs,), jnp.int32),
                     free=jnp.ones((num_pages,), bool))


def kv_cache(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype,
             head_dim_v: int | None = None) -> PagedKVCache:
    """Zero page pools [num_pages, page_size, num_kv_heads, head_dim(_v)] in `dtype`."""
    shape = (num_pages, page_size, num_kv_heads)
    return PagedKVCache(jnp.zeros((*shape, head_dim), dtype),
                        jnp.zeros((*shape, head_dim_v or head_dim), dtype))


def allocate(pages: PageTable, new_tokens, page_size: int) -> PageTable:
    """Gives every sequence the pages for lengths + new_tokens tokens; sets pending.

    new_tokens: int [max_seqs] (0 for slots that take no token this step). Free pages
    are handed out in ascending page order, sequence by sequence.
    """
    new_tokens = jnp.asarray(new_tokens, jnp.int32)
    if new_tokens.shape != pages.lengths.shape:
        raise ValueError(f"new_tokens: expected shape [max_seqs] = {tuple(pages.lengths.shape)}, "
                         f"got {tuple(new_tokens.shape)}.")
    max_pages = pages.table.shape[1]
    held = jnp.sum(pages.table >= 0, axis=1, dtype=jnp.int32)
    needed = -(-(pages.lengths + new_tokens) // page_size)
    extra = jnp.maximum(needed - held, 0)
    available = jnp.sum(pages.free, dtype=jnp.int32)
    _check_room(needed, max_pages, jnp.sum(extra), available)
    free_ids = jnp.argsort(~pages.free, stable=True).astype(jnp.int32)  # free pages first
    column = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
    take = (column >= held[:, None]) & (column < (held + extra)[:, None])
    rank = (jnp.cumsum(extra) - extra)[:, None] + column - held[:, None]
    granted = take & (rank < available)
    new_ids = jnp.take(free_ids, jnp.clip(rank, 0, free_ids.shape[0] - 1))
    table = jnp.where(granted, new_ids, pages.table)
    taken = jnp.where(granted, new_ids, pages.free.shape[0]).reshape(-1)
    return PageTable(table=table, lengths=pages.lengths, pending=new_tokens,
                     free=pages.free.at[taken].set(False, mode="drop"))


def _check_room(needed, max_pages: int, extra, available) -> None:
    if isinstance(extra, jax.core.Tracer) or isinstance(needed, jax.core.Tracer):
        return  # under jit the op reports the missing pages (see the module docstring)
    if int(jnp.max(needed)) > max_pages:
        raise ValueError(
            f"new_tokens: a sequence would need {int(jnp.max(needed))} pages, but the page "
            f"table holds {max_pages} per sequence; make a page_table with a larger "
            "max_pages_per_seq (or larger pages).")
    if int(extra) > int(available):
        raise ValueError(
            f"new_tokens: the step needs {int(extra)} new pages but only {int(available)} are "
            "free; free finished sequences (free(pages, done)) or make a larger pool.")


def advance(pages: PageTable) -> PageTable:
    """After every layer has written the step's tokens: lengths += pending, pending = 0."""
    return pages._replace(lengths=pages.lengths + pages.pending,
                          pending=jnp.zeros_like(pages.pending))


def free(pages: PageTable, done) -> PageTable:
    """Empties the sequence slots where `done` (bool [max_seqs]) and frees their pages."""
    done = jnp.asarray(done, bool)
    released = jnp.where(done[:, None] & (pages.table >= 0), pages.table,
                         pages.free.shape[0]).reshape(-1)
    return PageTable(table=jnp.where(done[:, None], -1, pages.table),
                     lengths=jnp.where(done, 0, pages.lengths),
                     pending=jnp.where(done, 0, pages.pending),
                     free=pages.free.at[released].set(True, mode="drop"))


def positions(pages: PageTable, num_tokens: int) -> Array:
    """int32 [max_seqs, num_tokens]: the sequence positions of the step's tokens."""
    return pages.lengths[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]


def write(cache: PagedKVCache, pages: PageTable, k: Array, v: Array) -> PagedKVCache:
    """Stores the step's keys/values k [max_seqs, n, h_kv, d], v [..., dv] (the first
    pending[s] rows of each sequence) after the sequence's cached tokens."""
    num_pages, page_size = cache.key_pages.shape[:2]
    max_pages = pages.table.shape[1]
    n = k.shape[1]
    position = positions(pages, n)
    page_index = position // page_size
    page = jnp.take_along_axis(pages.table, jnp.clip(page_index, 0, max_pages - 1), axis=1)
    keep = ((jnp.arange(n)[None, :] < pages.pending[:, None]) & (page_index < max_pages)
            & (page >= 0))
    page = jnp.where(keep, page, num_pages)  # dropped by the scatter
    slot = position % page_size
    return PagedKVCache(
        cache.key_pages.at[page, slot].set(k.astype(cache.key_pages.dtype), mode="drop"),
        cache.value_pages.at[page, slot].set(v.astype(cache.value_pages.dtype), mode="drop"))


def paged_spec(spec: AttentionSpec) -> AttentionSpec:
    """The layer's spec for a paged step: the paged BSHD layout, bottom-right causal
    (or padding, for non-causal masks) over each sequence's cached tokens."""
    return spec.replace(qkv_layout=QKVLayout.PAGED_KV_BSHD_BSHD_BSHD,
                        mask=(MaskType.PADDING_CAUSAL_BOTTOM_RIGHT if spec.mask.is_causal
                              else MaskType.PADDING),
                        sequence_format=SequenceFormat.SEQLENS, max_segments_per_seq=1,
                        max_seqlen_q=None, max_seqlen_kv=None)


def attend(spec: AttentionSpec, q: Array, cache: PagedKVCache, pages: PageTable,
           softmax_offset=None) -> Array:
    """q [max_seqs, n, h, d] over the cached (and just written) tokens -> [max_seqs, n, h, dv]."""
    sequence = _ops.SequenceDescriptor.from_seqlens(pages.pending, pages.lengths + pages.pending)
    return _ops.fused_attn((q, cache.key_pages, cache.value_pages), config=paged_spec(spec),
                           softmax_offset=softmax_offset, sequence=sequence,
                           page_table=pages.table)


def check_step(pages, x_shape: tuple[int, ...], name: str, *, mask, bias, sequence) -> None:
    """The errors of a paged layer call: a PageTable, [max_seqs, n, features] inputs, no
    mask / bias / sequence (the page table describes the sequences)."""
    if not isinstance(pages, PageTable):
        raise TypeError(f"pages: expected a fusedattn.layers.paged.PageTable, got "
                        f"{type(pages).__name__}.")
    if len(x_shape) != 3 or x_shape[0] != pages.lengths.shape[0]:
        raise ValueError(
            f"{name}: a paged step takes [max_seqs, n, features] = [{pages.lengths.shape[0]}, "
            f"n, features] (one row per sequence slot of the page table), got {x_shape}.")
    for arg, value in (("mask", mask), ("bias", bias), ("sequence", sequence)):
        if value is not None:
            raise ValueError(
                f"{arg}: a paged step takes none (the page table's lengths describe the "
                f"sequences and the mask is bottom-right causal over them); drop {arg}=.")


def step(spec: AttentionSpec, options, q: Array, k: Array, v: Array, *, q_norm=None,
         k_norm=None, cache: PagedKVCache, pages: PageTable,
         softmax_offset=None) -> tuple[Array, PagedKVCache]:
    """A layer's paged step between its projections: QK norm, RoPE at the sequences'
    positions, write k/v into the pools, attend.

    q: [max_seqs, n, h, d]; k: [max_seqs, n, h_kv, d]; v: [max_seqs, n, h_kv, dv];
    options: the layer's common.LayerOptions. Returns (out [max_seqs, n, h, dv] in q's
    dtype, the updated cache).
    """
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    if options.rope_theta is not None:
        position = positions(pages, q.shape[1])
        q = common.apply_rope(q, position, options.rope_theta)
        k = common.apply_rope(k, position, options.rope_theta)
    cache = write(cache, pages, k, v)
    out = attend(spec, q.astype(cache.key_pages.dtype), cache, pages, softmax_offset)
    return out.astype(q.dtype), cache
