"""float64 NumPy reference of the FP8 attention recipe (fusedattn/ops/fp8.py,
fusedattn/ops/backends/xla_fp8.py): the same quantisation steps, every sum in float64."""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
from reference import describe_tokens, visible_keys

TENSORS = ("q", "k", "v", "s", "o", "do", "dp", "dq", "dk", "dv")
E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def fp8_dtype(fmt: str, tensor: str):
    return E5M2 if fmt == "hybrid" and tensor in ("do", "dp") else E4M3


def round_trip(x: np.ndarray, dtype, scale: float) -> np.ndarray:
    top = float(ml_dtypes.finfo(dtype).max)
    return np.clip(x * scale, -top, top).astype(dtype).astype(np.float64) / scale


def scale_from(amax: float, dtype, margin: int, fallback: float) -> float:
    if not (math.isfinite(amax) and amax > 0):
        return fallback
    return float(ml_dtypes.finfo(dtype).max) / amax / 2.0**margin


# The FP8 roundings each result passes through, from the inputs on (xla_fp8.py's steps).
ROUNDINGS = {"out": ("q", "k", "v", "s", "o"),
             "dv": ("q", "k", "s", "do", "dv"),
             "dq": ("q", "k", "v", "s", "o", "do", "dp", "dq"),
             "dk": ("q", "k", "v", "s", "o", "do", "dp", "dk")}


def rounding_rms(dtype) -> tuple[float, float]:
    """(least, most) relative rms error of one round-to-nearest into FP8 `dtype`: with m
    mantissa bits a value x in [2^e, 2^(e+1)) moves by at most half its step 2^(e-m), an
    error uniform over that half step each side has rms 2^(e-m) / sqrt(12): relative to x,
    2^-m / sqrt(12) at the bottom of the binade and half that at the top (E4M3 3.6% / 1.8%,
    E5M2 7.2% / 3.6%)."""
    most = 2.0 ** -ml_dtypes.finfo(dtype).nmant / math.sqrt(12.0)
    return most / 2.0, most


def fp8_step(x, dtype=E4M3) -> np.ndarray:
    """The spacing of FP8 `dtype` values around |x| (elementwise): 2^(e - m) in the binade
    [2^e, 2^(e+1)) with m mantissa bits, the subnormal spacing below the smallest normal
    (E4M3: 2^-9 under 2^-6); at a power of two the larger, upper spacing."""
    finfo = ml_dtypes.finfo(dtype)
    exponent = np.floor(np.log2(np.maximum(np.abs(np.asarray(x, np.float64)),
                                           2.0 ** finfo.minexp)))
    return 2.0 ** (exponent - finfo.nmant)


def rerounded_rms_bound(expected, before: float, dtype=E4M3) -> float:
    """Bound of rms(C - E) / rms(E) for two results C = R(c), E = R(e) rounded once more
    into FP8 `dtype` at unit scale (the gradients of FP8 inputs, fp8.input_cotangent),
    where the values c, e before that rounding differ by D = c - e with
    rms(D) <= before * rms(e) (the bound the same tensor meets without it).

    Derivation, with Delta the spacing at an entry (fp8_step of `expected`) and the
    entry's position within its rounding cell uniform (the model of rounding_rms): write
    D = n Delta + f, 0 <= f < Delta. C - E is n Delta or (n + 1) Delta, with probability
    1 - f / Delta and f / Delta, so E[(C - E)^2] = D^2 + f (Delta - f), and the added term
    f (Delta - f) is at most Delta^2 / 4 (f = Delta / 2) and at most |D| Delta (f <= |D|
    when n = 0; Delta^2 / 4 <= |D| Delta otherwise). Averaged over the entries, with
    mean(|D| Delta) <= rms(D) rms(Delta) (Cauchy-Schwarz) and rms(e) <= rms(E) (a rounding
    adds its variance):
        mean((C - E)^2) / mean(E^2) <= before^2 + min(before rms(Delta) / rms(E),
                                                       mean(Delta^2) / (4 mean(E^2)))
    Not a format-only constant: where the values sit among E4M3's subnormals (the
    gradients of FP8 inputs stored with scales near 60, test_fp8_gpu.py's case: rms about
    one spacing 2^-9) one flip is a whole spacing, and the bound is 0.26-0.28 there, where
    values 0.06 rms apart before the rounding measure 0.21-0.25, and bugs in the
    conversion (scale not divided, divided twice, a factor 2, a neighbouring token's
    gradient) 1.0-63 (tests/test_fp8.py checks both sides on the emulation)."""
    expected = np.asarray(expected, np.float64)
    step_square = np.mean(fp8_step(expected, dtype) ** 2)
    mean_square = np.mean(expected**2)
    added = min(before * np.sqrt(step_square * mean_square), step_square / 4) / mean_square
    return float(np.sqrt(before**2 + added))


