#!/usr/bin/env bash
# On the GPU machine: the small_seq launch-plan sweep (benchmarks/probes/small_seq_sweep.py) and,
# against its unchanged build ("as_is", sm_90, no cuDNN), the small_seq GPU tests, in one
# call. Builds stay in /tmp; the variants' timings go under $OUT, the logs under $LOGS and,
# packed, in $OUT/logs.tar.gz (the device tool brings back at most 8 files); the table last.
#   usage: S_KV=4,8,16 PYTEST_ARGS=tests/test_small_seq.py bash scripts/device_sweep.sh VARIANT...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusedattn-out}
LOGS=${LOGS:-/tmp/device-logs}
work=/tmp/small_seq_sweep
mkdir -p "$OUT" "$LOGS" "$work"
trap 'tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .' EXIT
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-}
summary=()
if ! python3 benchmarks/probes/small_seq_sweep.py --phase build --out "$work" "$@" > "$LOGS/sweep_build.log" 2>&1; then
  tail -30 "$LOGS/sweep_build.log"; tail -30 "$work"/*.build.log; echo "SWEEP BUILD FAILED"; exit 1
fi
summary+=("tests on the GPU against the as_is build (${PYTEST_ARGS:-tests/test_small_seq.py}), by shard:")
while read -r line; do summary+=("  $line"); done < <(
  FUSEDATTN_LIB_DIR="$work/as_is/build" LOG_DIR="$LOGS" bash scripts/pytest_shards.sh ${PYTEST_ARGS:-tests/test_small_seq.py})
timeout "${SWEEP_TIMEOUT:-0}" python3 benchmarks/probes/small_seq_sweep.py --phase time --out "$work" \
  --s-kv "${S_KV:-2,4,6,8,12,16}" "$@" > "$LOGS/sweep_time.log" 2>&1
summary+=("sweep timing: exit $?")
cp "$work"/*.json "$OUT"/ 2>/dev/null
grep -hE '^(FAILED|ERROR)' "$LOGS/tests.log" | head -30
tail -12 "$LOGS/sweep_time.log"
printf '%s\n' "${summary[@]}"
