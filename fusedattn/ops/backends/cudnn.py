"""The "cudnn" backend: cuDNN's fused SDPA through the cuDNN frontend graph API.

Kernels: ops_cuda/cudnn/cudnn_sdpa.cc, built into libfusedattn_cudnn, which
cudnn_library.py loads (with libcudnn) and asks about graphs. Two XLA FFI calls
around a `jax.custom_vjp`:

    fusedattn_cudnn_fwd(q, k, v, bias, seqlen_q, seqlen_kv, offsets, rng, sink) -> (o, stats)
    fusedattn_cudnn_bwd(q, k, v, bias, seqlen_q, seqlen_kv, offsets, rng, sink, o, stats, do)
        -> (dq, dk, dv, dbias, dsink)

q/k/v are the canonical [b, s, h, d] arrays, read by cuDNN as strided
[b, h, s, d] views (no transposes); stats is cuDNN's float32 log-sum-exp
[b', h, sq', 1], saved for the backward. A call nobody differentiates (the
custom_vjp's primal) runs the forward with the attribute training=false: cuDNN's
inference graph, without stats (its stats result is a float32 [0] placeholder,
dropped at once), which lets cuDNN pick another engine, as JAX's own cuDNN
attention does; the forward rule of a differentiated call passes training=true.
On ragged rows the two forwards take the same time (benchmarks/probes/cudnn_thd_parts.py,
H200: 0.107 against 0.103 ms at b=4, s=2048; 0.288 against 0.286 at b=1, s=8192).
Graphs are built once per static configuration and device and cached in the
library; `supports` builds them (the training forward and the backward) at trace
time, so a configuration cuDNN cannot run is rejected with cuDNN's own reason
and "auto" moves on to flash or xla. Each FFI call's graph is also built when the
call is traced, to size its workspace (a uint8 result XLA allocates: the handlers
allocate nothing, so XLA may record them into its command buffers); where cuDNN
cannot build the inference forward, that call runs the training forward.

What it serves (everything else is rejected by `supports` with the reason):

- every layout (THD through cuDNN's ragged offsets), bf16/fp16, head dims
  multiples of 8 up to 128 (256 on Hopper), GQA/MQA;
- all six masks. Padding and packing: cuDNN runs one batch entry per segment
  slot (config.sequence.max_segments_per_seq per row) with per-slot lengths and,
  unless the descriptor is the one-sequence-per-row seqlens form, ragged element
  offsets. The lengths forms of the descriptor give the slots directly; segment
  ids are paired into slots by id. Declared max_seqlen_q/kv bound cuDNN's work;
  a row that breaks the configuration (too many segments, a segment over a bound,
  ...) raises eagerly or reports through checkify, and its outputs are NaN
  (`base.guard`). Query rows with no visible key output zeros and get zero
  gradients (masked here: cuDNN leaves them unset);
- sliding windows (window_size, inclusive, from the mask's diagonal);
- post-scale bias [b|1, h|1, sq, skv] with its gradient, and pre-scale bias
  as the post-scale bias `bias * scale`, also under padding masks of the seqlens
  form (one sequence per row: the bias indexes its positions), not with packed
  segments;
- ALiBi under masks "causal" and "padding_causal" (cuDNN adds slope_h * (j - i)
  below the top-left diagonal, its slopes the standard ones of the query heads,
  which the xla backend also draws), dense, padded and packed; not with given
  slopes (`bias`), and the heads do not shard under a mesh;
- softmax "off_by_one" and "learnable" through cuDNN's sink token (cuDNN >= 9.13),
  with the offset's gradient;
- dropout with cuDNN's own Philox generator: seed = the dropout key's two
  words as one int64, offset 0. The mask is NOT the one of the shared Philox
  dropout (fusedattn/ops/philox.py) that the xla and flash backends draw, so
  dropout outputs match the other backends only in distribution; the same key
  gives the same mask (forward and backward agree, runs repeat, and the forward
  without stats keeps cuDNN's composite implementation, that of the training
  forward, so a call nobody differentiates draws it too);
- deterministic backward (config.deterministic_backward) through cuDNN's
  deterministic algorithm.

Under jax.vmap the mapped axis folds into the batch (one cuDNN call); a vmap
over dropout keys or softmax offsets runs one call per example instead, since
cuDNN takes one seed and one offset row per call. cuDNN sums dsink and the dbias
of a bias shared by the batch over the whole call, so a vmapped backward (of
jax.vmap(jax.grad(f)) or of jax.grad(jax.vmap(f)): its vmap rule cannot tell them
apart) makes them per example when they are differentiated: dsink from the
forward's statistics beside the call, dbias by broadcasting the shared bias over
the folded rows in the backward call (still one call; the bias and its gradient
then take examples x rows times the memory). Under a device mesh the calls
shard over the batch and head axes of q without gathering; dsink and the dbias
of a shared bias, which cuDNN sums inside the call, are psummed over the sharded
axes. With dropout the batch and heads stay unsharded (gathered): a shard
cannot draw the unsharded call's mask from cuDNN's generator. Both through the
shared mechanism of partitioning.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from fusedattn.ops.backends import cudnn_library, partitioning
from fusedattn.ops.backends.base import (CallShapes, CanonicalArgs, TokenInfo, compute_capability,
                                         guard)
from fusedattn.ops.enums import BiasType, MaskType, SequenceFormat, SoftmaxType
from fusedattn.ops.sequence import segment_runs
from fusedattn.ops.spec import AttentionSpec

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# Operands the FFI handlers do not read in a call's configuration (the lengths and
# offsets without segments or ragged offsets, rng without dropout, sink without a
# softmax offset; the handlers check their shapes only when they read them) are numpy
# scalars: they lower to constants, where zero-filled arrays (jnp.zeros) lower to
# broadcasts that XLA does not constant-fold: it keeps them as fusions run on every
# call, a fixed cost that shows on short calls. Scalars, not [n] splats, because
# XLA turns a constant of more than one equal element back into a broadcast.
# The unused bias stays [1, 1, 1, 1] (one element: a constant too), as the batch
# folding under vmap reads its leading dim.
_UNREAD_INT32 = np.zeros((), np.int32)
_UNREAD_UINT32 = np.zeros((), np.uint32)
_UNREAD_FLOAT32 = np.zeros((), np.float32)


def _device() -> jax.Device:
    return jax.devices()[0]


_compute_capability = compute_capability  # a module name of its own: tests stand in for it


def _graph_params(static: _Static, b: int, h: int, hkv: int, sq: int, skv: int, d: int, dv: int,
                  dtype, bias_b: int, bias_h: int) -> tuple[int, ...]:
    """The library's graph parameters of a call (FusedattnCudnnCheck's order): what its
    handlers read off the operands and attributes."""
    return (b, h, hkv, sq, skv, d, dv, int(jnp.dtype(dtype) == jnp.bfloat16), int(static.causal),
            int(static.bottom_right), static.window_left, static.window_right, static.segments,
            int(static.ragged), static.max_seqlen_q or sq, static.max_seqlen_kv or skv,
            bias_b if static.has_bias else 0, bias_h if static.has_bias else 0,
            int(static.has_sink), int(static.alibi), int(static.deterministic))


def _workspace(static: _Static, q, k, v, bias, backward: bool, training: bool = True):
    """The uint8 workspace result of one FFI call: XLA allocates it, so the handlers allocate
    nothing and may run inside XLA's command buffers (CUDA graphs)."""
    b, sq, h, d = q.shape
    _, skv, hkv, dv = v.shape
    size = 0
    if b and sq and skv and h:  # the handlers run nothing on empty calls
        params = _graph_params(static, b, h, hkv, sq, skv, d, dv, q.dtype, *bias.shape[:2])
        size = cudnn_library.workspace_bytes(params, static.scale, static.dropout_rate,
                                             not training, backward, _device_ordinal())
    return jax.ShapeDtypeStruct((size,), jnp.uint8)


