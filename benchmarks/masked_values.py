"""What the masked-values guard costs (fusedattn.ops.masked_values).

fused_attn through the cudnn and flash backends with config.guard_masked_values (a NaN
check of the output, and of dQ in the backward, then a branch) against the same call
without it (the default), interleaved, bf16, random inputs without NaN (the fast path). Rows: shape
{"b", "s", "h", "d", "causal"}, impl "<backend>" / "<backend>_unguarded", pass "fwd" /
"fwd+bwd", ms; "guard_cost" is guarded over unguarded minus 1.

    python benchmarks/masked_values.py --out benchmarks/results/masked_values.json
"""

from __future__ import annotations

import jax

import fusedattn
from fusedattn.ops import fused_attn

from common import interleaved_ms, parse_args, passes, random_normal, timing, write_results

SHAPES = ((4, 2048, 16, 128), (1, 8192, 16, 128), (16, 512, 16, 128))
QUICK_SHAPES = ((1, 256, 2, 64),)
BACKENDS = ("cudnn", "flash")


def attend(backend: str, causal: bool, guard: bool):
    config = fusedattn.configs.attention_config()
    config.backend = backend
    config.mask = "causal" if causal else "no_mask"
    config.guard_masked_values = guard
    return lambda q, k, v: fused_attn((q, k, v), config=config)


def main():
    args = parse_args("benchmarks/results/masked_values.json")
    rows = []
    for b, s, h, d in QUICK_SHAPES if args.quick else SHAPES:
        keys = jax.random.split(jax.random.key(s), 4)
        arrays = tuple(random_normal(key, (b, s, h, d), jax.numpy.bfloat16) for key in keys)
        for causal in (False, True):
            for backend in BACKENDS:
                shape = {"b": b, "s": s, "h": h, "d": d, "causal": causal}
                try:
                    guarded = passes(attend(backend, causal, True))
                    bare = passes(attend(backend, causal, False))
                    jax.block_until_ready(guarded["fwd"](*arrays))
                except ValueError as error:  # the backend cannot serve the call here
                    rows.append({"shape": shape, "impl": backend, "error": str(error)[:300]})
                    continue
                for pass_name in guarded:
                    ms, errors = interleaved_ms(
                        {backend: guarded[pass_name], f"{backend}_unguarded": bare[pass_name]},
                        arrays, **timing(args))
                    for impl, value in ms.items():
                        rows.append({"shape": shape, "impl": impl, "pass": pass_name, "ms": value})
                    for impl, error in errors.items():
                        rows.append({"shape": shape, "impl": impl, "pass": pass_name,
                                     "error": error})
                    if len(ms) == 2:
                        cost = ms[backend] / ms[f"{backend}_unguarded"] - 1
                        rows[-1]["guard_cost"] = cost
                        print(f"{backend:6s} b{b} s{s} h{h} d{d} causal={causal!s:5s} "
                              f"{pass_name:8s} {ms[backend]:.3f} ms guarded, "
                              f"{ms[f'{backend}_unguarded']:.3f} bare: {cost:+.1%}")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
