"""The cuDNN op: a jax.custom_vjp over the two FFI calls (ffi_calls.py).

The primal (nobody differentiates) runs the forward without stats; the forward rule
saves what the backward call needs and learns from symbolic zeros which backward
results nobody reads. Around the calls, query rows without a visible key get zeros
and zero gradients (cuDNN leaves them unset), rows the descriptor breaks get NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from fusedattn.ops.backends.cudnn.ffi_calls import _DBIAS, _DSINK, _folding_op
from fusedattn.ops.backends.cudnn.graph_key import _Static
from fusedattn.ops.backends.cudnn.segments import _Segments
from fusedattn.ops.backends.unread import Unread, values


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
    unread = Unread.of(((_DBIAS, bias), (_DSINK, sink)))
    q, k, v, bias, rng, sink, segments = values((q, k, v, bias, rng, sink, segments))
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
