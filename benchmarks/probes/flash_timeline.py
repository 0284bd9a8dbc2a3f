"""Where one attention call's time goes on the GPU, per impl: every kernel of a traced
run of back-to-back calls (jax.profiler) with its device time per call, and the idle time
between kernels. Answers whether a gap to a peer is in the attention kernel itself or
in what surrounds it (the span summaries, XLA fusions, launch gaps).

    python benchmarks/probes/flash_timeline.py --shapes 4,2048,16,16,128 --impls flash,cudnn,fa3
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import parse_args, passes, random_normal, write_results  # noqa: E402
from flash import impls  # noqa: E402
from kernel_profile import timeline  # noqa: E402


def add_arguments(parser):
    parser.add_argument("--shapes", default="4,2048,16,16,128", help="b,s,h,h_kv,d[/...]")
    parser.add_argument("--impls", default="flash,cudnn,fa3")
    parser.add_argument("--masks", default="no_mask,causal")
    parser.add_argument("--calls", type=int, default=20, help="traced calls per (impl, pass)")


def main():
    args = parse_args("/tmp/flash_timeline.json", add_arguments)
    rows = []
    for shape in args.shapes.split("/"):
        b, s, h, h_kv, d = (int(x) for x in shape.split(","))
        keys = jax.random.split(jax.random.key(s), 4)
        q, do = (random_normal(keys[i], (b, s, h, d), jax.numpy.bfloat16) for i in (0, 3))
        k, v = (random_normal(keys[i], (b, s, h_kv, d), jax.numpy.bfloat16) for i in (1, 2))
        for mask in args.masks.split(","):
            table = impls(mask == "causal", d, dropout=False)
            for name in args.impls.split(","):
                if name not in table:
                    continue
                for pass_name, fn in passes(table[name]).items():
                    summary = timeline(fn, (q, k, v, do), f"{shape} {mask} {name} {pass_name}",
                                       args.calls)
                    rows.append({"shape": shape, "mask": mask, "impl": name, "pass": pass_name,
                                 **summary})
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
