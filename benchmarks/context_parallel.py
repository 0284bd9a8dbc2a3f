"""Context parallelism: the sharded attention against one unsharded call.

For each sequence length and strategy ("ring", "all_gather"; load-balanced causal
masks) the script times fused_attn with config.context_parallel.axis = "cp" over a
1-D mesh of the first --devices devices, forward ("fwd") and forward + VJP
("fwd+bwd"), next to the unsharded call on one device ("unsharded"). With
--devices 1 the ring runs over a one-device axis, which measures the per-block
overhead of the context-parallel path (merges, skipped-block predicates, the
shard_map) against one unsharded call. Every row also records each device's
compiled memory (argument, output and temporary bytes from memory_analysis).

    python benchmarks/context_parallel.py --devices 8 --out benchmarks/results/context_parallel.json
    # CPU smoke run with fake devices (not a measurement):
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/context_parallel.py \\
        --devices 4 --quick --out /tmp/cp.json
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fusedattn
from fusedattn.ops import fused_attn, reorder_causal_load_balancing

from common import median_ms, parse_args, random_normal, timing, write_results

SEQLENS = (8192, 16384, 32768)
QUICK_SEQLENS = (256,)


def add_arguments(parser):
    parser.add_argument("--devices", type=int, default=jax.device_count(),
                        help="devices along the context axis")
    parser.add_argument("--backend", default="xla", help="the per-block backend (xla, flash)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seqlens", type=int, nargs="*", default=None)
    parser.add_argument("--strategies", nargs="*", default=["ring", "all_gather"])


def config_for(args, strategy: str | None):
    config = fusedattn.configs.attention_config()
    config.backend = args.backend
    config.mask = "causal"
    if strategy is not None:
        config.context_parallel.axis = "cp"
        config.context_parallel.strategy = strategy
        config.context_parallel.load_balance = True
    return config


def passes(config, w):
    """{pass name: jitted function of (q, k, v)}."""
    def forward(q, k, v):
        return fused_attn((q, k, v), config=config)

    def forward_backward(q, k, v):
        out, vjp = jax.vjp(forward, q, k, v)
        return out, vjp(w)

    return {"fwd": jax.jit(forward), "fwd+bwd": jax.jit(forward_backward)}


def memory(fn, *arrays) -> dict:
    analysis = fn.lower(*arrays).compile().memory_analysis()
    return {name: int(getattr(analysis, f"{name}_size_in_bytes"))
            for name in ("argument", "output", "temp")}


def measure(args, s: int, mesh) -> list[dict]:
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(s), 4)
    q = random_normal(keys[0], (args.batch, s, args.heads, args.head_dim), dtype)
    k = random_normal(keys[1], (args.batch, s, args.kv_heads, args.head_dim), dtype)
    v = random_normal(keys[2], (args.batch, s, args.kv_heads, args.head_dim), dtype)
    w = random_normal(keys[3], q.shape, dtype)
    n = mesh.shape["cp"]
    shape = dict(batch=args.batch, seqlen=s, heads=args.heads, kv_heads=args.kv_heads,
                 head_dim=args.head_dim, dtype=dtype.name, devices=n, backend=args.backend)
    rows = []
    for name, fn in passes(config_for(args, None), w).items():
        rows.append({**shape, "impl": "unsharded", "pass": name,
                     "median_ms": median_ms(fn, q, k, v, **timing(args)),
                     "memory_per_device": memory(fn, q, k, v)})
    sharding = NamedSharding(mesh, P(None, "cp"))
    q_cp, k_cp, v_cp, w_cp = (jax.device_put(reorder_causal_load_balancing(x, n), sharding)
                              for x in (q, k, v, w))
    with jax.set_mesh(mesh):
        for strategy in args.strategies:
            for name, fn in passes(config_for(args, strategy), w_cp).items():
                rows.append({**shape, "impl": strategy, "pass": name,
                             "median_ms": median_ms(fn, q_cp, k_cp, v_cp, **timing(args)),
                             "memory_per_device": memory(fn, q_cp, k_cp, v_cp)})
    add_rates(rows)
    for row in rows:
        print(row)
    return rows


def causal_flops(row: dict) -> float:
    """Matmul FLOPs of one causal call (half of 4 b h s^2 d), x 3.5 with the backward."""
    forward = 2.0 * row["batch"] * row["heads"] * row["seqlen"] ** 2 * row["head_dim"]
    return forward * (3.5 if row["pass"] == "fwd+bwd" else 1.0)


def add_rates(rows: list[dict]) -> None:
    """TF/s per device, and for sharded rows the scaling efficiency: the unsharded call's time
    over (this time x devices); 1.0 is perfect scaling, the issue's target 0.85."""
    alone = {row["pass"]: row["median_ms"] for row in rows if row["impl"] == "unsharded"}
    for row in rows:
        n = 1 if row["impl"] == "unsharded" else row["devices"]
        row["tflops_per_device"] = causal_flops(row) / (row["median_ms"] * 1e-3) / n / 1e12
        if row["impl"] != "unsharded":
            row["scaling_efficiency"] = alone[row["pass"]] / (row["median_ms"] * n)


def main():
    args = parse_args("benchmarks/results/context_parallel.json", add_arguments)
    if args.devices > jax.device_count():
        raise SystemExit(f"--devices {args.devices}: only {jax.device_count()} devices here")
    mesh = jax.make_mesh((args.devices,), ("cp",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:args.devices])
    seqlens = args.seqlens or (QUICK_SEQLENS if args.quick else SEQLENS)
    rows = [row for s in seqlens for row in measure(args, s, mesh)]
    write_results(args.out, rows, mask="causal", load_balance=True)


if __name__ == "__main__":
    main()
