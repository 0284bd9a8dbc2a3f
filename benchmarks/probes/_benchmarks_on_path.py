"""Imported first by each probe: puts benchmarks/ on sys.path, so that a probe run as
`python benchmarks/probes/NAME.py` imports the benchmarks' modules (common, small_seq,
cudnn, kernel_profile) as the benchmarks themselves do."""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
