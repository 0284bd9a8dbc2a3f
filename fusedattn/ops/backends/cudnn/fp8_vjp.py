"""The cuDNN backend's FP8 op: the recipe of fusedattn/ops/fp8.py around cuDNN's FP8 SDPA
graphs (fp8_calls.py), a jax.custom_vjp whose steps are those of the xla emulation
(ops/backends/xla_fp8.py), which is its oracle:

  forward   q8, k8, v8 = fp8(q), fp8(k), fp8(v) (fp8.quantise_input); cuDNN: S = scale *
            q8 k8^T, the softmax numerators exp(S - row max) in FP8 with scale_s, O8 =
            fp8(E8 v8 / rowsum) with scale_o, amax_o = max |O|; out = O8 / scale_o
  backward  dO8 = fp8(dO); cuDNN: P = softmax(S) from the stats, dV8 = fp8(fp8(P)^T dO8),
            dS8 = fp8(P * (dO8 v8^T - rowsum(dO8 * O8))), dQ8 = fp8(scale * dS8 k8),
            dK8 = fp8(scale * dS8^T q8), with their amaxes; the gradients are dQ8 /
            scale_dq, ... in the inputs' dtypes

s's amax is the recipe's, 1 (the numerators' largest, at each row's max): cuDNN's
amax_s output is not read. (cuDNN's numerators are relative to a running row max over
key blocks, the emulation's to the final one: the same values up to FP8 rounding.)

cuDNN takes every scale as an input, so it must know a scale before the pass that uses it.
Under current scaling the recipe scales o, dp, dq, dk and dv by this call's own amaxes,
so probe passes measure them first: amax_o depends on scale_s (known), amax_dp (cuDNN's
dS) on none of the backward's scales, and the gradients' amaxes on scale_dp: the forward
runs twice (the probe without stats), the backward three times. Under delayed scaling
these tensors take the state's scales (ops/fp8.py, KERNEL_WRITTEN), so each direction is
one cuDNN call whose amax outputs are recorded for the next call's scales: no probe and
no branch (an XLA conditional costs a host round trip on the GPU, about 0.1 ms).

cuDNN's dS carries the attention scale (cudnn_fp8.cc): its scale_dp is the recipe's
divided by the attention scale (the same dS8 values), its amax_dp the recipe's times it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fusedattn.ops import fp8
from fusedattn.ops.backends.cudnn import fp8_calls
from fusedattn.ops.backends.cudnn.graph_key import FP8_E4M3, FP8_HYBRID, _Static
from fusedattn.ops.enums import Fp8Format, Fp8Scaling
from fusedattn.ops.spec import AttentionSpec

_ONE = 1.0


class _Fp8Static(NamedTuple):
    """The static part of an FP8 call (hashable: the custom_vjp's nondiff argument)."""

    call: _Static   # the FFI attributes
    spec: AttentionSpec
    dtypes: tuple   # of q, k, v (their gradients' dtypes)


def attention(spec: AttentionSpec, call: _Static, q, k, v,
              state: fp8.Fp8State) -> tuple[jax.Array, fp8.Fp8State]:
    """(out [b, sq, h, dv] in q's dtype (bfloat16 for FP8 inputs), the state with the
    forward's amaxes recorded) of dense q [b, sq, h, d], k, v [b, skv, h_kv, d]. The gradient
    with respect to `state` is the state with every amax recorded (ops/fp8.py)."""
    dtypes = tuple(jnp.dtype(x.dtype) for x in (q, k, v))
    return _fp8_cudnn(_Fp8Static(call, spec, dtypes), q, k, v, state)


def _scales(spec: AttentionSpec, state: fp8.Fp8State, tensors: tuple[str, ...], probe):
    """The scales of `tensors` (of fp8.KERNEL_WRITTEN) in this call: under current scaling
    from the amaxes probe() (a tuple of float32 scalars, one per tensor) measures, under
    delayed scaling the state's (no probe)."""
    if spec.fp8_scaling == Fp8Scaling.DELAYED:
        return tuple(fp8.call_scale(spec, state, tensor, None) for tensor in tensors)
    return tuple(fp8.call_scale(spec, state, tensor, amax)
                 for tensor, amax in zip(tensors, probe()))


def _forward(static: _Fp8Static, q, k, v, state: fp8.Fp8State, training: bool):
    spec, call = static.spec, static.call
    quantised = {name: fp8.quantise_input(spec, state, name, x)
                 for name, x in (("q", q), ("k", k), ("v", v))}
    (q8, _, scale_q), (k8, _, scale_k), (v8, _, scale_v) = quantised.values()
    amaxes = {name: amax for name, (_, amax, _) in quantised.items()}

    def run(scale_s, scale_o, with_stats=False):
        return fp8_calls.forward(call, q8, k8, v8, 1.0 / scale_q, 1.0 / scale_k, 1.0 / scale_v,
                                 scale_s, scale_o, with_stats)

    amaxes["s"] = jnp.ones((), jnp.float32)
    scale_s = fp8.call_scale(spec, state, "s", amaxes["s"])
    (scale_o,) = _scales(spec, state, ("o",), lambda: (run(scale_s, _ONE)[3],))
    o8, stats, _, amaxes["o"] = run(scale_s, scale_o, training)
    new_state = fp8.record(spec, state, amaxes)
    out_dtype = jnp.bfloat16 if fp8.given_in_fp8(q) else q.dtype
    out = (o8.astype(jnp.float32) / scale_o).astype(out_dtype)
    scales = {"q": scale_q, "k": scale_k, "v": scale_v, "s": scale_s, "o": scale_o}
    return (out, new_state), (q8, k8, v8, o8, stats, scales, state, new_state)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_cudnn(static: _Fp8Static, q, k, v, state):
    """The primal, run when nobody differentiates the call: the forward without stats."""
    return _forward(static, q, k, v, state, training=False)[0]


def _fp8_cudnn_fwd(static: _Fp8Static, q, k, v, state):
    return _forward(static, q, k, v, state, training=True)


def _fp8_cudnn_bwd(static: _Fp8Static, residuals, cotangents):
    spec, call = static.spec, static.call
    q8, k8, v8, o8, stats, scales, state, new_state = residuals
    d_out = cotangents[0]
    amaxes = {"do": fp8.amax(d_out)}
    scale_do = fp8.call_scale(spec, state, "do", amaxes["do"])
    do8 = fp8.quantise(d_out, fp8.dtype_of(spec, "do"), scale_do)
    descales = tuple(1.0 / scales[name] for name in ("q", "k", "v", "o")) + (1.0 / scale_do,)
    fp8_format = FP8_HYBRID if spec.fp8_format == Fp8Format.HYBRID else FP8_E4M3

    def run(scale_dp, grad_scales):
        """(dq8, dk8, dv8), their amaxes, the recipe's amax_dp; scale_dp the recipe's."""
        *grads, amax_dq, amax_dk, amax_dv, amax_dp = fp8_calls.backward(
            call, fp8_format, q8, k8, v8, o8, do8, stats, descales, scales["s"],
            scale_dp / call.scale, grad_scales)
        return grads, (amax_dq, amax_dk, amax_dv), amax_dp / call.scale

    def probe():
        ones = (_ONE,) * 3
        amax_dp = run(_ONE, ones)[2]
        return (amax_dp, *run(fp8.call_scale(spec, state, "dp", amax_dp), ones)[1])

    scale_dp, *grad_scales = _scales(spec, state, ("dp", "dq", "dk", "dv"), probe)
    grads, grad_amaxes, amaxes["dp"] = run(scale_dp, tuple(grad_scales))
    amaxes.update(zip(("dq", "dk", "dv"), grad_amaxes))
    grads = tuple(fp8.input_cotangent(g8.astype(jnp.float32) / scale, dtype, scales[name])
                  for g8, scale, dtype, name in zip(grads, grad_scales, static.dtypes, "qkv"))
    return (*grads, fp8.record(spec, new_state, amaxes))


_fp8_cudnn.defvjp(_fp8_cudnn_fwd, _fp8_cudnn_bwd)
