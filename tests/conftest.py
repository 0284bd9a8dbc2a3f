"""Shared test helpers: per-test random generators, dtype tolerances, closeness checks,
config building, and the `gpu` marker (skipped unless JAX's default device is a GPU).

Helpers are plain functions (import them with `from conftest import ...`); fixtures:
`rng` (a NumPy Generator seeded from the test's id, printed when the test fails) and
`seed` (that seed). Set FUSEDATTN_TEST_SEED=<int> to draw a different set of inputs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import zlib
from pathlib import Path

# On a GPU: XLA's scatter-adds (embedding gradients) use atomics unless asked for
# determinism, and the trainer's resume test compares losses bitwise. Set before JAX
# creates its backends.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_gpu_deterministic_ops=true"]).strip()
# Four host (CPU) devices for the device-mesh tests (tests/test_sharding.py).
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# float32 matmuls in full precision on GPUs too (not TF32), so float32 parity tests
# between two computations of one result hold to float32 tolerances.
jax.config.update("jax_default_matmul_precision", "highest")

# Relative tolerance of an op's result in each input dtype, against a float64 reference
# computed from the same (rounded) inputs. bf16: eps^(2/3) with eps = 2^-7.
TOLERANCES = {
    np.dtype(jnp.float32): 1e-5,
    np.dtype(jnp.bfloat16): 0.04,
    np.dtype(jnp.float16): 0.01,
    np.dtype(np.float64): 1e-12,
}


def tolerance(dtype) -> float:
    return TOLERANCES[np.dtype(dtype)]


def assert_finite(x, name: str = "value") -> None:
    x = np.asarray(x, np.float64)
    bad = ~np.isfinite(x)
    assert not bad.any(), f"{name}: {int(bad.sum())} non-finite entries, first at {np.argwhere(bad)[0]}"


def assert_close(actual, expected, tol: float, name: str = "value", scale: float | None = None):
    """|actual - expected| <= tol * (|expected| + scale) elementwise, everything finite.

    scale defaults to max(1, max|expected|): the error is measured relative to the size of
    the result, so entries near zero are not held to a relative bound.
    """
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != expected {e.shape}"
    assert_finite(a, name)
    assert_finite(e, f"{name} (expected)")
    if scale is None:
        scale = max(1.0, float(np.max(np.abs(e)))) if e.size else 1.0
    err = np.abs(a - e)
    bound = tol * (np.abs(e) + scale)
    if not np.all(err <= bound):
        worst = np.unravel_index(np.argmax(err - bound), err.shape)
        raise AssertionError(
            f"{name}: {int(np.sum(err > bound))}/{err.size} entries off; worst at {worst}: "
            f"got {a[worst]!r}, expected {e[worst]!r} (|err| {err[worst]:.3g} > "
            f"{bound[worst]:.3g}; tol {tol}, scale {scale:.3g}; max |err| {err.max():.3g})"
        )


def poison_like(*arrays, copies: int = 4) -> None:
    """Fills `copies` buffers of each array's shape and dtype with NaN, then frees them.

    Output buffers allocated next reuse that memory (XLA's GPU allocator hands a freed
    region out again; the host allocator reuses blocks of the same size), so an output
    element that a kernel leaves unwritten reads back as NaN, which no comparison passes.
    Call it right before the computation under test runs.
    """
    poison = [jnp.full(x.shape, jnp.nan, x.dtype) for x in arrays * copies]
    jax.block_until_ready(poison)
    for x in poison:
        x.delete()


def run_host_program(source: Path, build_dir: Path, include_dirs) -> str:
    """Builds the C++17 program `source` (-Wall -Wextra -Werror, -O2) with the host C++
    compiler into build_dir, runs it and returns its standard output."""
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.fail(f"no host C++ compiler (c++, g++ or clang++) on the PATH to build {source.name}")
    binary = build_dir / source.stem
    subprocess.run([compiler, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror",
                    *(f"-I{d}" for d in include_dirs), str(source), "-o", str(binary)], check=True)
    return subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout


def make_config(**overrides):
    """attention_config() with overrides; nested sections take dicts, e.g. sequence={...}."""
    from fusedattn.configs import attention_config

    config = attention_config()
    for key, value in overrides.items():
        if isinstance(value, dict):
            for sub, sub_value in value.items():
                setattr(getattr(config, key), sub, sub_value)
        else:
            setattr(config, key, value)
    return config


_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?([\w.-]+) = (\w+)\[[^=]*? ([\w-]+)\(([\w.-]+)")


def foldable_fp8_read_backs(hlo_text: str) -> list[str]:
    """The instructions of an HLO module (Lowered.as_text(dialect="hlo")) that convert an
    FP8 value straight from another convert: XLA's GPU compiler folds such chains, f32 ->
    FP8 -> f32, into the identity (SimplifyFPConversions, on under the default
    xla_allow_excess_precision), dropping the FP8 rounding. Empty when every read-back of
    a quantised value goes through an optimization barrier (ops/fp8.py dequantise)."""
    instructions = {}
    for line in hlo_text.splitlines():
        match = _HLO_INSTRUCTION.match(line)
        if match:
            name, dtype, opcode, operand = match.groups()
            instructions[name] = (dtype, opcode, operand, line.strip())
    return [line for dtype, opcode, operand, line in instructions.values()
            if opcode == "convert" and operand in instructions
            and instructions[operand][1] == "convert" and instructions[operand][0].startswith("f8")]


def random_array(rng: np.random.Generator, shape, dtype=jnp.float32, scale: float = 1.0):
    """Standard normal entries (times scale) as a jax array of `dtype`."""
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32).astype(dtype)


def _base_seed() -> int:
    return int(os.environ.get("FUSEDATTN_TEST_SEED", "0"))


@pytest.fixture
def seed(request) -> int:
    """A seed of its own for every test (stable across runs; FUSEDATTN_TEST_SEED varies it)."""
    value = (zlib.crc32(request.node.nodeid.encode()) + _base_seed()) % (2**31)
    request.node.fusedattn_seed = value
    return value


@pytest.fixture
def rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one")
    config.addinivalue_line("markers", "slow: long-running cases")


def pytest_collection_modifyitems(config, items):
    if jax.devices()[0].platform == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs a GPU; JAX runs on {jax.devices()[0].platform}")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    value = getattr(item, "fusedattn_seed", None)
    if report.failed and value is not None:
        report.sections.append(("random seed", f"seed={value} (FUSEDATTN_TEST_SEED="
                                                f"{_base_seed()})"))


FAKE_CUDNN_WORKSPACE_BYTES = 4096


def fake_cudnn_for_cuda_lowering(monkeypatch, request) -> None:
    """Lets cuDNN calls lower for CUDA without a GPU: the library's availability, cuDNN's
    check, the compute capability (9.0), the platform and the workspace sizes
    (FAKE_CUDNN_WORKSPACE_BYTES) are faked. Traces of the backend's ops hold the workspace
    size, so JAX's caches are cleared now and when the test ends: no trace may outlive the
    fake (a later real call with the same shapes would reuse it)."""
    from fusedattn.ops import registry
    from fusedattn.ops.backends import cudnn
    from fusedattn.ops.backends.cudnn import library as cudnn_library

    monkeypatch.setattr(cudnn_library, "available", lambda: None)
    monkeypatch.setattr(cudnn.backend, "_compute_capability", lambda: (9, 0))
    monkeypatch.setattr(cudnn_library, "check", lambda *args: None)
    monkeypatch.setattr(cudnn_library, "workspace_bytes", lambda *args: FAKE_CUDNN_WORKSPACE_BYTES)
    monkeypatch.setattr(registry, "current_platform", lambda: "cuda")
    jax.clear_caches()
    request.addfinalizer(jax.clear_caches)
