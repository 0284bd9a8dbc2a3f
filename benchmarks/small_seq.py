"""Small-sequence cross-attention: ours against jax.nn.dot_product_attention.

One query token per batch row, s_kv keys, padding mask from key lengths (all
full here so every implementation reads every byte), bf16. Impls:
"small_seq" (fusedattn, backend small_seq, default config), "small_seq_unchecked"
(the same with config.sequence.check_bounds = False: no checkify effect, so
JAX's C++ dispatch fast path; the NaN marks stay), "small_seq_kernel" (the
kernels alone, without the key-range pre-pass and guard, a diagnostic), "xla" and "cudnn"
(jax.nn.dot_product_attention implementation=...; cuDNN has no backward for
s_q = 1). Passes "fwd" and "fwd+bwd" (the VJP with a random cotangent).

The floor is bytes over the H200's 4.8 TB/s: forward reads q, k, v and writes
o; the backward also reads q, k, v, o, dO and writes dq, dk, dv.

    python benchmarks/small_seq.py --out benchmarks/results/small_seq.json

With --profile DIR each timed row is also traced (PROFILE_STEPS back-to-back calls,
into DIR/<name>_<impl>_<pass>; benchmarks/kernel_profile.py) and gets "profile": the
device time per call by kernel kind, the GPU's idle time between kernels and the
kernels per call. That separates a kernel's own rate (device ms of kind "fusedattn"
against the floor) from what a call adds around it (other kernels, launch gaps).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

import fusedattn
from fusedattn.ops import SequenceDescriptor, fused_attn
from fusedattn.ops import _library
from fusedattn.ops.backends import small_seq

from common import (H200_HBM_BYTES_PER_S, median_ms, parse_args, random_normal, timing,
                    write_results)
from kernel_profile import profile_call

HEADS = 16
S_KV = (2, 4, 6, 8, 12, 16)
PROFILE_STEPS = 10  # calls traced per row with --profile
PROFILE_TOP = 4  # longest kernels kept per row
# Of kernel_profile.summarize's keys, those kept in the results.
PROFILE_KEPT = ("error", "device_ms_per_step", "idle_ms_per_step", "kernels_per_step",
                "ms_per_step", "top_kernels_ms_per_step")


def ours(q, k, v, kv_len, check_bounds=True):
    config = fusedattn.configs.attention_config()
    config.backend = "small_seq"
    config.mask = "padding"
    config.sequence.max_seqlen_q = 1
    config.sequence.max_seqlen_kv = k.shape[1]
    config.sequence.check_bounds = check_bounds
    q_len = jnp.ones_like(kv_len)
    return fused_attn((q, k, v), config=config,
                      sequence=SequenceDescriptor.from_seqlens(q_len, kv_len))


def jax_attention(implementation):
    def attend(q, k, v, kv_len):
        return jax.nn.dot_product_attention(q, k, v, query_seq_lengths=jnp.ones_like(kv_len),
                                            key_value_seq_lengths=kv_len,
                                            implementation=implementation)
    return attend


def ours_kernel_only(q, k, v, kv_len):
    """Diagnostic: the kernels alone, without the descriptor -> key-range pre-pass and guard."""
    unavailable = _library.available(jax.default_backend())  # fused_attn would load it
    if unavailable:
        raise RuntimeError(unavailable)
    kv_start = jnp.zeros((q.shape[0], 1), jnp.int32)
    return small_seq._small_seq(q, k, v, kv_start, kv_len[:, None], jnp.zeros((2,), jnp.uint32),
                                q.shape[-1] ** -0.5, 0.0, k.shape[1])


IMPLS = {"small_seq": ours,
         "small_seq_unchecked": lambda q, k, v, kv_len: ours(q, k, v, kv_len, check_bounds=False),
         "small_seq_kernel": ours_kernel_only, "xla": jax_attention("xla"),
         "cudnn": jax_attention("cudnn")}


def passes(attend):
    forward = jax.jit(attend)

    @jax.jit
    def forward_backward(q, k, v, kv_len, do):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, kv_len), q, k, v)
        return out, vjp(do)

    return {"fwd": lambda q, k, v, kv_len, do: forward(q, k, v, kv_len),
            "fwd+bwd": forward_backward}


def floor_bytes(b, s_kv, d, itemsize, pass_name):
    q = o = b * HEADS * d * itemsize
    kv = 2 * b * s_kv * HEADS * d * itemsize
    forward = q + kv + o
    return forward if pass_name == "fwd" else forward + (q + kv + o + o) + (q + kv)


def add_arguments(parser):
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help=f"comma-separated subset of {', '.join(IMPLS)}")
    parser.add_argument("--s-kv", default=",".join(map(str, S_KV)),
                        help="comma-separated key counts")
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help=f"also trace {PROFILE_STEPS} calls of each row into DIR and add "
                             "its device time by kernel kind")


def main():
    args = parse_args("benchmarks/results/small_seq.json", add_arguments)
    impls = {name: IMPLS[name] for name in args.impls.split(",")}
    shapes = [(30720, 128), (4000, 128), (30720, 256)]
    if args.quick:
        shapes = shapes[:1]
    rows = []
    for b, d in shapes:
        for s_kv in map(int, args.s_kv.split(",")):
            keys = jax.random.split(jax.random.key(s_kv * 1000 + d), 4)
            q = random_normal(keys[0], (b, 1, HEADS, d), jnp.bfloat16)
            k = random_normal(keys[1], (b, s_kv, HEADS, d), jnp.bfloat16)
            v = random_normal(keys[2], (b, s_kv, HEADS, d), jnp.bfloat16)
            do = random_normal(keys[3], (b, 1, HEADS, d), jnp.bfloat16)
            kv_len = jnp.full((b,), s_kv, jnp.int32)
            shape = {"b": b, "h": HEADS, "d": d, "s_kv": s_kv, "s_q": 1}
            for impl, attend in impls.items():
                for pass_name, fn in passes(attend).items():
                    row = {"name": f"b{b}_d{d}_skv{s_kv}", "shape": shape, "impl": impl,
                           "pass": pass_name}
                    floor_ms = floor_bytes(b, s_kv, d, 2, pass_name) / H200_HBM_BYTES_PER_S * 1e3
                    try:
                        ms = median_ms(fn, q, k, v, kv_len, do, **timing(args))
                    except Exception as error:  # cuDNN rejects s_q = 1 in the backward
                        row.update(ms=None, unsupported=str(error).splitlines()[0][:200])
                    else:
                        row.update(ms=round(ms, 4), floor_ms=round(floor_ms, 4),
                                   fraction_of_floor=round(floor_ms / ms, 3))
                        if args.profile:
                            trace = f"{row['name']}_{impl}_{pass_name.replace('+', '_')}"
                            profile = profile_call(fn, (q, k, v, kv_len, do),
                                                   Path(args.profile) / trace, PROFILE_STEPS,
                                                   top=PROFILE_TOP)
                            row["profile"] = {key: profile[key] for key in PROFILE_KEPT
                                              if key in profile}
                    rows.append(row)
                    print(row, flush=True)
    summary = summarize(rows)
    write_results(args.out, rows, summary=summary,
                  floor="bytes / 4.8 TB/s (H200 HBM3e peak)")
    print_table(rows, summary)
    if args.profile:
        print_profile(rows)


def summarize(rows):
    """Per row of ours: time, floor fraction and speedup over each peer; with --profile
    traces also the speedup in device time per call, which is the kernels' own where a
    call's wall time is mostly dispatch (the b=4000 forwards)."""
    by_key = {(r["name"], r["impl"], r["pass"]): r for r in rows}
    out = []
    for r in rows:
        if r["impl"] not in ("small_seq", "small_seq_unchecked") or r["ms"] is None:
            continue
        entry = {"name": r["name"], "impl": r["impl"], "pass": r["pass"], "ms": r["ms"],
                 "fraction_of_floor": r["fraction_of_floor"]}
        for peer in ("xla", "cudnn"):
            peer_row = by_key.get((r["name"], peer, r["pass"]), {})
            entry[f"speedup_vs_{peer}"] = (round(peer_row["ms"] / r["ms"], 2)
                                           if peer_row.get("ms") else None)
            device_ms = [row.get("profile", {}).get("device_ms_per_step") for row in (r, peer_row)]
            if all(device_ms):
                entry[f"device_speedup_vs_{peer}"] = round(device_ms[1] / device_ms[0], 2)
        out.append(entry)
    return out


