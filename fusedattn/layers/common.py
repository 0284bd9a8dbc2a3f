"""Framework-independent core of the attention layers (linen, NNX, Equinox).

Every layer does the same thing between its projections: optional QK
normalisation, rotary embeddings, the decode KV cache, turning an explicit
boolean mask into a bias, arranging q/k/v in the config's layout and calling
`fusedattn.ops.fused_attn`. That logic lives here once; the framework modules
only own parameters, state and randomness.

Shapes (all functions): `batch...` is any number of leading batch axes (the
layers flatten them into one for the op and restore them after), sq/skv the
query/key lengths, h/h_kv the query/key-value heads, d/dv the q-k/v head dims.

Explicit masks and backend choice: a boolean `mask` (True = attend) is given to
the op as a bias array, -inf where masked (exact at any logit size and dtype),
added to the config's bias (post-scale when the config has none). A bias array changes which backends can serve the
call; `fusedattn.ops.explain(qkv, config=..., bias=jax.ShapeDtypeStruct(...))`
shows every backend's verdict for it. Query rows that the explicit mask and the
config's mask together leave without any visible key output zeros (and get
zero gradients), as the op does for its own masks.

Context parallelism (config.context_parallel): the layer's inputs and output are in
the op's device layout (load-balanced token order when asked); RoPE positions and
the rows of an explicit mask are reordered to match, while the mask, bias and
SequenceDescriptor themselves describe the natural order, as in the op.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn import ops as _ops
from fusedattn.layers import stock
from fusedattn.ops import context_parallel
from fusedattn.ops.backends.base import guard, visible_mask
from fusedattn.ops.enums import (BackendName, BiasType, MaskType, QKVLayout, SequenceFormat,
                                 SoftmaxType)
from fusedattn.ops.sequence import SequenceDescriptor, dense_token_info
from fusedattn.ops.spec import AttentionSpec

Array = jax.Array

__all__ = [
    "KVCache", "LayerOptions", "apply_rope", "attend", "attention_fn", "broadcast_bias",
    "broadcast_mask", "core", "rope_frequencies", "spec_of", "spec_with_mask",
    "split_fused_qkv",
]

_PACKED = {
    # family -> (separate, kv packed, qkv packed)
    "bshd": (QKVLayout.BSHD_BSHD_BSHD, QKVLayout.BSHD_BS2HD, QKVLayout.BS3HD),
    "sbhd": (QKVLayout.SBHD_SBHD_SBHD, QKVLayout.SBHD_SB2HD, QKVLayout.SB3HD),
    "thd": (QKVLayout.THD_THD_THD, QKVLayout.THD_T2HD, QKVLayout.T3HD),
}


def spec_of(config: Any) -> AttentionSpec:
    """The validated AttentionSpec of an attention ConfigDict (or a spec, unchanged)."""
    return AttentionSpec.from_config(config)


# --------------------------------------------------------------------------- options


class OpExtras(NamedTuple):
    """What the op returned besides the output: the FP8 state after the call (config.fp8
    enabled, else None) and max_logit float32 [h] (when asked, else None)."""

    fp8_state: Any = None
    max_logit: Array | None = None


class LayerOptions(NamedTuple):
    """Static per-layer choices shared by the three frameworks.

    num_heads / num_kv_heads: query and key/value heads (GQA when fewer kv heads).
    fused_qkv: q, k and v come from one projection of the query input.
    rope_theta: base of the rotary embedding applied to q and k, or None (no RoPE).
    """

    num_heads: int
    num_kv_heads: int
    fused_qkv: bool = False
    rope_theta: float | None = None


def check_num_heads(num_heads) -> None:
    """ValueError unless num_heads is an int >= 1 (before anything divides by it)."""
    if (isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer))
            or num_heads < 1):
        raise ValueError(f"num_heads: expected an int >= 1, got {num_heads!r}.")


def check_options(num_heads: int, num_kv_heads: int | None, head_dim: int, *, rope: bool,
                  rope_theta: float, fused_qkv: bool, head_dim_v: int | None = None,
                  ) -> LayerOptions:
    """Validates head counts, head dims and feature flags at construction; returns LayerOptions."""
    check_num_heads(num_heads)
    for name, dim in (("q/k", head_dim), ("v", head_dim_v)):
        if dim is not None and dim < 1:
            raise ValueError(
                f"head dim: the {name} head dim is {dim}; each head needs at least one feature. "
                "Use more features (qkv_features / qk_size / vo_size) or fewer num_heads."
            )
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if (not isinstance(num_kv_heads, (int, np.integer)) or num_kv_heads < 1
            or num_heads % num_kv_heads):
        raise ValueError(
            f"num_kv_heads: got {num_kv_heads!r}; expected an int >= 1 dividing num_heads "
            f"({num_heads}) (grouped-query attention: query head i uses key/value head "
            f"i // (num_heads // num_kv_heads)). Use None for num_heads."
        )
    if rope and head_dim % 2:
        raise ValueError(
            f"rope: rotary embeddings rotate pairs of features, so the q/k head dim must be "
            f"even; got {head_dim}. Change qkv_features/num_heads or set rope=False."
        )
    if rope and not rope_theta > 0:
        raise ValueError(f"rope_theta: expected a positive number, got {rope_theta!r}.")
    if fused_qkv and head_dim_v is not None and head_dim_v != head_dim:
        raise ValueError(
            f"fused_qkv: one fused projection needs equal q/k and v head dims, got {head_dim} "
            f"and {head_dim_v}; set fused_qkv=False or make them equal."
        )
    return LayerOptions(int(num_heads), int(num_kv_heads), bool(fused_qkv),
                        float(rope_theta) if rope else None)


def split_fused_qkv(qkv: Array, num_heads: int, num_kv_heads: int) -> tuple[Array, Array, Array]:
    """Splits a fused projection [batch..., s, h + 2 h_kv, d] into q, k, v.

    The fused kernel stacks, along its head axis, the h query heads, then the
    h_kv key heads, then the h_kv value heads (so with h_kv == h it is the
    query/key/value kernels concatenated, and reshapes to [.., s, 3, h, d]).
    """
    q = qkv[..., :num_heads, :]
    k = qkv[..., num_heads:num_heads + num_kv_heads, :]
    v = qkv[..., num_heads + num_kv_heads:, :]
    return q, k, v


# --------------------------------------------------------------------------- RoPE


def default_key_value(query: Array, key: Array | None, value: Array | None, key_name: str,
                      value_name: str) -> tuple[Array, Array]:
    """Self-attention defaults of the stock layers: key = query, value = key."""
    if key is None:
        if value is not None:
            raise ValueError(f"{key_name}: must be given when {value_name} is given.")
        key = query
    return key, key if value is None else value


def rope_frequencies(head_dim: int, theta: float) -> np.ndarray:
    """float32 [d / 2]: theta ** (-2 i / d), the rotation speed of feature pair i."""
    return (theta ** (-np.arange(0, head_dim // 2, dtype=np.float64) * 2.0 / head_dim)).astype(
        np.float32)


def apply_rope(x: Array, positions: Array, theta: float) -> Array:
    """Rotary position embedding ("rotate half", GPT-NeoX/Llama convention).

    Args:
      x: [b, s, h, d] queries or keys (d even).
      positions: int [b, s] (or [s]) absolute positions of the tokens.
      theta: the RoPE base (10000 in most models).

    Returns:
      [b, s, h, d] in x's dtype: features (x[i], x[i + d/2]) rotated by the angle
      position * theta ** (-2 i / d); computed in float32.
    """
    half = x.shape[-1] // 2
    angles = jnp.asarray(positions, jnp.float32)[..., None] * rope_frequencies(x.shape[-1], theta)
    sin, cos = jnp.sin(angles)[..., None, :], jnp.cos(angles)[..., None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


# --------------------------------------------------------------------------- masks and bias


def _broadcast_leading(array: Array, name: str, batch_shape: tuple[int, ...], num_heads: int,
                       seqlen_q: int, seqlen_kv: int, what: str) -> Array:
    """Array broadcastable to [batch..., h, sq, skv] -> [B or 1, h or 1, sq, skv]."""
    full = (*batch_shape, num_heads, seqlen_q, seqlen_kv)
    shape = tuple(array.shape)
    expected = (f"[batch..., heads, q, kv] = {list(full)} (batch and heads may be 1; "
                f"fewer axes broadcast from the left)")
    if len(shape) > len(full) or any(
            s not in (1, f) for s, f in zip(shape[::-1], full[::-1])):
        raise ValueError(f"{name}: expected {what} of shape broadcastable to {expected}, "
                         f"got {shape}.")
    array = array.reshape((1,) * (len(full) - len(shape)) + shape)
    nb = len(batch_shape)
    lead, heads = array.shape[:nb], array.shape[nb]
    if all(s == 1 for s in lead):
        batch = 1
    else:
        array = jnp.broadcast_to(array, (*batch_shape, *array.shape[nb:]))
        batch = int(np.prod(batch_shape))
    return jnp.broadcast_to(array.reshape(batch, heads, *array.shape[nb + 1:]),
                            (batch, heads, seqlen_q, seqlen_kv))


def broadcast_mask(mask, batch_shape: tuple[int, ...], num_heads: int, seqlen_q: int,
                   seqlen_kv: int) -> Array:
    """Validates a Flax-style mask; returns it as bool [B or 1, h or 1, sq, skv].

    mask: True = attend, broadcastable to [batch..., num_heads, sq, skv]. Like
    Flax (whose make_attention_mask/make_causal_mask return float32 0/1 masks),
    integer and floating masks are accepted too, nonzero meaning attend.
    Raises TypeError for any other dtype and ValueError for a bad shape.
    """
    if not hasattr(mask, "shape") or not hasattr(mask, "dtype"):
        raise TypeError(f"mask: expected a boolean array, got {type(mask).__name__}.")
    dtype = jnp.dtype(mask.dtype)
    if not (dtype == jnp.dtype(bool) or jnp.issubdtype(dtype, jnp.integer)
            or jnp.issubdtype(dtype, jnp.floating)):
        raise TypeError(
            f"mask: expected a boolean array (True = attend, the Flax/JAX convention; 0/1 "
            f"integer or float masks as made by flax's make_attention_mask also work), got "
            f"dtype {dtype}; pass a boolean mask."
        )
    mask = jnp.asarray(mask)
    if dtype != jnp.dtype(bool):
        mask = mask != 0
    return _broadcast_leading(mask, "mask", batch_shape, num_heads, seqlen_q,
                              seqlen_kv, "a mask")


def broadcast_bias(bias, batch_shape: tuple[int, ...], num_heads: int, seqlen_q: int,
                   seqlen_kv: int) -> Array:
    """A bias broadcastable to [batch..., h, sq, skv] -> [B or 1, h or 1, sq, skv]."""
    bias = jnp.asarray(bias)
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"bias: expected a floating-point array, got dtype {bias.dtype}.")
    return _broadcast_leading(bias, "bias", batch_shape, num_heads, seqlen_q, seqlen_kv,
                              "a bias")


# --------------------------------------------------------------------------- decode cache


class KVCache(NamedTuple):
    """The decode cache: key/value [batch..., max_len, h_kv, d(v)] and index (int32 [])."""

    key: Array
    value: Array
    index: Array


def _cache_overflow(spec: AttentionSpec, index: Array, new_tokens: int, max_length: int
                    ) -> Array:
    """bool []: whether writing new_tokens at index runs past the cache's max_length.

    Raises ValueError at once with a concrete index (eager use); under jit the same
    message goes through base.guard (checkify) and the caller marks the outputs NaN.
    """
    message = (f"decode: the KV cache holds {max_length} positions and {new_tokens} new "
               "token(s) do not fit after the used ones; initialise a longer cache (max_len).")
    if not isinstance(index, jax.core.Tracer) and int(index) + new_tokens > max_length:
        raise ValueError(message.replace("positions and", f"positions, {int(index)} are used "
                                                          "and"))
    overflow = jnp.asarray(index, jnp.int32) + new_tokens > max_length
    guard(overflow, message, spec)
    return overflow


def _decode(spec: AttentionSpec, cache: KVCache, k: Array, v: Array, sequence):
    """Writes the new k/v [B, n, h_kv, d] at cache.index; returns what attention needs.

    (spec, cache k, cache v, descriptor, new cache, overflow: bool [] past max_len).
    """
    if sequence is not None:
        raise ValueError(
            "sequence: decode mode builds its own descriptor from the cache index (padding + "
            "bottom-right causal over the filled cache); pass sequence=None while decoding."
        )
    cache_k, cache_v = cache.key, cache.value
    batch_shape = cache_k.shape[:-3]
    max_length = cache_k.shape[-3]
    flat_k = cache_k.reshape(-1, *cache_k.shape[-3:])
    flat_v = cache_v.reshape(-1, *cache_v.shape[-3:])
    if flat_k.shape[0] != k.shape[0] or flat_k.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"decode: the cache holds keys of shape {tuple(cache_k.shape)} "
            f"([batch..., max_len, h_kv, d]) but the new keys have shape {tuple(k.shape)} after "
            "flattening the batch axes; initialise the cache with this batch and head layout."
        )
    n = k.shape[1]
    overflow = _cache_overflow(spec, cache.index, n, max_length)
    index = jnp.asarray(cache.index, jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    flat_k = jax.lax.dynamic_update_slice(flat_k, k.astype(flat_k.dtype), (zero, index, zero, zero))
    flat_v = jax.lax.dynamic_update_slice(flat_v, v.astype(flat_v.dtype), (zero, index, zero, zero))
    batch = flat_k.shape[0]
    descriptor = SequenceDescriptor.from_seqlens(jnp.full((batch,), n, jnp.int32),
                                                 jnp.full((batch,), index + n, jnp.int32))
    new_cache = KVCache(flat_k.reshape(*batch_shape, *flat_k.shape[1:]),
                        flat_v.reshape(*batch_shape, *flat_v.shape[1:]), index + n)
    mask = (MaskType.PADDING_CAUSAL_BOTTOM_RIGHT if spec.mask.is_causal else MaskType.PADDING)
    family = "sbhd" if spec.qkv_layout.format == "sbhd" else "bshd"
    decode_spec = spec.replace(mask=mask, sequence_format=SequenceFormat.NONE,
                               qkv_layout=_PACKED[family][0])
    return decode_spec, flat_k, flat_v, descriptor, new_cache, overflow


# --------------------------------------------------------------------------- the op call


def _choose_layout(spec: AttentionSpec, q: Array, k: Array, v: Array, fused: bool) -> QKVLayout:
    """The layout q/k/v go to the op in: the config's family, packed as far as possible.

    A fused QKV projection selects the qkv-packed layout of the config's family
    (kv-packed under GQA); otherwise the config's packing is used, and a packing
    the arrays cannot take raises.
    """
    separate, kv_packed, qkv_packed = _PACKED[spec.qkv_layout.format]
    same_dv = k.shape[-1] == v.shape[-1]
    can_pack_qkv = same_dv and q.shape[1] == k.shape[1] and q.shape[2] == k.shape[2]
    if fused:
        return qkv_packed if can_pack_qkv else kv_packed
    wanted = spec.qkv_layout
    if wanted.num_arrays == 1 and not can_pack_qkv:
        raise ValueError(
            f"config.qkv_layout: {str(wanted)!r} packs q, k and v into one array, which needs "
            f"self-attention with equal head counts and head dims; got q {tuple(q.shape)}, k "
            f"{tuple(k.shape)}, v {tuple(v.shape)} ([b, s, h, d]). Use {str(kv_packed)!r} or "
            f"{str(separate)!r}."
        )
    if wanted.num_arrays == 2 and not same_dv:
        raise ValueError(
            f"config.qkv_layout: {str(wanted)!r} packs k and v into one array, which needs equal "
            f"k and v head dims; got {k.shape[-1]} and {v.shape[-1]}. Use {str(separate)!r}."
        )
    return wanted


def _arrange(q: Array, k: Array, v: Array, layout: QKVLayout) -> tuple:
    """BSHD q, k, v -> the array tuple of `layout`."""
    if layout.num_arrays == 1:
        arrays = (jnp.stack([q, k, v], axis=2),)
    elif layout.num_arrays == 2:
        arrays = (q, jnp.stack([k, v], axis=2))
    else:
        arrays = (q, k, v)
    if layout.format == "sbhd":
        arrays = tuple(jnp.swapaxes(a, 0, 1) for a in arrays)
    return arrays


def spec_with_mask(config) -> AttentionSpec:
    """The spec a layer hands to the op when the call has an explicit `mask`.

    The mask travels as a bias array, so config.bias "no_bias" becomes
    "post_scale_bias" (pre/post-scale bias configs keep theirs, the mask is added
    to the array). See which backends serve such calls with, e.g.,
    `fusedattn.ops.explain((q, k, v), config=spec_with_mask(cfg),
    bias=jax.ShapeDtypeStruct((b, 1, sq, skv), q.dtype))`.
    """
    spec = spec_of(config)
    if spec.bias == BiasType.ALIBI:
        raise ValueError(
            "mask: an explicit mask is passed to the op as a bias array, but config.bias is "
            "'alibi', which takes no bias array; express the mask through config.mask and a "
            "SequenceDescriptor (sequence=...), or use a post-scale bias for ALiBi yourself."
        )
    if spec.bias == BiasType.NO_BIAS:
        return spec.replace(bias=BiasType.POST_SCALE_BIAS)
    return spec


def _with_mask_bias(spec: AttentionSpec, mask: Array | None, bias: Array | None, dtype,
                    rows: Array | None) -> tuple[AttentionSpec, Array | None]:
    """Folds an explicit boolean mask [B|1, h|1, sq, skv] into the bias argument of the op.

    Masked keys get -inf, so no logit, however large, outweighs them (a finite bias
    such as float16's -32752 loses to a scaled score of 48000). A query row that sees
    no key at all (`rows` False, see _row_visible) keeps a zero mask bias instead, so
    no backend meets a row of -inf; `attend` zeroes that row's output.
    """
    if mask is None:
        return spec, bias
    keep = mask | ~rows[..., None]
    mask_bias = jnp.where(keep, jnp.zeros((), dtype), jnp.asarray(-jnp.inf, dtype))
    if spec.bias == BiasType.NO_BIAS:
        return spec_with_mask(spec), mask_bias
    spec = spec_with_mask(spec)
    if bias is None:  # the op names the missing array
        return spec, None
    return spec, (bias + mask_bias).astype(jnp.result_type(bias.dtype, dtype))


def _check_backend_serves_mask(spec: AttentionSpec, arrays: tuple, bias: Array | None,
                               sequence) -> None:
    """ValueError saying how an explicit mask travels when the named backend refuses it."""
    if spec.backend == BackendName.AUTO or bias is None:
        return
    explanation = _ops.explain(arrays, config=spec, bias=bias, sequence=sequence)
    if explanation.backend is not None:
        return
    serving = [name for name, reason in explanation.verdicts.items() if reason is None]
    raise ValueError(
        f"mask: an explicit mask travels to the op as a bias array (-inf where masked, "
        f"config.bias {str(spec.bias)!r}), and config.backend {str(spec.backend)!r} cannot "
        f"serve it: {explanation.verdicts[str(spec.backend)]}. Backends that serve this call: "
        f"{', '.join(serving) or 'none'}; name one (or 'auto'), or express the mask through "
        "config.mask and a SequenceDescriptor (sequence=...) instead."
    )


def _row_visible(spec: AttentionSpec, mask: Array, sequence, batch: int, sq: int, skv: int
                 ) -> Array:
    """bool [B, h|1, sq]: whether a query row sees a key under mask AND the config mask."""
    tokens = (sequence.token_info(spec, sq, skv) if spec.uses_segments
              else dense_token_info(spec, batch, sq, skv))
    return jnp.any(mask & visible_mask(spec, tokens), axis=-1)


def attend(spec: AttentionSpec, q: Array, k: Array, v: Array, *, mask=None, bias=None,
           softmax_offset=None, sequence=None, dropout_rng=None, deterministic: bool = True,
           fused: bool = False, fp8_state=None, return_max_logit: bool = False
           ) -> tuple[Array, OpExtras]:
    """Calls `fusedattn.ops.fused_attn` on BSHD q/k/v with a Flax-style mask.

    Args:
      spec: the layer's AttentionSpec (its layout family, mask, bias, softmax, dropout...).
      q: [B, sq, h, d]; k: [B, skv, h_kv, d]; v: [B, skv, h_kv, dv] (one dtype).
      mask: bool [B|1, h|1, sq, skv] (True = attend), ANDed with the config's mask.
      bias: [B|1, h|1, sq, skv] (pre/post-scale bias, per config.bias), [h] ALiBi slopes or None.
      softmax_offset: float32 [h] for softmax "learnable".
      sequence: SequenceDescriptor for padding masks / THD layouts (batch B).
      dropout_rng: PRNG key, used when not deterministic and config.dropout_rate > 0.
      fused: q/k/v came from one fused projection (selects the packed layout).
      fp8_state, return_max_logit: as fused_attn's (config.fp8, max logit).

    Returns:
      ([B, sq, h, dv] in q's dtype, OpExtras).
    """
    if spec.fp8_enabled and mask is not None:
        raise ValueError(
            "mask: an explicit mask travels to the op as a bias array, and FP8 attention "
            "(config.fp8.enabled) takes none; express the mask through config.mask and a "
            "SequenceDescriptor (sequence=...) instead.")
    batch, sq, _, _ = q.shape
    skv = k.shape[1]
    layout = _choose_layout(spec, q, k, v, fused)
    spec = spec.replace(qkv_layout=layout)
    rows = None if mask is None else _row_visible(spec, mask, sequence, batch, sq, skv)
    call_spec, call_bias = _with_mask_bias(spec, mask, bias, q.dtype, rows)
    arrays = _arrange(q, k, v, layout)
    if mask is not None:
        _check_backend_serves_mask(call_spec, arrays, call_bias, sequence)
    result = _ops.fused_attn(arrays, config=call_spec, bias=call_bias,
                             softmax_offset=softmax_offset, sequence=sequence,
                             dropout_rng=dropout_rng, is_training=not deterministic,
                             fp8_state=fp8_state, return_max_logit=return_max_logit)
    out, *rest = result if spec.fp8_enabled or return_max_logit else (result,)
    extras = OpExtras(fp8_state=rest[0] if spec.fp8_enabled else None,
                      max_logit=rest[-1] if return_max_logit else None)
    if layout.format == "sbhd":
        out = jnp.swapaxes(out, 0, 1)
    if mask is not None:
        rows = context_parallel.to_device_layout(spec, rows, -1)  # the output's row order
        out = jnp.where(jnp.swapaxes(rows, 1, 2)[..., None], out, jnp.zeros((), out.dtype))
    return out, extras


def _flatten_batch(x: Array) -> tuple[Array, tuple[int, ...]]:
    """[batch..., s, h, d] -> ([B, s, h, d], batch_shape); a missing batch axis becomes 1."""
    batch_shape = tuple(x.shape[:-3])
    return x.reshape(-1, *x.shape[-3:]), batch_shape


def core(spec: AttentionSpec, options: LayerOptions, q: Array, k: Array, v: Array, *,
         q_norm: Callable[[Array], Array] | None = None,
         k_norm: Callable[[Array], Array] | None = None,
         cache: KVCache | None = None, mask=None, bias=None, softmax_offset=None,
         sequence=None, dropout_rng=None, deterministic: bool = True, fp8_state=None,
         return_max_logit: bool = False) -> tuple[Array, KVCache | None, OpExtras]:
    """Everything between the projections: QK norm, RoPE, decode cache, attention.

    Args:
      spec, options: the layer's config and static choices.
      q: [batch..., sq, h, d]; k: [batch..., skv, h_kv, d]; v: [batch..., skv, h_kv, dv].
      q_norm, k_norm: per-head normalisations of q and k (applied before RoPE), or None.
      cache: the decode KVCache ([batch..., max_len, h_kv, d]), or None (no decoding).
        The new k/v are written at cache.index and the queries attend, bottom-right
        causally (padding_causal_bottom_right with kv length index + sq), to the
        filled part of the cache; with a non-causal config mask ("no_mask",
        "padding") they see all of the filled part ("padding").
      mask: bool, broadcastable to [batch..., h, sq, skv (max_len when decoding)].
      bias, softmax_offset, sequence, dropout_rng, deterministic, fp8_state,
        return_max_logit: as in `attend`.

    Returns:
      (out [batch..., sq, h, dv], the updated cache or None, OpExtras).
    """
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q, batch_shape = _flatten_batch(q)
    k, _ = _flatten_batch(k)
    v, _ = _flatten_batch(v)
    if cache is not None and spec.context_axis is not None:
        raise ValueError(
            "decode: the KV cache is not sharded over a sequence axis, but "
            f"config.context_parallel.axis is {spec.context_axis!r}; decode with a config "
            "whose context_parallel.axis is None."
        )
    if cache is not None:
        index = jnp.asarray(cache.index, jnp.int32)
        positions_q = index + jnp.arange(q.shape[1], dtype=jnp.int32)
        positions_kv = positions_q
    elif sequence is not None and options.rope_theta is not None:
        if not isinstance(sequence, SequenceDescriptor):
            raise TypeError(f"sequence: expected a fusedattn.ops.SequenceDescriptor, got "
                            f"{type(sequence).__name__}.")
        sequence.check(spec, q.shape[0], q.shape[1], k.shape[1])
        tokens = sequence.token_info(spec, q.shape[1], k.shape[1])
        positions_q, positions_kv = tokens.q_pos, tokens.kv_pos
    else:
        positions_q = jnp.arange(q.shape[1], dtype=jnp.int32)
        positions_kv = jnp.arange(k.shape[1], dtype=jnp.int32)
    if options.rope_theta is not None:
        q = apply_rope(q, context_parallel.to_device_layout(spec, positions_q, -1),
                       options.rope_theta)
        k = apply_rope(k, context_parallel.to_device_layout(spec, positions_kv, -1),
                       options.rope_theta)
    new_cache, overflow = None, None
    fused = options.fused_qkv
    if cache is not None:
        spec, k, v, sequence, new_cache, overflow = _decode(spec, cache, k, v, sequence)
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        fused = False
    sq, h, skv = q.shape[1], q.shape[2], k.shape[1]
    if mask is not None:
        mask = broadcast_mask(mask, batch_shape, h, sq, skv)
    if bias is not None and spec.bias in (BiasType.PRE_SCALE_BIAS, BiasType.POST_SCALE_BIAS):
        bias = broadcast_bias(bias, batch_shape, h, sq, skv)
    out, extras = attend(spec, q, k, v, mask=mask, bias=bias, softmax_offset=softmax_offset,
                         sequence=sequence, dropout_rng=dropout_rng,
                         deterministic=deterministic, fused=fused, fp8_state=fp8_state,
                         return_max_logit=return_max_logit)
    if overflow is not None:  # past max_len: the cache write was clamped, so no numbers
        out = jnp.where(overflow, jnp.asarray(jnp.nan, out.dtype), out)
    return out.reshape(*batch_shape, *out.shape[1:]), new_cache, extras


def missing_dropout_rng(spec: AttentionSpec, how: str) -> ValueError:
    """The error for training with dropout and no randomness; `how` says how to supply it."""
    return ValueError(
        f"dropout_rng: config.dropout_rate is {spec.dropout_rate} and the layer is not "
        f"deterministic, so dropout needs randomness; {how}"
    )


# --------------------------------------------------------------------------- attention_fn


def attention_fn(config) -> Callable[..., Array]:
    """A drop-in `attention_fn` for the stock Flax modules (linen and nnx MultiHeadAttention).

    Returns a function with flax's `dot_product_attention` signature,
    `(query, key, value, bias=None, mask=None, broadcast_dropout=True,
    dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
    precision=None, module=None, force_fp32_for_softmax=False, einsum_dot_general=None,
    qk_attn_weights_einsum=None, attn_weights_value_einsum=None, is_causal=False,
    promote_dtype=None)` (linen's, then nnx's `is_causal` and `promote_dtype`),
    that computes the attention with `fusedattn.ops.fused_attn` under `config`:
    query [batch..., sq, h, d], key [batch..., skv, h_kv, d], value
    [batch..., skv, h_kv, dv] -> [batch..., sq, h, dv] (layout family of
    config.qkv_layout, "bshd" by default).

    - `mask` (bool, True = attend) is ANDed with config.mask; `is_causal`
      (nnx) adds a causal mask to config.mask.
    - `bias` is additive; flax adds it after scaling, so it is passed as a
      post-scale bias unless config.bias is "pre_scale_bias".
    - Dropout: the stock module owns `deterministic` and the "dropout" RNG and
      passes its own `dropout_rate`; it is used when config.dropout_rate is 0 and
      must equal config.dropout_rate otherwise. `broadcast_dropout` is ignored
      (the op draws one Philox mask element per (batch, head, q, kv)).
    - `precision` and `force_fp32_for_softmax` are ignored (the op keeps the
      softmax in float32); `module` (sow_weights) raises: no weights are formed, and
      so do `einsum_dot_general` and the weight einsums when given.
    - `promote_dtype` (nnx), when given, promotes query, key and value as nnx does.
    - Padding masks and THD layouts need a per-call SequenceDescriptor, which a
      stock module cannot pass: use an explicit `mask` instead.
    """
    spec = spec_of(config)
    if spec.softmax == SoftmaxType.LEARNABLE:
        raise ValueError(
            "config.softmax: 'learnable' needs a per-head softmax_offset parameter, which stock "
            "Flax modules do not have; use fusedattn.layers.linen/nnx.MultiHeadAttention, or "
            "config.softmax 'vanilla' / 'off_by_one'."
        )

    def fused_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                        dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                        precision=None, module=None, force_fp32_for_softmax=False,
                        einsum_dot_general=None, qk_attn_weights_einsum=None,
                        attn_weights_value_einsum=None, is_causal=False, promote_dtype=None):
        del broadcast_dropout, precision, force_fp32_for_softmax
        if module is not None:
            raise ValueError(
                "module: sow_weights=True asks for the attention weights, which the fused op "
                "never forms; call the module with sow_weights=False."
            )
        stock.check_weight_einsums(einsum_dot_general=einsum_dot_general,
                                   qk_attn_weights_einsum=qk_attn_weights_einsum,
                                   attn_weights_value_einsum=attn_weights_value_einsum)
        call_spec = spec
        if dropout_rate:
            if spec.dropout_rate not in (0.0, dropout_rate):
                raise ValueError(
                    f"dropout_rate: the module passes {dropout_rate} but config.dropout_rate is "
                    f"{spec.dropout_rate}; set them equal (or config.dropout_rate = 0.0)."
                )
            call_spec = spec.replace(dropout_rate=float(dropout_rate))
        elif spec.dropout_rate > 0:
            raise ValueError(
                f"dropout_rate: config.dropout_rate is {spec.dropout_rate} but the module's "
                "dropout_rate is 0.0, so it never supplies a dropout RNG; set the module's "
                f"dropout_rate={spec.dropout_rate} as well (it owns deterministic and the RNG)."
            )
        if is_causal:
            call_spec = stock.with_causal_mask(call_spec)
        if call_spec.dropout_rate > 0 and not deterministic and dropout_rng is None:
            raise missing_dropout_rng(call_spec, "pass dropout_rng (the stock module takes it "
                                                 "from its 'dropout' RNG stream).")
        if promote_dtype is not None:  # nnx's: promotes q, k, v to one dtype
            query, key, value = promote_dtype((query, key, value), dtype=dtype)
        if dtype is None:
            dtype = jnp.result_type(query.dtype, key.dtype, value.dtype)
        query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
        options = LayerOptions(query.shape[-2], key.shape[-2])
        if bias is not None and call_spec.bias == BiasType.NO_BIAS:
            call_spec = call_spec.replace(bias=BiasType.POST_SCALE_BIAS)
        out, _, _ = core(call_spec, options, query, key, value, mask=mask, bias=bias,
                         dropout_rng=dropout_rng,
                         deterministic=bool(deterministic) or call_spec.dropout_rate == 0)
        return out

    fused_attention.__doc__ = attention_fn.__doc__
    return fused_attention

