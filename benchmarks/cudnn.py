"""The cudnn backend against JAX's own cuDNN attention and XLA.

Impls: "cudnn" (fusedattn.ops.fused_attn with backend "cudnn"), "jax_cudnn"
(jax.nn.dot_product_attention(implementation="cudnn")), "xla"
(jax.nn.dot_product_attention(implementation="xla")), "cudnn_dropout"
(ours with dropout 0.1, training) and "cudnn_thd4" (ours on the thd_thd_thd
layout, each row packing 4 sequences of s/4 tokens: a quarter of the FLOPs,
which JAX's path cannot run), "cudnn_thd4_unchecked" (the same with
config.sequence.check_bounds = False: no checkify effect, so JAX's C++ dispatch
fast path; a lone packed call is short enough for its dispatch to show),
"cudnn_alibi" (ours with config.bias = "alibi", causal cases only: cuDNN serves ALiBi
under causal masks) and "xla_alibi" (the same through our xla backend, what an ALiBi
call ran on before cuDNN served it). --impls picks a subset (e.g. the ALiBi rows only:
--impls cudnn,cudnn_alibi,xla_alibi --out benchmarks/results/cudnn_alibi.json).
Passes "fwd" and "fwd+bwd" (the VJP with a random cotangent, all of dq, dk, dv).
bf16, BSHD.

TF/s counts matmul FLOPs only: forward 4*b*h*sq*skv*d, halved for causal
(a quarter of that on THD); fwd+bwd 3.5x the forward. "of_peak" is the fraction of ~790 TF/s, a large
bf16 matmul measured on the H200.

    python benchmarks/cudnn.py --out benchmarks/results/cudnn.json
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import fusedattn
from fusedattn.ops import SequenceDescriptor, fused_attn

from common import (H200_MEASURED_MATMUL_FLOPS, median_ms, parse_args, passes, random_normal,
                    timing, write_results)

SHAPES = [(4, 2048, 2048, 16, 128), (1, 8192, 8192, 16, 128), (16, 512, 512, 16, 64)]
THD_SEGMENTS = 4


def ours(causal: bool, dropout: float = 0.0, alibi: bool = False, backend: str = "cudnn"):
    config = fusedattn.configs.attention_config()
    config.backend = backend
    config.mask = "causal" if causal else "no_mask"
    config.dropout_rate = dropout
    config.bias = "alibi" if alibi else "no_bias"
    key = jax.random.key(0)

    def attend(q, k, v):
        return fused_attn((q, k, v), config=config, dropout_rng=key if dropout else None,
                          is_training=dropout > 0)
    return attend


def thd_config(causal: bool, t: int, check_bounds: bool = True):
    """Ours on thd_thd_thd rows of t tokens packing THD_SEGMENTS sequences, bounds declared
    (cuDNN's work per segment follows the declared bound)."""
    config = fusedattn.configs.attention_config()
    config.sequence.check_bounds = check_bounds
    config.backend = "cudnn"
    config.qkv_layout = "thd_thd_thd"
    config.mask = "padding_causal" if causal else "padding"
    config.sequence.format = "seqlens_offsets"
    config.sequence.max_segments_per_seq = THD_SEGMENTS
    config.sequence.max_seqlen_q = config.sequence.max_seqlen_kv = t // THD_SEGMENTS
    return config


def thd_descriptor(b: int, t: int) -> SequenceDescriptor:
    """THD_SEGMENTS equal sequences per row: lengths [b, 4] and offsets [b, 5]."""
    lengths = jnp.full((b, THD_SEGMENTS), t // THD_SEGMENTS, jnp.int32)
    offsets = jnp.broadcast_to(jnp.arange(THD_SEGMENTS + 1, dtype=jnp.int32) * (t // THD_SEGMENTS),
                               (b, THD_SEGMENTS + 1))
    return SequenceDescriptor.from_seqlens_and_offsets(lengths, lengths, offsets, offsets)


def ours_thd(causal: bool, check_bounds: bool = True):
    """Ours on THD rows packing THD_SEGMENTS equal sequences (q, k, v [b, t, h, d])."""
    def attend(q, k, v):
        b, t = q.shape[:2]
        return fused_attn((q, k, v), config=thd_config(causal, t, check_bounds),
                          sequence=thd_descriptor(b, t))
    return attend


def jax_attention(implementation: str, causal: bool):
    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                            implementation=implementation)
    return attend


def impls(causal: bool) -> dict:
    alibi = {"cudnn_alibi": ours(causal, alibi=True),
             "xla_alibi": ours(causal, alibi=True, backend="xla")} if causal else {}
    return {"cudnn": ours(causal), "jax_cudnn": jax_attention("cudnn", causal),
            "xla": jax_attention("xla", causal), "cudnn_dropout": ours(causal, 0.1),
            "cudnn_thd4": ours_thd(causal),
            "cudnn_thd4_unchecked": ours_thd(causal, check_bounds=False), **alibi}


def add_arguments(parser):
    names = ",".join(impls(causal=True))  # every impl: the causal cases have them all
    parser.add_argument("--impls", default=names, help=f"comma-separated subset of {names}")


def flops(b, sq, skv, h, d, causal, pass_name, impl):
    forward = 4 * b * h * sq * skv * d / (2 if causal else 1)
    if impl.startswith("cudnn_thd4"):
        forward /= THD_SEGMENTS
    return forward if pass_name == "fwd" else 3.5 * forward


def main():
    args = parse_args("benchmarks/results/cudnn.json", add_arguments)
    chosen = args.impls.split(",")
    unknown = sorted(set(chosen) - set(impls(causal=True)))
    if unknown:
        raise SystemExit(f"--impls: unknown {', '.join(unknown)}; choose a subset of "
                         f"{','.join(impls(causal=True))}")
    shapes = SHAPES[:1] if args.quick else SHAPES
    rows = []
    for b, sq, skv, h, d in shapes:
        keys = jax.random.split(jax.random.key(sq + d), 4)
        q = random_normal(keys[0], (b, sq, h, d), jnp.bfloat16)
        k = random_normal(keys[1], (b, skv, h, d), jnp.bfloat16)
        v = random_normal(keys[2], (b, skv, h, d), jnp.bfloat16)
        do = random_normal(keys[3], (b, sq, h, d), jnp.bfloat16)
        for causal in (False, True):
            name = f"b{b}_s{sq}_h{h}_d{d}" + ("_causal" if causal else "")
            shape = {"b": b, "sq": sq, "skv": skv, "h": h, "d": d, "causal": causal}
            for impl, attend in impls(causal).items():
                if impl not in chosen:
                    continue
                for pass_name, fn in passes(attend).items():
                    row = {"name": name, "shape": shape, "impl": impl, "pass": pass_name}
                    try:
                        ms = median_ms(fn, q, k, v, do, **timing(args))
                    except Exception as error:  # an implementation that cannot run the case
                        row.update(ms=None, unsupported=str(error).splitlines()[0][:300])
                    else:
                        tflops = flops(b, sq, skv, h, d, causal, pass_name, impl) / (ms * 1e-3) / 1e12
                        row.update(ms=round(ms, 4), tflops=round(tflops, 1),
                                   of_peak=round(tflops * 1e12 / H200_MEASURED_MATMUL_FLOPS, 3))
                    rows.append(row)
                    print(row, flush=True)
    summary = summarize(rows)
    from fusedattn.ops.backends.cudnn import library as cudnn_library
    version = cudnn_library.cudnn_version()
    write_results(args.out, rows, summary=summary,
                  cudnn=cudnn_library.version_string(version) if version else None,
                  flops="matmul only: fwd 4*b*h*sq*skv*d (causal /2), fwd+bwd 3.5x",
                  peak="790 TF/s (large bf16 matmul measured on the H200)")
    print_table(summary)


_VARIANTS = ("cudnn_dropout", "cudnn_thd4", "cudnn_thd4_unchecked", "cudnn_alibi")


def summarize(rows):
    times = {(r["name"], r["impl"], r["pass"]): r for r in rows}
    out = []
    for r in rows:
        if r["impl"] != "cudnn":
            continue
        entry = {"name": r["name"], "pass": r["pass"], "ms": r["ms"], "tflops": r.get("tflops"),
                 "of_peak": r.get("of_peak")}
        for peer in ("jax_cudnn", "xla", "xla_alibi") + _VARIANTS:
            other = times.get((r["name"], peer, r["pass"]), {})
            entry[f"{peer}_ms"] = other.get("ms")
            entry[f"{peer}_tflops"] = other.get("tflops")
        for variant in _VARIANTS:  # throughput against the plain call
            tflops = entry[f"{variant}_tflops"]
            entry[f"{variant}_of_plain"] = (round(tflops / r["tflops"], 3)
                                            if tflops and r.get("tflops") else None)
        alibi_ms, xla_alibi_ms = entry["cudnn_alibi_ms"], entry["xla_alibi_ms"]
        entry["alibi_speedup_vs_xla_alibi"] = (round(xla_alibi_ms / alibi_ms, 2)
                                               if alibi_ms and xla_alibi_ms else None)
        jax_ms = entry["jax_cudnn_ms"]
        entry["time_vs_jax_cudnn"] = (round(r["ms"] / jax_ms, 3) if r["ms"] and jax_ms else None)
        out.append(entry)
    return out


def print_table(summary):
    fmt = lambda x, f="{:.2f}": "n/a" if x is None else f.format(x)
    print(f"\n{'case':<26}{'pass':<8}{'ours ms':>8}{'TF/s':>6}{'peak':>6}{'jax_cudnn':>10}"
          f"{'ratio':>7}{'xla ms':>8}{'drop.1':>8}{'thd4':>7}{'thd4u':>7}{'alibi':>7}"
          f"{'vs xla alibi':>13}")
    for s in summary:
        print(f"{s['name']:<26}{s['pass']:<8}{fmt(s['ms'], '{:.3f}'):>8}"
              f"{fmt(s['tflops'], '{:.0f}'):>6}{fmt(s['of_peak'] and 100 * s['of_peak'], '{:.0f}%'):>6}"
              f"{fmt(s['jax_cudnn_ms'], '{:.3f}'):>10}{fmt(s['time_vs_jax_cudnn'], '{:.3f}'):>7}"
              f"{fmt(s['xla_ms'], '{:.2f}'):>8}{fmt(s['cudnn_dropout_of_plain'], '{:.2f}'):>8}"
              f"{fmt(s['cudnn_thd4_of_plain'], '{:.2f}'):>7}"
              f"{fmt(s['cudnn_thd4_unchecked_of_plain'], '{:.2f}'):>7}"
              f"{fmt(s['cudnn_alibi_of_plain'], '{:.2f}'):>7}"
              f"{fmt(s['alibi_speedup_vs_xla_alibi'], '{:.2f}x'):>13}")
    print("ratio = ours / jax_cudnn time (<= 1.03 is the target); drop.1 and thd4 = throughput "
          "(TF/s) of ours with dropout 0.1 and of ours on THD with 4 sequences per row, as a "
          "fraction of ours plain (target >= 0.85); thd4u the same without the bounds check; "
          "alibi the same with ALiBi, and its speedup over our xla backend's ALiBi")


if __name__ == "__main__":
    main()
