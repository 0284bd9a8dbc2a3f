"""Sharding of the compiled backends' FFI calls, and `op`, which adds the batching of folding.py.

XLA's SPMD partitioner cannot see inside a custom call, so a bare `jax.ffi.ffi_call`
on arrays sharded over a device mesh gathers them to every device. `op(fn, signature)`
wraps one FFI call (`fn`: the ffi_call and any index math on its local shapes) so that

- under a mesh (`jax.experimental.custom_partitioning`, with a Shardy sharding rule
  and the GSPMD callbacks) every device runs `fn` on its own shard of the batch and
  head axes, sharded as q is: no gathering of q/k/v, results sharded like q, and
  everything else replicated (sequence, head dims, per-call scalars). Sums the kernel
  takes over a sharded axis are completed with a psum. An axis that cannot shard
  exactly stays replicated (gathered): never different numbers.
- under `jax.vmap` (`jax.custom_batching.custom_vmap`, folding.py) the mapped axis is
  folded into the kernel's batch: one call, no loop.

A `Signature` gives every operand and result one role letter per dimension:

    b  batch: extent the batch B of q (operand 0), or a multiple k * B, batch-major
       (cuDNN's statistics: one entry per segment slot)
    B  batch, or 1: an operand shared by every row (a bias [1, ...]); a result dim of
       extent 1 under this role is a sum over the batch taken inside the call
    h  query heads H (q's heads); H: heads or 1, like B
    g  K/V heads H / G (grouped-query attention): shards with the query heads, by the
       same devices, when both head counts divide by them
    r  rows of a per-row operand (the kernels' leading-dims broadcast): L rows, L
       divides B, batch row i reads row i // (B / L); shards with the batch when L
       divides by the batch devices, is replicated when L == 1
    .  replicated

Operand 0 is q ("b.h." for [b, s, h, d]): its batch and head shardings are the ones
kept.

Sums over the batch taken inside the call: results with neither a batch role nor a
shared one (`batch_sums`, e.g. cuDNN's dsink [h]) and results with role B of extent 1
(the gradient of a shared B operand, e.g. the dbias [1, h, sq, skv] of a bias shared
by the batch). Under a mesh they are psummed over the batch devices; under vmap they
come back per example (folding.py says how).

Dropout: the kernels key their masks by the global (batch, head) coordinates, which a
shard does not know, so with `dropout` set the heads never shard, and the batch shards
only where the rows of operand `dropout_rows` (per-example seeds, the kernels' Philox
batch coordinate being the row's index within its seed's rows) split with it. Then a
sharded call draws exactly the masks of the unsharded one.

Per-head constants: a kernel that derives values from the head index and count (cuDNN's
ALiBi slopes) sets `whole_heads`, so its heads never shard either (the batch still does).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax.experimental.custom_partitioning import (
    ArrayMapping, CompoundFactor, SdyShardingRule, custom_partitioning)
from jax._src.sharding_impls import GSPMDSharding
from jax.interpreters.mlir import ir
from jax.sharding import NamedSharding, PartitionSpec

from fusedattn.ops.backends import folding

_ROLES = frozenset("bBhHgr.")


@dataclasses.dataclass(frozen=True)
class Signature:
    """The roles of one FFI call's operands and results (see the module docstring)."""

    operands: tuple[str, ...]
    results: tuple[str, ...]
    batch_sums: frozenset[int] = frozenset()
    dropout: bool = False
    dropout_rows: int | None = None
    unread: frozenset[int] = frozenset()
    whole_heads: bool = False

    def __post_init__(self):
        for roles in self.operands + self.results:
            if not set(roles) <= _ROLES:
                raise ValueError(f"unknown roles in {roles!r}; use {''.join(sorted(_ROLES))}")
        if "b" not in self.operands[0] or "h" not in self.operands[0]:
            raise ValueError(f"operand 0 must be q with roles b and h, got {self.operands[0]!r}")
        for i, roles in enumerate(self.results):
            if (i in self.batch_sums) == (roles[:1] in ("b", "B")):
                raise ValueError(f"result {i} ({roles!r}): a batch sum has no batch dim, and a "
                                 "result without one must be a batch sum")
        if self.dropout_rows is not None and self.operands[self.dropout_rows][:1] != "r":
            raise ValueError("dropout_rows must name an operand of rows ('r' first)")
        if not self.unread <= set(range(len(self.results))):
            raise ValueError(f"unread names results {sorted(self.unread)}, but there are "
                             f"{len(self.results)}")