# ---- the static configuration of a call ---------------------------------------------

class _Static(NamedTuple):
    """The attributes of both FFI calls (hashable: a nondiff argument).

    segments: 0 without a padding mask or packing (one dense sequence per row);
    else cuDNN runs one batch entry per segment slot, `segments` slots per row.
    ragged: segments may start anywhere in their row (cuDNN's ragged offsets);
    without it each row holds one segment from its first token (the seqlens form).
    max_seqlen_q / max_seqlen_kv: with ragged, the declared bounds on a segment's
    length when tighter than the row (0: the row); cuDNN's work scales with them.
    alibi: cuDNN adds ALiBi, -slope_h * (query position - key position), with the
    standard slopes of the call's query heads (so the heads never shard).
    """

    scale: float
    dropout_rate: float
    causal: bool
    bottom_right: bool
    window_left: int
    window_right: int
    segments: int
    ragged: bool
    max_seqlen_q: int
    max_seqlen_kv: int
    has_bias: bool
    has_sink: bool
    alibi: bool
    deterministic: bool

    def attributes(self, training: bool = True) -> dict:
        """The FFI attributes; training=False (the forward only) builds cuDNN's graph
        without stats."""
        return dict(scale=np.float32(self.scale), dropout_rate=np.float32(self.dropout_rate),
                    causal=bool(self.causal), bottom_right=bool(self.bottom_right),
                    window_left=np.int64(self.window_left),
                    window_right=np.int64(self.window_right), segments=np.int64(self.segments),
                    ragged=bool(self.ragged), max_seqlen_q=np.int64(self.max_seqlen_q),
                    max_seqlen_kv=np.int64(self.max_seqlen_kv), has_bias=bool(self.has_bias),
                    has_sink=bool(self.has_sink), alibi=bool(self.alibi),
                    deterministic=bool(self.deterministic),
                    training=bool(training))

    @property
    def batch_per_row(self) -> int:
        """cuDNN batch entries (and rows of stats) per row of q."""
        return max(self.segments, 1)


