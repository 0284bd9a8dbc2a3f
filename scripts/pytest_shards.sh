#!/usr/bin/env bash
# Runs pytest over the given arguments split into SHARDS processes side by side (XLA
# compiles on the CPU, so one GPU serves several), each with on-demand GPU memory.
# Logs: $LOG_DIR/collect.log, $LOG_DIR/tests_<i>.log, all of them also in
# $LOG_DIR/tests.log; prints each shard's summary line and exit status, and says so when
# collection failed (a test module that does not import must not pass unnoticed).
# A shard past TEST_TIMEOUT gets SIGTERM, and SIGKILL 30 s later if it is still there
# (a process stuck in a GPU call may not end on SIGTERM).
#   usage: SHARDS=4 LOG_DIR=$OUT TEST_TIMEOUT=300 bash scripts/pytest_shards.sh tests/test_x.py
set -uo pipefail
shards=${SHARDS:-4}
log_dir=${LOG_DIR:?set LOG_DIR}
rm -f "$log_dir"/tests_*.log "$log_dir"/tests_*.rc
python3 -m pytest --collect-only -q -p no:cacheprovider "$@" > "$log_dir/collect.log" 2>&1
collect_status=$?
mapfile -t ids < <(grep '::' "$log_dir/collect.log")
if ((collect_status != 0)); then
  echo "collection: FAILED (exit $collect_status): $(tail -1 "$log_dir/collect.log")"
fi
for ((i = 0; i < shards; i++)); do
  mine=()
  for ((j = i; j < ${#ids[@]}; j += shards)); do mine+=("${ids[j]}"); done
  ((${#mine[@]})) || continue
  (XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 30 "${TEST_TIMEOUT:-0}" \
     python3 -m pytest -q -p no:cacheprovider -rA "${mine[@]}" > "$log_dir/tests_$i.log" 2>&1
   echo $? > "$log_dir/tests_$i.rc") &
done
wait
cat "$log_dir/collect.log" "$log_dir"/tests_*.log > "$log_dir/tests.log" 2>/dev/null
for f in "$log_dir"/tests_*.log; do
  [[ -e $f ]] || continue
  status=$(cat "${f%.log}.rc")
  note=""
  ((status == 124)) && note=" (timed out)"
  echo "$(basename "$f"): $(tail -1 "$f") [exit $status$note]"
done
