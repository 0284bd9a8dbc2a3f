"""The decode caches of the linen layer as variables of its "cache" collection, and its
paged step.

- contiguous (fusedattn.layers.kv_cache): cached_key / cached_value
  [batch..., max_len, h_kv, d] and cache_index (int32 []), created by `init` with an
  input of the full length, as in the stock module;
- paged (fusedattn.layers.paged): key_pages / value_pages [num_pages, page_size, h_kv, d],
  created by the first call with pages= (apply with mutable=["cache"]).

Each function takes the layer and must run inside its compact `__call__`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from fusedattn.layers import common, paged
from fusedattn.layers.projections import LayerOptions
from fusedattn.ops.spec import AttentionSpec

Array = jax.Array

__all__ = ["decode_cache", "paged_step", "write"]


def decode_cache(layer: nn.Module, key: Array, value: Array
                 ) -> tuple[tuple[nn.Variable, nn.Variable, nn.Variable], common.KVCache | None]:
    """The contiguous cache's variables (cached_key, cached_value, cache_index), created
    like the step's key and value [batch..., max_len, h_kv, d] (zeros) and int32 0, and
    their values as a KVCache, or None while the cache is being created (`init`)."""
    initialized = layer.has_variable("cache", "cached_key")
    variables = (
        layer.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype),
        layer.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype),
        layer.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32)),
    )
    cache = common.KVCache(*(v.value for v in variables)) if initialized else None
    return variables, cache


def write(variables: tuple[nn.Variable, nn.Variable, nn.Variable], cache: common.KVCache
          ) -> None:
    """Stores a decode step's cache in (cached_key, cached_value, cache_index)."""
    for variable, value in zip(variables, cache):
        variable.value = value


def paged_step(layer: nn.Module, spec: AttentionSpec, options: LayerOptions, query: Array,
               key: Array, value: Array, pages: paged.PageTable, input_shape: tuple[int, ...],
               *, q_norm, k_norm, softmax_offset: Array | None, mask, bias, sequence,
               separate_kv: bool) -> Array:
    """One paged step (fusedattn.layers.paged.step) on the layer's projected heads.

    Args:
      query: [max_seqs, n, h, d]; key, value: [max_seqs, n, h_kv, d], the step's tokens.
      pages: the step's PageTable (after `allocate`).
      input_shape: the shape of the layer's inputs_q [max_seqs, n, features] (checked).
      q_norm, k_norm, softmax_offset: the layer's.
      mask, bias, sequence: the call's; a paged step takes none of them (an error says so).
      separate_kv: the call gave inputs_kv / inputs_k / inputs_v (an error: paged steps
        are self-attention).

    Returns:
      [max_seqs, n, h, d], before the output projection; the layer's key_pages /
      value_pages [num_pages, page_size, h_kv, d] hold the step's k/v after it.
    """
    paged.check_step(pages, input_shape, "inputs_q", mask=mask, bias=bias, sequence=sequence)
    if separate_kv or layer.decode:
        raise ValueError("pages: a paged step is self-attention over the cached "
                         "sequence; pass no inputs_kv/inputs_k/inputs_v, and leave "
                         "decode off (it selects the contiguous cache).")
    if layer.num_pages is None or layer.page_size is None:
        raise ValueError("num_pages, page_size: set both on the layer to give it a "
                         "paged cache before calling it with pages=.")
    pools = [layer.variable("cache", name, jnp.zeros,
                            (layer.num_pages, layer.page_size, options.num_kv_heads,
                             key.shape[-1]), key.dtype)
             for name in ("key_pages", "value_pages")]
    x, new_pools = paged.step(spec, options, query, key, value, q_norm=q_norm, k_norm=k_norm,
                              cache=paged.PagedKVCache(*(pool.value for pool in pools)),
                              pages=pages, softmax_offset=softmax_offset)
    for pool, pool_value in zip(pools, new_pools):
        pool.value = pool_value
    return x
