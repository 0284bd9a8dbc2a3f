"""Decoding over a KV cache: our paged decode kernel against our contiguous path, XLA and
FlashAttention-3's KV-cache kernel.

Single-token and 4-token decode (s_q 1 and 4: the new tokens are the last of each
sequence, bottom-right causal) at (b, s_kv) in (16, 8192), (64, 2048), (4, 32768),
(128, 1024); 32 query heads over 8 K/V heads, d=128, bf16, every sequence s_kv keys long.
Impls (pass "fwd"):

- "contiguous": fusedattn.ops.fused_attn, backend "auto" (cuDNN on the H200), K/V
  [b, s_kv, 8, 128], mask "causal_bottom_right".
- "paged": fused_attn, backend "auto" (the "decode" kernel), layout
  "paged_kv_bshd_bshd_bshd", page pools of b * s_kv / page pages, each sequence's
  pages a random permutation of the pool (shape key "page": 16, 64, 256), mask
  "padding_causal_bottom_right", config.sequence.check_bounds = False (the guard's
  checkify effect costs each call JAX's slower dispatch; the NaN marks stay).
- "jax_xla": jax.nn.dot_product_attention(implementation="xla") on the contiguous cache
  with the bottom-right causal mask as a boolean array.
- "fa3", "fa3_paged": flash_attn3_jax.flash_mha_with_kvcache on the contiguous cache and
  on the same page pools and tables (is_causal: bottom-right aligned), num_splits from
  FlashAttention's rule of thumb (enough CTAs for the GPU's SMs, at most 16); only where
  the wheel is installed.

"cudnn_paged" is not measured: our cudnn backend has no paged path (its explain verdict
says so), so there is nothing of ours to time through cuDNN's paged SDPA.

The byte floor of a call is the bytes it must move: the K/V it reads (b * s_kv * h_kv *
d * 2 for each of K and V), q and the output, over --peak bytes/s (the H200's 4.8 TB/s);
"fraction_of_floor" is floor time over measured time.

With --layers L (default 1) each timed call is one jitted program of L decode calls in
sequence, as the L layers of a model's decode step: layer i + 1's queries are layer i's
output, every layer reads the same cache (far larger than L2), and the row's "ms" is the
time per layer. One call per program (L = 1) counts the host's dispatch and the idle GPU
between calls; a step of layers, as a server runs it, leaves only the gaps between kernels.

With --profile DIR the "paged" and "fa3_paged" rows are also traced (PROFILE_STEPS
back-to-back calls into DIR/<name>_<impl>; benchmarks/kernel_profile.py) and get
"profile": device ms per call by kernel (ours: the decode kernel, its combine kernel
when it splits, and the XLA fusions before the call), and the GPU's idle time.

    python benchmarks/decode.py --out benchmarks/results/decode.json
    python benchmarks/decode.py --layers 8 --out benchmarks/results/decode_layers.json
    python benchmarks/decode.py --quick   # one small shape on any device, seconds on a CPU
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import fusedattn
from fusedattn.ops import SequenceDescriptor, explain, fused_attn

from common import H200_HBM_BYTES_PER_S, interleaved_ms, parse_args, random_normal, write_results
from kernel_profile import profile_call

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SHAPES = ((16, 8192), (64, 2048), (4, 32768), (128, 1024))
QUICK_SHAPES = ((2, 256),)
QUERIES = (1, 4)
PAGE_SIZES = (16, 64, 256)
IMPL_NAMES = ("contiguous", "paged", "jax_xla", "fa3", "fa3_paged")
PROFILED = ("paged", "fa3_paged")  # impls traced with --profile
PROFILE_STEPS = 10  # calls traced per row
PROFILE_TOP = 5  # longest kernels kept per row
# Of kernel_profile.summarize's keys, those kept in the results.
PROFILE_KEPT = ("error", "device_ms_per_step", "idle_ms_per_step", "kernels_per_step",
                "top_kernels_ms_per_step")


def add_arguments(parser):
    parser.add_argument("--peak", type=float, default=H200_HBM_BYTES_PER_S,
                        help="HBM bytes/s of the byte floor (default: the H200's 4.8e12)")
    parser.add_argument("--impls", default=",".join(IMPL_NAMES),
                        help=f"comma-separated subset of {','.join(IMPL_NAMES)}")
    parser.add_argument("--layers", type=int, default=1,
                        help="decode calls per timed program, in sequence (a step of layers); "
                             "rows report the time per call")
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help=f"also trace {PROFILE_STEPS} calls of each {'/'.join(PROFILED)} row "
                             "into DIR and add its device time by kernel")


def floor_bytes(b: int, s_kv: int, s_q: int, itemsize: int = 2) -> int:
    """Bytes a decode call must move: K and V read once, q read, the output written."""
    kv = 2 * b * s_kv * KV_HEADS * HEAD_DIM
    q_and_out = 2 * b * s_q * HEADS * HEAD_DIM
    return (kv + q_and_out) * itemsize


def paged_cache(key, k, v, page: int):
    """The contiguous cache [b, s_kv, h_kv, d] as page pools [b * s_kv / page, page, h_kv, d]
    and an int32 table [b, s_kv / page] whose pages are a random permutation of the pool."""
    b, s_kv = k.shape[:2]
    pages = s_kv // page
    order = jax.random.permutation(key, b * pages).astype(jnp.int32)
    table = order.reshape(b, pages)
    inverse = jnp.argsort(order)  # pool slot -> (sequence, page) it holds

    def pool(x):
        return x.reshape(b * pages, page, *x.shape[2:])[inverse]
    return pool(k), pool(v), table


def bottom_right_mask(s_q: int, s_kv: int):
    """[1, 1, s_q, s_kv]: query i sees keys j <= s_kv - s_q + i."""
    return (jnp.arange(s_kv)[None, :] <= s_kv - s_q + jnp.arange(s_q)[:, None])[None, None]


def ours_contiguous():
    config = fusedattn.configs.attention_config()
    config.mask = "causal_bottom_right"
    return jax.jit(lambda q, k, v: fused_attn((q, k, v), config=config))


def paged_config(s_q: int):
    config = fusedattn.configs.attention_config()
    config.qkv_layout = "paged_kv_bshd_bshd_bshd"
    config.mask = "padding_causal_bottom_right"
    config.sequence.max_seqlen_q = s_q
    config.sequence.check_bounds = False
    return config


def ours_paged(s_q: int):
    config = paged_config(s_q)

    @jax.jit
    def attend(q, k_pages, v_pages, table, q_len, kv_len):
        sequence = SequenceDescriptor.from_seqlens(q_len, kv_len)
        return fused_attn((q, k_pages, v_pages), config=config, sequence=sequence,
                          page_table=table)
    return attend


def jax_xla(s_q: int, s_kv: int):
    mask = bottom_right_mask(s_q, s_kv)
    return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask,
                                                                implementation="xla"))


def fa3_splits(b: int) -> int:
    """FlashAttention's rule of thumb: split until b * h_kv * splits covers the SMs."""
    sms = getattr(jax.devices()[0], "core_count", 132) or 132
    return max(1, min(16, sms // (b * KV_HEADS)))


def fa3(b: int, paged: bool):
    from flash_attn3_jax import flash_mha_with_kvcache

    splits = fa3_splits(b)
    if paged:
        return jax.jit(lambda q, k_pages, v_pages, table, kv_len: flash_mha_with_kvcache(
            q, k_pages, v_pages, cache_seqlens=kv_len, page_table=table, is_causal=True,
            num_splits=splits))
    return jax.jit(lambda q, k, v: flash_mha_with_kvcache(q, k, v, is_causal=True,
                                                          num_splits=splits))


def fa3_available() -> str | None:
    """None when flash_attn3_jax imports, else why not."""
    try:
        import flash_attn3_jax  # noqa: F401
    except ImportError as error:
        return f"flash_attn3_jax not installed ({error})"
    return None


def layer_step(attend, args: tuple, layers: int):
    """A zero-argument call of `attend(q, *rest)` (args = (q, *rest)): one program of `layers`
    calls, each taking the previous one's output as its queries (unrolled: a loop's trip
    test would cost a device-to-host copy per layer)."""
    if layers == 1:
        return functools.partial(attend, *args)

    @jax.jit
    def step(q, *rest):
        def layer(x, _):
            return attend(x, *rest).astype(x.dtype), None
        return jax.lax.scan(layer, q, None, length=layers, unroll=True)[0]
    return functools.partial(step, *args)


def case_calls(b: int, s_kv: int, s_q: int, chosen: list[str],
               layers: int = 1) -> list[tuple[int | None, dict]]:
    """[(page or None, {impl: zero-argument call})] of one (b, s_kv, s_q) case; each call
    runs `layers` decode calls in sequence (layer_step)."""
    keys = jax.random.split(jax.random.key(b * 7 + s_kv + s_q), 4)
    q = random_normal(keys[0], (b, s_q, HEADS, HEAD_DIM), jnp.bfloat16)
    k = random_normal(keys[1], (b, s_kv, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    v = random_normal(keys[2], (b, s_kv, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    q_len = jnp.full((b,), s_q, jnp.int32)
    kv_len = jnp.full((b,), s_kv, jnp.int32)
    contiguous = {"contiguous": layer_step(ours_contiguous(), (q, k, v), layers),
                  "jax_xla": layer_step(jax_xla(s_q, s_kv), (q, k, v), layers)}
    if fa3_available() is None:
        contiguous["fa3"] = layer_step(fa3(b, paged=False), (q, k, v), layers)
    calls = [(None, {n: f for n, f in contiguous.items() if n in chosen})]
    for page in PAGE_SIZES:
        if s_kv % page:
            continue
        k_pages, v_pages, table = paged_cache(keys[3], k, v, page)
        paged = {"paged": layer_step(ours_paged(s_q), (q, k_pages, v_pages, table, q_len, kv_len),
                                     layers)}
        if fa3_available() is None:
            paged["fa3_paged"] = layer_step(fa3(b, paged=True), (q, k_pages, v_pages, table, kv_len),
                                            layers)
        calls.append((page, {n: f for n, f in paged.items() if n in chosen}))
    return calls


def paged_backend(b: int, s_kv: int, s_q: int, page: int) -> str:
    """The backend "auto" picks for the paged impl's call (explain, on shapes only)."""
    q = jax.ShapeDtypeStruct((b, s_q, HEADS, HEAD_DIM), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((b * s_kv // page, page, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    sequence = SequenceDescriptor.from_seqlens(np.full(b, s_q, np.int32), np.full(b, s_kv, np.int32))
    return explain((q, pool, pool), config=paged_config(s_q), sequence=sequence,
                   page_table=jax.ShapeDtypeStruct((b, s_kv // page), jnp.int32)).backend


def significant(x: float) -> float:
    """x to 4 significant digits (quick runs on a CPU are far below the floor)."""
    return float(f"{x:.4g}")


def rows_of_case(b: int, s_kv: int, s_q: int, args) -> list[dict]:
    chosen = args.impls.split(",")
    floor_ms = floor_bytes(b, s_kv, s_q) / args.peak * 1e3
    rows = []
    for page, calls in case_calls(b, s_kv, s_q, chosen, args.layers):
        times, errors = interleaved_ms(calls, (), args.repeats, args.iters, args.min_window_ms)
        times = {impl: ms / args.layers for impl, ms in times.items()}
        for impl in calls:
            row = {"name": f"b{b}_skv{s_kv}_sq{s_q}" + (f"_page{page}" if page else ""),
                   "shape": {"b": b, "s_kv": s_kv, "s_q": s_q, "page": page},
                   "impl": impl, "pass": "fwd", "floor_ms": significant(floor_ms)}
            if impl == "paged":
                row["backend"] = paged_backend(b, s_kv, s_q, page)
            if impl.startswith("fa3"):
                row["num_splits"] = fa3_splits(b)
            if impl in times:
                row.update(ms=significant(times[impl]),
                           fraction_of_floor=significant(floor_ms / times[impl]))
                if args.profile and impl in PROFILED:
                    profile = profile_call(calls[impl], (), Path(args.profile) / f"{row['name']}_{impl}",
                                           PROFILE_STEPS, top=PROFILE_TOP)
                    row["profile"] = {key: profile[key] for key in PROFILE_KEPT if key in profile}
            else:
                row.update(ms=None, unsupported=errors[impl])
            rows.append(row)
            print(row, flush=True)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per paged row: its fraction of the floor, and speed against fa3_paged (same page) and
    our contiguous path (same b, s_kv, s_q): the other's time over ours (> 1: paged faster)."""
    def key(r, page):
        return (r["shape"]["b"], r["shape"]["s_kv"], r["shape"]["s_q"], page)

    by = {(key(r, r["shape"]["page"]), r["impl"]): r for r in rows if r.get("ms")}
    out = []
    for r in rows:
        if r["impl"] != "paged" or not r.get("ms"):
            continue
        entry = {"name": r["name"], "fraction_of_floor": r["fraction_of_floor"]}
        for peer, page in (("fa3_paged", r["shape"]["page"]), ("contiguous", None),
                           ("jax_xla", None)):
            other = by.get((key(r, page), peer))
            entry[f"speed_vs_{peer}"] = round(other["ms"] / r["ms"], 3) if other else None
        out.append(entry)
    return out


def print_profile(rows: list[dict]) -> None:
    """Per traced row: timed ms, then device ms per call, idle ms and its longest kernels."""
    for r in (r for r in rows if "profile" in r):
        p = r["profile"]
        kernels = "; ".join(f"{name[:48]} {ms:.4f}" for name, ms in p.get("top_kernels_ms_per_step", ()))
        detail = (f"error: {p['error'][:80]}" if "error" in p else
                  f"device {p['device_ms_per_step']:.4f} idle {p['idle_ms_per_step']:.4f}  {kernels}")
        print(f"{r['name']:<26}{r['impl']:<11}{r['ms']:>8.4f} ms  {detail}")


def main():
    args = parse_args("benchmarks/results/decode.json", add_arguments)
    unknown = sorted(set(args.impls.split(",")) - set(IMPL_NAMES))
    if unknown:
        raise SystemExit(f"--impls: unknown {', '.join(unknown)}; choose from {','.join(IMPL_NAMES)}")
    if args.layers < 1:
        raise SystemExit(f"--layers: a step has at least one layer, got {args.layers}")
    if args.profile and args.layers > 1:
        raise SystemExit("--profile traces one decode call per program; leave --layers at 1")
    rows = []
    for b, s_kv in QUICK_SHAPES if args.quick else SHAPES:
        for s_q in QUERIES:
            rows += rows_of_case(b, s_kv, s_q, args)
    summary = summarize(rows)
    write_results(args.out, rows, summary=summary, heads=HEADS, kv_heads=KV_HEADS,
                  head_dim=HEAD_DIM, dtype="bfloat16", peak_bytes_per_s=args.peak,
                  fa3=fa3_available() or "installed",
                  floor="K and V read once, q read, output written, at peak_bytes_per_s",
                  method="interleaved rotated rounds, median per impl" + (
                      f"; each timed program runs {args.layers} decode calls in sequence (layers "
                      "of a step), ms per call" if args.layers > 1 else ""),
                  layers=args.layers,
                  quick=bool(args.quick))
    for entry in summary:
        print(entry)
    if args.profile:
        print_profile(rows)
    if args.quick:
        print("quick mode: a smoke run, not a measurement")


if __name__ == "__main__":
    main()
