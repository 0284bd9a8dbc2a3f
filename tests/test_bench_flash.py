"""benchmarks/flash.py's packed-bias impls on the CPU (the host build; not a measurement):
flash and xla agree on what they time, forward and fwd+bwd, with the bias constant and
learned (its gradient included), and a run of those impls writes a row with a time for each
and the summary's ratios."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import assert_close, tolerance

from fusedattn.ops import _library

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import common  # noqa: E402  (benchmarks/common.py)
import flash as bench  # noqa: E402  (benchmarks/flash.py)

pytestmark = pytest.mark.skipif(_library.available("cpu") is not None, reason="no host op library")

B, S, H, D = 1, 128, 2, 64


@pytest.fixture(autouse=True)
def _on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _operands():
    keys = jax.random.split(jax.random.key(5), 4)
    return tuple(common.random_normal(k, (B, S, H, D), jnp.bfloat16) for k in keys)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("learned", [False, True])
def test_packed_bias_impls_agree(causal, learned):
    table = bench.impls(causal, D, dropout=False, packed=bench.packed_bias(B, S, H))
    kind = "bias_grad_packed" if learned else "bias_packed"
    operands = _operands()
    tol = tolerance(jnp.bfloat16)
    flash, xla = (common.passes(table[f"{backend}_{kind}"]) for backend in ("flash", "xla"))
    assert_close(flash["fwd"](*operands), xla["fwd"](*operands), tol, "fwd")
    (got_out, got_grads), (want_out, want_grads) = flash["fwd+bwd"](*operands), xla["fwd+bwd"](*operands)
    assert_close(got_out, want_out, tol, "fwd+bwd output")
    assert len(got_grads) == len(want_grads) == (4 if learned else 3)  # dq, dk, dv (, d_bias)
    for name, got, want in zip(("dq", "dk", "dv", "d_bias"), got_grads, want_grads):
        assert got.shape == want.shape, name
        assert_close(got, want, tol, name)


def test_packed_bias_run_writes_rows(tmp_path, monkeypatch):
    out = tmp_path / "flash.json"
    impls = ("flash", "flash_bias_packed", "xla_bias_packed", "flash_bias_grad_packed", "xla_bias_grad_packed")
    monkeypatch.setattr(sys, "argv", ["flash.py", "--impls", ",".join(impls), "--shapes", f"{B},{S},{H},{H},{D}",
                                      "--masks", "causal", "--repeats", "1", "--iters", "1",
                                      "--min-window-ms", "0", "--out", str(out)])
    bench.main()
    result = json.loads(out.read_text())
    rows = {(r["impl"], r["pass"]): r for r in result["rows"]}
    assert set(rows) == {(impl, p) for impl in impls for p in ("fwd", "fwd+bwd")}
    assert all(r["ms"] is not None and r["ms"] > 0 for r in rows.values()), rows
    for entry in result["summary"]:
        assert entry["flash_bias_packed_vs_xla"] > 0 and entry["flash_bias_grad_packed_vs_xla"] > 0
