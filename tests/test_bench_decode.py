"""benchmarks/decode.py: its --quick mode runs end to end on the CPU (the host build of the
paged decode kernel; not a measurement) and writes the issue's rows, its paged cache holds
the contiguous cache's keys, and the paged and contiguous calls it times agree."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, tolerance

from fusedattn.ops import _library

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import decode as bench  # noqa: E402  (benchmarks/decode.py)


@pytest.fixture(autouse=True)
def _on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def test_paged_cache_holds_the_contiguous_keys():
    b, s_kv, page = 3, 64, 16
    k = jax.random.normal(jax.random.key(1), (b, s_kv, 2, 8))
    v = jax.random.normal(jax.random.key(2), (b, s_kv, 2, 8))
    k_pages, v_pages, table = bench.paged_cache(jax.random.key(3), k, v, page)
    assert k_pages.shape == (b * s_kv // page, page, 2, 8) and table.shape == (b, s_kv // page)
    assert sorted(np.asarray(table).ravel().tolist()) == list(range(b * s_kv // page))
    assert not np.array_equal(np.asarray(table).ravel(), np.arange(table.size))  # permuted
    for pool, dense in ((k_pages, k), (v_pages, v)):
        np.testing.assert_array_equal(np.asarray(pool[table].reshape(dense.shape)),
                                      np.asarray(dense))


@pytest.mark.skipif(_library.available("cpu") is not None, reason="no host op library")
@pytest.mark.parametrize("s_q", bench.QUERIES)
def test_paged_and_contiguous_calls_agree(s_q):
    b, s_kv = bench.QUICK_SHAPES[0]
    calls = dict(bench.case_calls(b, s_kv, s_q, list(bench.IMPL_NAMES)))
    want = calls[None]["contiguous"]()
    reference = calls[None]["jax_xla"]()
    assert_close(want, reference, tolerance(jnp.bfloat16), "contiguous vs jax_xla")
    for page in bench.PAGE_SIZES:
        assert bench.paged_backend(b, s_kv, s_q, page) == "decode"
        assert_close(calls[page]["paged"](), want, tolerance(jnp.bfloat16), f"page {page}")


@pytest.mark.skipif(_library.available("cpu") is not None, reason="no host op library")
def test_quick_mode_writes_the_rows(tmp_path, monkeypatch):
    out = tmp_path / "decode.json"
    monkeypatch.setattr(sys, "argv", ["decode.py", "--quick", "--repeats", "1", "--iters", "1",
                                      "--min-window-ms", "0", "--out", str(out)])
    bench.main()
    result = json.loads(out.read_text())
    rows = result["rows"]
    b, s_kv = bench.QUICK_SHAPES[0]
    expected_impls = {"contiguous", "jax_xla", "paged"}
    if bench.fa3_available() is None:
        expected_impls |= {"fa3", "fa3_paged"}
    assert {r["impl"] for r in rows} == expected_impls
    for r in rows:
        assert set(r["shape"]) == {"b", "s_kv", "s_q", "page"} and r["pass"] == "fwd"
        assert r["ms"] > 0 and r["fraction_of_floor"] > 0
        floor = bench.floor_bytes(b, s_kv, r["shape"]["s_q"])
        assert r["floor_ms"] == pytest.approx(floor / result["peak_bytes_per_s"] * 1e3, rel=1e-3)
    paged = [r for r in rows if r["impl"] == "paged"]
    assert sorted((r["shape"]["s_q"], r["shape"]["page"]) for r in paged) == sorted(
        (s_q, page) for s_q in bench.QUERIES for page in bench.PAGE_SIZES)
    assert all(r["backend"] == "decode" for r in paged)
    assert len(result["summary"]) == len(paged) and result["quick"] is True


def test_floor_counts_kv_once_and_q_and_out():
    # b=2, s_kv=8, s_q=1: K and V 2*8*8*128 each, q and out 2*1*32*128 each, 2 bytes apiece
    assert bench.floor_bytes(2, 8, 1) == (2 * 2 * 8 * 8 * 128 + 2 * 2 * 32 * 128) * 2


@pytest.mark.skipif(_library.available("cpu") is not None, reason="no host op library")
def test_profile_traces_the_paged_rows(tmp_path, monkeypatch):
    out = tmp_path / "decode.json"
    monkeypatch.setattr(sys, "argv", ["decode.py", "--quick", "--repeats", "1", "--iters", "1",
                                      "--min-window-ms", "0", "--impls", "paged,jax_xla",
                                      "--out", str(out), "--profile", str(tmp_path / "traces")])
    bench.main()
    rows = json.loads(out.read_text())["rows"]
    for r in rows:
        assert ("profile" in r) == (r["impl"] == "paged"), r["name"]
    for r in rows:
        if r["impl"] == "paged":
            # A CPU trace has no GPU stream: the row says so instead of device times.
            profile = r["profile"]
            assert "error" in profile or profile["device_ms_per_step"] > 0
            assert (tmp_path / "traces" / f"{r['name']}_paged").is_dir()


def test_kernel_variants_edit_the_current_source():
    """benchmarks/probes/decode_variants.py: each variant's literal edits still find their
    text, once, in ops_cuda/cuda/paged_decode.cu (else the probe stops on the GPU machine)."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "probes"))
    import decode_variants  # noqa: E402

    source = decode_variants.SOURCE.read_text()
    assert "as_is" in decode_variants.VARIANTS
    for name, edits in decode_variants.VARIANTS.items():
        for old, new in edits.items():
            assert source.count(old) == 1 and old != new, (name, old)


@pytest.mark.skipif(_library.available("cpu") is not None, reason="no host op library")
def test_layer_step_feeds_each_layer_the_previous_output():
    b, s_kv = bench.QUICK_SHAPES[0]
    layers = 3
    one = dict(bench.case_calls(b, s_kv, 1, ["paged"]))[16]["paged"]
    stacked = dict(bench.case_calls(b, s_kv, 1, ["paged"], layers))[16]["paged"]
    x = one()
    attend, args = one.func, one.args
    for _ in range(layers - 1):
        x = attend(x.astype(args[0].dtype), *args[1:])
    assert_close(stacked(), x, tolerance(jnp.bfloat16), f"{layers} layers")
