"""The "decode" backend: the project's paged decode kernel (forward only).

Serves the paged layouts (fusedattn/ops/paged.py) for decoding: at most
MAX_QUERIES query tokens per sequence (one decode step, or a few draft tokens
verified at once in speculative decoding), every mask, sliding windows, GQA and
every softmax variant. Kernel contract: ops_cuda/include/fusedattn/paged_decode_ffi.h
(index math in paged.h), two builds: the host one (ops_cuda/host/paged_decode_host.cc)
on platform "cpu" (float32, bfloat16, float16, any head dims) and the CUDA one
(ops_cuda/cuda/paged_decode.cu; sm_80 and newer, bfloat16 and float16, head dims 64,
128 and 256 with dv = d), which splits the keys over several CTAs when the batch
would not fill the GPU and then takes a uint8 workspace result (sized here).

    fusedattn_paged_decode_fwd(q, k_pages, v_pages, page_table, q_start, q_len, kv_len,
                               softmax_offset) -> o  (CUDA: -> o, workspace)
    (q_start and softmax_offset empty where all zero: BSHD, vanilla and off_by_one)
    attributes: scale f32, causal bool, bottom_right bool, window_left i64,
                window_right i64, softmax_type i32, max_seqlen_q i64, max_seqlen_kv i64
                (config.sequence's bounds, -1 for none)

The kernels take the lengths as the caller gave them and find the broken sequences
themselves (paged.h: the q range in its row, the keys within the table and the pool, the
declared bounds), so paged.canonical computes nothing before them where no guard reads
its marks (jitted, config.sequence.check_bounds off): the call is the kernel alone.

Forward only: decoding takes no gradient, so the kernel keeps no softmax
statistics for a backward; jax.grad through it raises and names backend='xla',
whose paged path is differentiable. Not vmappable (a vmap over page pools has no
use in decoding; the batch is the sequences).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn.ops import _library
from fusedattn.ops.backends.base import (CallShapes, align256, cuda_library_reason,
                                         current_platform)
from fusedattn.ops.enums import SoftmaxType
from fusedattn.ops.paged import PagedArgs
from fusedattn.ops.spec import AttentionSpec

TARGET = "fusedattn_paged_decode_fwd"
MAX_QUERIES = 8
_SOFTMAX_TYPES = {SoftmaxType.VANILLA: 0, SoftmaxType.OFF_BY_ONE: 1, SoftmaxType.LEARNABLE: 2}
_CUDA_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_CUDA_HEAD_DIMS = (64, 128, 256)

# The CUDA kernel's workspace (ops_cuda/cuda/paged_decode.cu reads how many splits it holds
# from its size): int32 [S] flags, then float32 m and l [splits, b * sq * h] and the
# accumulators [splits, b * sq * h, dv], each part 256-byte aligned. The kernel splits only
# while its CTAs (at least S * h_kv) fill less than one wave of the GPU, so a bound on any
# GPU's resident CTAs bounds the splits; each split gets at least _MIN_SPLIT_KEYS keys.
_MAX_RESIDENT_CTAS = 2048
_MIN_SPLIT_KEYS = 256  # the kernel's kMinSplitKeys


def _cuda_workspace_bytes(q_shape, kv_heads: int, head_dim_v: int, sequences: int,
                         capacity: int) -> int:
    """Bytes of the CUDA kernel's workspace for q [b, sq, h, d] and `sequences` page-table
    rows of `capacity` keys each."""
    b, sq, h = q_shape[:3]
    flags = align256(max(sequences, 1) * 4)
    ctas = sequences * kv_heads
    if ctas == 0 or ctas >= _MAX_RESIDENT_CTAS:
        return flags
    splits = min(-(-_MAX_RESIDENT_CTAS // ctas), -(-capacity // _MIN_SPLIT_KEYS))
    if splits <= 1:
        return flags
    stats = splits * b * sq * h * 4
    return flags + 2 * align256(stats) + stats * head_dim_v


def _cuda_reason(dtype, head_dim: int, head_dim_v: int) -> str | None:
    """Why the CUDA kernel cannot serve a call (None: it can)."""
    reason = cuda_library_reason("decode")
    if reason is not None:
        return reason
    if jnp.dtype(dtype) not in _CUDA_DTYPES:
        return (f"decode: the CUDA kernel takes bfloat16 or float16 inputs, got "
                f"{jnp.dtype(dtype).name}; cast q and the page pools, or use backend='xla'")
    if head_dim not in _CUDA_HEAD_DIMS or head_dim_v != head_dim:
        return (f"decode: the CUDA kernel serves head dims 64, 128 and 256 with v's head dim "
                f"equal to q's, got {head_dim} and {head_dim_v}; use backend='xla'")
    return None


def _platform_reason(platform: str, dtype, head_dim: int, head_dim_v: int) -> str | None:
    """Why the build of `platform` cannot serve a call of q's dtype and head dims (None: it
    can)."""
    if platform in ("gpu", "cuda"):
        return _cuda_reason(dtype, head_dim, head_dim_v)
    if platform != "cpu":
        return (f"decode: the paged decode kernel exists for cpu (host build) and CUDA GPUs; "
                f"this computation runs on {platform}; use backend='xla'")
    reason = _library.available("cpu")
    return None if reason is None else f"decode: {reason}"


def query_bound(spec: AttentionSpec, shapes: CallShapes) -> int:
    """The static bound on a sequence's query count: declared bound vs the q row extent."""
    return min(spec.max_seqlen_q or shapes.seqlen_q, shapes.seqlen_q)


