"""benchmarks/probes/flash_candidates.py on the CPU: a copy of the host op library registered
as a candidate, its programs calling its own targets, and the check that catches a
lowering left on the tree's targets."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "probes"))

import flash_candidates  # noqa: E402
from flash import ours  # noqa: E402
from fusedattn.ops import _library  # noqa: E402

pytestmark = pytest.mark.skipif(_library.available("cpu") is not None, reason="no host op library")


@pytest.fixture(scope="module")
def candidate(tmp_path_factory):
    """Candidate "copy": the host library, copied to a file of its own and registered."""
    path = tmp_path_factory.mktemp("candidate") / "libfusedattn_host.so"
    shutil.copy(_library.library_path("fusedattn_host"), path)
    keep = []
    flash_candidates.register("copy", path, "cpu", keep)
    yield keep


def operands(seed: int):
    keys = jax.random.split(jax.random.key(seed), 4)
    shape = (1, 96, 2, 32)
    return tuple(jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16) for key in keys)


@pytest.mark.parametrize("causal", [False, True])
def test_a_candidate_runs_its_own_targets_and_matches_the_tree(candidate, causal):
    args = operands(1 + causal)
    tree = flash_candidates.compiled_passes(ours("flash", causal), None, args)
    copy = flash_candidates.compiled_passes(ours("flash", causal), "copy", args)
    for pass_name in ("fwd", "fwd+bwd"):
        reference = tree[pass_name](*args)
        result = copy[pass_name](*args)
        assert flash_candidates.largest_difference(reference, result) == 0.0
        leaves = jax.tree.leaves(result)
        assert len(leaves) == (1 if pass_name == "fwd" else 4)
        assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in leaves)


def test_the_targets_a_program_calls_are_read_from_its_text(candidate):
    args = operands(3)
    lowered = jax.jit(lambda q, k, v: ours("flash", False)(q, k, v)).lower(*args[:3])
    assert flash_candidates.flash_targets(lowered.as_text()) == {"fusedattn_flash_fwd"}
    with flash_candidates.lowering_with("copy"):
        jax.clear_caches()
        lowered = jax.jit(lambda q, k, v: ours("flash", False)(q, k, v)).lower(*args[:3])
    assert flash_candidates.flash_targets(lowered.as_text()) == {"fusedattn_flash_fwd__candidate_copy"}


def test_a_lowering_left_on_the_trees_targets_is_refused(candidate, monkeypatch):
    """If the candidate's targets did not reach the program (here: the switch does nothing),
    the probe stops instead of timing the tree twice."""
    tree_targets = flash_candidates.lowering_with
    monkeypatch.setattr(flash_candidates, "lowering_with", lambda name: tree_targets(None))
    with pytest.raises(ValueError, match="expected"):
        flash_candidates.compiled_passes(ours("flash", False), "copy", operands(4))


def test_candidate_names_are_checked(tmp_path):
    library = tmp_path / "lib.so"
    library.write_bytes(b"")
    assert flash_candidates.parse_candidates(f"a={library},b_2={library}") == {"a": library, "b_2": library}
    for bad in (f"a@b={library}", f"a={library},a={library}", "a", f"a={tmp_path / 'missing.so'}"):
        with pytest.raises(SystemExit):
            flash_candidates.parse_candidates(bad)


@pytest.mark.parametrize("compare", [True, False])
def test_a_run_times_tree_candidate_and_peer_in_one_table(candidate, tmp_path, monkeypatch, capsys, compare):
    """main() end to end on the CPU: the copy matches the tree exactly (or, with --no-compare,
    is marked not compared) and is timed beside it; --fa3's peer (here the xla backend
    standing in for flash_attn3_jax) joins the rounds."""
    name = "copy2" if compare else "copy3"  # a name registers once per process
    library = tmp_path / name / "libfusedattn_host.so"
    library.parent.mkdir()
    shutil.copy(_library.library_path("fusedattn_host"), library)
    monkeypatch.setattr(flash_candidates, "fa3", lambda causal: ours("xla", causal))
    out = tmp_path / "result.json"
    monkeypatch.setattr(sys, "argv", [
        "flash_candidates.py", "--platform", "cpu", "--candidates", f"{name}={library}", "--fa3",
        "--shapes", "1,64,2,2,128", "--masks", "causal", "--repeats", "1", "--iters", "1",
        "--min-window-ms", "1", "--out", str(out)] + ([] if compare else ["--no-compare"]))
    flash_candidates.main()
    rows = json.loads(out.read_text())["rows"]
    by_impl = {(r["impl"], r["pass"]): r for r in rows}
    assert set(by_impl) == {(impl, p) for impl in ("flash", f"flash@{name}", "fa3") for p in ("fwd", "fwd+bwd")}
    for p in ("fwd", "fwd+bwd"):
        assert by_impl[(f"flash@{name}", p)]["difference"] == (0.0 if compare else "not compared (--no-compare)")
        assert by_impl[(f"flash@{name}", p)]["ms"] > 0 and by_impl[("fa3", p)]["ms"] > 0
        assert by_impl[("flash", p)]["vs_tree"] == 1.0
    assert f"flash@{name}" in capsys.readouterr().out
