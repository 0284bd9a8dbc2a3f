"""Runs one impl of benchmarks/flash.py (default: the flash backend) forward and fwd+bwd once
each, after a warm-up call, at one shape, for a kernel profiler to attach to (e.g. `ncu
--kernel-name regex:flash -c 4 python benchmarks/probes/flash_kernel_profile.py`). bf16,
random normal inputs. `--impl fa3` runs FlashAttention-3 (flash_attn3_jax), so that its
kernels are profiled the same way (scripts/flash_profile.sh with PEER=fa3); `--impl
flash_dropout` runs the flash backend with dropout 0.1.

    python benchmarks/probes/flash_kernel_profile.py --shape 4,2048,16,16,128 --causal
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import _benchmarks_on_path  # noqa: F401  (benchmarks/ on sys.path)
from flash import impls


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="4,2048,16,16,128", help="b,s,h,h_kv,d")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--impl", default="flash", help="an impl of benchmarks/flash.py (flash, cudnn, fa3, ...)")
    args = parser.parse_args()
    b, s, h, h_kv, d = (int(x) for x in args.shape.split(","))
    table = impls(args.causal, d, dropout=True)  # flash_dropout and cudnn_dropout too
    if args.impl not in table:
        raise SystemExit(f"--impl: {args.impl!r} is not an impl of benchmarks/flash.py at head dim {d}; "
                         f"choose from {sorted(table)}")
    attend = table[args.impl]
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, s, h, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, h_kv, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, h_kv, d), jnp.float32).astype(jnp.bfloat16)
    do = jax.random.normal(keys[3], (b, s, h, d), jnp.float32).astype(jnp.bfloat16)

    forward = jax.jit(attend)
    forward_backward = jax.jit(lambda q, k, v, do: jax.vjp(attend, q, k, v)[1](do))
    for _ in range(2):  # the first call compiles; the second is the one to profile
        jax.block_until_ready(forward(q, k, v))
        jax.block_until_ready(forward_backward(q, k, v, do))


if __name__ == "__main__":
    main()
