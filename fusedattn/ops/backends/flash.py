"""The "flash" backend: the compiled op set's own attention kernels.

It serves platform "cpu" through the host build (ops_cuda/host/flash_host.cc),
CUDA GPUs of compute capability 8.0 and newer through the kernels of
ops_cuda/cuda/flash (bfloat16 and float16, head dims 64, 128 and 256 with
dv = d; mma.sync tensor-core tiles, tile skipping from the token vectors,
a deterministic backward), and AMD CDNA GPUs (gfx90a, gfx94x) through the same
kernel text compiled by hipcc over MFMA (head dims 64 and 128; compile-checked
only, never run on AMD hardware). On compute capability 9.0 the forward and, unless
config.deterministic_backward, the backward run the sm_90a kernels of
ops_cuda/cuda/flash/sm90 (wgmma, TMA) where the library holds them, unless the
environment variable FUSEDATTN_FLASH_KERNEL=sm80 names the sm_80 kernels (for tests
and benchmarks); every kernel serves ALiBi (a compile-time variant of it). Which kernels
serve a call on which GPU, and why a GPU call is refused, is flash_gpu.py's job (explain()
names the kernels a call gets).
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
d_bias float32 of its shape, summed over its dims of extent 1 inside the call. The
host build serves bias arrays; the CUDA and ROCm handlers refuse them (supports() says
so). softmax_offset, seed and alibi_slopes reach the kernels with a leading axis of
rows ([L, h], [L, 2], [L, h]): batch row r reads row r // (B / L). Both calls go through partitioning.py: under
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

from fusedattn.ops import _library
from fusedattn.ops.backends import flash_gpu, partitioning, xla
from fusedattn.ops.backends.base import CallShapes, CanonicalArgs, align256, current_platform
from fusedattn.ops.enums import BiasType, SoftmaxType
from fusedattn.ops.spec import AttentionSpec

FWD_TARGET = "fusedattn_flash_fwd"
BWD_TARGET = "fusedattn_flash_bwd"

_SOFTMAX_TYPES = {
    SoftmaxType.VANILLA: 0,
    SoftmaxType.OFF_BY_ONE: 1,
    SoftmaxType.LEARNABLE: 2,
}
_BIAS_TYPES = {BiasType.PRE_SCALE_BIAS: 1, BiasType.POST_SCALE_BIAS: 2}
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class _Static(NamedTuple):
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
    bias_type: int = 0  # _BIAS_TYPES: 0 without a bias array

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


# The CUDA handlers' scratch, a uint8 result XLA allocates (ops_cuda/cuda/flash/flash.cu
# checks its size): per token row, one 32-byte summary of every 32 queries and of every
# 32 keys; the backward adds float32 [b, h, sq] for rowsum(dO * O) and, where the sm_90a
# backward runs (flash_gpu.cuda_backward_kernel), its float32 dQ accumulator [b, h, sq', d] with
# sq' = sq rounded up to whole query tiles of 64 (sm90/launch.h: dq_accum_floats) and, with
# ALiBi, float32 [b, h, slots] partial sums of the slopes' gradient (a slot per warp: of every
# query tile of 64 for the sm_80 kernels, launch.h: sm80_slope_slots, 4 warps on CUDA and 2 on
# ROCm, sized here for 4; of every key tile of 128 for the sm_90a one, 8 warps,
# sm90/launch.h: slope_slots). Each part is 256-byte aligned.
_SPAN_TOKENS = 32
_SM90_QUERY_TILE = 64
_SPAN_BYTES = 32
_SM80_SLOPE_SLOTS = (64, 4)  # (queries, warps) of a slot group
_SM90_SLOPE_SLOTS = (128, 8)  # (keys, warps)


def _cuda_workspace(q, k, tokens, backward: bool, deterministic: bool = False,
                    alibi: bool = False) -> tuple[jax.ShapeDtypeStruct, ...]:
    """() on the host; the workspace result's shape on CUDA and ROCm."""
    if current_platform() not in ("cuda", "rocm"):
        return ()
    b, sq, h, d = q.shape
    skv = k.shape[1]
    token_rows = math.prod(tokens.shape[:-1])
    spans = -(-sq // _SPAN_TOKENS) + -(-skv // _SPAN_TOKENS)  # ceil(sq / 32) + ceil(skv / 32)
    size = align256(token_rows * spans * _SPAN_BYTES)
    if backward:
        size += align256(b * h * sq * 4)
        sm90 = (current_platform() == "cuda"
                and flash_gpu.cuda_backward_kernel(d, sq, skv, deterministic) == "sm90")
        if sm90:
            size += align256(b * h * -(-sq // _SM90_QUERY_TILE) * _SM90_QUERY_TILE * d * 4)
        if alibi:
            tokens_per_group, warps = _SM90_SLOPE_SLOTS if sm90 else _SM80_SLOPE_SLOTS
            length = skv if sm90 else sq
            size += align256(b * h * -(-length // tokens_per_group) * warps * 4)
    return (jax.ShapeDtypeStruct((size,), jnp.uint8),)


def _forward(static: _Static, q, k, v, *operands):
    b, sq, h, _ = q.shape
    return jax.ffi.ffi_call(
        FWD_TARGET,
        (jax.ShapeDtypeStruct((b, sq, h, v.shape[-1]), q.dtype),
         jax.ShapeDtypeStruct((b, h, sq), jnp.float32))
        + _cuda_workspace(q, k, operands[0], backward=False),
    )(q, k, v, *operands, **static.attributes(backward=False))[:2]


def _backward(static: _Static, q, k, v, *operands):
    b, _, h, _ = q.shape
    return jax.ffi.ffi_call(
        BWD_TARGET,
        (jax.ShapeDtypeStruct(q.shape, q.dtype),
         jax.ShapeDtypeStruct(k.shape, k.dtype),
         jax.ShapeDtypeStruct(v.shape, v.dtype),
         jax.ShapeDtypeStruct((b, h), jnp.float32),
         jax.ShapeDtypeStruct((b, h), jnp.float32),
         jax.ShapeDtypeStruct(operands[_BIAS - 3].shape, jnp.float32))
        + _cuda_workspace(q, k, operands[0], backward=True, deterministic=static.deterministic,
                          alibi=static.alibi),
    )(q, k, v, *operands, **static.attributes(backward=True))[:6]


# q, k, v, the five token vectors, then the per-row offset [L, h], seed [L, 2] and
# ALiBi slopes [L, h], and the bias [b|1, h|1, sq, skv].
_OPERANDS = ("b.h.", "b.g.", "b.g.") + ("b.",) * 5 + ("rh", "r.", "rh", "BH..")
_SEED, _BIAS = 9, 11
_D_BIAS = 5  # the backward's result


@functools.lru_cache(maxsize=None)
def _op(static: _Static, backward: bool):
    """The FFI call of one direction, sharded over batch and heads, folded under vmap."""
    operands, results = ((_OPERANDS + ("b.h.", "bh.", "b.h."),
                          ("b.h.", "b.g.", "b.g.", "bh", "bh", "BH.."))
                         if backward else (_OPERANDS, ("b.h.", "bh.")))
    unread = frozenset({_D_BIAS}) if backward and not static.bias_type else frozenset()
    signature = partitioning.Signature(operands, results, dropout=static.dropout_rate > 0,
                                       dropout_rows=_SEED, unread=unread)
    return partitioning.op(functools.partial(_backward if backward else _forward, static),
                           signature)


def _row_operands(offset, seed, slopes):
    """The per-row operands (softmax_offset, seed, alibi_slopes) with their one row."""
    return offset[None], seed[None], slopes[None]


def _no_bias() -> jax.Array:
    """The bias operand of a call without a bias array (unread)."""
    return jnp.zeros((1, 1, 0, 0), jnp.float32)


def _forward_call(static: _Static, q, k, v, offset, seed, tokens, slopes=None, bias=None):
    """(o, lse) of the forward; slopes float32 [h] (None: zeros, for calls without ALiBi),
    bias float32 [b|1, h|1, sq, skv] (None: without a bias array)."""
    slopes = jnp.zeros_like(offset) if slopes is None else slopes
    bias = _no_bias() if bias is None else bias
    return _op(static, False)(q, k, v, *tokens, *_row_operands(offset, seed, slopes), bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(static: _Static, q, k, v, offset, slopes, bias, seed, q_seg, q_pos, q_diag, kv_seg,
           kv_pos):
    tokens = (q_seg, q_pos, q_diag, kv_seg, kv_pos)
    o, _ = _forward_call(static, q, k, v, offset, seed, tokens, slopes, bias)
    return o


def _flash_fwd(static: _Static, q, k, v, offset, slopes, bias, seed, q_seg, q_pos, q_diag,
               kv_seg, kv_pos):
    tokens = (q_seg, q_pos, q_diag, kv_seg, kv_pos)
    o, lse = _forward_call(static, q, k, v, offset, seed, tokens, slopes, bias)
    return o, (q, k, v, offset, slopes, bias, seed, tokens, o, lse)


def _flash_bwd(static: _Static, residuals, do):
    q, k, v, offset, slopes, bias, seed, tokens, o, lse = residuals
    dq, dk, dv, d_offset, d_slopes, d_bias = _op(static, True)(
        q, k, v, *tokens, *_row_operands(offset, seed, slopes), bias, o, lse,
        do.astype(o.dtype))
    if static.softmax_type == _SOFTMAX_TYPES[SoftmaxType.LEARNABLE]:
        d_offset = jnp.sum(d_offset, axis=0)
    else:
        d_offset = jnp.zeros_like(offset)
    d_slopes = jnp.sum(d_slopes, axis=0) if static.alibi else jnp.zeros_like(slopes)
    d_bias = d_bias if static.bias_type else jnp.zeros_like(bias)
    return (dq, dk, dv, d_offset, d_slopes, d_bias, None, None, None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


class FlashBackend:
    """The compiled kernels of this project: the host build on "cpu", CUDA kernels on NVIDIA
    GPUs (sm_80 and newer), the same kernels over MFMA on AMD CDNA GPUs (ROCm)."""

    name = "flash"

    def masked_values_exact(self, spec: AttentionSpec, platform: str) -> bool:
        # The host kernels select masked keys out; the CUDA ones multiply: measured on an
        # H200 (benchmarks/probes/masked_values_probe.py), a NaN value under causal or
        # window masks reaches earlier rows' outputs, and a NaN key or value dQ under every
        # mask, padding included.
        return platform == "cpu"

    def supports(self, spec: AttentionSpec, shapes: CallShapes | None, platform: str) -> str | None:
        platform = (platform or "").lower()
        if spec.bias in _BIAS_TYPES and platform in ("gpu", "cuda", "rocm"):
            return (f"flash: bias arrays (config.bias {str(spec.bias)!r}) are not yet in the "
                    "CUDA and ROCm kernels (the host build serves them on cpu); use "
                    "backend='xla' or 'auto'")
        if platform in ("gpu", "cuda"):
            return flash_gpu.gpu_reason(shapes, "cuda")
        if platform == "rocm":
            return flash_gpu.gpu_reason(shapes, "rocm")
        if platform != "cpu":
            return (f"flash: kernels exist for cpu (host build), CUDA and ROCm GPUs; this "
                    f"computation runs on {platform}; use backend='xla'")
        if shapes is not None and jnp.dtype(shapes.dtype) not in _DTYPES:
            return (f"flash: dtype {jnp.dtype(shapes.dtype).name} is not supported; use float32, "
                    "bfloat16 or float16 inputs, or backend='xla'")
        reason = _library.available("cpu")
        if reason is not None:
            return f"flash: {reason}"
        return None

    def kernel(self, spec: AttentionSpec, shapes: CallShapes | None,
               platform: str) -> str | None:
        """Which kernels serve a call on CUDA or ROCm (for explain); None elsewhere."""
        return flash_gpu.kernels(spec, shapes, platform)

    def attention(self, spec: AttentionSpec, args: CanonicalArgs, scale: float) -> jax.Array:
        alibi = spec.bias == BiasType.ALIBI
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
        slopes = _slopes(alibi, args.bias, h)
        bias = _bias(spec, args.bias, q.shape, k.shape[1])
        static = _static(spec, scale, spec.softmax, dropout)
        tokens = tuple(jnp.asarray(t, jnp.int32) for t in args.tokens)
        return _flash(static, *partitioning.same_varying(
            (q, k, v, offset, slopes, bias, seed, *tokens)))


BACKEND = FlashBackend()


def _slopes(alibi: bool, given, num_heads: int) -> jax.Array:
    """The alibi_slopes operand, float32 [h]: the given slopes, the paper's for `num_heads`
    heads (xla.alibi_slopes), or zeros (unread) without ALiBi."""
    if not alibi:
        return jnp.zeros((num_heads,), jnp.float32)
    if given is None:
        return jnp.asarray(xla.alibi_slopes(num_heads))
    slopes = jnp.asarray(given, jnp.float32)
    if slopes.shape != (num_heads,):
        raise ValueError(f"bias: ALiBi slopes must have shape [h] = ({num_heads},), got "
                         f"{tuple(slopes.shape)}; pass None for the standard slopes.")
    return slopes


def _bias(spec: AttentionSpec, given, q_shape, seqlen_kv: int) -> jax.Array:
    """The bias operand: the bias array as float32 [b|1, h|1, sq, skv] (its gradient comes
    back in its own dtype through the cast), or the unread placeholder without one. The op
    validated the array's shape (attention._check_bias); the handlers check it again."""
    if spec.bias not in _BIAS_TYPES:
        return _no_bias()
    if given is None:
        b, sq, h, _ = q_shape
        raise ValueError(f"bias: config.bias {str(spec.bias)!r} needs a bias array of shape "
                         f"[b or 1, h or 1, sq, skv] = [{b} or 1, {h} or 1, {sq}, {seqlen_kv}]")
    return jnp.asarray(given).astype(jnp.float32)


def _static(spec: AttentionSpec, scale: float, softmax: SoftmaxType, dropout: bool) -> _Static:
    return _Static(
        scale=float(scale),
        causal=spec.mask.is_causal,
        window_left=int(spec.window_size[0]),
        window_right=int(spec.window_size[1]),
        softmax_type=_SOFTMAX_TYPES[softmax],
        dropout_rate=float(spec.dropout_rate) if dropout else 0.0,
        deterministic=bool(spec.deterministic_backward),
        sm80_named=flash_gpu.named_kernel() == "sm80",
        alibi=spec.bias == BiasType.ALIBI,
        bias_type=_BIAS_TYPES.get(spec.bias, 0),
    )


def _block_row_operands(spec: AttentionSpec, args: CanonicalArgs):
    """The per-row operands and the bias of a context-parallel block: no sink, no dropout,
    no ALiBi (context_parallel.plan refuses flash with ALiBi); the block's slice of a bias
    array where the call has one."""
    if spec.bias == BiasType.ALIBI:
        raise ValueError("flash: context-parallel blocks take no ALiBi; use backend='xla'")
    h = args.q.shape[2]
    return (*_row_operands(jnp.zeros((h,), jnp.float32), jnp.zeros((2,), jnp.uint32),
                           jnp.zeros((h,), jnp.float32)),
            _bias(spec, args.bias, args.q.shape, args.k.shape[1]))


def attention_with_lse(spec: AttentionSpec, args: CanonicalArgs, scale: float):
    """One block of a larger attention (context parallelism): vanilla softmax, no sink, no
    dropout, no ALiBi; the block's bias [b|1, h|1, sq, skv] where the call has one. Returns o [b, sq, h, dv] (q's dtype) and the float32 log-sum-exp
    [b, h, sq], -inf for a query with no visible key (the kernels' +inf, flipped)."""
    operands = (*args.tokens, *_block_row_operands(spec, args))
    o, lse = _op(_static(spec, scale, SoftmaxType.VANILLA, False), False)(
        args.q, args.k, args.v, *operands)
    return o, jnp.where(lse == jnp.inf, -jnp.inf, lse)


def attention_backward_from_lse(spec: AttentionSpec, args: CanonicalArgs, scale: float,
                                out: jax.Array, lse: jax.Array, d_out: jax.Array):
    """This block's share (dq, dk, dv, dbias) of the gradients of an attention spanning many
    blocks, from the whole attention's output out [b, sq, h, dv], log-sum-exp lse
    [b, h, sq] (sink included; -inf where a query sees nothing) and d_out. dbias: float32
    like the block's bias, None without a bias array (as xla.attention_backward_from_lse)."""
    operands = (*args.tokens, *_block_row_operands(spec, args))
    dq, dk, dv, _, _, d_bias = _op(_static(spec, scale, SoftmaxType.VANILLA, False), True)(
        args.q, args.k, args.v, *operands, out.astype(args.q.dtype),
        jnp.where(lse == -jnp.inf, jnp.inf, lse), d_out.astype(args.q.dtype))
    return dq, dk, dv, (d_bias if spec.bias in _BIAS_TYPES else None)
