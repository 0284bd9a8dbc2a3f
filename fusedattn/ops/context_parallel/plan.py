"""What is static about a context-parallel call, and its checks.

verdict: which backends can serve under context parallelism (those with a log-sum-exp
entry point, _KERNELS; cudnn only for masks its chunk pairs can express, _cudnn_reason);
_mesh: the mesh axis in context, checked; _Plan and _plan_and_operands: the hashable plan
of a call and its operands, the per-token vectors and a bias array put in device order;
to_device_layout: a natural-order array in the device layout.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn.ops.backends import cudnn, flash, xla
from fusedattn.ops.backends.base import CallShapes, CanonicalArgs
from fusedattn.ops.context_parallel.load_balance import (_check_divisible,
                                                         load_balance_permutation,
                                                         reorder_causal_load_balancing)
from fusedattn.ops.enums import BiasType, ContextParallelStrategy
from fusedattn.ops.spec import AttentionSpec


# Backends with a log-sum-exp entry point (attention_with_lse, attention_backward_from_lse).
_KERNELS = {"xla": xla, "flash": flash, "cudnn": cudnn}
# Kernels that read no per-token positions (cuDNN): each is called per chunk pair with
# the pair's own mask, "no_mask" where the pair is wholly visible and "causal" on the
# diagonal (blocks._pair_kind), so they serve dense no_mask and causal masks only.
_CHUNK_MASKED = frozenset({"cudnn"})


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
                "(config.context_parallel.axis); use backend='xla' or 'flash' (or 'cudnn' "
                "for dense 'no_mask' and 'causal' masks)")
    if name in _CHUNK_MASKED:
        return _cudnn_reason(spec, shapes)
    if name == "flash" and spec.bias == BiasType.ALIBI:
        return ("flash: its context-parallel block entry point has no ALiBi (the whole-call "
                "kernels do); use backend='xla'")
    if name == "flash" and shapes.dropout:
        return ("flash: its dropout masks are keyed by block-local indices, so under context "
                "parallelism they would differ from the unsharded call's; use backend='xla'")
    return None


def _cudnn_reason(spec: AttentionSpec, shapes: CallShapes | None) -> str | None:
    """Why cudnn cannot serve this call under context parallelism (None: it can).

    cuDNN takes no per-token positions, so each (query chunk, key chunk) pair is one call
    with a mask of its own: wholly visible ("no_mask"), the top-left causal diagonal of
    two equally long chunks ("causal"), or not called. That expresses dense "no_mask" and
    "causal" (and "causal_bottom_right" where sq == skv, the same mask) and nothing that
    depends on positions within a chunk or is drawn per token.
    """
    why = ("under context parallelism each (query chunk, key chunk) pair is one cuDNN call "
           "that is wholly visible, causal on its diagonal, or skipped, and cuDNN reads no "
           "token positions")
    if spec.uses_segments:
        return (f"cudnn: {why}, so it cannot apply padding or packed segments (config.mask "
                f"{str(spec.mask)!r}, layout {str(spec.qkv_layout)!r}); use backend='flash' "
                "or 'xla'")
    if tuple(spec.window_size) != (-1, -1):
        return (f"cudnn: {why}, so it cannot apply a sliding window (config.window_size "
                f"{tuple(spec.window_size)}), which cuts pairs off the diagonal; use "
                "backend='flash' or 'xla'")
    if (spec.mask.is_causal and shapes is not None
            and shapes.seqlen_q != shapes.seqlen_kv):
        return (f"cudnn: {why}, so a causal mask needs as many query as key tokens for its "
                f"diagonal to run through the pairs' corners (sq={shapes.seqlen_q}, "
                f"skv={shapes.seqlen_kv}); use backend='flash' or 'xla'")
    if spec.bias == BiasType.ALIBI:
        return (f"cudnn: {why}, so its ALiBi term would be taken from block-local positions; "
                "use backend='xla'")
    if spec.bias != BiasType.NO_BIAS:
        return (f"cudnn: its context-parallel block calls take no bias array (config.bias "
                f"{str(spec.bias)!r}); use backend='flash' (which takes each block's slice) or "
                "'xla'")
    if shapes is not None and shapes.dropout:
        return ("cudnn: under context parallelism its dropout masks would come from cuDNN's "
                "own generator at block-local indices, not the unsharded call's; use "
                "backend='xla'")
    return None


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about one context-parallel call (hashable)."""

    spec: AttentionSpec
    kernel: str
    scale: float
    mesh: jax.sharding.AbstractMesh
    size: int      # devices along the axis
    pieces: int    # calls per device shard and block side (2: chunk pairs under load balancing)
    chunk_masked: bool = False  # the kernel takes the pair's mask (_CHUNK_MASKED), no positions

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
    # cuDNN is told each pair's mask (a call per chunk pair) where the mask is causal;
    # without one every pair is wholly visible, and one call serves a block.
    chunk_masked = backend_name in _CHUNK_MASKED
    per_pair = backend_name == "xla" or (chunk_masked and spec.mask.is_causal)
    pieces = chunks if per_pair else 1
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
                 pieces=pieces, chunk_masked=chunk_masked)
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
