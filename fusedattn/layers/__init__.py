"""Attention layers for Flax linen, Flax NNX and Equinox over `fusedattn.ops.fused_attn`.

    from fusedattn.layers import linen, nnx, equinox
    # drop-in for flax.linen.MultiHeadDotProductAttention:
    linen.MultiHeadAttention(num_heads, config=cfg, ...)
    # drop-in for flax.nnx.MultiHeadAttention:
    nnx.MultiHeadAttention(num_heads, in_features, config=cfg, rngs=...)
    # drop-in for equinox.nn.MultiheadAttention (unbatched; vmap it):
    equinox.MultiheadAttention(num_heads, query_size, config=cfg, key=...)
    # an attention_fn for the stock Flax modules:
    fusedattn.layers.attention_fn(cfg)

The framework modules are imported lazily, so using one framework does not
import the others.
"""

from __future__ import annotations

import importlib

from fusedattn.layers.flax_attention_fn import attention_fn

__all__ = ["attention_fn", "common", "equinox", "linen", "nnx"]


def __getattr__(name: str):
    if name in ("linen", "nnx", "equinox", "common"):
        return importlib.import_module(f"fusedattn.layers.{name}")
    raise AttributeError(f"module 'fusedattn.layers' has no attribute {name!r}")
