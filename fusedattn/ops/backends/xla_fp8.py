"""FP8 attention emulated in plain jax.numpy: the oracle of the FP8 recipe (ops/fp8.py).

Every FP8 operand is rounded through its FP8 format with its scale and read back in
float32; the matmuls and the softmax then run in float32, as a kernel that multiplies
FP8 operands and accumulates in float32 would. The steps, per call:

  forward   q8, k8, v8 = fp8(q), fp8(k), fp8(v)
            S = scale * q8 k8^T (masked); E = exp(S - rowmax(S)) (then dropout), the
            softmax numerators in (0, 1]; E8 = fp8(E) with s's scale; l = rowsum(E)
            O = (E8 v8) / l, O8 = fp8(O); the output is O8 in q's dtype
  backward  P = E / l; P8 = fp8(P) with s's scale; dO8 = fp8(dO); dV = P8^T dO8;
            dP = dO8 v8^T (dropout's mask and 1/(1-rate))
            dS = P * (dP - rowsum(dO8 * O8)), dS8 = fp8(dS)
            dQ8 = fp8(scale * dS8 k8); dK8 = fp8(scale * dS8^T q8); dV8 = fp8(dV)

The forward stores the numerators, not P, in FP8, as cuDNN's FP8 flash kernels do (they
normalise after the P.V product; their numerators are relative to a running row max,
which the emulation takes as the row's final max), so s's amax is 1 (1 / (1 - rate)
with dropout) and its scale fp8_max / 2**margin; the backward, as cuDNN's, stores the
normalised P with the same scale.

Quantisation is the identity for the gradient (straight through): dQ8, dK8 and dV8 are
the gradients with respect to q, k and v, in their dtype (as cuDNN's FP8 backward on
Hopper writes them in FP8).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fusedattn.ops import fp8, philox
from fusedattn.ops.backends import xla
from fusedattn.ops.backends.base import CanonicalArgs, TokenInfo
from fusedattn.ops.spec import AttentionSpec

_HIGHEST = jax.lax.Precision.HIGHEST


def attention(spec: AttentionSpec, args: CanonicalArgs, scale: float,
              state: fp8.Fp8State) -> tuple[jax.Array, fp8.Fp8State, jax.Array]:
    """(out [b, sq, h, dv] in q's dtype (bfloat16 for FP8 inputs), the state with the
    forward's amaxes recorded, max_logit float32 [h]: each head's largest visible logit
    of the FP8 scores).

    The gradient with respect to `state` is the state with every amax recorded (module
    docstring of ops/fp8.py).
    """
    dtypes = tuple(jnp.dtype(x.dtype) for x in (args.q, args.k, args.v))
    return _attention((spec, scale, dtypes), args.q, args.k, args.v, args.tokens,
                      args.dropout_seed, state)


def _quantised_inputs(spec: AttentionSpec, state: fp8.Fp8State, tokens: TokenInfo, q, k, v):
    """q, k, v with padding tokens zeroed, rounded through FP8 (or, given in FP8, read with
    the state's scales) as float32; their amaxes; and the scales they were read with."""
    q = jnp.where((tokens.q_seg != 0)[:, :, None, None], q, 0)
    real_key = (tokens.kv_seg != 0)[:, :, None, None]
    k, v = jnp.where(real_key, k, 0), jnp.where(real_key, v, 0)
    rounded, amaxes, scales = [], {}, []
    for name, x in (("q", q), ("k", k), ("v", v)):
        x8, amaxes[name], scale = fp8.quantise_input(spec, state, name, x)
        rounded.append(fp8.dequantise(x8, scale))
        scales.append(scale)
    return tuple(rounded), amaxes, tuple(scales)


def _forward(static, q, k, v, tokens, seed, state):
    spec, scale, _ = static
    (q8, k8, v8), amaxes, input_scales = _quantised_inputs(spec, state, tokens, q, k, v)
    args = CanonicalArgs(q=q8, k=k8, v=v8, tokens=tokens)
    scores, visible = xla.scores_and_visible(spec, args, scale)
    row_max = jnp.max(jnp.where(visible, scores, -jnp.inf), axis=-1, keepdims=True,
                      initial=-jnp.inf)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    numerators = jnp.where(visible, jnp.exp(jnp.where(visible, scores - row_max, 0.0)), 0.0)
    denominator = jnp.sum(numerators, axis=-1, keepdims=True)                # [b, h, sq, 1]
    denominator = jnp.where(denominator > 0, denominator, 1.0)
    weights = numerators / denominator
    keep = (None if seed is None else
            philox.dropout_keep_mask(seed, spec.dropout_rate, weights.shape))
    dropped = xla._dropped(spec, numerators, keep)
    amaxes["s"] = fp8.amax(dropped)
    scale_s = fp8.call_scale(spec, state, "s", amaxes["s"])
    e8 = fp8.round_trip(dropped, fp8.dtype_of(spec, "s"), scale_s)
    out = xla._weighted_values(e8, v8, jnp.float32) / denominator.transpose(0, 2, 1, 3)
    amaxes["o"] = fp8.amax(out)
    o8 = fp8.round_trip(out, fp8.dtype_of(spec, "o"), fp8.call_scale(spec, state, "o", amaxes["o"]))
    max_logit = jnp.max(jnp.where(visible, scores, -jnp.inf), axis=(0, 2, 3))
    new_state = fp8.record(spec, state, amaxes)
    residuals = (q8, k8, v8, weights, keep, scale_s, o8, state, new_state, input_scales)
    out_dtype = jnp.bfloat16 if fp8.given_in_fp8(q) else q.dtype
    return (o8.astype(out_dtype), new_state, max_logit), residuals


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, k, v, tokens, seed, state):
    return _forward(static, q, k, v, tokens, seed, state)[0]


