"""cuDNN's FP8 attention (backend "cudnn", config.fp8.enabled) against the xla emulation of
the same recipe (ops/backends/xla_fp8.py), both run on the GPU.

Tolerance: the two round nearly the same values through FP8, but cuDNN's softmax and
sums differ from the emulation's float32 ones in the last bits, and its softmax
numerators are relative to a running row max over key blocks (the emulation's to the
final max), so a value near an FP8 rounding boundary may land on the neighbouring FP8
value (one step: 1/8 to 1/16 of it in E4M3, 1/4 in E5M2). So: the largest difference
within FP8_CLOSE of the largest entry (e4m3: one E4M3 step at the largest entry, at most
1/8 of it, since out, dq, dk and dv are stored in E4M3 last and a simulation of cuDNN's
running-max numerators over 128-key blocks flips entries of the top binade by one step;
hybrid: more for the flips of its E5M2 score gradients), the root-mean-square
difference within FP8_RMS of the entries' (both miss by far for a wrong graph, scale or
layout: a saturated scale_s gave 0.47 of 0.70), and cuDNN's error against exact attention (float32, unquantised) at
most ACCURACY_RATIO times the emulation's, both within the relative rms bounds FP8
rounding gives (fp8_reference.rms_error_bounds). The amaxes XLA computes (q, k, v, do) and s's
(1) are equal; those of cuDNN's results (o, dp, dq, dk, dv) within AMAX_RTOL.

Skipped without a GPU of compute capability 9.0 or newer (cuDNN's FP8 SDPA graphs need
Hopper; an 8.9 GPU gets the reason, checked here too).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_finite, make_config, poison_like, random_array
from fp8_reference import fp8_step, rerounded_rms_bound, rms_error_bounds

from fusedattn.ops import Fp8State, explain, fp8, fp8_state_init, fused_attn
from fusedattn.ops.backends.base import compute_capability

pytestmark = pytest.mark.gpu

FP8_CLOSE = {"e4m3": 0.125, "hybrid": 0.15}
FP8_RMS = {"e4m3": 0.06, "hybrid": 0.12}
ACCURACY_RATIO = 1.5
AMAX_RTOL = 5e-2
_EXACT_COLUMNS = ("q", "k", "v", "s", "do")   # amaxes computed alike on both paths


def _hopper() -> bool:
    return jax.devices()[0].platform == "gpu" and compute_capability() >= (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="cuDNN's FP8 graphs need sm_90+")


def assert_fp8_close(actual, expected, fmt: str, name: str, rerounded: bool = False):
    """Within FP8_CLOSE and FP8_RMS (module docstring). `rerounded`: both were rounded once
    more, into E4M3 at unit scale (the gradients of FP8 inputs, fp8.input_cotangent), which
    can turn their difference into whole E4M3 spacings: the largest difference may grow by
    the spacing at the largest entry (each rounding moves a value by half its spacing at
    most), the rms one as fp8_reference.rerounded_rms_bound derives from FP8_RMS and
    the spacings at `expected`'s entries."""
    actual, expected = (np.asarray(x, np.float64) for x in (actual, expected))
    assert_finite(actual, name)
    top = np.abs(expected).max()
    close, rms_bound = FP8_CLOSE[fmt] * top, FP8_RMS[fmt]
    if rerounded:
        close += float(fp8_step(top))
        rms_bound = rerounded_rms_bound(expected, FP8_RMS[fmt])
    error = np.abs(actual - expected)
    assert error.max() <= close, f"{name}: max error {error.max()} of {top} (bound {close})"
    rms = np.sqrt(np.mean(error**2)) / np.sqrt(np.mean(expected**2))
    assert rms <= rms_bound, f"{name}: relative rms error {rms} > {rms_bound}"


def _rms(x) -> float:
    return float(np.sqrt(np.mean(np.asarray(x, np.float64) ** 2)))


def assert_as_accurate(actual, emulated, exact, fmt: str, name: str):
    """cuDNN's error against exact attention at most ACCURACY_RATIO times the emulation's;
    both relative rms errors within the bounds of the FP8 format (rms_error_bounds: below
    them FP8 rounding was lost, as XLA's GPU compiler once folded the emulation's)."""
    actual, emulated, exact = (np.asarray(x, np.float64) for x in (actual, emulated, exact))
    ours, oracle = _rms(actual - exact), _rms(emulated - exact)
    assert ours <= ACCURACY_RATIO * oracle + 1e-4 * _rms(exact), (
        f"{name}: rms error against exact attention {ours}, the emulation's {oracle}")
    lower, upper = rms_error_bounds(fmt, name)
    for who, error in (("cudnn", ours), ("emulation", oracle)):
        relative = error / _rms(exact)
        assert lower <= relative <= upper, (
            f"{name}: {who}'s relative rms error against exact attention {relative:.4f} is "
            f"outside the FP8 bounds [{lower:.4f}, {upper:.4f}]")


