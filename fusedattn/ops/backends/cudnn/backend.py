"""CudnnBackend: what the cuDNN backend serves (supports(), with the reason of each
refusal) and the call (attention(): the bias, ALiBi, dropout seed and softmax offset
turned into the op's operands, the descriptor's guard, then the op of vjp.py;
fp8_attention(): the FP8 op of fp8_vjp.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn.ops import fp8, max_logit
from fusedattn.ops.backends import partitioning
from fusedattn.ops.backends.base import CallShapes, CanonicalArgs, compute_capability, guard
from fusedattn.ops.backends.cudnn import fp8_vjp
from fusedattn.ops.backends.cudnn import library as cudnn_library
from fusedattn.ops.backends.cudnn.ffi_calls import _UNREAD_FLOAT32, _UNREAD_UINT32
from fusedattn.ops.backends.cudnn.graph_key import (FP8_E4M3, FP8_HYBRID, _default_scale,
                                                    _device_ordinal, _graph_params, _static,
                                                    _Static)
from fusedattn.ops.backends.cudnn.segments import _segments
from fusedattn.ops.backends.cudnn.vjp import _cudnn
from fusedattn.ops.enums import (BiasType, Fp8Format, Fp8Scaling, MaskType, SequenceFormat,
                                  SoftmaxType)
from fusedattn.ops.spec import AttentionSpec


_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# FP8 calls quantise these inputs (or read float8_e4m3fn ones with the state's scales).
_FP8_INPUT_DTYPES = _DTYPES + (jnp.dtype(jnp.float32), jnp.dtype(jnp.float8_e4m3fn))
# The masks the FP8 path serves: dense ones (bottom-right causal where cuDNN has it: on
# Blackwell, cuDNN >= 9.7; its check gives the reason elsewhere).
_FP8_MASKS = (MaskType.NO_MASK, MaskType.CAUSAL, MaskType.CAUSAL_BOTTOM_RIGHT)

_compute_capability = compute_capability  # a module name of its own: tests stand in for it


def _guard_message(spec: AttentionSpec, static: _Static) -> str:
    layout = ("each row packs its segments one after another" if static.ragged else
              "each row holds one segment from its first token (the seqlens form)")
    return (f"cudnn: the sequence descriptor breaks what the cuDNN backend was configured for: "
            f"{layout}, at most config.sequence.max_segments_per_seq="
            f"{spec.max_segments_per_seq} segments per row, each at most "
            f"config.sequence.max_seqlen_q={spec.max_seqlen_q} query and max_seqlen_kv="
            f"{spec.max_seqlen_kv} key tokens long, a contiguous run of tokens with positions "
            "0, 1, ..., and one run per segment id. The broken rows' outputs are NaN. Raise the "
            "bounds to fit the data, or use backend='xla'.")


class CudnnBackend:
    name = "cudnn"
    # FP8 (config.fp8.enabled): cuDNN's FP8 SDPA graphs (fp8_vjp.py), Hopper and newer.
    serves_fp8 = True

    def masked_values_exact(self, spec: AttentionSpec, platform: str) -> bool:
        # Measured on an H200 (benchmarks/probes/masked_values_probe.py): under causal and
        # window masks a NaN value at a masked key reaches the output and a NaN key dQ;
        # keys past a padded sequence's end never reach anything.
        return not spec.mask.is_causal and spec.window_size == (-1, -1)

    def supports(self, spec: AttentionSpec, shapes: CallShapes | None, platform: str) -> str | None:
        platform = (platform or "").lower()
        if platform not in ("cuda", "gpu"):
            return f"cudnn: needs a CUDA GPU; this computation runs on {platform}"
        if spec.fp8_enabled:
            return _fp8_reason(spec, shapes)
        if spec.bias == BiasType.ALIBI:
            reason = _alibi_reason(spec, shapes is not None and shapes.alibi_slopes)
            if reason is not None:
                return reason
        elif (spec.uses_segments and spec.sequence_format != SequenceFormat.SEQLENS
              and spec.bias != BiasType.NO_BIAS):
            return (f"cudnn: packed segments (segment ids, offsets) with config.bias "
                    f"{str(spec.bias)!r} are not served (cuDNN's bias is not defined per "
                    "segment); the seqlens form (one sequence per row) is")
        if shapes is not None:
            dtype = jnp.dtype(shapes.dtype)
            if dtype not in _DTYPES:
                return (f"cudnn: needs bfloat16 or float16 inputs, got {dtype.name}; cast them, "
                        "or use backend 'flash' or 'xla'")
            for name, dim in (("q/k", shapes.head_dim_qk), ("v", shapes.head_dim_v)):
                if dim % 8 or dim > 256:
                    return (f"cudnn: the {name} head dim must be a multiple of 8 and at most 256 "
                            f"(128 before Hopper), got {dim}")
            if shapes.seqlen_q < 1 or shapes.seqlen_kv < 1:
                return "cudnn: empty sequences"
            widest = max(shapes.seqlen_q * shapes.num_heads, shapes.seqlen_kv * shapes.num_kv_heads)
            elements = shapes.batch * widest * max(shapes.head_dim_qk, shapes.head_dim_v)
            ragged = spec.uses_segments and spec.sequence_format != SequenceFormat.SEQLENS
            if ragged and elements >= 2 ** 31:
                return (f"cudnn: packed segments are addressed by int32 element offsets, but an "
                        f"operand has {elements} elements; split the batch")
        reason = cudnn_library.available()
        if reason is not None:
            return f"cudnn: {reason}"
        major, minor = _compute_capability()
        if major < 8:
            return (f"cudnn: fused attention needs compute capability 8.0 or newer, this GPU has "
                    f"{major}.{minor}; use backend='xla'")
        if shapes is None:
            return None
        dropout = shapes.dropout and spec.dropout_rate > 0
        static = _static(spec, _default_scale(spec, shapes.head_dim_qk), dropout,
                         shapes.has_bias_array, shapes.seqlen_q, shapes.seqlen_kv)
        bias_b, bias_h = shapes.bias_shape[:2] if shapes.has_bias_array else (0, 0)
        params = _graph_params(static, shapes.batch, shapes.num_heads, shapes.num_kv_heads,
                               shapes.seqlen_q, shapes.seqlen_kv, shapes.head_dim_qk,
                               shapes.head_dim_v, shapes.dtype, bias_b, bias_h)
        why = cudnn_library.check(params, static.scale, static.dropout_rate, _device_ordinal())
        if why is not None:
            version = cudnn_library.version_string(cudnn_library.cudnn_version())
            return (f"cudnn: cuDNN {version} on compute capability "
                    f"{major}.{minor} cannot run this call: {why}")
        return None

    def fp8_kernel(self, spec: AttentionSpec, shapes: CallShapes | None, platform: str) -> str:
        """explain()'s note on what an FP8 call runs."""
        passes = ("one cuDNN call per direction (delayed scaling: no probe pass)"
                  if spec.fp8_scaling == Fp8Scaling.DELAYED else
                  "current scaling: a probe forward and two probe backwards measure this "
                  "call's amaxes of O, dS, dQ, dK, dV first")
        return ("cuDNN's FP8 SDPA graphs: q, k, v, P, O, dO, dS, dQ, dK, dV in FP8 with "
                f"per-tensor scales; {passes}")

    def fp8_attention(self, spec: AttentionSpec, args: CanonicalArgs, scale: float,
                      state: fp8.Fp8State):
        """(out [b, sq, h, dv], the new Fp8State, max_logit float32 [h]) of an FP8 call
        through cuDNN's FP8 graphs (fp8_vjp.py). max_logit comes from the shared pass
        (ops/max_logit.py) over the FP8 operands as the kernel reads them, the emulation's
        definition: under jit it is not computed unless used."""
        reason = cudnn_library.available()
        if reason is not None:
            raise RuntimeError(f"cudnn: {reason}")
        q, k, v = (jnp.asarray(x) for x in (args.q, args.k, args.v))
        call = _static(spec, scale, False, False, q.shape[1], k.shape[1])
        out, new_state = fp8_vjp.attention(spec, call, q, k, v, state)
        read = {}
        for name, x in (("q", q), ("k", k)):
            x8, _, x_scale = fp8.quantise_input(spec, state, name, jax.lax.stop_gradient(x))
            read[name] = fp8.dequantise(x8, x_scale)
        largest = max_logit.max_logit(spec, args._replace(q=read["q"], k=read["k"]), scale)
        return out, new_state, largest

    def attention(self, spec: AttentionSpec, args: CanonicalArgs, scale: float) -> jax.Array:
        reason = cudnn_library.available()
        if reason is not None:
            raise RuntimeError(f"cudnn: {reason}")
        q, k, v = (jnp.asarray(x) for x in (args.q, args.k, args.v))
        if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"cudnn: q, k and v must share one dtype, bfloat16 or float16; got "
                             f"{q.dtype}, {k.dtype} and {v.dtype}. Cast them, or use backend='xla'.")
        h = q.shape[2]
        if spec.bias in (BiasType.PRE_SCALE_BIAS, BiasType.POST_SCALE_BIAS):
            if args.bias is None:
                raise ValueError(f"bias: config.bias {str(spec.bias)!r} needs a bias array")
            bias = jnp.asarray(args.bias)
            if spec.bias == BiasType.PRE_SCALE_BIAS:  # (s + bias) * scale = s * scale + bias * scale
                bias = bias.astype(jnp.float32) * jnp.float32(scale)
            bias = bias.astype(q.dtype)
            has_bias = True
        else:  # no bias, or ALiBi, which cuDNN derives from the head count and positions
            reason = _alibi_reason(spec, args.bias is not None)
            if reason is not None:
                raise ValueError(f"{reason}.")
            bias, has_bias = np.zeros((1, 1, 1, 1), q.dtype), False  # unread (see _UNREAD_INT32)
        dropout = args.dropout_seed is not None and spec.dropout_rate > 0
        if dropout:
            seed = jnp.asarray(args.dropout_seed).astype(jnp.uint32).reshape(2)
            rng = jnp.concatenate([seed, jnp.zeros((2,), jnp.uint32)])  # int64 seed, offset 0
        else:
            rng = _UNREAD_UINT32
        if spec.softmax != SoftmaxType.VANILLA:
            if args.softmax_offset is None:
                raise ValueError(f"softmax_offset: config.softmax {str(spec.softmax)!r} needs a "
                                 f"float32 array of shape [h] = ({h},)")
            sink = jnp.asarray(args.softmax_offset, jnp.float32).reshape(h)
        else:
            sink = _UNREAD_FLOAT32
        static = _static(spec, scale, dropout, has_bias, q.shape[1], k.shape[1])
        segments = None
        if static.segments:
            segments = _segments(static, args)
            if segments.broken is not None:
                guard(segments.broken, _guard_message(spec, static), spec)
        return _cudnn(static, *partitioning.same_varying((q, k, v, bias, rng, sink, segments)))


