"""The decode caches of the NNX layer as nnx.Cache variables, and its paged step.

- contiguous (fusedattn.layers.kv_cache): cached_key / cached_value
  [batch..., max_len, h_kv, d] and cache_index (int32 []), as in the stock module;
- paged (fusedattn.layers.paged): key_pages / value_pages [num_pages, page_size, h_kv, d].

The layer's attributes hold these variables (or None before they are created); the
functions here create, read and write them, and name the layer method to call when a
cache is missing.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fusedattn.layers import common, paged
from fusedattn.layers.projections import LayerOptions
from fusedattn.ops.spec import AttentionSpec

Array = jax.Array

__all__ = ["decode_cache", "decode_cache_shape", "paged_cache", "paged_step", "read", "write"]


def decode_cache(input_shape: tuple[int, ...], num_kv_heads: int, head_dim: int, dtype: Any
                 ) -> tuple[nnx.Cache, nnx.Cache, nnx.Cache]:
    """(cached_key, cached_value, cache_index) for inputs of shape [batch..., max_len,
    features]: zeros [batch..., max_len, h_kv, d] in `dtype`, and int32 0."""
    shape = (*input_shape[:-1], num_kv_heads, head_dim)
    return (nnx.Cache(jnp.zeros(shape, dtype)), nnx.Cache(jnp.zeros(shape, dtype)),
            nnx.Cache(jnp.array(0, dtype=jnp.int32)))


def decode_cache_shape(batch_size: int | tuple[int, ...] | None, max_length: int | None,
                       features: int) -> tuple[int, ...]:
    """The input shape [*batch_size, max_length, features] of the cache that
    `nnx.view(model, decode=True, batch_size=..., max_length=...)` creates."""
    if batch_size is None or max_length is None:
        raise TypeError(
            "batch_size, max_length: both must be given to nnx.view(..., decode=True) "
            "when the cache is not initialised (or call layer.init_cache first)."
        )
    batch = (batch_size,) if isinstance(batch_size, int) else tuple(batch_size)
    return (*batch, max_length, features)


def read(cached_key: nnx.Cache | None, cached_value: nnx.Cache | None,
         cache_index: nnx.Cache | None) -> common.KVCache:
    """The contiguous cache's values; an error naming init_cache when there is none."""
    if cached_key is None:
        raise ValueError(
            "decode: the autoregressive cache is not initialised; call "
            "layer.init_cache(input_shape) first."
        )
    return common.KVCache(cached_key[...], cached_value[...], cache_index[...])


def write(variables: tuple[nnx.Cache, nnx.Cache, nnx.Cache], cache: common.KVCache) -> None:
    """Stores a decode step's cache in (cached_key, cached_value, cache_index)."""
    for variable, value in zip(variables, cache):
        variable[...] = value


def paged_cache(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                dtype: Any) -> tuple[nnx.Cache, nnx.Cache]:
    """(key_pages, value_pages): zeros [num_pages, page_size, h_kv, d] in `dtype`."""
    cache = paged.kv_cache(num_pages, page_size, num_kv_heads, head_dim, dtype)
    return nnx.Cache(cache.key_pages), nnx.Cache(cache.value_pages)


def paged_step(spec: AttentionSpec, options: LayerOptions, query: Array, key: Array,
               value: Array, pools: tuple[nnx.Cache | None, nnx.Cache | None],
               pages: paged.PageTable, input_shape: tuple[int, ...], *, q_norm, k_norm,
               softmax_offset: Array | None, mask, bias, sequence, separate_kv: bool) -> Array:
    """One paged step (fusedattn.layers.paged.step) on the layer's projected heads.

    Args:
      query: [max_seqs, n, h, d]; key, value: [max_seqs, n, h_kv, d], the step's tokens.
      pools: the layer's (key_pages, value_pages), written in place.
      input_shape: the shape of the layer's inputs_q [max_seqs, n, features] (checked).
      q_norm, k_norm, softmax_offset: the layer's.
      mask, bias, sequence: the call's; a paged step takes none of them (an error says so).
      separate_kv: the call gave inputs_k / inputs_v (an error: paged steps are
        self-attention).

    Returns:
      [max_seqs, n, h, d], before the output projection.
    """
    paged.check_step(pages, input_shape, "inputs_q", mask=mask, bias=bias, sequence=sequence)
    if separate_kv:
        raise ValueError("inputs_k, inputs_v: a paged step is self-attention over the "
                         "cached sequence; pass neither.")
    key_pages, value_pages = pools
    if key_pages is None:
        raise ValueError("pages: the paged cache is not initialised; call "
                         "layer.init_paged_cache(num_pages, page_size) first.")
    x, cache = paged.step(spec, options, query, key, value, q_norm=q_norm, k_norm=k_norm,
                          cache=paged.PagedKVCache(key_pages[...], value_pages[...]),
                          pages=pages, softmax_offset=softmax_offset)
    key_pages[...], value_pages[...] = cache
    return x
