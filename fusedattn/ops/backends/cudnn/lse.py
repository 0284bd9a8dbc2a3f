"""The cuDNN backend's log-sum-exp block entry points, for context parallelism
(fusedattn/ops/context_parallel/): the contracts of flash.py's and xla.py's.

    attention_with_lse(spec, args, scale) -> o [b, sq, h, dv] (q's dtype), lse f32 [b, h, sq]
    attention_backward_from_lse(spec, args, scale, out, lse, d_out) -> (dq, dk, dv, None)

cuDNN reads no per-token positions (args.tokens is not read), so a block's mask is the
call's own: "no_mask" (a chunk pair wholly visible) or top-left "causal" (a pair on the
diagonal, chunks of one length). Context parallelism picks it per chunk pair
(context_parallel/blocks.py, _pair_call) and calls no pair that sees nothing; under
these masks every query sees at least its block's first key, so no lse is -inf. Vanilla
softmax (a sink joins after the merge), no bias, no dropout (plan.verdict refuses them).

The forward is cuDNN's training forward: its stats are the natural-log log-sum-exp of
the scaled scores, float32 [b, h, sq, 1] (ops_cuda/cudnn/cudnn_sdpa.cc), the lse here
without its last axis. The backward is cuDNN's, fed the whole attention's output and
log-sum-exp for o and stats: with P = exp(s - lse) the block's weights in the whole
softmax, cuDNN's dS = P (dO v^T - rowsum(dO * O)) is this block's share of the
gradients, as in flash's and xla's entry points.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn.ops.backends.base import CanonicalArgs
from fusedattn.ops.backends.cudnn.ffi_calls import (_DBIAS, _DSINK, _UNREAD_FLOAT32,
                                                    _UNREAD_UINT32, _folding_op)
from fusedattn.ops.backends.cudnn.graph_key import _static, _Static
from fusedattn.ops.backends.cudnn.vjp import _forward
from fusedattn.ops.enums import BiasType, MaskType
from fusedattn.ops.spec import AttentionSpec

_BLOCK_MASKS = (MaskType.NO_MASK, MaskType.CAUSAL)
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _block_static(spec: AttentionSpec, args: CanonicalArgs, scale: float) -> _Static:
    """The FFI attributes of a block call: the spec's mask, no bias, sink or dropout."""
    if (spec.mask not in _BLOCK_MASKS or spec.uses_segments or spec.bias != BiasType.NO_BIAS
            or tuple(spec.window_size) != (-1, -1)):
        raise ValueError(
            f"cudnn: a context-parallel block call takes mask 'no_mask' or 'causal' without "
            f"padding, window or bias, got mask {str(spec.mask)!r}, window "
            f"{tuple(spec.window_size)}, bias {str(spec.bias)!r} (context_parallel.verdict "
            "refuses these calls; use backend='xla')")
    dtypes = {jnp.dtype(x.dtype) for x in (args.q, args.k, args.v)}
    if len(dtypes) != 1 or not dtypes <= set(_DTYPES):
        raise ValueError(f"cudnn: q, k and v must share one dtype, bfloat16 or float16; got "
                         f"{sorted(d.name for d in dtypes)}. Cast them, or use backend='xla'.")
    static = _static(spec, scale, False, False, args.q.shape[1], args.k.shape[1])
    return static._replace(has_sink=False)


def _unread(args: CanonicalArgs):
    """bias, rng and sink of a call without them: constants the handlers do not read."""
    return np.zeros((1, 1, 1, 1), args.q.dtype), _UNREAD_UINT32, _UNREAD_FLOAT32


def attention_with_lse(spec: AttentionSpec, args: CanonicalArgs, scale: float):
    """One block of a larger attention (context parallelism), masked by spec.mask alone
    ("no_mask" or top-left "causal"). Returns o [b, sq, h, dv] (q's dtype) and the
    float32 log-sum-exp [b, h, sq] of the block's scaled scores."""
    bias, rng, sink = _unread(args)
    o, _, stats = _forward(_block_static(spec, args, scale), args.q, args.k, args.v, bias, rng,
                           sink, None)
    return o, stats[..., 0]


def attention_backward_from_lse(spec: AttentionSpec, args: CanonicalArgs, scale: float,
                                out: jax.Array, lse: jax.Array, d_out: jax.Array):
    """This block's share (dq, dk, dv, None) of the gradients of an attention spanning many
    blocks, from the whole attention's output out [b, sq, h, dv], log-sum-exp lse
    [b, h, sq] (sink included; -inf where a query sees nothing: its weights here are 0)
    and d_out [b, sq, h, dv]; dq, dk, dv in q's dtype."""
    q = args.q
    bias, rng, sink = _unread(args)
    slots = np.zeros((q.shape[0], 4, 1), np.int32)  # unread without segments
    stats = jnp.where(lse == -jnp.inf, jnp.inf, lse).astype(jnp.float32)[..., None]
    backward = _folding_op(_block_static(spec, args, scale), True, frozenset({_DBIAS, _DSINK}))
    dq, dk, dv, _, _ = backward(q, args.k, args.v, bias, slots, rng, sink, out.astype(q.dtype),
                                stats, d_out.astype(q.dtype))
    return dq, dk, dv, None
