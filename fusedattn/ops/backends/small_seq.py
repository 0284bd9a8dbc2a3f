"""The small-sequence backend: one query token per segment, at most 16 keys.

The case of recommendation and retrieval models cross-attending to a short
history with a huge batch (ROCm TransformerEngine's small-sequence backend).
Kernels: ops_cuda/cuda/small_seq_kernels.cuh (CUDA and HIP), ops_cuda/host/small_seq_host.cc
(platform "cpu"); contract in ops_cuda/include/fusedattn/small_seq.h:

    fusedattn_small_seq_fwd(q, k, v, kv_start, kv_len, seed) -> (o, lse)
    fusedattn_small_seq_bwd(q, k, v, kv_start, kv_len, seed, o, lse, do) -> (dq, dk, dv)
    attributes: scale f32, dropout_rate f64, max_keys i64

Eligibility is static: the query bound (the tighter of
config.sequence.max_seqlen_q and the q extent) must be 1 and the key bound
(max_seqlen_kv vs the kv extent) at most 16. The data must honour the declared
bounds; the guard below checks it on the device, without a host sync:

- each query token's key range is computed from the per-token segment vectors
  (key_ranges), or with one sequence per row from its lengths alone
  (prefix_key_ranges); a segment with more keys than the bound, more than one
  query token, or keys that are not contiguous marks its query "broken" (kv_len = -1);
- the kernels write NaN (never plausible numbers) to a broken query's output
  and dq;
- the call raises ValueError naming the bound when its values are concrete
  (eager use), and reports the same message through
  jax.experimental.checkify when the caller wraps the function with
  checkify.checkify (under jit without checkify, the NaN marks remain);
- where no data can break them (one query token and at most the bound's keys
  per row, with no descriptor or its lengths form) there is no guard, so no
  checkify effect on JAX's dispatch (can_break_bounds).

The forward saves its output and the log-sum-exp of each query head's scores
(lse, float32 [b, sq, h]: 4 bytes beside the 2 * D * (2 + 2 * keys) bytes of
bf16 q, o, k and v rows), so the backward takes each key's weight from its own score,
p_j = exp(s_j - lse), in a single pass over the key and value rows (see
ops_cuda/include/fusedattn/small_seq.h for the measurement).

Both calls go through partitioning.py: jax.vmap folds into the kernel's batch
(the seed reaches the kernels as rows [L, 2]), and under a device mesh the calls
shard over the batch and head axes of q without gathering; with dropout (masks
keyed by global batch and head indices) only per-example seeds let the batch
shard, and the heads stay unsharded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn.ops import _library
from fusedattn.ops.backends import partitioning
from fusedattn.ops.backends.base import CallShapes, CanonicalArgs, TokenInfo, guard
from fusedattn.ops.enums import BiasType, MaskType, SequenceFormat, SoftmaxType
from fusedattn.ops.sequence import segment_occurrences
from fusedattn.ops.spec import AttentionSpec

MAX_KEYS = 16
HEAD_DIMS = (64, 128, 256, 512)
MAX_HEADS_PER_KV_HEAD = 64
FWD_TARGET = "fusedattn_small_seq_fwd"
BWD_TARGET = "fusedattn_small_seq_bwd"


def key_bound(spec: AttentionSpec, seqlen_kv: int) -> int:
    """The static bound on any segment's key count: declared bound vs array extent."""
    return min(spec.max_seqlen_kv or seqlen_kv, seqlen_kv)


def query_bound(spec: AttentionSpec, seqlen_q: int) -> int:
    return min(spec.max_seqlen_q or seqlen_q, seqlen_q)


