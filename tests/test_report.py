"""benchmarks/report.py draws one chart per committed results file it knows."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_report_draws_every_chart_from_the_committed_results(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    charts = {"cudnn", "flash", "small_seq", "layers", "lm_train", "decode", "fp8", "masked_values",
              "context_parallel", "lm_mesh"}
    written = {path.stem for path in tmp_path.glob("*.png") if path.stat().st_size > 10_000}
    assert written == charts, f"charts written: {sorted(written)}"
    for name in charts:  # each chart is committed for docs/benchmarks.md
        assert (ROOT / "docs" / "img" / f"{name}.png").exists(), name