def _static(spec: AttentionSpec, scale: float, dropout: bool, has_bias: bool, seqlen_q: int,
            seqlen_kv: int) -> _Static:
    seqlens = spec.sequence_format == SequenceFormat.SEQLENS
    ragged = spec.uses_segments and not seqlens

    def bound(declared, extent):
        return declared if ragged and declared and declared < extent else 0

    return _Static(
        scale=float(scale),
        dropout_rate=float(spec.dropout_rate) if dropout else 0.0,
        causal=spec.mask.is_causal,
        bottom_right=spec.mask.is_bottom_right,
        window_left=int(spec.window_size[0]),
        window_right=int(spec.window_size[1]),
        segments=(1 if seqlens else spec.max_segments_per_seq) if spec.uses_segments else 0,
        ragged=ragged,
        max_seqlen_q=bound(spec.max_seqlen_q, seqlen_q),
        max_seqlen_kv=bound(spec.max_seqlen_kv, seqlen_kv),
        has_bias=has_bias,
        has_sink=spec.softmax != SoftmaxType.VANILLA,
        alibi=spec.bias == BiasType.ALIBI,
        deterministic=spec.deterministic_backward,
    )


def _default_scale(spec: AttentionSpec, head_dim: int) -> float:
    return spec.scale if spec.scale is not None else 1.0 / math.sqrt(head_dim)


# ---- segments: from the descriptor to cuDNN's per-slot lengths and offsets ----------

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


