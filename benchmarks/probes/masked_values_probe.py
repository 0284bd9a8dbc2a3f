"""Which GPU kernels leak masked NaN/Inf values, and where the guard's time goes.

1. Leaks (config.guard_masked_values off, the default): NaN in v (or k) at one key that earlier rows never see (causal,
   sliding window, padding), cudnn and flash; whether the forward output or dQ of the
   rows that never see the key holds NaN.
2. Timings (causal forward, bf16, (4, 2048, 16, 128) and (16, 512, 16, 128)): the bare call,
   the bare call plus the NaN flag of its output (no branch), and the guarded call.

    python benchmarks/probes/masked_values_probe.py --out masked_values_probe.json
"""

from __future__ import annotations

import _benchmarks_on_path  # noqa: F401

import jax
import jax.numpy as jnp
import numpy as np

import fusedattn
from fusedattn.ops import SequenceDescriptor, fused_attn

from common import interleaved_ms, parse_args, random_normal, timing, write_results


def config_of(backend: str, mask: str, window=(-1, -1), guard: bool = False):
    config = fusedattn.configs.attention_config()
    config.backend, config.mask, config.window_size = backend, mask, window
    config.guard_masked_values = guard
    return config


CASES = {"causal": ("causal", (-1, -1)), "window": ("no_mask", (8, 0)),
         "padding": ("padding", (-1, -1))}


def leak_rows(backend: str, case: str, poisoned: str) -> dict:
    mask, window = CASES[case]
    b, s, h, d, late = 2, 256, 4, 128, 150
    keys = jax.random.split(jax.random.key(1), 3)
    q, k, v = (random_normal(key, (b, s, h, d), jnp.bfloat16) for key in keys)
    sequence = (SequenceDescriptor.from_seqlens(np.array([s, s], np.int32),
                                                np.array([late, s], np.int32))
                if case == "padding" else None)
    arrays = {"q": q, "k": k, "v": v}
    arrays[poisoned] = arrays[poisoned].at[0, late].set(jnp.nan)
    config = config_of(backend, mask, window)

    def attend(q, k, v):
        return fused_attn((q, k, v), config=config, sequence=sequence)

    clean_rows = slice(0, late) if case != "padding" else slice(0, s)
    out = jax.jit(attend)(arrays["q"], arrays["k"], arrays["v"])
    dq = jax.jit(jax.grad(lambda *a: jnp.sum(attend(*a)[:, clean_rows].astype(jnp.float32)
                                             ** 2)))(arrays["q"], arrays["k"], arrays["v"])
    return {"backend": backend, "mask": case, "poisoned": poisoned,
            "out_leaks": bool(np.isnan(np.asarray(out[0, clean_rows], np.float32)).any()),
            "dq_leaks": bool(np.isnan(np.asarray(dq[0, clean_rows], np.float32)).any())}


def timings(args, backend: str, shape) -> list[dict]:
    keys = jax.random.split(jax.random.key(2), 3)
    arrays = tuple(random_normal(key, shape, jnp.bfloat16) for key in keys)
    config, guarded_config = config_of(backend, "causal"), config_of(backend, "causal", guard=True)

    def attend(q, k, v):
        return fused_attn((q, k, v), config=config)

    bare = jax.jit(attend)
    flagged = jax.jit(lambda *a: (lambda o: (o, jnp.isnan(o).any()))(attend(*a)))
    guarded = jax.jit(lambda q, k, v: fused_attn((q, k, v), config=guarded_config))
    ms, errors = interleaved_ms({"bare": bare, "bare+flag": flagged, "guarded": guarded},
                                arrays, **timing(args))
    print(backend, shape, {name: round(value, 4) for name, value in ms.items()}, errors)
    return [{"backend": backend, "shape": list(shape), "impl": name, "pass": "fwd", "ms": value}
            for name, value in ms.items()]


def main():
    args = parse_args("masked_values_probe.json")
    rows = []
    for backend in ("cudnn", "flash"):
        for case in CASES:
            for poisoned in ("v", "k"):
                try:
                    rows.append(leak_rows(backend, case, poisoned))
                except Exception as error:  # a backend that cannot serve the case
                    rows.append({"backend": backend, "mask": case, "poisoned": poisoned,
                                 "error": str(error).splitlines()[0][:200]})
                print(rows[-1])
    for backend in ("cudnn", "flash"):
        for shape in ((4, 2048, 16, 128), (16, 512, 16, 128)):
            rows += timings(args, backend, shape)
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
