"""Variants of the paged decode CUDA kernel timed side by side (GPU machine).

Each variant is a set of literal edits to ops_cuda/cuda/paged_decode.cu (VARIANTS). The
source of every variant named, and "as_is" (the source unchanged), is compiled on its own
(nvcc, sm_90a, this one translation unit, the variants in parallel) into a shared library
whose handler is registered under a target of its own; then benchmarks/decode.py's cases
(GQA 32/8, d=128, bf16, bottom-right causal, random page tables) are timed through those
raw targets with the operands and workspace the decode backend passes, the variants
interleaved (common.interleaved_ms). Each variant's output is compared with as_is's.

    python benchmarks/probes/decode_variants.py --out $OUT/decode_variants.json [VARIANT ...]

With --profile DIR, as_is's call of each case is also traced (benchmarks/kernel_profile.py):
its device time by kernel (the decode kernel, the combine kernel when it splits).

(scripts/device.sh decode_variants runs it with every variant.)
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import math
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import _benchmarks_on_path  # noqa: F401  (benchmarks/ on sys.path)
from common import H200_HBM_BYTES_PER_S, interleaved_ms, parse_args, random_normal, write_results
from decode import PROFILE_KEPT, PROFILE_STEPS, PROFILE_TOP, HEAD_DIM, HEADS, KV_HEADS, floor_bytes, paged_cache
from kernel_profile import profile_call
from fusedattn.ops.backends import decode as decode_backend

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "ops_cuda/cuda/paged_decode.cu"
SYMBOL = "FusedattnPagedDecodeFwdCuda"
CASES = tuple((b, s_kv, s_q, page) for b, s_kv in ((16, 8192), (64, 2048), (4, 32768), (128, 1024))
              for s_q, page in ((1, 16), (1, 64), (4, 64)))

_ORDER = ("  const int64_t s = blockIdx.x / head_ctas / a.splits;\n"
          "  const int split = static_cast<int>(blockIdx.x / head_ctas % a.splits);\n")
_RESIDENT = "const int64_t resident = static_cast<int64_t>(sms) * std::max(resident_per_sm, 1);"
_STAGES = "kStages = D >= 256 ? 2 : D >= 128 ? 3 : 4;"
_BOUNDS = "__launch_bounds__(kThreads) paged_decode_kernel"
_ROW_THREADS = "constexpr int kRowThreads = 8;"

VARIANTS: dict[str, dict[str, str]] = {
    "as_is": {},
    # Each tile's page-table entries read from global memory as its copies are issued (the
    # second kernel's way), not from the shared-memory window.
    "global_table": {"sh.pages[page - static_cast<uint32_t>(window)]": "table[page]"},
    # The first kernel's grid order: the sequences side by side, each K/V head in turn.
    "sequences_adjacent": {
        "  const int head_cta = static_cast<int>(blockIdx.x % head_ctas);\n" + _ORDER:
        "  const int64_t s = blockIdx.x % p.sequences;\n"
        "  const int head_cta = static_cast<int>(blockIdx.x / p.sequences % head_ctas);\n"
        "  const int split = static_cast<int>(blockIdx.x / p.sequences / head_ctas);\n"},
    # Splits for two waves of resident CTAs instead of one.
    "two_waves": {_RESIDENT: "const int64_t resident = 2 * static_cast<int64_t>(sms) * "
                             "std::max(resident_per_sm, 1);"},
    # CTAs of 8 warps and 128-key tiles (d=128: 204 KB, one CTA per SM; d=256 no longer fits).
    "threads256": {"constexpr int kThreads = 128;": "constexpr int kThreads = 256;"},
    # The combine kernel launched in stream order, not as a programmatic dependent launch.
    "no_pdl": {"major >= 9;": "major >= 9 && false;"},
    # Four stages at d=128 (135 KB: one CTA per SM) instead of three (two CTAs).
    "d128_stages4": {_STAGES: "kStages = D >= 256 ? 2 : 4;"},
    # Two stages at d=128 (68 KB: three CTAs per SM with one query tile; two tiles' 208
    # registers still allow two).
    "d128_stages2": {_STAGES: "kStages = D >= 256 ? 2 : D >= 128 ? 2 : 4;"},
    # Two stages and at most 168 registers a thread: three CTAs per SM with two query tiles too.
    "d128_stages2_regs168": {_STAGES: "kStages = D >= 256 ? 2 : D >= 128 ? 2 : 4;",
                             _BOUNDS: "__launch_bounds__(kThreads, 3) paged_decode_kernel"},
    # Four threads per key row in the tile copies (the kernel before 8 was measured faster:
    # half the page lookups, 64 contiguous bytes per row per copy instruction) and two.
    "row_threads4": {_ROW_THREADS: "constexpr int kRowThreads = 4;"},
    "row_threads2": {_ROW_THREADS: "constexpr int kRowThreads = 2;"},
    # The accumulators rescaled on every tile, as before the skip when no maximum grew.
    "always_rescale": {"if (warp_ballot(grew) != 0) {": "if (true) {"},
}


def build(name: str, edits: dict[str, str], work: Path) -> Path:
    """Compiles variant `name` into work/name/libpaged_decode.so."""
    source = SOURCE.read_text()
    for old, new in edits.items():
        if source.count(old) != 1:
            raise SystemExit(f"variant {name}: {old!r} must occur once in {SOURCE}")
        source = source.replace(old, new)
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "paged_decode.cu").write_text(source)
    library = folder / "libpaged_decode.so"
    command = ["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17",
               "--expt-relaxed-constexpr", "-Xptxas", "-v", "-shared", "-Xcompiler", "-fPIC",
               f"-I{ROOT / 'ops_cuda/include'}", f"-I{ROOT / 'ops_cuda/cuda'}",
               "-isystem", jax.ffi.include_dir(), str(folder / "paged_decode.cu"), "-o", str(library)]
    result = subprocess.run(command, capture_output=True, text=True)
    (folder / "build.log").write_text(result.stdout + result.stderr)
    if result.returncode:
        raise SystemExit(f"variant {name}: nvcc failed:\n{result.stderr[-3000:]}")
    return library


def register(name: str, library: Path, keep: list) -> str:
    """Registers the library's handler for CUDA as target "paged_decode_<name>"."""
    lib = ctypes.CDLL(str(library))
    keep.append(lib)
    target = f"paged_decode_{name}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, SYMBOL)), platform="CUDA")
    return target


