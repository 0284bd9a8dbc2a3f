#!/usr/bin/env bash
# On the GPU machine (see ../shared/device/README.md): build fusedattn, run the
# whole test suite including GPU tests, then the benchmarks named as arguments.
# Results go under $OUT (a benchmark's JSON), the logs under $LOGS (default
# /tmp/device-logs) and, packed, in $OUT/logs.tar.gz: the device tool brings back at most
# 8 files, so the logs travel as one. The short summary prints last. Each step also prints
# a progress line with the seconds so far as it ends, so a call cut short by its
# time limit still shows how far it got.
#   usage: bash scripts/device.sh [benchmark-name ...]   e.g. small_seq
# (a name is a script of benchmarks/ or of benchmarks/probes/, e.g. hbm_stream)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusedattn-out}
LOGS=${LOGS:-/tmp/device-logs}
rm -rf "$LOGS"  # an earlier call's logs, on a machine kept warm
mkdir -p "$OUT" "$LOGS"
pack_logs() { tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .; }
summary=()
started=$(date +%s)
# Adds a line to the summary and prints it now, with the seconds since the start.
note() { summary+=("$1"); echo "[device.sh +$(( $(date +%s) - started ))s] $1"; }

python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$LOGS/gpu.txt" 2>&1

if ! python3 -m pip install -v --no-build-isolation --no-deps -e . > "$LOGS/build.log" 2>&1; then
  tail -60 "$LOGS/build.log"; echo "BUILD FAILED"; pack_logs; exit 1
fi
note "build: ok ($(grep -c 'Building CUDA' "$LOGS/build.log") CUDA objects)"
# The GPU libraries are built by default where a GPU JAX plugin or a GPU is seen (here: the
# CUDA plugin of the machine's python3 and its GPU); the configure says what it decided.
note "$(grep -oE 'fusedattn: (host op library only|GPU op libraries);.*' "$LOGS/build.log" | head -1)"

# PYTEST_ARGS picks the tests (default: the whole suite); all of them run with the GPU
# as JAX's default device, so the compiled backends run their CUDA kernels.
# TEST_TIMEOUT (seconds per shard, 0 = none) leaves time for the benchmarks after the tests;
# BENCH_TIMEOUT bounds each benchmark the same way.
# The tests run in SHARDS pytest processes side by side (default 4).
note "tests on the GPU (${PYTEST_ARGS:-tests}), by shard:"
while read -r line; do note "  $line"; done < <(
  LOG_DIR="$LOGS" bash scripts/pytest_shards.sh ${PYTEST_ARGS:-tests})
gpu_tests=$(python3 -m pytest -q -p no:cacheprovider --collect-only -m gpu ${PYTEST_ARGS:-tests} 2>/dev/null | tail -1)
note "GPU-marked tests among them (collected with -m gpu): ${gpu_tests}"

for name in "$@"; do
  script="benchmarks/$name.py"
  [ -f "$script" ] || script="benchmarks/probes/$name.py"
  timeout "${BENCH_TIMEOUT:-0}" python3 "$script" --out "$OUT/$name.json" ${BENCH_ARGS:-} \
    > "$LOGS/bench_$name.log" 2>&1
  note "benchmark $name: exit $? (table below)"
done

pack_logs
grep -hE '^(FAILED|ERROR)' "$LOGS/tests.log" | head -30
for name in "$@"; do echo "== $name"; tail -40 "$LOGS/bench_$name.log"; done
printf '%s\n' "${summary[@]}"
