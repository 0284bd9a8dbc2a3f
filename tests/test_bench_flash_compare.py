"""benchmarks/flash_compare.py: the A/B table of flash.py result files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import flash_compare  # noqa: E402


def write_run(path: Path, tflops: dict) -> Path:
    """A flash.py-shaped result file: {(case, pass, impl): TF/s}."""
    rows = [{"name": case, "pass": pass_, "impl": impl, "tflops": t, "ms": 1.0}
            for (case, pass_, impl), t in tflops.items()]
    path.write_text(json.dumps({"device": "test", "rows": rows}))
    return path


@pytest.fixture
def runs(tmp_path):
    new = write_run(tmp_path / "new.json", {
        ("b4_s2048", "fwd", "flash"): 500.0, ("b4_s2048", "fwd", "fa3"): 600.0,
        ("b4_s2048", "fwd+bwd", "flash"): 450.0,
        ("b1_s8192", "fwd", "flash"): 570.0, ("b1_s8192", "fwd", "fa3"): 620.0})
    old = write_run(tmp_path / "old.json", {
        ("b4_s2048", "fwd", "flash"): 400.0, ("b4_s2048", "fwd", "fa3"): 500.0,
        ("b1_s8192", "fwd", "flash"): 600.0, ("b1_s8192", "fwd", "fa3"): 620.0,
        ("b16_s512", "fwd", "flash"): 300.0})
    return new, old


def test_ratios_against_the_first_run_and_the_reference(runs):
    rows = flash_compare.compare([flash_compare.load_tflops(f) for f in runs])
    by_key = {(r["case"], r["pass"]): r for r in rows}
    # The first run's cases, in its order; a case only a later run timed is not listed.
    assert [(r["case"], r["pass"]) for r in rows] == [("b4_s2048", "fwd"), ("b4_s2048", "fwd+bwd"),
                                                      ("b1_s8192", "fwd")]
    fwd = by_key["b4_s2048", "fwd"]
    assert fwd["tflops"] == [500.0, 400.0]
    assert fwd["vs_first"] == pytest.approx([1.0, 0.8])
    assert fwd["of_reference"] == pytest.approx([500 / 600, 400 / 500])
    # Missing in the second run, and no reference in either: None, not a number.
    both = by_key["b4_s2048", "fwd+bwd"]
    assert both["tflops"] == [450.0, None] and both["vs_first"] == [1.0, None]
    assert both["of_reference"] == [None, None]
    assert by_key["b1_s8192", "fwd"]["vs_first"] == pytest.approx([1.0, 600 / 570])


def test_the_table_and_its_errors(runs, capsys):
    assert flash_compare.main([str(f) for f in runs] + ["--names", "with,without"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "with TF/s" in out[0] and "without TF/s" in out[0] and "/fa3" in out[0]
    fwd_bwd = next(line for line in out if "fwd+bwd" in line)
    assert fwd_bwd.split()[2:] == ["450.0", "1.000", "-", "-", "-", "-"]
    with pytest.raises(SystemExit):
        flash_compare.main([str(f) for f in runs] + ["--names", "only_one"])
    assert "one per file" in capsys.readouterr().err
    assert flash_compare.main([str(f) for f in runs] + ["--impl", "cudnn"]) == 1
    assert "no rows of impl 'cudnn'" in capsys.readouterr().err