def raw_decode(target: str, q_shape, pages_per_seq: int, page: int):
    """jit fn(q, k_pages, v_pages, table, q_len, kv_len) -> o through `target`, with the
    attributes and workspace the decode backend passes for mask padding_causal_bottom_right."""
    b, _, _, d = q_shape
    workspace = decode_backend._cuda_workspace_bytes(q_shape, KV_HEADS, d, b, pages_per_seq * page)
    static = decode_backend._Static(scale=1.0 / math.sqrt(d), causal=True, bottom_right=True,
                                    window_left=-1, window_right=-1, softmax_type=0)
    results = (jax.ShapeDtypeStruct(q_shape, jnp.bfloat16), jax.ShapeDtypeStruct((workspace,), jnp.uint8))

    @jax.jit
    def attend(q, k_pages, v_pages, table, q_len, kv_len):
        return jax.ffi.ffi_call(target, results)(
            q, k_pages, v_pages, table, np.zeros((0,), np.int32), q_len, kv_len,  # q_start 0
            np.zeros((0,), np.float32), **static.attributes())[0]  # offsets 0: no op before the kernel
    return attend


def time_case(targets: dict[str, str], case, args) -> list[dict]:
    b, s_kv, s_q, page = case
    keys = jax.random.split(jax.random.key(b + s_kv + s_q), 4)
    q = random_normal(keys[0], (b, s_q, HEADS, HEAD_DIM), jnp.bfloat16)
    k = random_normal(keys[1], (b, s_kv, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    v = random_normal(keys[2], (b, s_kv, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    k_pages, v_pages, table = paged_cache(keys[3], k, v, page)
    operands = (q, k_pages, v_pages, table, jnp.full((b,), s_q, jnp.int32), jnp.full((b,), s_kv, jnp.int32))
    fns = {name: raw_decode(target, q.shape, table.shape[1], page) for name, target in targets.items()}
    want = np.asarray(fns["as_is"](*operands), np.float32)
    times, errors = interleaved_ms(fns, operands, args.repeats, args.iters, args.min_window_ms)
    floor_ms = floor_bytes(b, s_kv, s_q) / H200_HBM_BYTES_PER_S * 1e3
    rows = []
    for name in fns:
        row = {"name": f"b{b}_skv{s_kv}_sq{s_q}_page{page}", "variant": name,
               "shape": {"b": b, "s_kv": s_kv, "s_q": s_q, "page": page}, "floor_ms": round(floor_ms, 4)}
        if name in times:
            got = np.asarray(fns[name](*operands), np.float32)
            row.update(ms=round(times[name], 4), fraction_of_floor=round(floor_ms / times[name], 3),
                       max_abs_diff_vs_as_is=float(np.nanmax(np.abs(got - want))))
            if args.profile and name == "as_is":
                profile = profile_call(fns[name], operands, Path(args.profile) / row["name"],
                                       PROFILE_STEPS, top=PROFILE_TOP)
                row["profile"] = {key: profile[key] for key in PROFILE_KEPT if key in profile}
        else:
            row.update(ms=None, error=errors[name])
        rows.append(row)
        print(row, flush=True)
    return rows


def main():
    def add_arguments(parser):
        parser.add_argument("variants", nargs="*", help=f"of {', '.join(VARIANTS)} (default: all)")
        parser.add_argument("--profile", metavar="DIR", default=None,
                            help="also trace as_is's calls of each case into DIR")

    args = parse_args("benchmarks/results/decode_variants.json", add_arguments)
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    names = ["as_is"] + [v for v in (args.variants or VARIANTS) if v != "as_is"]
    work = Path(tempfile.mkdtemp(prefix="decode_variants_"))
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        libraries = dict(zip(names, pool.map(lambda n: build(n, VARIANTS[n], work), names)))
    for name in names:
        log = (work / name / "build.log").read_text()
        print(name, "ptxas:", "; ".join(line.split(":", 1)[1].strip() for line in log.splitlines()
                                        if "registers" in line))
    keep: list = []
    targets = {name: register(name, libraries[name], keep) for name in names}
    rows = []
    for case in CASES[:3] if args.quick else CASES:
        rows += time_case(targets, case, args)
    write_results(args.out, rows, variants={n: VARIANTS[n] for n in names}, peak_bytes_per_s=H200_HBM_BYTES_PER_S)
    cases = sorted({r["name"] for r in rows}, key=lambda n: [r["name"] for r in rows].index(n))
    print(f"\nfraction of the byte floor\n{'case':<28}" + "".join(f"{n:>20}" for n in names))
    by = {(r["name"], r["variant"]): r for r in rows}
    for case in cases:
        print(f"{case:<28}" + "".join(f"{by[(case, n)].get('fraction_of_floor') or float('nan'):>20.3f}"
                                      for n in names))


if __name__ == "__main__":
    main()
