"""FP8 attention (config.fp8): the recipe's emulation on the xla backend, its state, errors.

The emulation is checked against a float64 NumPy run of the same recipe
(tests/fp8_reference.py): equal up to float32 noise, except where a value sits on an FP8
rounding boundary and the two round it to neighbouring FP8 values; so the output may
differ by one FP8 step of the output (module tolerance FP8_STEP_SLACK) in at most 1% of
its elements, and the gradients, sums of rounded score gradients, by at most 5% of
their largest entry with 95% of their entries within 1e-4 of it. Against exact
attention the documented FP8 tolerance is FP8_VS_EXACT (per format) of the largest entry,
and the relative rms error lies within the bounds the FP8 formats give
(fp8_reference.rms_error_bounds: a result without FP8 rounding falls below them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import assert_finite, foldable_fp8_read_backs, make_config, random_array
from fp8_reference import (TENSORS, fp8_attention, fp8_step, rerounded_rms_bound,
                           rms_error_bounds, round_trip, scale_from)
from reference import dropout_keep, reference_attention
from test_fp8_gpu import FP8_RMS

from fusedattn.ops import (AttentionSpec, Fp8State, SequenceDescriptor, explain, fp8,
                           fp8_state_init, fused_attn)

FP8_VS_EXACT = {"e4m3": 0.15, "hybrid": 0.3}  # E5M2 score gradients: 2 mantissa bits


def assert_output_matches(actual, expected, scale_o: float, name="out"):
    actual = np.asarray(actual, np.float64)
    assert_finite(actual, name)
    error = np.abs(actual - expected)
    noise = 1e-5 * max(1.0, np.abs(expected).max())
    flips = error > noise
    assert np.all(error <= fp8_step(expected * scale_o) / scale_o + noise), (
        f"{name}: max error {error.max()} beyond one FP8 step")
    assert flips.mean() <= 0.01, f"{name}: {flips.mean():.3%} of elements differ"


def assert_gradient_matches(actual, expected, name):
    """Also allows one rounding to actual's dtype (bfloat16 gradients)."""
    rounding = float(jnp.finfo(actual.dtype).eps)
    actual = np.asarray(actual, np.float64)
    assert_finite(actual, name)
    top = np.abs(expected).max()
    error = np.abs(actual - expected)
    assert error.max() <= 0.05 * top, f"{name}: max error {error.max()} of {top}"
    close = error <= 1e-4 * top + rounding * np.abs(expected)
    assert np.mean(close) >= 0.95, f"{name}: {1 - np.mean(close):.1%} of elements differ"


def _inputs(rng, b=2, sq=40, skv=40, h=4, h_kv=2, d=32, dtype=jnp.float32):
    return (random_array(rng, (b, sq, h, d), dtype), random_array(rng, (b, skv, h_kv, d), dtype),
            random_array(rng, (b, skv, h_kv, d), dtype))


def _random_state(rng, config, scale=None) -> Fp8State:
    """A state as if after earlier calls: scales spread around the sizes of unit normals
    (or `scale`), and a history that is not empty."""
    state = fp8_state_init(config)
    if scale is None:
        scale = np.asarray([100.0, 120.0, 90.0, 440.0, 200.0, 2000.0, 5000.0, 1500.0, 1500.0,
                            300.0], np.float32)
        scale = scale * rng.uniform(0.7, 1.3, size=scale.shape).astype(np.float32)
    scale = np.broadcast_to(np.asarray(scale, np.float32), (len(TENSORS),))
    history = np.zeros(state.amax_history.shape, np.float32)
    history[1] = 448.0 / scale
    return Fp8State(scale=jnp.asarray(scale), amax_history=jnp.asarray(history))


def _jitted_vjp(config, **kwargs):
    """(state, q, k, v, d_out) -> (out, the forward's new state, (dq, dk, dv, d_state)) of
    one FP8 call, jitted."""
    def run(q, k, v, state):
        return fused_attn((q, k, v), config=config, fp8_state=state, **kwargs)

    @jax.jit
    def forward_backward(state, q, k, v, d_out):
        (out, new_state), pullback = jax.vjp(run, q, k, v, state)
        return out, new_state, pullback((d_out, jax.tree.map(jnp.zeros_like, new_state)))

    return forward_backward


