"""One device's backward under context parallelism: each visible pair's gradients from
the forward's log-sum-exp (the backend's attention_backward_from_lse), dK/dV accumulated
with their block, the bias rows and the softmax offset's gradient."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fusedattn.ops.context_parallel.blocks import (_over_blocks, _over_pairs, _pair_call, _rows,
                                                   _seq_slice, _seq_update)
from fusedattn.ops.context_parallel.plan import _KERNELS, _Plan
from fusedattn.ops.enums import SoftmaxType


def _add_at(x: jax.Array, part: jax.Array, start) -> jax.Array:
    """x with part added along the sequence axis at start."""
    return _seq_update(x, _seq_slice(x, start, part.shape[1]) + part, start)


def _backward_local(plan: _Plan, operands: dict, out, lse, d_out):
    """One device's gradients: q, k, v (its shards), bias (its rows), slopes, offset."""
    q, k, v = operands["q"], operands["k"], operands["v"]
    width = q.shape[1] // plan.pieces
    kernel = _KERNELS[plan.kernel]
    bias = operands.get("bias")
    zeros = functools.partial(jax.tree.map, lambda x: jnp.zeros(x.shape, jnp.float32))

    def visit_pair(args, keep, pair, carry):
        (d_k, d_v), (d_q, d_bias) = carry
        rows, column, j = pair.rows, pair.column, pair.start
        whole = (_seq_slice(out, rows, width), jax.lax.dynamic_slice_in_dim(lse, rows, width, 2),
                 _seq_slice(d_out, rows, width))

        def run(spec):
            dropout = (keep,) if plan.kernel == "xla" else ()  # flash, cudnn: no dropout here
            grads = kernel.attention_backward_from_lse(spec, args, plan.scale, *dropout, *whole)
            return jax.tree.map(lambda g: g.astype(jnp.float32), grads)

        g_q, g_k, g_v, g_bias = _pair_call(plan, args, pair, run,
                                           lambda: zeros((args.q, args.k, args.v, args.bias)))
        if plan.bias_array:  # every (rows, columns) block is visited once
            d_bias = jax.lax.dynamic_update_slice_in_dim(
                d_bias, jax.lax.dynamic_update_slice_in_dim(_rows(d_bias, rows, width), g_bias,
                                                            column, 3), rows, 2)
        elif g_bias is not None:
            d_bias = d_bias + g_bias
        return ((_add_at(d_k, g_k, j), _add_at(d_v, g_v, j)), (_add_at(d_q, g_q, rows), d_bias))

    def visit(source, kv, travel, state):
        return _over_pairs(plan, operands, source, kv, (travel, state), visit_pair)

    (d_k, d_v), (d_q, d_bias) = _over_blocks(plan, operands, zeros((k, v)),
                                             (zeros(q), zeros(bias)), visit)
    grads = dict(q=d_q.astype(q.dtype), k=d_k.astype(k.dtype), v=d_v.astype(v.dtype))
    if bias is not None:
        grads["bias"] = (d_bias if plan.bias_array
                         else jax.lax.psum(d_bias, plan.axis)).astype(bias.dtype)
    if "offset" in operands:
        grads["offset"] = _offset_gradient(plan, operands["offset"], out, lse, d_out)
    return grads


def _offset_gradient(plan: _Plan, offset, out, lse, d_out):
    """d/d offset[h] = -sum over queries of exp(offset[h] - lse) <d_out, out>, over the axis."""
    if plan.spec.softmax != SoftmaxType.LEARNABLE:
        return jnp.zeros_like(offset)
    dot = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [b, sq, h]
    share = jnp.exp(offset.astype(jnp.float32)[None, :, None] - lse).transpose(0, 2, 1)
    return jax.lax.psum(-jnp.sum(share * dot, axis=(0, 1)), plan.axis).astype(offset.dtype)
