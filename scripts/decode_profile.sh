#!/usr/bin/env bash
# On the GPU machine, after scripts/device.sh built the project: Nsight Compute reports
# (speed of light, memory workload, occupancy, warp stalls, stall samples per SASS
# instruction) of one paged decode kernel launch at each shape given. Output under $OUT:
# ncu_decode_<shape>.txt and _sass.csv; a short summary prints last.
#   usage: bash scripts/decode_profile.sh ["b,s_kv,s_q,page" ...]
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
shapes=("$@")
((${#shapes[@]})) || shapes=("16,8192,1,64")
for shape in "${shapes[@]}"; do
  report="$OUT/ncu_decode_${shape//,/_}"
  timeout 240 ncu --clock-control none --kernel-name regex:paged_decode_kernel --launch-skip 2 -c 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats --section SourceCounters \
    -o "$report" -f python3 benchmarks/probes/decode_kernel_profile.py --shape "$shape" \
    > "$report.txt" 2>&1
  ncu -i "$report.ncu-rep" --page details >> "$report.txt" 2>&1
  ncu -i "$report.ncu-rep" --page source --csv --print-source sass > "${report}_sass.csv" 2>&1
  python3 benchmarks/probes/sass_stalls.py "${report}_sass.csv" >> "$report.txt" 2>&1
  echo "== decode $shape"
  grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Block Limit|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|Eligible Warps|Stall|L2 Hit|Waves Per SM|Grid Size" \
    "$report.txt" | head -40
  tail -16 "$report.txt"
done