def _bound_attribute(bound: int | None) -> int:
    """A declared config.sequence bound as the kernel's attribute (-1: none)."""
    return -1 if bound is None else int(bound)


class _Static(NamedTuple):
    """The kernel's attributes (hashable: a nondiff argument)."""

    scale: float
    causal: bool
    bottom_right: bool
    window_left: int
    window_right: int
    softmax_type: int
    max_seqlen_q: int  # -1: no bound
    max_seqlen_kv: int  # -1: no bound

    def attributes(self) -> dict:
        return dict(scale=np.float32(self.scale), causal=bool(self.causal),
                    bottom_right=bool(self.bottom_right),
                    window_left=np.int64(self.window_left),
                    window_right=np.int64(self.window_right),
                    softmax_type=np.int32(self.softmax_type),
                    max_seqlen_q=np.int64(self.max_seqlen_q),
                    max_seqlen_kv=np.int64(self.max_seqlen_kv))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _decode(static: _Static, workspace: int | None, q, k_pages, v_pages, page_table, q_start,
            q_len, kv_len, offset):
    """workspace: None (host build) or the CUDA kernel's workspace bytes."""
    results = (jax.ShapeDtypeStruct((*q.shape[:3], v_pages.shape[-1]), q.dtype),)
    if workspace is not None:
        results += (jax.ShapeDtypeStruct((workspace,), jnp.uint8),)
    return jax.ffi.ffi_call(TARGET, results)(
        q, k_pages, v_pages, page_table, q_start, q_len, kv_len, offset,
        **static.attributes())[0]


def _decode_fwd(static, workspace, *operands):
    return _decode(static, workspace, *operands), None


def _decode_bwd(static, workspace, residuals, do):
    raise ValueError(
        "decode: the paged decode kernel is forward only (decoding takes no gradient); for "
        "gradients through a paged call set config.backend='xla' (its paged path is "
        "differentiable in q and the page pools).")


_decode.defvjp(_decode_fwd, _decode_bwd)


class DecodeBackend:
    """Paged decoding with the project's kernel: the host build on "cpu", the CUDA kernel on
    NVIDIA GPUs (sm_80 and newer)."""

    name = "decode"
    serves_paged = True
    checks_sequences = True  # both builds find the broken sequences (paged.canonical)

    def supports(self, spec: AttentionSpec, shapes: CallShapes, platform: str) -> str | None:
        if not spec.qkv_layout.is_paged:
            return ("decode: serves the paged layouts only ('paged_kv_bshd_bshd_bshd', "
                    "'paged_kv_thd_bshd_bshd')")
        bound = query_bound(spec, shapes)
        if bound > MAX_QUERIES:
            return (f"decode: serves at most {MAX_QUERIES} query tokens per sequence (decoding, "
                    f"speculative verification), but the query bound is {bound} "
                    f"(config.sequence.max_seqlen_q={spec.max_seqlen_q}, q extent "
                    f"{shapes.seqlen_q}); declare config.sequence.max_seqlen_q <= {MAX_QUERIES}, "
                    "or use backend='xla' for prefill")
        return _platform_reason((platform or "").lower(), shapes.dtype, shapes.head_dim_qk,
                                shapes.head_dim_v)

    def attention(self, spec: AttentionSpec, args, scale: float) -> jax.Array:
        raise ValueError("decode: serves the paged layouts only; use another backend for "
                         f"layout {str(spec.qkv_layout)!r}")

    def paged_attention(self, spec: AttentionSpec, args: PagedArgs, scale: float) -> jax.Array:
        """The [b, sq, h, dv] output of a paged call (forward only)."""
        platform = current_platform()
        q = args.q
        _, page_size, h_kv, dv = args.v_pages.shape
        reason = _platform_reason(platform, q.dtype, q.shape[3], dv)
        if reason is not None:
            raise ValueError(reason)
        workspace = None
        if platform == "cuda":
            sequences, pages = args.page_table.shape
            workspace = _cuda_workspace_bytes(q.shape, h_kv, dv, sequences, pages * page_size)
        # Zero q_start (BSHD) and zero offsets go as empty operands (paged_decode_ffi.h): a
        # zero-filled one would cost a device op of its own before each call.
        q_start = args.q_start if spec.qkv_layout.is_thd else np.zeros((0,), np.int32)
        offset = (jnp.asarray(args.softmax_offset, jnp.float32)
                  if spec.softmax == SoftmaxType.LEARNABLE else np.zeros((0,), np.float32))
        static = _Static(scale=float(scale), causal=spec.mask.is_causal,
                         bottom_right=spec.mask.is_bottom_right,
                         window_left=int(spec.window_size[0]),
                         window_right=int(spec.window_size[1]),
                         softmax_type=_SOFTMAX_TYPES[spec.softmax],
                         max_seqlen_q=_bound_attribute(spec.max_seqlen_q),
                         max_seqlen_kv=_bound_attribute(spec.max_seqlen_kv))
        return _decode(static, workspace, args.q, args.k_pages, args.v_pages, args.page_table,
                       q_start, args.q_len, args.kv_len, offset)


BACKEND = DecodeBackend()
