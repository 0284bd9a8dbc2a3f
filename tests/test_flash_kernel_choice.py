"""Which CUDA kernels the flash backend names for a call (no GPU needed): the rule of
ops_cuda/cuda/flash/flash.cu (forward_kernel_of) as fusedattn/ops/backends/flash.py states
it, and explain's line for it."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from conftest import make_config

from fusedattn.ops import explain
from fusedattn.ops.backends import flash
from fusedattn.ops.backends.base import CallShapes


def _shapes(head_dim: int) -> CallShapes:
    return CallShapes(batch=2, seqlen_q=300, seqlen_kv=300, num_heads=4, num_kv_heads=2,
                      head_dim_qk=head_dim, head_dim_v=head_dim, dtype=jnp.dtype(jnp.bfloat16),
                      bias_shape=None, dropout=False)


@pytest.fixture
def device(monkeypatch):
    """Sets the compute capability and the sm_90a head dims that flash.py reads."""
    def set_device(capability, sm90_head_dims):
        monkeypatch.setattr(flash, "compute_capability", lambda: capability)
        monkeypatch.setattr(flash._library, "flash_sm90_head_dims",
                            lambda platform="cuda": frozenset(sm90_head_dims))
    return set_device


@pytest.mark.parametrize("capability,head_dims,d,skv,expected", [
    ((9, 0), {64, 128, 256}, 128, 1, "sm90"),
    ((9, 0), {128}, 64, 300, "sm80"),     # a head dim the library has no sm_90a kernel for
    ((9, 0), set(), 128, 300, "sm80"),    # a library built without sm_90
    ((9, 0), {128}, 128, 0, "sm80"),      # no keys: TMA describes no empty tensor
    ((8, 0), {64, 128, 256}, 128, 300, "sm80"),
    ((10, 0), {64, 128, 256}, 128, 300, "sm80"),  # wgmma is sm_90a only
])
def test_the_forward_kernel_rule(device, capability, head_dims, d, skv, expected):
    device(capability, head_dims)
    assert flash._cuda_forward_kernel(d, skv) == expected


def test_kernel_text_names_both_passes(device):
    device((9, 0), {128})
    assert flash.BACKEND.kernel(_shapes(128), "cuda") == "flash: sm90 wgmma forward, sm80 backward"
    assert flash.BACKEND.kernel(_shapes(64), "cuda") == "flash: sm80 mma.sync forward and backward"
    assert flash.BACKEND.kernel(_shapes(128), "cpu") is None
    assert flash.BACKEND.kernel(None, "cuda") is None


def test_explain_prints_the_kernels_of_the_serving_backend(device, monkeypatch, rng):
    q = jnp.asarray(rng.standard_normal((1, 64, 2, 64)), jnp.bfloat16)
    on_cpu = explain((q, q, q), config=make_config(backend="flash"), platform="cpu")
    assert on_cpu.backend == "flash" and on_cpu.kernels == {}
    assert [line.split() for line in str(on_cpu).splitlines() if "flash" in line][1] == \
        ["->", "flash", "ok"]
    device((9, 0), {64})
    monkeypatch.setattr(flash, "_cuda_reason", lambda shapes: None)  # as if on a CUDA GPU
    on_gpu = explain((q, q, q), config=make_config(backend="flash"), platform="cuda")
    assert on_gpu.kernels == {"flash": "flash: sm90 wgmma forward, sm80 backward"}
    assert "ok (flash: sm90 wgmma forward, sm80 backward)" in str(on_gpu)
