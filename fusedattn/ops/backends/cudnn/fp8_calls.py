"""The cuDNN backend's two FP8 FFI calls (ops_cuda/cudnn/cudnn_fp8.cc):

    fusedattn_cudnn_fp8_fwd(q8, k8, v8, seqlen_q, seqlen_kv,
                            descale_q, descale_k, descale_v, descale_s, scale_s, scale_o)
        -> (o8, stats, amax_s, amax_o)
    fusedattn_cudnn_fp8_bwd(q8, k8, v8, o8, do8, stats, seqlen_q, seqlen_kv,
                            descale_q, descale_k, descale_v, descale_o, descale_do, descale_s,
                            descale_dp, scale_s, scale_dq, scale_dk, scale_dv, scale_dp)
        -> (dq8, dk8, dv8, amax_dq, amax_dk, amax_dv, amax_dp)

q8, k8, v8, o8, dq8, dk8, dv8 float8_e4m3fn in the canonical [b, s, h, d] layout; do8
float8_e4m3fn or float8_e5m2 ("hybrid"); every scale, descale and amax a float32 scalar
(float32 [1] at the call). cuDNN's amax_dp is that of its dS, which includes the attention
scale (cudnn_fp8.cc). The calls here take the dense layouts (segments = 0: seqlen_q and
seqlen_kv unread; the FFI's padding form, segments = 1, has no caller).
Under jax.vmap they run once per example (vmap_method "sequential"), each with its own
scales and amaxes, as the xla emulation's batched amaxes are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn.ops.backends.cudnn import library as cudnn_library
from fusedattn.ops.backends.cudnn.ffi_calls import _UNREAD_INT32
from fusedattn.ops.backends.cudnn.graph_key import FP8_E4M3, _device_ordinal, _graph_params, _Static

_SCALAR = jax.ShapeDtypeStruct((1,), jnp.float32)


def _attributes(static: _Static, training: bool) -> dict:
    return dict(scale=np.float32(static.scale), causal=bool(static.causal),
                bottom_right=bool(static.bottom_right), segments=np.int64(static.segments),
                deterministic=bool(static.deterministic), training=bool(training))


def _workspace(static: _Static, fp8_format: int, q, v, backward: bool, training: bool):
    """The uint8 workspace result of one call (XLA allocates it; the handlers allocate nothing)."""
    b, sq, h, d = q.shape
    _, skv, hkv, dv = v.shape
    size = 0
    if b and sq and skv and h:
        params = _graph_params(static, b, h, hkv, sq, skv, d, dv, q.dtype, 0, 0, fp8_format)
        size = cudnn_library.workspace_bytes(params, static.scale, 0.0, not training, backward,
                                             _device_ordinal())
    return jax.ShapeDtypeStruct((size,), jnp.uint8)


def _scalars(values) -> list[jax.Array]:
    return [jnp.asarray(x, jnp.float32).reshape(1) for x in values]


def forward(static: _Static, q8, k8, v8, descale_q, descale_k, descale_v, scale_s, scale_o,
            training: bool):
    """(o8 [b, sq, h, dv] float8_e4m3fn, stats float32 [b, h, sq, 1] or None without
    training, amax_s, amax_o float32 scalars): P stored with scale_s, O with scale_o."""
    b, sq, h, _ = q8.shape
    stats_shape = (b, h, sq, 1) if training else (0,)
    o8, stats, amax_s, amax_o, _ = jax.ffi.ffi_call(
        cudnn_library.FP8_FWD_TARGET,
        (jax.ShapeDtypeStruct((b, sq, h, v8.shape[-1]), jnp.float8_e4m3fn),
         jax.ShapeDtypeStruct(stats_shape, jnp.float32), _SCALAR, _SCALAR,
         _workspace(static, FP8_E4M3, q8, v8, backward=False, training=training)),
        vmap_method="sequential",
    )(q8, k8, v8, _UNREAD_INT32, _UNREAD_INT32,
      *_scalars((descale_q, descale_k, descale_v, 1.0 / scale_s, scale_s, scale_o)),
      **_attributes(static, training))
    return o8, stats if training else None, amax_s[0], amax_o[0]


def backward(static: _Static, fp8_format: int, q8, k8, v8, o8, do8, stats, descales, scale_s,
             scale_dp, grad_scales):
    """(dq8, dk8, dv8 float8_e4m3fn like q8, k8, v8; amax_dq, amax_dk, amax_dv, amax_dp
    float32 scalars).

    descales: of q, k, v, o and do (1 / their scales); scale_s the forward's; scale_dp and
    amax_dp cuDNN's (of dS with the attention scale in it); grad_scales of dq, dk, dv.
    """
    descale_q, descale_k, descale_v, descale_o, descale_do = descales
    *grads, amax_dq, amax_dk, amax_dv, amax_dp, _ = jax.ffi.ffi_call(
        cudnn_library.FP8_BWD_TARGET,
        (jax.ShapeDtypeStruct(q8.shape, jnp.float8_e4m3fn),
         jax.ShapeDtypeStruct(k8.shape, jnp.float8_e4m3fn),
         jax.ShapeDtypeStruct(v8.shape, jnp.float8_e4m3fn), _SCALAR, _SCALAR, _SCALAR, _SCALAR,
         _workspace(static, fp8_format, q8, v8, backward=True, training=True)),
        vmap_method="sequential",
    )(q8, k8, v8, o8, do8, stats, _UNREAD_INT32, _UNREAD_INT32,
      *_scalars((descale_q, descale_k, descale_v, descale_o, descale_do, 1.0 / scale_s,
                 1.0 / scale_dp, scale_s, *grad_scales, scale_dp)),
      **_attributes(static, True))
    return (*grads, amax_dq[0], amax_dk[0], amax_dv[0], amax_dp[0])
