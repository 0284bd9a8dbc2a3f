"""FP8 attention through the cudnn backend against ours in bf16 and JAX's private FP8 path.

Impls:
  "fp8"        ours: fused_attn with config.fp8.enabled (E4M3, delayed scaling) on bf16
               inputs, backend "cudnn": the amaxes and quantisation of q, k, v (and dO) in
               XLA around cuDNN's FP8 graphs; the state is a call argument with a history
               (delayed scaling runs no probe pass: one cuDNN call per direction)
  "fp8_inputs" the same with q, k, v given in float8_e4m3fn (no quantisation pass): what
               JAX's path takes
  "fp8_graph"  cuDNN's FP8 graphs alone, as the op calls them (fp8_calls.py) on
               float8_e4m3fn q, k, v, dO with unit scales: no amax, quantisation, state
               update or conversion of O/dQ/dK/dV to bfloat16; the floor under
               "fp8_inputs", set against jax_fp8 (the same work); fp8_inputs - fp8_graph
               is the XLA work around the graphs (amaxes, conversions, the state update)
  "bf16"       ours in bf16, backend "cudnn"
  "jax_fp8"    jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(use_fp8=True)
               on float8_e4m3fn inputs, unit scales (its gradients FP8 too)
The issue's cases: (4, 2048, 16, 128) and (1, 8192, 16, 128) without a mask,
(1, 8192, 16, 128) and (2, 4096, 32, 128) causal. Passes "fwd" (jitted forward) and
"fwd+bwd" (the VJP with a random cotangent: dq, dk, dv; ours also the state's gradient,
as training takes it). Every impl of a case is timed in
the same rounds, in rotated order (common.interleaved_ms: medians over --repeats rounds,
each after warm-up). Random normal inputs. BSHD.

TF/s counts matmul FLOPs only: forward 4*b*h*s*s*d, halved for causal; fwd+bwd 3.5x the
forward. Ratios per case and pass: fp8/bf16, fp8/jax_fp8, fp8_inputs/jax_fp8,
fp8_graph/jax_fp8.

    python benchmarks/fp8.py --out benchmarks/results/fp8.json
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import fusedattn
from fusedattn.ops import AttentionSpec, fp8, fp8_state_init, fused_attn
from fusedattn.ops.backends.cudnn import fp8_calls
from fusedattn.ops.backends.cudnn import library as cudnn_library
from fusedattn.ops.backends.cudnn.graph_key import FP8_E4M3, _static

from common import interleaved_ms, parse_args, passes, random_normal, write_results

# (b, s, h, d, causal): the cases.
CASES = [(4, 2048, 16, 128, False), (1, 8192, 16, 128, False), (1, 8192, 16, 128, True),
         (2, 4096, 32, 128, True)]
IMPLS = ("fp8", "fp8_inputs", "fp8_graph", "bf16", "jax_fp8")
RATIOS = (("fp8", "bf16"), ("fp8", "jax_fp8"), ("fp8_inputs", "jax_fp8"),
          ("fp8_graph", "jax_fp8"))


def _config(causal: bool, fp8: bool):
    config = fusedattn.configs.attention_config()
    config.backend = "cudnn"
    config.mask = "causal" if causal else "no_mask"
    config.fp8.enabled = fp8
    return config


def _warm_state(config, q, k, v, do):
    """The state after one training step: every tensor has an amax history. (Arrays are
    arguments, never closed over: XLA would fold the constants' reductions at compile time.)"""
    @jax.jit
    def state_gradient(q, k, v, do, state):
        (_, _), pullback = jax.vjp(
            lambda q, k, v, state: fused_attn((q, k, v), config=config, fp8_state=state),
            q, k, v, state)
        return pullback((do, jax.tree.map(jnp.zeros_like, state)))[3]
    return state_gradient(q, k, v, do, fp8_state_init(config))


def ours_fp8(causal: bool, q, k, v, do, fp8_inputs: bool):
    """The two passes of ours in FP8, as fn(q, k, v, do) (state bound as an argument)."""
    config = _config(causal, fp8=True)
    state = _warm_state(config, q, k, v, do)
    if fp8_inputs:
        # Stored with the state's q, k, v scales, as an FP8 projection would write them.
        q, k, v = (fp8.quantise(x, jnp.float8_e4m3fn, state.scale[i])
                   for i, x in enumerate((q, k, v)))

    def attend(q, k, v, state):
        return fused_attn((q, k, v), config=config, fp8_state=state)

    forward = jax.jit(attend)

    @jax.jit
    def forward_backward(q, k, v, state, do):
        (out, new_state), pullback = jax.vjp(attend, q, k, v, state)
        return out, pullback((do, jax.tree.map(jnp.zeros_like, new_state)))

    inputs = (q, k, v)
    return {"fwd": lambda *_: forward(*inputs, state),
            "fwd+bwd": lambda *_: forward_backward(*inputs, state, do)}


def ours_fp8_graph(causal: bool, q, k, v, do):
    """cuDNN's FP8 graphs alone (module docstring), as fn(q, k, v, do)."""
    config = _config(causal, fp8=True)
    spec = AttentionSpec.from_config(config)
    call = _static(spec, 1.0 / q.shape[-1] ** 0.5, False, False, q.shape[1], k.shape[1])
    q8, k8, v8, do8 = (x.astype(jnp.float8_e4m3fn) for x in (q, k, v, do))
    one = 1.0

    @jax.jit
    def forward(q8, k8, v8):
        return fp8_calls.forward(call, q8, k8, v8, one, one, one, one, one, False)[0]

    @jax.jit
    def forward_backward(q8, k8, v8, do8):
        o8, stats, _, _ = fp8_calls.forward(call, q8, k8, v8, one, one, one, one, one, True)
        args = (call, FP8_E4M3, q8, k8, v8, o8, do8, stats, (one,) * 5, one)
        return o8, fp8_calls.backward(*args, one, (one,) * 3)[:3]

    return {"fwd": lambda *_: forward(q8, k8, v8),
            "fwd+bwd": lambda *_: forward_backward(q8, k8, v8, do8)}


def ours_bf16(causal: bool):
    config = _config(causal, fp8=False)
    return passes(lambda q, k, v: fused_attn((q, k, v), config=config))


def jax_fp8(causal: bool, q, k, v, do):
    """JAX's private cuDNN FP8 attention on float8_e4m3fn inputs with unit scales."""
    from jax._src.cudnn import fused_attention_stablehlo as jax_cudnn

    names = ("amax_dQ", "amax_dK", "amax_dV", "amax_dP", "descale_q", "descale_k", "descale_v",
             "descale_s", "scale_s", "scale_o", "descale_o", "descale_dO", "descale_dP",
             "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
    params = {name: jnp.ones((1, 1, 1, 1), jnp.float32) for name in names}
    scale = 1.0 / q.shape[-1] ** 0.5
    mask = jax_cudnn.MaskType.CAUSAL if causal else jax_cudnn.MaskType.NO_MASK
    q8, k8, v8, do8 = (x.astype(jnp.float8_e4m3fn) for x in (q, k, v, do))

    def attend(q, k, v):
        return jax_cudnn.dot_product_attention(q, k, v, fp8_params=params, scale=scale,
                                               mask_type=mask, use_fp8=True)[0]

    forward = jax.jit(attend)

    @jax.jit
    def forward_backward(q, k, v, do):
        out, pullback = jax.vjp(attend, q, k, v)
        return out, pullback(do)

    return {"fwd": lambda *_: forward(q8, k8, v8),
            "fwd+bwd": lambda *_: forward_backward(q8, k8, v8, do8)}


def flops(b: int, s: int, h: int, d: int, causal: bool, pass_name: str) -> float:
    forward = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    return forward * (3.5 if pass_name == "fwd+bwd" else 1.0)


def case_inputs(b: int, s: int, h: int, d: int, causal: bool):
    """Random normal bfloat16 q, k, v, dO [b, s, h, d] of a case."""
    keys = jax.random.split(jax.random.key(b * s + h + causal), 4)
    return tuple(random_normal(key, (b, s, h, d), jnp.bfloat16) for key in keys)


def build_impls(impls, causal: bool, q, k, v, do) -> tuple[dict, dict]:
    """({impl: {pass: fn(q, k, v, do)}} of the impls that build, {impl: error} of the others."""
    builders = {"fp8": lambda: ours_fp8(causal, q, k, v, do, fp8_inputs=False),
                "fp8_inputs": lambda: ours_fp8(causal, q, k, v, do, fp8_inputs=True),
                "fp8_graph": lambda: ours_fp8_graph(causal, q, k, v, do),
                "bf16": lambda: ours_bf16(causal),
                "jax_fp8": lambda: jax_fp8(causal, q, k, v, do)}
    fns, errors = {}, {}
    for impl in impls:
        try:
            fns[impl] = builders[impl]()
        except Exception as error:  # an impl that cannot build the case
            errors[impl] = str(error).splitlines()[0][:300]
    return fns, errors


def run_case(b: int, s: int, h: int, d: int, causal: bool, args) -> list[dict]:
    q, k, v, do = case_inputs(b, s, h, d, causal)
    fns, errors = build_impls(args.impls, causal, q, k, v, do)
    rows = []
    shape = {"b": b, "s": s, "h": h, "d": d, "causal": causal}
    for pass_name in ("fwd", "fwd+bwd"):
        timed, failed = interleaved_ms({impl: fn[pass_name] for impl, fn in fns.items()},
                                       (q, k, v, do), args.repeats, args.iters, args.min_window_ms)
        failed.update(errors)
        for impl in args.impls:
            row = {"shape": shape, "impl": impl, "pass": pass_name}
            if impl in timed:
                ms = timed[impl]
                row.update(ms=round(ms, 4), tflops=round(flops(b, s, h, d, causal, pass_name)
                                                         / ms / 1e9, 1))
            else:
                row["error"] = failed.get(impl, "not run")
            rows.append(row)
        ratios = {f"{a}/{c}": round(timed[c] / timed[a], 3)
                  for a, c in RATIOS if a in timed and c in timed}
        rows.append({"shape": shape, "pass": pass_name, "speed_ratios": ratios})
        print(f"b={b} s={s} h={h} d={d} causal={causal} {pass_name}: " + ", ".join(
            f"{impl} {timed[impl]:.3f} ms" if impl in timed else f"{impl} failed"
            for impl in args.impls) + f"; speed ratios {ratios}", flush=True)
    return rows


def main():
    def add(parser):
        parser.add_argument("--impls", default=",".join(IMPLS),
                            help=f"comma-separated subset of {IMPLS}")

    args = parse_args("benchmarks/results/fp8.json", add)
    args.impls = [impl for impl in args.impls.split(",") if impl]
    unknown = set(args.impls) - set(IMPLS)
    if unknown:
        raise SystemExit(f"--impls: unknown {sorted(unknown)}; choose from {IMPLS}")
    rows = []
    for b, s, h, d, causal in (CASES[1:3] if args.quick else CASES):
        rows.extend(run_case(b, s, h, d, causal, args))
    write_results(args.out, rows, impls=args.impls,
                  cudnn=cudnn_library.version_string(cudnn_library.cudnn_version()),
                  flops_note="matmul FLOPs: fwd 4*b*h*s*s*d (halved causal), fwd+bwd 3.5x",
                  ratio_note="speed ratio a/c = ms of c / ms of a (above 1: a is faster)")


if __name__ == "__main__":
    main()
