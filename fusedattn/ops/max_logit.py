"""fused_attn(..., return_max_logit=True): each head's largest attention logit (QK-clip).

The logit is what the softmax sees: scale * q.k plus the bias or ALiBi term, over the
batch and every visible (query, key) pair; masked pairs, padding and the softmax sink
do not count, and a head with no visible pair gets -inf. It is a monitor, not a loss
term: it carries no gradient.

One pass serves every backend: the scores are formed again, a block of queries at a
time (so memory stays near QUERY_BLOCK_ELEMENTS floats, whatever the sequence length),
from the same q and k the backend reads. That costs one more q.k^T product: half a
forward pass's matmul FLOPs. (The FP8 emulation reports the maximum of its own FP8
scores instead, ops/backends/xla_fp8.py; context parallelism runs this pass on each
pair of blocks, context_parallel.max_logit.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fusedattn.ops.backends import xla
from fusedattn.ops.backends.base import CanonicalArgs
from fusedattn.ops.spec import AttentionSpec

# Scores held at once: b * h * block * skv float32 values, at most this many (256 MiB).
QUERY_BLOCK_ELEMENTS = 2**26


def max_logit(spec: AttentionSpec, args: CanonicalArgs, scale: float) -> jax.Array:
    """float32 [h]: the largest visible logit of each head (module docstring)."""
    b, sq, h, _ = args.q.shape
    skv = args.k.shape[1]
    block = max(1, min(sq, QUERY_BLOCK_ELEMENTS // max(1, b * h * skv)))
    blocks = -(-sq // block)
    stop = jax.lax.stop_gradient
    args = _padded_queries(args._replace(
        q=stop(args.q), k=stop(args.k), bias=None if args.bias is None else stop(args.bias)),
        blocks * block - sq)

    def block_max(index):
        start = index * block
        part = args._replace(
            q=jax.lax.dynamic_slice_in_dim(args.q, start, block, axis=1),
            tokens=args.tokens._replace(**{
                name: jax.lax.dynamic_slice_in_dim(getattr(args.tokens, name), start, block,
                                                   axis=1)
                for name in ("q_seg", "q_pos", "q_diag")}),
            bias=(args.bias if args.bias is None or args.bias.ndim == 1 else
                  jax.lax.dynamic_slice_in_dim(args.bias, start, block, axis=2)))
        scores, visible = xla.scores_and_visible(spec, part, scale)
        return jnp.max(jnp.where(visible, scores, -jnp.inf), axis=(0, 2, 3))

    return jnp.max(jax.lax.map(block_max, jnp.arange(blocks)), axis=0)


def _padded_queries(args: CanonicalArgs, extra: int) -> CanonicalArgs:
    """args with `extra` padding queries (segment 0: they see nothing) at the end."""
    if extra == 0:
        return args

    def pad(x, axis):
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, extra)
        return jnp.pad(x, widths)

    tokens = args.tokens._replace(q_seg=pad(args.tokens.q_seg, 1), q_pos=pad(args.tokens.q_pos, 1),
                                  q_diag=pad(args.tokens.q_diag, 1))
    bias = args.bias if args.bias is None or args.bias.ndim == 1 else pad(args.bias, 2)
    return args._replace(q=pad(args.q, 1), tokens=tokens, bias=bias)