def _vjp(config, state, q, k, v, d_out, **kwargs):
    return _jitted_vjp(config, **kwargs)(state, q, k, v, d_out)


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("mask", ["no_mask", "causal", "padding_causal"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_emulation_matches_the_float64_recipe(rng, fmt, mask, dtype):
    config = make_config(mask=mask, fp8={"enabled": True, "format": fmt})
    q, k, v = _inputs(rng, dtype=dtype)
    padding = mask.startswith("padding")
    sequence = (SequenceDescriptor.from_seqlens(jnp.asarray([40, 23], jnp.int32),
                                                jnp.asarray([40, 31], jnp.int32))
                if padding else None)
    state = _random_state(rng, config)
    d_out = random_array(rng, q.shape, dtype)
    out, new_state, grads = _vjp(config, state, q, k, v, d_out, sequence=sequence)
    scales = dict(zip(TENSORS, np.asarray(state.scale, np.float64)))
    ref = fp8_attention(*(np.asarray(x, np.float64) for x in (q, k, v)), scales=scales, fmt=fmt,
                        causal="causal" in mask, padding=padding,
                        sequence=sequence,
                        dout=np.asarray(d_out, np.float64))
    out = np.asarray(out, np.float64)
    expected = ref.out.astype(dtype).astype(np.float64) if dtype != jnp.float32 else ref.out
    if padding:  # padding query rows: zero in both
        assert np.all(out[1, 23:] == 0)
    assert_output_matches(out, expected, scales["o"])
    for got, want, name in zip(grads[:3], ref.grads, ("dq", "dk", "dv")):
        assert_gradient_matches(got, want, name)
    history = np.asarray(grads[3].amax_history[0], np.float64)
    for column, tensor in enumerate(TENSORS):
        np.testing.assert_allclose(history[column], ref.amax[tensor], rtol=2e-3,
                                   err_msg=f"recorded amax of {tensor}")
    # The forward's returned state records q, k, v, s, o only; the gradient records all.
    np.testing.assert_array_equal(np.asarray(new_state.amax_history[0, 5:]), 0.0)


def test_dropout_uses_the_documented_keep_mask(rng):
    config = make_config(mask="causal", dropout_rate=0.2, fp8={"enabled": True})
    q, k, v = _inputs(rng, b=1, h=2, h_kv=2)
    state = _random_state(rng, config)
    key = jax.random.key(7)
    d_out = random_array(rng, q.shape)
    out, _, grads = _vjp(config, state, q, k, v, d_out, dropout_rng=key, is_training=True)
    keep = dropout_keep(key, 0.2, (1, 2, 40, 40))
    scales = dict(zip(TENSORS, np.asarray(state.scale, np.float64)))
    ref = fp8_attention(*(np.asarray(x, np.float64) for x in (q, k, v)), scales=scales,
                        keep=keep, rate=0.2, dout=np.asarray(d_out, np.float64))
    assert_output_matches(out, ref.out, scales["o"])
    for got, want, name in zip(grads[:3], ref.grads, ("dq", "dk", "dv")):
        assert_gradient_matches(got, want, name)


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_fp8_stays_within_its_tolerance_of_exact_attention(rng, fmt):
    config = make_config(mask="causal", fp8={"enabled": True, "format": fmt,
                                             "scaling": "current"})
    q, k, v = _inputs(rng, sq=64, skv=64, dtype=jnp.bfloat16)
    d_out = random_array(rng, q.shape, jnp.bfloat16)
    out, _, grads = _vjp(config, None, q, k, v, d_out)
    exact = reference_attention((q, k, v), make_config(mask="causal"),
                                dout=np.asarray(d_out, np.float64))
    for got, want, name in ((out, exact.out, "out"), *zip(grads[:3], exact.grads["qkv"],
                                                          ("dq", "dk", "dv"))):
        got = np.asarray(got, np.float64)
        assert_finite(got, name)
        error = np.abs(got - want).max() / np.abs(want).max()
        assert error <= FP8_VS_EXACT[fmt], f"{name}: error {error:.3f} of the largest entry"
        rms = np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2))
        lower, upper = rms_error_bounds(fmt, name)
        assert lower <= rms <= upper, f"{name}: relative rms error {rms:.4f} not in " \
                                      f"[{lower:.4f}, {upper:.4f}] (FP8 rounding lost?)"


