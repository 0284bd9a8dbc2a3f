"""The "cudnn" backend: cuDNN's fused SDPA through the cuDNN frontend graph API.

Kernels: ops_cuda/cudnn/*.cc (cudnn_sdpa.cc the bf16/fp16 handlers, cudnn_fp8.cc the
FP8 ones), built into libfusedattn_cudnn, which library.py loads (with libcudnn) and
asks about graphs. Two XLA FFI calls
around a `jax.custom_vjp`:

    fusedattn_cudnn_fwd(q, k, v, bias, seqlen_q, seqlen_kv, offsets, rng, sink) -> (o, stats)
    fusedattn_cudnn_bwd(q, k, v, bias, seqlen_q, seqlen_kv, offsets, rng, sink, o, stats, do)
        -> (dq, dk, dv, dbias, dsink)

q/k/v are the canonical [b, s, h, d] arrays, read by cuDNN as strided
[b, h, s, d] views (no transposes); stats is cuDNN's float32 log-sum-exp
[b', h, sq', 1], saved for the backward. A call nobody differentiates (the
custom_vjp's primal) runs the forward with the attribute training=false: cuDNN's
inference graph, without stats (its stats result is a float32 [0] placeholder,
dropped at once), which lets cuDNN pick another engine, as JAX's own cuDNN
attention does; the forward rule of a differentiated call passes training=true.
On ragged rows the two forwards take the same time (benchmarks/probes/cudnn_thd_parts.py,
H200: 0.107 against 0.103 ms at b=4, s=2048; 0.288 against 0.286 at b=1, s=8192).
Graphs are built once per static configuration and device and cached in the
library; `supports` builds them (the training forward and the backward) at trace
time, so a configuration cuDNN cannot run is rejected with cuDNN's own reason
and "auto" moves on to flash or xla. Each FFI call's graph is also built when the
call is traced, to size its workspace (a uint8 result XLA allocates: the handlers
allocate nothing, so XLA may record them into its command buffers); where cuDNN
cannot build the inference forward, that call runs the training forward.

What it serves (everything else is rejected by `supports` with the reason):

- every layout (THD through cuDNN's ragged offsets), bf16/fp16, head dims
  multiples of 8 up to 128 (256 on Hopper), GQA/MQA;
- all six masks. Padding and packing: cuDNN runs one batch entry per segment
  slot (config.sequence.max_segments_per_seq per row) with per-slot lengths and,
  unless the descriptor is the one-sequence-per-row seqlens form, ragged element
  offsets. The lengths forms of the descriptor give the slots directly; segment
  ids are paired into slots by id. Declared max_seqlen_q/kv bound cuDNN's work;
  a row that breaks the configuration (too many segments, a segment over a bound,
  ...) raises eagerly or reports through checkify, and its outputs are NaN
  (`base.guard`). Query rows with no visible key output zeros and get zero
  gradients (masked here: cuDNN leaves them unset);
- sliding windows (window_size, inclusive, from the mask's diagonal);
- post-scale bias [b|1, h|1, sq, skv] with its gradient, and pre-scale bias
  as the post-scale bias `bias * scale`, also under padding masks of the seqlens
  form (one sequence per row: the bias indexes its positions), not with packed
  segments;
- ALiBi under masks "causal" and "padding_causal" (cuDNN adds slope_h * (j - i)
  below the top-left diagonal, its slopes the standard ones of the query heads,
  which the xla backend also draws), dense, padded and packed; not with given
  slopes (`bias`), and the heads do not shard under a mesh;
- softmax "off_by_one" and "learnable" through cuDNN's sink token (cuDNN >= 9.13),
  with the offset's gradient;
- dropout with cuDNN's own Philox generator: seed = the dropout key's two
  words as one int64, offset 0. The mask is NOT the one of the shared Philox
  dropout (fusedattn/ops/philox.py) that the xla and flash backends draw, so
  dropout outputs match the other backends only in distribution; the same key
  gives the same mask (forward and backward agree, runs repeat, and the forward
  without stats keeps cuDNN's composite implementation, that of the training
  forward, so a call nobody differentiates draws it too);
- deterministic backward (config.deterministic_backward) through cuDNN's
  deterministic algorithm;
- FP8 (config.fp8.enabled) through cuDNN's FP8 graphs on Hopper and newer: dense
  "no_mask" and "causal" (fp8_calls.py, fp8_vjp.py; docs/fp8.md says what else);
- context parallelism (config.context_parallel) per block through lse.py: cuDNN reads
  no token positions, so each chunk pair is a "no_mask" or top-left "causal" call (or
  skipped), which serves dense "no_mask" and "causal" masks (also "causal_bottom_right"
  with sq == skv) with every softmax variant; context_parallel.verdict says why not
  for the rest (padding, packing, windows, bias, ALiBi, dropout).

Under jax.vmap the mapped axis folds into the batch (one cuDNN call); a vmap
over dropout keys or softmax offsets runs one call per example instead, since
cuDNN takes one seed and one offset row per call. cuDNN sums dsink and the dbias
of a bias shared by the batch over the whole call, so a vmapped backward (of
jax.vmap(jax.grad(f)) or of jax.grad(jax.vmap(f)): its vmap rule cannot tell them
apart) makes them per example when they are differentiated: dsink from the
forward's statistics beside the call, dbias by broadcasting the shared bias over
the folded rows in the backward call (still one call; the bias and its gradient
then take examples x rows times the memory). Under a device mesh the calls
shard over the batch and head axes of q without gathering; dsink and the dbias
of a shared bias, which cuDNN sums inside the call, are psummed over the sharded
axes. With dropout the batch and heads stay unsharded (gathered): a shard
cannot draw the unsharded call's mask from cuDNN's generator. Both through the
shared mechanism of partitioning.py.

The package, one job a module (each imports only the ones before it):

    library.py    loading libfusedattn_cudnn and libcudnn; cuDNN's verdict on a graph,
                  and a call's workspace size
    graph_key.py  the static configuration of a call (_Static: the FFI attributes) and
                  the library's graph parameters
    segments.py   the sequence descriptor -> cuDNN's segment slots, per-token masks, and
                  the rows cuDNN cannot express
    ffi_calls.py  the two FFI calls and their operands, sharded and folded under vmap
    vjp.py        the custom_vjp over the FFI calls (the op)
    lse.py        the log-sum-exp block entry points of context parallelism
                  (attention_with_lse, attention_backward_from_lse: dense "no_mask" and
                  top-left "causal" blocks, cuDNN's stats as the log-sum-exp)
    fp8_calls.py  the two FP8 FFI calls
    fp8_vjp.py    the FP8 op: the recipe of ops/fp8.py around them, a custom_vjp
    backend.py    CudnnBackend: supports() and its reasons, attention() (bias, ALiBi,
                  dropout seed, softmax offset -> the op), fp8_attention()
"""

from fusedattn.ops.backends.cudnn.backend import BACKEND, CudnnBackend
from fusedattn.ops.backends.cudnn.lse import attention_backward_from_lse, attention_with_lse

__all__ = ["BACKEND", "CudnnBackend", "attention_backward_from_lse", "attention_with_lse"]
