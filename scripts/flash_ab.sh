#!/usr/bin/env bash
# On the GPU machine, after scripts/device.sh built the tree: the flash benchmark on earlier
# versions of the kernels, for an A/B comparison in one session. Each patch given (a diff
# of one change, newest first) is reversed in turn, the library rebuilt (incrementally) and
# benchmarks/flash.py run with BENCH_ARGS; results go to $OUT/ab_<n>.json, the tables print.
#   usage: BENCH_ARGS="--impls flash,cudnn --shapes ..." bash scripts/flash_ab.sh newest.patch older.patch
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusedattn-out}
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
n=0
for patch in "$@"; do
  n=$((n + 1))
  if ! git apply -R "$patch"; then echo "ab $n: $patch does not reverse cleanly"; exit 1; fi
  if ! python3 -m pip install -v --no-build-isolation --no-deps -e . > "$OUT/ab_build_$n.log" 2>&1; then
    tail -30 "$OUT/ab_build_$n.log"; echo "ab $n: BUILD FAILED"; exit 1
  fi
  timeout "${BENCH_TIMEOUT:-0}" python3 benchmarks/flash.py --out "$OUT/ab_$n.json" ${BENCH_ARGS:-} > "$OUT/ab_$n.log" 2>&1
  echo "== ab $n: without $(basename "$patch") and the patches before it (exit $?)"
  tail -20 "$OUT/ab_$n.log"
done
