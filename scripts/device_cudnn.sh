#!/usr/bin/env bash
# On the GPU machine (see ../shared/device/README.md): build fusedattn (with the
# cuDNN backend), run tests/test_cudnn.py and benchmarks/cudnn.py. Logs and the
# benchmark JSON go under $OUT; the short summary prints last.
#   usage: bash scripts/device_cudnn.sh [--no-bench] [--quick-bench] [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusedattn-out}
mkdir -p "$OUT"
bench=full
if [ "${1:-}" = "--no-bench" ]; then bench=none; shift; fi
if [ "${1:-}" = "--quick-bench" ]; then bench=quick; shift; fi
summary=()

python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1

start=$(date +%s)
if ! CMAKE_ARGS="-DFUSEDATTN_CUDA_ARCHS=90 ${CMAKE_ARGS:-}" \
    python3 -m pip install -v --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  grep -E "error|FAILED" -A5 "$OUT/build.log" | head -60; tail -30 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
summary+=("build: ok in $(( $(date +%s) - start ))s; $(grep -o 'fusedattn: [a-z].*cuDNN[^(]*' "$OUT/build.log" | head -2 | tr '\n' ' ')")

python3 - > "$OUT/env.log" 2>&1 <<'PY'
import os, jax
from fusedattn.ops.backends import cudnn
print("jax", jax.__version__, jax.devices()[0].device_kind, getattr(jax.devices()[0], "compute_capability", "?"))
print("cudnn backend:", cudnn.available() or "ok", "version", cudnn.cudnn_version())
print("CUDNN_FRONTEND_CUDART_LIB_NAME =", os.environ.get("CUDNN_FRONTEND_CUDART_LIB_NAME"))
print("loaded:", cudnn._loaded_libraries("libcudnn.so") + cudnn._loaded_libraries("libcudart") +
      cudnn._loaded_libraries("libnvrtc"))
PY
summary+=("env: $(tr '\n' ' ' < "$OUT/env.log" | cut -c1-600)")

start=$(date +%s)
timeout 360 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cudnn.py "$@" > "$OUT/tests_cudnn.log" 2>&1
summary+=("tests/test_cudnn.py: $(tail -1 "$OUT/tests_cudnn.log") in $(( $(date +%s) - start ))s")

if [ "$bench" != none ]; then
  start=$(date +%s)
  flag=""; [ "$bench" = quick ] && flag="--quick"
  timeout 240 python3 benchmarks/cudnn.py $flag --out "$OUT/cudnn.json" > "$OUT/bench_cudnn.log" 2>&1
  summary+=("benchmark cudnn: exit $? in $(( $(date +%s) - start ))s")
fi

grep -hE '^(FAILED|ERROR)|^E  ' "$OUT/tests_cudnn.log" | cut -c1-400 | head -40
grep -hE '^SKIPPED' "$OUT/tests_cudnn.log" | cut -c1-300 | head -20
[ "$bench" != none ] && tail -22 "$OUT/bench_cudnn.log"
printf '%s\n' "${summary[@]}"
