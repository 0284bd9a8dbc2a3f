"""benchmarks/probes/flash_item_trace.py: the sm90 forward's work-item stamps as phases."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "probes"))

import flash_item_trace  # noqa: E402

# One item's stamps relative to its start (see ops_cuda/cuda/flash/sm90/trace.cuh):
# producer: taken, first K, waits for Q, Q issued, last load; consumers: start, Q landed,
# first weights, last P V, store issued, store read. Warpgroup 1 runs 300 cycles behind.
PRODUCER = [0, 900, 950, 6_000, 9_000]
CONSUMER = [500, 7_000, 9_500, 15_000, 16_700, 17_200]
ITEM = 20_000


def output(items: int, never_stamped: int = 0) -> str:
    """A kernel's printout: `items` stamped items per role, then unstamped (zero) ones, twice
    (two calls: the second call's stamps are 5 cycles later and must win)."""
    lines = []
    for call in range(2):
        for role in range(3):
            for i in range(items + never_stamped):
                if i >= items:
                    stamps = [0] * 6
                elif role == 0:
                    stamps = [ITEM * i + x + 5 * call for x in PRODUCER] + [0]
                else:
                    stamps = [ITEM * i + x + 300 * (role - 1) + 5 * call for x in CONSUMER]
                lines.append(f"fusedattn-trace role={role} item={i} " + " ".join(map(str, stamps)))
        lines.append("some other output")
    return "\n".join(lines)


def test_phases_of_a_regular_run():
    got = flash_item_trace.phases(flash_item_trace.read_stamps(output(4, never_stamped=2)))
    assert got == {
        "item": ITEM,
        "idle_at_boundary": ITEM + CONSUMER[1] - CONSUMER[3],
        "epilogue": CONSUMER[4] - CONSUMER[3],
        "store_read": CONSUMER[5] - CONSUMER[4],
        "warpgroup_lag": 300,
        "producer_to_q": ITEM + PRODUCER[3] - (CONSUMER[5] + 300),
        "q_load": CONSUMER[1] - PRODUCER[3],
        "first_tile": CONSUMER[2] - CONSUMER[1],
        "producer_setup": PRODUCER[1] - PRODUCER[0],
        "k_lead": CONSUMER[1] - PRODUCER[1],
    }


def test_the_last_call_and_stamped_items_only():
    stamps = flash_item_trace.read_stamps(output(3, never_stamped=1))
    assert sorted(stamps) == [(role, i) for role in range(3) for i in range(3)]
    assert stamps[(0, 1)][0] == ITEM + 5  # the second call's line


def test_a_build_without_stamps_is_named():
    with pytest.raises(ValueError, match="FUSEDATTN_FLASH_TRACE=ON"):
        flash_item_trace.phases(flash_item_trace.read_stamps("no stamps here"))
    with pytest.raises(ValueError, match="fewer than two whole items"):
        flash_item_trace.phases(flash_item_trace.read_stamps(output(1)))


def block_line(sm: int, block: int, tiles: int, start: int) -> str:
    """A backward block's printout: K/V after 1000 cycles, the first tile 500 later, 800 per
    tile, an epilogue of 1200."""
    e = [start, start + 1_000, start + 1_500, start + 1_500 + 800 * tiles,
         start + 2_700 + 800 * tiles]
    return f"fusedattn-btrace sm={sm} block={block} tiles={tiles} " + " ".join(map(str, e))


def test_backward_block_phases_and_the_gaps_between_blocks():
    ends = 1_000 + 2_700 + 800 * 4  # the end of SM 0's first block
    text = "\n".join([block_line(0, 0, 4, 1_000), block_line(1, 1, 4, 5_000),
                      block_line(0, 2, 4, ends + 300), block_line(1, 3, 4, 5_000 + ends - 1_000 + 700)])
    got = flash_item_trace.block_phases(text)
    assert got == {"kv_load": 1_000, "first_q": 500, "loop": 3_200, "per_tile": 800,
                   "epilogue": 1_200, "tiles": 4, "between_blocks": 500, "blocks": 4}


def test_only_the_marked_call_is_read():
    before = block_line(0, 0, 2, 1_000)
    after = block_line(0, 0, 6, 90_000)
    text = flash_item_trace.measured(f"{before}\n{flash_item_trace.MARK}\n{after}\n")
    assert flash_item_trace.block_phases(text)["tiles"] == 6
    with pytest.raises(ValueError, match="no backward block stamps"):
        flash_item_trace.block_phases("nothing")
