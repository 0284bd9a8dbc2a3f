#!/usr/bin/env bash
# On the GPU machine, after scripts/device.sh built the tree: builds the op library of each
# candidate (NAME=PATCH: the tree with PATCH applied; the patch is reversed again after its
# build), keeps a copy of each, and times the candidates' flash kernels against the tree's
# in one process (benchmarks/probes/flash_candidates.py with BENCH_ARGS; results in
# $OUT/flash_candidates.json, the logs under $LOGS, packed into $OUT/logs.tar.gz). The
# tree's library is put back in place at the end, so tests run after this script run it.
#   usage: [CHECK_TIMEOUT=60] BENCH_ARGS="--shapes 16,512,16,16,128 --repeats 5" bash scripts/flash_candidates.sh a=ab/a.patch b=ab/b.patch
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
CANDIDATES=/tmp/flash-candidates
lib_dir=$(python3 -c "from fusedattn.ops import _library as L; print(L.library_path('fusedattn_cuda').parent)") || {
  echo "flash_candidates.sh: no CUDA op library installed (run scripts/device.sh first)"; exit 1; }
rm -rf "$CANDIDATES"
mkdir -p "$CANDIDATES/tree"
cp "$lib_dir"/libfusedattn_*.so "$CANDIDATES/tree/"
restore() {
  cp "$CANDIDATES"/tree/libfusedattn_*.so "$lib_dir/"
  tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .
}
trap restore EXIT
specs=()
for item in "$@"; do
  name=${item%%=*}
  patch=${item#*=}
  if ! git apply "$patch"; then echo "flash_candidates.sh: $name: $patch does not apply"; exit 1; fi
  python3 -m pip install -v --no-build-isolation --no-deps -e . > "$LOGS/candidate_build_$name.log" 2>&1
  built=$?
  git apply -R "$patch" || { echo "flash_candidates.sh: $name: $patch does not reverse"; exit 1; }
  if [ "$built" -ne 0 ]; then tail -30 "$LOGS/candidate_build_$name.log"; echo "$name: BUILD FAILED"; exit 1; fi
  mkdir -p "$CANDIDATES/$name"
  cp "$lib_dir"/libfusedattn_*.so "$CANDIDATES/$name/"  # all of them: tests may run on a candidate
  specs+=("$name=$CANDIDATES/$name/libfusedattn_cuda.so")
  echo "candidate $name: built"
done
# CHECK_TIMEOUT (seconds; 0: no check): each candidate first runs alone at one small shape,
# in a process of its own under that limit. One that fails, gives wrong numbers or hangs
# there (a deadlocked kernel would stop the whole run) is left out, with a message.
if [ "${CHECK_TIMEOUT:-0}" -gt 0 ]; then
  kept=()
  for spec in "${specs[@]}"; do
    name=${spec%%=*}
    if FUSEDATTN_LIB_DIR="$CANDIDATES/tree" timeout "$CHECK_TIMEOUT" python3 benchmarks/probes/flash_candidates.py \
        --candidates "$spec" --shapes 2,384,4,2,128 --repeats 1 --iters 1 --min-window-ms 1 \
        --out "$LOGS/check_$name.json" > "$LOGS/check_$name.log" 2>&1 && ! grep -q '"wrong"' "$LOGS/check_$name.json"; then
      kept+=("$spec")
    else
      echo "candidate $name: left out (its check failed, differed or ran past ${CHECK_TIMEOUT} s: $LOGS/check_$name.log)"
    fi
  done
  specs=("${kept[@]}")
  ((${#specs[@]})) || { echo "flash_candidates.sh: no candidate passed its check"; exit 1; }
fi
# The tree's own library for the "flash" impl (the installed one is now the last candidate's).
FUSEDATTN_LIB_DIR="$CANDIDATES/tree" timeout "${BENCH_TIMEOUT:-0}" python3 benchmarks/probes/flash_candidates.py \
  --candidates "$(IFS=,; echo "${specs[*]}")" --out "$OUT/flash_candidates.json" ${BENCH_ARGS:-} \
  > "$LOGS/flash_candidates.log" 2>&1
echo "flash_candidates.py: exit $?"
tail -25 "$LOGS/flash_candidates.log"
