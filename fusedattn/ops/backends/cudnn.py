"""The "cudnn" backend: cuDNN's fused SDPA through the cuDNN frontend graph API.

Kernels: ops_cuda/cudnn/cudnn_sdpa.cc, built into libfusedattn_cudnn (a
library of its own, built when the nvidia-cudnn-frontend and nvidia-cudnn-cu13
headers are found at install time). libcudnn itself is loaded at run time: the
libcudnn.so.9 JAX's CUDA plugin already loaded, else the one of the
nvidia-cudnn wheel. Two XLA FFI calls around a `jax.custom_vjp`:

    fusedattn_cudnn_fwd(q, k, v, bias, seqlen_q, seqlen_kv, rng, sink) -> (o, stats)
    fusedattn_cudnn_bwd(q, k, v, bias, seqlen_q, seqlen_kv, rng, sink, o, stats, do)
        -> (dq, dk, dv, dbias, dsink)

q/k/v are the canonical [b, s, h, d] arrays, read by cuDNN as strided
[b, h, s, d] views (no transposes); stats is cuDNN's float32 log-sum-exp
[b, h, sq, 1], saved for the backward. Graphs are built once per static
configuration and device and cached in the library; `supports` builds them
(forward and backward) at trace time, so a configuration cuDNN cannot run is
rejected with cuDNN's own reason and "auto" moves on to flash or xla.

What it serves (everything else is rejected by `supports` with the reason):

- layouts that reduce to BSHD (bs3hd, bshd_*, sbhd_*; not THD), bf16/fp16,
  head dims multiples of 8 up to 128 (256 on Hopper), GQA/MQA;
- masks no_mask, causal, causal_bottom_right and, with
  config.sequence.format = "seqlens" (one left-aligned sequence per row, from
  SequenceDescriptor.from_seqlens), their padding variants; per-row lengths
  are counted from the token vectors. Query rows with no visible key output
  zeros and get zero gradients (masked here: cuDNN leaves padded rows unset);
- sliding windows (window_size, inclusive, from the mask's diagonal);
- post-scale bias [b|1, h|1, sq, skv] with its gradient, and pre-scale bias
  as the post-scale bias `bias * scale` (not combined with padding masks);
- softmax "off_by_one" and "learnable" through cuDNN's sink token (cuDNN >= 9.13),
  with the offset's gradient;
- dropout with cuDNN's own Philox generator: seed = the dropout key's two
  words as one int64, offset 0. The mask is NOT the one of the shared Philox
  dropout (fusedattn/ops/philox.py) that the xla and flash backends draw, so
  dropout outputs match the other backends only in distribution; the same key
  gives the same mask (forward and backward agree, runs repeat);
- deterministic backward (config.deterministic_backward) through cuDNN's
  deterministic algorithm.

Under jax.vmap (vmap_method="broadcast_all") the mapped axes fold into the
batch. The dropout seed and the sink offsets are read from the first mapped
example, so a vmap over different dropout keys draws one mask stream for the
folded batch (each example's rows still differ) and a vmap over different
softmax offsets is not supported.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util
import math
import os
import sys
import threading
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn.ops import _library
from fusedattn.ops.backends.base import CallShapes, CanonicalArgs
from fusedattn.ops.enums import BiasType, SequenceFormat, SoftmaxType
from fusedattn.ops.spec import AttentionSpec

FWD_TARGET = "fusedattn_cudnn_fwd"
BWD_TARGET = "fusedattn_cudnn_bwd"
TARGETS = {FWD_TARGET: "FusedattnCudnnFwd", BWD_TARGET: "FusedattnCudnnBwd"}
LIBRARY_STEM = "fusedattn_cudnn"
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MESSAGE_BYTES = 4096


# ---- the library ------------------------------------------------------------------

class _State:
    lock = threading.Lock()
    reason: str | None = "not loaded yet"
    loaded = False
    lib: ctypes.CDLL | None = None
    version = 0


def _site_dirs() -> list[Path]:
    """sys.path entries, then the locations of an importable `nvidia` namespace package."""
    dirs = [Path(p) for p in sys.path if p]
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        parent = Path(location).parent
        if parent not in dirs:
            dirs.append(parent)
    return dirs


def _wheel_libraries(pattern: str) -> list[str]:
    """Files matching nvidia/<pattern> in every sys.path entry (the CUDA wheels' layout)."""
    found: list[str] = []
    for d in _site_dirs():
        found.extend(sorted(glob.glob(str(d / "nvidia" / pattern))))
    return found


def _loaded_libraries(name_prefix: str) -> list[str]:
    """Paths of already-mapped shared objects whose file name starts with name_prefix."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(name_prefix))


def _choose_cudart() -> None:
    """Points the cuDNN frontend's own libcudart loader at the runtime JAX uses.

    The frontend (dynamic loading) dlopens libcudart.so.12 or .13 by itself and takes
    the first it finds; CUDNN_FRONTEND_CUDART_LIB_NAME selects one explicitly.
    """
    if os.environ.get("CUDNN_FRONTEND_CUDART_LIB_NAME"):
        return
    candidates = (_loaded_libraries("libcudart.so.13") + _loaded_libraries("libcudart.so.12")
                  + _wheel_libraries("cu13/lib/libcudart.so.13")
                  + _wheel_libraries("cuda_runtime/lib/libcudart.so.1*"))
    for path in candidates:
        if os.path.isfile(path):
            os.environ["CUDNN_FRONTEND_CUDART_LIB_NAME"] = path
            return


def _load() -> str | None:
    if not _library._has_jax_backend("CUDA"):
        return "jax has no CUDA backend in this process"
    path = _library.library_path(LIBRARY_STEM)
    if path is None:
        return ("the cuDNN backend library was not built (lib" + LIBRARY_STEM + " not found: it "
                "needs nvcc and the headers of the nvidia-cudnn-frontend and nvidia-cudnn-cu13 "
                "wheels at install time); pip install nvidia-cudnn-frontend nvidia-cudnn-cu13, "
                "then reinstall fusedattn")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as error:
        return f"could not load {path}: {error}"
    lib.FusedattnCudnnLoad.restype = ctypes.c_int64
    lib.FusedattnCudnnLoad.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int64]
    lib.FusedattnCudnnCheck.restype = ctypes.c_int64
    lib.FusedattnCudnnCheck.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int64,
                                        ctypes.c_float, ctypes.c_float, ctypes.c_int64,
                                        ctypes.c_char_p, ctypes.c_int64]
    _choose_cudart()
    message = ctypes.create_string_buffer(_MESSAGE_BYTES)
    version = lib.FusedattnCudnnLoad(None, message, _MESSAGE_BYTES)
    errors = [message.value.decode(errors="replace")]
    if not version:
        for candidate in _wheel_libraries("cudnn/lib/libcudnn.so.9"):
            version = lib.FusedattnCudnnLoad(candidate.encode(), message, _MESSAGE_BYTES)
            if version:
                break
            errors.append(message.value.decode(errors="replace"))
    if not version:
        return "could not load libcudnn: " + "; ".join(errors)
    try:
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="CUDA")
    except (AttributeError, ValueError, RuntimeError) as error:
        return f"could not register the handlers of {path}: {error}"
    _State.lib, _State.version = lib, int(version)
    return None


def available() -> str | None:
    """None when the cuDNN backend library and libcudnn are loaded, else why not."""
    with _State.lock:
        if not _State.loaded:
            _State.reason = _load()
            _State.loaded = True
        return _State.reason


def cudnn_version() -> int:
    """cuDNN's version as loaded (e.g. 91000 for 9.10.0); 0 when not loaded."""
    return _State.version if available() is None else 0


def _version_string(version: int) -> str:
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


def _device() -> jax.Device:
    return jax.devices()[0]


def _compute_capability() -> tuple[int, int]:
    text = getattr(_device(), "compute_capability", "0.0")
    major, _, minor = str(text).partition(".")
    return int(major or 0), int(minor or 0)


@functools.lru_cache(maxsize=4096)
def _check(params: tuple[int, ...], scale: float, dropout: float, device: int) -> str | None:
    """Builds the forward and backward graphs (cached in the library); None or cuDNN's reason."""
    values = (ctypes.c_int64 * len(params))(*params)
    message = ctypes.create_string_buffer(_MESSAGE_BYTES)
    ok = _State.lib.FusedattnCudnnCheck(values, len(params), scale, dropout, device, message,
                                        _MESSAGE_BYTES)
    return None if ok else message.value.decode(errors="replace")


# ---- the static configuration of a call ---------------------------------------------

class _Static(NamedTuple):
    """The attributes of both FFI calls (hashable: a nondiff argument)."""

    scale: float
    dropout_rate: float
    causal: bool
    bottom_right: bool
    window_left: int
    window_right: int
    padding: bool
    has_bias: bool
    has_sink: bool
    deterministic: bool

    def attributes(self) -> dict:
        return dict(scale=np.float32(self.scale), dropout_rate=np.float32(self.dropout_rate),
                    causal=bool(self.causal), bottom_right=bool(self.bottom_right),
                    window_left=np.int64(self.window_left),
                    window_right=np.int64(self.window_right), padding=bool(self.padding),
                    has_bias=bool(self.has_bias), has_sink=bool(self.has_sink),
                    deterministic=bool(self.deterministic))


def _static(spec: AttentionSpec, scale: float, dropout: bool, has_bias: bool) -> _Static:
    return _Static(
        scale=float(scale),
        dropout_rate=float(spec.dropout_rate) if dropout else 0.0,
        causal=spec.mask.is_causal,
        bottom_right=spec.mask.is_bottom_right,
        window_left=int(spec.window_size[0]),
        window_right=int(spec.window_size[1]),
        padding=spec.mask.is_padding,
        has_bias=has_bias,
        has_sink=spec.softmax != SoftmaxType.VANILLA,
        deterministic=spec.deterministic_backward,
    )


def _default_scale(spec: AttentionSpec, head_dim: int) -> float:
    return spec.scale if spec.scale is not None else 1.0 / math.sqrt(head_dim)


# ---- the op --------------------------------------------------------------------------

def _row_has_keys(static: _Static, q_len, kv_len, seqlen_q: int):
    """bool [b, sq]: query i < q_len has at least one visible key (padding form)."""
    i = jnp.arange(seqlen_q, dtype=jnp.int32)[None, :]
    q_len, kv_len = q_len[:, None], kv_len[:, None]
    diagonal = i + (kv_len - q_len if static.bottom_right else 0)
    high = kv_len - 1
    if static.causal:
        high = jnp.minimum(high, diagonal)
    elif static.window_right >= 0:
        high = jnp.minimum(high, diagonal + static.window_right)
    low = jnp.maximum(diagonal - static.window_left, 0) if static.window_left >= 0 else 0
    return (i < q_len) & (low <= high)


def _forward_call(static: _Static, q, k, v, bias, q_len, kv_len, rng, sink):
    b, sq, h, _ = q.shape
    call = jax.ffi.ffi_call(
        FWD_TARGET,
        (jax.ShapeDtypeStruct((b, sq, h, v.shape[-1]), q.dtype),
         jax.ShapeDtypeStruct((b, h, sq, 1), jnp.float32)),
        vmap_method="broadcast_all",
    )
    o, stats = call(q, k, v, bias, q_len, kv_len, rng, sink, **static.attributes())
    if static.padding:
        rows = _row_has_keys(static, q_len, kv_len, sq)
        o = jnp.where(rows[:, :, None, None], o, jnp.zeros((), o.dtype))
    return o, stats


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cudnn(static: _Static, q, k, v, bias, q_len, kv_len, rng, sink):
    return _forward_call(static, q, k, v, bias, q_len, kv_len, rng, sink)[0]


def _cudnn_fwd(static: _Static, q, k, v, bias, q_len, kv_len, rng, sink):
    o, stats = _forward_call(static, q, k, v, bias, q_len, kv_len, rng, sink)
    return o, (q, k, v, bias, q_len, kv_len, rng, sink, o, stats)


def _cudnn_bwd(static: _Static, residuals, do):
    q, k, v, bias, q_len, kv_len, rng, sink, o, stats = residuals
    do = do.astype(o.dtype)
    if static.padding:
        rows = _row_has_keys(static, q_len, kv_len, q.shape[1])
        do = jnp.where(rows[:, :, None, None], do, jnp.zeros((), do.dtype))
        # A row without keys contributes nothing: exp(s - huge) = 0 whatever cuDNN left there.
        stats = jnp.where(rows[:, None, :, None], stats, jnp.float32(1e30))
    call = jax.ffi.ffi_call(
        BWD_TARGET,
        (jax.ShapeDtypeStruct(q.shape, q.dtype),
         jax.ShapeDtypeStruct(k.shape, k.dtype),
         jax.ShapeDtypeStruct(v.shape, v.dtype),
         jax.ShapeDtypeStruct(bias.shape, bias.dtype),
         jax.ShapeDtypeStruct(sink.shape, jnp.float32)),
        vmap_method="broadcast_all",
    )
    dq, dk, dv, dbias, dsink = call(q, k, v, bias, q_len, kv_len, rng, sink, o, stats, do,
                                    **static.attributes())
    if static.padding:
        dq = jnp.where(rows[:, :, None, None], dq, jnp.zeros((), dq.dtype))
        keys = jnp.arange(k.shape[1], dtype=jnp.int32)[None, :] < kv_len[:, None]
        dk = jnp.where(keys[:, :, None, None], dk, jnp.zeros((), dk.dtype))
        dv = jnp.where(keys[:, :, None, None], dv, jnp.zeros((), dv.dtype))
    if not static.has_bias:
        dbias = jnp.zeros_like(bias)
    if not static.has_sink:
        dsink = jnp.zeros_like(sink)
    return dq, dk, dv, dbias, None, None, None, dsink


_cudnn.defvjp(_cudnn_fwd, _cudnn_bwd)


def _lengths(segments) -> jax.Array:
    """Per-row count of tokens in a segment (int32 [b]): the length in the seqlens form."""
    return jnp.sum(jnp.asarray(segments) != 0, axis=1, dtype=jnp.int32)


class CudnnBackend:
    name = "cudnn"

    def supports(self, spec: AttentionSpec, shapes: CallShapes | None, platform: str) -> str | None:
        platform = (platform or "").lower()
        if platform not in ("cuda", "gpu"):
            return f"cudnn: needs a CUDA GPU; this computation runs on {platform}"
        if spec.qkv_layout.is_thd:
            return (f"cudnn: THD (packed) layouts are not served by this version, got "
                    f"{str(spec.qkv_layout)!r}; use backend 'flash' or 'xla'")
        if spec.bias == BiasType.ALIBI:
            return "cudnn: ALiBi is not served (cuDNN's ALiBi differs); use backend 'xla'"
        if spec.mask.is_padding:
            if spec.sequence_format != SequenceFormat.SEQLENS:
                return ("cudnn: padding masks need config.sequence.format = 'seqlens' (one "
                        "left-aligned sequence per row, SequenceDescriptor.from_seqlens), got "
                        f"{str(spec.sequence_format)!r}; other descriptor forms are not expressible "
                        "as cuDNN sequence lengths")
            if spec.bias != BiasType.NO_BIAS:
                return (f"cudnn: padding masks with config.bias {str(spec.bias)!r} are not served "
                        "(cuDNN's bias gradient is not defined at padded positions)")
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
        reason = available()
        if reason is not None:
            return f"cudnn: {reason}"
        major, minor = _compute_capability()
        if major < 8:
            return (f"cudnn: fused attention needs compute capability 8.0 or newer, this GPU has "
                    f"{major}.{minor}")
        if shapes is None:
            return None
        dropout = shapes.dropout and spec.dropout_rate > 0
        static = _static(spec, _default_scale(spec, shapes.head_dim_qk), dropout,
                         shapes.has_bias_array)
        params = (shapes.batch, shapes.num_heads, shapes.num_kv_heads, shapes.seqlen_q,
                  shapes.seqlen_kv, shapes.head_dim_qk, shapes.head_dim_v,
                  int(jnp.dtype(shapes.dtype) == jnp.bfloat16), int(static.causal),
                  int(static.bottom_right), static.window_left, static.window_right,
                  int(static.padding), shapes.batch if static.has_bias else 0,
                  shapes.num_heads if static.has_bias else 0, int(static.has_sink),
                  int(static.deterministic))
        why = _check(params, static.scale, static.dropout_rate, _device_ordinal())
        if why is not None:
            return (f"cudnn: cuDNN {_version_string(_State.version)} on compute capability "
                    f"{major}.{minor} cannot run this call: {why}")
        return None

    def attention(self, spec: AttentionSpec, args: CanonicalArgs, scale: float) -> jax.Array:
        reason = available()
        if reason is not None:
            raise RuntimeError(f"cudnn: {reason}")
        q, k, v = (jnp.asarray(x) for x in (args.q, args.k, args.v))
        if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"cudnn: q, k and v must share one dtype, bfloat16 or float16; got "
                             f"{q.dtype}, {k.dtype} and {v.dtype}. Cast them, or use backend='xla'.")
        b, sq, h, _ = q.shape
        if spec.bias in (BiasType.PRE_SCALE_BIAS, BiasType.POST_SCALE_BIAS):
            if args.bias is None:
                raise ValueError(f"bias: config.bias {str(spec.bias)!r} needs a bias array")
            bias = jnp.asarray(args.bias)
            if spec.bias == BiasType.PRE_SCALE_BIAS:  # (s + bias) * scale = s * scale + bias * scale
                bias = bias.astype(jnp.float32) * jnp.float32(scale)
            bias = bias.astype(q.dtype)
            has_bias = True
        elif spec.bias == BiasType.NO_BIAS:
            bias, has_bias = jnp.zeros((1, 1, 1, 1), q.dtype), False
        else:
            raise ValueError(f"cudnn: config.bias {str(spec.bias)!r} is not served; use "
                             "backend='xla'")
        dropout = args.dropout_seed is not None and spec.dropout_rate > 0
        if dropout:
            seed = jnp.asarray(args.dropout_seed).astype(jnp.uint32).reshape(2)
            rng = jnp.concatenate([seed, jnp.zeros((2,), jnp.uint32)])  # int64 seed, offset 0
        else:
            rng = jnp.zeros((4,), jnp.uint32)
        if spec.softmax != SoftmaxType.VANILLA:
            if args.softmax_offset is None:
                raise ValueError(f"softmax_offset: config.softmax {str(spec.softmax)!r} needs a "
                                 f"float32 array of shape [h] = ({h},)")
            sink = jnp.asarray(args.softmax_offset, jnp.float32).reshape(h)
        else:
            sink = jnp.zeros((h,), jnp.float32)
        if spec.mask.is_padding:
            q_len, kv_len = _lengths(args.tokens.q_seg), _lengths(args.tokens.kv_seg)
        else:
            q_len = kv_len = jnp.zeros((b,), jnp.int32)
        static = _static(spec, scale, dropout, has_bias)
        return _cudnn(static, q, k, v, bias, q_len, kv_len, rng, sink)


def _device_ordinal() -> int:
    device = _device()
    ordinal = getattr(device, "local_hardware_id", None)
    return int(ordinal) if ordinal is not None else int(device.id)


BACKEND = CudnnBackend()
