"""Context parallelism: exact attention with the sequence sharded over one device-mesh axis.

`config.context_parallel.axis` names an axis of the mesh in context (`jax.set_mesh(mesh)`
or `with jax.sharding.use_mesh(mesh):`) over which q, k and v are sharded along their
sequence axis. fused_attn then runs inside `jax.shard_map` over that axis alone (the other
mesh axes stay with the automatic partitioner, so batch and head shardings carry through):

- "all_gather": each device gathers K/V (with their token vectors) and attends its query
  shard to all of it; the backward reduce-scatters dK/dV back to their shards.
- "ring": K/V blocks circulate around the axis with `jax.lax.ppermute` (the next block is
  sent before the current one is used, so the transfer can overlap the block's compute);
  each device merges its queries' partial results by log-sum-exp. The backward circulates
  K/V again with float32 dK/dV accumulators that travel with their block and arrive home
  after the last step. No device ever holds more than two K/V blocks.

Layout. q, k, v and the output are in the *device layout*: with `load_balance`, the
sequence is cut into 2N chunks and device i holds chunks i and 2N-1-i (so causal work is
even); `reorder_causal_load_balancing` puts a batch into that order and
`inverse_reorder_causal_load_balancing` takes it back. Without load balancing the device
layout is the natural order. The SequenceDescriptor and a bias array [b|1, h|1, sq, skv]
always describe the natural order; the op reorders their per-token vectors itself.

Blocks. Each device's shard is cut into `pieces` (its two chunks under load balancing,
else one); every (query piece, key piece) pair whose mask has no visible entry (causal
future, outside the sliding window, other documents only) is skipped with
`jax.lax.cond`, so under load-balanced causal masks an off-diagonal step does half the
work. A pair runs the backend's log-sum-exp entry point: xla (every feature) or flash
(host build: no bias arrays, and no dropout, its masks being keyed by block-local
indices). Softmax sinks (off_by_one, learnable) join once per query after the merge;
dropout masks are drawn at the global query and key indices, so every result equals the
unsharded call's (up to float32 rounding of the merge).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from fusedattn.ops import max_logit as max_logit_pass
from fusedattn.ops import philox
from fusedattn.ops.backends import flash, xla
from fusedattn.ops.backends.base import CallShapes, CanonicalArgs, TokenInfo, visible_mask
from fusedattn.ops.enums import BiasType, ContextParallelStrategy, SoftmaxType
from fusedattn.ops.spec import AttentionSpec

# Backends with a log-sum-exp entry point (attention_with_lse, attention_backward_from_lse).
_KERNELS = {"xla": xla, "flash": flash}


# --------------------------------------------------------------------------- load balancing

def load_balance_permutation(seqlen: int, cp_size: int) -> np.ndarray:
    """int32 [seqlen]: entry i is the natural position of the token at device-layout slot i.

    The sequence is cut into 2 * cp_size equal chunks; device i holds chunks i and
    2 * cp_size - 1 - i, in that order.
    """
    _check_divisible(seqlen, 2 * cp_size, "seqlen")
    chunk = seqlen // (2 * cp_size)
    order = [c for i in range(cp_size) for c in (i, 2 * cp_size - 1 - i)]
    return (np.asarray(order)[:, None] * chunk + np.arange(chunk)).reshape(-1).astype(np.int32)


def reorder_causal_load_balancing(x, cp_size: int, seq_axis: int = 1) -> jax.Array:
    """x in natural token order -> the device layout of load-balanced context parallelism
    (x's axis `seq_axis`, of a length divisible by 2 * cp_size, is permuted)."""
    x = jnp.asarray(x)
    return jnp.take(x, load_balance_permutation(x.shape[seq_axis], cp_size), axis=seq_axis)


def inverse_reorder_causal_load_balancing(x, cp_size: int, seq_axis: int = 1) -> jax.Array:
    """The inverse of reorder_causal_load_balancing: device layout -> natural order."""
    x = jnp.asarray(x)
    inverse = np.argsort(load_balance_permutation(x.shape[seq_axis], cp_size))
    return jnp.take(x, inverse, axis=seq_axis)


def to_device_layout(spec: AttentionSpec, x, seq_axis: int = 1) -> jax.Array:
    """A natural-order array (positions, row masks) in the device layout of `spec`'s context
    parallelism: reordered for load balancing over the mesh axis in context, else x itself."""
    if spec.context_axis is None or not spec.context_load_balance:
        return x
    return reorder_causal_load_balancing(x, _mesh(spec.context_axis).shape[spec.context_axis],
                                         seq_axis)


def _check_divisible(length: int, by: int, name: str) -> None:
    if length % by:
        raise ValueError(
            f"{name}: context parallelism cuts the sequence into {by} equal chunks (mesh axis "
            f"size x 2 with config.context_parallel.load_balance, else x 1), but it has "
            f"{length} tokens; pad it to a multiple of {by}."
        )


# --------------------------------------------------------------------------- selection

def verdict(name: str, spec: AttentionSpec, shapes: CallShapes) -> str | None:
    """Why backend `name` cannot serve this call under context parallelism (None: it can)."""
    if name not in _KERNELS:
        return (f"{name}: no log-sum-exp block entry point for context parallelism "
                "(config.context_parallel.axis); use backend='xla' or 'flash'")
    if name == "flash" and shapes.dropout:
        return ("flash: its dropout masks are keyed by block-local indices, so under context "
                "parallelism they would differ from the unsharded call's; use backend='xla'")
    return None


# --------------------------------------------------------------------------- the op

@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about one context-parallel call (hashable)."""

    spec: AttentionSpec
    kernel: str
    scale: float
    mesh: jax.sharding.AbstractMesh
    size: int      # devices along the axis
    pieces: int    # pieces per device shard (2 under load balancing)

    @property
    def axis(self) -> str:
        return self.spec.context_axis

    @property
    def ring(self) -> bool:
        return self.spec.context_strategy == ContextParallelStrategy.RING

    @property
    def bias_array(self) -> bool:
        return self.spec.bias in (BiasType.PRE_SCALE_BIAS, BiasType.POST_SCALE_BIAS)


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
        def visit_pair(pair_args, keep, rows, column, j, largest):
            return jnp.maximum(largest, max_logit_pass.max_logit(plan.spec, pair_args,
                                                                 plan.scale))

        def visit(source, kv, travel, largest):
            return travel, _over_pairs(plan, operands, source, kv, largest, visit_pair)

        start = jnp.full((operands["q"].shape[2],), -jnp.inf, jnp.float32)
        _, largest = _over_blocks(plan, operands, (), start, visit)
        return jax.lax.pmax(largest, plan.axis)

    return _shard_map(plan, local, operands, P())


def _plan_and_operands(spec: AttentionSpec, backend_name: str, args: CanonicalArgs,
                       scale: float) -> tuple["_Plan", dict]:
    """The plan of a context-parallel call and its operands (tokens in device order)."""
    mesh = _mesh(spec.context_axis)
    size = mesh.shape[spec.context_axis]
    pieces = 2 if spec.context_load_balance else 1
    sq, skv = args.q.shape[1], args.k.shape[1]
    _check_divisible(sq, size * pieces, "q")
    _check_divisible(skv, size * pieces, "k/v")
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


# --------------------------------------------------------------------------- per device

def _seq_slice(x: jax.Array, start, width: int) -> jax.Array:
    """x[:, start:start + width] along the sequence axis (axis 0 of a 1-D index vector)."""
    return jax.lax.dynamic_slice_in_dim(x, start, width, 0 if x.ndim == 1 else 1)


def _seq_update(x: jax.Array, part: jax.Array, start) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, part, start, 0 if x.ndim == 1 else 1)


def _rotate(plan: _Plan, tree):
    """Sends every device's arrays to the next device along the axis."""
    perm = [(i, (i + 1) % plan.size) for i in range(plan.size)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, plan.axis, perm), tree)


