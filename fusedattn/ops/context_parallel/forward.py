"""One device's forward under context parallelism: each visible (query piece, key piece)
pair through the backend's log-sum-exp entry point, merged by log-sum-exp, then the
softmax sink (off_by_one, learnable) joined once per query."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fusedattn.ops.context_parallel.blocks import (_over_blocks, _over_pairs, _pair_call,
                                                   _seq_slice, _seq_update)
from fusedattn.ops.context_parallel.plan import _KERNELS, _Plan
from fusedattn.ops.enums import SoftmaxType


def _forward_local(plan: _Plan, operands: dict):
    """One device's output [b, sq_l, h, dv] (q's dtype) and log-sum-exp [b, h, sq_l]."""
    q = operands["q"]
    b, sq, h = q.shape[:3]
    dv = operands["v"].shape[-1]
    width = sq // plan.pieces
    kernel = _KERNELS[plan.kernel]
    empty = (jnp.zeros((b, width, h, dv), jnp.float32),
             jnp.full((b, h, width), -jnp.inf, jnp.float32))

    def visit_pair(args, keep, pair, state):
        def run(spec):
            extra = (keep,) if plan.kernel == "xla" else ()
            o, lse = kernel.attention_with_lse(spec, args, plan.scale, *extra)
            return o.astype(jnp.float32), lse

        o, lse = _pair_call(plan, args, pair, run, lambda: empty)
        rows = pair.rows
        out, lse_all = state
        merged_out, merged_lse = _merge(_seq_slice(out, rows, width),
                                        jax.lax.dynamic_slice_in_dim(lse_all, rows, width, 2),
                                        o, lse)
        return (_seq_update(out, merged_out, rows),
                jax.lax.dynamic_update_slice_in_dim(lse_all, merged_lse, rows, 2))

    def visit(source, kv, travel, state):
        return travel, _over_pairs(plan, operands, source, kv, state, visit_pair)

    state = (jnp.zeros((b, sq, h, dv), jnp.float32), jnp.full((b, h, sq), -jnp.inf, jnp.float32))
    _, (out, lse) = _over_blocks(plan, operands, (), state, visit)
    if plan.spec.softmax != SoftmaxType.VANILLA:
        total = jnp.logaddexp(lse, operands["offset"].astype(jnp.float32)[None, :, None])
        out = out * _weight(lse, total)
        lse = total
    return out.astype(q.dtype), lse


def _weight(lse: jax.Array, total: jax.Array) -> jax.Array:
    """exp(lse - total) as [b, sq, h, 1] for outputs; 0 where lse is -inf."""
    safe = jnp.where(jnp.isfinite(total), total, 0.0)
    return jnp.where(jnp.isfinite(lse), jnp.exp(lse - safe), 0.0).transpose(0, 2, 1)[..., None]


def _merge(out_a, lse_a, out_b, lse_b):
    """Two partial attentions over disjoint keys -> the attention over both (float32)."""
    total = jnp.logaddexp(lse_a, lse_b)
    return (out_a * _weight(lse_a, total) + out_b * _weight(lse_b, total), total)
