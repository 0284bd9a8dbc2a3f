#!/usr/bin/env bash
# The multi-GPU run of context parallelism (issue 26), on one machine of several GPUs (one
# process, NCCL, NVLink multicast left off): build fusedattn for sm_90, then, each step under
# its own time limit so that the whole script ends within DEADLINE seconds (default 560),
# in this order:
#   1. the GPU tests of tests/test_context_parallel.py and tests/test_sharding.py on every GPU;
#   2. benchmarks/context_parallel.py on N GPUs (N = the GPUs JAX sees, at most 4), flash per
#      block, s = 131072, 262144, 32768 (in that order; the results file is rewritten after
#      each), ring and all_gather, load-balanced and in natural order, and the trace of both
#      strategies' load-balanced fwd+bwd at s = 131072 (communication overlapped by compute);
#   3. the LM trainer (benchmarks/lm_train.py, configs/lm_nnx.py:gpu) on 1 GPU, and on a
#      data 2 x context 2 mesh (N = 4);
#   4. where time is left: the LM trainer on a data 1 x context N mesh.
# A step whose time is not left is skipped and says so. Logs stay under /tmp/multi_gpu; $OUT
# gets the result files (context_parallel.json, lm_*.json) and multi_gpu.log (every log);
# the summary table (scripts/multi_gpu_summary.py) prints last.
#   usage: bash scripts/multi_gpu.sh
#   MULTI_GPU_DRY_RUN=1 bash scripts/multi_gpu.sh   # the same steps at toy sizes on 4 fake CPU
#                                                   # devices, no build: checks the script only
# Settings (environment): STEPS (default "tests cp lm": which of the three run), CP_SEQLENS
# (default "131072 262144 32768"), CP_LOAD_BALANCE ("on off"), CP_TRACE (the length traced,
# default 131072; empty: no trace), CP_WANT (the benchmark step's seconds, 220), XLA_FLAGS
# (passed on), e.g. the s=262144 rows alone:
#   STEPS=cp CP_SEQLENS=262144 CP_LOAD_BALANCE=on CP_TRACE= bash scripts/multi_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/multi_gpu-out}
LOGS=/tmp/multi_gpu
DEADLINE=${DEADLINE:-560}
DRY=${MULTI_GPU_DRY_RUN:-0}
STEPS=${STEPS:-tests cp lm}
rm -rf "$LOGS"
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1
started=$(date +%s)
summary=()
elapsed() { echo $(( $(date +%s) - started )); }
# Adds a line to the summary and prints it now, with the seconds since the start.
note() { summary+=("$1"); echo "[multi_gpu.sh +$(elapsed)s] $1"; }
# budget WANT: seconds a step may run: WANT, or less where the deadline (less 20 s for the
# summary) comes sooner; 0 when under 30 s are left.
budget() {
  local left=$(( DEADLINE - 20 - $(elapsed) ))
  (( left < 30 )) && { echo 0; return; }
  (( left < $1 )) && echo "$left" || echo "$1"
}
# step NAME WANT MIN LOG COMMAND...: runs COMMAND under `timeout` for budget(WANT) seconds
# (SIGKILL 10 s later), its output in $LOGS/LOG; skipped where fewer than MIN seconds are left.
step() {
  local name=$1 want=$2 min=$3 log=$4; shift 4
  local limit; limit=$(budget "$want")
  if (( limit < min )); then note "$name: SKIPPED (${limit}s left of the ${min}s it needs)"; return; fi
  local begin; begin=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$LOGS/$log" 2>&1
  local status=$?
  local why=""; (( status == 124 || status == 137 )) && why=" (TIMED OUT at ${limit}s)"
  note "$name: exit $status$why in $(( $(date +%s) - begin ))s"
}

if [ "$DRY" = 1 ]; then
  export JAX_PLATFORMS=cpu XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=4"
  CP_SIZES=(--backend xla --heads 2 --kv-heads 2 --head-dim 16)
  read -ra CP_SEQLENS <<< "${CP_SEQLENS:-256 512 128}"
  CP_TRACE=${CP_TRACE-256}
  LM_SIZES=(--config.model.num_layers=1 --config.model.d_model=64 --config.model.num_heads=2
            --config.model.num_kv_heads=2 --config.model.mlp_dim=128 --config.data.batch_size=4
            --config.data.seq_len=128 --config.model.max_len=128 --config.data.max_doc_len=64
            --config.trainer.data_workers=0)
  LM_STEPS=(--steps 12 --steady-after 5)
else
  # NVLink multicast stays off (the machine sets NCCL_NVLS_ENABLE=0; never turn it on).
  if [ "${NCCL_NVLS_ENABLE:-0}" != 0 ]; then
    echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE: NVLink multicast must stay off; run with it 0"; exit 1
  fi
  export NCCL_NVLS_ENABLE=0
  CP_SIZES=(--backend flash --heads 16 --kv-heads 16 --head-dim 128)
  read -ra CP_SEQLENS <<< "${CP_SEQLENS:-131072 262144 32768}"
  CP_TRACE=${CP_TRACE-131072}
  LM_SIZES=()
  LM_STEPS=(--steps 40 --steady-after 20)
