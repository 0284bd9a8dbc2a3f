"""From a layer's inputs to per-head q, k and v: static options, inputs, fused QKV, RoPE.

The framework modules own the projection parameters; what they share around them
lives here: the validated head counts and feature flags (`LayerOptions`,
`check_options`), the stock self-attention defaults for key and value
(`default_key_value`), splitting one fused QKV projection (`split_fused_qkv`),
and the rotary position embedding applied to the projected q and k (`apply_rope`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

__all__ = ["LayerOptions", "apply_rope", "check_num_heads", "check_options",
           "check_self_attention", "default_key_value", "rope_frequencies", "split_fused_qkv"]


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


def check_self_attention(inputs_q: Array, inputs_k: Array, inputs_v: Array, key_name: str,
                         value_name: str, alternative: str = "") -> None:
    """The fused qkv projection reads the query input alone: raises ValueError unless the key
    and value inputs are that same array. key_name/value_name are the layer's argument names;
    `alternative` is a further way to call it that the error suggests."""
    if inputs_k is inputs_q and inputs_v is inputs_q:
        return
    raise ValueError(
        f"fused_qkv: the fused projection serves self-attention only; call with "
        f"{key_name}=None and {value_name}=None{alternative}, or build the layer with "
        f"fused_qkv=False."
    )


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