def op(fn, signature: Signature, batch_sum_rows=None):
    """`fn(*operands) -> tuple of results`, partitioned and folded as `signature` says.

    batch_sum_rows(*operands) -> tuple, one entry per batch sum (ascending result index):
    its terms per row of q, [B, ...], whose sum over the rows is the result; needed
    when the signature has batch sums (see the module docstring).
    Returns a function of the same operands that always returns a tuple.
    """
    if signature.batch_sums and batch_sum_rows is None:
        raise ValueError("batch sums need batch_sum_rows: under vmap they are made per "
                         "example from their per-row terms")
    folded = folding.fold(_partitioned(fn, signature), signature, fn, batch_sum_rows)

    def call(*operands):
        return same_varying(folded(*operands), like=operands)

    return call


# ---- jax.shard_map: the manual axes a value varies over ------------------------------

def varying_axes(x) -> frozenset:
    """The manual mesh axes (inside `jax.shard_map`) over which x varies; empty outside."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


def same_varying(tree, like=None):
    """Every array of `tree` marked as varying over the union of the manual axes of
    `like`'s arrays (default: `tree`'s own).

    Inside `jax.shard_map` each value carries the mesh axes it varies over, and a
    `jax.custom_vjp` backward must return cotangents of exactly its primal inputs'
    types. An FFI call's results carry no such axes (XLA cannot see inside it), and a
    cotangent computed from a varying q is varying even where k was not. So the
    compiled backends mark their inputs alike before their custom_vjp (outside it, so
    JAX's own transpose of the cast sums the cotangent over the axes it added) and the
    results of every FFI call like their inputs (`op`). A no-op outside shard_map.
    """
    leaves = jax.tree.leaves(tree if like is None else like)
    axes = frozenset().union(*(varying_axes(x) for x in leaves))
    if not axes:
        return tree

    def vary(x):
        missing = tuple(sorted(axes - varying_axes(x)))
        if not missing:
            return x
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(x, missing, to="varying")
        return jax.lax.pvary(x, missing)

    return jax.tree.map(vary, tree)


# ---- the plan: which mesh axes each dimension shards over ----------------------------

@dataclasses.dataclass(frozen=True)
class _Plan:
    """The mesh axes the batch and the heads shard over (empty: replicated)."""

    mesh: object
    batch: tuple[str, ...]
    heads: tuple[str, ...]

    def spec(self, roles: str, shape) -> PartitionSpec:
        """A dim of extent 1 (a broadcast, or a rows operand of one row) is replicated."""
        def dim(role, extent):
            axes = (self.batch if role in "bBr" else self.heads if role in "hHg" else ())
            axes = axes if extent != 1 else ()
            return None if not axes else axes[0] if len(axes) == 1 else axes
        return PartitionSpec(*(dim(role, extent) for role, extent in zip(roles, shape)))

    def size(self, axes) -> int:
        return math.prod(self.mesh.shape[a] for a in axes)

    def summed_axes(self, signature: Signature, index: int, shape) -> tuple[str, ...]:
        """Mesh axes over which result `index`'s local values are partial sums."""
        axes = self.batch if index in signature.batch_sums else ()
        for role, extent in zip(signature.results[index], shape):
            if extent == 1 and role in "BH":
                axes += self.batch if role == "B" else self.heads
        return axes


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _plan(signature: Signature, mesh, arg_shapes) -> _Plan | None:
    """Batch and head axes of q's sharding, kept where they shard exactly, else dropped.

    None without a mesh (shardings that are not NamedSharding): everything replicated.
    """
    q = arg_shapes[0]
    if not isinstance(q.sharding, NamedSharding) or mesh is None or mesh.empty:
        return None
    spec = tuple(q.sharding.spec) + (None,) * (len(q.shape) - len(q.sharding.spec))
    roles = signature.operands[0]
    plan = _Plan(mesh, _axes(spec[roles.index("b")]), _axes(spec[roles.index("h")]))
    n_batch, n_heads = plan.size(plan.batch), plan.size(plan.heads)
    shapes = [a.shape for a in arg_shapes]
    rows = {i: s[0] for i, (r, s) in enumerate(zip(signature.operands, shapes)) if r[0] == "r"}
    batch_ok = (q.shape[roles.index("b")] % n_batch == 0
                and all(n % n_batch == 0 or n == 1 for n in rows.values()))
    if signature.dropout and n_batch > 1:  # only seed rows that split with the batch
        batch_ok = batch_ok and rows.get(signature.dropout_rows, 1) % n_batch == 0
    head_extents = [extent for r, s in zip(signature.operands, shapes)
                    for role, extent in zip(r, s) if role in "hg" or role == "H" and extent != 1]
    heads_ok = n_heads == 1 or (not signature.dropout and not signature.whole_heads
                                and all(extent % n_heads == 0 for extent in head_extents))
    return _Plan(mesh, plan.batch if batch_ok else (), plan.heads if heads_ok else ())


def _shardings(plan: _Plan | None, roles, arrays, q):
    """The sharding of each of `arrays` (roles `roles`) under the plan of q's call."""
    if plan is None:
        replicated = GSPMDSharding.get_replicated(q.sharding._device_assignment)
        return tuple(replicated for _ in arrays)
    return tuple(NamedSharding(plan.mesh, plan.spec(r, a.shape)) for r, a in zip(roles, arrays))


# ---- custom_partitioning -------------------------------------------------------------

def _partitioned(fn, signature: Signature):
    fn = folding.tuple_results(fn)

    @custom_partitioning
    def call(*args):
        return fn(*args)

    def partition(mesh, arg_shapes, result_shape):
        plan = _plan(signature, mesh, arg_shapes)
        results = _shardings(plan, signature.results, result_shape, arg_shapes[0])
        arguments = _shardings(plan, signature.operands, arg_shapes, arg_shapes[0])
        summed = [plan.summed_axes(signature, i, r.shape) if plan else ()
                  for i, r in enumerate(result_shape)]

        def lower(*args):
            outs = fn(*args)
            return tuple(jax.lax.psum(out, axes) if axes else out
                         for out, axes in zip(outs, summed))

        return mesh, lower, results, arguments

    def infer(mesh, arg_shapes, result_shape):
        return _shardings(_plan(signature, mesh, arg_shapes), signature.results, result_shape,
                          arg_shapes[0])

    call.def_partition(partition, infer_sharding_from_operands=infer,
                       sharding_rule=functools.partial(_sharding_rule, signature))
    return call


def _sharding_rule(signature: Signature, mesh, operand_types, result_types) -> SdyShardingRule:
    """Shardy's view of the roles: batch and head factors shared, the rest replicated."""
    del mesh

    def shape(t):
        return tuple(ir.RankedTensorType(t).shape)

    operand_shapes = [shape(t) for t in operand_types]
    result_shapes = [shape(t) for t in result_types]
    q_roles, q_shape = signature.operands[0], operand_shapes[0]
    batch, heads = q_shape[q_roles.index("b")], q_shape[q_roles.index("h")]
    kv_heads = next((extent for roles, s in zip(signature.operands, operand_shapes)
                     for role, extent in zip(roles, s) if role == "g"), heads)
    # Grouped heads: q's heads are (kv head, member of its group), the kv head major.
    group = heads // kv_heads if 1 < kv_heads < heads and heads % kv_heads == 0 else 1
    sizes: dict[str, int] = {}
    replicated: list[str] = []

    def fresh(size=None):
        name = f"x{len(replicated)}"
        replicated.append(name)
        if size is not None:
            sizes[name] = size
        return name

    def factor(role, extent):
        if role in "bBr" and extent == batch:
            return "b"
        if role == "b" and batch and extent % batch == 0:
            return CompoundFactor("b", fresh(extent // batch))
        if role in "hH" and extent == heads:
            if group > 1:
                sizes["grp"] = group
                return CompoundFactor("k", "grp")
            return "k"
        if role == "g" and extent == kv_heads and (group > 1 or extent == heads):
            return "k"
        return fresh()

    def mapping(roles, s):
        return ArrayMapping(*(factor(role, extent) for role, extent in zip(roles, s)))

    operands = tuple(mapping(r, s) for r, s in zip(signature.operands, operand_shapes))
    results = tuple(mapping(r, s) for r, s in zip(signature.results, result_shapes))
    # Sums over the batch inside the call (batch_sums, a shared bias's gradient) are not
    # told to Shardy: the batch factor lives in other results too, which a reduction
    # factor may not. The partition callback completes them with a psum.
    return SdyShardingRule(operands, results, need_replication_factors=tuple(replicated),
                           **sizes)
