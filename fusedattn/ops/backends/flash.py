"""The "flash" backend: the compiled op set's own attention kernels.

This version serves platform "cpu" through the host build
(ops_cuda/host/flash_host.cc); the GPU kernels are not written yet. The op
is two XLA FFI calls around a `jax.custom_vjp`:

    fusedattn_flash_fwd(q, k, v, q_seg, q_pos, q_diag, kv_seg, kv_pos,
                        softmax_offset, seed) -> (o, lse)
    fusedattn_flash_bwd(q, k, v, q_seg, q_pos, q_diag, kv_seg, kv_pos,
                        softmax_offset, seed, o, lse, do) -> (dq, dk, dv, d_offset)

    attributes: scale f32, causal bool, window_left i64, window_right i64,
                softmax_type i32 (0 vanilla, 1 off_by_one, 2 learnable),
                dropout_rate f64 (0 = no dropout)

with q [b, sq, h, d], k [b, skv, h_kv, d], v [b, skv, h_kv, dv] (one dtype:
float32, bfloat16 or float16), the int32 token vectors of base.TokenInfo,
softmax_offset float32 [h], seed uint32 [2], o [b, sq, h, dv], lse float32
[b, h, sq] and d_offset float32 [b, h] (summed over b here). The calls use
vmap_method="broadcast_all": under jax.vmap every operand gets the mapped axes
prepended and the kernel folds them into its batch (never a loop); operands
with fewer rows (softmax_offset, seed) serve batch row r with their row
r // (B / L), and the dropout mask of a mapped example is that of the
unbatched call.

The forward saves o and lse (float32 log-sum-exp of the scaled scores and the
softmax sink; +inf for a query with no visible key, whose output and gradients
are exactly 0).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn.ops import _library
from fusedattn.ops.backends.base import CallShapes, CanonicalArgs
from fusedattn.ops.enums import BiasType, SoftmaxType
from fusedattn.ops.spec import AttentionSpec

FWD_TARGET = "fusedattn_flash_fwd"
BWD_TARGET = "fusedattn_flash_bwd"

_SOFTMAX_TYPES = {
    SoftmaxType.VANILLA: 0,
    SoftmaxType.OFF_BY_ONE: 1,
    SoftmaxType.LEARNABLE: 2,
}
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class _Static(NamedTuple):
    """The attributes of both FFI calls (hashable: a nondiff argument)."""

    scale: float
    causal: bool
    window_left: int
    window_right: int
    softmax_type: int
    dropout_rate: float

    def attributes(self) -> dict:
        return dict(
            scale=np.float32(self.scale),
            causal=bool(self.causal),
            window_left=np.int64(self.window_left),
            window_right=np.int64(self.window_right),
            softmax_type=np.int32(self.softmax_type),
            dropout_rate=np.float64(self.dropout_rate),
        )


def _forward_call(static: _Static, q, k, v, offset, seed, tokens):
    b, sq, h, _ = q.shape
    dv = v.shape[-1]
    call = jax.ffi.ffi_call(
        FWD_TARGET,
        (jax.ShapeDtypeStruct((b, sq, h, dv), q.dtype),
         jax.ShapeDtypeStruct((b, h, sq), jnp.float32)),
        vmap_method="broadcast_all",
    )
    return call(q, k, v, *tokens, offset, seed, **static.attributes())


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(static: _Static, q, k, v, offset, seed, q_seg, q_pos, q_diag, kv_seg, kv_pos):
    o, _ = _forward_call(static, q, k, v, offset, seed, (q_seg, q_pos, q_diag, kv_seg, kv_pos))
    return o


def _flash_fwd(static: _Static, q, k, v, offset, seed, q_seg, q_pos, q_diag, kv_seg, kv_pos):
    tokens = (q_seg, q_pos, q_diag, kv_seg, kv_pos)
    o, lse = _forward_call(static, q, k, v, offset, seed, tokens)
    return o, (q, k, v, offset, seed, tokens, o, lse)


def _flash_bwd(static: _Static, residuals, do):
    q, k, v, offset, seed, tokens, o, lse = residuals
    b, _, h, _ = q.shape
    call = jax.ffi.ffi_call(
        BWD_TARGET,
        (jax.ShapeDtypeStruct(q.shape, q.dtype),
         jax.ShapeDtypeStruct(k.shape, k.dtype),
         jax.ShapeDtypeStruct(v.shape, v.dtype),
         jax.ShapeDtypeStruct((b, h), jnp.float32)),
        vmap_method="broadcast_all",
    )
    dq, dk, dv, d_offset = call(q, k, v, *tokens, offset, seed, o, lse, do.astype(o.dtype),
                                **static.attributes())
    if static.softmax_type == _SOFTMAX_TYPES[SoftmaxType.LEARNABLE]:
        d_offset = jnp.sum(d_offset, axis=0)
    else:
        d_offset = jnp.zeros_like(offset)
    return (dq, dk, dv, d_offset, None, None, None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


class FlashBackend:
    """The compiled kernels of this project; the host build on "cpu" for now."""

    name = "flash"

    def supports(self, spec: AttentionSpec, shapes: CallShapes | None, platform: str) -> str | None:
        platform = (platform or "").lower()
        if platform in ("gpu", "cuda", "rocm"):
            return "flash: no GPU kernel yet (host build only); use backend='xla'"
        if platform != "cpu":
            return (f"flash: only the host (cpu) build exists; this computation runs on "
                    f"{platform}; use backend='xla'")
        if spec.bias == BiasType.ALIBI:
            return ("flash: ALiBi is not supported by the flash kernels; use backend='xla' "
                    "or 'auto'")
        if spec.bias != BiasType.NO_BIAS or (shapes is not None and shapes.has_bias_array):
            return ("flash: bias arrays are not supported by the flash kernels; use "
                    "backend='xla' or 'auto'")
        if shapes is not None and jnp.dtype(shapes.dtype) not in _DTYPES:
            return (f"flash: dtype {jnp.dtype(shapes.dtype).name} is not supported; use float32, "
                    "bfloat16 or float16 inputs, or backend='xla'")
        reason = _library.available("cpu")
        if reason is not None:
            return f"flash: {reason}"
        return None

    def attention(self, spec: AttentionSpec, args: CanonicalArgs, scale: float) -> jax.Array:
        reason = _library.available("cpu")
        if reason is not None:
            raise RuntimeError(f"flash: {reason}")
        if spec.bias != BiasType.NO_BIAS or args.bias is not None:
            raise ValueError("flash: bias arrays are not supported by the flash kernels; use "
                             "backend='xla' or 'auto'")
        q, k, v = (jnp.asarray(x) for x in (args.q, args.k, args.v))
        if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(
                f"flash: q, k and v must share one dtype among float32, bfloat16 and float16; "
                f"got {q.dtype}, {k.dtype} and {v.dtype}. Cast them, or use backend='xla'.")
        h = q.shape[2]
        if spec.softmax == SoftmaxType.LEARNABLE and args.softmax_offset is None:
            raise ValueError(
                f"softmax_offset: config.softmax 'learnable' needs a float32 array of shape "
                f"[h] = ({h},).")
        if spec.softmax != SoftmaxType.VANILLA and args.softmax_offset is not None:
            offset = jnp.asarray(args.softmax_offset, jnp.float32)
        else:
            offset = jnp.zeros((h,), jnp.float32)
        dropout = args.dropout_seed is not None and spec.dropout_rate > 0
        seed = (jnp.asarray(args.dropout_seed).astype(jnp.uint32) if dropout
                else jnp.zeros((2,), jnp.uint32))
        static = _Static(
            scale=float(scale),
            causal=spec.mask.is_causal,
            window_left=int(spec.window_size[0]),
            window_right=int(spec.window_size[1]),
            softmax_type=_SOFTMAX_TYPES[spec.softmax],
            dropout_rate=float(spec.dropout_rate) if dropout else 0.0,
        )
        tokens = tuple(jnp.asarray(t, jnp.int32) for t in args.tokens)
        return _flash(static, q, k, v, offset, seed, *tokens)


BACKEND = FlashBackend()
