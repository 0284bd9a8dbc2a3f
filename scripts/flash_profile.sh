#!/usr/bin/env bash
# On the GPU machine, after scripts/device.sh built the project: the flash kernels' SASS
# instruction mix, and Nsight Compute reports (speed of light, warp stalls, pipes) of one
# forward and one backward at each shape given (default: the shape below). Output
# under $OUT: flash.sass.gz, ncu_<shape>.txt (ending with the instructions of most stall samples,
# benchmarks/probes/sass_stalls.py; and .ncu-rep, _sass.csv: stall samples per
# instruction); a short summary prints last. smsp__inst_executed / smsp__issue_active .max
# against .min: how much busier the busiest scheduler is (the producer warp shares
# scheduler 0 with one warp of each consumer warpgroup).
# PEER=fa3 profiles FlashAttention-3's kernels (flash_attn3_jax) at the same shapes instead
# (its forward and main backward kernel; the reports are then ncu_fa3_<shape>.txt).
# IMPL names another impl of benchmarks/probes/flash_kernel_profile.py (e.g. flash_dropout).
#   usage: [KERNELS=forward|backward] [PEER=fa3] [IMPL=flash_dropout] bash scripts/flash_profile.sh ["b,s,h,h_kv,d[,causal]" ...]
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
lib=$(find build -name libfusedattn_cuda.so | head -1)
cuobjdump -sass "$lib" > "$OUT/flash.sass" 2>&1
python3 - "$OUT/flash.sass" <<'PY'
import collections, re, sys
text = open(sys.argv[1]).read()
for name, body in re.findall(r"Function : (\S+)\n(.*?)(?=\n\s*Function :|\Z)", text, re.S):
    if "sm90" not in name:
        continue
    ops = collections.Counter(m.split(".")[0] for m in re.findall(
        r"/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", body))
    keep = {k: ops[k] for k in ("HGMMA", "MUFU", "LDG", "STG", "LDS", "STS", "LDL", "STL", "BAR", "RED")}
    print(name[:80], sum(ops.values()), keep)
PY
gzip -f "$OUT/flash.sass"
shapes=("$@")
((${#shapes[@]})) || shapes=("1,8192,16,16,128,causal")
for shape in "${shapes[@]}"; do
  causal=()
  [[ $shape == *,causal ]] && causal=(--causal)
  dims=${shape%,causal}
  report="$OUT/ncu_${PEER:+${PEER}_}${shape//,/_}.txt"
  # The probe calls forward, then forward+backward, twice: profile the second round's
  # kernels once each (the forward of the forward call; the backward).
  case ${KERNELS:-both} in
    forward) kernels=forward; fa3=Fwd; skip=2; count=1 ;;
    backward) kernels=backward; fa3=Bwd; skip=1; count=1 ;;
    *) kernels="(forward|backward)"; fa3="(Fwd|Bwd)"; skip=4; count=2 ;;
  esac
  regex="sm90::${kernels}_kernel" impl=${IMPL:-flash}
  [ "${PEER:-}" = fa3 ] && regex="FlashAttn${fa3}Sm90" impl=fa3
  timeout 300 ncu --clock-control none --kernel-name-base demangled --kernel-name regex:"$regex" \
    --launch-skip $skip -c $count \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,regex:sm__pipe_.*tensor.*cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,smsp__inst_executed.max,smsp__inst_executed.min,smsp__issue_active.max,smsp__issue_active.min" \
    -o "${report%.txt}" -f python3 benchmarks/probes/flash_kernel_profile.py --impl "$impl" --shape "$dims" "${causal[@]}" > "$report" 2>&1
  ncu -i "${report%.txt}.ncu-rep" --page details >> "$report" 2>&1
  # Per SASS instruction: executions and stall samples by reason (where the time goes).
  ncu -i "${report%.txt}.ncu-rep" --page source --csv --print-source sass > "${report%.txt}_sass.csv" 2>&1
  python3 benchmarks/probes/sass_stalls.py "${report%.txt}_sass.csv" >> "$report" 2>&1
  echo "== $shape"
  grep -E "^\s+void (fusedattn|cutlass)|^\s+fusedattn|Duration|Compute \(SM\) Throughput|tensor|inst_executed|issue_active|Warp Cycles Per Issued|Issue Slots Busy|Eligible|stalled" \
    "$report" | awk '$NF != "0" && $NF != "0.00"' | head -90
  tail -31 "$report"
done