class SmallSeqBackend:
    name = "small_seq"

    def masked_values_exact(self, spec: AttentionSpec, platform: str) -> bool:
        return True  # keys past a segment's end are never loaded (tests/test_masked_values.py)

    def supports(self, spec: AttentionSpec, shapes: CallShapes, platform: str) -> str | None:
        if spec.mask not in (MaskType.NO_MASK, MaskType.PADDING):
            return (f"small_seq: serves masks 'no_mask' and 'padding' only (one query per segment), "
                    f"got {str(spec.mask)!r}")
        if spec.bias != BiasType.NO_BIAS:
            return f"small_seq: no bias support, got config.bias {str(spec.bias)!r}"
        if spec.softmax != SoftmaxType.VANILLA:
            return f"small_seq: vanilla softmax only, got config.softmax {str(spec.softmax)!r}"
        if spec.window_size != (-1, -1):
            return f"small_seq: no sliding window, got config.window_size {spec.window_size}"
        q_bound = query_bound(spec, shapes.seqlen_q)
        if q_bound != 1:
            return (f"small_seq: needs one query token per segment, but the query bound is "
                    f"{q_bound} (config.sequence.max_seqlen_q={spec.max_seqlen_q}, q length "
                    f"{shapes.seqlen_q}); declare config.sequence.max_seqlen_q = 1")
        kv_bound = key_bound(spec, shapes.seqlen_kv)
        if kv_bound > MAX_KEYS:
            return (f"small_seq: needs at most {MAX_KEYS} keys per segment, but the key bound is "
                    f"{kv_bound} (config.sequence.max_seqlen_kv={spec.max_seqlen_kv}, kv length "
                    f"{shapes.seqlen_kv}); declare config.sequence.max_seqlen_kv <= {MAX_KEYS}")
        if shapes.head_dim_qk != shapes.head_dim_v or shapes.head_dim_qk not in HEAD_DIMS:
            return (f"small_seq: head dims must be equal and one of {HEAD_DIMS}, got "
                    f"q/k {shapes.head_dim_qk} and v {shapes.head_dim_v}")
        group = shapes.num_heads // shapes.num_kv_heads
        if group > MAX_HEADS_PER_KV_HEAD:
            return (f"small_seq: at most {MAX_HEADS_PER_KV_HEAD} query heads per K/V head, "
                    f"got {group}")
        unavailable = _library.available(platform)
        if unavailable is not None:
            return f"small_seq: {unavailable}"
        return None

    def attention(self, spec: AttentionSpec, args: CanonicalArgs, scale: float) -> jax.Array:
        max_keys = key_bound(spec, args.k.shape[1])
        if one_prefix_per_row(args):
            kv_start, kv_len = prefix_key_ranges(args.sequence, args.q.shape[:2], args.k.shape[1],
                                                 max_keys)
        else:
            kv_start, kv_len = key_ranges(args.tokens, max_keys)
        if can_break_bounds(args, max_keys):
            guard(kv_len < 0, _guard_message(spec, max_keys), spec)
        rate = spec.dropout_rate if args.dropout_seed is not None else 0.0
        seed = (jnp.zeros((2,), jnp.uint32) if args.dropout_seed is None
                else args.dropout_seed.astype(jnp.uint32))
        arrays = partitioning.same_varying((args.q, args.k, args.v, kv_start, kv_len, seed))
        return _small_seq(*arrays, float(scale), float(rate), int(max_keys))


def can_break_bounds(args: CanonicalArgs, max_keys: int) -> bool:
    """Whether any data can break the bounds (key_ranges' -1). Not with one query token per
    row, at most max_keys keys per row, and no descriptor or its lengths form (a prefix of
    each row): then the guard, whose checkify effect slows JAX's dispatch, is left out."""
    return not (one_prefix_per_row(args) and args.q.shape[1] == 1 and args.k.shape[1] <= max_keys)


def one_prefix_per_row(args: CanonicalArgs) -> bool:
    """Whether each row holds one sequence, a prefix of it: no descriptor or its lengths form."""
    return args.sequence is None or args.sequence.format == SequenceFormat.SEQLENS


def prefix_key_ranges(sequence, q_shape: tuple[int, int], seqlen_kv: int,
                      max_keys: int) -> tuple[jax.Array, jax.Array]:
    """key_ranges for one sequence per row, a prefix of it (no descriptor, or its lengths
    form): the same kv_len, from the lengths alone, in one elementwise pass instead of
    key_ranges' reductions over every row's segment ids. kv_start is 0 (key_ranges puts
    seqlen_kv there for a query without keys, whose start no kernel reads).

    sequence: None or a SequenceDescriptor with q_seqlens, kv_seqlens [b]; q_shape: (b, sq).
    """
    batch, seqlen_q = q_shape
    if sequence is None:
        q_count, kv_count = jnp.full((batch, 1), seqlen_q), jnp.full((batch, 1), seqlen_kv)
    else:
        q_count = jnp.clip(sequence.q_seqlens, 0, seqlen_q)[:, None]
        kv_count = jnp.clip(sequence.kv_seqlens, 0, seqlen_kv)[:, None]
    is_query = jnp.arange(seqlen_q)[None, :] < q_count
    broken = is_query & ((kv_count > max_keys) | (q_count > 1))
    kv_len = jnp.where(broken, -1, jnp.where(is_query, kv_count, 0))
    return jnp.zeros((batch, seqlen_q), jnp.int32), kv_len.astype(jnp.int32)


