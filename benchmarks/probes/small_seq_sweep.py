"""Tuning the small_seq kernels' launch plans on the GPU machine.

Each variant is a set of literal edits to ops_cuda/cuda/small_seq_kernels.cuh (its plan
constants: rows per batch, the occupancy floor of __launch_bounds__). For each,
a patched copy of the source tree builds the op libraries with CMake (the
variants in parallel, sm_90 only, without cuDNN), then benchmarks/small_seq.py
times the kernels alone with FUSEDATTN_LIB_DIR pointing at that build. The
table compares every variant with "as_is" (the source unchanged).

    python benchmarks/probes/small_seq_sweep.py --out $OUT/sweep bwd_batch8 bwd_batch16

--phase build only builds (so the builds can overlap other GPU work), --phase time
reuses the builds under --out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = "ops_cuda/cuda/small_seq_kernels.cuh"

# BackwardPlan: raw vectors per lane of the (K_j, V_j) pair slots in shared memory (CUDA);
# the occupancy floor of one head without dropout below d=512.
_BWD_SLOTS = "kSlotVectors = 24;"
_BWD_BLOCKS = "|| DROPOUT || D == 512 ? 2 : N == 8 ? 4 : 3;"
# The forward's block size, and its occupancy floor (ForwardPlan).
_FWD_THREADS = "constexpr int kForwardThreads = 128;"
_FWD_BLOCKS = "kMinBlocks = kWideHeavy ? 2 : kHeavy ? 3 : 4;"
# The HIP build's pairs streamed through registers, in batches, instead of the slots.
_REGISTER_PAIRS = {"constexpr bool kStagedPairs = true;": "constexpr bool kStagedPairs = false;",
                   "#if defined(__HIPCC__)\n    stream_rows<": "#if 1\n    stream_rows<"}

_STREAM_LOADS = {
    '"@p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];': '"@p ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];',
    "s.v[t] = *reinterpret_cast<const uint4*>(row + (sub + t * T::kLanes) * T::kVec);":
        "s.v[t] = __ldcs(reinterpret_cast<const uint4*>(row + (sub + t * T::kLanes) * T::kVec));"}
_STREAM_STORES = {
    "*reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);":
        "__stcs(reinterpret_cast<uint4*>(dst), make_uint4(words[0], words[1], words[2], words[3]));"}


# The forward on a resident grid (the H200's 132 SMs times BLOCKS blocks), each team looping
# over tasks, as benchmarks/probes/hbm_stream.cu's stream kernel does, instead of one task per team.
def _fwd_persistent(blocks_per_sm: int) -> dict[str, str]:
    return {
        "  const int64_t task = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / T::kLanes;\n"
        "  if (task >= p.batch * p.seqlen_q * p.heads) return;  // a whole team: its shuffles are team-local\n":
        "  const int64_t teams = static_cast<int64_t>(gridDim.x) * blockDim.x / T::kLanes;\n"
        "  for (int64_t task = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / T::kLanes;\n"
        "       task < p.batch * p.seqlen_q * p.heads; task += teams) {\n",
        "  if (sub == 0) lse[task] = t.ok ? row_lse : NAN;\n}":
        "  if (sub == 0) lse[task] = t.ok ? row_lse : NAN;\n  }\n}",
        "const int64_t blocks = blocks_for(tasks, kForwardThreads, Team<ET, D>::kLanes);":
        "const int64_t blocks = std::min<int64_t>(blocks_for(tasks, kForwardThreads, Team<ET, D>::kLanes), "
        f"132 * {blocks_per_sm});",
    }


# The forward's K/V loads issued before its key range arrives: rows at key 0 of the token's
# row, predicated on the array's extent, the range read only for the softmax. Timing only: it
# reads padded keys and is wrong where a query's keys do not start at key 0 of its row (THD,
# packed rows); it measures what one memory round trip per task instead of two is worth.
_FWD_ROWS_BEFORE_RANGE = {
    "        if (j == 0) kr = t.rows.fresh(team, sub);\n"
    "        s = load_slice_if<ET, D>((r < N ? k : v) + kr(j), sub, j < kr.live);\n":
    "        s = load_slice_if<ET, D>((r < N ? k : v) + bshd_offset(t.b, j, h / (p.heads / p.kv_heads), 0,\n"
    "                                 p.seqlen_kv, p.kv_heads, D), sub, j < p.seqlen_kv);\n",
    "        const int j = r % N;\n        if (r < N) {\n          w[j] = dot<ET, D>(qs, kv);\n":
    "        const int j = r % N;\n        if (r == 0) kr = t.rows.fresh(team, sub);\n"
    "        if (r < N) {\n          w[j] = dot<ET, D>(qs, kv);\n",
}


VARIANTS: dict[str, dict[str, str]] = {
    "as_is": {},
    "bwd_slots16": {_BWD_SLOTS: "kSlotVectors = 16;"},
    "bwd_slots32": {_BWD_SLOTS: "kSlotVectors = 32;"},
    "bwd_blocks3": {_BWD_BLOCKS: "|| DROPOUT || D == 512 ? 2 : 3;"},
    "bwd_blocks4": {_BWD_BLOCKS: "|| DROPOUT || D == 512 ? 2 : 4;"},
    "bwd_registers": _REGISTER_PAIRS,
    "fwd_threads64": {_FWD_THREADS: "constexpr int kForwardThreads = 64;"},
    "fwd_threads256": {_FWD_THREADS: "constexpr int kForwardThreads = 256;"},
    # Up to 4 keys, at most 64 registers: 8 blocks of 128 per SM at least.
    "fwd_few_keys_blocks8": {_FWD_BLOCKS: "kMinBlocks = kWideHeavy ? 2 : kHeavy ? 3 : N <= 4 ? 8 : 4;"},
    # Streaming cache hints (evict first, as benchmarks/probes/hbm_stream.cu's loads and stores):
    # on the forward's K/V loads and every q, dO, O load; on every result store; on both.
    "stream_loads": _STREAM_LOADS,
    "stream_stores": _STREAM_STORES,
    "stream_both": {**_STREAM_LOADS, **_STREAM_STORES},
    "fwd_persistent4": _fwd_persistent(4),
    "fwd_persistent8": _fwd_persistent(8),
    "fwd_rows_before_range": _FWD_ROWS_BEFORE_RANGE,
    # 9 to 12 keys served by the 16-key kernels, as before the 12-key instantiations.
    "no_12_keys": {"  if (max_keys <= 12) return with_dropout(std::integral_constant<int, 12>{});\n": ""},
}


def build(name: str, edits: dict[str, str], work: Path) -> None:
    """Builds the op libraries of one variant into work/name/build."""
    tree = work / name
    if tree.exists():
        shutil.rmtree(tree)
    shutil.copytree(ROOT / "ops_cuda", tree / "ops_cuda")
    shutil.copytree(ROOT / "cmake", tree / "cmake")
    shutil.copy(ROOT / "CMakeLists.txt", tree)
    source = (tree / SOURCE).read_text()
    for old, new in edits.items():
        if source.count(old) != 1:
            raise SystemExit(f"variant {name}: {old!r} must occur once in {SOURCE}")
        source = source.replace(old, new)
    (tree / SOURCE).write_text(source)
    log = work / f"{name}.build.log"
    with log.open("w") as out:
        for command in (["cmake", "-S", str(tree), "-B", str(tree / "build"), "-G", "Ninja",
                         "-DFUSEDATTN_ENABLE_CUDA=ON", "-DFUSEDATTN_CUDA_ARCHS=90", "-DFUSEDATTN_ENABLE_CUDNN=OFF",
                         "-DFUSEDATTN_ENABLE_ROCM=OFF",
                         f"-DPython_EXECUTABLE={sys.executable}"],
                        ["cmake", "--build", str(tree / "build"), "-j", "4"]):
            if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode:
                raise SystemExit(f"variant {name}: build failed, see {log}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("variants", nargs="+", choices=sorted(VARIANTS))
    parser.add_argument("--out", required=True, help="directory for builds, logs and results")
    parser.add_argument("--s-kv", default="8,12,16")
    parser.add_argument("--impls", default="small_seq_kernel")
    parser.add_argument("--phase", choices=("build", "time", "all"), default="all")
    args = parser.parse_args()
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    names = ["as_is"] + [v for v in args.variants if v != "as_is"]
    if args.phase != "time":
        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            list(pool.map(lambda n: build(n, VARIANTS[n], work), names))
    if args.phase == "build":
        return
    libs = {name: work / name / "build" for name in names}

    times: dict[str, dict[tuple, float]] = {}
    for name in names:
        result = work / f"{name}.json"
        subprocess.run([sys.executable, str(ROOT / "benchmarks/small_seq.py"), "--quick",
                        "--impls", args.impls, "--s-kv", args.s_kv, "--out", str(result)],
                       env={**os.environ, "FUSEDATTN_LIB_DIR": str(libs[name]),
                            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
                       check=True,
                       stdout=subprocess.DEVNULL)
        rows = json.loads(result.read_text())["rows"]
        times[name] = {(r["name"], r["impl"], r["pass"]): r["ms"] for r in rows}

    keys = sorted(times["as_is"])
    print(f"\n{'variant':<16}" + "".join(f"{k[0].rsplit('_', 1)[-1] + ' ' + k[2]:>16}" for k in keys))
    for name in names:
        print(f"{name:<16}" + "".join(f"{times[name].get(k) or float('nan'):>16.3f}" for k in keys))


if __name__ == "__main__":
    main()
