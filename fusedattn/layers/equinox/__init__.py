"""Equinox MultiheadAttention over `fusedattn.ops.fused_attn`, driven by the attention config.

- `attention`: `MultiheadAttention`, the drop-in for `equinox.nn.MultiheadAttention`
  (unbatched; its constructor, call and paged step);
- `heads`: one example's projections into heads and back (no vmap inside), the
  per-head QK norms, and the per-example descriptor and `process_heads` hook.
"""

from fusedattn.layers.equinox.attention import MultiheadAttention

__all__ = ["MultiheadAttention"]
