"""FP8 attention's scaling recipe: formats, the per-tensor state, quantisation.

An FP8 attention call (config.fp8.enabled) holds ten tensors in FP8 (TENSORS): the
inputs q, k, v; s, the softmax numerators exp(S - rowmax) in the forward (normalised
after the P.V product, as cuDNN's FP8 kernels do; amax 1) and the weights P in the
backward, with the same scale; o, the output; do, the output's gradient;
dp, the score gradient dS = P * (dP - delta) that feeds the dQ and dK matmuls; and the
gradients dq, dk, dv (cuDNN's FP8 backward on Hopper writes them in FP8, as
TransformerEngine's META_DQKV scales them). Each has a scale: it is stored as
x8 = saturate(x * scale) in its format and read back as x8 / scale. Formats: every
tensor E4M3 ("e4m3"), or E5M2 for do and dp ("hybrid"; dq, dk, dv stay E4M3).

Fp8State, a pytree (fp8_state_init(config) makes the first one):
  scale         float32 [10]     each tensor's scale for the next call (TENSORS order)
  amax_history  float32 [L, 10]  the amax (max |x|) of the last L calls, newest in row 0

A call records its amaxes: each tensor's column of the history rolls down by one with
the new amax on top, and its scale becomes fp8_max / max(column) / 2**margin (kept as it
was while that max is 0 or not finite). "delayed" scaling quantises with the state's
scales (set by earlier calls); "current" quantises with the same formula over this
call's own amax, and records it the same way. Under "delayed" scaling a tensor with
nothing recorded yet (its history all zero: the first call) is scaled from its own amax
where the call computes that amax before quantising anyway (q, k, v and do, quantised
in XLA); the tensors a fused kernel writes (KERNEL_WRITTEN: o, dp, dq, dk, dv) take the
state's scale even then (fp8_state_init's 1, as TransformerEngine's DelayedScaling
starts), since learning their amax before the kernel runs would take a second kernel
pass on every call (an XLA conditional to skip it costs a host round trip on the GPU).
The kernel's own amaxes of those tensors are recorded, so from the second call on their
scales follow the history; on the first, gradients below E4M3's 2^-9 at unit scale
flush to zero, and a training step that never feeds the state's gradient back leaves
dp, dq, dk and dv at unit scales for good.

Inputs already in FP8 (q, k, v float8_e4m3fn, e.g. from an FP8 projection) are read with
the state's q/k/v scales, the ones they were stored with; the output is then bfloat16,
and their gradients are dL/dx8 = dL/dx / scale rounded to float8_e4m3fn (lossy:
differentiate the unquantised values instead where a gradient matters).

The forward knows the amaxes of q, k, v, s and o: fused_attn returns the state with those
recorded. do, dp, dq, dk and dv are known only in the backward pass, so the gradient of the loss
with respect to fp8_state is the whole new state (Flax's "overwrite with gradient"
convention, flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT): a training step replaces the
state with its gradient, which the layers arrange.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fusedattn.ops.enums import BiasType, Fp8Format, Fp8Scaling, SoftmaxType
from fusedattn.ops.spec import AttentionSpec

TENSORS = ("q", "k", "v", "s", "o", "do", "dp", "dq", "dk", "dv")
# Written by the fused kernel, which takes their scales as inputs (module docstring).
KERNEL_WRITTEN = ("o", "dp", "dq", "dk", "dv")
_HYBRID_E5M2 = ("do", "dp")


class Fp8State(NamedTuple):
    """Per-tensor FP8 scales and amax histories (module docstring).

    scale: float32 [10]; amax_history: float32 [amax_history_len, 10]; columns in TENSORS order.
    """

    scale: jax.Array
    amax_history: jax.Array


def fp8_state_init(config) -> Fp8State:
    """The first FP8 state for `config` (a ConfigDict or AttentionSpec): unit scales and an
    empty (zero) amax history of config.fp8.amax_history_len rows."""
    spec = AttentionSpec.from_config(config)
    return Fp8State(scale=jnp.ones((len(TENSORS),), jnp.float32),
                    amax_history=jnp.zeros((spec.fp8_amax_history_len, len(TENSORS)),
                                           jnp.float32))


def dtype_of(spec: AttentionSpec, tensor: str):
    """The FP8 dtype that `tensor` (one of TENSORS) is stored in."""
    if spec.fp8_format == Fp8Format.HYBRID and tensor in _HYBRID_E5M2:
        return jnp.float8_e5m2
    return jnp.float8_e4m3fn


def fp8_max(dtype) -> float:
    """The largest finite value of FP8 `dtype`."""
    return float(jnp.finfo(dtype).max)


def quantise(x: jax.Array, dtype, scale: jax.Array) -> jax.Array:
    """x stored in FP8 `dtype` with `scale`: saturate(x * scale), same shape as x."""
    top = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) * scale, -top, top).astype(dtype)


def dequantise(x8: jax.Array, scale: jax.Array) -> jax.Array:
    """FP8 x8 read back with `scale`: x8 / scale in float32, same shape.

    The optimization barrier keeps the FP8 rounding: XLA's GPU compiler folds a chain of
    float conversions f32 -> FP8 -> f32 into the identity (its SimplifyFPConversions pass,
    on under xla_allow_excess_precision, the default), which silently turned the emulation
    into unquantised float32 attention on the GPU.
    """
    return jax.lax.optimization_barrier(x8).astype(jnp.float32) / scale


def round_trip(x: jax.Array, dtype, scale: jax.Array) -> jax.Array:
    """x stored in FP8 `dtype` with `scale` and read back: float32, same shape as x."""
    return dequantise(quantise(x, dtype, scale), scale)


def given_in_fp8(x) -> bool:
    """Whether an input comes already in FP8 (float8_e4m3fn: read with the state's scale)."""
    return jnp.dtype(x.dtype) == jnp.dtype(jnp.float8_e4m3fn)


def quantise_input(spec: AttentionSpec, state: Fp8State, tensor: str,
                   x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(x8 in the tensor's FP8 dtype, amax of the value x8 stands for, its scale) of input
    `tensor` (q, k or v): quantised with this call's scale, or, given in FP8, as it is with
    the state's scale."""
    if given_in_fp8(x):
        # max |x8 / scale| = max |x8| / scale exactly (rounding is monotonic): one pass over
        # the FP8 bytes (bfloat16 holds every E4M3 value), not a float32 copy of x.
        scale = state.scale[TENSORS.index(tensor)]
        return x, amax(x.astype(jnp.bfloat16)) / scale, scale
    value = amax(x)
    scale = call_scale(spec, state, tensor, value)
    return quantise(x, dtype_of(spec, tensor), scale), value, scale


def input_cotangent(gradient: jax.Array, dtype, scale: jax.Array) -> jax.Array:
    """The gradient with respect to an input of `dtype` from the one with respect to the
    value it stands for (an FP8 input x8 = x * scale: dL/dx8 = dL/dx / scale, rounded to
    its format)."""
    if jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn):
        return quantise(gradient / scale, dtype, jnp.float32(1.0))
    return gradient.astype(dtype)


def amax(x: jax.Array) -> jax.Array:
    """max |x| as a float32 scalar."""
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _scale_from(top, amax_value: jax.Array, fallback: jax.Array) -> jax.Array:
    """top / amax (elementwise), or `fallback` where amax is 0 or not finite."""
    usable = jnp.isfinite(amax_value) & (amax_value > 0)
    return jnp.where(usable, top / jnp.where(usable, amax_value, 1.0), fallback)


def _top(spec: AttentionSpec, tensor: str) -> float:
    """fp8_max / 2**margin of `tensor`'s format: its scale times its amax."""
    return fp8_max(dtype_of(spec, tensor)) / 2.0 ** spec.fp8_margin


def _scale_for(spec: AttentionSpec, tensor: str, amax_value: jax.Array,
               fallback: jax.Array) -> jax.Array:
    """fp8_max / amax / 2**margin, or `fallback` where amax is 0 or not finite."""
    return _scale_from(_top(spec, tensor), amax_value, fallback)


def has_history(state: Fp8State, tensor: str) -> jax.Array:
    """Whether `tensor` has an amax recorded (bool scalar): delayed scaling reads its scale.
    (One reduction over the whole history, the same for every tensor: XLA computes it once.)"""
    return (jnp.max(state.amax_history, axis=0) > 0)[TENSORS.index(tensor)]


def call_scale(spec: AttentionSpec, state: Fp8State, tensor: str,
               amax_value: jax.Array | None) -> jax.Array:
    """The scale `tensor` is quantised with in this call (float32 scalar): from this call's
    `amax_value` under current scaling; under delayed scaling the state's, or, for a tensor
    outside KERNEL_WRITTEN with an empty history, from `amax_value` (module docstring).
    `amax_value` may be None for a KERNEL_WRITTEN tensor under delayed scaling."""
    stored = state.scale[TENSORS.index(tensor)]
    if spec.fp8_scaling == Fp8Scaling.DELAYED and tensor in KERNEL_WRITTEN:
        return stored
    current = _scale_for(spec, tensor, amax_value, stored)
    if spec.fp8_scaling == Fp8Scaling.CURRENT:
        return current
    return jnp.where(has_history(state, tensor), stored, current)


def record(spec: AttentionSpec, state: Fp8State, amaxes: dict[str, jax.Array]) -> Fp8State:
    """The state after a call that saw `amaxes` (tensor name -> float32 scalar): the columns
    of those tensors rolled and rescaled, the others as they were. Whole-array selects, one
    small fusion (a scatter per column cost a kernel each, in series)."""
    recorded = jnp.asarray([tensor in amaxes for tensor in TENSORS])
    # Each amax's reduction stays a fusion of its own: with FP8 inputs, whose amaxes nothing
    # else reads, XLA fused their reductions into this row's concatenate, one kernel of
    # 0.026-0.036 ms per call at (1, 8192, 16, 128) on the H200 (0.002 ms where they stay
    # apart: benchmarks/results/fp8_timeline.json).
    amaxes = jax.lax.optimization_barrier(amaxes)
    row = jnp.stack([jnp.asarray(amaxes.get(tensor, 0.0), jnp.float32) for tensor in TENSORS])
    rolled = jnp.concatenate([row[None], state.amax_history[:-1]])
    history = jnp.where(recorded[None, :], rolled, state.amax_history)
    tops = jnp.asarray([_top(spec, tensor) for tensor in TENSORS], jnp.float32)
    rescaled = _scale_from(tops, jnp.max(history, axis=0), state.scale)
    return Fp8State(scale=jnp.where(recorded, rescaled, state.scale), amax_history=history)


def check_config(spec: AttentionSpec, dtype) -> None:
    """What an FP8 call may be (no bias, vanilla softmax, contiguous layouts, no context
    parallelism, bfloat16/float16/float32 or float8_e4m3fn inputs); ValueError/TypeError
    otherwise."""
    if spec.bias != BiasType.NO_BIAS or spec.softmax != SoftmaxType.VANILLA:
        raise ValueError(
            f"config.fp8.enabled: FP8 attention takes no bias and the vanilla softmax (as "
            f"cuDNN's FP8 graphs), got config.bias {str(spec.bias)!r} and config.softmax "
            f"{str(spec.softmax)!r}; set config.fp8.enabled = False for these.")
    if spec.qkv_layout.is_paged or spec.context_axis is not None:
        raise ValueError(
            "config.fp8.enabled: FP8 attention serves the contiguous layouts without context "
            "parallelism; set config.fp8.enabled = False for paged KV caches and "
            "config.context_parallel.axis.")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                                jnp.dtype(jnp.float32), jnp.dtype(jnp.float8_e4m3fn)):
        raise TypeError(f"qkv: FP8 attention quantises bfloat16, float16 or float32 inputs, or "
                        f"reads float8_e4m3fn ones, got {jnp.dtype(dtype)}.")


def check_call(spec: AttentionSpec, state, dtype) -> Fp8State:
    """Validates an FP8 call's config, input dtype and state; returns the state to use.

    Raises ValueError/TypeError naming the argument or key and what to do.
    """
    check_config(spec, dtype)
    if state is None:
        if spec.fp8_scaling == Fp8Scaling.DELAYED:
            raise ValueError(
                "fp8_state: config.fp8.scaling 'delayed' takes its scales from the amax history "
                "of earlier calls; pass fp8_state=fusedattn.ops.fp8_state_init(config) first and "
                "then the state each call returns, or set config.fp8.scaling = 'current'.")
        return fp8_state_init(spec)
    if not isinstance(state, Fp8State):
        raise TypeError(f"fp8_state: expected a fusedattn.ops.Fp8State (from "
                        f"fusedattn.ops.fp8_state_init(config)), got {type(state).__name__}.")
    expected = {"scale": (len(TENSORS),),
                "amax_history": (spec.fp8_amax_history_len, len(TENSORS))}
    for field, shape in expected.items():
        array = getattr(state, field)
        if tuple(array.shape) != shape or jnp.dtype(array.dtype) != jnp.dtype(jnp.float32):
            raise ValueError(
                f"fp8_state.{field}: expected float32 {list(shape)} (config.fp8.amax_history_len "
                f"= {spec.fp8_amax_history_len}), got {jnp.dtype(array.dtype)} "
                f"{list(array.shape)}; make it with fusedattn.ops.fp8_state_init(config).")
    return state