def _lengths_and_offsets(static: _Static, slots, q_shape, k_shape, v_shape):
    """cuDNN's int32 seqlen_q, seqlen_kv [B'] and element offsets [4, B' + 1] (q, o, k, v)."""
    b, sq, h, d = q_shape
    _, skv, h_kv, _ = k_shape
    dv = v_shape[3]
    if not static.segments:
        return _UNREAD_INT32, _UNREAD_INT32, _UNREAD_INT32
    q_start, q_len, kv_start, kv_len = (slots[:, i] for i in range(4))
    if not static.ragged:
        return q_len.reshape(-1), kv_len.reshape(-1), _UNREAD_INT32
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    q_token = (rows * sq + q_start).reshape(-1)
    kv_token = (rows * skv + kv_start).reshape(-1)

    def offsets(tokens, total_tokens, width):
        return jnp.concatenate([tokens, jnp.full((1,), total_tokens, jnp.int32)]) * width

    return q_len.reshape(-1), kv_len.reshape(-1), jnp.stack([
        offsets(q_token, b * sq, h * d), offsets(q_token, b * sq, h * dv),
        offsets(kv_token, b * skv, h_kv * d), offsets(kv_token, b * skv, h_kv * dv)])


# ---- the FFI calls, sharded and folded under vmap ----------------------------------

def _forward_ffi(static: _Static, q, k, v, bias, slots, rng, sink, training=True):
    """(o, stats) of the training forward; (o,) with training=False, the forward without
    stats, whose stats result (the FFI call's results are fixed) is a float32 [0] placeholder
    dropped here, so that sharding and vmap folding never see it."""
    b, sq, h, _ = q.shape
    seqlen_q, seqlen_kv, offsets = _lengths_and_offsets(static, slots, q.shape, k.shape, v.shape)
    stats_shape = (b * static.batch_per_row, h, static.max_seqlen_q or sq, 1) if training else (0,)
    o, stats, _ = jax.ffi.ffi_call(
        cudnn_library.FWD_TARGET,
        (jax.ShapeDtypeStruct((b, sq, h, v.shape[-1]), q.dtype),
         jax.ShapeDtypeStruct(stats_shape, jnp.float32),
         _workspace(static, q, k, v, bias, backward=False, training=training)),
    )(q, k, v, bias, seqlen_q, seqlen_kv, offsets, rng, sink, **static.attributes(training))
    return (o, stats) if training else (o,)


def _backward_ffi(static: _Static, q, k, v, bias, slots, rng, sink, o, stats, do):
    seqlen_q, seqlen_kv, offsets = _lengths_and_offsets(static, slots, q.shape, k.shape, v.shape)
    return jax.ffi.ffi_call(
        cudnn_library.BWD_TARGET,
        (jax.ShapeDtypeStruct(q.shape, q.dtype),
         jax.ShapeDtypeStruct(k.shape, k.dtype),
         jax.ShapeDtypeStruct(v.shape, v.dtype),
         jax.ShapeDtypeStruct(bias.shape, bias.dtype),
         jax.ShapeDtypeStruct(sink.shape, jnp.float32),
         _workspace(static, q, k, v, bias, backward=True)),
    )(q, k, v, bias, seqlen_q, seqlen_kv, offsets, rng, sink, o, stats, do,
      **static.attributes())[:5]


