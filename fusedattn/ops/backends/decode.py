"""The "decode" backend: the project's paged decode kernel (forward only).

Serves the paged layouts (fusedattn/ops/paged.py) for decoding: at most
MAX_QUERIES query tokens per sequence (one decode step, or a few draft tokens
verified at once in speculative decoding), every mask, sliding windows, GQA and
every softmax variant. Kernel contract: ops_cuda/include/fusedattn/paged_decode_ffi.h
(index math in paged.h); this version runs the host build (ops_cuda/host/
paged_decode_host.cc) on platform "cpu", the GPU kernel is not written yet.

    fusedattn_paged_decode_fwd(q, k_pages, v_pages, page_table, q_start, q_len, kv_len,
                               softmax_offset) -> o
    attributes: scale f32, causal bool, bottom_right bool, window_left i64,
                window_right i64, softmax_type i32

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
from fusedattn.ops.backends.base import CallShapes
from fusedattn.ops.enums import SoftmaxType
from fusedattn.ops.paged import PagedArgs
from fusedattn.ops.spec import AttentionSpec

TARGET = "fusedattn_paged_decode_fwd"
MAX_QUERIES = 8
_SOFTMAX_TYPES = {SoftmaxType.VANILLA: 0, SoftmaxType.OFF_BY_ONE: 1, SoftmaxType.LEARNABLE: 2}


def query_bound(spec: AttentionSpec, shapes: CallShapes) -> int:
    """The static bound on a sequence's query count: declared bound vs the q row extent."""
    return min(spec.max_seqlen_q or shapes.seqlen_q, shapes.seqlen_q)


class _Static(NamedTuple):
    """The kernel's attributes (hashable: a nondiff argument)."""

    scale: float
    causal: bool
    bottom_right: bool
    window_left: int
    window_right: int
    softmax_type: int

    def attributes(self) -> dict:
        return dict(scale=np.float32(self.scale), causal=bool(self.causal),
                    bottom_right=bool(self.bottom_right),
                    window_left=np.int64(self.window_left),
                    window_right=np.int64(self.window_right),
                    softmax_type=np.int32(self.softmax_type))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _decode(static: _Static, q, k_pages, v_pages, page_table, q_start, q_len, kv_len, offset):
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((*q.shape[:3], v_pages.shape[-1]),
                                                         q.dtype))(
        q, k_pages, v_pages, page_table, q_start, q_len, kv_len, offset, **static.attributes())


def _decode_fwd(static, *operands):
    return _decode(static, *operands), None


def _decode_bwd(static, residuals, do):
    raise ValueError(
        "decode: the paged decode kernel is forward only (decoding takes no gradient); for "
        "gradients through a paged call set config.backend='xla' (its paged path is "
        "differentiable in q and the page pools).")


_decode.defvjp(_decode_fwd, _decode_bwd)


class DecodeBackend:
    """Paged decoding with the project's kernel; the host build on "cpu" for now."""

    name = "decode"
    serves_paged = True

    def supports(self, spec: AttentionSpec, shapes: CallShapes, platform: str) -> str | None:
        if not spec.qkv_layout.is_paged:
            return ("decode: serves the paged layouts only ('paged_kv_bshd_bshd_bshd', "
                    "'paged_kv_thd_bshd_bshd')")
        platform = (platform or "").lower()
        if platform != "cpu":
            return (f"decode: only the host (cpu) build of the paged decode kernel exists; this "
                    f"computation runs on {platform}; use backend='xla'")
        bound = query_bound(spec, shapes)
        if bound > MAX_QUERIES:
            return (f"decode: serves at most {MAX_QUERIES} query tokens per sequence (decoding, "
                    f"speculative verification), but the query bound is {bound} "
                    f"(config.sequence.max_seqlen_q={spec.max_seqlen_q}, q extent "
                    f"{shapes.seqlen_q}); declare config.sequence.max_seqlen_q <= {MAX_QUERIES}, "
                    "or use backend='xla' for prefill")
        reason = _library.available("cpu")
        return None if reason is None else f"decode: {reason}"

    def attention(self, spec: AttentionSpec, args, scale: float) -> jax.Array:
        raise ValueError("decode: serves the paged layouts only; use another backend for "
                         f"layout {str(spec.qkv_layout)!r}")

    def paged_attention(self, spec: AttentionSpec, args: PagedArgs, scale: float) -> jax.Array:
        """The [b, sq, h, dv] output of a paged call (forward only)."""
        reason = _library.available("cpu")
        if reason is not None:
            raise RuntimeError(f"decode: {reason}")
        h = args.q.shape[2]
        offset = (jnp.zeros((h,), jnp.float32) if args.softmax_offset is None
                  else jnp.asarray(args.softmax_offset, jnp.float32))
        static = _Static(scale=float(scale), causal=spec.mask.is_causal,
                         bottom_right=spec.mask.is_bottom_right,
                         window_left=int(spec.window_size[0]),
                         window_right=int(spec.window_size[1]),
                         softmax_type=_SOFTMAX_TYPES[spec.softmax])
        return _decode(static, args.q, args.k_pages, args.v_pages, args.page_table,
                       args.q_start, args.q_len, args.kv_len, offset)


BACKEND = DecodeBackend()
