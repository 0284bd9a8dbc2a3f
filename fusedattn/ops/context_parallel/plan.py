"""What is static about a context-parallel call, and its checks.

verdict: which backends can serve under context parallelism (those with a log-sum-exp
entry point, _KERNELS); _mesh: the mesh axis in context, checked; _Plan and
_plan_and_operands: the hashable plan of a call and its operands, the per-token vectors
and a bias array put in device order; to_device_layout: a natural-order array in the
device layout.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn.ops.backends import flash, xla
from fusedattn.ops.backends.base import CallShapes, CanonicalArgs
from fusedattn.ops.context_parallel.load_balance import (_check_divisible,
                                                         load_balance_permutation,
                                                         reorder_causal_load_balancing)
from fusedattn.ops.enums import BiasType, ContextParallelStrategy
from fusedattn.ops.spec import AttentionSpec


# Backends with a log-sum-exp entry point (attention_with_lse, attention_backward_from_lse).
_KERNELS = {"xla": xla, "flash": flash}


def to_device_layout(spec: AttentionSpec, x, seq_axis: int = 1) -> jax.Array:
    """A natural-order array (positions, row masks) in the device layout of `spec`'s context
    parallelism: reordered for load balancing over the mesh axis in context, else x itself."""
    if spec.context_axis is None or not spec.context_load_balance:
        return x
    return reorder_causal_load_balancing(x, _mesh(spec.context_axis).shape[spec.context_axis],
                                         seq_axis)


def verdict(name: str, spec: AttentionSpec, shapes: CallShapes) -> str | None:
    """Why backend `name` cannot serve this call under context parallelism (None: it can)."""
    if name not in _KERNELS:
        return (f"{name}: no log-sum-exp block entry point for context parallelism "
                "(config.context_parallel.axis); use backend='xla' or 'flash'")
    if name == "flash" and spec.bias == BiasType.ALIBI:
        return ("flash: its context-parallel block entry point has no ALiBi (the whole-call "
                "kernels do); use backend='xla'")
    if name == "flash" and shapes.dropout:
        return ("flash: its dropout masks are keyed by block-local indices, so under context "
                "parallelism they would differ from the unsharded call's; use backend='xla'")
    return None


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about one context-parallel call (hashable)."""

    spec: AttentionSpec
    kernel: str
    scale: float
    mesh: jax.sharding.AbstractMesh
    size: int      # devices along the axis
    pieces: int    # calls per device shard and block side (2: xla under load balancing)

    @property
    def axis(self) -> str:
        return self.spec.context_axis

    @property
    def ring(self) -> bool:
        return self.spec.context_strategy == ContextParallelStrategy.RING

    @property
    def bias_array(self) -> bool:
        return self.spec.bias in (BiasType.PRE_SCALE_BIAS, BiasType.POST_SCALE_BIAS)


def _plan_and_operands(spec: AttentionSpec, backend_name: str, args: CanonicalArgs,
                       scale: float) -> tuple["_Plan", dict]:
    """The plan of a context-parallel call and its operands (tokens in device order)."""
    mesh = _mesh(spec.context_axis)
    size = mesh.shape[spec.context_axis]
    chunks = 2 if spec.context_load_balance else 1
    # xla computes every pair it is given: a call per chunk pair, so that the invisible
    # ones are skipped; flash skips invisible tiles itself, so one call serves a block.
    pieces = chunks if backend_name == "xla" else 1
    sq, skv = args.q.shape[1], args.k.shape[1]
    _check_divisible(sq, size * chunks, "q")
    _check_divisible(skv, size * chunks, "k/v")
    q_index, kv_index = np.arange(sq, dtype=np.int32), np.arange(skv, dtype=np.int32)
    if spec.context_load_balance:
        q_index, kv_index = load_balance_permutation(sq, size), load_balance_permutation(skv, size)
    t = args.tokens
    q_tok = tuple(jnp.take(x, q_index, axis=1) for x in (t.q_seg, t.q_pos, t.q_diag))
    kv_tok = tuple(jnp.take(x, kv_index, axis=1) for x in (t.kv_seg, t.kv_pos))
    bias = args.bias
    plan = _Plan(spec=spec, kernel=backend_name, scale=float(scale), mesh=mesh, size=size,
                 pieces=pieces)
    if plan.bias_array:
        bias = jnp.take(jnp.take(bias, q_index, axis=2), kv_index, axis=3)
    operands = dict(q=args.q, k=args.k, v=args.v, bias=bias, offset=args.softmax_offset,
                    seed=args.dropout_seed, q_tok=q_tok + (jnp.asarray(q_index),),
                    kv_tok=kv_tok + (jnp.asarray(kv_index),))
    return plan, {k: x for k, x in operands.items() if x is not None}


def _mesh(axis: str) -> jax.sharding.AbstractMesh:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.axis_names:
        have = "no mesh" if mesh.empty else f"a mesh with axes {tuple(mesh.axis_names)}"
        raise ValueError(
            f"config.context_parallel.axis: {axis!r} must name an axis of the device mesh in "
            f"context, but there is {have}; call fused_attn under jax.set_mesh(mesh) (or "
            "`with jax.sharding.use_mesh(mesh):`) with a mesh that has that axis, or set "
            "config.context_parallel.axis = None."
        )
    explicit = [name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                if kind == jax.sharding.AxisType.Explicit and name != axis]
    if explicit:
        raise ValueError(
            f"config.context_parallel.axis: the mesh's other axes {tuple(explicit)} are of "
            "explicit sharding, which context parallelism does not handle yet; make the mesh "
            "with axis_types=jax.sharding.AxisType.Auto for them (jax.make_mesh(..., "
            "axis_types=...)), or shard the sequence alone."
        )
    return mesh