def _sink_gradient_rows(static: _Static, sink, slots, o, stats, do) -> jax.Array:
    """dsink's terms per row of q: float32 [b, h], whose sum over the rows is cuDNN's dsink.

    sink [h]; slots int32 [b, 4, M]; o, do [b, sq, h, dv]; stats float32
    [b * M', h, sq', 1] (M' = static.batch_per_row). The sink's weight in query row q
    is exp(sink_h - lse_q), lse being cuDNN's stats: the natural-log log-sum-exp of the
    row's scaled (and biased) scores and the sink. So, as for every softmax input,
    dL/dsink_h = -sum_q exp(sink_h - lse_q) * rowsum(dO * O)_q. With segments, stats
    row i of slot j is token q_start_j + i of its row (i < q_len_j); without, token i.
    """
    b, sq, h, _ = o.shape
    positions = stats.shape[2]
    lse = jnp.swapaxes(stats[..., 0].reshape(b, static.batch_per_row, h, positions), 2, 3)
    delta = jnp.einsum("bqhd,bqhd->bqh", do.astype(jnp.float32), o.astype(jnp.float32))
    if static.segments:
        position = jnp.arange(positions, dtype=jnp.int32)
        token = jnp.clip(slots[:, 0, :, None] + position, 0, sq - 1)  # [b, M, sq']
        delta = jnp.take_along_axis(delta, token.reshape(b, -1, 1), axis=1).reshape(lse.shape)
        delta = jnp.where((position < slots[:, 1, :, None])[..., None], delta, 0.0)
    else:
        delta = delta[:, None]
    # A row whose dO . O is zero (no visible key, or past its slot's length) adds
    # nothing, whatever statistic cuDNN left there (possibly unset).
    terms = jnp.where(delta != 0, jnp.exp(sink - lse) * delta, 0.0)
    return -jnp.sum(terms, axis=(1, 2))


# q, k, v, bias [b|1, h|1, sq, skv], slots, then the per-call rng and softmax offset row.
_OPERANDS = ("b.h.", "b.g.", "b.g.", "BH..", "b..", ".", "h")
_DBIAS, _DSINK = 3, 4  # results of the backward call


@functools.lru_cache(maxsize=None)
def _folding_op(static: _Static, backward: bool, unread: frozenset[int] = frozenset(),
                training: bool = True):
    """The FFI call of one direction, sharded over batch and heads, folded under vmap.

    The forward returns (o, stats), or (o,) with training=False (`_forward_ffi`).

    The shared mechanism of fusedattn/ops/backends/partitioning.py. Under jax.vmap,
    row-wise operands (q, k, v, slots, o, stats, do and a bias with a batch axis) are
    broadcast where unmapped and reshaped [n, b, ...] -> [n * b, ...]; the segment
    offsets are computed after folding (inside the call), so they index the folded
    arrays. cuDNN takes one dropout seed and one row of softmax offsets per call, so
    when either is mapped the rule runs one call per mapped example (jax.lax.map):
    exact, but sequential. cuDNN sums dsink, and the dbias of a bias shared by the
    batch, over the whole call; a vmapped backward needs them per example (the vmap
    rule cannot tell jax.vmap(jax.grad(f)) from jax.grad(jax.vmap(f)), which sums
    them afterwards). dsink comes per example from `_sink_gradient_rows`, one cheap
    pass over o and do beside the call; a shared bias is broadcast over the folded rows
    in the backward call, so dbias comes per row and is summed per example: still one
    call, but the bias and dbias take (examples x rows) times their shared memory.
    Both only for a differentiated bias or offset (`unread`: backward results of
    operands not differentiated, which stay cuDNN's sums). Under a mesh each device
    runs the call on its batch and head shard; dsink (and dbias of a bias shared over
    the batch or heads), which cuDNN sums inside the call, are psummed over the
    sharded axes. A shard cannot draw the unsharded call's dropout mask from cuDNN's
    generator, so with dropout the batch and heads stay unsharded (gathered).
    """
    signature = _signature(static, backward, unread, training)
    if not backward:
        return partitioning.op(functools.partial(_forward_ffi, static, training=training),
                               signature)

    def sink_rows(q, k, v, bias, slots, rng, sink, o, stats, do):
        return (_sink_gradient_rows(static, sink, slots, o, stats, do),)

    return partitioning.op(functools.partial(_backward_ffi, static), signature, sink_rows)


