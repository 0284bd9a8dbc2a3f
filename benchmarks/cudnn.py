"""The cudnn backend against JAX's own cuDNN attention and XLA.

Impls: "cudnn" (fusedattn.ops.fused_attn with backend "cudnn"), "jax_cudnn"
(jax.nn.dot_product_attention(implementation="cudnn")), "xla"
(jax.nn.dot_product_attention(implementation="xla")), and "cudnn_dropout"
(ours with dropout 0.1, training). Passes "fwd" and "fwd+bwd" (the VJP with a
random cotangent, all of dq, dk, dv). bf16, BSHD.

TF/s counts matmul FLOPs only: forward 4*b*h*sq*skv*d, halved for causal;
fwd+bwd 3.5x the forward. "of_peak" is the fraction of ~790 TF/s, a large
bf16 matmul measured on the H200.

    python benchmarks/cudnn.py --out benchmarks/results/cudnn.json
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import fusedattn
from fusedattn.ops import fused_attn

from common import H200_MEASURED_MATMUL_FLOPS, median_ms, parse_args, random_normal, write_results

SHAPES = [(4, 2048, 2048, 16, 128), (1, 8192, 8192, 16, 128), (16, 512, 512, 16, 64)]


def ours(causal: bool, dropout: float = 0.0):
    config = fusedattn.configs.attention_config()
    config.backend = "cudnn"
    config.mask = "causal" if causal else "no_mask"
    config.dropout_rate = dropout
    key = jax.random.key(0)

    def attend(q, k, v):
        return fused_attn((q, k, v), config=config, dropout_rng=key if dropout else None,
                          is_training=dropout > 0)
    return attend


def jax_attention(implementation: str, causal: bool):
    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                            implementation=implementation)
    return attend


def impls(causal: bool) -> dict:
    return {"cudnn": ours(causal), "jax_cudnn": jax_attention("cudnn", causal),
            "xla": jax_attention("xla", causal), "cudnn_dropout": ours(causal, 0.1)}


def passes(attend):
    forward = jax.jit(attend)

    @jax.jit
    def forward_backward(q, k, v, do):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(do)

    return {"fwd": lambda q, k, v, do: forward(q, k, v), "fwd+bwd": forward_backward}


def flops(b, sq, skv, h, d, causal, pass_name):
    forward = 4 * b * h * sq * skv * d / (2 if causal else 1)
    return forward if pass_name == "fwd" else 3.5 * forward


def main():
    args = parse_args("benchmarks/results/cudnn.json")
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
                for pass_name, fn in passes(attend).items():
                    row = {"name": name, "shape": shape, "impl": impl, "pass": pass_name}
                    try:
                        ms = median_ms(fn, q, k, v, do, repeats=args.repeats, iters=args.iters)
                    except Exception as error:  # an implementation that cannot run the case
                        row.update(ms=None, unsupported=str(error).splitlines()[0][:300])
                    else:
                        tflops = flops(b, sq, skv, h, d, causal, pass_name) / (ms * 1e-3) / 1e12
                        row.update(ms=round(ms, 4), tflops=round(tflops, 1),
                                   of_peak=round(tflops * 1e12 / H200_MEASURED_MATMUL_FLOPS, 3))
                    rows.append(row)
                    print(row, flush=True)
    summary = summarize(rows)
    from fusedattn.ops.backends import cudnn
    version = cudnn.cudnn_version()
    write_results(args.out, rows, summary=summary,
                  cudnn=f"{version // 10000}.{version // 100 % 100}.{version % 100}" if version else None,
                  flops="matmul only: fwd 4*b*h*sq*skv*d (causal /2), fwd+bwd 3.5x",
                  peak="790 TF/s (large bf16 matmul measured on the H200)")
    print_table(summary)


def summarize(rows):
    times = {(r["name"], r["impl"], r["pass"]): r for r in rows}
    out = []
    for r in rows:
        if r["impl"] != "cudnn":
            continue
        entry = {"name": r["name"], "pass": r["pass"], "ms": r["ms"], "tflops": r.get("tflops"),
                 "of_peak": r.get("of_peak")}
        for peer in ("jax_cudnn", "xla", "cudnn_dropout"):
            other = times.get((r["name"], peer, r["pass"]), {})
            entry[f"{peer}_ms"] = other.get("ms")
            entry[f"{peer}_tflops"] = other.get("tflops")
        jax_ms = entry["jax_cudnn_ms"]
        entry["time_vs_jax_cudnn"] = (round(r["ms"] / jax_ms, 3) if r["ms"] and jax_ms else None)
        out.append(entry)
    return out


def print_table(summary):
    fmt = lambda x, f="{:.2f}": "n/a" if x is None else f.format(x)
    print(f"\n{'case':<26}{'pass':<8}{'ours ms':>8}{'TF/s':>6}{'peak':>6}{'jax_cudnn':>10}"
          f"{'ratio':>7}{'xla ms':>8}{'drop.1':>8}")
    for s in summary:
        print(f"{s['name']:<26}{s['pass']:<8}{fmt(s['ms'], '{:.3f}'):>8}"
              f"{fmt(s['tflops'], '{:.0f}'):>6}{fmt(s['of_peak'] and 100 * s['of_peak'], '{:.0f}%'):>6}"
              f"{fmt(s['jax_cudnn_ms'], '{:.3f}'):>10}{fmt(s['time_vs_jax_cudnn'], '{:.3f}'):>7}"
              f"{fmt(s['xla_ms'], '{:.2f}'):>8}{fmt(s['cudnn_dropout_ms'], '{:.3f}'):>8}")
    print("ratio = ours / jax_cudnn time (<= 1.03 is the target); drop.1 = ours with dropout 0.1 (ms)")


if __name__ == "__main__":
    main()