def assert_states_close(actual: Fp8State, expected: Fp8State, name: str):
    for field in ("scale", "amax_history"):
        got, want = (np.asarray(getattr(x, field)) for x in (actual, expected))
        for column, tensor in enumerate(fp8.TENSORS):
            rtol = 1e-5 if tensor in _EXACT_COLUMNS else AMAX_RTOL
            np.testing.assert_allclose(got[..., column], want[..., column], rtol=rtol,
                                       err_msg=f"{name}.{field}, column {tensor}")


def _exact(mask, q, k, v, d_out):
    """(out, (dq, dk, dv)) of float32 attention on the unquantised inputs (xla backend)."""
    config = make_config(backend="xla", mask=mask)

    @jax.jit
    def run(q, k, v, d_out):
        out, pullback = jax.vjp(lambda q, k, v: fused_attn((q, k, v), config=config), q, k, v)
        return out, pullback(d_out)

    return run(*(x.astype(jnp.float32) for x in (q, k, v, d_out)))


def _inputs(rng, b=2, sq=256, skv=256, h=4, h_kv=4, d=128, dtype=jnp.bfloat16):
    return (random_array(rng, (b, sq, h, d), dtype), random_array(rng, (b, skv, h_kv, d), dtype),
            random_array(rng, (b, skv, h_kv, d), dtype))


def _step(config):
    """(state, q, k, v, d_out) -> (out, the forward's state, (dq, dk, dv, the state's
    gradient: every amax recorded)), jitted."""
    def run(q, k, v, state):
        return fused_attn((q, k, v), config=config, fp8_state=state)

    @jax.jit
    def step(state, q, k, v, d_out):
        (out, new_state), pullback = jax.vjp(run, q, k, v, state)
        return out, new_state, pullback((d_out, jax.tree.map(jnp.zeros_like, new_state)))

    return step


def _both(config_overrides, state, q, k, v, d_out):
    """The step's results through cudnn and through xla, cudnn's after poisoned buffers."""
    results = {}
    for backend in ("xla", "cudnn"):
        config = make_config(backend=backend, **config_overrides)
        step = _step(config)
        step.lower(state, q, k, v, d_out)  # graph builds before the poison
        if backend == "cudnn":
            poison_like(q, k, v, d_out)
        results[backend] = jax.block_until_ready(step(state, q, k, v, d_out))
    return results["cudnn"], results["xla"]


def _warm_state(rng, overrides, q, k, v, d_out) -> Fp8State:
    """The state after one emulated step on other data: a history that is not empty."""
    config = make_config(backend="xla", **overrides)
    first = _step(config)(fp8_state_init(config), *(x * 1.5 for x in (q, k, v)), d_out)
    return first[2][3]


@needs_hopper
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_forward_gradients_and_state_match_the_emulation(rng, fmt, mask, scaling):
    overrides = dict(mask=mask, fp8={"enabled": True, "format": fmt, "scaling": scaling})
    q, k, v = _inputs(rng)
    d_out = random_array(rng, q.shape, jnp.bfloat16)
    state = _warm_state(rng, overrides, q, k, v, d_out)
    (out, new_state, grads), (ref_out, ref_state, ref_grads) = _both(overrides, state, q, k, v,
                                                                     d_out)
    exact_out, exact_grads = _exact(mask, q, k, v, d_out)
    assert out.dtype == q.dtype
    assert_fp8_close(out, ref_out, fmt, "out")
    assert_as_accurate(out, ref_out, exact_out, fmt, "out")
    for got, want, exact, name in zip(grads[:3], ref_grads[:3], exact_grads, ("dq", "dk", "dv")):
        assert got.dtype == q.dtype
        assert_fp8_close(got, want, fmt, name)
        assert_as_accurate(got, want, exact, fmt, name)
    assert_states_close(new_state, ref_state, "forward state")
    assert_states_close(grads[3], ref_grads[3], "state gradient")


@needs_hopper
def test_grouped_query_heads(rng):
    overrides = dict(mask="causal", fp8={"enabled": True})
    q, k, v = _inputs(rng, h=8, h_kv=2)
    d_out = random_array(rng, q.shape, jnp.bfloat16)
    state = _warm_state(rng, overrides, q, k, v, d_out)
    (out, _, grads), (ref_out, _, ref_grads) = _both(overrides, state, q, k, v, d_out)
    assert_fp8_close(out, ref_out, "e4m3", "out")
    for got, want, name in zip(grads[:3], ref_grads[:3], ("dq", "dk", "dv")):
        assert_fp8_close(got, want, "e4m3", name)


