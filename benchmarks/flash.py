"""The flash backend's CUDA kernels against cuDNN (ours and JAX's) and FlashAttention-3.

Impls: "flash" (fusedattn.ops.fused_attn with backend "flash"), "flash_sm80" (the same with
the sm_80 mma.sync kernels named, FUSEDATTN_FLASH_KERNEL=sm80 while it traces: on an H200
the portable kernels' NVIDIA text instead of the sm_90a forward), "xla" (ours, backend
"xla": the pure-JAX reference), "cudnn" (ours, backend
"cudnn"), "jax_cudnn" (jax.nn.dot_product_attention(implementation="cudnn")), "fa3"
(flash_attn3_jax.flash_mha, head dim 128 only, where the wheel is installed),
"flash_dropout" and "cudnn_dropout" (ours with dropout 0.1, training; at the first shape
only, to keep a full run within one device call), "flash_alibi", "cudnn_alibi" and
"xla_alibi" (config.bias "alibi", the standard slopes: cuDNN serves it under the causal mask
only, so its no_mask rows say why not), "flash_alibi_window" and "xla_alibi_window" (ALiBi
with a sliding window of ALIBI_WINDOW keys to the left). Passes "fwd" and
"fwd+bwd" (the VJP with a random cotangent, all of dq, dk, dv). bf16, BSHD, random
normal inputs.

Every case times its impls interleaved: --repeats rounds, each round one timed window
(at least --min-window-ms of back-to-back calls) of every impl in turn, rotated; the
median per impl is reported. TF/s counts matmul FLOPs only: forward 4*b*h*sq*skv*d,
halved for causal; fwd+bwd 3.5x the forward. "of_peak" is the fraction of ~790 TF/s,
a large bf16 matmul measured on the H200.

    python benchmarks/flash.py --out benchmarks/results/flash.json
    python benchmarks/flash.py --impls flash,flash_alibi,cudnn_alibi,xla_alibi,flash_alibi_window,xla_alibi_window \
        --out benchmarks/results/flash_alibi.json
"""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp

import fusedattn
from fusedattn.ops import SequenceDescriptor, fused_attn

from common import (H200_MEASURED_MATMUL_FLOPS, WithParams, interleaved_ms, parse_args, passes,
                    random_normal, write_results)

# (b, s, h, h_kv, d): the six shapes, then d=64 and d=256.
SHAPES = [(4, 2048, 16, 16, 128), (1, 8192, 16, 16, 128), (2, 4096, 32, 8, 128),
          (16, 512, 16, 16, 128), (16, 512, 16, 16, 64), (2, 4096, 16, 16, 256)]


# The ALiBi-with-window impls' window: (left, right) keys.
ALIBI_WINDOW = (256, 0)


def ours(backend: str, causal: bool, dropout: float = 0.0, alibi: bool = False,
         window: tuple[int, int] = (-1, -1), bias=None, sequence=None, learn_bias: bool = False):
    """fused_attn on `backend`; bias: a post-scale bias array [b|1, h|1, s, s] (a constant, or
    with learn_bias a parameter that the fwd+bwd pass differentiates); sequence: a
    SequenceDescriptor (the mask then reads it: padding, causal within segments)."""
    config = fusedattn.configs.attention_config()
    config.backend = backend
    config.mask = "causal" if causal else "no_mask"
    if sequence is not None:  # THD packing (seqlens and offsets)
        config.mask = "padding_causal" if causal else "padding"
        config.qkv_layout = "thd_thd_thd"
        config.sequence.format = "seqlens_offsets"
        config.sequence.max_segments_per_seq = sequence.q_seqlens.shape[1]
        # The descriptor's value checks report through checkify, whose effect takes a jitted
        # call off JAX's fast dispatch path (0.2-0.3 ms of host time a call, longer than the
        # kernels here); a training step pays that once, not per attention call.
        config.sequence.check_bounds = False
    config.dropout_rate = dropout
    if alibi:
        config.bias = "alibi"
    if bias is not None:
        config.bias = "post_scale_bias"
    config.window_size = window
    key = jax.random.key(0)

    def attend(q, k, v, bias=bias):
        return fused_attn((q, k, v), config=config, bias=bias, sequence=sequence,
                          dropout_rng=key if dropout else None, is_training=dropout > 0)
    return WithParams(attend, (bias,)) if learn_bias else attend


# The packed-bias impls: THD rows of PACKED_SEGMENTS sequences of equal length, a post-scale
# bias [1, h, s, s] (cuDNN refuses a bias under packing: flash against xla).
PACKED_SEGMENTS = 4


