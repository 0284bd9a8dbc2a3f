"""The static configuration of a cuDNN call: the FFI attributes, hashable (_Static), and
the library's graph parameters, the key under which the library builds and caches the
call's graphs for the device (_graph_params, _device_ordinal)."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn.ops.enums import BiasType, SequenceFormat, SoftmaxType
from fusedattn.ops.spec import AttentionSpec


def _device() -> jax.Device:
    return jax.devices()[0]


def _graph_params(static: _Static, b: int, h: int, hkv: int, sq: int, skv: int, d: int, dv: int,
                  dtype, bias_b: int, bias_h: int, fp8: int = 0) -> tuple[int, ...]:
    """The library's graph parameters of a call (FusedattnCudnnCheck's order): what its
    handlers read off the operands and attributes. fp8: 0 for the bf16/fp16 graphs, else
    the FP8 graphs' format (FP8_E4M3 or FP8_HYBRID)."""
    return (b, h, hkv, sq, skv, d, dv, int(jnp.dtype(dtype) == jnp.bfloat16), int(static.causal),
            int(static.bottom_right), static.window_left, static.window_right, static.segments,
            int(static.ragged), static.max_seqlen_q or sq, static.max_seqlen_kv or skv,
            bias_b if static.has_bias else 0, bias_h if static.has_bias else 0,
            int(static.has_sink), int(static.alibi), int(static.deterministic), fp8)


# The library's FP8 formats (cudnn_common.h, enum Fp8): every tensor E4M3, or E5M2 for
# dO and dP in the backward.
FP8_E4M3, FP8_HYBRID = 1, 2


class _Static(NamedTuple):
    """The attributes of both FFI calls (hashable: a nondiff argument).

    segments: 0 without a padding mask or packing (one dense sequence per row);
    else cuDNN runs one batch entry per segment slot, `segments` slots per row.
    ragged: segments may start anywhere in their row (cuDNN's ragged offsets);
    without it each row holds one segment from its first token (the seqlens form).
    max_seqlen_q / max_seqlen_kv: with ragged, the declared bounds on a segment's
    length when tighter than the row (0: the row); cuDNN's work scales with them.
    alibi: cuDNN adds ALiBi, -slope_h * (query position - key position), with the
    standard slopes of the call's query heads (so the heads never shard).
    """

    scale: float
    dropout_rate: float
    causal: bool
    bottom_right: bool
    window_left: int
    window_right: int
    segments: int
    ragged: bool
    max_seqlen_q: int
    max_seqlen_kv: int
    has_bias: bool
    has_sink: bool
    alibi: bool
    deterministic: bool

    def attributes(self, training: bool = True) -> dict:
        """The FFI attributes; training=False (the forward only) builds cuDNN's graph
        without stats."""
        return dict(scale=np.float32(self.scale), dropout_rate=np.float32(self.dropout_rate),
                    causal=bool(self.causal), bottom_right=bool(self.bottom_right),
                    window_left=np.int64(self.window_left),
                    window_right=np.int64(self.window_right), segments=np.int64(self.segments),
                    ragged=bool(self.ragged), max_seqlen_q=np.int64(self.max_seqlen_q),
                    max_seqlen_kv=np.int64(self.max_seqlen_kv), has_bias=bool(self.has_bias),
                    has_sink=bool(self.has_sink), alibi=bool(self.alibi),
                    deterministic=bool(self.deterministic),
                    training=bool(training))

    @property
    def batch_per_row(self) -> int:
        """cuDNN batch entries (and rows of stats) per row of q."""
        return max(self.segments, 1)


def _static(spec: AttentionSpec, scale: float, dropout: bool, has_bias: bool, seqlen_q: int,
            seqlen_kv: int) -> _Static:
    seqlens = spec.sequence_format == SequenceFormat.SEQLENS
    ragged = spec.uses_segments and not seqlens

    def bound(declared, extent):
        return declared if ragged and declared and declared < extent else 0

    return _Static(
        scale=float(scale),
        dropout_rate=float(spec.dropout_rate) if dropout else 0.0,
        causal=spec.mask.is_causal,
        bottom_right=spec.mask.is_bottom_right,
        window_left=int(spec.window_size[0]),
        window_right=int(spec.window_size[1]),
        segments=(1 if seqlens else spec.max_segments_per_seq) if spec.uses_segments else 0,
        ragged=ragged,
        max_seqlen_q=bound(spec.max_seqlen_q, seqlen_q),
        max_seqlen_kv=bound(spec.max_seqlen_kv, seqlen_kv),
        has_bias=has_bias,
        has_sink=spec.softmax != SoftmaxType.VANILLA,
        alibi=spec.bias == BiasType.ALIBI,
        deterministic=spec.deterministic_backward,
    )


def _default_scale(spec: AttentionSpec, head_dim: int) -> float:
    return spec.scale if spec.scale is not None else 1.0 / math.sqrt(head_dim)


def _device_ordinal() -> int:
    device = _device()
    ordinal = getattr(device, "local_hardware_id", None)
    return int(ordinal) if ordinal is not None else int(device.id)