def _fp8_reason(spec: AttentionSpec, shapes: CallShapes | None) -> str | None:
    """Why cuDNN's FP8 graphs cannot serve this FP8 call (None: they can)."""
    if spec.mask not in _FP8_MASKS or spec.uses_segments:
        return (f"cudnn: FP8 attention is served with masks 'no_mask', 'causal' and "
                f"'causal_bottom_right' on dense layouts, got config.mask {str(spec.mask)!r} "
                f"and layout {str(spec.qkv_layout)!r}; use backend 'xla' (the emulation)")
    if tuple(spec.window_size) != (-1, -1):
        return (f"cudnn: FP8 attention with a sliding window is not served (config.window_size "
                f"{tuple(spec.window_size)}); use backend 'xla'")
    if spec.dropout_rate > 0 and (shapes is None or shapes.dropout):
        return ("cudnn: FP8 attention with dropout is not served (cuDNN's FP8 graphs would draw "
                "their own mask, not the recipe's); set config.dropout_rate = 0 or use backend "
                "'xla'")
    if shapes is not None:
        dtype = jnp.dtype(shapes.dtype)
        if dtype not in _FP8_INPUT_DTYPES:
            return (f"cudnn: FP8 attention quantises bfloat16, float16 or float32 inputs or reads "
                    f"float8_e4m3fn ones, got {dtype.name}")
        for name, dim in (("q/k", shapes.head_dim_qk), ("v", shapes.head_dim_v)):
            if dim % 16 or dim > 256:
                return (f"cudnn: cuDNN's FP8 graphs need the {name} head dim a multiple of 16 "
                        f"and at most 256 (128 exactly for the backward on Hopper), got {dim}")
    reason = cudnn_library.available()
    if reason is not None:
        return f"cudnn: {reason}"
    version = cudnn_library.cudnn_version()
    if version < 90100 or version == 91000:
        return (f"cudnn: cuDNN's FP8 SDPA graphs need cuDNN 9.1.0 or newer, but not 9.10.0; "
                f"this process loaded cuDNN {cudnn_library.version_string(version)}; upgrade "
                "nvidia-cudnn-cu13, or use backend 'xla'")
    major, minor = _compute_capability()
    if major < 9:
        return (f"cudnn: FP8 attention needs compute capability 9.0 (Hopper) or newer (cuDNN's "
                f"FP8 SDPA graphs), this GPU has {major}.{minor}; use backend 'xla'")
    if shapes is None:
        return None
    static = _static(spec, _default_scale(spec, shapes.head_dim_qk), False, False,
                     shapes.seqlen_q, shapes.seqlen_kv)
    fp8_format = FP8_HYBRID if spec.fp8_format == Fp8Format.HYBRID else FP8_E4M3
    params = _graph_params(static, shapes.batch, shapes.num_heads, shapes.num_kv_heads,
                           shapes.seqlen_q, shapes.seqlen_kv, shapes.head_dim_qk,
                           shapes.head_dim_v, jnp.float8_e4m3fn, 0, 0, fp8_format)
    why = cudnn_library.check(params, static.scale, 0.0, _device_ordinal())
    if why is not None:
        return (f"cudnn: cuDNN {cudnn_library.version_string(version)} on compute "
                f"capability {major}.{minor} cannot run this FP8 call ({spec.fp8_format} "
                f"format): {why}")
    return None


def _alibi_reason(spec: AttentionSpec, slopes_given: bool) -> str | None:
    """Why cuDNN cannot serve this ALiBi call (None: it can, or the call has no ALiBi).

    cuDNN adds ALiBi only under a top-left causal mask (where |i - j| = i - j) and only
    with the standard slopes of the query heads (the ALiBi paper's, as the XLA backend's).
    """
    if spec.bias != BiasType.ALIBI:
        return None
    if slopes_given:
        return ("cudnn: ALiBi with given slopes is not served (cuDNN derives the standard "
                "slopes from the head count); pass no slopes, or use backend 'xla'")
    if spec.mask not in (MaskType.CAUSAL, MaskType.PADDING_CAUSAL):
        return (f"cudnn: ALiBi is served under masks 'causal' and 'padding_causal' only "
                f"(cuDNN adds it below a top-left diagonal), got {str(spec.mask)!r}; use "
                "backend 'xla'")
    return None


BACKEND = CudnnBackend()