def packed_bias(b: int, s: int, h: int):
    """(bias, sequence) of the packed-bias impls for one shape (fixed random bias)."""
    lengths = jnp.full((b, PACKED_SEGMENTS), s // PACKED_SEGMENTS, jnp.int32)
    offsets = jnp.broadcast_to(jnp.arange(PACKED_SEGMENTS + 1, dtype=jnp.int32) * (s // PACKED_SEGMENTS),
                               (b, PACKED_SEGMENTS + 1))
    bias = jax.random.normal(jax.random.key(s + h), (1, h, s, s), jnp.float32)
    return bias, SequenceDescriptor.from_seqlens_and_offsets(lengths, lengths, offsets, offsets)


@contextlib.contextmanager
def _sm80_named():
    """FUSEDATTN_FLASH_KERNEL=sm80 for the duration (the flash backend reads it when it traces)."""
    before = os.environ.get("FUSEDATTN_FLASH_KERNEL")
    os.environ["FUSEDATTN_FLASH_KERNEL"] = "sm80"
    try:
        yield
    finally:
        if before is None:
            del os.environ["FUSEDATTN_FLASH_KERNEL"]
        else:
            os.environ["FUSEDATTN_FLASH_KERNEL"] = before


def ours_sm80(causal: bool):
    inner = ours("flash", causal)

    def attend(q, k, v):
        with _sm80_named():
            return inner(q, k, v)
    return attend


def jax_cudnn(causal: bool):
    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    return attend


def fa3(causal: bool):
    def attend(q, k, v):
        from flash_attn3_jax import flash_mha  # here: a table without the wheel still builds

        return flash_mha(q, k, v, is_causal=causal)
    return attend


def impls(causal: bool, d: int, dropout: bool, packed=None) -> dict:
    """The impls of one case; packed: packed_bias's (bias, sequence) where a packed-bias impl
    was chosen."""
    table = {"flash": ours("flash", causal), "flash_sm80": ours_sm80(causal), "xla": ours("xla", causal),
             "auto": ours("auto", causal),
             "cudnn": ours("cudnn", causal), "jax_cudnn": jax_cudnn(causal)}
    if dropout:
        table.update(flash_dropout=ours("flash", causal, 0.1), cudnn_dropout=ours("cudnn", causal, 0.1))
    for backend in ("flash", "cudnn", "xla"):
        table[f"{backend}_alibi"] = ours(backend, causal, alibi=True)
    for backend in ("flash", "xla"):
        table[f"{backend}_alibi_window"] = ours(backend, causal, alibi=True, window=ALIBI_WINDOW)
    if packed is not None:
        for backend in ("flash", "xla"):
            table[f"{backend}_bias_packed"] = ours(backend, causal, bias=packed[0], sequence=packed[1])
            table[f"{backend}_bias_grad_packed"] = ours(backend, causal, bias=packed[0], sequence=packed[1],
                                                        learn_bias=True)
    if d == 128:
        table["fa3"] = fa3(causal)
    return table


DEFAULT_IMPLS = ("flash", "flash_sm80", "xla", "cudnn", "jax_cudnn", "fa3", "flash_dropout", "cudnn_dropout")
# Opt-in (--impls): backend "auto" (cudnn or flash: explain says which), the ALiBi impls (the
# xla ones take 5-18 ms a call at the large shapes) and the packed-bias ones (a float32 bias
# of h s^2 elements: 4 GB at s = 8192, h = 16; "bias_grad": fwd+bwd also differentiates it).
PACKED_BIAS_IMPLS = ("flash_bias_packed", "xla_bias_packed", "flash_bias_grad_packed", "xla_bias_grad_packed")
IMPL_NAMES = DEFAULT_IMPLS + ("auto", "flash_alibi", "cudnn_alibi", "xla_alibi", "flash_alibi_window",
                              "xla_alibi_window") + PACKED_BIAS_IMPLS


def add_arguments(parser):
    parser.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                        help=f"comma-separated subset of {','.join(IMPL_NAMES)} (default: "
                             f"{','.join(DEFAULT_IMPLS)})")
    parser.add_argument("--shapes", default="",
                        help="b,s,h,h_kv,d shapes separated by '/' instead of the default set")
    parser.add_argument("--masks", default="no_mask,causal", help="no_mask, causal or both (comma-separated)")


def chosen_shapes(args):
    """The (b, s, h, h_kv, d) shapes to run: --shapes, else the first (--quick) or all of SHAPES."""
    if args.shapes:
        try:
            shapes = [tuple(int(x) for x in shape.split(",")) for shape in args.shapes.split("/")]
        except ValueError:
            shapes = []
        if not shapes or any(len(shape) != 5 for shape in shapes):
            raise SystemExit(f"--shapes: expected b,s,h,h_kv,d integer shapes separated by '/', got {args.shapes!r}")
        return shapes
    return SHAPES[:1] if args.quick else SHAPES


def flops(b, s, h, d, causal, pass_name):
    forward = 4 * b * h * s * s * d / (2 if causal else 1)
    return forward if pass_name == "fwd" else 3.5 * forward


def main():
    args = parse_args("benchmarks/results/flash.json", add_arguments)
    chosen = args.impls.split(",")
    unknown = sorted(set(chosen) - set(IMPL_NAMES))
    if unknown:
        raise SystemExit(f"--impls: unknown {', '.join(unknown)}; choose from {','.join(IMPL_NAMES)}")
    shapes = chosen_shapes(args)
    masks = args.masks.split(",")
    if not set(masks) <= {"no_mask", "causal"} or not masks:
        raise SystemExit(f"--masks: expected no_mask and/or causal, got {args.masks!r}")
    rows = []
    for index, (b, s, h, h_kv, d) in enumerate(shapes):
        keys = jax.random.split(jax.random.key(s + d + h_kv), 4)
        q = random_normal(keys[0], (b, s, h, d), jnp.bfloat16)
        k = random_normal(keys[1], (b, s, h_kv, d), jnp.bfloat16)
        v = random_normal(keys[2], (b, s, h_kv, d), jnp.bfloat16)
        do = random_normal(keys[3], (b, s, h, d), jnp.bfloat16)
        for causal in [mask == "causal" for mask in masks]:
            name = f"b{b}_s{s}_h{h}_{h_kv}_d{d}" + ("_causal" if causal else "")
            shape = {"b": b, "s": s, "h": h, "h_kv": h_kv, "d": d, "causal": causal}
            packed = (packed_bias(b, s, h)
                      if set(PACKED_BIAS_IMPLS) & set(chosen) else None)
            table = {n: f for n, f in impls(causal, d, dropout=index == 0, packed=packed).items()
                     if n in chosen}
            for pass_name in ("fwd", "fwd+bwd"):
                fns = {n: passes(f)[pass_name] for n, f in table.items()}
                times, errors = interleaved_ms(fns, (q, k, v, do), args.repeats, args.iters,
                                               args.min_window_ms)
                for impl in table:
                    row = {"name": name, "shape": shape, "impl": impl, "pass": pass_name}
                    if impl in times:
                        ms = times[impl]
                        tflops = flops(b, s, h, d, causal, pass_name) / (ms * 1e-3) / 1e12
                        row.update(ms=round(ms, 4), tflops=round(tflops, 1),
                                   of_peak=round(tflops * 1e12 / H200_MEASURED_MATMUL_FLOPS, 3))
                    else:
                        row.update(ms=None, unsupported=errors[impl])
                    rows.append(row)
                    print(row, flush=True)
    summary = summarize(rows)
    write_results(args.out, rows, summary=summary,
                  flops="matmul only: fwd 4*b*h*s*s*d (causal /2), fwd+bwd 3.5x",
                  peak="790 TF/s (large bf16 matmul measured on the H200)",
                  method="interleaved rotated rounds, median per impl")
    print_table(summary)


def summarize(rows):
    by_key = {(r["name"], r["impl"], r["pass"]): r for r in rows}
    out = []
    for r in rows:
        if r["impl"] != "flash":
            continue
        entry = {"name": r["name"], "pass": r["pass"], "flash_ms": r["ms"],
                 "flash_tflops": r.get("tflops")}
        for peer in IMPL_NAMES[1:]:
            other = by_key.get((r["name"], peer, r["pass"]), {})
            entry[f"{peer}_tflops"] = other.get("tflops")
            entry[f"speed_vs_{peer}"] = (round(other["ms"] / r["ms"], 3)
                                         if other.get("ms") and r["ms"] else None)
        dropout = by_key.get((r["name"], "flash_dropout", r["pass"]), {})
        cudnn_dropout = by_key.get((r["name"], "cudnn_dropout", r["pass"]), {})
        entry["flash_dropout_vs_cudnn_dropout"] = (
            round(cudnn_dropout["ms"] / dropout["ms"], 3)
            if dropout.get("ms") and cudnn_dropout.get("ms") else None)
        entry["flash_dropout_of_plain"] = (round(r["ms"] / dropout["ms"], 3)
                                           if dropout.get("ms") and r["ms"] else None)
        # ALiBi: flash's ALiBi speed as a fraction of plain flash's, and against its peers.
        alibi = {n: by_key.get((r["name"], n, r["pass"]), {}).get("ms")
                 for n in ("flash_alibi", "cudnn_alibi", "xla_alibi", "flash_alibi_window",
                           "xla_alibi_window")}
        ratio = lambda slow, fast: round(slow / fast, 3) if slow and fast else None
        entry["flash_alibi_of_plain"] = ratio(r["ms"], alibi["flash_alibi"])
        entry["flash_alibi_vs_cudnn_alibi"] = ratio(alibi["cudnn_alibi"], alibi["flash_alibi"])
        entry["flash_alibi_vs_xla_alibi"] = ratio(alibi["xla_alibi"], alibi["flash_alibi"])
        entry["flash_alibi_window_vs_xla"] = ratio(alibi["xla_alibi_window"], alibi["flash_alibi_window"])
        # A bias under packing (its TF/s count dense work; the ratio is what compares).
        packed = {n: by_key.get((r["name"], n, r["pass"]), {}).get("ms") for n in PACKED_BIAS_IMPLS}
        entry["flash_bias_packed_vs_xla"] = ratio(packed["xla_bias_packed"], packed["flash_bias_packed"])
        entry["flash_bias_grad_packed_vs_xla"] = ratio(packed["xla_bias_grad_packed"],
                                                       packed["flash_bias_grad_packed"])
        out.append(entry)
    return out


def print_table(summary):
    fmt = lambda x, f="{:.2f}": "n/a" if x is None else f.format(x)
    print(f"\n{'case':<30}{'pass':<8}{'flash':>7}{'sm80':>7}{'xla':>7}{'cudnn':>7}{'jaxcd':>7}{'fa3':>7}"
          f"{'vs cudnn':>9}{'vs fa3':>8}{'drop vs cudnn':>14}{'drop/plain':>11}")
    for s in summary:
        print(f"{s['name']:<30}{s['pass']:<8}{fmt(s['flash_tflops'], '{:.0f}'):>7}"
              f"{fmt(s['flash_sm80_tflops'], '{:.0f}'):>7}{fmt(s['xla_tflops'], '{:.0f}'):>7}"
              f"{fmt(s['cudnn_tflops'], '{:.0f}'):>7}{fmt(s['jax_cudnn_tflops'], '{:.0f}'):>7}"
              f"{fmt(s['fa3_tflops'], '{:.0f}'):>7}{fmt(s['speed_vs_cudnn'], '{:.3f}'):>9}"
              f"{fmt(s['speed_vs_fa3'], '{:.3f}'):>8}"
              f"{fmt(s['flash_dropout_vs_cudnn_dropout'], '{:.3f}'):>14}"
              f"{fmt(s['flash_dropout_of_plain'], '{:.3f}'):>11}")
    print("TF/s columns; 'vs X' = X's time / flash's time (> 1: flash faster; targets: >= 1.00 vs "
          "fa3, >= 1.05 vs cudnn); drop = flash with dropout 0.1 vs cudnn's dropout (target "
          ">= 1.5) and vs flash plain (target >= 0.85)")
    print(f"\n{'case':<30}{'pass':<8}{'alibi/plain':>12}{'vs cudnn_alibi':>15}{'vs xla_alibi':>13}"
          f"{'window vs xla':>14}")
    for s in summary:
        print(f"{s['name']:<30}{s['pass']:<8}{fmt(s['flash_alibi_of_plain'], '{:.3f}'):>12}"
              f"{fmt(s['flash_alibi_vs_cudnn_alibi'], '{:.3f}'):>15}"
              f"{fmt(s['flash_alibi_vs_xla_alibi'], '{:.3f}'):>13}"
              f"{fmt(s['flash_alibi_window_vs_xla'], '{:.3f}'):>14}")
    print("ALiBi: alibi/plain = flash ALiBi's speed as a fraction of plain flash's; vs X = X's time "
          "/ flash ALiBi's (targets: ALiBi+window >= 5x xla)")
    print(f"\n{'case':<30}{'pass':<8}{'bias packed vs xla':>19}{'learned':>9}")
    for s in summary:
        print(f"{s['name']:<30}{s['pass']:<8}{fmt(s['flash_bias_packed_vs_xla'], '{:.3f}'):>19}"
              f"{fmt(s['flash_bias_grad_packed_vs_xla'], '{:.3f}'):>9}")
    print(f"a post-scale bias [1, h, s, s] under THD packing ({PACKED_SEGMENTS} sequences a row): xla's time / "
          "flash's (target >= 5); learned: the bias differentiated too (fwd+bwd)")


if __name__ == "__main__":
    main()
