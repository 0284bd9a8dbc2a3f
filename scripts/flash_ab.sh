#!/usr/bin/env bash
# On the GPU machine, after scripts/device.sh built the tree: the flash benchmark on earlier
# versions of the kernels, for an A/B comparison in one session. Each patch given (a diff
# of one change, newest first) is reversed in turn, the library rebuilt (incrementally) and
# benchmarks/flash.py run with BENCH_ARGS; results go to $OUT/ab_<n>.json, the tables print,
# the logs go under $LOGS and are packed again into $OUT/logs.tar.gz (as scripts/device.sh).
# At the end, or on a failure, the reversed patches are applied again: the tree is as it
# was (rebuild it before measuring it again; never `git checkout` it, which would drop
# uncommitted changes). The ab_<n>.json of earlier calls are removed first, so that a run
# that fails leaves none, never an older one.
# With WITH=<the tree's own flash.py result file>, the A/B table of benchmarks/flash_compare.py
# (that file first, then each ab_<n>.json) prints last.
#   usage: BENCH_ARGS="--impls flash,cudnn --shapes ..." bash scripts/flash_ab.sh newest.patch older.patch
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
reversed=()
restore() {
  for ((i = ${#reversed[@]} - 1; i >= 0; i--)); do
    git apply "${reversed[i]}" || echo "flash_ab.sh: could not apply ${reversed[i]} again"
  done
  tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .
}
trap restore EXIT
rm -f "$OUT"/ab_*.json
n=0
for patch in "$@"; do
  n=$((n + 1))
  if ! git apply -R "$patch"; then echo "ab $n: $patch does not reverse cleanly"; exit 1; fi
  reversed+=("$patch")
  if ! python3 -m pip install -v --no-build-isolation --no-deps -e . > "$LOGS/ab_build_$n.log" 2>&1; then
    tail -30 "$LOGS/ab_build_$n.log"; echo "ab $n: BUILD FAILED"; exit 1
  fi
  timeout "${BENCH_TIMEOUT:-0}" python3 benchmarks/flash.py --out "$OUT/ab_$n.json" ${BENCH_ARGS:-} > "$LOGS/ab_$n.log" 2>&1
  echo "== ab $n: without $(basename "$patch") and the patches before it (exit $?)"
  tail -20 "$LOGS/ab_$n.log"
done
if [ -n "${WITH:-}" ]; then
  files=("$WITH"); names=(with)
  for ((k = 1; k <= n; k++)); do files+=("$OUT/ab_$k.json"); names+=("ab_$k"); done
  python3 benchmarks/flash_compare.py "${files[@]}" --names "$(IFS=,; echo "${names[*]}")"
fi