def _signature(static: _Static, backward: bool, unread: frozenset[int] = frozenset(),
               training: bool = True) -> partitioning.Signature:
    dropout = static.dropout_rate > 0
    if backward:
        return partitioning.Signature(
            _OPERANDS + ("b.h.", "bh..", "b.h."), ("b.h.", "b.g.", "b.g.", "BH..", "h"),
            batch_sums=frozenset({_DSINK}), dropout=dropout, unread=unread,
            whole_heads=static.alibi)
    return partitioning.Signature(_OPERANDS, ("b.h.", "bh..") if training else ("b.h.",),
                                  dropout=dropout, whole_heads=static.alibi)


# ---- the op --------------------------------------------------------------------------

@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Unread:
    """Backward results no one reads: dbias / dsink of a bias / offset not differentiated.

    Static (a pytree without leaves): the forward rule learns it from symbolic zeros and
    hands it to the backward rule in the residuals.
    """

    results: frozenset[int]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cudnn(static: _Static, q, k, v, bias, rng, sink, segments: _Segments | None):
    """The primal, run when nobody differentiates the call: the forward without stats."""
    return _forward(static, q, k, v, bias, rng, sink, segments, training=False)[0]


def _forward(static: _Static, q, k, v, bias, rng, sink, segments: _Segments | None,
             training: bool = True):
    """(o, slots, stats) of the forward call; o masked where segments say. With
    training=False cuDNN runs its graph without stats (the same dropout mask), and stats is
    None."""
    slots = segments.slots if segments else np.zeros((q.shape[0], 4, 1), np.int32)  # unread
    o, *stats = _folding_op(static, False, training=training)(q, k, v, bias, slots, rng, sink)
    if segments:
        o = _mask_rows(o, segments.q_keys, segments.broken)
    return o, slots, stats[0] if training else None


def _cudnn_fwd(static: _Static, q, k, v, bias, rng, sink, segments):
    """The forward rule under symbolic_zeros: each array comes as a CustomVJPPrimal (its
    value, and whether it is differentiated)."""
    unread = _Unread(frozenset(index for index, primal in ((_DBIAS, bias), (_DSINK, sink))
                               if not primal.perturbed))
    q, k, v, bias, rng, sink, segments = jax.tree.map(
        lambda primal: primal.value, (q, k, v, bias, rng, sink, segments),
        is_leaf=lambda x: isinstance(x, CustomVJPPrimal))
    o, slots, stats = _forward(static, q, k, v, bias, rng, sink, segments)
    return o, (q, k, v, bias, rng, sink, segments, slots, o, stats, unread)


def _cudnn_bwd(static: _Static, residuals, do):
    if isinstance(do, SymbolicZero):  # symbolic_zeros: a cotangent known to be zero
        return (None,) * 7
    q, k, v, bias, rng, sink, segments, slots, o, stats, unread = residuals
    do = do.astype(o.dtype)
    if segments:
        # Rows without keys contribute nothing whatever cuDNN left in their statistics.
        do = _mask_rows(do, segments.q_keys, None)
    dq, dk, dv, dbias, dsink = _folding_op(static, True, unread.results)(
        q, k, v, bias, slots, rng, sink, o, stats, do)
    if segments:
        dq = _mask_rows(dq, segments.q_keys, segments.broken)
        dk = _mask_rows(dk, segments.kv_used, segments.broken)
        dv = _mask_rows(dv, segments.kv_used, segments.broken)
    if not static.has_bias:
        dbias = jnp.zeros_like(bias)
    if not static.has_sink:
        dsink = jnp.zeros_like(sink)
    return dq, dk, dv, dbias, None, dsink, None


_cudnn.defvjp(_cudnn_fwd, _cudnn_bwd, symbolic_zeros=True)


def _mask_rows(x, keep, broken):
    """x [b, s, h, d]: zero where not `keep` [b, s]; NaN over rows `broken` [b] (if not None)."""
    x = jnp.where(keep[:, :, None, None], x, jnp.zeros((), x.dtype))
    if broken is None:
        return x
    return jnp.where(broken[:, None, None, None], jnp.full((), jnp.nan, x.dtype), x)