def test_rerounded_bound_holds_for_the_last_rounding_and_not_for_a_wrong_gradient(rng):
    """fp8_reference.rerounded_rms_bound, test_fp8_gpu.py's bound for the gradients of FP8
    inputs (cuDNN's against the emulation's), on that test's case: results whose values
    differed by FP8_RMS (the bound without the last rounding) before that rounding stay
    within it; a conversion that forgets the scale, divides by it twice, is off by a
    factor 2 or takes a neighbouring token's gradient exceeds it."""
    config = make_config(mask="no_mask", fp8={"enabled": True})
    q, k, v = _inputs(rng, sq=256, skv=256, h=4, h_kv=4, d=128, dtype=jnp.bfloat16)
    d_out = random_array(rng, q.shape, jnp.bfloat16)
    state = _vjp(config, fp8_state_init(config), *(x * 1.5 for x in (q, k, v)), d_out)[2][3]
    as_fp8 = [fp8.quantise(x, jnp.float8_e4m3fn, state.scale[i]) for i, x in enumerate((q, k, v))]
    given = _vjp(config, state, *as_fp8, d_out)[2]
    unrounded = _vjp(config, state, *(x.astype(jnp.float32) for x in (q, k, v, d_out)))[2]
    for i, name in enumerate(("dq8", "dk8", "dv8")):
        scale = float(state.scale[i])
        before = np.asarray(unrounded[i], np.float64) / scale    # dL/dx8 before its rounding
        expected = np.asarray(given[i].astype(jnp.float32), np.float64)
        np.testing.assert_array_equal(expected, round_trip(before, ml_dtypes.float8_e4m3fn, 1.0))
        bound = rerounded_rms_bound(expected, FP8_RMS["e4m3"])

        def error(values):
            rounded = round_trip(values, ml_dtypes.float8_e4m3fn, 1.0)
            return np.sqrt(np.mean((rounded - expected) ** 2) / np.mean(expected**2))

        noise = rng.normal(size=before.shape) * FP8_RMS["e4m3"] * np.sqrt(np.mean(before**2))
        assert error(before + noise) <= bound, f"{name}: {error(before + noise)} > {bound}"
        for bug, values in (("scale not divided", before * scale),
                            ("divided twice", before / scale), ("a factor 2", before * 2),
                            ("the next token's", np.roll(before, 1, axis=1))):
            assert error(values) > 2 * bound, f"{name}, {bug}: {error(values)} <= 2 * {bound}"


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_gpu_compiler_cannot_fold_the_fp8_rounding_away(fmt):
    """Lowered for CUDA, the emulation reads every quantised value back through an
    optimization barrier: XLA's GPU compiler would fold a bare f32 -> FP8 -> f32 convert
    chain into the identity (on an H200 the emulation's output was then unquantised
    attention, 0.0003 rms from exact, where FP8 and cuDNN are 0.011)."""
    config = make_config(mask="causal", fp8={"enabled": True, "format": fmt})
    q = jax.ShapeDtypeStruct((2, 64, 4, 32), jnp.bfloat16)

    def step(q, k, v, d_out, state):
        (out, _), pullback = jax.vjp(
            lambda q, k, v, s: fused_attn((q, k, v), config=config, fp8_state=s), q, k, v, state)
        return out, pullback((d_out, state))

    lowered = jax.jit(step).trace(q, q, q, q, fp8_state_init(config)).lower(
        lowering_platforms=("cuda",))
    text = lowered.as_text(dialect="hlo")
    assert foldable_fp8_read_backs(text) == []
    assert text.count(" opt-barrier(") >= 11   # q, k, v, s, o; P, do, dp, dq, dk, dv


