"""Batching of the compiled backends' FFI calls: jax.vmap folded into the kernel's batch.

partitioning.op wraps every FFI call of the compiled backends in `fold`, a
`jax.custom_batching.custom_vmap` whose rule reshapes the mapped axis into the kernel's
batch: one call, never a loop. The operands' roles are those of a partitioning.Signature
(its module docstring): operands whose first role is b, B or r fold; operands whose first
role is none of them are per call (one dropout seed, one offset row), and a vmap over them
runs one call per example (jax.lax.map).

Under vmap every result the caller reads comes back per example, because the vmap rule
cannot tell jax.vmap(jax.grad(f)) (per-example gradients: a sum over all folded examples
would be wrong) from jax.grad(jax.vmap(f)) (which sums the per-example values itself):

- a batch sum is summed per example from its per-row terms (`batch_sum_rows`, a
  function of the call's operands run beside the folded call);
- a shared B operand whose gradient (a B result) is read folds per row like a mapped
  one, broadcast over every folded row (materialized), so the call's sum over the
  rows sharing it is taken per example. Still one call, but the operand and its
  gradient take examples x rows times the memory of the shared one.

Results named `unread` (the caller discards them) skip that work and stay sums over
all folded examples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from fusedattn.ops.backends.partitioning import Signature

_FOLDED = frozenset("bBr")  # first roles of operands folded under vmap


def tuple_results(fn):
    """fn, returning a tuple even where it returns one array."""
    def call(*args):
        out = fn(*args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)
    return call


def fold(call, signature: Signature, fn, batch_sum_rows):
    """`call` (the partitioned FFI call) with a vmap rule that folds the mapped axis into
    the kernel's batch, as the module docstring says. `fn` is the bare call (its
    per-example result shapes), batch_sum_rows as for partitioning.op."""
    op_ = jax.custom_batching.custom_vmap(lambda *args: call(*args))
    tuple_fn = tuple_results(fn)
    read = frozenset(range(len(signature.results))) - signature.unread
    shared_gradient_read = any(signature.results[i][0] == "B" for i in read)

    @op_.def_vmap
    def rule(axis_size, in_batched, *args):
        roles = signature.operands
        if any(batched and r[:1] not in _FOLDED for r, batched in zip(roles, in_batched)):
            return _mapped(op_, in_batched, args)
        rows = args[0].shape[1] if in_batched[0] else args[0].shape[0]
        folded = []
        for a, r, batched in zip(args, roles, in_batched):
            shared = r[0] == "B" and not batched and a.shape[0] == 1 and not shared_gradient_read
            if r[:1] not in _FOLDED or shared:
                folded.append(a)  # per call, or shared by every row
                continue
            if not batched:
                a = jnp.broadcast_to(a, (axis_size,) + a.shape)
            if r[0] == "B":
                a = jnp.broadcast_to(a, (axis_size, rows) + a.shape[2:])
            folded.append(a.reshape((-1,) + a.shape[2:]))
        outs = op_(*folded)
        sum_terms = (dict(zip(sorted(signature.batch_sums), batch_sum_rows(*folded)))
                     if signature.batch_sums & read else {})
        example = jax.eval_shape(tuple_fn, *(
            jax.ShapeDtypeStruct(a.shape[1:] if batched else a.shape, a.dtype)
            for a, batched in zip(args, in_batched)))
        unfolded, batched_out = [], []
        for i, (out, r, one) in enumerate(zip(outs, signature.results, example)):
            if i in read and i in sum_terms:
                terms = sum_terms[i]
                unfolded.append(jnp.sum(terms.reshape((axis_size, -1) + terms.shape[1:]), axis=1))
                batched_out.append(True)
                continue
            if r[:1] not in ("b", "B") or r[0] == "B" and out.shape[0] == 1:
                unfolded.append(out)  # unread: the sum over every folded row
                batched_out.append(False)
                continue
            out = out.reshape((axis_size, -1) + out.shape[1:])
            if out.shape[1] != one.shape[0]:  # a shared (extent 1) dim, per example
                out = jnp.sum(out, axis=1, keepdims=True)
            unfolded.append(out)
            batched_out.append(True)
        return tuple(unfolded), tuple(batched_out)

    return op_


def _mapped(op_, in_batched, args):
    """One call per mapped example (jax.lax.map): exact, but sequential."""
    mapped = [a for a, batched in zip(args, in_batched) if batched]

    def one(example):
        values = iter(example)
        return op_(*(next(values) if batched else a for a, batched in zip(args, in_batched)))

    outs = jax.lax.map(one, mapped)
    return outs, jax.tree.map(lambda _: True, outs)
