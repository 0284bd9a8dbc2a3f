"""Where the sm90 flash kernels' time goes around their work: clock stamps
(ops_cuda/cuda/flash/sm90/trace.cuh) as phases in cycles. Forward: block 0's work items
(PHASES), medians over its items. Backward: the blocks that ran on SMs 0 and 1
(BLOCK_PHASES), medians over the blocks, and the cycles between blocks on one SM (an
upper bound: they include the previous block's printf of its stamps).

Needs a build with the stamps, which print from the kernel (never time that build):

    CMAKE_ARGS="-DFUSEDATTN_CUDA_ARCHS=90 -DFUSEDATTN_FLASH_TRACE=ON" pip install -e .
    python benchmarks/probes/flash_item_trace.py --shapes 16,512,16,128,causal/1,8192,16,128

Each shape runs in a child process (the kernels' printf reaches the process's stdout) that
calls the forward and its gradient twice, then marks its output (MARK) and calls them once
more: the stamps after the mark are read.
"""

from __future__ import annotations

import ctypes
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import parse_args, write_results  # noqa: E402

_LINE = re.compile(r"fusedattn-trace role=(\d) item=(\d+) ((?:-?\d+ ?){6})")
_BLOCK = re.compile(r"fusedattn-btrace sm=(\d+) block=(\d+) tiles=(\d+) ((?:-?\d+ ?){5})")
MARK = "fusedattn-trace: the measured call"

# phase: (what it measures, its cycles from one item's stamps and the previous item's).
# P, C0, C1: this item's producer, consumer warpgroup 0 and 1 stamps; p, c0, c1: the previous item's.
PHASES = {
    "item": ("warpgroup 0's item start to the next item's start",
             lambda P, C0, C1, p, c0, c1: C0[0] - c0[0]),
    "idle_at_boundary": ("warpgroup 0: last P V done -> next Q landed (no product in flight)",
                         lambda P, C0, C1, p, c0, c1: C0[1] - c0[3]),
    "epilogue": ("warpgroup 0: last P V done -> O store issued",
                 lambda P, C0, C1, p, c0, c1: c0[4] - c0[3]),
    "store_read": ("warpgroup 0: O store issued -> its shared-memory reads done",
                   lambda P, C0, C1, p, c0, c1: c0[5] - c0[4]),
    "warpgroup_lag": ("warpgroup 1's store read done after warpgroup 0's",
                      lambda P, C0, C1, p, c0, c1: c1[5] - c0[5]),
    "producer_to_q": ("both stores read -> next Q issued",
                      lambda P, C0, C1, p, c0, c1: P[3] - max(c0[5], c1[5])),
    "q_load": ("next Q issued -> landed", lambda P, C0, C1, p, c0, c1: C0[1] - P[3]),
    "first_tile": ("warpgroup 0: Q landed -> first tile's weights done",
                   lambda P, C0, C1, p, c0, c1: C0[2] - C0[1]),
    "producer_setup": ("producer: item taken -> first K issued",
                       lambda P, C0, C1, p, c0, c1: P[1] - P[0]),
    "k_lead": ("producer's first K issued -> warpgroup 0's Q landed (negative: the consumers reach "
               "the item before its first K is on its way, and wait for it)",
               lambda P, C0, C1, p, c0, c1: C0[1] - P[1]),
}


def measured(text: str) -> str:
    """The output after the child's last MARK (all of it where there is none)."""
    return text.rsplit(MARK, 1)[-1]


def read_stamps(text: str) -> dict[tuple[int, int], list[int]]:
    """{(role, item): six stamps} from a run's output; a later line wins (the last call).
    A block prints as many items as the busiest block has; its items past its own last
    were never stamped (all zero) and are left out."""
    stamps = {}
    for role, item, values in _LINE.findall(text):
        stamps[(int(role), int(item))] = [int(x) for x in values.split()]
    return {key: value for key, value in stamps.items() if any(value)}


def phases(stamps: dict[tuple[int, int], list[int]]) -> dict[str, int]:
    """Median cycles of each of PHASES over the items that have an item before them and
    stamps from all three roles."""
    items = sorted({item for role, item in stamps if role == 0})
    whole = [i for i in items if all((r, i) in stamps and (r, i - 1) in stamps for r in range(3))]
    if not whole:
        raise ValueError("flash_item_trace: fewer than two whole items of stamps in the output "
                         "(is the library built with -DFUSEDATTN_FLASH_TRACE=ON?)")
    return {name: round(statistics.median(
        measure(*(stamps[(r, i)] for r in range(3)), *(stamps[(r, i - 1)] for r in range(3)))
        for i in whole)) for name, (_, measure) in PHASES.items()}