def _guard_message(spec: AttentionSpec, static: _Static) -> str:
    layout = ("each row packs its segments one after another" if static.ragged else
              "each row holds one segment from its first token (the seqlens form)")
    return (f"cudnn: the sequence descriptor breaks what the cuDNN backend was configured for: "
            f"{layout}, at most config.sequence.max_segments_per_seq="
            f"{spec.max_segments_per_seq} segments per row, each at most "
            f"config.sequence.max_seqlen_q={spec.max_seqlen_q} query and max_seqlen_kv="
            f"{spec.max_seqlen_kv} key tokens long, a contiguous run of tokens with positions "
            "0, 1, ..., and one run per segment id. The broken rows' outputs are NaN. Raise the "
            "bounds to fit the data, or use backend='xla'.")


class CudnnBackend:
    name = "cudnn"

    def supports(self, spec: AttentionSpec, shapes: CallShapes | None, platform: str) -> str | None:
        platform = (platform or "").lower()
        if platform not in ("cuda", "gpu"):
            return f"cudnn: needs a CUDA GPU; this computation runs on {platform}"
        if spec.bias == BiasType.ALIBI:
            reason = _alibi_reason(spec, shapes is not None and shapes.alibi_slopes)
            if reason is not None:
                return reason
        elif (spec.uses_segments and spec.sequence_format != SequenceFormat.SEQLENS
              and spec.bias != BiasType.NO_BIAS):
            return (f"cudnn: packed segments (segment ids, offsets) with config.bias "
                    f"{str(spec.bias)!r} are not served (cuDNN's bias is not defined per "
                    "segment); the seqlens form (one sequence per row) is")
        if shapes is not None:
            dtype = jnp.dtype(shapes.dtype)
            if dtype not in _DTYPES:
                return (f"cudnn: needs bfloat16 or float16 inputs, got {dtype.name}; cast them, "
                        "or use backend 'flash' or 'xla'")
            for name, dim in (("q/k", shapes.head_dim_qk), ("v", shapes.head_dim_v)):
                if dim % 8 or dim > 256:
                    return (f"cudnn: the {name} head dim must be a multiple of 8 and at most 256 "
                            f"(128 before Hopper), got {dim}")
            if shapes.seqlen_q < 1 or shapes.seqlen_kv < 1:
                return "cudnn: empty sequences"
            widest = max(shapes.seqlen_q * shapes.num_heads, shapes.seqlen_kv * shapes.num_kv_heads)
            elements = shapes.batch * widest * max(shapes.head_dim_qk, shapes.head_dim_v)
            ragged = spec.uses_segments and spec.sequence_format != SequenceFormat.SEQLENS
            if ragged and elements >= 2 ** 31:
                return (f"cudnn: packed segments are addressed by int32 element offsets, but an "
                        f"operand has {elements} elements; split the batch")
        reason = cudnn_library.available()
        if reason is not None:
            return f"cudnn: {reason}"
        major, minor = _compute_capability()
        if major < 8:
            return (f"cudnn: fused attention needs compute capability 8.0 or newer, this GPU has "
                    f"{major}.{minor}")
        if shapes is None:
            return None
        dropout = shapes.dropout and spec.dropout_rate > 0
        static = _static(spec, _default_scale(spec, shapes.head_dim_qk), dropout,
                         shapes.has_bias_array, shapes.seqlen_q, shapes.seqlen_kv)
        bias_b, bias_h = shapes.bias_shape[:2] if shapes.has_bias_array else (0, 0)
        params = _graph_params(static, shapes.batch, shapes.num_heads, shapes.num_kv_heads,
                               shapes.seqlen_q, shapes.seqlen_kv, shapes.head_dim_qk,
                               shapes.head_dim_v, shapes.dtype, bias_b, bias_h)
        why = cudnn_library.check(params, static.scale, static.dropout_rate, _device_ordinal())
        if why is not None:
            version = cudnn_library.version_string(cudnn_library.cudnn_version())
            return (f"cudnn: cuDNN {version} on compute capability "
                    f"{major}.{minor} cannot run this call: {why}")
        return None

    def attention(self, spec: AttentionSpec, args: CanonicalArgs, scale: float) -> jax.Array:
        reason = cudnn_library.available()
        if reason is not None:
            raise RuntimeError(f"cudnn: {reason}")
        q, k, v = (jnp.asarray(x) for x in (args.q, args.k, args.v))
        if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"cudnn: q, k and v must share one dtype, bfloat16 or float16; got "
                             f"{q.dtype}, {k.dtype} and {v.dtype}. Cast them, or use backend='xla'.")
        h = q.shape[2]
        if spec.bias in (BiasType.PRE_SCALE_BIAS, BiasType.POST_SCALE_BIAS):
            if args.bias is None:
                raise ValueError(f"bias: config.bias {str(spec.bias)!r} needs a bias array")
            bias = jnp.asarray(args.bias)
            if spec.bias == BiasType.PRE_SCALE_BIAS:  # (s + bias) * scale = s * scale + bias * scale
                bias = bias.astype(jnp.float32) * jnp.float32(scale)
            bias = bias.astype(q.dtype)
            has_bias = True
        else:  # no bias, or ALiBi, which cuDNN derives from the head count and positions
            reason = _alibi_reason(spec, args.bias is not None)
            if reason is not None:
                raise ValueError(f"{reason}.")
            bias, has_bias = np.zeros((1, 1, 1, 1), q.dtype), False  # unread (see _UNREAD_INT32)
        dropout = args.dropout_seed is not None and spec.dropout_rate > 0
        if dropout:
            seed = jnp.asarray(args.dropout_seed).astype(jnp.uint32).reshape(2)
            rng = jnp.concatenate([seed, jnp.zeros((2,), jnp.uint32)])  # int64 seed, offset 0
        else:
            rng = _UNREAD_UINT32
        if spec.softmax != SoftmaxType.VANILLA:
            if args.softmax_offset is None:
                raise ValueError(f"softmax_offset: config.softmax {str(spec.softmax)!r} needs a "
                                 f"float32 array of shape [h] = ({h},)")
            sink = jnp.asarray(args.softmax_offset, jnp.float32).reshape(h)
        else:
            sink = _UNREAD_FLOAT32
        static = _static(spec, scale, dropout, has_bias, q.shape[1], k.shape[1])
        segments = None
        if static.segments:
            segments = _segments(static, args)
            if segments.broken is not None:
                guard(segments.broken, _guard_message(spec, static), spec)
        return _cudnn(static, *partitioning.same_varying((q, k, v, bias, rng, sink, segments)))


def _alibi_reason(spec: AttentionSpec, slopes_given: bool) -> str | None:
    """Why cuDNN cannot serve this ALiBi call (None: it can, or the call has no ALiBi).

    cuDNN adds ALiBi only under a top-left causal mask (where |i - j| = i - j) and only
    with the standard slopes of the query heads (the ALiBi paper's, as the XLA backend's).
    """
    if spec.bias != BiasType.ALIBI:
        return None
    if slopes_given:
        return ("cudnn: ALiBi with given slopes is not served (cuDNN derives the standard "
                "slopes from the head count); pass no slopes, or use backend 'xla'")
    if spec.mask not in (MaskType.CAUSAL, MaskType.PADDING_CAUSAL):
        return (f"cudnn: ALiBi is served under masks 'causal' and 'padding_causal' only "
                f"(cuDNN adds it below a top-left diagonal), got {str(spec.mask)!r}; use "
                "backend 'xla'")
    return None


def _device_ordinal() -> int:
    device = _device()
    ordinal = getattr(device, "local_hardware_id", None)
    return int(ordinal) if ordinal is not None else int(device.id)


BACKEND = CudnnBackend()