@needs_hopper
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_state_over_training_steps_equals_the_emulation(rng, fmt):
    """Delayed scaling from the initial state (the first step's o, dp, dq, dk, dv at the
    state's unit scales, fp8.KERNEL_WRITTEN; no probe pass on any step): each step
    overwrites the state with its gradient, as the layers do; fresh inputs per step."""
    overrides = dict(mask="causal", fp8={"enabled": True, "format": fmt, "amax_history_len": 4})
    config = make_config(**overrides)
    states = {"cudnn": fp8_state_init(config), "xla": fp8_state_init(config)}
    steps = {name: _step(make_config(backend=name, **overrides)) for name in states}
    for index in range(5):
        q, k, v = (x * (1.0 + 0.5 * index) for x in _inputs(rng))
        d_out = random_array(rng, q.shape, jnp.bfloat16)
        results = {name: steps[name](states[name], q, k, v, d_out) for name in states}
        assert_fp8_close(results["cudnn"][0], results["xla"][0], fmt, f"out at step {index}")
        states = {name: result[2][3] for name, result in results.items()}
        assert_states_close(states["cudnn"], states["xla"], f"state after step {index}")
    assert np.all(np.asarray(states["cudnn"].amax_history[:4]) > 0)


@needs_hopper
def test_inputs_given_in_fp8(rng):
    """Their gradients dL/dx / scale in E4M3 at unit scale are mostly E4M3 subnormals here
    (rms about one spacing 2^-9: the inputs' scales are near 60), so their comparison
    allows for that last rounding (assert_fp8_close's `rerounded`); their numbers are
    checked by the bfloat16 tests, this one checks the conversion."""
    overrides = dict(mask="no_mask", fp8={"enabled": True})
    q, k, v = _inputs(rng)
    d_out = random_array(rng, q.shape, jnp.bfloat16)
    state = _warm_state(rng, overrides, q, k, v, d_out)
    q8, k8, v8 = (fp8.quantise(x, jnp.float8_e4m3fn, state.scale[i]) for i, x in
                  enumerate((q, k, v)))
    (out, new_state, grads), (ref_out, ref_state, ref_grads) = _both(overrides, state, q8, k8, v8,
                                                                     d_out)
    assert out.dtype == jnp.bfloat16
    assert_fp8_close(out, ref_out, "e4m3", "out")
    for got, want, name in zip(grads[:3], ref_grads[:3], ("dq8", "dk8", "dv8")):
        assert got.dtype == jnp.float8_e4m3fn
        assert_fp8_close(got.astype(jnp.float32), want.astype(jnp.float32), "e4m3", name,
                         rerounded=True)
    assert_states_close(new_state, ref_state, "forward state")


@needs_hopper
def test_forward_only_call_and_max_logit(rng):
    """A call nobody differentiates runs cuDNN's forward without stats; max_logit is the
    emulation's (the largest logit of the FP8 scores)."""
    overrides = dict(mask="causal", fp8={"enabled": True, "scaling": "current"})
    q, k, v = _inputs(rng)
    results = {}
    for backend in ("xla", "cudnn"):
        config = make_config(backend=backend, **overrides)
        results[backend] = jax.jit(lambda q, k, v: fused_attn(
            (q, k, v), config=config, return_max_logit=True))(q, k, v)
    (out, state, largest), (ref_out, ref_state, ref_largest) = results["cudnn"], results["xla"]
    assert_fp8_close(out, ref_out, "e4m3", "out")
    assert_states_close(state, ref_state, "state")
    np.testing.assert_allclose(np.asarray(largest), np.asarray(ref_largest), rtol=1e-3)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_round_trip_rounds_under_jit_on_the_gpu(rng, dtype):
    """The emulation's FP8 rounding survives XLA's GPU compiler, which folds a bare
    f32 -> FP8 -> f32 convert chain into the identity (any GPU; a power-of-two scale keeps
    the expected values exact)."""
    x = random_array(rng, (8192,), jnp.float32, scale=8.0)
    got = jax.jit(lambda x, scale: fp8.round_trip(x, dtype, scale))(x, jnp.float32(4.0))
    top = float(jnp.finfo(dtype).max)
    want = np.clip(np.asarray(x) * 4, -top, top).astype(dtype).astype(np.float32) / 4
    assert np.any(want != np.asarray(x))
    np.testing.assert_array_equal(np.asarray(got), want)


@needs_hopper
def test_explain_names_cudnn_for_fp8(rng):
    q, k, v = _inputs(rng)
    explanation = explain((q, k, v), config=make_config(fp8={"enabled": True}))
    assert explanation.backend == "cudnn", str(explanation)
    assert "cuDNN's FP8 SDPA graphs" in str(explanation)


@pytest.mark.skipif(jax.devices()[0].platform != "gpu" or _hopper(), reason="a pre-Hopper GPU")
def test_pre_hopper_gpu_gets_the_reason(rng):
    q, k, v = _inputs(rng)
    reason = explain((q, k, v), config=make_config(fp8={"enabled": True})).verdicts["cudnn"]
    assert "FP8 attention needs compute capability 9.0 (Hopper) or newer" in reason, reason
