"""benchmarks/probes/sass_stalls.py: the top stalled instructions of an ncu source-page CSV."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "probes"))
from sass_stalls import reads_and_writes, top_stalls  # noqa: E402

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


WAITS = '''"Address","Source","Warp Stall Sampling (All Samples)"
"0x00","LDG.E.64 R2, desc[UR6][R8.64]","0"
"0x10","LDG.E R26, desc[UR6][R10.64]","0"
"0x20","MOV R26, R5","0"
"0x30","STG.E desc[UR6][R2.64], R7","0"
"0x40","@!P1 IADD3 R30, P2, R3, R12, RZ","900"
"0x50","FMUL R12, R12, R4","100"
'''


def test_names_the_nearest_writer_of_a_register_the_instruction_reads():
    lines = top_stalls(WAITS.splitlines(keepends=True), top=2)
    # R3 is the upper half of the 64-bit load into R2; the store between reads R2-R3 only
    assert lines[1].split()[:3] == ["90.00%", "0x40", "@!P1"]
    assert lines[2].split() == ["<-", "0x00", "LDG.E.64", "R2,", "desc[UR6][R8.64]"]
    assert lines[3].split()[:2] == ["10.00%", "0x50"]
    assert len(lines) == 4  # nothing before 0x50 writes R12 or R4 (0x40 reads R12)


def test_reads_and_writes():
    assert reads_and_writes("@!P1 IADD3 R30, P2, R3, R26, RZ") == ({"R3", "R26"}, {"R30"})
    assert reads_and_writes("STS.128 [R5+0x10], R8") == ({"R5", "R8"}, set())
    assert reads_and_writes("LDS.128 R8, [R5+0x10]") == ({"R5"}, {"R8", "R9", "R10", "R11"})
    reads, writes = reads_and_writes("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], RZ, !UPT")
    assert reads == {"UR20"} and writes == {f"R{24 + k}" for k in range(64)}
    assert reads_and_writes("IMAD.WIDE.U32 R2, R4, R5, RZ") == ({"R4", "R5"}, {"R2", "R3"})


def test_says_what_columns_it_found_without_a_sampling_column():
    lines = top_stalls(['"Address","Source","Instructions Executed"\n', '"0x0","NOP","1"\n'], top=5)
    assert lines == ["sass_stalls: no 'Warp Stall Sampling (All...' column; columns found: "
                     "['Address', 'Source', 'Instructions Executed']"]
