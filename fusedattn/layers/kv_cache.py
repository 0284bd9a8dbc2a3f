"""The decode KV cache of the layers (one contiguous cache per layer; paged.py has the paged one).

`KVCache` holds key/value [batch..., max_len, h_kv, d(v)] and the number of
positions used. `decode` writes a step's new k/v at that index and turns the
call into attention of the new queries over the filled part of the cache:
bottom-right causal for causal configs, all of it otherwise, through a
SequenceDescriptor of the filled lengths. Writing past max_len raises eagerly;
under jit it is a checkify error and `common.core` makes the outputs NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fusedattn.layers.qkv_layout import PACKINGS
from fusedattn.ops.backends.base import guard
from fusedattn.ops.enums import MaskType, SequenceFormat
from fusedattn.ops.sequence import SequenceDescriptor
from fusedattn.ops.spec import AttentionSpec

Array = jax.Array

__all__ = ["KVCache", "decode"]


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


def decode(spec: AttentionSpec, cache: KVCache, k: Array, v: Array, sequence):
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
                               qkv_layout=PACKINGS[family][0])
    return decode_spec, flat_k, flat_v, descriptor, new_cache, overflow
