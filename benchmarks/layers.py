"""One attention layer, forward + backward: ours (backend auto) against the stock layers.

b=4, L=2048, d_model=2048, 16 heads (head dim 128), causal self-attention,
bf16 compute with float32 parameters. The timed step is the VJP of the layer
output with a random cotangent, with respect to the parameters and the input; with
--wrt params, with respect to the parameters only (the input's gradient, three of the
twelve projection matmuls, is not computed), as the issue's baseline figures appear to
be taken: its hand_cudnn 1.54 ms is below this machine's matmul floor with the input
gradient (1.35 ms of projections at ~790 TF/s plus 0.62 ms of cuDNN attention).

Impls: fusedattn_{nnx,linen,equinox} (config backend "auto"), stock_{nnx,linen,
equinox} (flax.nnx.MultiHeadAttention, flax.linen.MultiHeadDotProductAttention,
equinox.nn.MultiheadAttention vmapped; causal mask arrays) and hand_cudnn (the
same four projections around jax.nn.dot_product_attention(implementation="cudnn"),
without biases), with two diagnostics: hand_cudnn_bias (with the layers' four
biases, so the same work as ours) and hand_cudnn_fused_qkv (q, k, v as one matmul).

Timing: every impl is compiled and warmed up first; then each of --repeats rounds
(21 by default) times every impl once (--iters back-to-back calls, or more to fill
--min-window-ms), in an order rotated by one per round, so all impls meet the same
clocks, temperature and neighbours. "ms" is the median over the rounds; ms_min/ms_max
show the spread.
(Before, each impl was timed in a window of its own, where drift between windows
reads as a gap between impls: fusedattn_linen and fusedattn_nnx lower to the same
program, op for op, yet were once measured 1.979 against 1.884 ms, and 1.914 against
1.905 ms in the run before, with no layer code changed in between.)

    python benchmarks/layers.py --out benchmarks/results/layers.json

With --profile DIR, after the timing (and after the results are written once
without it), each impl's step is traced with jax.profiler (PROFILE_STEPS back-to-back
calls, into DIR/<impl>), and the device time per step by kernel kind, the longest
kernels with their calls per step and the GPU's idle time between kernels
(benchmarks/kernel_profile.py) go under "profile"
in the results, {impl: summary} or {impl: {"error": ...}} where the trace could not
be taken or read (on a CPU there are no GPU streams to read: every impl gets an error).

    python benchmarks/layers.py --out OUT/layers.json --profile OUT/layers_profile

--small (b=2, L=256, d_model=256, 2 heads) is for trying the script out on a CPU.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import equinox as eqx
import flax.linen as linen
import jax
import jax.numpy as jnp
from flax import nnx

import fusedattn
from fusedattn.layers import equinox as fa_equinox
from fusedattn.layers import linen as fa_linen
from fusedattn.layers import nnx as fa_nnx

from common import (H200_MEASURED_MATMUL_FLOPS, calls_per_repeat, mean_call_ms, parse_args,
                    random_normal, write_results)
from kernel_profile import KINDS, print_host, print_idle, print_top_kernels, profile_call

B, L, D_MODEL, HEADS = 4, 2048, 2048, 16
SMALL_SHAPE = (2, 256, 256, 2)  # --small: head dim 128 as in the full shape
DTYPE = jnp.bfloat16
PROFILE_STEPS = 5  # calls traced per impl with --profile
PROFILE_TOP = 8  # longest kernels kept per impl
PROFILE_KERNELS_SHOWN = ("fusedattn_nnx", "fusedattn_equinox", "hand_cudnn", "hand_cudnn_bias")


def attention_config():
    config = fusedattn.configs.attention_config()
    config.mask = "causal"
    return config


def nnx_step(module, **call_kwargs):
    graphdef, state = nnx.split(module)

    def apply(state, x):
        return nnx.merge(graphdef, state)(x, **call_kwargs)

    return apply, state


def linen_step(module, x, **call_kwargs):
    params = module.init(jax.random.key(0), x)
    return (lambda params, x: module.apply(params, x, **call_kwargs)), params


def equinox_step(module):
    params, static = eqx.partition(module, eqx.is_array)

    def apply(params, x):
        layer = eqx.combine(params, static)
        return jax.vmap(lambda row: layer(row, row, row))(x)

    return apply, params


def stock_equinox_step(module):
    params, static = eqx.partition(module, eqx.is_array)
    mask = jnp.tril(jnp.ones((L, L), bool))

    def apply(params, x):
        layer = eqx.combine(params, static)
        run = lambda row: layer(row.astype(DTYPE), row.astype(DTYPE), row.astype(DTYPE), mask=mask)
        return jax.vmap(run)(x)

    return apply, params


def hand_cudnn_step(rng, fused_qkv: bool = False, use_bias: bool = False):
    """Four projections around JAX's cuDNN attention; fused_qkv: q, k, v as one matmul;
    use_bias: with the biases of the layers ([h, d] for q/k/v, [d_model] for the output)."""
    if fused_qkv and use_bias:
        raise ValueError("hand_cudnn_step: fused_qkv with use_bias is not a benchmarked variant")
    keys = jax.random.split(rng, 4)
    head_dim = D_MODEL // HEADS
    params = {name: jax.random.normal(k, (D_MODEL, HEADS, head_dim), jnp.float32) * D_MODEL ** -0.5
              for name, k in zip(("q", "k", "v"), keys[:3])}
    params["o"] = jax.random.normal(keys[3], (HEADS, head_dim, D_MODEL), jnp.float32) * D_MODEL ** -0.5
    if fused_qkv:
        params["qkv"] = jnp.stack([params.pop(n) for n in ("q", "k", "v")], axis=1)
    if use_bias:
        params["bias"] = {**{n: jnp.zeros((HEADS, head_dim), jnp.float32) for n in ("q", "k", "v")},
                          "o": jnp.zeros((D_MODEL,), jnp.float32)}

    def apply(params, x):
        p = jax.tree.map(lambda w: w.astype(DTYPE), params)
        bias = p.get("bias")

        def project(name):
            y = jnp.einsum("bld,dhe->blhe", x, p[name])
            return y if bias is None else y + bias[name]

        if fused_qkv:
            q, k, v = jnp.unstack(jnp.einsum("bld,dthe->tblhe", x, p["qkv"]))
        else:
            q, k, v = (project(n) for n in ("q", "k", "v"))
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        out = jnp.einsum("blhe,hed->bld", out, p["o"])
        return out if bias is None else out + bias["o"]

    return apply, params


def interleaved_ms(steps: dict, repeats: int, iters: int, min_window_ms: float
                   ) -> tuple[dict, dict]:
    """Times steps {name: (fn, args)} in rounds; returns ({name: [ms per round]}, {name: error}).

    Each step is compiled and run twice first (a step that raises is reported in
    the errors and left out). Each round then times every step once, as
    common.mean_call_ms of common.calls_per_repeat back-to-back calls, starting the
    round one step further along the list than the last, so that no impl is measured
    in a window of its own or always after the same neighbour.
    """
    calls, errors = {}, {}
    for name, (fn, args) in steps.items():
        try:
            jax.block_until_ready(fn(*args))
            calls[name] = calls_per_repeat(fn, args, iters, min_window_ms)
        except Exception as error:
            errors[name] = str(error).splitlines()[0][:300]
    names = list(calls)
    times = {name: [] for name in names}
    for round_ in range(repeats):
        shift = round_ % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            fn, args = steps[name]
            times[name].append(mean_call_ms(fn, args, calls[name]))
    return times, errors


def floor_ms(wrt_input: bool = True) -> float:
    """Matmul FLOPs of one layer's fwd+bwd over the ~790 TF/s rate: 4 projections
    (2 * B*L * d_model^2 each, x3 for fwd+bwd; without the input's gradient the q, k and
    v projections' input matmuls drop: 9 in all) and causal attention (half of
    4 * B*h*L^2*hd forward, x3.5 for fwd+bwd)."""
    projections = (12 if wrt_input else 9) * 2 * B * L * D_MODEL ** 2
    attention = 3.5 * 0.5 * 4 * B * HEADS * L * L * (D_MODEL // HEADS)
    return (projections + attention) / H200_MEASURED_MATMUL_FLOPS * 1e3


def impls(x):
    rngs = nnx.Rngs(0)
    config = attention_config()
    causal = nnx.make_causal_mask(jnp.ones((B, L)))
    return {
        "fusedattn_nnx": nnx_step(fa_nnx.MultiHeadAttention(HEADS, D_MODEL, config=config,
                                                            dtype=DTYPE, rngs=rngs)),
        "fusedattn_linen": linen_step(fa_linen.MultiHeadAttention(HEADS, config=config,
                                                                  dtype=DTYPE), x),
        "fusedattn_equinox": equinox_step(fa_equinox.MultiheadAttention(
            HEADS, D_MODEL, config=config, compute_dtype=DTYPE, key=jax.random.key(1))),
        "stock_nnx": nnx_step(nnx.MultiHeadAttention(HEADS, D_MODEL, dtype=DTYPE, decode=False,
                                                     rngs=rngs), mask=causal),
        "stock_linen": linen_step(linen.MultiHeadDotProductAttention(num_heads=HEADS, dtype=DTYPE),
                                  x, mask=causal),
        "stock_equinox": stock_equinox_step(eqx.nn.MultiheadAttention(HEADS, D_MODEL,
                                                                      key=jax.random.key(2))),
        "hand_cudnn": hand_cudnn_step(jax.random.key(3)),
        "hand_cudnn_bias": hand_cudnn_step(jax.random.key(3), use_bias=True),
        "hand_cudnn_fused_qkv": hand_cudnn_step(jax.random.key(3), fused_qkv=True),
    }


def profile_impls(steps: dict, errors: dict, profile_dir: str,
                  n_steps: int = PROFILE_STEPS, top: int = PROFILE_TOP) -> dict:
    """kernel_profile.profile_call of each step {name: (fn, args)} (already compiled and
    warmed up by the timing), traced into profile_dir/<name>. Returns {name: summary}, or
    {name: {"error": ...}} for a step that failed in the timing or whose trace could not
    be taken or read."""
    return {name: {"error": f"not traced: the step failed: {errors[name]}"} if name in errors
            else profile_call(fn, args, Path(profile_dir) / name, n_steps, top=top)
            for name, (fn, args) in steps.items()}


def print_profile(profile: dict, medians: dict) -> None:
    """One line per impl (against the timed ms: device ms per step, the GPU's idle ms
    between kernels, kernels per step, device ms by kind), then the longest kernels and
    the largest idle gaps of the impls in PROFILE_KERNELS_SHOWN."""
    kinds = [kind for kind, _ in KINDS]
    print(f"\ndevice ms per step by kind (traced, {PROFILE_STEPS} steps per impl)")
    print(f"{'impl':<22}{'timed':>8}{'device':>8}{'idle':>8}{'kernels':>8}"
          + "".join(f"{k:>10}" for k in kinds))
    for name, p in profile.items():
        timed = f"{medians[name]:>8.3f}" if medians.get(name) else f"{'-':>8}"
        if "error" in p:
            print(f"{name:<22}{timed}  error: {p['error'][:100]}")
            continue
        print(f"{name:<22}{timed}{p['device_ms_per_step']:>8.3f}{p['idle_ms_per_step']:>8.3f}"
              f"{p['kernels_per_step']:>8g}"
              + "".join(f"{p['ms_per_step'].get(k, 0.0):>10.3f}" for k in kinds))
    for name in PROFILE_KERNELS_SHOWN:
        if name in profile and "error" not in profile[name]:
            print_top_kernels(profile[name], f"{name}, longest kernels")
            print_idle(profile[name])
            print_host(profile[name])


def fwd_bwd_step(apply, wrt_input: bool = True):
    """The timed step: the VJP of the layer output with a given cotangent, w.r.t. params and
    x (or params only)."""

    def step(params, x, cotangent):
        if wrt_input:
            out, vjp = jax.vjp(apply, params, x)
        else:
            out, vjp = jax.vjp(lambda params: apply(params, x), params)
        return vjp(cotangent.astype(out.dtype))

    return step


def main():
    global B, L, D_MODEL, HEADS

    def add_arguments(parser):
        parser.set_defaults(repeats=21)
        parser.add_argument("--profile", metavar="DIR", default=None,
                            help=f"after the timing, trace {PROFILE_STEPS} steps of each impl "
                                 "into DIR/<impl> and add device time per kernel kind")
        parser.add_argument("--wrt", choices=("params_and_input", "params"),
                            default="params_and_input",
                            help="what the backward differentiates (see the module docstring)")
        parser.add_argument("--small", action="store_true",
                            help=f"b, L, d_model, heads = {SMALL_SHAPE} (to try it on a CPU)")

    args = parse_args("benchmarks/results/layers.json", add_arguments)
    if args.small:
        B, L, D_MODEL, HEADS = SMALL_SHAPE
    keys = jax.random.split(jax.random.key(0), 2)
    x = random_normal(keys[0], (B, L, D_MODEL), DTYPE)
    cotangent = random_normal(keys[1], (B, L, D_MODEL), DTYPE)
    wrt_input = args.wrt == "params_and_input"
    steps = {name: (jax.jit(fwd_bwd_step(apply, wrt_input)), (params, x, cotangent))
             for name, (apply, params) in impls(x).items()}
    times, errors = interleaved_ms(steps, repeats=args.repeats, iters=args.iters,
                                   min_window_ms=args.min_window_ms)
    rows = []
    for name in steps:
        row = {"name": f"b{B}_L{L}_d{D_MODEL}_h{HEADS}_causal", "shape": {"b": B, "L": L, "d_model": D_MODEL,
                                                               "h": HEADS},
               "impl": name, "pass": "fwd+bwd"}
        if name in errors:
            row.update(ms=None, error=errors[name])
        else:
            row.update(ms=round(statistics.median(times[name]), 4),
                       ms_min=round(min(times[name]), 4), ms_max=round(max(times[name]), 4),
                       rounds=len(times[name]))
        rows.append(row)
        print(row, flush=True)
    medians = {r["impl"]: r["ms"] for r in rows}
    summary = {}
    for ours in ("fusedattn_nnx", "fusedattn_linen", "fusedattn_equinox"):
        stock = ours.replace("fusedattn", "stock")
        if medians.get(ours) and medians.get(stock) and medians.get("hand_cudnn"):
            summary[ours] = {"speedup_vs_stock": round(medians[stock] / medians[ours], 2),
                             "time_ratio_vs_hand_cudnn": round(medians[ours] / medians["hand_cudnn"], 3)}
            if medians.get("hand_cudnn_bias"):
                summary[ours]["time_ratio_vs_hand_cudnn_bias"] = round(
                    medians[ours] / medians["hand_cudnn_bias"], 3)
    head_dim = D_MODEL // HEADS
    structs = [jax.ShapeDtypeStruct((B, L, HEADS, head_dim), DTYPE)] * 3
    explanation = fusedattn.ops.explain(structs, config=attention_config())
    print(explanation)
    floor = floor_ms(wrt_input)
    for r in rows:
        r["of_matmul_floor"] = round(floor / r["ms"], 3) if r["ms"] else None
    results = dict(summary=summary, attention_backend=explanation.backend,
                   matmul_floor_ms=round(floor, 4), gradients_wrt=args.wrt)
    write_results(args.out, rows, **results)
    print(f"\n{'impl':<22}{'ms':>9}{'min':>9}{'max':>9}{'floor/ms':>10}   (matmul floor {floor:.3f} ms)")
    for r in rows:
        if r['ms'] is None:
            print(f"{r['impl']:<22}{'error':>9}")
            continue
        print(f"{r['impl']:<22}{r['ms']:>9.3f}{r['ms_min']:>9.3f}{r['ms_max']:>9.3f}"
              f"{r['of_matmul_floor']:>10.2f}")
    for ours, s in summary.items():
        print(f"{ours}: {s['speedup_vs_stock']}x vs stock, {s['time_ratio_vs_hand_cudnn']} x hand_cudnn time")
    if args.profile:
        # The timings are written above already, in case tracing takes the process down.
        profile = profile_impls(steps, errors, args.profile)
        write_results(args.out, rows, **results, profile=profile)
        print_profile(profile, medians)


if __name__ == "__main__":
    main()
