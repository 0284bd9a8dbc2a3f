"""QK-clip (as in MuonClip): keeps each attention head's largest logit at most a threshold.

After an optimizer step, a head h whose max logit m_h (fusedattn's return_max_logit, of
the step's forward) exceeded the threshold t gets gamma_h = t / m_h: its query
projection is scaled by sqrt(gamma_h) and its key/value group's key projection by
sqrt(min gamma) over the group's query heads (grouped-query attention shares keys), so
every logit of the head shrinks by at least gamma_h. Other heads are untouched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rescale(params: dict, max_logit: jax.Array, threshold: float) -> dict:
    """params (the LM's named params: blocks/<i>/attn/query|key/kernel [d, heads, head_dim],
    optional bias [heads, head_dim]) with every layer's over-threshold heads rescaled;
    max_logit float32 [num_layers, h]."""
    blocks = dict(params["blocks"])
    for layer, largest in zip(sorted(blocks, key=int), max_logit):
        gamma = jnp.where(largest > threshold, threshold / jnp.maximum(largest, threshold), 1.0)
        attn = dict(blocks[layer]["attn"])
        kv_heads = attn["key"]["kernel"].shape[1]
        group_gamma = jnp.min(gamma.reshape(kv_heads, -1), axis=1)
        for name, factor in (("query", jnp.sqrt(gamma)), ("key", jnp.sqrt(group_gamma))):
            attn[name] = {part: value * factor[:, None].astype(value.dtype)
                          if part == "bias" else value * factor[None, :, None].astype(value.dtype)
                          for part, value in attn[name].items()}
        blocks[layer] = {**blocks[layer], "attn": attn}
    return {**params, "blocks": blocks}
