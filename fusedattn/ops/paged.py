"""Paged KV cache: checking a paged call and reducing it to one canonical form.

Layouts (API.md) "paged_kv_bshd_bshd_bshd" and "paged_kv_thd_bshd_bshd": q as the
letters after "paged_kv_" say, k and v page pools [num_pages, page_size, h_kv, d(v)],
and `page_table` int32 [S, max_pages_per_seq]: page i of sequence s is pool entry
page_table[s, i], so key j of the sequence (0 <= j < kv_len) is
k[page_table[s, j // page_size], j % page_size].

Sequences and their lengths come from the SequenceDescriptor:

- BSHD q [b, sq, h, d]: one sequence per row (S = b), its queries left-aligned,
  `SequenceDescriptor.from_seqlens(q_seqlens [b], kv_seqlens [b])`.
- THD q [b, t, h, d]: each row packs up to m sequences' queries,
  `from_seqlens_and_offsets(q_seqlens [b, m], kv_seqlens [b, m], q_offsets [b, m + 1],
  kv_offsets)`; page-table row r * m + j is slot j of row r (S = b * m; for the usual
  q [1, t, h, d], one table row per sequence). kv_offsets are not read: the keys live
  in the pages. Unused slots have lengths -1 (or 0).

Query i of a sequence (0 <= i < q_len) has position i; its mask diagonal is i under
top-left masks and i + kv_len - q_len under bottom-right ones (the queries are the
sequence's last tokens: decoding, speculative verification, chunked prefill). Every
mask reads the key lengths (no_mask behaves as padding, as with THD layouts); q
tokens outside every sequence output zeros.

Data that breaks the call's bounds (more keys than the sequence's pages hold or than
config.sequence.max_seqlen_kv, more queries than config.sequence.max_seqlen_q or
than fit in the row, a page number outside the pool among the pages a sequence
uses) marks that sequence broken: every backend writes NaN to its queries' outputs,
and base.guard raises (eagerly) or reports through checkify (under jit).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fusedattn.ops.backends.base import CallShapes, CanonicalArgs, TokenInfo, guard
from fusedattn.ops.enums import BiasType, SequenceFormat
from fusedattn.ops import layouts
from fusedattn.ops.sequence import SequenceDescriptor
from fusedattn.ops.spec import AttentionSpec


class PagedArgs(NamedTuple):
    """One paged call in canonical form (BSHD and THD alike).

    q: [b, sq, h, d] (THD: [b, t, h, d]); k_pages: [num_pages, page_size, h_kv, d];
    v_pages: [num_pages, page_size, h_kv, dv]; page_table: int32 [S, pages_per_seq]
    with S = b * m (m sequences per row); sequence s lives in q row s // m.
    q_start: int32 [S], the row offset of the sequence's first query (0 for BSHD).
    q_len: int32 [S], its query count (<= 0 for an unused slot).
    kv_len: int32 [S], its key count; -1 marks a broken sequence (NaN outputs).
    softmax_offset: None or float32 [h] (off_by_one passes zeros).
    """

    q: jax.Array
    k_pages: jax.Array
    v_pages: jax.Array
    page_table: jax.Array
    q_start: jax.Array
    q_len: jax.Array
    kv_len: jax.Array
    softmax_offset: jax.Array | None = None

    @property
    def segments_per_row(self) -> int:
        return self.page_table.shape[0] // self.q.shape[0]


def check_arrays(qkv: tuple, layout) -> tuple:
    """Validates (q, k_pages, v_pages) against a paged layout; works on ShapeDtypeStructs."""
    shapes = ("[b, t, h, d]" if layout.is_thd else "[b, sq, h, d]",
              "[num_pages, page_size, h_kv, d]", "[num_pages, page_size, h_kv, dv]")
    if len(qkv) != 3:
        raise ValueError(
            f"qkv: layout {str(layout)!r} takes 3 arrays (q {shapes[0]}, k {shapes[1]}, "
            f"v {shapes[2]}), got {len(qkv)}. Pass q and the two page pools, or change "
            "config.qkv_layout."
        )
    for array, name, shape in zip(qkv, ("q", "k", "v"), shapes):
        layouts.check_array(array, name, shape, layout)
    layouts.check_same_dtype(qkv, ("q", "k", "v"))
    q, k, v = qkv
    if tuple(k.shape[:3]) != tuple(v.shape[:3]):
        raise ValueError(
            f"qkv: the k pool {tuple(k.shape)} and the v pool {tuple(v.shape)} must agree on "
            "[num_pages, page_size, h_kv]."
        )
    if k.shape[0] < 1 or k.shape[1] < 1:
        raise ValueError(f"qkv: the page pools need at least one page of at least one token, "
                         f"got k {tuple(k.shape)}.")
    if k.shape[3] != q.shape[3]:
        raise ValueError(
            f"qkv: q head dim {q.shape[3]} differs from the k pool's {k.shape[3]}; q and k need "
            "one head dim."
        )
    h, h_kv = q.shape[2], k.shape[2]
    if h_kv == 0 or h % h_kv:
        raise ValueError(
            f"qkv: q has {h} heads and the k/v pools {h_kv}; grouped-query attention needs the "
            "q head count to be a multiple of the k/v head count."
        )
    return tuple(qkv)


def call_shapes(spec: AttentionSpec, q, k, v, bias, sequence, page_table,
                dropout: bool) -> CallShapes:
    """Validates a paged call (all but array values) and returns its static facts."""
    layout = spec.qkv_layout
    if spec.bias != BiasType.NO_BIAS or bias is not None:
        raise ValueError(
            f"bias: paged layouts take no bias (config.bias is {str(spec.bias)!r}): their keys "
            "have no dense axis to lay a bias over. Set config.bias='no_bias' and drop the array."
        )
    if dropout:
        raise ValueError(
            f"config.dropout_rate: paged layouts serve inference (decoding, prefill into the "
            f"cache), without dropout; got dropout_rate={spec.dropout_rate} with "
            "is_training=True. Pass is_training=False."
        )
    if page_table is None:
        raise ValueError(
            f"page_table: layout {str(layout)!r} reads k and v through a page table; pass "
            "page_table=int32 [sequences, max_pages_per_seq] (page i of sequence s is pool "
            "entry page_table[s, i])."
        )
    if not hasattr(page_table, "shape") or not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise TypeError(
            f"page_table: expected an int32 array [sequences, max_pages_per_seq], got "
            f"{getattr(page_table, 'dtype', type(page_table).__name__)}."
        )
    wanted = SequenceFormat.SEQLENS_OFFSETS if layout.is_thd else SequenceFormat.SEQLENS
    constructor = ("SequenceDescriptor.from_seqlens_and_offsets(q_seqlens [b, m], kv_seqlens "
                   "[b, m], q_offsets [b, m + 1], kv_offsets)" if layout.is_thd
                   else "SequenceDescriptor.from_seqlens(q_seqlens [b], kv_seqlens [b])")
    if sequence is None:
        raise ValueError(
            f"sequence: layout {str(layout)!r} reads each sequence's key count from a "
            f"SequenceDescriptor; pass sequence={constructor}."
        )
    if not isinstance(sequence, SequenceDescriptor):
        raise TypeError(f"sequence: expected a fusedattn.ops.SequenceDescriptor, got "
                        f"{type(sequence).__name__}.")
    if sequence.format != wanted:
        raise ValueError(
            f"sequence: layout {str(layout)!r} needs the descriptor's {str(wanted)!r} form, got "
            f"{str(sequence.format)!r}; build it with {constructor}."
        )
    b, sq, h, d = q.shape
    sequence.check(spec, b, sq, sq)
    segments = sequence.q_seqlens.shape[1] if layout.is_thd else 1
    if page_table.ndim != 2 or page_table.shape[0] != b * segments or page_table.shape[1] < 1:
        rows = f"b * m = {b} * {segments}" if layout.is_thd else f"b = {b}"
        raise ValueError(
            f"page_table: expected shape [{rows}, max_pages_per_seq >= 1] (one row per "
            f"sequence{' slot' if layout.is_thd else ''}), got {tuple(page_table.shape)}."
        )
    num_pages, page_size, h_kv, _ = k.shape
    pages = page_table.shape[1]
    return CallShapes(batch=b, seqlen_q=sq, seqlen_kv=pages * page_size, num_heads=h,
                      num_kv_heads=h_kv, head_dim_qk=d, head_dim_v=v.shape[3],
                      dtype=jnp.dtype(q.dtype), bias_shape=None, dropout=False,
                      num_pages=num_pages, page_size=page_size, pages_per_seq=pages)


def canonical(spec: AttentionSpec, q, k_pages, v_pages, sequence: SequenceDescriptor,
              page_table, softmax_offset, kernel_checks_pages: bool = False) -> PagedArgs:
    """The call's PagedArgs, with broken sequences marked (kv_len -1) and guarded.

    kernel_checks_pages: the backend's kernel marks sequences with a page outside the pool
    broken by itself (the decode kernels: paged_sequence_ok); then, where no guard reads
    it (traced, config.sequence.check_bounds off), the [S, pages] page check is left out
    here, one device op less before the kernel.
    """
    b, sq = q.shape[:2]
    if spec.qkv_layout.is_thd:
        q_start = sequence.q_offsets[:, :-1].reshape(-1)
        q_len, kv_len = sequence.q_seqlens.reshape(-1), sequence.kv_seqlens.reshape(-1)
    else:
        q_start = jnp.zeros((b,), jnp.int32)
        q_len, kv_len = sequence.q_seqlens, sequence.kv_seqlens
    page_table = jnp.asarray(page_table, jnp.int32)
    used = q_len > 0  # q_len stays as given: every reader takes q_len <= 0 as an unused slot
    kv_len = jnp.maximum(kv_len, 0)
    num_pages, page_size = k_pages.shape[:2]
    pages = page_table.shape[1]
    broken = (kv_len > pages * page_size) | (q_start < 0) | (q_start + q_len > sq)
    traced = any(isinstance(x, jax.core.Tracer) for x in (q_start, q_len, kv_len, page_table))
    if not (kernel_checks_pages and traced and not spec.check_bounds):
        page_in_use = jnp.arange(pages)[None, :] * page_size < kv_len[:, None]
        broken |= jnp.any(page_in_use & ((page_table < 0) | (page_table >= num_pages)), axis=1)
    if spec.max_seqlen_q is not None:
        broken |= q_len > spec.max_seqlen_q
    if spec.max_seqlen_kv is not None:
        broken |= kv_len > spec.max_seqlen_kv
    broken &= used
    guard(broken, _guard_message(spec, pages, page_size, num_pages), spec)
    return PagedArgs(q=q, k_pages=k_pages, v_pages=v_pages, page_table=page_table,
                     q_start=q_start.astype(jnp.int32), q_len=q_len.astype(jnp.int32),
                     kv_len=jnp.where(broken, -1, kv_len).astype(jnp.int32),
                     softmax_offset=softmax_offset)


def _guard_message(spec: AttentionSpec, pages: int, page_size: int, num_pages: int) -> str:
    return (f"paged attention: the data breaks the call's bounds: a sequence has more keys than "
            f"its {pages} pages of {page_size} tokens hold (or than config.sequence.max_seqlen_kv="
            f"{spec.max_seqlen_kv}), more queries than config.sequence.max_seqlen_q="
            f"{spec.max_seqlen_q} or than fit in its q row, or a page number outside "
            f"[0, {num_pages}) among the pages it uses. Its outputs are NaN. Fix the page table "
            "and lengths, or raise the bounds.")


def dense_view(spec: AttentionSpec, args: PagedArgs) -> tuple[CanonicalArgs, jax.Array]:
    """The call as contiguous attention (the XLA oracle): gathers every sequence's pages.

    Returns CanonicalArgs with k, v [b, m * cap, h_kv, d] (row r holds its m sequences'
    pages one after another, cap = pages_per_seq * page_size tokens each) and TokenInfo
    whose segments are the sequences, and a boolean [b, sq] marking the query tokens of
    broken sequences.
    """
    b, sq = args.q.shape[:2]
    m = args.segments_per_row
    num_pages, page_size = args.k_pages.shape[:2]
    pages = args.page_table.shape[1]
    cap = pages * page_size
    table = jnp.clip(args.page_table, 0, num_pages - 1)

    def gather(pool):
        dense = jnp.take(pool, table, axis=0)  # [S, pages, page_size, h_kv, d]
        return dense.reshape(b, m * cap, *pool.shape[2:])

    q_start, q_len, kv_len = (x.reshape(b, m) for x in (args.q_start, args.q_len, args.kv_len))
    slot = jnp.arange(1, m + 1, dtype=jnp.int32)
    token = jnp.arange(sq, dtype=jnp.int32)[None, :, None]
    inside = (q_len[:, None, :] > 0) & (token >= q_start[:, None, :]) & (
        token < (q_start + q_len)[:, None, :])
    q_seg = jnp.sum(jnp.where(inside, slot, 0), axis=-1)
    q_pos = jnp.sum(jnp.where(inside, token - q_start[:, None, :], 0), axis=-1)
    shift = jnp.where(spec.mask.is_bottom_right, kv_len - q_len, 0)
    q_diag = jnp.sum(jnp.where(inside, shift[:, None, :], 0), axis=-1)
    kv_index = jnp.arange(m * cap, dtype=jnp.int32)
    kv_slot, kv_pos = kv_index // cap, kv_index % cap
    kv_seg = jnp.where(kv_pos[None, :] < jnp.take(kv_len, kv_slot, axis=1), kv_slot + 1, 0)
    tokens = TokenInfo(*(jnp.asarray(x, jnp.int32) for x in (
        q_seg, q_pos, q_diag, kv_seg, jnp.broadcast_to(kv_pos, (b, m * cap)))))
    broken_token = jnp.any(inside & (kv_len < 0)[:, None, :], axis=-1)
    dense = CanonicalArgs(q=args.q, k=gather(args.k_pages), v=gather(args.v_pages),
                          tokens=tokens, softmax_offset=args.softmax_offset)
    return dense, broken_token
