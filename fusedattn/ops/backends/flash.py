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
names the kernels a call gets). The two FFI calls, their operands and the
custom_vjp around them are flash_ffi.py's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fusedattn.ops import _library
from fusedattn.ops.backends import flash_gpu, partitioning, xla
from fusedattn.ops.backends.base import CallShapes, CanonicalArgs
from fusedattn.ops.enums import BiasType, SoftmaxType
from fusedattn.ops.backends.flash_ffi import (BIAS_TYPES, DTYPES, SOFTMAX_TYPES, Static, attend, no_bias, op,
                                             row_operands)
from fusedattn.ops.spec import AttentionSpec



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
        if platform in ("gpu", "cuda"):
            return flash_gpu.gpu_reason(shapes, "cuda")
        if platform == "rocm":
            return flash_gpu.gpu_reason(shapes, "rocm")
        if platform != "cpu":
            return (f"flash: kernels exist for cpu (host build), CUDA and ROCm GPUs; this "
                    f"computation runs on {platform}; use backend='xla'")
        if shapes is not None and jnp.dtype(shapes.dtype) not in DTYPES:
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

    def auto_preference(self, spec: AttentionSpec, shapes: CallShapes | None,
                        platform: str) -> str | None:
        """The rule under which backend "auto" takes flash ahead of the backends listed
        before it (cudnn), where it covers the call; None elsewhere."""
        return flash_gpu.auto_preference(spec, shapes, platform)

    def attention(self, spec: AttentionSpec, args: CanonicalArgs, scale: float) -> jax.Array:
        alibi = spec.bias == BiasType.ALIBI
        q, k, v = (jnp.asarray(x) for x in (args.q, args.k, args.v))
        if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
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
        return attend(static, *partitioning.same_varying(
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
    if spec.bias not in BIAS_TYPES:
        return no_bias()
    if given is None:
        b, sq, h, _ = q_shape
        raise ValueError(f"bias: config.bias {str(spec.bias)!r} needs a bias array of shape "
                         f"[b or 1, h or 1, sq, skv] = [{b} or 1, {h} or 1, {sq}, {seqlen_kv}]; "
                         "pass it as bias=..., or set config.bias to 'no_bias'")
    return jnp.asarray(given).astype(jnp.float32)


def _static(spec: AttentionSpec, scale: float, softmax: SoftmaxType, dropout: bool) -> Static:
    return Static(
        scale=float(scale),
        causal=spec.mask.is_causal,
        window_left=int(spec.window_size[0]),
        window_right=int(spec.window_size[1]),
        softmax_type=SOFTMAX_TYPES[softmax],
        dropout_rate=float(spec.dropout_rate) if dropout else 0.0,
        deterministic=bool(spec.deterministic_backward),
        sm80_named=flash_gpu.named_kernel() == "sm80",
        alibi=spec.bias == BiasType.ALIBI,
        bias_type=BIAS_TYPES.get(spec.bias, 0),
    )


def _block_row_operands(spec: AttentionSpec, args: CanonicalArgs):
    """The per-row operands and the bias of a context-parallel block: no sink, no dropout,
    no ALiBi (context_parallel.plan refuses flash with ALiBi); the block's slice of a bias
    array where the call has one."""
    if spec.bias == BiasType.ALIBI:
        raise ValueError("flash: context-parallel blocks take no ALiBi; use backend='xla'")
    h = args.q.shape[2]
    return (*row_operands(jnp.zeros((h,), jnp.float32), jnp.zeros((2,), jnp.uint32),
                           jnp.zeros((h,), jnp.float32)),
            _bias(spec, args.bias, args.q.shape, args.k.shape[1]))


def attention_with_lse(spec: AttentionSpec, args: CanonicalArgs, scale: float):
    """One block of a larger attention (context parallelism): vanilla softmax, no sink, no
    dropout, no ALiBi; the block's bias [b|1, h|1, sq, skv] where the call has one. Returns
    o [b, sq, h, dv] (q's dtype) and the float32 log-sum-exp [b, h, sq], -inf for a query
    with no visible key (the kernels' +inf, flipped)."""
    operands = (*args.tokens, *_block_row_operands(spec, args))
    o, lse = op(_static(spec, scale, SoftmaxType.VANILLA, False), False)(
        args.q, args.k, args.v, *operands)
    return o, jnp.where(lse == jnp.inf, -jnp.inf, lse)


def attention_backward_from_lse(spec: AttentionSpec, args: CanonicalArgs, scale: float,
                                out: jax.Array, lse: jax.Array, d_out: jax.Array):
    """This block's share (dq, dk, dv, dbias) of the gradients of an attention spanning many
    blocks, from the whole attention's output out [b, sq, h, dv], log-sum-exp lse
    [b, h, sq] (sink included; -inf where a query sees nothing) and d_out. dbias: float32
    like the block's bias, None without a bias array (as xla.attention_backward_from_lse)."""
    operands = (*args.tokens, *_block_row_operands(spec, args))
    dq, dk, dv, _, _, d_bias = op(_static(spec, scale, SoftmaxType.VANILLA, False), True)(
        args.q, args.k, args.v, *operands, out.astype(args.q.dtype),
        jnp.where(lse == -jnp.inf, jnp.inf, lse), d_out.astype(args.q.dtype))
    return dq, dk, dv, (d_bias if spec.bias in BIAS_TYPES else None)