def _over_blocks(plan: _Plan, operands: dict, travel, state, visit):
    """Runs visit(source, kv, travel, state) -> (travel, state) over every device's K/V block.

    kv = (k, v, kv_seg, kv_pos, kv_index) of the block of device `source` (traced).
    travel: accumulators shaped like a K/V block (the backward's dK/dV; () in the
    forward). Under the ring the blocks circulate with jax.lax.ppermute (the next one is
    sent before the current one is used) and each accumulator travels with its block,
    arriving home after the last step; under all_gather the blocks are sliced from the
    gathered K/V and the accumulators are reduce-scattered. Returns (travel, state), travel
    for this device's own block.
    """
    kv = (operands["k"], operands["v"], *operands["kv_tok"])
    width = kv[0].shape[1]
    if not plan.ring:
        gathered = tuple(jax.lax.all_gather(x, plan.axis, axis=0 if x.ndim == 1 else 1,
                                            tiled=True) for x in kv)
        full = jax.tree.map(lambda x: jnp.zeros(x.shape[:1] + (width * plan.size,) + x.shape[2:],
                                                x.dtype), travel)

        def gathered_step(carry, source):
            full, state = carry
            start = source * width
            part, state = visit(source, tuple(_seq_slice(x, start, width) for x in gathered),
                                jax.tree.map(lambda x: _seq_slice(x, start, width), full), state)
            full = jax.tree.map(lambda x, p: _seq_update(x, p, start), full, part)
            return (full, state), None

        (full, state), _ = jax.lax.scan(gathered_step, (full, state), jnp.arange(plan.size))
        travel = jax.tree.map(
            lambda x: jax.lax.psum_scatter(x, plan.axis, scatter_dimension=1, tiled=True), full)
        return travel, state

    me = jax.lax.axis_index(plan.axis)

    def ring_step(kv, travel, state, step, last: bool):
        following = None if last else _rotate(plan, kv)
        travel, state = visit((me - step) % plan.size, kv, travel, state)
        return following, _rotate(plan, travel), state

    def scanned(carry, step):
        return ring_step(*carry, step, last=False), None

    (kv, travel, state), _ = jax.lax.scan(scanned, (kv, travel, state),
                                          jnp.arange(plan.size - 1))
    _, travel, state = ring_step(kv, travel, state, plan.size - 1, last=True)
    return travel, state


