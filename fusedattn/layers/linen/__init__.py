"""Flax linen MultiHeadAttention over `fusedattn.ops.fused_attn`, driven by the attention config.

One job per module:

- `attention`: `MultiHeadDotProductAttention` and `MultiHeadAttention`, the drop-ins for
  the stock linen classes of those names (their fields and call);
- `parameters`: the submodules and parameters the call creates (q/k/v or fused qkv and
  out projections, QK norms, the learnable softmax offset) and projecting into heads;
- `caches`: the decode caches as "cache" variables (contiguous, paged) and a paged step;
- `fp8`: the FP8 state as variables of the OVERWRITE_WITH_GRADIENT collection;
- `dropout`: the dropout key of a call from the call's and the module's randomness.
"""

from fusedattn.layers.linen.attention import MultiHeadAttention, MultiHeadDotProductAttention

__all__ = ["MultiHeadAttention", "MultiHeadDotProductAttention"]
