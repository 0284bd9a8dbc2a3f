"""The flash backend's two FFI calls (flash.py is the backend around them).

The op is two XLA FFI calls around a `jax.custom_vjp`:

    fusedattn_flash_fwd(q, k, v, q_seg, q_pos, q_diag, kv_seg, kv_pos,
                        softmax_offset, seed, alibi_slopes, bias) -> (o, lse)
    fusedattn_flash_bwd(q, k, v, q_seg, q_pos, q_diag, kv_seg, kv_pos,
                        softmax_offset, seed, alibi_slopes, bias, o, lse, do)
                        -> (dq, dk, dv, d_offset, d_slopes, d_bias)

    attributes: scale f32, causal bool, window_left i64, window_right i64,
                softmax_type i32 (0 vanilla, 1 off_by_one, 2 learnable),
                dropout_rate f64 (0 = no dropout),
                alibi bool (scores gain -slope[h] * |kv_pos - (q_pos + q_diag)|, as in
                the xla backend; ops_cuda/include/fusedattn/alibi.h),
                bias_type i32 (0 none, 1 pre_scale: s = (q.k + bias) * scale,
                2 post_scale: s = q.k * scale + bias; ops_cuda/include/fusedattn/bias.h),
                kernel i32 (CUDA and ROCm only: 0 the device picks, 1 the sm_80
                kernels named by FUSEDATTN_FLASH_KERNEL=sm80 when the call was traced);
                the backward also deterministic bool (bitwise repeatable gradients)

with q [b, sq, h, d], k [b, skv, h_kv, d], v [b, skv, h_kv, dv] (one dtype:
float32, bfloat16 or float16), the int32 token vectors of base.TokenInfo,
softmax_offset float32 [h], seed uint32 [2], alibi_slopes float32 [h] (the
paper's slopes, or config.bias 'alibi''s given ones; zeros without ALiBi), o [b, sq,
h, dv], lse float32 [b, h, sq], and d_offset, d_slopes float32 [b, h] (summed over b
here). bias is float32 [b|1, h|1, sq, skv] (config.bias 'pre_scale_bias' or
'post_scale_bias', cast from its dtype; an unread float32 [1, 1, 0, 0] without one) and
d_bias float32 of its shape, summed over its dims of extent 1 inside the call (every CUDA
and ROCm kernel has a bias variant), or float32 [1, 1, 0, 0] where nobody differentiates
the bias (learnt from symbolic zeros: the kernels then compute no bias gradient).
softmax_offset, seed and alibi_slopes reach the kernels with a leading axis of rows
([L, h], [L, 2], [L, h]): batch row r reads row r // (B / L). Both calls go through partitioning.py: under
jax.vmap the mapped axis folds into the kernel's batch (never a loop; mapped
offsets and seeds become rows, so the dropout mask of a mapped example is that
of the unbatched call), and under a device mesh the calls shard over the batch
and head axes of q without gathering. The dropout mask is keyed by the global
(batch, head) indices, so with dropout the heads stay unsharded and the batch
shards only with per-example seeds (a vmap over keys) that split with it.

The forward saves o and lse (float32 log-sum-exp of the scaled scores and the
softmax sink; +inf for a query with no visible key, whose output and gradients
are exactly 0).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from fusedattn.ops import _library
from fusedattn.ops.backends import flash_gpu, partitioning
from fusedattn.ops.backends.base import current_platform
from fusedattn.ops.backends.unread import Unread, values
from fusedattn.ops.enums import BiasType, SoftmaxType

FWD_TARGET = "fusedattn_flash_fwd"
BWD_TARGET = "fusedattn_flash_bwd"

SOFTMAX_TYPES = {
    SoftmaxType.VANILLA: 0,
    SoftmaxType.OFF_BY_ONE: 1,
    SoftmaxType.LEARNABLE: 2,
}
BIAS_TYPES = {BiasType.PRE_SCALE_BIAS: 1, BiasType.POST_SCALE_BIAS: 2}
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class Static(NamedTuple):
    """The attributes of both FFI calls (hashable: a nondiff argument)."""

    scale: float
    causal: bool
    window_left: int
    window_right: int
    softmax_type: int
    dropout_rate: float
    deterministic: bool = False  # config.deterministic_backward
    sm80_named: bool = False  # FUSEDATTN_FLASH_KERNEL=sm80 when the call was traced
    alibi: bool = False  # config.bias 'alibi'
    bias_type: int = 0  # BIAS_TYPES: 0 without a bias array
    # The backward computes d_bias (False where nobody differentiates the bias: a mask given
    # as a bias, a fixed one; its d_bias result is then empty and the kernels skip it).
    bias_gradient: bool = True

    @property
    def d_bias_wanted(self) -> bool:
        return bool(self.bias_type) and self.bias_gradient

    def attributes(self, backward: bool) -> dict:
        """The FFI attributes; "kernel" on the GPU platforms only (the host handlers have none)."""
        attributes = dict(
            scale=np.float32(self.scale),
            causal=bool(self.causal),
            window_left=np.int64(self.window_left),
            window_right=np.int64(self.window_right),
            softmax_type=np.int32(self.softmax_type),
            dropout_rate=np.float64(self.dropout_rate),
            alibi=bool(self.alibi),
            bias_type=np.int32(self.bias_type),
        )
        if backward:
            attributes["deterministic"] = bool(self.deterministic)
        if current_platform() in ("cuda", "rocm"):
            attributes["kernel"] = np.int32(int(self.sm80_named))
        return attributes


def cuda_workspace(q, k, tokens, backward: bool, deterministic: bool = False,
                    alibi: bool = False, bias_shape: tuple[int, ...] | None = None,
                    ) -> tuple[jax.ShapeDtypeStruct, ...]:
    """() on the host; on CUDA and ROCm the handlers' scratch, a uint8 result XLA allocates,
    sized by the library's own layout (_library.flash_workspace_bytes: the spans, and for the
    backward the softmax delta, the sm_90a dQ accumulator, ALiBi's partial sums and the terms
    of a broadcast bias array's gradient). bias_shape: the bias array's [b|1, h|1, sq, skv]
    (None without one)."""
    platform = current_platform()
    if platform not in ("cuda", "rocm"):
        return ()
    b, sq, h, d = q.shape
    bias = bias_shape is not None
    sm90 = (backward and platform == "cuda"
            and flash_gpu.cuda_backward_kernel(d, sq, k.shape[1], deterministic) == "sm90")
    bias_batch, bias_heads = bias_shape[:2] if bias else (0, 0)
    size = _library.flash_workspace_bytes(
        platform, token_rows=math.prod(tokens.shape[:-1]), batch=b, heads=h, seqlen_q=sq,
        seqlen_kv=k.shape[1], head_dim=d, backward=backward, sm90_backward=sm90, alibi=alibi,
        bias_batch=bias_batch, bias_heads=bias_heads)
    return (jax.ShapeDtypeStruct((size,), jnp.uint8),)


def _forward(static: Static, q, k, v, *operands):
    b, sq, h, _ = q.shape
    return jax.ffi.ffi_call(
        FWD_TARGET,
        (jax.ShapeDtypeStruct((b, sq, h, v.shape[-1]), q.dtype),
         jax.ShapeDtypeStruct((b, h, sq), jnp.float32))
        + cuda_workspace(q, k, operands[0], backward=False),
    )(q, k, v, *operands, **static.attributes(backward=False))[:2]


def _backward(static: Static, q, k, v, *operands):
    b, _, h, _ = q.shape
    return jax.ffi.ffi_call(
        BWD_TARGET,
        (jax.ShapeDtypeStruct(q.shape, q.dtype),
         jax.ShapeDtypeStruct(k.shape, k.dtype),
         jax.ShapeDtypeStruct(v.shape, v.dtype),
         jax.ShapeDtypeStruct((b, h), jnp.float32),
         jax.ShapeDtypeStruct((b, h), jnp.float32),
         jax.ShapeDtypeStruct(operands[_BIAS - 3].shape if static.d_bias_wanted else _NO_D_BIAS,
                              jnp.float32))
        + cuda_workspace(q, k, operands[0], backward=True, deterministic=static.deterministic,
                          alibi=static.alibi,
                          bias_shape=operands[_BIAS - 3].shape if static.d_bias_wanted else None),
    )(q, k, v, *operands, **static.attributes(backward=True))[:6]


# q, k, v, the five token vectors, then the per-row offset [L, h], seed [L, 2] and
# ALiBi slopes [L, h], and the bias [b|1, h|1, sq, skv].
_OPERANDS = ("b.h.", "b.g.", "b.g.") + ("b.",) * 5 + ("rh", "r.", "rh", "BH..")
_SEED, _BIAS = 9, 11
_D_BIAS = 5  # the backward's result
_NO_D_BIAS = (1, 1, 0, 0)  # its shape where the bias's gradient is not wanted (no elements)


@functools.lru_cache(maxsize=None)
def op(static: Static, backward: bool):
    """The FFI call of one direction, sharded over batch and heads, folded under vmap."""
    operands, results = ((_OPERANDS + ("b.h.", "bh.", "b.h."),
                          ("b.h.", "b.g.", "b.g.", "bh", "bh", "BH.."))
                         if backward else (_OPERANDS, ("b.h.", "bh.")))
    unread = frozenset({_D_BIAS}) if backward and not static.d_bias_wanted else frozenset()
    signature = partitioning.Signature(operands, results, dropout=static.dropout_rate > 0,
                                       dropout_rows=_SEED, unread=unread)
    return partitioning.op(functools.partial(_backward if backward else _forward, static),
                           signature)


def row_operands(offset, seed, slopes):
    """The per-row operands (softmax_offset, seed, alibi_slopes) with their one row."""
    return offset[None], seed[None], slopes[None]


def no_bias() -> jax.Array:
    """The bias operand of a call without a bias array (unread)."""
    return jnp.zeros((1, 1, 0, 0), jnp.float32)


def forward_call(static: Static, q, k, v, offset, seed, tokens, slopes=None, bias=None):
    """(o, lse) of the forward; slopes float32 [h] (None: zeros, for calls without ALiBi),
    bias float32 [b|1, h|1, sq, skv] (None: without a bias array)."""
    slopes = jnp.zeros_like(offset) if slopes is None else slopes
    bias = no_bias() if bias is None else bias
    return op(static, False)(q, k, v, *tokens, *row_operands(offset, seed, slopes), bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attend(static: Static, q, k, v, offset, slopes, bias, seed, q_seg, q_pos, q_diag, kv_seg,
           kv_pos):
    tokens = (q_seg, q_pos, q_diag, kv_seg, kv_pos)
    o, _ = forward_call(static, q, k, v, offset, seed, tokens, slopes, bias)
    return o


def _attend_fwd(static: Static, q, k, v, offset, slopes, bias, seed, q_seg, q_pos, q_diag,
               kv_seg, kv_pos):
    """The forward rule under symbolic_zeros: each array comes as a CustomVJPPrimal; a bias
    nobody differentiates gets no gradient from the backward call (Unread)."""
    unread = Unread.of(((_D_BIAS, bias),))
    q, k, v, offset, slopes, bias, seed, *tokens = values(
        (q, k, v, offset, slopes, bias, seed, q_seg, q_pos, q_diag, kv_seg, kv_pos))
    tokens = tuple(tokens)
    o, lse = forward_call(static, q, k, v, offset, seed, tokens, slopes, bias)
    return o, (q, k, v, offset, slopes, bias, seed, tokens, o, lse, unread)


def _attend_bwd(static: Static, residuals, do):
    q, k, v, offset, slopes, bias, seed, tokens, o, lse, unread = residuals
    if isinstance(do, SymbolicZero):  # a cotangent known to be zero
        return (None,) * 12
    static = static._replace(bias_gradient=_D_BIAS not in unread.results)
    dq, dk, dv, d_offset, d_slopes, d_bias = op(static, True)(
        q, k, v, *tokens, *row_operands(offset, seed, slopes), bias, o, lse,
        do.astype(o.dtype))
    if static.softmax_type == SOFTMAX_TYPES[SoftmaxType.LEARNABLE]:
        d_offset = jnp.sum(d_offset, axis=0)
    else:
        d_offset = jnp.zeros_like(offset)
    d_slopes = jnp.sum(d_slopes, axis=0) if static.alibi else jnp.zeros_like(slopes)
    d_bias = d_bias if static.d_bias_wanted else None  # None: a zero (or unread) cotangent
    return (dq, dk, dv, d_offset, d_slopes, d_bias, None, None, None, None, None, None)


attend.defvjp(_attend_fwd, _attend_bwd, symbolic_zeros=True)