def _backward(static, residuals, cotangents):
    spec, scale, (q_dtype, k_dtype, v_dtype) = static
    q8, k8, v8, weights, keep, scale_s, o8, state, new_state, input_scales = residuals
    p8 = fp8.round_trip(xla._dropped(spec, weights, keep), fp8.dtype_of(spec, "s"), scale_s)
    d_out = cotangents[0].astype(jnp.float32)
    amaxes = {"do": fp8.amax(d_out)}
    do8 = fp8.round_trip(d_out, fp8.dtype_of(spec, "do"),
                         fp8.call_scale(spec, state, "do", amaxes["do"]))
    d_weights = xla._dropped(spec, xla._scores(do8, v8), keep)          # [b, h, sq, skv]
    delta = jnp.sum(do8 * o8, axis=-1).transpose(0, 2, 1)[..., None]    # [b, h, sq, 1]
    d_scores = weights * (d_weights - delta)
    amaxes["dp"] = fp8.amax(d_scores)
    ds8 = fp8.round_trip(d_scores, fp8.dtype_of(spec, "dp"),
                         fp8.call_scale(spec, state, "dp", amaxes["dp"]))
    grads = {"dq": scale * xla._weighted_values(ds8, k8, jnp.float32),
             "dk": scale * _transposed_product(ds8, q8, k8.shape[2]),
             "dv": _transposed_product(p8, do8, v8.shape[2])}
    for name, gradient in grads.items():
        amaxes[name] = fp8.amax(gradient)
        grads[name] = fp8.round_trip(gradient, fp8.dtype_of(spec, name),
                                     fp8.call_scale(spec, state, name, amaxes[name]))
    grads = tuple(fp8.input_cotangent(g, dtype, s) for g, dtype, s in
                  zip(grads.values(), (q_dtype, k_dtype, v_dtype), input_scales))
    return (*grads, None, None, fp8.record(spec, new_state, amaxes))


def _transposed_product(weights: jax.Array, x: jax.Array, num_kv_heads: int) -> jax.Array:
    """weights [b, h, sq, skv]^T . x [b, sq, h, d] -> float32 [b, skv, h_kv, d], summed over
    each K/V head's group of query heads."""
    b, h, sq, skv = weights.shape
    group = h // num_kv_heads
    return jnp.einsum("bkgqs,bqkgd->bskd", weights.reshape(b, num_kv_heads, group, sq, skv),
                      x.reshape(b, sq, num_kv_heads, group, x.shape[-1]), precision=_HIGHEST)


_attention.defvjp(_forward, _backward)
