"""The cudnn backend's FP8 path on any machine: the reasons supports() gives, and what an
FP8 call lowers to for CUDA (cuDNN's FP8 calls, with probe passes under current scaling).
Its numbers against the emulation: tests/test_fp8_gpu.py."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from conftest import fake_cudnn_for_cuda_lowering, foldable_fp8_read_backs, make_config

from fusedattn.ops import AttentionSpec, explain, fp8_state_init, fused_attn
from fusedattn.ops.backends import cudnn
from fusedattn.ops.backends.base import CallShapes
from fusedattn.ops.backends.cudnn import library as cudnn_library


def shapes(d=128, dtype=jnp.bfloat16, dropout=False):
    return CallShapes(batch=2, seqlen_q=128, seqlen_kv=128, num_heads=4, num_kv_heads=4,
                      head_dim_qk=d, head_dim_v=d, dtype=jnp.dtype(dtype), bias_shape=None,
                      dropout=dropout)


def fp8_spec(**overrides):
    fp8 = {"enabled": True, **overrides.pop("fp8", {})}
    return AttentionSpec.from_config(make_config(fp8=fp8, **overrides))


@pytest.fixture
def fake_cuda(monkeypatch, request):
    """A CUDA machine without one (conftest.fake_cudnn_for_cuda_lowering), cuDNN 9.28.1."""
    fake_cudnn_for_cuda_lowering(monkeypatch, request)
    monkeypatch.setattr(cudnn_library, "cudnn_version", lambda: 92801)


@pytest.mark.parametrize("overrides, call, expected", [
    (dict(mask="padding_causal"), {}, "got config.mask 'padding_causal'"),
    (dict(qkv_layout="thd_thd_thd", mask="padding", sequence={"format": "seqlens_offsets"}), {},
     "layout 'thd_thd_thd'"),
    (dict(window_size=(16, 0)), {}, "sliding window is not served"),
    (dict(dropout_rate=0.1), dict(dropout=True), "dropout is not served"),
    ({}, dict(d=72), "head dim a multiple of 16"),
    ({}, dict(d=320), "at most 256"),
])
def test_static_reasons(overrides, call, expected):
    reason = cudnn.BACKEND.supports(fp8_spec(**overrides), shapes(**call), "cuda")
    assert reason is not None and reason.startswith("cudnn: ") and expected in reason, reason


def test_dropout_off_at_inference_is_no_reason(fake_cuda):
    assert cudnn.BACKEND.supports(fp8_spec(dropout_rate=0.1), shapes(dropout=False), "cuda") is None


@pytest.mark.parametrize("version, fragment", [(90005, "cuDNN 9.0.5"), (91000, "cuDNN 9.10.0")])
def test_cudnn_version_reason(fake_cuda, monkeypatch, version, fragment):
    monkeypatch.setattr(cudnn_library, "cudnn_version", lambda: version)
    reason = cudnn.BACKEND.supports(fp8_spec(), shapes(), "cuda")
    assert "need cuDNN 9.1.0 or newer, but not 9.10.0" in reason and fragment in reason, reason


@pytest.mark.parametrize("capability", [(8, 0), (8, 9)])
def test_compute_capability_reason(fake_cuda, monkeypatch, capability):
    monkeypatch.setattr(cudnn.backend, "_compute_capability", lambda: capability)
    reason = cudnn.BACKEND.supports(fp8_spec(), shapes(), "cuda")
    assert reason == (f"cudnn: FP8 attention needs compute capability 9.0 (Hopper) or newer "
                      f"(cuDNN's FP8 SDPA graphs), this GPU has {capability[0]}.{capability[1]}; "
                      "use backend 'xla'")


@pytest.mark.parametrize("fmt, code", [("e4m3", 1), ("hybrid", 2)])
def test_cudnn_checks_the_fp8_graphs_and_gives_its_reason(fake_cuda, monkeypatch, fmt, code):
    asked = []

    def check(params, scale, dropout, device):
        asked.append(params)
        return "hidden_dim shoud be equal to 128"

    monkeypatch.setattr(cudnn_library, "check", check)
    reason = cudnn.BACKEND.supports(fp8_spec(fp8={"format": fmt}), shapes(d=64), "cuda")
    assert reason == (f"cudnn: cuDNN 9.28.1 on compute capability 9.0 cannot run this FP8 call "
                      f"({fmt} format): hidden_dim shoud be equal to 128")
    assert asked[0][-1] == code and asked[0][7] == 0  # the FP8 graphs, not bf16 ones


@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_supports_checks_only_the_dense_graphs(fake_cuda, monkeypatch, scaling):
    """No scaling runs cuDNN's padding-mask graphs (delayed scaling has no probe passes)."""
    asked = []

    def check(params, scale, dropout, device):
        asked.append(params)
        return "no padding" if params[12] == 1 else None   # segments

    monkeypatch.setattr(cudnn_library, "check", check)
    assert cudnn.BACKEND.supports(fp8_spec(fp8={"scaling": scaling}), shapes(), "cuda") is None
    assert [params[12] for params in asked] == [0]


@pytest.mark.parametrize("scaling, passes", [
    ("delayed", "one cuDNN call per direction (delayed scaling: no probe pass)"),
    ("current", "a probe forward and two probe backwards"),
])
def test_explain_names_the_fp8_path(fake_cuda, scaling, passes):
    q = jax.ShapeDtypeStruct((2, 128, 4, 128), jnp.bfloat16)
    explanation = explain((q, q, q), config=make_config(fp8={"enabled": True, "scaling": scaling}))
    assert explanation.backend == "cudnn"
    assert "cuDNN's FP8 SDPA graphs" in str(explanation), str(explanation)
    assert passes in str(explanation), str(explanation)


def _targets(text: str) -> list[str]:
    return re.findall(r"custom_call @(\w+)\(", text)


@pytest.mark.parametrize("scaling, forward_calls, backward_calls", [
    ("current", 2, 3),   # the probes (of amax_o; of amax_dp, then dq/dk/dv's) and the calls
    ("delayed", 1, 1),   # the state's scales: one cuDNN graph per direction, no probe
])
def test_lowers_to_the_fp8_calls_probes_only_under_current_scaling(fake_cuda, scaling,
                                                                    forward_calls,
                                                                    backward_calls):
    config = make_config(backend="cudnn", mask="causal", fp8={"enabled": True, "scaling": scaling})
    state = fp8_state_init(config)
    q = jax.ShapeDtypeStruct((2, 128, 4, 128), jnp.bfloat16)

    def step(q, k, v, do, state):
        (out, _), pullback = jax.vjp(
            lambda q, k, v, s: fused_attn((q, k, v), config=config, fp8_state=s), q, k, v, state)
        return out, pullback((do, state))

    lowered = jax.jit(step).trace(q, q, q, q, state).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert foldable_fp8_read_backs(lowered.as_text(dialect="hlo")) == []
    targets = _targets(text)
    assert targets.count(cudnn_library.FP8_FWD_TARGET) == forward_calls, targets
    assert targets.count(cudnn_library.FP8_BWD_TARGET) == backward_calls, targets
    assert cudnn_library.FWD_TARGET not in targets
    assert not re.findall(r"stablehlo\.(?:case|if|while)\b", text)  # no host round trips
    segments = re.findall(r"custom_call @fusedattn_cudnn_fp8_\w+\(.*segments = (\d+)", text)
    assert segments == ["0"] * (forward_calls + backward_calls)   # dense graphs only
