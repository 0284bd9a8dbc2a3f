"""Context parallelism: the sharded attention against one unsharded call.

For each sequence length, load balancing ("on": each device holds chunks i and 2N-1-i
of the causal sequence, the inputs reordered so; "off": natural token order, contiguous
shards) and strategy ("ring", "all_gather") the script times fused_attn with
config.context_parallel.axis = "cp" over a 1-D mesh of the first --devices devices,
forward ("fwd") and forward + VJP ("fwd+bwd"), next to the unsharded call on one device
("unsharded"). With --devices 1 the ring runs over a one-device axis, which measures the
per-block overhead of the context-parallel path (merges, skipped-block predicates, the
shard_map) against one unsharded call. Every row also records each device's compiled
memory (argument, output and temporary bytes from memory_analysis), the first call's
seconds (compilation and one call) and, for the flash backend on a GPU, which kernels
(sm90 / sm80) ran forward and backward.

With --trace-seqlen S, after timing length S each strategy's fwd+bwd is traced for
--trace-calls calls with jax.profiler, and the result's "overlap" entries say per GPU how
much of the communication (NCCL kernels) ran while compute kernels ran on another stream
(kernel_profile.communication_overlap); where no GPU trace can be read (a CPU) an entry
holds the error instead; each entry has the seconds its trace took. The results file is
rewritten after each length, so a run cut short keeps the lengths it finished.

    python benchmarks/context_parallel.py --devices 4 --backend flash --seqlens 131072 \
        --trace-seqlen 131072 --out benchmarks/results/context_parallel.json
    # CPU smoke run with fake devices (not a measurement):
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/context_parallel.py \
        --devices 4 --quick --trace-seqlen 256 --out /tmp/cp.json
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fusedattn
from fusedattn.ops import fused_attn, reorder_causal_load_balancing

from common import median_ms, parse_args, random_normal, timing, write_results
from context_parallel_table import table_lines
from kernel_profile import communication_overlap, profile_call, read_trace

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
    parser.add_argument("--load-balance", nargs="*", choices=("on", "off"), default=["on", "off"],
                        help="load-balanced token order, natural order, or both (rows of each)")
    parser.add_argument("--trace-seqlen", type=int, default=None,
                        help="after timing this length, trace each strategy's fwd+bwd and "
                             "measure how much communication overlaps compute")
    parser.add_argument("--trace-calls", type=int, default=3, help="calls per trace")
    parser.add_argument("--trace-dir", default=None,
                        help="where the traces go (default: a new temporary folder)")


def config_for(args, strategy: str | None, load_balance: bool = True):
    config = fusedattn.configs.attention_config()
    config.backend = args.backend
    config.mask = "causal"
    if strategy is not None:
        config.context_parallel.axis = "cp"
        config.context_parallel.strategy = strategy
        config.context_parallel.load_balance = load_balance
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


def measure(args, s: int, mesh) -> tuple[list[dict], list[dict]]:
    """The rows of length s (unsharded, then each load balancing x strategy x pass) and,
    where s is --trace-seqlen, the overlap entries of the traced strategies."""
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(s), 4)
    q = random_normal(keys[0], (args.batch, s, args.heads, args.head_dim), dtype)
    k = random_normal(keys[1], (args.batch, s, args.kv_heads, args.head_dim), dtype)
    v = random_normal(keys[2], (args.batch, s, args.kv_heads, args.head_dim), dtype)
    w = random_normal(keys[3], q.shape, dtype)
    n = mesh.shape["cp"]
    shape = dict(batch=args.batch, seqlen=s, heads=args.heads, kv_heads=args.kv_heads,
                 head_dim=args.head_dim, dtype=dtype.name, devices=n, backend=args.backend,
                 **kernel_note(args, s))
    rows, overlaps = [], []
    for name, fn in passes(config_for(args, None), w).items():
        rows.append({**shape, "impl": "unsharded", "load_balance": None, "pass": name,
                     **timed(args, fn, (q, k, v))})
    sharding = NamedSharding(mesh, P(None, "cp"))
    for balance in args.load_balance:
        balanced = balance == "on"
        order = (lambda x: reorder_causal_load_balancing(x, n)) if balanced else (lambda x: x)
        q_cp, k_cp, v_cp, w_cp = (jax.device_put(order(x), sharding) for x in (q, k, v, w))
        with jax.set_mesh(mesh):
            for strategy in args.strategies:
                fns = passes(config_for(args, strategy, balanced), w_cp)
                for name, fn in fns.items():
                    rows.append({**shape, "impl": strategy, "load_balance": balance, "pass": name,
                                 **timed(args, fn, (q_cp, k_cp, v_cp))})
                if s == args.trace_seqlen and balance == args.load_balance[0]:
                    overlaps.append({"seqlen": s, "devices": n, "impl": strategy,
                                     "load_balance": balance, "pass": "fwd+bwd",
                                     **trace_overlap(args, fns["fwd+bwd"], (q_cp, k_cp, v_cp),
                                                     f"{strategy}_{s}")})
    add_rates(rows)
    for row in rows + overlaps:
        print(row, flush=True)
    return rows, overlaps


def timed(args, fn, arrays: tuple) -> dict:
    """first_call_s (the first call's wall seconds: compilation and one call), median_ms and
    memory_per_device of fn(*arrays)."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*arrays))
    first_call_s = round(time.perf_counter() - start, 2)
    return {"median_ms": median_ms(fn, *arrays, **timing(args)), "first_call_s": first_call_s,
            "memory_per_device": memory(fn, *arrays)}


def kernel_note(args, s: int) -> dict:
    """{"kernels": "forward sm90, backward sm90"} for the flash backend on a CUDA GPU (the
    kernels every block call gets), else {}."""
    if args.backend != "flash" or jax.devices()[0].platform != "gpu":
        return {}
    from fusedattn.ops.backends import flash_gpu

    forward = flash_gpu.cuda_forward_kernel(args.head_dim, s)
    backward = flash_gpu.cuda_backward_kernel(args.head_dim, s, s, deterministic=False)
    return {"kernels": f"forward {forward}, backward {backward}"}


def trace_overlap(args, fn, arrays: tuple, name: str) -> dict:
    """Traces --trace-calls calls of fn(*arrays) (compiled and timed already) and returns
    kernel_profile.communication_overlap of the trace, or {"error": ...} where none was
    taken or it holds no GPU events (a CPU); "trace_dir" names the trace either way."""
    trace_dir = Path(args.trace_dir) / name
    start = time.perf_counter()
    profile = profile_call(fn, arrays, trace_dir, args.trace_calls)
    if "error" not in profile:
        try:
            overlap = communication_overlap(read_trace(trace_dir), args.trace_calls)
            profile = {"trace_dir": str(trace_dir),
                       "device_ms_per_call_all_gpus": profile["device_ms_per_step"], **overlap}
        except (OSError, ValueError) as error:
            profile = {"error": f"{type(error).__name__}: {error}", "trace_dir": str(trace_dir)}
    return {**profile, "trace_s": round(time.perf_counter() - start, 2)}


def causal_flops(row: dict) -> float:
    """Matmul FLOPs of one causal call (half of 4 b h s^2 d), x 3.5 with the backward."""
    forward = 2.0 * row["batch"] * row["heads"] * row["seqlen"] ** 2 * row["head_dim"]
    return forward * (3.5 if row["pass"] == "fwd+bwd" else 1.0)


def add_rates(rows: list[dict]) -> None:
    """TF/s per device, and for sharded rows the scaling efficiency: the unsharded call's time
    (same length and pass) over (this time x devices); 1.0 is perfect scaling, the issue's
    target 0.85."""
    alone = {(row["seqlen"], row["pass"]): row["median_ms"] for row in rows
             if row["impl"] == "unsharded"}
    for row in rows:
        n = 1 if row["impl"] == "unsharded" else row["devices"]
        row["tflops_per_device"] = causal_flops(row) / (row["median_ms"] * 1e-3) / n / 1e12
        if row["impl"] != "unsharded":
            row["scaling_efficiency"] = alone[(row["seqlen"], row["pass"])] / (row["median_ms"] * n)


def main():
    args = parse_args("benchmarks/results/context_parallel.json", add_arguments)
    if args.devices > jax.device_count():
        raise SystemExit(f"--devices {args.devices}: only {jax.device_count()} devices here")
    if not args.load_balance:
        raise SystemExit("--load-balance: name 'on', 'off' or both")
    seqlens = args.seqlens or (QUICK_SEQLENS if args.quick else SEQLENS)
    if args.trace_seqlen is not None and args.trace_seqlen not in seqlens:
        raise SystemExit(f"--trace-seqlen {args.trace_seqlen}: not among the lengths {list(seqlens)}; "
                         "name one of them")
    args.trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="cp_trace_")
    mesh = jax.make_mesh((args.devices,), ("cp",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:args.devices])
    rows, overlaps = [], []
    for s in seqlens:
        start = time.perf_counter()
        more_rows, more_overlaps = measure(args, s, mesh)
        print(f"s={s}: {time.perf_counter() - start:.1f} s", flush=True)
        rows += more_rows
        overlaps += more_overlaps
        write_results(args.out, rows, mask="causal", load_balance=args.load_balance,
                      overlap=overlaps)
    print("\n".join(table_lines(rows, overlaps)))


if __name__ == "__main__":
    main()