def rms_error_bounds(fmt: str, result: str) -> tuple[float, float]:
    """(lower, upper) bound of the relative rms error, rms(FP8 - exact) / rms(exact), of
    `result` (out, dq, dk or dv) of FP8 attention against exact attention: at least the
    least error of its own last rounding (the others add independent errors), at most
    the roundings of ROUNDINGS[result] at their worst, added in quadrature (independent
    errors, each carried to the result with a gain of at most about one: the scores'
    errors move softmax weights that sum to one). On unit-normal inputs (d 128, 256 keys)
    the emulation and cuDNN measure 0.64-0.73 of the upper bound."""
    lower = rounding_rms(fp8_dtype(fmt, result))[0]
    upper = math.sqrt(sum(rounding_rms(fp8_dtype(fmt, name))[1] ** 2
                          for name in ROUNDINGS[result]))
    return lower, upper


@dataclasses.dataclass
class Fp8Reference:
    out: np.ndarray                 # [b, sq, h, dv]
    grads: tuple | None             # (dq, dk, dv)
    amax: dict[str, float]          # per tensor, this call's
    scales: dict[str, float]        # the scales this call quantised with
    max_logit: np.ndarray           # [h]


def fp8_attention(q, k, v, *, scales: dict[str, float], fmt="e4m3", scaling="delayed",
                  margin=0, causal=True, sequence=None, padding=False, keep=None, rate=0.0,
                  dout=None) -> Fp8Reference:
    """q [b, sq, h, d], k/v [b, skv, h_kv, d] (float64); `scales` the state's scales per
    tensor (read under delayed scaling; current scaling derives them from the amaxes).
    s is the softmax numerators exp(S - rowmax) (xla_fp8.py's module docstring)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, sq, h, d = q.shape
    skv, h_kv = k.shape[1], k.shape[2]
    group = h // h_kv
    scale = 1.0 / math.sqrt(d)
    tokens = describe_tokens(sequence, b, sq, skv, use_sequence=padding, bottom_right=False)
    visible = visible_keys(tokens, causal=causal, window=(-1, -1))[:, None]  # [b, 1, sq, skv]
    q = np.where((tokens.q_seg != 0)[:, :, None, None], q, 0.0)
    real = (tokens.kv_seg != 0)[:, :, None, None]
    k, v = np.where(real, k, 0.0), np.where(real, v, 0.0)
    amax, used = {}, {}

    def fp8(name, x):
        amax[name] = float(np.max(np.abs(x)))
        dtype = fp8_dtype(fmt, name)
        used[name] = (scale_from(amax[name], dtype, margin, scales[name])
                      if scaling == "current" else scales[name])
        return round_trip(x, dtype, used[name])

    q8, k8, v8 = fp8("q", q), fp8("k", k), fp8("v", v)
    kh, vh = np.repeat(k8, group, axis=2), np.repeat(v8, group, axis=2)
    scores = np.einsum("bihd,bjhd->bhij", q8, kh) * scale
    masked = np.where(visible, scores, -np.inf)
    row_max = np.max(masked, axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    exps = np.where(visible, np.exp(np.where(visible, scores, 0.0) - row_max), 0.0)
    total = np.sum(exps, axis=-1, keepdims=True)
    total = np.where(total > 0, total, 1.0)
    probs = exps / total
    multiplier = 1.0 if keep is None else np.where(keep, 1.0 / (1.0 - rate), 0.0)
    e8 = fp8("s", exps * multiplier)      # the numerators, normalised after the product
    o8 = fp8("o", np.einsum("bhij,bjhe->bihe", e8, vh) / total.transpose(0, 2, 1, 3))
    # The backward stores the normalised weights with the forward's scale.
    p8 = round_trip(probs * multiplier, fp8_dtype(fmt, "s"), used["s"])
    result = Fp8Reference(out=o8, grads=None, amax=amax, scales=used,
                          max_logit=np.max(masked, axis=(0, 2, 3)))
    if dout is None:
        return result
    do8 = fp8("do", np.asarray(dout, np.float64))
    d_probs = np.einsum("bihe,bjhe->bhij", do8, vh) * multiplier
    delta = np.sum(do8 * o8, axis=-1).transpose(0, 2, 1)[..., None]
    ds8 = fp8("dp", probs * (d_probs - delta))
    dq = fp8("dq", scale * np.einsum("bhij,bjhd->bihd", ds8, kh))
    dk = fp8("dk", scale * np.einsum("bhij,bihd->bjhd", ds8, q8).reshape(b, skv, h_kv, group, d).sum(3))
    dv = fp8("dv", np.einsum("bhij,bihe->bjhe", p8, do8).reshape(b, skv, h_kv, group, -1).sum(3))
    result.grads = (dq, dk, dv)
    return result
