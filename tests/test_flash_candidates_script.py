"""scripts/flash_candidates.sh on a toy repository, with a stand-in python3 (a "build" copies
the tree's speed.txt into the installed library; the probe reports what each library holds):
each candidate's library is the build of the tree with its patch, the probe reads the tree's
own library, and the tree and its installed library are as they were afterwards."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FAKE_PYTHON = """#!/usr/bin/env bash
lib="{lib}"
if [ "$1" = "-c" ]; then echo "$lib"; exit 0; fi
if [ "$1" = "-m" ]; then cp speed.txt "$lib/libfusedattn_cuda.so"; exit 0; fi
out=""; candidates=""
while [ $# -gt 0 ]; do
  [ "$1" = "--out" ] && out=$2
  [ "$1" = "--candidates" ] && candidates=$2
  shift
done
for item in ${{candidates//,/ }}; do  # a candidate built from a "hang" tree never returns
  grep -q hang "${{item#*=}}" && sleep 30
done
{{
  echo "{{\\"tree\\": $(cat "$FUSEDATTN_LIB_DIR/libfusedattn_cuda.so"), \\"candidates\\": {{"
  sep=""
  for item in ${{candidates//,/ }}; do
    echo "$sep\\"${{item%%=*}}\\": $(cat "${{item#*=}}")"; sep=","
  done
  echo "}}}}"
}} > "$out"
"""


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


@pytest.fixture
def toy(tmp_path):
    """A repository at speed 100 with patches to 200 (a), 300 (b) and a build that hangs (h),
    and its installed library built from it."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for script in ("flash_candidates.sh", "device_env.sh"):
        shutil.copy(ROOT / "scripts" / script, repo / "scripts")
    (repo / "speed.txt").write_text("100\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "base")
    for name, speed in (("a", 200), ("b", 300), ("h", "hang")):
        (repo / "speed.txt").write_text(f"{speed}\n")
        (tmp_path / f"{name}.patch").write_text(git(repo, "diff"))
        git(repo, "checkout", "-q", "speed.txt")
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libfusedattn_cuda.so").write_text("100\n")
    (lib / "libfusedattn_host.so").write_text("host\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(FAKE_PYTHON.format(lib=lib))
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               OUT=str(tmp_path / "out"), LOGS=str(tmp_path / "logs"))
    return repo, tmp_path, env


def run(repo: Path, env: dict, *items: str, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/flash_candidates.sh", *items], cwd=repo, env={**env, **extra_env},
                          capture_output=True, text=True, timeout=120)


def test_each_candidate_is_the_tree_with_its_patch(toy):
    repo, tmp, env = toy
    result = run(repo, env, f"a={tmp / 'a.patch'}", f"b={tmp / 'b.patch'}")
    assert result.returncode == 0, result.stdout + result.stderr
    measured = json.loads((tmp / "out" / "flash_candidates.json").read_text())
    assert measured == {"tree": 100, "candidates": {"a": 200, "b": 300}}
    assert (repo / "speed.txt").read_text() == "100\n"
    assert git(repo, "status", "--porcelain") == ""
    assert (tmp / "lib" / "libfusedattn_cuda.so").read_text() == "100\n"  # the tree's again
    assert (tmp / "out" / "logs.tar.gz").is_file()


def test_a_patch_that_does_not_apply_stops_the_run_and_restores(toy):
    repo, tmp, env = toy
    (tmp / "bad.patch").write_text("--- a/missing.txt\n+++ b/missing.txt\n@@ -1 +1 @@\n-x\n+y\n")
    result = run(repo, env, f"a={tmp / 'a.patch'}", f"bad={tmp / 'bad.patch'}")
    assert result.returncode != 0
    assert "bad.patch does not apply" in result.stdout
    assert not (tmp / "out" / "flash_candidates.json").exists()
    assert git(repo, "status", "--porcelain") == ""
    assert (tmp / "lib" / "libfusedattn_cuda.so").read_text() == "100\n"


def test_a_candidate_that_hangs_in_its_check_is_left_out(toy):
    repo, tmp, env = toy
    result = run(repo, env, f"a={tmp / 'a.patch'}", f"h={tmp / 'h.patch'}", CHECK_TIMEOUT="3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "candidate h: left out" in result.stdout
    measured = json.loads((tmp / "out" / "flash_candidates.json").read_text())
    assert measured == {"tree": 100, "candidates": {"a": 200}}
    assert git(repo, "status", "--porcelain") == ""
    assert (tmp / "lib" / "libfusedattn_cuda.so").read_text() == "100\n"
