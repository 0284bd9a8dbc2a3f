"""Which CUDA kernels the flash backend names for a call (no GPU needed): the rules of
ops_cuda/cuda/flash/flash.cu (forward_kernel_of, backward_kernel_of) as
fusedattn/ops/backends/flash_gpu.py states them, explain's line for them, and the workspace a
call gets: the CUDA library's own layout (flash.cu: workspace_of, through
_library.flash_workspace_bytes), checked here against the layout it documents where that library
was built (CI builds it)."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import pytest
from conftest import make_config

from fusedattn.ops import _library, explain, registry
from fusedattn.ops.backends import flash, flash_ffi, flash_gpu
from fusedattn.ops.backends.base import CallShapes
from fusedattn.ops.spec import AttentionSpec


def _shapes(head_dim: int) -> CallShapes:
    return CallShapes(batch=2, seqlen_q=300, seqlen_kv=300, num_heads=4, num_kv_heads=2,
                      head_dim_qk=head_dim, head_dim_v=head_dim, dtype=jnp.dtype(jnp.bfloat16),
                      bias_shape=None, dropout=False)


def _spec(deterministic_backward: bool = False) -> AttentionSpec:
    return AttentionSpec.from_config(dict(deterministic_backward=deterministic_backward))


@pytest.fixture
def cuda_library():
    """Skips where libfusedattn_cuda was not built (fails where FUSEDATTN_REQUIRE_LIBRARIES
    names CUDA, as in CI)."""
    if _library.library_path("fusedattn_cuda") is None:
        required = os.environ.get("FUSEDATTN_REQUIRE_LIBRARIES", "").replace(",", " ").split()
        assert "CUDA" not in required, "libfusedattn_cuda was not built (FUSEDATTN_REQUIRE_LIBRARIES)"
        pytest.skip("libfusedattn_cuda was not built on this machine: the workspace is its layout")


@pytest.fixture
def device(monkeypatch):
    """Sets the compute capability and the sm_90a head dims (forward; backward: the same, as
    flash.cu builds it, unless given) that flash_gpu.py reads."""
    def set_device(capability, sm90_head_dims, backward_head_dims=None):
        backward = set(sm90_head_dims) if backward_head_dims is None else backward_head_dims
        monkeypatch.setattr(flash_gpu, "compute_capability", lambda: capability)
        monkeypatch.setattr(flash_gpu._library, "flash_sm90_head_dims",
                            lambda platform="cuda": frozenset(sm90_head_dims))
        monkeypatch.setattr(flash_gpu._library, "flash_sm90_backward_head_dims",
                            lambda platform="cuda": frozenset(backward))
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
    assert flash_gpu.cuda_forward_kernel(d, skv) == expected


@pytest.mark.parametrize("capability,head_dims,d,sq,skv,deterministic,expected", [
    ((9, 0), {64, 128}, 128, 300, 1, False, "sm90"),
    ((9, 0), {64, 128}, 64, 1, 300, False, "sm90"),
    ((9, 0), {64, 128}, 128, 300, 300, True, "sm80"),  # atomics are not bitwise repeatable
    ((9, 0), {128}, 64, 300, 300, False, "sm80"),      # no sm_90a backward for the head dim
    ((9, 0), {64, 128, 256}, 256, 300, 300, False, "sm90"),
    ((9, 0), set(), 128, 300, 300, False, "sm80"),     # a library built without sm_90
    ((9, 0), {128}, 128, 0, 300, False, "sm80"),       # no queries or no keys: TMA describes
    ((9, 0), {128}, 128, 300, 0, False, "sm80"),       # no empty tensor
    ((8, 0), {64, 128}, 128, 300, 300, False, "sm80"),
    ((10, 0), {64, 128}, 128, 300, 300, False, "sm80"),
])
def test_the_backward_kernel_rule(device, capability, head_dims, d, sq, skv, deterministic,
                                  expected):
    device(capability, head_dims | {256}, head_dims)
    assert flash_gpu.cuda_backward_kernel(d, sq, skv, deterministic) == expected


def test_kernel_text_names_both_passes(device):
    device((9, 0), {128, 256})
    spec, deterministic = _spec(), _spec(deterministic_backward=True)
    assert flash.BACKEND.kernel(spec, _shapes(128), "cuda") == \
        "flash: sm90 wgmma forward, sm90 wgmma backward"
    assert flash.BACKEND.kernel(deterministic, _shapes(128), "cuda") == \
        "flash: sm90 wgmma forward, sm80 backward (deterministic_backward)"
    assert flash.BACKEND.kernel(spec, _shapes(256), "cuda") == \
        "flash: sm90 wgmma forward, sm90 wgmma backward"
    assert flash.BACKEND.kernel(spec, _shapes(64), "cuda") == \
        "flash: sm80 mma.sync forward and backward"
    assert flash.BACKEND.kernel(deterministic, _shapes(64), "cuda") == \
        "flash: sm80 mma.sync forward and backward (deterministic_backward)"
    assert flash.BACKEND.kernel(spec, _shapes(128), "cpu") is None
    assert flash.BACKEND.kernel(spec, None, "cuda") is None


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_workspace_holds_the_dq_accumulator_where_the_sm90_backward_runs(
        cuda_library, device, monkeypatch, deterministic):
    """flash.cu checks the workspace against the same rule: spans, delta, then (sm_90a
    backward only) float32 [b, h, sq rounded up to tiles of 64, d], each part 256-byte aligned."""
    device((9, 0), {128})
    monkeypatch.setattr(flash_ffi, "current_platform", lambda: "cuda")
    b, sq, skv, h, d = 2, 300, 170, 4, 128
    q, k = jnp.zeros((b, sq, h, d), jnp.bfloat16), jnp.zeros((b, skv, 2, d), jnp.bfloat16)
    tokens = jnp.zeros((b, sq), jnp.int32)
    spans = 2 * ((-(-sq // 32) + -(-skv // 32)) * 32)  # two token rows of 32-byte summaries
    delta = -(-(b * h * sq * 4) // 256) * 256
    (forward,) = flash_ffi.cuda_workspace(q, k, tokens, backward=False)
    (backward,) = flash_ffi.cuda_workspace(q, k, tokens, backward=True, deterministic=deterministic)
    assert forward.shape == (-(-spans // 256) * 256,)
    accumulator = 0 if deterministic else b * h * 320 * d * 4  # 300 queries: 5 tiles of 64
    assert backward.shape == (forward.shape[0] + delta + accumulator,)


@pytest.mark.parametrize("capability,deterministic", [((9, 0), False), ((9, 0), True), ((8, 0), False)])
def test_the_workspace_holds_the_slope_partials_with_alibi(cuda_library, device, monkeypatch,
                                                          capability, deterministic):
    """flash.cu checks the workspace against the same rule: with ALiBi the backward adds
    float32 [b, h, slots], a slot per warp: 8 of every 128 keys for the sm_90a backward
    (sm90/launch.h: slope_slots), 4 of every 64 queries for the sm_80 one (launch.h:
    sm80_slope_slots), 256-byte aligned."""
    device(capability, {128})
    monkeypatch.setattr(flash_ffi, "current_platform", lambda: "cuda")
    b, sq, skv, h, d = 2, 300, 170, 4, 128
    q, k = jnp.zeros((b, sq, h, d), jnp.bfloat16), jnp.zeros((b, skv, 2, d), jnp.bfloat16)
    tokens = jnp.zeros((b, sq), jnp.int32)
    (plain,) = flash_ffi.cuda_workspace(q, k, tokens, backward=True, deterministic=deterministic)
    (alibi,) = flash_ffi.cuda_workspace(q, k, tokens, backward=True, deterministic=deterministic,
                                     alibi=True)
    sm90 = capability == (9, 0) and not deterministic
    slots = 2 * 8 if sm90 else 5 * 4  # 170 keys: 2 blocks of 128; 300 queries: 5 tiles of 64
    assert alibi.shape == (plain.shape[0] + -(-(b * h * slots * 4) // 256) * 256,)
    (forward,) = flash_ffi.cuda_workspace(q, k, tokens, backward=False)
    assert flash_ffi.cuda_workspace(q, k, tokens, backward=False, alibi=True)[0].shape == forward.shape


def test_kernel_text_says_alibi(device):
    device((9, 0), {128})
    spec = dataclasses.replace(_spec(), bias=flash.BiasType.ALIBI)
    assert flash.BACKEND.kernel(spec, _shapes(128), "cuda") == (
        "flash: sm90 wgmma forward, sm90 wgmma backward, ALiBi in the kernels (slopes' "
        "gradient summed in a fixed order)")
    assert "ALiBi in the kernels" in flash.BACKEND.kernel(spec, _shapes(128), "rocm")
    assert "ALiBi" not in flash.BACKEND.kernel(_spec(), _shapes(128), "cuda")
    device((9, 0), {128, 256})
    assert flash.BACKEND.kernel(spec, _shapes(256), "cuda").startswith(
        "flash: sm90 wgmma forward, sm90 wgmma backward, ALiBi")


def test_the_backward_call_carries_the_deterministic_attribute():
    static = flash._static(_spec(deterministic_backward=True), 0.125, _spec().softmax, False)
    assert static.attributes(backward=True)["deterministic"] is True
    assert "deterministic" not in static.attributes(backward=False)
    assert flash._static(_spec(), 0.125, _spec().softmax, False).deterministic is False


def test_explain_prints_the_kernels_of_the_serving_backend(device, monkeypatch, rng):
    q = jnp.asarray(rng.standard_normal((1, 64, 2, 64)), jnp.bfloat16)
    on_cpu = explain((q, q, q), config=make_config(backend="flash"), platform="cpu")
    assert on_cpu.backend == "flash" and on_cpu.kernels == {}
    assert [line.split() for line in str(on_cpu).splitlines() if "flash" in line][1] == \
        ["->", "flash", "ok"]
    device((9, 0), {64})
    monkeypatch.setattr(flash_gpu, "gpu_reason", lambda shapes, platform: None)  # as if on a GPU
    on_gpu = explain((q, q, q), config=make_config(backend="flash"), platform="cuda")
    assert on_gpu.kernels == {"flash": "flash: sm90 wgmma forward, sm90 wgmma backward"}
    assert "ok (flash: sm90 wgmma forward, sm90 wgmma backward)" in str(on_gpu)
    repeatable = explain((q, q, q), config=make_config(backend="flash", deterministic_backward=True),
                         platform="cuda")
    assert repeatable.kernels == {
        "flash": "flash: sm90 wgmma forward, sm80 backward (deterministic_backward)"}


@pytest.mark.parametrize("capability,head_dims", [((9, 0), {64, 128, 256}), ((8, 0), set())])
def test_the_environment_variable_names_the_sm80_kernels(device, monkeypatch, capability,
                                                         head_dims):
    device(capability, head_dims)
    monkeypatch.setenv(flash_gpu.KERNEL_VARIABLE, "sm80")
    assert flash_gpu.cuda_forward_kernel(128, 300) == "sm80"
    assert flash_gpu.cuda_backward_kernel(128, 300, 300, False) == "sm80"
    assert flash.BACKEND.kernel(_spec(), _shapes(128), "cuda") == \
        "flash: sm80 mma.sync forward and backward (named by FUSEDATTN_FLASH_KERNEL=sm80)"
    monkeypatch.setenv(flash_gpu.KERNEL_VARIABLE, "")
    assert flash_gpu.cuda_forward_kernel(128, 300) == ("sm90" if head_dims else "sm80")
    assert flash_gpu.cuda_backward_kernel(128, 300, 300, False) == ("sm90" if head_dims else "sm80")


def test_an_unknown_kernel_name_is_refused(device, monkeypatch):
    device((9, 0), {128})
    monkeypatch.setenv(flash_gpu.KERNEL_VARIABLE, "sm90a")
    with pytest.raises(ValueError,
                       match="FUSEDATTN_FLASH_KERNEL must be unset, empty or 'sm80', got 'sm90a'"):
        flash_gpu.cuda_forward_kernel(128, 300)


@pytest.fixture
def rocm(monkeypatch):
    """A loaded ROCm library with the given flash head dims on a device of the given gfx target."""
    def set_rocm(arch, head_dims, reason=None):
        monkeypatch.setattr(flash_gpu._library, "available", lambda platform: reason)
        monkeypatch.setattr(flash_gpu._library, "flash_head_dims",
                            lambda platform="cuda": frozenset(head_dims))
        monkeypatch.setattr(flash_gpu, "rocm_arch", lambda: arch)
    return set_rocm


def test_rocm_serves_the_built_head_dims_on_cdna(rocm):
    rocm("gfx90a", {64, 128})
    spec = AttentionSpec.from_config(make_config(backend="flash"))
    assert flash.BACKEND.supports(spec, _shapes(128), "rocm") is None
    assert flash.BACKEND.kernel(_spec(), _shapes(128), "rocm") == (
        "flash: MFMA forward and backward (the sm80 kernels' text, gfx90a/gfx94x; "
        "compile-checked only, never run on AMD hardware)")


@pytest.mark.parametrize("arch,d,dtype,reason,expected", [
    ("gfx1100", 128, jnp.bfloat16, None,
     "written for CDNA GPUs (gfx90a, gfx940, gfx941, gfx942: MFMA, wave64), this GPU is gfx1100"),
    ("gfx90a", 256, jnp.bfloat16, None,
     "no ROCm kernel for head dim 256 in this build (built: [64, 128]; the kernels exist for 64, 128,"),
    ("gfx942", 64, jnp.float32, None,
     "the ROCm kernels take bfloat16 or float16 inputs, got float32"),
    ("gfx90a", 64, jnp.bfloat16, "the ROCm op library was not built",
     "flash: the ROCm op library was not built"),
])
def test_rocm_reasons(rocm, arch, d, dtype, reason, expected):
    rocm(arch, {64, 128}, reason)
    shapes = dataclasses.replace(_shapes(d), dtype=jnp.dtype(dtype))
    spec = AttentionSpec.from_config(make_config(backend="flash"))
    assert expected in flash.BACKEND.supports(spec, shapes, "rocm")


@pytest.mark.parametrize("value,named", [(None, False), ("", False), ("sm80", True)])
def test_the_named_kernel_travels_as_the_gpu_calls_attribute(monkeypatch, value, named):
    """Read when the call is traced, carried to flash.cu as "kernel"; the host handler has none."""
    if value is None:
        monkeypatch.delenv(flash_gpu.KERNEL_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(flash_gpu.KERNEL_VARIABLE, value)
    static = flash._static(AttentionSpec.from_config(make_config(backend="flash")), 0.1,
                           flash.SoftmaxType.VANILLA, False)
    assert static.sm80_named is named
    monkeypatch.setattr(flash_ffi, "current_platform", lambda: "cuda")
    assert static.attributes(backward=False)["kernel"] == int(named)
    assert static.attributes(backward=True)["kernel"] == int(named)
    monkeypatch.setattr(flash_ffi, "current_platform", lambda: "cpu")
    assert "kernel" not in static.attributes(backward=True)


@pytest.mark.parametrize("capability", [(9, 0), (8, 0)])
def test_bias_arrays_run_the_devices_kernels(device, capability):
    """Every kernel has a bias variant: a call with a bias array runs the kernels the device
    picks, and explain says where its gradient comes from."""
    device(capability, {64, 128, 256})
    kernels = "sm90 wgmma forward, sm90 wgmma backward" if capability == (9, 0) else \
        "sm80 mma.sync forward and backward"
    for bias in ("pre_scale_bias", "post_scale_bias"):
        spec = AttentionSpec.from_config(dict(bias=bias))
        assert flash.BACKEND.kernel(spec, _shapes(128), "cuda") == (
            f"flash: {kernels}, the bias array in the kernels (its gradient's terms summed in "
            "a fixed order)")


@pytest.mark.parametrize("bias_batch,bias_heads,terms", [(2, 4, False), (1, 4, True), (2, 1, True),
                                                         (1, 1, True)])
def test_the_workspace_holds_a_broadcast_bias_gradients_terms(cuda_library, device, monkeypatch,
                                                              bias_batch, bias_heads, terms):
    """flash.cu checks the workspace against the same rule: a bias array broadcast over batch
    rows or heads adds the terms of its gradient, float32 [b, h, sq, skv], 256-byte aligned
    (a full one takes them in d_bias itself), to either backward's workspace."""
    device((9, 0), {128})
    monkeypatch.setattr(flash_ffi, "current_platform", lambda: "cuda")
    b, sq, skv, h, d = 2, 300, 170, 4, 128
    q, k = jnp.zeros((b, sq, h, d), jnp.bfloat16), jnp.zeros((b, skv, 2, d), jnp.bfloat16)
    tokens = jnp.zeros((b, sq), jnp.int32)
    extra = -(-(b * h * sq * skv * 4) // 256) * 256 if terms else 0
    for deterministic in (False, True):  # the sm_90a backward, the sm_80 one
        (plain,) = flash_ffi.cuda_workspace(q, k, tokens, backward=True, deterministic=deterministic)
        (biased,) = flash_ffi.cuda_workspace(q, k, tokens, backward=True, deterministic=deterministic,
                                             bias_shape=(bias_batch, bias_heads, sq, skv))
        assert biased.shape == (plain.shape[0] + extra,)
    (forward,) = flash_ffi.cuda_workspace(q, k, tokens, backward=False)
    assert flash_ffi.cuda_workspace(q, k, tokens, backward=False,
                                    bias_shape=(bias_batch, bias_heads, sq, skv))[0].shape == forward.shape


def _long_causal(**changes) -> CallShapes:
    shapes = CallShapes(batch=1, seqlen_q=8192, seqlen_kv=8192, num_heads=16, num_kv_heads=16,
                        head_dim_qk=128, head_dim_v=128, dtype=jnp.dtype(jnp.bfloat16),
                        bias_shape=None, dropout=False)
    return dataclasses.replace(shapes, **changes)


@pytest.fixture
def cudnn_serves(device, monkeypatch):
    """An sm90 device where cudnn and flash both serve every call (as on the H200)."""
    device((9, 0), {64, 128, 256})
    monkeypatch.setattr(flash_gpu, "gpu_reason", lambda shapes, platform: None)
    monkeypatch.setattr(registry.BACKENDS["cudnn"], "supports", lambda spec, shapes, platform: None)


@pytest.mark.parametrize("config,shapes,chosen", [
    ({"mask": "causal"}, _long_causal(), "flash"),
    ({"mask": "causal"}, _long_causal(seqlen_q=32768, seqlen_kv=32768), "flash"),
    ({"mask": "causal"}, _long_causal(seqlen_q=4096, seqlen_kv=4096), "cudnn"),   # measured: cudnn
    ({"mask": "no_mask"}, _long_causal(), "cudnn"),
    ({"mask": "causal_bottom_right"}, _long_causal(), "cudnn"),
    ({"mask": "causal"}, _long_causal(num_kv_heads=4), "cudnn"),                   # GQA: not measured
    ({"mask": "causal"}, _long_causal(dtype=jnp.dtype(jnp.float16)), "cudnn"),
    ({"mask": "causal"}, _long_causal(head_dim_qk=64, head_dim_v=64), "cudnn"),
    ({"mask": "causal"}, _long_causal(dropout=True), "cudnn"),                     # measured: cudnn
    ({"mask": "causal", "deterministic_backward": True}, _long_causal(), "cudnn"),  # sm80 backward
    ({"mask": "causal", "window_size": (4096, 0)}, _long_causal(), "cudnn"),
    ({"mask": "causal", "softmax": "off_by_one"}, _long_causal(), "cudnn"),
])
def test_auto_prefers_flash_exactly_where_measured_faster(cudnn_serves, config, shapes, chosen):
    spec = AttentionSpec.from_config(config)
    explained = registry.explain_spec(spec, shapes, "cuda")
    assert explained.verdicts["cudnn"] is None and explained.verdicts["flash"] is None
    assert explained.backend == chosen
    assert (flash_gpu.AUTO_RULE in str(explained)) == (chosen == "flash")
    named = registry.explain_spec(AttentionSpec.from_config({**config, "backend": "cudnn"}), shapes, "cuda")
    assert named.backend == "cudnn" and named.preference is None


def test_auto_keeps_cudnn_off_sm90_and_with_the_sm80_kernels_named(cudnn_serves, device, monkeypatch):
    spec = AttentionSpec.from_config({"mask": "causal"})
    monkeypatch.setenv(flash_gpu.KERNEL_VARIABLE, "sm80")
    assert registry.explain_spec(spec, _long_causal(), "cuda").backend == "cudnn"
    monkeypatch.delenv(flash_gpu.KERNEL_VARIABLE)
    device((8, 0), set())
    assert registry.explain_spec(spec, _long_causal(), "cuda").backend == "cudnn"
    assert registry.explain_spec(spec, _long_causal(), "rocm").backend == "cudnn"


@pytest.mark.gpu
def test_auto_takes_flash_for_a_long_causal_call_on_the_device():
    """On the GPU itself (cudnn's own verdict, the library's kernels): the rule's call goes to
    flash, a shorter one stays with cudnn."""
    if flash_gpu.compute_capability() != (9, 0):
        pytest.skip("the rule covers compute capability 9.0 only")
    config = make_config(mask="causal")
    long, short = (jax.ShapeDtypeStruct((1, s, 16, 128), jnp.bfloat16) for s in (8192, 4096))
    explained = explain((long, long, long), config=config)
    assert explained.backend == "flash" and flash_gpu.AUTO_RULE in str(explained)
    assert explain((short, short, short), config=config).backend == "cudnn"