def test_delayed_scaling_follows_the_amax_history(rng):
    config = make_config(mask="no_mask", fp8={"enabled": True, "amax_history_len": 3,
                                              "margin": 1})
    state = fp8_state_init(config)
    step = _jitted_vjp(config)
    amaxes = []
    for size in (1.0, 4.0, 0.5, 0.25):
        q, k, v = (x * size for x in _inputs(rng, b=1, sq=16, skv=16, h=2, h_kv=2))
        d_out = random_array(rng, q.shape, scale=size)
        used = np.asarray(state.scale)
        state = step(state, q, k, v, d_out)[2][3]
        amaxes.append(float(jnp.max(jnp.abs(q))))
        history = np.asarray(state.amax_history[:, 0])
        expected = (amaxes[::-1] + [0.0] * 3)[:3]
        np.testing.assert_allclose(history, expected, rtol=1e-6)
        assert float(state.scale[0]) == pytest.approx(
            scale_from(max(expected), ml_dtypes.float8_e4m3fn, 1, used[0]), rel=1e-6)
        assert np.all(np.asarray(state.amax_history[0]) > 0)  # every tensor recorded


def test_current_scaling_uses_this_calls_amax(rng):
    config = make_config(mask="causal", fp8={"enabled": True, "scaling": "current"})
    q, k, v = _inputs(rng)
    stale = _random_state(rng, config, scale=1e-3)
    run = jax.jit(lambda q, k, v, state, config: fused_attn((q, k, v), config=config,
                                                            fp8_state=state)[0],
                  static_argnums=4)
    out_fresh = run(q, k, v, None, AttentionSpec.from_config(config))
    out_stale = run(q, k, v, stale, AttentionSpec.from_config(config))
    np.testing.assert_array_equal(np.asarray(out_fresh), np.asarray(out_stale))
    delayed = make_config(mask="causal", fp8={"enabled": True})
    out_delayed = run(q, k, v, stale, AttentionSpec.from_config(delayed))
    assert np.abs(np.asarray(out_delayed) - np.asarray(out_fresh)).max() > 0.1


def test_first_delayed_call_scales_only_what_xla_quantises_from_its_own_amax(rng):
    """A fresh state (the first call) under delayed scaling: q, k, v and do, which XLA
    quantises after computing their amaxes, and s (amax 1) are scaled from this call's
    amaxes; o, dp, dq, dk and dv, which the fused kernel writes, with the state's unit
    scales (fp8.KERNEL_WRITTEN: no probe pass learns their amaxes first). The state's
    gradient records every amax, so the next call scales all ten from the history."""
    config = make_config(mask="causal", fp8={"enabled": True})
    q, k, v = _inputs(rng)
    d_out = random_array(rng, q.shape)
    out, _, grads = _vjp(config, fp8_state_init(config), q, k, v, d_out)
    e4m3 = ml_dtypes.float8_e4m3fn
    scales = {name: 1.0 for name in ("o", "dp", "dq", "dk", "dv")}
    scales.update({name: scale_from(float(np.abs(x).max()), e4m3, 0, 1.0)
                   for name, x in (("q", q), ("k", k), ("v", v), ("do", d_out))})
    scales["s"] = scale_from(1.0, e4m3, 0, 1.0)
    ref = fp8_attention(*(np.asarray(x, np.float64) for x in (q, k, v)), scales=scales,
                        dout=np.asarray(d_out, np.float64))
    assert_output_matches(out, ref.out, scales["o"])
    for got, want, name in zip(grads[:3], ref.grads, ("dq", "dk", "dv")):
        assert_gradient_matches(got, want, name)
    recorded = grads[3]
    for column, tensor in enumerate(TENSORS):
        assert float(recorded.scale[column]) == pytest.approx(
            448.0 / ref.amax[tensor], rel=2e-3), f"next call's scale of {tensor}"


