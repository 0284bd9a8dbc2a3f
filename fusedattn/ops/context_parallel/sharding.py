"""A per-device function run under jax.shard_map over the context axis alone: the
PartitionSpec of each operand, and under explicit sharding the reshard that splits the
sequence over the axis (the other mesh axes stay with the automatic partitioner)."""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P

from fusedattn.ops.context_parallel.plan import _Plan


def _specs(plan: _Plan, operands: dict) -> dict:
    """The PartitionSpec of each operand over the context axis (others replicated)."""
    a = plan.axis
    specs = dict(q=P(None, a), k=P(None, a), v=P(None, a), offset=P(), seed=P(),
                 bias=P(None, None, a) if plan.bias_array else P(),
                 q_tok=(P(None, a),) * 3 + (P(a),), kv_tok=(P(None, a),) * 2 + (P(a),))
    return {k: specs[k] for k in operands}


def _shard_map(plan: _Plan, fn, operands: dict, out_specs, *extra, extra_specs=()):
    in_specs = (_specs(plan, operands), *extra_specs)
    args = (operands, *extra)
    if jax.sharding.AxisType.Explicit in plan.mesh.axis_types:
        args = jax.tree.map(functools.partial(_explicitly_split, plan), args, in_specs)
    # Axes of one device are made manual too: nothing splits over them, and the compiled
    # ops' partitioning callbacks inside fail on a size-1 axis left automatic (a mesh of
    # data x context = 1 x N, as the LM trainer makes).
    manual = {plan.axis} | {name for name, size in plan.mesh.shape.items() if size == 1}
    return jax.shard_map(fn, mesh=plan.mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=manual, check_vma=False)(*args)


def _explicitly_split(plan: _Plan, x: jax.Array, spec: P) -> jax.Array:
    """Under explicit sharding: x resharded so that the dim `spec` splits over the context
    axis does, and no other; its other dims keep their shardings."""
    current = list(jax.typeof(x).sharding.spec) + [None] * x.ndim
    entries = [None if entry == plan.axis else entry for entry in current[:x.ndim]]
    for dim, entry in enumerate(spec):
        if entry is not None:
            entries[dim] = entry
    return jax.sharding.reshard(x, P(*entries))
