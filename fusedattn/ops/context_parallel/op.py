"""The context-parallel op: attention() (a jax.custom_vjp whose forward and backward run
per device under shard_map, forward.py and backward.py) and max_logit()."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fusedattn.ops import max_logit as max_logit_pass
from fusedattn.ops.backends.base import CanonicalArgs
from fusedattn.ops.context_parallel.backward import _backward_local
from fusedattn.ops.context_parallel.blocks import _over_blocks, _over_pairs
from fusedattn.ops.context_parallel.forward import _forward_local
from fusedattn.ops.context_parallel.plan import _Plan, _plan_and_operands
from fusedattn.ops.context_parallel.sharding import _shard_map
from fusedattn.ops.spec import AttentionSpec


def attention(spec: AttentionSpec, backend_name: str, args: CanonicalArgs, scale: float
              ) -> jax.Array:
    """fused_attn's path under context parallelism: the [b, sq, h, dv] output, device layout.

    args.q/k/v are in the device layout (see the module docstring); args.tokens and a
    bias array in the natural order.
    """
    return _attention(*_plan_and_operands(spec, backend_name, args, scale))


def max_logit(spec: AttentionSpec, args: CanonicalArgs, scale: float) -> jax.Array:
    """return_max_logit under context parallelism: float32 [h] (fusedattn.ops.max_logit),
    each device's maximum over the K/V blocks it visits (the same ring or all-gather as
    the attention: one more pass of K over the axis), then the maximum over the axis."""
    plan, operands = _plan_and_operands(spec, "xla", args._replace(dropout_seed=None), scale)

    def local(operands):
        def visit_pair(pair_args, keep, pair, largest):
            return jnp.maximum(largest, max_logit_pass.max_logit(plan.spec, pair_args,
                                                                 plan.scale))

        def visit(source, kv, travel, largest):
            return travel, _over_pairs(plan, operands, source, kv, largest, visit_pair)

        start = jnp.full((operands["q"].shape[2],), -jnp.inf, jnp.float32)
        _, largest = _over_blocks(plan, operands, (), start, visit)
        return jax.lax.pmax(largest, plan.axis)

    return _shard_map(plan, local, operands, P())


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(plan: _Plan, operands: dict) -> jax.Array:
    return _attention_fwd(plan, operands)[0]


def _attention_fwd(plan: _Plan, operands: dict):
    a = plan.axis
    out, lse = _shard_map(plan, functools.partial(_forward_local, plan), operands,
                          (P(None, a), P(None, None, a)))
    return out, (operands, out, lse)


def _attention_bwd(plan: _Plan, residuals, d_out):
    operands, out, lse = residuals
    a = plan.axis
    grad_specs = dict(q=P(None, a), k=P(None, a), v=P(None, a),
                      bias=P(None, None, a) if plan.bias_array else P(), offset=P())
    grads = _shard_map(plan, functools.partial(_backward_local, plan), operands,
                       {k: grad_specs[k] for k in operands if k in grad_specs},
                       out, lse, d_out, extra_specs=(P(None, a), P(None, None, a), P(None, a)))
    return ({k: grads.get(k) for k in operands},)


_attention.defvjp(_attention_fwd, _attention_bwd)
