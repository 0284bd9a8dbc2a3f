#!/usr/bin/env bash
# On the GPU machine, after scripts/device.sh built the project: the flash kernels' SASS
# summary (instruction mix, local memory) and an Nsight Compute report of one forward and
# one backward at the benchmark's first shape. Output under $OUT.
#   usage: bash scripts/flash_profile.sh [--causal]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fusedattn-out}
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
lib=$(find build -name libfusedattn_cuda.so | head -1)
cuobjdump -sass "$lib" > "$OUT/flash.sass" 2>&1
cuobjdump -sass -fun _ZN9fusedattn5flash14forward_kernelILNS_11ElementTypeE1ELi128EEEvNS0_9FlashArgsE "$lib" \
  > "$OUT/forward_bf16_d128.sass" 2>&1
python3 - "$OUT/flash.sass" <<'PY'
import re, sys, collections
text = open(sys.argv[1]).read()
for name, body in re.findall(r"Function : (\S+)\n(.*?)(?=\n\s*Function :|\Z)", text, re.S):
    if "flash" not in name or "sm_90" not in text:
        continue
    ops = collections.Counter(m.split(".")[0] for m in re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", body))
    keep = {k: ops[k] for k in ("HMMA", "HGMMA", "LDSM", "LDGSTS", "LDG", "STG", "LDL", "STL", "BAR", "MUFU", "SHFL", "FFMA", "FMUL", "IMAD")}
    print(name[:90], sum(ops.values()), keep)
PY
gzip -f "$OUT/flash.sass"
timeout 300 ncu --clock-control none --kernel-name regex:"forward_kernel|dkdv_kernel|dq_kernel" --launch-skip 4 -c 4 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section ComputeWorkloadAnalysis \
  python3 benchmarks/probes/flash_kernel_profile.py "$@" > "$OUT/ncu.txt" 2>&1
grep -E "^\s+(forward|dkdv|dq)_kernel|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Stall|Block Limit|Executed Ipc|Issue Slots Busy" "$OUT/ncu.txt" | head -80
