"""Explicit masks and bias arrays from layer inputs, and how a mask reaches the op.

A layer's `mask` (True = attend, Flax-style, broadcastable to
[batch..., h, sq, skv]) and `bias` are checked and broadcast to
[B or 1, h or 1, sq, skv] (`broadcast_mask`, `broadcast_bias`). The op has no
mask argument: a boolean mask is given to it as a bias array, -inf where masked
(exact at any logit size and dtype), added to the config's bias (post-scale
when the config has none: `spec_with_mask`). A bias array changes which
backends can serve the call; `fusedattn.ops.explain(qkv, config=...,
bias=jax.ShapeDtypeStruct(...))` shows every backend's verdict for it, and a
named backend that refuses it raises saying so (`check_backend_serves_mask`).
Query rows that the explicit mask and the config's mask together leave without
any visible key (`row_visible`) get a zero mask bias, and the layer zeroes
their output (and so their gradients), as the op does for its own masks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn import ops as _ops
from fusedattn.ops.backends.base import visible_mask
from fusedattn.ops.enums import BackendName, BiasType
from fusedattn.ops.sequence import dense_token_info
from fusedattn.ops.spec import AttentionSpec

Array = jax.Array

__all__ = ["broadcast_bias", "broadcast_mask", "check_backend_serves_mask", "row_visible",
           "spec_with_mask", "with_mask_bias"]


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


def spec_with_mask(config) -> AttentionSpec:
    """The spec a layer hands to the op when the call has an explicit `mask`.

    The mask travels as a bias array, so config.bias "no_bias" becomes
    "post_scale_bias" (pre/post-scale bias configs keep theirs, the mask is added
    to the array). See which backends serve such calls with, e.g.,
    `fusedattn.ops.explain((q, k, v), config=spec_with_mask(cfg),
    bias=jax.ShapeDtypeStruct((b, 1, sq, skv), q.dtype))`.
    """
    spec = AttentionSpec.from_config(config)
    if spec.bias == BiasType.ALIBI:
        raise ValueError(
            "mask: an explicit mask is passed to the op as a bias array, but config.bias is "
            "'alibi', which takes no bias array; express the mask through config.mask and a "
            "SequenceDescriptor (sequence=...), or use a post-scale bias for ALiBi yourself."
        )
    if spec.bias == BiasType.NO_BIAS:
        return spec.replace(bias=BiasType.POST_SCALE_BIAS)
    return spec


def with_mask_bias(spec: AttentionSpec, mask: Array | None, bias: Array | None, dtype,
                    rows: Array | None) -> tuple[AttentionSpec, Array | None]:
    """Folds an explicit boolean mask [B|1, h|1, sq, skv] into the bias argument of the op.

    Masked keys get -inf, so no logit, however large, outweighs them (a finite bias
    such as float16's -32752 loses to a scaled score of 48000). A query row that sees
    no key at all (`rows` False, see row_visible) keeps a zero mask bias instead, so
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


def check_backend_serves_mask(spec: AttentionSpec, arrays: tuple, bias: Array | None,
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


def row_visible(spec: AttentionSpec, mask: Array, sequence, batch: int, sq: int, skv: int
                 ) -> Array:
    """bool [B, h|1, sq]: whether a query row sees a key under mask AND the config mask."""
    tokens = (sequence.token_info(spec, sq, skv) if spec.uses_segments
              else dense_token_info(spec, batch, sq, skv))
    return jnp.any(mask & visible_mask(spec, tokens), axis=-1)
