"""The cuDNN backend's two FFI calls, sharded over batch and heads and folded under vmap.

    fusedattn_cudnn_fwd(q, k, v, bias, seqlen_q, seqlen_kv, offsets, rng, sink) -> (o, stats)
    fusedattn_cudnn_bwd(q, k, v, bias, seqlen_q, seqlen_kv, offsets, rng, sink, o, stats, do)
        -> (dq, dk, dv, dbias, dsink)

Also their operands: cuDNN's per-entry lengths and ragged element offsets from the
slot table (segments.py), the workspace result XLA allocates, the constants of the
operands a configuration does not read, and the per-example dsink a vmapped backward
needs. _folding_op wraps each call in the shared mechanism of partitioning.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn.ops.backends import partitioning
from fusedattn.ops.backends.cudnn import library as cudnn_library
from fusedattn.ops.backends.cudnn.graph_key import _device_ordinal, _graph_params, _Static


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