fi
CP_TIMING=(--repeats 3 --iters 1 --min-window-ms 0)
read -ra CP_LOAD_BALANCE <<< "${CP_LOAD_BALANCE:-on off}"
CP_TRACE_ARGS=(); [ -n "$CP_TRACE" ] && CP_TRACE_ARGS=(--trace-seqlen "$CP_TRACE")
# wants STEP: whether STEPS names it
wants() { [[ " $STEPS " == *" $1 "* ]]; }

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
if [ "$DRY" != 1 ]; then
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m; } \
    > "$LOGS/gpu.txt" 2>&1
  if ! CMAKE_ARGS="-DFUSEDATTN_CUDA_ARCHS=90" timeout -k 10 300 \
      python3 -m pip install -v --no-build-isolation --no-deps -e . > "$LOGS/build.log" 2>&1; then
    tail -60 "$LOGS/build.log"; cp "$LOGS/build.log" "$OUT/multi_gpu.log"; echo "BUILD FAILED"; exit 1
  fi
  note "build: ok ($(grep -c 'Building CUDA' "$LOGS/build.log") CUDA objects)"
  note "$(grep -oE 'fusedattn: (host op library only|GPU op libraries);.*' "$LOGS/build.log" | head -1)"
fi
read -r N KIND < <(python3 -c 'import jax; print(min(jax.device_count(), 4), jax.devices()[0].device_kind)' \
  2> "$LOGS/devices.log")
if [ -z "${N:-}" ] || (( N < 2 )); then
  echo "JAX sees ${N:-no} devices (want 2 to 4):"; tail -20 "$LOGS/devices.log"; exit 1
fi
note "devices: $N x $KIND"

note "XLA_FLAGS=${XLA_FLAGS:-}"

# 1. GPU tests (on the CPU in a dry run: collected, then skipped as GPU tests are there).
mkdir -p "$LOGS/tests"
if wants tests; then
  tests_limit=$(budget 110)
  note "tests (-m gpu, 3 shards, ${tests_limit}s each):"
  while read -r line; do note "  $line"; done < <(
    SHARDS=3 LOG_DIR="$LOGS/tests" TEST_TIMEOUT=$(( tests_limit > 40 ? tests_limit - 30 : 10 )) \
      bash scripts/pytest_shards.sh -m gpu tests/test_context_parallel.py tests/test_sharding.py)
fi
touch "$LOGS/tests/tests.log"

# 2. context parallelism, with the trace
if wants cp; then
  step "context_parallel on $N" "${CP_WANT:-220}" 60 cp.log \
    python3 benchmarks/context_parallel.py --devices "$N" "${CP_SIZES[@]}" \
      --seqlens "${CP_SEQLENS[@]}" "${CP_TRACE_ARGS[@]}" --strategies ring all_gather \
      --load-balance "${CP_LOAD_BALANCE[@]}" "${CP_TIMING[@]}" \
      --trace-dir "$LOGS/traces" --out "$OUT/context_parallel.json"
fi

# 3. the LM trainer: one device, then data 2 x context 2; 4. where time is left, 1 x N
lm() {  # lm NAME MIN [env assignments] -- overrides...
  local name=$1 min=$2; shift 2
  local env=(); while [ "$1" != -- ]; do env+=("$1"); shift; done; shift
  step "lm $name" 120 "$min" "lm_$name.log" env "${env[@]}" python3 benchmarks/lm_train.py \
    --backends auto "${LM_STEPS[@]}" --out "$OUT/lm_$name.json" -- "${LM_SIZES[@]}" "$@"
}
if wants lm; then
  lm gpu1 60 CUDA_VISIBLE_DEVICES=0 --
  if (( N >= 4 )); then
    lm data2_context2 70 -- --config.mesh.data=2 --config.mesh.context=2
  fi
  lm "data1_context$N" 70 -- --config.mesh.data=1 "--config.mesh.context=$N"
fi

# Every log in one file for $OUT (the device tool brings back a few files only).
for f in "$LOGS"/gpu.txt "$LOGS"/devices.log "$LOGS"/tests/tests.log "$LOGS"/cp.log \
         "$LOGS"/lm_*.log; do
  [ -f "$f" ] && { echo "==================== $f"; cat "$f"; }
done > "$OUT/multi_gpu.log"
[ -f "$LOGS/build.log" ] && { echo "==================== build.log (tail)"; tail -40 "$LOGS/build.log"; } \
  >> "$OUT/multi_gpu.log"

echo
echo "==================== failed tests"
grep -hE '^(FAILED|ERROR)' "$LOGS/tests/tests.log" | head -20 | cut -c1-240
echo "==================== the benchmarks' last lines"
for f in "$LOGS"/cp.log "$LOGS"/lm_*.log; do
  [ -f "$f" ] && { echo "-- $(basename "$f")"; tail -4 "$f" | cut -c1-300; }
done
echo "==================== summary (+$(elapsed)s)"
printf '%s\n' "${summary[@]}"
python3 scripts/multi_gpu_summary.py "$OUT"
