"""Builds of the flash kernels timed side by side in one process (A/B without drift).

Each candidate is a copy of the op library built from another tree (a branch or a patch):
its flash handlers are registered under targets of their own ("fusedattn_flash_fwd__candidate_NAME"),
and the calls of impl "flash@NAME" are lowered with those targets, so one process holds
the tree's kernels ("flash", from the library it loads as usual) and every candidate's,
and benchmarks/flash.py's cases time them interleaved (common.interleaved_ms). Timing
candidates in separate runs read up to 4% apart on one tree (main's (16, 512, 16) forward:
345-363 TF/s over three calls of a session), which hides the effects being measured.

Each call is lowered and compiled once, with the candidate's targets in place; the probe
checks that the compiled program calls them (and the tree's calls none), and that each
candidate's outputs and gradients equal the tree's within bf16 rounding before it times.
With --fa3, flash_attn3_jax (head dim 128) runs in the same rounds as a reference.

    python benchmarks/probes/flash_candidates.py --candidates a=/tmp/cand/a/libfusedattn_cuda.so,b=... \
        --shapes 4,2048,16,16,128/16,512,16,16,128 --out $OUT/flash_candidates.json

scripts/flash_candidates.sh builds the candidate libraries from patches on the GPU machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import _benchmarks_on_path  # noqa: F401  (benchmarks/ on sys.path)
from common import interleaved_ms, parse_args, passes, random_normal, write_results
from flash import chosen_shapes, fa3, flops, ours
from fusedattn.ops import _library
from fusedattn.ops.backends import flash_ffi

# The flash targets a candidate replaces: the module attribute flash_ffi reads when it
# lowers a call -> its base target name.
TARGETS = {"FWD_TARGET": flash_ffi.FWD_TARGET, "BWD_TARGET": flash_ffi.BWD_TARGET}
# Largest |candidate - tree| accepted, relative to the tree's largest |value| (bf16 outputs,
# float32 accumulation in another order).
TOLERANCE = 2e-2


def candidate_target(base: str, name: str) -> str:
    return f"{base}__candidate_{name}"


def flash_targets(text: str) -> set[str]:
    """The flash targets that a lowered program (StableHLO text) calls."""
    found = re.findall(r'custom_call @"?([A-Za-z0-9_.]+)"?', text)
    return {t for t in found if t.startswith(tuple(TARGETS.values()))}


def register(name: str, library: Path, platform: str, keep: list) -> None:
    """Registers `library`'s flash handlers under candidate `name`'s targets (`keep` holds the
    handle open)."""
    platform = _library._ffi_platform(platform)
    _, symbols, _ = _library._LIBRARIES[platform]
    lib = ctypes.CDLL(str(library), mode=ctypes.RTLD_LOCAL)
    keep.append(lib)
    for base in TARGETS.values():
        jax.ffi.register_ffi_target(candidate_target(base, name), jax.ffi.pycapsule(getattr(lib, symbols[base])),
                                    platform=platform)


@contextlib.contextmanager
def lowering_with(name: str | None):
    """flash_ffi lowers to candidate `name`'s targets for the duration (None: the tree's)."""
    before = {attr: getattr(flash_ffi, attr) for attr in TARGETS}
    try:
        for attr, base in TARGETS.items():
            setattr(flash_ffi, attr, base if name is None else candidate_target(base, name))
        yield
    finally:
        for attr, value in before.items():
            setattr(flash_ffi, attr, value)


def compiled_passes(attend, name: str | None, args: tuple, flash: bool = True) -> dict:
    """{"fwd", "fwd+bwd"}: the passes of `attend` compiled with candidate `name`'s targets (None:
    the tree's); ValueError if the program calls any other build's flash targets. flash=False:
    a peer's `attend`, which calls no flash target."""
    out = {}
    jax.clear_caches()  # no trace of another build's lowering is reused
    with lowering_with(name):
        for pass_name, fn in passes(attend).items():
            lowered = jax.jit(fn).lower(*args)
            bases = (TARGETS["FWD_TARGET"],) + ((TARGETS["BWD_TARGET"],) if pass_name == "fwd+bwd" else ())
            want = {t if name is None else candidate_target(t, name) for t in bases} if flash else set()
            got = flash_targets(lowered.as_text())
            if got != want:
                raise ValueError(f"flash_candidates: the {pass_name} program of {name or 'the tree'} calls "
                                 f"{sorted(got)}, expected {sorted(want)}")
            out[pass_name] = lowered.compile()
    return out


def largest_difference(reference, result) -> float:
    """max |result - reference| over every leaf, relative to the reference's largest |value|."""
    worst = 0.0
    for ref, got in zip(jax.tree.leaves(reference), jax.tree.leaves(result)):
        ref, got = np.asarray(ref, np.float32), np.asarray(got, np.float32)
        if not np.isfinite(got).all():
            return float("inf")
        worst = max(worst, float(np.max(np.abs(got - ref))) / max(float(np.max(np.abs(ref))), 1e-30))
    return worst


def differences_from_tree(builds: dict, pass_name: str, operands: tuple) -> dict[str, float]:
    """Each candidate build's largest_difference from the tree's ("flash") result of one pass."""
    reference = builds["flash"][pass_name](*operands)
    return {impl: largest_difference(reference, passes[pass_name](*operands))
            for impl, passes in builds.items() if impl != "flash"}


