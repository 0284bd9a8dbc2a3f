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
and base.guard raises (eagerly) or reports through checkify (under jit). A negative
key length counts as 0 keys. `broken_sequences` computes the marks; the decode
kernels find them themselves (ops_cuda/include/fusedattn/paged.h), so a jitted,
unchecked decode call passes the lengths to its kernel as they are.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

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
    kv_len: int32 [S], its key count as the caller gave it (a negative one counts as 0).
    broken: None or bool [S], broken_sequences(): the used sequences whose data breaks the
        call's bounds (NaN outputs); None where canonical left finding them to the
        backend's kernel.
    softmax_offset: None or float32 [h] (off_by_one passes zeros).
    """

    q: jax.Array
    k_pages: jax.Array
    v_pages: jax.Array
    page_table: jax.Array
    q_start: jax.Array
    q_len: jax.Array
    kv_len: jax.Array
    broken: jax.Array | None = None
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
              page_table, softmax_offset, kernel_checks_sequences: bool = False) -> PagedArgs:
    """The call's PagedArgs, with its broken sequences found (`broken`) and guarded.

    kernel_checks_sequences: the backend's kernels find the broken sequences themselves,
    from the lengths as given and the call's bounds (the decode kernels: paged.h's
    paged_sequence_ok). Then, where no guard reads the marks (traced values,
    config.sequence.check_bounds off), nothing is computed here (`broken` None): the
    lengths reach the kernel untouched and the call is the kernel alone.
    """
    b = q.shape[0]
    if spec.qkv_layout.is_thd:
        q_start = sequence.q_offsets[:, :-1].reshape(-1)
        q_len, kv_len = sequence.q_seqlens.reshape(-1), sequence.kv_seqlens.reshape(-1)
    else:
        q_start = np.zeros((b,), np.int32)  # a constant: no device op where nothing reads it
        q_len, kv_len = sequence.q_seqlens, sequence.kv_seqlens
    # astype and asarray add no op where the values are int32 already (the descriptor's are)
    args = PagedArgs(q=q, k_pages=k_pages, v_pages=v_pages,
                     page_table=jnp.asarray(page_table, jnp.int32),
                     q_start=q_start.astype(jnp.int32), q_len=q_len.astype(jnp.int32),
                     kv_len=kv_len.astype(jnp.int32), softmax_offset=softmax_offset)
    traced = any(isinstance(x, jax.core.Tracer)
                 for x in (args.q_start, args.q_len, args.kv_len, args.page_table))
    if kernel_checks_sequences and traced and not spec.check_bounds:
        return args
    broken = broken_sequences(spec, args)
    num_pages, page_size = k_pages.shape[:2]
    guard(broken, _guard_message(spec, args.page_table.shape[1], page_size, num_pages), spec)
    return args._replace(broken=broken)


def broken_sequences(spec: AttentionSpec, args: PagedArgs) -> jax.Array:
    """bool [S]: the used sequences (q_len > 0) whose data breaks the call's bounds.

    Broken: more keys (a negative count read as 0) than the sequence's pages hold or than
    config.sequence.max_seqlen_kv, a query range outside its q row, more queries than
    config.sequence.max_seqlen_q, or a page number outside the pool among the pages its
    keys use. The twin of the decode kernels' paged_lengths_ok and paged_page_ok
    (ops_cuda/include/fusedattn/paged.h): the two must agree.
    """
    sq = args.q.shape[1]
    num_pages, page_size = args.k_pages.shape[:2]
    pages = args.page_table.shape[1]
    kv_len = jnp.maximum(args.kv_len, 0)
    broken = ((kv_len > pages * page_size) | (args.q_start < 0)
              | (args.q_start + args.q_len > sq))
    page_in_use = jnp.arange(pages)[None, :] * page_size < kv_len[:, None]
    outside_pool = (args.page_table < 0) | (args.page_table >= num_pages)
    broken |= jnp.any(page_in_use & outside_pool, axis=1)
    if spec.max_seqlen_q is not None:
        broken |= args.q_len > spec.max_seqlen_q
    if spec.max_seqlen_kv is not None:
        broken |= kv_len > spec.max_seqlen_kv
    return broken & (args.q_len > 0)


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
    whose segments are the sequences (a broken one's without keys), and a boolean [b, sq]
    marking the query tokens of broken sequences.
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

    broken = args.broken if args.broken is not None else broken_sequences(spec, args)
    kv_len = jnp.where(broken, 0, jnp.maximum(args.kv_len, 0))
    q_start, q_len, kv_len, broken = (x.reshape(b, m) for x in (args.q_start, args.q_len, kv_len,
                                                                 broken))
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
    broken_token = jnp.any(inside & broken[:, None, :], axis=-1)
    dense = CanonicalArgs(q=args.q, k=gather(args.k_pages), v=gather(args.v_pages),
                          tokens=tokens, softmax_offset=args.softmax_offset)
    return dense, broken_token
