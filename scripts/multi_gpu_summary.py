"""The short table that scripts/multi_gpu.sh prints last: each context-parallel row (length,
impl, load balancing, pass, ms, TF/s per device, scaling efficiency, the first call's
seconds), the ring's and the all-gather's communication overlap, and each LM run's tokens/s
(with its multiple of the one-GPU run's, lm_gpu1.json) and MFU per device.

    python scripts/multi_gpu_summary.py OUT_DIR   # reads OUT_DIR/context_parallel*.json, lm_*.json

A file that is missing or unreadable (a step cut short or skipped) prints one line saying so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from context_parallel_table import table_lines  # noqa: E402


def context_parallel(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    return [f"== {path.name}: {data.get('device', '?')}",
            *table_lines(data["rows"], data.get("overlap", []))]


def lm(path: Path, one_device_rate: float | None) -> list[str]:
    """The run's tokens/s (and its multiple of one_device_rate, where known) and MFU."""
    data = json.loads(path.read_text())
    mesh = [o for o in data.get("overrides", []) if o.startswith("--config.mesh.")]
    lines = [f"== {path.name}: {' '.join(mesh) or 'one device'}"]
    for run in data["rows"]:
        if "error" in run:
            lines.append(f"  {run['backend']}: ERROR {run['error'][-300:]}")
            continue
        s = run["summary"]
        rate, mfu = s.get("tokens_per_s") or 0, s.get("mfu")
        times = f" (x{rate / one_device_rate:.2f} of one GPU)" if one_device_rate and mesh else ""
        lines.append(f"  {run['backend']}: {rate:,.0f} tokens/s{times}, MFU per device "
                     f"{'n/a' if mfu is None else format(100 * mfu, '.1f') + '%'} (steady after step "
                     f"{s.get('after_step', 'the first interval')}), loss {s.get('final_loss')}")
    return lines


def one_device_rate(out: Path) -> float | None:
    """tokens/s of lm_gpu1.json's first run, where it is there."""
    try:
        return json.loads((out / "lm_gpu1.json").read_text())["rows"][0]["summary"]["tokens_per_s"]
    except (OSError, ValueError, KeyError, IndexError):
        return None


def main():
    out = Path(sys.argv[1])
    rate = one_device_rate(out)
    for pattern, summarize in (("context_parallel*.json", context_parallel),
                               ("lm_*.json", lambda path: lm(path, rate))):
        paths = sorted(out.glob(pattern), key=lambda path: path.stat().st_mtime)
        if not paths:
            print(f"== no {pattern} in {out}")
        for path in paths:
            try:
                print("\n".join(summarize(path)))
            except (OSError, ValueError, KeyError, TypeError) as error:
                print(f"== {path.name}: unreadable ({type(error).__name__}: {error})")


if __name__ == "__main__":
    main()
