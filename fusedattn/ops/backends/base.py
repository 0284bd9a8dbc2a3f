"""What every backend receives: the call in canonical form, and the Backend protocol.

Every QKV layout is reduced to three BSHD arrays, and every mask and sequence
descriptor to per-token vectors, before a backend sees the call. One mask
predicate over those vectors (written once here for JAX and once in
ops_cuda/include/fusedattn/mask.h for the kernels) then serves all six masks,
windows, padding and packing:

    visible(b, i, j) =  q_seg[b, i] != 0  and  q_seg[b, i] == kv_seg[b, j]
                        and (not causal or kv_pos[b, j] <= q_pos[b, i] + q_diag[b, i])
                        and (left  < 0 or kv_pos[b, j] >= q_pos[b, i] + q_diag[b, i] - left)
                        and (right < 0 or kv_pos[b, j] <= q_pos[b, i] + q_diag[b, i] + right)

seg: segment id (0 = padding), pos: position within the segment, q_diag: how
far the mask's diagonal is shifted for that query's segment (0 top-left,
kv_len - q_len bottom-right).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from fusedattn.ops.spec import AttentionSpec


class TokenInfo(NamedTuple):
    """Per-token segment ids, positions and diagonal shifts, all int32.

    q_seg, q_pos, q_diag: [b, sq]; kv_seg, kv_pos: [b, skv].
    """

    q_seg: jax.Array
    q_pos: jax.Array
    q_diag: jax.Array
    kv_seg: jax.Array
    kv_pos: jax.Array


class CanonicalArgs(NamedTuple):
    """One attention call, layout-free.

    q: [b, sq, h, d]; k: [b, skv, h_kv, d]; v: [b, skv, h_kv, dv] (one dtype).
    bias: None, [b|1, h|1, sq, skv] for pre/post-scale bias, or [h] ALiBi slopes.
    softmax_offset: None, or float32 [h] (learnable; off_by_one passes zeros).
    dropout_seed: None (no dropout) or uint32 [2], the Philox key.
    sequence: the caller's SequenceDescriptor (None without padding or packing), for
      backends that read its lengths and offsets directly instead of `tokens`.
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    tokens: TokenInfo
    bias: jax.Array | None = None
    softmax_offset: jax.Array | None = None
    dropout_seed: jax.Array | None = None
    sequence: Any = None


@dataclasses.dataclass(frozen=True)
class CallShapes:
    """The static facts of a call that backends decide on (no array values)."""

    batch: int
    seqlen_q: int
    seqlen_kv: int
    num_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_v: int
    dtype: jnp.dtype
    bias_shape: tuple[int, ...] | None  # the bias array's [b|1, h|1, sq, skv]; None without one
    dropout: bool
    alibi_slopes: bool = False  # config.bias 'alibi' with slopes given (else the standard ones)
    # Paged layouts only (None otherwise): the pools' [num_pages, page_size] and the page
    # table's max_pages_per_seq; seqlen_kv is then one sequence's capacity, pages * page_size.
    num_pages: int | None = None
    page_size: int | None = None
    pages_per_seq: int | None = None

    @property
    def has_bias_array(self) -> bool:
        return self.bias_shape is not None


class Backend(Protocol):
    """A backend: says whether it can serve a call, and serves it differentiably."""

    name: str

    def masked_values_exact(self, spec: AttentionSpec, platform: str) -> bool:
        """Whether masked keys holding NaN/Inf contribute nothing to the call's output and
        gradients (selected out, not multiplied by a zero probability); where not,
        fused_attn guards the call (fusedattn.ops.masked_values)."""

    def supports(self, spec: AttentionSpec, shapes: CallShapes, platform: str) -> str | None:
        """None when this backend can serve the call on `platform`, else the reason."""

    def attention(self, spec: AttentionSpec, args: CanonicalArgs, scale: float) -> jax.Array:
        """Returns the [b, sq, h, dv] output; differentiable in q, k, v, bias, offset."""


def current_platform() -> str:
    """"cpu", "cuda" or "rocm" (or another JAX platform name) of the default device: the one
    `jax.default_device` sets, else the first device."""
    device = jax.config.jax_default_device
    if device is None:
        device = jax.devices()[0]
    elif isinstance(device, str):
        device = jax.devices(device)[0]
    if device.platform == "gpu":
        version = device.client.platform_version.lower()
        return "rocm" if "rocm" in version or "hip" in version else "cuda"
    return device.platform


def compute_capability() -> tuple[int, int]:
    """(major, minor) of the default device's CUDA compute capability; (0, 0) elsewhere."""
    text = getattr(jax.devices()[0], "compute_capability", "0.0")
    major, _, minor = str(text).partition(".")
    return int(major or 0), int(minor or 0)


def align256(size: int) -> int:
    """`size` rounded up to a multiple of 256 (the CUDA handlers' workspace parts)."""
    return -(-size // 256) * 256


def cuda_library_reason(backend: str) -> str | None:
    """Why the project's CUDA op library cannot run `backend`'s kernels on the default
    device: not built or loaded, or a GPU older than compute capability 8.0 (the kernels
    use cp.async and mma.sync); None when it can."""
    from fusedattn.ops import _library

    reason = _library.available("cuda")
    if reason is not None:
        return f"{backend}: {reason}"
    major, minor = compute_capability()
    if major < 8:
        return (f"{backend}: the CUDA kernels need compute capability 8.0 or newer, this GPU "
                f"has {major}.{minor}; use backend='xla'")
    return None


def visible_mask(spec: AttentionSpec, tokens: TokenInfo) -> jax.Array:
    """The predicate above as a boolean [b, 1, sq, skv] array (broadcast over heads)."""
    q_seg = tokens.q_seg[:, :, None]
    kv_seg = tokens.kv_seg[:, None, :]
    visible = (q_seg != 0) & (q_seg == kv_seg)
    diagonal = (tokens.q_pos + tokens.q_diag)[:, :, None]
    kv_pos = tokens.kv_pos[:, None, :]
    left, right = spec.window_size
    if spec.mask.is_causal:
        visible &= kv_pos <= diagonal
    if left >= 0:
        visible &= kv_pos >= diagonal - left
    if right >= 0:
        visible &= kv_pos <= diagonal + right
    return visible[:, None]


def guard(broken: jax.Array, message: str, spec: AttentionSpec) -> None:
    """Surfaces data that breaks a backend's declared bounds, without a host sync.

    `broken` is a boolean array computed on the device. With concrete values (eager
    use) a true entry raises ValueError(message) at once; under tracing, when
    spec.check_bounds (config.sequence.check_bounds) is set, the same message goes
    through jax.experimental.checkify (reported when the caller wraps the function
    with checkify.checkify). Either way the backend also marks the broken outputs
    NaN, so they never pass as plausible numbers.

    The checkify check is an effect: a jitted function holding one leaves JAX's
    C++ dispatch fast path (about 0.1 ms more host time per call on a CPU host),
    which shows when a call's device time is shorter than its dispatch.
    check_bounds=False drops the check and keeps the NaN marks.
    """
    broken = jnp.any(broken)
    if not isinstance(broken, jax.core.Tracer):
        if bool(broken):
            raise ValueError(message)
        return
    if spec.check_bounds:
        checkify.debug_check(jnp.logical_not(broken), message)
