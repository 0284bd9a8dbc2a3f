"""Where the time of a packed (THD) cudnn call goes: the whole call against its parts.

For each shape of benchmarks/cudnn.py (rows of 4 equal sequences, lengths and
offsets descriptor, bounds declared), forward only:

- "whole": fused_attn with backend "cudnn", jitted;
- "whole_unchecked": the same with config.sequence.check_bounds = False (no
  checkify effect: JAX's C++ dispatch fast path);
- "slots": the backend's descriptor reading alone (slot table, per-token masks,
  the guard's flags), jitted;
- "ffi": the cuDNN FFI call alone, on a precomputed slot table: the training
  forward (with stats), as "whole" runs it on ragged rows;
- "ffi_inference": the same without stats (training=false), the forward that
  dense rows get when nothing differentiates;
- "dense": the same q, k, v as dense rows (no descriptor), for reference.

    python benchmarks/probes/cudnn_thd_parts.py --out /tmp/thd_parts.json
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import _benchmarks_on_path  # noqa: F401  (benchmarks/ on sys.path)
from cudnn import SHAPES, ours, ours_thd, thd_config, thd_descriptor
from common import median_ms, parse_args, random_normal, timing, write_results
from fusedattn.ops import AttentionSpec, SequenceDescriptor
from fusedattn.ops.backends import cudnn
from fusedattn.ops.backends.base import CanonicalArgs


def parts(q, k, v, causal: bool) -> dict:
    b, t, h, d = q.shape
    spec = AttentionSpec.from_config(thd_config(causal, t))
    static = cudnn.graph_key._static(spec, d ** -0.5, dropout=False, has_bias=False,
                                     seqlen_q=t, seqlen_kv=t)
    sequence = thd_descriptor(b, t)

    @jax.jit
    def slots(q, k, v, sequence):
        return cudnn.segments._segments(static, CanonicalArgs(q, k, v, tokens=None,
                                                              sequence=sequence))

    table = slots(q, k, v, sequence).slots
    bias, rng = jnp.zeros((1, 1, 1, 1), q.dtype), jnp.zeros((4,), jnp.uint32)
    sink = jnp.zeros((h,), jnp.float32)
    def ffi(training):
        forward = cudnn.ffi_calls._folding_op(static, False, training=training)
        call = jax.jit(lambda q, k, v, table: forward(q, k, v, bias, table, rng, sink)[0])
        return lambda: call(q, k, v, table)

    whole = jax.jit(ours_thd(causal))
    whole_unchecked = jax.jit(ours_thd(causal, check_bounds=False))
    dense = jax.jit(ours(causal))
    return {"whole": lambda: whole(q, k, v),
            "whole_unchecked": lambda: whole_unchecked(q, k, v), "slots": lambda: slots(q, k, v, sequence),
            "ffi": ffi(True), "ffi_inference": ffi(False), "dense": lambda: dense(q, k, v)}


def main():
    args = parse_args("/tmp/cudnn_thd_parts.json")
    rows = []
    for b, sq, _, h, d in SHAPES:
        keys = jax.random.split(jax.random.key(sq + d), 3)
        q, k, v = (random_normal(key, (b, sq, h, d), jnp.bfloat16) for key in keys)
        for causal in (False, True):
            name = f"b{b}_s{sq}_h{h}_d{d}" + ("_causal" if causal else "")
            row = {"name": name}
            for part, fn in parts(q, k, v, causal).items():
                row[part] = round(median_ms(fn, **timing(args)), 4)
            rows.append(row)
            print(row, flush=True)
    write_results(args.out, rows)
    columns = ("whole", "whole_unchecked", "slots", "ffi", "ffi_inference", "dense")
    print(f"\n{'case':<26}" + "".join(f"{part:>15}" for part in columns) + "   (ms, forward)")
    for r in rows:
        print(f"{r['name']:<26}" + "".join(f"{r[part]:>15.3f}" for part in columns))


if __name__ == "__main__":
    main()