def print_table(rows, summary):
    print(f"\n{'shape':<22}{'impl':<21}{'pass':<9}{'ours ms':>9}{'kernel':>8}{'xla ms':>9}"
          f"{'cudnn ms':>10}{'vs xla':>8}{'vs cudnn':>9}{'floor%':>8}{'device vs xla':>14}")
    times = {(r["name"], r["impl"], r["pass"]): r["ms"] for r in rows}
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"
    for s in summary:
        peers = [times.get((s["name"], impl, s["pass"]))
                 for impl in ("small_seq_kernel", "xla", "cudnn")]
        print(f"{s['name']:<22}{s['impl']:<21}{s['pass']:<9}{s['ms']:>9.3f}"
              + "".join(f"{fmt(ms):>{width}}" for ms, width in zip(peers, (8, 9, 10)))
              + f"{fmt(s['speedup_vs_xla']):>8}{fmt(s['speedup_vs_cudnn']):>9}"
              f"{100 * s['fraction_of_floor']:>7.0f}%{fmt(s.get('device_speedup_vs_xla')):>14}")


def print_profile(rows):
    """Per traced row: timed ms, device ms per call (all kernels, and ours alone), the
    GPU's idle ms between kernels, kernels per call, and the floor over our kernels' time."""
    print(f"\n{'shape':<22}{'impl':<21}{'pass':<9}{'timed':>8}{'device':>8}{'ours':>8}{'idle':>8}"
          f"{'kernels':>8}{'ours floor%':>12}")
    for r in rows:
        p = r.get("profile")
        if p is None:
            continue
        head = f"{r['name']:<22}{r['impl']:<21}{r['pass']:<9}{r['ms']:>8.3f}"
        if "error" in p:
            print(f"{head}  error: {p['error'][:80]}")
            continue
        ours_ms = p["ms_per_step"].get("fusedattn")
        print(f"{head}{p['device_ms_per_step']:>8.3f}{ours_ms or 0.0:>8.3f}{p['idle_ms_per_step']:>8.3f}"
              f"{p['kernels_per_step']:>8g}"
              + (f"{100 * r['floor_ms'] / ours_ms:>11.0f}%" if ours_ms else f"{'-':>12}"))


if __name__ == "__main__":
    main()