# Backward block phases from one block's stamps e (see trace.cuh) and its query tiles.
BLOCK_PHASES = {
    "kv_load": ("consumers start -> K and V landed", lambda e, tiles: e[1] - e[0]),
    "first_q": ("K and V landed -> first query tile landed", lambda e, tiles: e[2] - e[1]),
    "loop": ("first query tile landed -> last dK product done", lambda e, tiles: e[3] - e[2]),
    "per_tile": ("the loop per query tile", lambda e, tiles: (e[3] - e[2]) // max(tiles, 1)),
    "epilogue": ("last dK product done -> dK and dV stored", lambda e, tiles: e[4] - e[3]),
    "tiles": ("query tiles of the block", lambda e, tiles: tiles),
}


def block_phases(text: str) -> dict[str, int]:
    """Medians of BLOCK_PHASES over the traced backward blocks, and `between_blocks`: the
    median cycles from one block's last stamp to the next block's first on the same SM. The
    trace build prints a block's stamps after its last one, so the gap includes that printf
    (measured 56,000-65,000 cycles at d128, far more than the blocks' loops leave room for
    in the untraced kernel's time): an upper bound, not the real gap."""
    blocks = [(int(sm), int(tiles), [int(x) for x in values.split()])
              for sm, _, tiles, values in _BLOCK.findall(text)]
    if not blocks:
        raise ValueError("flash_item_trace: no backward block stamps in the output (is the "
                         "library built with -DFUSEDATTN_FLASH_TRACE=ON?)")
    got = {name: round(statistics.median(measure(e, tiles) for _, tiles, e in blocks))
           for name, (_, measure) in BLOCK_PHASES.items()}
    gaps = []
    for sm in {sm for sm, _, _ in blocks}:
        run = sorted(e for s, _, e in blocks if s == sm)
        gaps += [after[0] - before[4] for before, after in zip(run, run[1:])]
    got["between_blocks"] = round(statistics.median(gaps)) if gaps else None
    got["blocks"] = len(blocks)
    return got


def child(shape: str) -> None:
    """The forward and its gradient of backend 'flash' at b,s,h,d[,causal], three times,
    MARK before the last (the kernels print)."""
    import jax
    import jax.numpy as jnp

    import fusedattn
    from fusedattn.ops import fused_attn
    b, s, h, d = (int(x) for x in shape.split(",")[:4])
    config = fusedattn.configs.attention_config()
    config.backend = "flash"
    config.mask = "causal" if shape.endswith(",causal") else "no_mask"
    q, k, v = (jax.random.normal(key, (b, s, h, d), jnp.float32).astype(jnp.bfloat16)
               for key in jax.random.split(jax.random.key(0), 3))
    forward = jax.jit(lambda q, k, v: fused_attn((q, k, v), config=config))
    gradient = jax.jit(jax.grad(lambda q, k, v: forward(q, k, v).astype(jnp.float32).sum(),
                                argnums=(0, 1, 2)))
    for call in range(3):
        if call == 2:  # the kernels' printf is in C's stdout buffer once a call is done
            ctypes.CDLL(None).fflush(None)
            os.write(1, f"{MARK}\n".encode())
        forward(q, k, v).block_until_ready()
        jax.block_until_ready(gradient(q, k, v))
    ctypes.CDLL(None).fflush(None)


def main():
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2])
    args = parse_args("/tmp/flash_item_trace.json", lambda parser: parser.add_argument(
        "--shapes", default="16,512,16,128/16,512,16,128,causal/1,8192,16,128",
        help="b,s,h,d[,causal] separated by /"))
    rows = []
    for shape in args.shapes.split("/"):
        run = subprocess.run([sys.executable, __file__, "--child", shape], capture_output=True,
                             text=True, check=True)
        text = measured(run.stdout)
        rows.append({"shape": shape, "forward": phases(read_stamps(text)),
                     "backward": block_phases(text)})
    for part in ("forward", "backward"):
        names = list(rows[0][part])
        print(f"{part:<26}" + "".join(f"{name:>16}" for name in names))
        for row in rows:
            print(f"{row['shape']:<26}" + "".join(f"{row[part][name]!s:>16}" for name in names))
    write_results(args.out, rows, forward_phases={n: what for n, (what, _) in PHASES.items()},
                  backward_phases={n: what for n, (what, _) in BLOCK_PHASES.items()},
                  units="cycles of one SM's clock; forward: medians over block 0's items; "
                        "backward: medians over the blocks of SMs 0 and 1")


if __name__ == "__main__":
    main()
