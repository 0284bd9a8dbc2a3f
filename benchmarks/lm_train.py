"""The LM trainer on the GPU config: tokens/s and model FLOP utilisation per backend.

Runs examples/lm/main.py --config=configs/lm_nnx.py:gpu (12 layers, d_model 1024,
sequence 2048, packed documents, bf16) for a short run per attention backend
("xla" and "auto"; more with --backends) and, with --framework equinox, the Equinox
model. Steady-state rates come from the trainer's own summary (intervals after
the first, which holds compilation), or with --steady-after N from the logged intervals
after step N (on a device mesh the interval ending at step 10 holds a second
compilation of the step). Writes the summaries and the runs' metrics.
With --profile N, a further short run of the last backend traces N steps with
jax.profiler and adds the device time per kernel kind (benchmarks/kernel_profile.py):
where a step's time goes besides the matmuls.

    python benchmarks/lm_train.py --out benchmarks/results/lm_train.json --steps 60
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import write_results
from kernel_profile import print_summary, summarize

ROOT = Path(__file__).resolve().parent.parent


def steady_rates(metrics: list[dict], after_step: int) -> dict:
    """{"after_step", "tokens_per_s", "mfu"} over the logged intervals that end after
    after_step: total steps over total time, each interval's time being its steps over its
    rate (MFU is proportional to the rate, so it combines the same way); None where no such
    interval has the rate."""
    intervals, previous = [], 0
    for record in metrics:
        if record["step"] > after_step and "tokens_per_s" in record:
            intervals.append((record["step"] - previous, record))
        previous = record["step"]
    rates = {"after_step": after_step}
    for key in ("tokens_per_s", "mfu"):
        known = [(steps, record[key]) for steps, record in intervals if record.get(key)]
        rates[key] = (sum(steps for steps, _ in known) / sum(steps / rate for steps, rate in known)
                      if known else None)
    return rates


def run(backend: str, framework: str, steps: int, extra: list[str], profile_steps: int = 0) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"lm_{framework}_{backend}_"))
    command = [sys.executable, str(ROOT / "examples/lm/main.py"), f"--workdir={workdir}",
               "--config=" + str(ROOT / f"configs/lm_{framework}.py") + ":gpu",
               f"--config.model.attention.backend={backend}",
               f"--config.trainer.num_steps={steps}", "--config.trainer.log_every=10",
               f"--config.trainer.eval_every={steps}", f"--config.trainer.checkpoint_every={steps}",
               "--config.trainer.progress=False", *extra]
    if profile_steps:
        command += [f"--config.trainer.profile_steps={profile_steps}",
                    f"--config.trainer.profile_start={steps - profile_steps}"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", flush=True)
    if done.returncode != 0:
        return {"backend": backend, "framework": framework, "error": done.stderr[-500:]}
    summary = json.loads((workdir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    result = {"backend": backend, "framework": framework, "steps": steps, "summary": summary,
              "metrics": metrics}
    if profile_steps:
        try:
            result["profile"] = summarize(workdir / "profile", profile_steps)
        except (OSError, ValueError) as error:
            result["profile_error"] = str(error)
            print(f"profile: {error}", flush=True)
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/lm_train.json")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--backends", default="xla,auto")
    parser.add_argument("--framework", default="nnx", choices=("nnx", "equinox"))
    parser.add_argument("--profile", type=int, default=0,
                        help="trace this many steps of a further run of the last backend")
    parser.add_argument("--steady-after", type=int, default=0,
                        help="rates from the logged intervals after this step (0: the trainer's "
                             "summary, every interval after the first)")
    parser.add_argument("overrides", nargs="*", help="extra --config.a.b=value flags")
    args = parser.parse_args()
    if not 0 <= args.steady_after < args.steps:
        raise SystemExit(f"--steady-after {args.steady_after}: choose a step from 0 to "
                         f"--steps - 1 ({args.steps - 1}), so that some interval comes after it")
    runs = [run(b, args.framework, args.steps, args.overrides) for b in args.backends.split(",")]
    if args.steady_after:  # the trainer's own rates stay as trainer_tokens_per_s, trainer_mfu
        for r in runs:
            if "summary" in r:
                r["summary"].update(trainer_tokens_per_s=r["summary"].get("tokens_per_s"),
                                    trainer_mfu=r["summary"].get("mfu"),
                                    **steady_rates(r["metrics"], args.steady_after))
    if args.profile:
        backend = args.backends.split(",")[-1]
        profiled = run(backend, args.framework, args.profile + 20, args.overrides, args.profile)
        profiled.update(backend=backend + "_profiled", traced=True)
        runs.append(profiled)
    # A traced run's rates include the tracer's overhead: it is there for its profile only.
    timed = [r for r in runs if "summary" in r and not r.get("traced")]
    rates = {r["backend"]: r["summary"].get("tokens_per_s") for r in timed}
    summary = {r["backend"]: {k: r["summary"].get(k) for k in ("tokens_per_s", "mfu", "final_loss")}
               for r in timed}
    if rates.get("xla") and rates.get("auto"):
        summary["auto_speedup_vs_xla"] = round(rates["auto"] / rates["xla"], 2)
    write_results(args.out, runs, summary=summary, config=f"configs/lm_{args.framework}.py:gpu",
                  overrides=args.overrides)
    print(f"\n{'backend':<8}{'tokens/s':>12}{'MFU':>8}")
    for name, s in summary.items():
        if isinstance(s, dict):
            mfu = s.get("mfu")
            print(f"{name:<8}{s.get('tokens_per_s') or 0:>12.0f}"
                  f"{'n/a' if mfu is None else format(100 * mfu, '.1f') + '%':>8}")
    if "auto_speedup_vs_xla" in summary:
        print(f"auto / xla tokens/s: {summary['auto_speedup_vs_xla']}x")
    for r in runs:
        if "profile" in r:
            print(f"\nprofile of {r['backend']}:")
            print_summary(r["profile"])


if __name__ == "__main__":
    main()
