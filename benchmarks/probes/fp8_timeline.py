"""Where an FP8 attention call's time goes on the GPU: every kernel of a traced run of
back-to-back calls (jax.profiler) per impl of benchmarks/fp8.py and pass, with its device
time per call and the idle time between kernels. Answers how much of ours against
cuDNN's graphs alone ("fp8_graph") or JAX's FP8 path is the XLA work around the graphs
(amaxes, quantisation, conversions, the state update) and which kernels it is.

    python benchmarks/probes/fp8_timeline.py --cases 4,2048,16,128/1,8192,16,128,causal
"""

from __future__ import annotations

import _benchmarks_on_path  # noqa: F401  (benchmarks/ on sys.path)
from common import parse_args, write_results
from fp8 import IMPLS, build_impls, case_inputs
from kernel_profile import timeline


def add_arguments(parser):
    parser.add_argument("--cases", default="4,2048,16,128/1,8192,16,128,causal",
                        help="b,s,h,d[,causal][/...]")
    parser.add_argument("--impls", default="fp8,fp8_inputs,fp8_graph,jax_fp8",
                        help=f"comma-separated subset of {IMPLS}")
    parser.add_argument("--calls", type=int, default=10, help="traced calls per (impl, pass)")


def main():
    args = parse_args("/tmp/fp8_timeline.json", add_arguments)
    rows = []
    for case in args.cases.split("/"):
        fields = case.split(",")
        causal = fields[-1] == "causal"
        b, s, h, d = (int(x) for x in fields[:4])
        inputs = case_inputs(b, s, h, d, causal)
        fns, errors = build_impls(args.impls.split(","), causal, *inputs)
        for name, error in errors.items():
            print(f"== {case} {name}: {error}")
        for name, passes in fns.items():
            for pass_name, fn in passes.items():
                summary = timeline(fn, inputs, f"{case} {name} {pass_name}", args.calls)
                rows.append({"case": case, "impl": name, "pass": pass_name, **summary})
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
