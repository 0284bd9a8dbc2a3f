"""The layout a layer hands q, k and v to the op in, and arranging them so.

The layers hold q [B, sq, h, d], k [B, skv, h_kv, d] and v [B, skv, h_kv, dv]
(BSHD). The op takes them in config.qkv_layout's family (bshd, sbhd, thd),
separate, kv-packed or qkv-packed: a fused QKV projection asks for the most
packed layout the arrays allow, otherwise the config's packing is kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fusedattn.ops.enums import QKVLayout
from fusedattn.ops.spec import AttentionSpec

Array = jax.Array

__all__ = ["PACKINGS", "arrange", "choose_layout"]

PACKINGS = {
    # family -> (separate, kv packed, qkv packed)
    "bshd": (QKVLayout.BSHD_BSHD_BSHD, QKVLayout.BSHD_BS2HD, QKVLayout.BS3HD),
    "sbhd": (QKVLayout.SBHD_SBHD_SBHD, QKVLayout.SBHD_SB2HD, QKVLayout.SB3HD),
    "thd": (QKVLayout.THD_THD_THD, QKVLayout.THD_T2HD, QKVLayout.T3HD),
}


def choose_layout(spec: AttentionSpec, q: Array, k: Array, v: Array, fused: bool) -> QKVLayout:
    """The layout q/k/v go to the op in: the config's family, packed as far as possible.

    A fused QKV projection selects the qkv-packed layout of the config's family
    (kv-packed under GQA); otherwise the config's packing is used, and a packing
    the arrays cannot take raises.
    """
    separate, kv_packed, qkv_packed = PACKINGS[spec.qkv_layout.format]
    same_dv = k.shape[-1] == v.shape[-1]
    can_pack_qkv = same_dv and q.shape[1] == k.shape[1] and q.shape[2] == k.shape[2]
    if fused:
        return qkv_packed if can_pack_qkv else kv_packed
    wanted = spec.qkv_layout
    if wanted.num_arrays == 1 and not can_pack_qkv:
        raise ValueError(
            f"config.qkv_layout: {str(wanted)!r} packs q, k and v into one array, which needs "
            f"self-attention with equal head counts and head dims; got q {tuple(q.shape)}, k "
            f"{tuple(k.shape)}, v {tuple(v.shape)} ([b, s, h, d]). Use {str(kv_packed)!r} or "
            f"{str(separate)!r}."
        )
    if wanted.num_arrays == 2 and not same_dv:
        raise ValueError(
            f"config.qkv_layout: {str(wanted)!r} packs k and v into one array, which needs equal "
            f"k and v head dims; got {k.shape[-1]} and {v.shape[-1]}. Use {str(separate)!r}."
        )
    return wanted


def arrange(q: Array, k: Array, v: Array, layout: QKVLayout) -> tuple:
    """BSHD q, k, v -> the array tuple of `layout`."""
    if layout.num_arrays == 1:
        arrays = (jnp.stack([q, k, v], axis=2),)
    elif layout.num_arrays == 2:
        arrays = (q, jnp.stack([k, v], axis=2))
    else:
        arrays = (q, k, v)
    if layout.format == "sbhd":
        arrays = tuple(jnp.swapaxes(a, 0, 1) for a in arrays)
    return arrays
