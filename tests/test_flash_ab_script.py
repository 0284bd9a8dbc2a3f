"""scripts/flash_ab.sh on a toy repository, with a stand-in python3 (no build, no GPU):
each result is measured on the tree without the patches given so far, the tree is as it
was afterwards (also when a patch does not reverse), and a failed run leaves no result
file of an earlier call behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Stands in for python3: pip succeeds; benchmarks/flash.py writes a result whose TF/s is
# read from the toy tree's file (so each result says which tree it measured);
# benchmarks/flash_compare.py runs for real.
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-m" ]; then exit 0; fi
if [ "$1" = "benchmarks/flash_compare.py" ]; then exec "{python}" "$@"; fi
out=""; while [ $# -gt 0 ]; do [ "$1" = "--out" ] && out=$2; shift; done
echo "{{\\"rows\\": [{{\\"name\\": \\"c\\", \\"pass\\": \\"fwd\\", \\"impl\\": \\"flash\\", \\"tflops\\": $(cat speed.txt)}}]}}" > "$out"
"""


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


@pytest.fixture
def toy(tmp_path):
    """A repository whose speed.txt went 100 -> 200 (old.patch) -> 300 (new.patch, uncommitted)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "benchmarks").mkdir()
    for script in ("flash_ab.sh", "device_env.sh"):
        shutil.copy(ROOT / "scripts" / script, repo / "scripts")
    shutil.copy(ROOT / "benchmarks" / "flash_compare.py", repo / "benchmarks")
    (repo / "speed.txt").write_text("100\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "base")
    (repo / "speed.txt").write_text("200\n")
    (tmp_path / "old.patch").write_text(git(repo, "diff"))
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "old")
    (repo / "speed.txt").write_text("300\n")
    (tmp_path / "new.patch").write_text(git(repo, "diff"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(FAKE_PYTHON.format(python=shutil.which("python3") or "python3"))
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               OUT=str(tmp_path / "out"), LOGS=str(tmp_path / "logs"))
    return repo, tmp_path, env


def run_ab(repo: Path, env: dict, *patches: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/flash_ab.sh", *map(str, patches)], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)


def speed(path: Path) -> float:
    return json.loads(path.read_text())["rows"][0]["tflops"]


def test_each_run_measures_the_tree_without_the_patches_so_far(toy):
    repo, tmp, env = toy
    (tmp / "out").mkdir()
    (tmp / "out" / "with.json").write_text(
        '{"rows": [{"name": "c", "pass": "fwd", "impl": "flash", "tflops": 300}]}')
    result = run_ab(repo, dict(env, WITH=str(tmp / "out" / "with.json")),
                    tmp / "new.patch", tmp / "old.patch")
    assert result.returncode == 0, result.stdout + result.stderr
    assert speed(tmp / "out" / "ab_1.json") == 200
    assert speed(tmp / "out" / "ab_2.json") == 100
    assert (repo / "speed.txt").read_text() == "300\n"  # uncommitted change restored
    assert (tmp / "out" / "logs.tar.gz").exists()
    table = result.stdout.splitlines()[-2:]
    assert table[0].split()[:2] == ["case", "pass"]
    assert table[1].split()[2:] == ["300.0", "1.000", "-", "200.0", "0.667", "-", "100.0", "0.333", "-"]


def test_a_patch_that_does_not_reverse_leaves_the_tree_and_no_stale_result(toy):
    repo, tmp, env = toy
    assert run_ab(repo, env, tmp / "new.patch").returncode == 0
    assert (tmp / "out" / "ab_1.json").exists()
    # old.patch is in HEAD but new.patch sits on top of it: old alone does not reverse.
    result = run_ab(repo, env, tmp / "old.patch")
    assert result.returncode != 0
    assert "does not reverse cleanly" in result.stdout
    assert not (tmp / "out" / "ab_1.json").exists()
    assert (repo / "speed.txt").read_text() == "300\n"