def _over_pairs(plan: _Plan, operands: dict, source, kv: tuple, carry, visit):
    """Runs visit(args, keep, rows, column, j, carry) -> carry over every (query piece, key
    piece) pair of one block (a lax.scan: one copy of the pair's computation), where
    rows is the query piece's first local row and j the key piece within the block
    (both traced), column its first device-layout column; args is the pair's canonical
    call and keep its dropout mask (None without dropout)."""
    pieces = plan.pieces
    q_width, kv_width = operands["q"].shape[1] // pieces, kv[0].shape[1] // pieces

    def step(carry, pair):
        i, j = pair // pieces, pair % pieces
        rows, start = i * q_width, j * kv_width
        q, q_seg, q_pos, q_diag, q_index = (_seq_slice(x, rows, q_width) for x in
                                            (operands["q"], *operands["q_tok"]))
        k, v, kv_seg, kv_pos, kv_index = (_seq_slice(x, start, kv_width) for x in kv)
        column = source * kv[0].shape[1] + start
        bias = operands.get("bias")
        if plan.bias_array:
            bias = jax.lax.dynamic_slice_in_dim(_rows(bias, rows, q_width), column, kv_width, 3)
        args = CanonicalArgs(q=q, k=k, v=v, bias=bias,
                             tokens=TokenInfo(q_seg, q_pos, q_diag, kv_seg, kv_pos))
        keep = None
        if "seed" in operands and plan.spec.dropout_rate > 0:
            keep = philox.dropout_keep_mask(operands["seed"], plan.spec.dropout_rate,
                                            (q.shape[0], q.shape[2], q_width, kv_width),
                                            q_index, kv_index)
        return visit(args, keep, rows, column, start, carry), None

    carry, _ = jax.lax.scan(step, carry, jnp.arange(pieces * pieces))
    return carry


def _rows(x: jax.Array, start, width: int) -> jax.Array:
    """Rows [start, start + width) of a bias-shaped [b, h, sq, skv] array."""
    return jax.lax.dynamic_slice_in_dim(x, start, width, 2)


def _visible_anywhere(plan: _Plan, args: CanonicalArgs) -> jax.Array:
    return jnp.any(visible_mask(plan.spec, args.tokens))


def _forward_local(plan: _Plan, operands: dict):
    """One device's output [b, sq_l, h, dv] (q's dtype) and log-sum-exp [b, h, sq_l]."""
    q = operands["q"]
    b, sq, h = q.shape[:3]
    dv = operands["v"].shape[-1]
    width = sq // plan.pieces
    kernel = _KERNELS[plan.kernel]
    empty = (jnp.zeros((b, width, h, dv), jnp.float32),
             jnp.full((b, h, width), -jnp.inf, jnp.float32))

    def visit_pair(args, keep, rows, column, j, state):
        def run():
            extra = (keep,) if plan.kernel == "xla" else ()
            o, lse = kernel.attention_with_lse(plan.spec, args, plan.scale, *extra)
            return o.astype(jnp.float32), lse

        o, lse = jax.lax.cond(_visible_anywhere(plan, args), run, lambda: empty)
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

    def visit_pair(args, keep, rows, column, j, carry):
        (d_k, d_v), (d_q, d_bias) = carry
        whole = (_seq_slice(out, rows, width), jax.lax.dynamic_slice_in_dim(lse, rows, width, 2),
                 _seq_slice(d_out, rows, width))

        def run():
            if plan.kernel == "xla":
                grads = kernel.attention_backward_from_lse(plan.spec, args, plan.scale, keep,
                                                           *whole)
            else:
                grads = (*kernel.attention_backward_from_lse(plan.spec, args, plan.scale,
                                                             *whole), None)
            return jax.tree.map(lambda g: g.astype(jnp.float32), grads)

        g_q, g_k, g_v, g_bias = jax.lax.cond(
            _visible_anywhere(plan, args), run,
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
