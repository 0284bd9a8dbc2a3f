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

Blocks. For the xla backend, which computes every score it is given, each device's shard
is cut into `pieces` (its two chunks under load balancing, else one) and every (query
piece, key piece) pair whose mask has no visible entry (causal future, outside the
sliding window, other documents only) is skipped with `jax.lax.cond`, so under
load-balanced causal masks an off-diagonal step does half the work. The flash kernels
skip invisible tiles themselves (from the tokens' positions and segments, in any order),
so they take a device's whole shard against a whole block in one call (one piece), and
only blocks with no visible entry are skipped. cuDNN reads no token positions, so
cudnn is called per chunk pair with the pair's own mask (blocks._pair_kind, from the
pair's global chunk indices): "no_mask" where wholly visible, top-left "causal" on the
diagonal, nothing where invisible; that serves dense "no_mask" and "causal" masks
(one call per block without a causal mask), and verdict says why not the rest. A pair
runs the backend's log-sum-exp entry point: xla (every feature), flash
(bias arrays included; no ALiBi, and no dropout, its masks being keyed by
block-local indices) or cudnn (backends/cudnn/lse.py). Softmax sinks (off_by_one,
learnable) join once per query after the merge; dropout masks are drawn at the global
query and key indices, so every result equals the unsharded call's (up to float32
rounding of the merge).

The package, one job a module (each imports only the ones before it):

    load_balance.py  the load-balanced device layout and its reorders
    plan.py          which backends serve (verdict), the mesh axis, the static plan of a
                     call and its operands in device order; to_device_layout
    sharding.py      shard_map over the context axis alone (operand specs, explicit meshes)
    blocks.py        the per-device loops: over K/V blocks (ring or all-gather) and over
                     (query piece, key piece) pairs
    forward.py       one device's forward: pairs merged by log-sum-exp, the softmax sink
    backward.py      one device's gradients from the forward's log-sum-exp
    op.py            attention() (a custom_vjp over the two) and max_logit()
"""

from fusedattn.ops.context_parallel.load_balance import (
    inverse_reorder_causal_load_balancing,
    load_balance_permutation,
    reorder_causal_load_balancing,
)
from fusedattn.ops.context_parallel.op import attention, max_logit
from fusedattn.ops.context_parallel.plan import to_device_layout, verdict

__all__ = [
    "attention", "inverse_reorder_causal_load_balancing", "load_balance_permutation",
    "max_logit", "reorder_causal_load_balancing", "to_device_layout", "verdict",
]
