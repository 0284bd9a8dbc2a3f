"""benchmarks/probes/sass_stalls.py: the top stalled instructions of an ncu source-page CSV."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "probes"))
from sass_stalls import top_stalls  # noqa: E402

CSV = '''"Kernel Name","forward_kernel"
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed"
"0x100","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24","10","8","1,024"
"0x110","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8+0x10], R3","1,200","1,100","2048"
"0x120","LDG.E R5, desc[UR6][R2.64]","290","280","64"
"0x130","MUFU.EX2 R7, R7","0","0","4096"
'''


def test_ranks_instructions_by_their_share_of_stall_samples():
    lines = top_stalls(CSV.splitlines(keepends=True), top=2)
    assert lines[0] == "top 2 of 4 instructions by stall samples (1500 in all):"
    assert lines[1].split() == ["80.00%", "0x110", "SYNCS.PHASECHK.TRANS64.TRYWAIT", "P0,", "[UR8+0x10],", "R3"]
    assert lines[2].split()[:3] == ["19.33%", "0x120", "LDG.E"]
    assert len(lines) == 3


def test_says_what_columns_it_found_without_a_sampling_column():
    lines = top_stalls(['"Address","Source","Instructions Executed"\n', '"0x0","NOP","1"\n'], top=5)
    assert lines == ["sass_stalls: no 'Warp Stall Sampling (All...' column; columns found: "
                     "['Address', 'Source', 'Instructions Executed']"]
