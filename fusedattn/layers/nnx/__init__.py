"""Flax NNX MultiHeadAttention over `fusedattn.ops.fused_attn`, driven by the attention config.

One job per module:

- `attention`: `MultiHeadAttention`, the drop-in for `flax.nnx.MultiHeadAttention`
  (its constructor and call);
- `parameters`: its parameter modules (q/k/v or fused qkv and out projections, QK
  norms, the learnable softmax offset) and projecting the inputs into heads;
- `caches`: its decode caches as nnx.Cache variables (contiguous, paged) and a paged step;
- `fp8`: its FP8 state (`Fp8Meta`, `apply_fp8_gradients`);
- `dropout`: the dropout key of a call from the call's and the layer's randomness.
"""

from fusedattn.layers.nnx.attention import MultiHeadAttention
from fusedattn.layers.nnx.fp8 import Fp8Meta, apply_fp8_gradients

__all__ = ["Fp8Meta", "MultiHeadAttention", "apply_fp8_gradients"]