@pytest.mark.skipif(jax.devices()[0].platform == "gpu", reason="cudnn serves FP8 on a GPU")
def test_fp8_backends_and_explain_says_why(rng):
    """xla and cudnn have FP8 paths (cudnn's refuses here, on a machine without CUDA, with
    its reason; its own reasons: tests/test_cudnn_fp8.py); the others say they have none."""
    config = make_config(fp8={"enabled": True})
    q, k, v = _inputs(rng)
    explanation = explain((q, k, v), config=config, platform="cuda")
    assert explanation.backend == "xla"
    assert explanation.verdicts["cudnn"] == "cudnn: jax has no CUDA backend in this process"
    for name in ("flash", "small_seq"):
        assert "no FP8 path" in explanation.verdicts[name]
    config.backend = "flash"
    with pytest.raises(ValueError, match="no FP8 path"):
        fused_attn((q, k, v), config=config, fp8_state=fp8_state_init(config))
    config.backend, config.bias = "auto", "post_scale_bias"
    with pytest.raises(ValueError, match="takes no bias"):
        explain((q, k, v), config=config, bias=jnp.zeros((1, 4, 40, 40)))


@pytest.mark.parametrize("overrides, argument, message", [
    ({}, "state", "fp8_state: config.fp8.enabled is False"),
    ({"fp8": {"enabled": True}}, None, "scaling 'delayed'"),
    ({"fp8": {"enabled": True}, "bias": "post_scale_bias"}, "state", "takes no bias"),
    ({"fp8": {"enabled": True}, "softmax": "off_by_one"}, "state", "vanilla softmax"),
    ({"fp8": {"enabled": True, "amax_history_len": 4}}, "short", "amax_history"),
])
def test_fp8_mistakes_raise_with_the_argument_named(rng, overrides, argument, message):
    config = make_config(**overrides)
    q, k, v = _inputs(rng, b=1, sq=8, skv=8)
    good = fp8_state_init(make_config(fp8={"enabled": True}))
    state = {"state": good, None: None,
             "short": good._replace(amax_history=good.amax_history[:2])}[argument]
    bias = jnp.zeros((1, 4, 8, 8)) if config.bias != "no_bias" else None
    with pytest.raises(ValueError, match=message):
        fused_attn((q, k, v), config=config, fp8_state=state, bias=bias)


@pytest.mark.parametrize("key, value", [("format", "e5m2"), ("scaling", "just_in_time"),
                                        ("amax_history_len", 0), ("margin", -1)])
def test_bad_fp8_config_values_raise(rng, key, value):
    config = make_config(fp8={"enabled": True, key: value})
    q, k, v = _inputs(rng, b=1, sq=8, skv=8)
    with pytest.raises(ValueError, match=f"config.fp8.{key}"):
        fused_attn((q, k, v), config=config)


def test_inputs_given_in_fp8_are_read_with_the_states_scales(rng):
    """q, k, v already in float8_e4m3fn (stored with the state's scales) give the output of
    the same values given in bfloat16, in bfloat16; their gradients are dL/dx / scale in
    E4M3 (within one E4M3 step of the bfloat16 path's, which rounds to bfloat16 first)."""
    config = make_config(mask="causal", fp8={"enabled": True})
    q, k, v = _inputs(rng, dtype=jnp.bfloat16)
    state = _random_state(rng, config)
    as_fp8 = [(x.astype(jnp.float32) * state.scale[i]).astype(jnp.float8_e4m3fn)
              for i, x in enumerate((q, k, v))]
    d_out = random_array(rng, q.shape, jnp.bfloat16)
    out, _, grads = _vjp(config, state, *as_fp8, d_out)
    out_ref, _, grads_ref = _vjp(config, state, q, k, v, d_out)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out_ref, np.float32))
    for i, (got, want) in enumerate(zip(grads[:3], grads_ref[:3])):
        assert got.dtype == jnp.float8_e4m3fn
        expected = np.clip(np.asarray(want, np.float64) / float(state.scale[i]), -448, 448)
        error = np.abs(np.asarray(got.astype(jnp.float32), np.float64) - expected)
        assert np.all(error <= fp8_step(expected)), f"d{'qkv'[i]}: {error.max()}"
    with pytest.raises(TypeError, match="float8_e4m3fn with config.fp8.enabled"):
        fused_attn(tuple(as_fp8), config=make_config(mask="causal"))
