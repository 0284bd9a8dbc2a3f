"""Runs the paged decode op (backend "auto", the "decode" kernel on a GPU) three times at
one shape of benchmarks/decode.py, for a kernel profiler to attach to (e.g. `ncu
--kernel-name regex:paged_decode --launch-skip 2 -c 1 python
benchmarks/probes/decode_kernel_profile.py`). GQA 32/8, d=128, bf16, random inputs,
every sequence s_kv keys long, its pages a random permutation of the pool.

    python benchmarks/probes/decode_kernel_profile.py --shape 16,8192,1,64   # b,s_kv,s_q,page
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import _benchmarks_on_path  # noqa: F401  (benchmarks/ on sys.path)
from common import random_normal
from decode import HEAD_DIM, HEADS, KV_HEADS, ours_paged, paged_cache


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="16,8192,1,64", help="b,s_kv,s_q,page")
    args = parser.parse_args()
    b, s_kv, s_q, page = (int(x) for x in args.shape.split(","))
    keys = jax.random.split(jax.random.key(0), 4)
    q = random_normal(keys[0], (b, s_q, HEADS, HEAD_DIM), jnp.bfloat16)
    k = random_normal(keys[1], (b, s_kv, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    v = random_normal(keys[2], (b, s_kv, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    k_pages, v_pages, table = paged_cache(keys[3], k, v, page)
    lengths = (jnp.full((b,), s_q, jnp.int32), jnp.full((b,), s_kv, jnp.int32))
    attend = ours_paged(s_q)
    for _ in range(3):  # the first call compiles; profile a later one
        jax.block_until_ready(attend(q, k_pages, v_pages, table, *lengths))


if __name__ == "__main__":
    main()