def add_arguments(parser):
    parser.add_argument("--candidates", required=True,
                        help="NAME=PATH[,NAME=PATH...]: op libraries built from other trees")
    parser.add_argument("--shapes", default="", help="b,s,h,h_kv,d shapes separated by '/'")
    parser.add_argument("--masks", default="no_mask,causal", help="no_mask, causal or both")
    parser.add_argument("--platform", default="cuda", help="the libraries' platform (cpu: host builds)")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="dropout rate of every flash call (the same Philox key in each build)")
    parser.add_argument("--no-compare", action="store_true",
                        help="time the builds without comparing their outputs with the tree's (for a candidate "
                             "that changes a definition, e.g. the dropout mask); each row says so")
    parser.add_argument("--fa3", action="store_true",
                        help="also time flash_attn3_jax (head dim 128) in the same rounds, as a reference")


def parse_candidates(text: str) -> dict[str, Path]:
    candidates = {}
    for item in text.split(","):
        name, sep, path = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_]+", name) or name in candidates:
            raise SystemExit(f"--candidates: expected distinct NAME=PATH items (NAME: letters, digits, _), "
                             f"got {item!r}")
        if not Path(path).is_file():
            raise SystemExit(f"--candidates: {name}: no file {path}")
        candidates[name] = Path(path)
    return candidates


def main():
    args = parse_args("/tmp/flash_candidates.json", add_arguments)
    candidates = parse_candidates(args.candidates)
    if _library.available(args.platform) is not None:
        raise SystemExit(f"flash_candidates: the tree's library: {_library.available(args.platform)}")
    keep: list = []
    for name, path in candidates.items():
        register(name, path, args.platform, keep)
    names = list(candidates)
    rows = []
    for b, s, h, h_kv, d in chosen_shapes(args):
        keys = jax.random.split(jax.random.key(s + d + h_kv), 4)
        operands = (random_normal(keys[0], (b, s, h, d), jnp.bfloat16),
                    random_normal(keys[1], (b, s, h_kv, d), jnp.bfloat16),
                    random_normal(keys[2], (b, s, h_kv, d), jnp.bfloat16),
                    random_normal(keys[3], (b, s, h, d), jnp.bfloat16))
        for causal in [mask == "causal" for mask in args.masks.split(",")]:
            case = f"b{b}_s{s}_h{h}_{h_kv}_d{d}" + ("_causal" if causal else "")
            attend = ours("flash", causal, args.dropout)
            builds = {"flash": compiled_passes(attend, None, operands)}
            for name in names:
                builds[f"flash@{name}"] = compiled_passes(attend, name, operands)
            peers = {"fa3": compiled_passes(fa3(causal), None, operands, flash=False)} if args.fa3 and d == 128 else {}
            for pass_name in ("fwd", "fwd+bwd"):
                differences = {} if args.no_compare else differences_from_tree(builds, pass_name, operands)
                wrong = {impl: x for impl, x in differences.items() if not x <= TOLERANCE}
                fns = {impl: passes[pass_name] for impl, passes in {**builds, **peers}.items() if impl not in wrong}
                times, errors = interleaved_ms(fns, operands, args.repeats, args.iters, args.min_window_ms)
                for impl in {**builds, **peers}:
                    row = {"name": case, "impl": impl, "pass": pass_name,
                           "shape": {"b": b, "s": s, "h": h, "h_kv": h_kv, "d": d, "causal": causal}}
                    if impl in wrong:
                        row["wrong"] = f"differs from the tree's by {wrong[impl]:.3g} of its largest value"
                    elif impl in times:
                        tflops = flops(b, s, h, d, causal, pass_name) / (times[impl] * 1e-3) / 1e12
                        row.update(ms=round(times[impl], 4), tflops=round(tflops, 1),
                                   vs_tree=round(times["flash"] / times[impl], 3) if "flash" in times else None)
                    else:
                        row["error"] = errors[impl]
                    if impl in differences:
                        row["difference"] = differences[impl]
                    elif args.no_compare and impl != "flash":
                        row["difference"] = "not compared (--no-compare)"
                    rows.append(row)
                    print(row, flush=True)
    write_results(args.out, rows, candidates={n: str(p) for n, p in candidates.items()},
                  method="one process: each build's calls compiled once with its own FFI targets, "
                         "interleaved rotated rounds, median per impl; vs_tree = tree's time / impl's")
    print_table(rows)


def print_table(rows):
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    print(f"\n{'case':<30}{'pass':<9}" + "".join(f"{impl:>22}" for impl in impls))
    for key in dict.fromkeys((r["name"], r["pass"]) for r in rows):
        by_impl = {r["impl"]: r for r in rows if (r["name"], r["pass"]) == key}
        cells = []
        for impl in impls:
            r = by_impl.get(impl, {})
            cell = ("wrong" if "wrong" in r else f"{r['tflops']:.1f}" if "tflops" in r else "n/a")
            if r.get("vs_tree") is not None and impl != "flash":
                cell += f" ({r['vs_tree']:.3f}x)"
            cells.append(f"{cell:>22}")
        print(f"{key[0]:<30}{key[1]:<9}" + "".join(cells))
    print("TF/s; (x): the tree's time / the candidate's (> 1: the candidate is faster)")


if __name__ == "__main__":
    main()