def key_ranges(tokens: TokenInfo, max_keys: int) -> tuple[jax.Array, jax.Array]:
    """Each query token's keys as (kv_start, kv_len), int32 [b, sq].

    kv_len is 0 for a padding query and -1 for a query whose segment breaks the
    bounds (more than max_keys keys, more than one query token, keys not
    contiguous in the row).
    """
    q_seg, kv_seg = tokens.q_seg, tokens.kv_seg
    kv_count, kv_first, kv_last = jax.vmap(segment_occurrences)(q_seg, kv_seg)
    q_count, _, _ = jax.vmap(segment_occurrences)(q_seg, q_seg)
    is_query = q_seg != 0
    contiguous = (kv_count == 0) | (kv_last - kv_first + 1 == kv_count)
    broken = is_query & ((kv_count > max_keys) | (q_count > 1) | ~contiguous)
    kv_len = jnp.where(broken, -1, jnp.where(is_query, kv_count, 0))
    return jnp.where(is_query, kv_first, 0).astype(jnp.int32), kv_len.astype(jnp.int32)


def _guard_message(spec: AttentionSpec, max_keys: int) -> str:
    return (f"small_seq: the data breaks the declared sequence bounds: a segment has more than "
            f"{max_keys} keys (config.sequence.max_seqlen_kv={spec.max_seqlen_kv}), more than "
            f"one query token (config.sequence.max_seqlen_q={spec.max_seqlen_q}), or keys that "
            "are not contiguous in their row. Its outputs are NaN. Raise the bounds to fit the "
            "data, or use backend='xla'.")


def _attributes(scale, rate, max_keys) -> dict:
    return dict(scale=np.float32(scale), dropout_rate=np.float64(rate),
                max_keys=np.int64(max_keys))


def _forward(static, q, k, v, *operands):
    return jax.ffi.ffi_call(
        FWD_TARGET,
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32)))(
            q, k, v, *operands, **_attributes(*static))


def _backward(static, q, k, v, *operands):
    return jax.ffi.ffi_call(
        BWD_TARGET,
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
         jax.ShapeDtypeStruct(v.shape, v.dtype)))(q, k, v, *operands, **_attributes(*static))


# q, k, v, kv_start, kv_len, then the per-row seed [L, 2].
_OPERANDS = ("b.h.", "b.g.", "b.g.", "b.", "b.", "r.")
_SEED = 5


@functools.lru_cache(maxsize=None)
def _op(scale: float, rate: float, max_keys: int, backward: bool):
    """The FFI call of one direction, sharded over batch and heads, folded under vmap."""
    operands, results = ((_OPERANDS + ("b.h.", "b.h", "b.h."), ("b.h.", "b.g.", "b.g."))
                         if backward else (_OPERANDS, ("b.h.", "b.h")))
    signature = partitioning.Signature(operands, results, dropout=rate > 0, dropout_rows=_SEED)
    return partitioning.op(
        functools.partial(_backward if backward else _forward, (scale, rate, max_keys)), signature)


def _forward_call(q, k, v, kv_start, kv_len, seed, scale, rate, max_keys):
    """(o [b, sq, h, d], lse float32 [b, sq, h])."""
    return _op(scale, rate, max_keys, False)(q, k, v, kv_start, kv_len, seed[None])


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _small_seq(q, k, v, kv_start, kv_len, seed, scale, rate, max_keys):
    o, _ = _forward_call(q, k, v, kv_start, kv_len, seed, scale, rate, max_keys)
    return o


def _small_seq_fwd(q, k, v, kv_start, kv_len, seed, scale, rate, max_keys):
    o, lse = _forward_call(q, k, v, kv_start, kv_len, seed, scale, rate, max_keys)
    return o, (q, k, v, kv_start, kv_len, seed, o, lse)


def _small_seq_bwd(scale, rate, max_keys, residuals, do):
    q, k, v, kv_start, kv_len, seed, o, lse = residuals
    dq, dk, dv = _op(scale, rate, max_keys, True)(q, k, v, kv_start, kv_len, seed[None], o, lse,
                                                  do.astype(o.dtype))
    return dq, dk, dv, None, None, None


_small_seq.defvjp(_small_seq_fwd, _small_seq_bwd)

BACKEND = SmallSeqBackend()
