"""Framework-independent core of the attention layers (linen, NNX, Equinox).

Every layer does the same thing between its projections: optional QK
normalisation, rotary embeddings, the decode KV cache, turning an explicit
boolean mask into a bias, arranging q/k/v in the config's layout and calling
`fusedattn.ops.fused_attn`. That logic lives once in this package; the framework
modules only own parameters, state and randomness, and call it through this
module:

- here: `core` (everything between the projections) and `attend` (one op call
  with a Flax-style mask), `OpExtras`, `missing_dropout_rng`;
- `projections`: `LayerOptions` / `check_options`, `default_key_value`,
  `split_fused_qkv`, RoPE (`apply_rope`);
- `masks`: explicit masks and bias arrays from layer inputs, and how a mask
  travels to the op (as a -inf bias: `spec_with_mask`, backend eligibility);
- `kv_cache`: the decode cache (`KVCache`) and one decode step;
- `qkv_layout`: the layout (family and packing) q/k/v are handed to the op in;
- `flax_attention_fn`: `attention_fn`, the drop-in for the stock Flax modules.

The names the framework modules use (`LayerOptions`, `check_options`,
`split_fused_qkv`, `apply_rope`, `KVCache`, `broadcast_mask`, `spec_with_mask`, ...)
are importable from here.

Shapes (all functions): `batch...` is any number of leading batch axes (the
layers flatten them into one for the op and restore them after), sq/skv the
query/key lengths, h/h_kv the query/key-value heads, d/dv the q-k/v head dims.

Context parallelism (config.context_parallel): the layer's inputs and output are in
the op's device layout (load-balanced token order when asked); RoPE positions and
the rows of an explicit mask are reordered to match, while the mask, bias and
SequenceDescriptor themselves describe the natural order, as in the op.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from fusedattn import ops as _ops
from fusedattn.layers import kv_cache
from fusedattn.layers.kv_cache import KVCache
from fusedattn.layers.masks import (broadcast_bias, broadcast_mask, check_backend_serves_mask,
                                    row_visible, spec_with_mask, with_mask_bias)
from fusedattn.layers.projections import (LayerOptions, apply_rope, check_num_heads,
                                          check_options, check_self_attention, default_key_value,
                                          split_fused_qkv)
from fusedattn.layers.qkv_layout import arrange, choose_layout
from fusedattn.ops import context_parallel
from fusedattn.ops.enums import BiasType
from fusedattn.ops.sequence import SequenceDescriptor
from fusedattn.ops.spec import AttentionSpec

Array = jax.Array

__all__ = [
    "KVCache", "LayerOptions", "OpExtras", "apply_rope", "attend", "broadcast_bias",
    "broadcast_mask", "check_num_heads", "check_options", "check_self_attention", "core", "default_key_value",
    "missing_dropout_rng", "spec_with_mask", "split_fused_qkv",
]


class OpExtras(NamedTuple):
    """What the op returned besides the output: the FP8 state after the call (config.fp8
    enabled, else None) and max_logit float32 [h] (when asked, else None)."""

    fp8_state: Any = None
    max_logit: Array | None = None


def attend(spec: AttentionSpec, q: Array, k: Array, v: Array, *, mask=None, bias=None,
           softmax_offset=None, sequence=None, dropout_rng=None, deterministic: bool = True,
           fused: bool = False, fp8_state=None, return_max_logit: bool = False
           ) -> tuple[Array, OpExtras]:
    """Calls `fusedattn.ops.fused_attn` on BSHD q/k/v with a Flax-style mask.

    Args:
      spec: the layer's AttentionSpec (its layout family, mask, bias, softmax, dropout...).
      q: [B, sq, h, d]; k: [B, skv, h_kv, d]; v: [B, skv, h_kv, dv] (one dtype).
      mask: bool [B|1, h|1, sq, skv] (True = attend), ANDed with the config's mask.
      bias: [B|1, h|1, sq, skv] (pre/post-scale bias, per config.bias), [h] ALiBi slopes or None.
      softmax_offset: float32 [h] for softmax "learnable".
      sequence: SequenceDescriptor for padding masks / THD layouts (batch B).
      dropout_rng: PRNG key, used when not deterministic and config.dropout_rate > 0.
      fused: q/k/v came from one fused projection (selects the packed layout).
      fp8_state, return_max_logit: as fused_attn's (config.fp8, max logit).

    Returns:
      ([B, sq, h, dv] in q's dtype, OpExtras).
    """
    if spec.fp8_enabled and mask is not None:
        raise ValueError(
            "mask: an explicit mask travels to the op as a bias array, and FP8 attention "
            "(config.fp8.enabled) takes none; express the mask through config.mask and a "
            "SequenceDescriptor (sequence=...) instead.")
    batch, sq, _, _ = q.shape
    skv = k.shape[1]
    layout = choose_layout(spec, q, k, v, fused)
    spec = spec.replace(qkv_layout=layout)
    rows = None if mask is None else row_visible(spec, mask, sequence, batch, sq, skv)
    call_spec, call_bias = with_mask_bias(spec, mask, bias, q.dtype, rows)
    arrays = arrange(q, k, v, layout)
    if mask is not None:
        check_backend_serves_mask(call_spec, arrays, call_bias, sequence)
    result = _ops.fused_attn(arrays, config=call_spec, bias=call_bias,
                             softmax_offset=softmax_offset, sequence=sequence,
                             dropout_rng=dropout_rng, is_training=not deterministic,
                             fp8_state=fp8_state, return_max_logit=return_max_logit)
    out, *rest = result if spec.fp8_enabled or return_max_logit else (result,)
    extras = OpExtras(fp8_state=rest[0] if spec.fp8_enabled else None,
                      max_logit=rest[-1] if return_max_logit else None)
    if layout.format == "sbhd":
        out = jnp.swapaxes(out, 0, 1)
    if mask is not None:
        rows = context_parallel.to_device_layout(spec, rows, -1)  # the output's row order
        out = jnp.where(jnp.swapaxes(rows, 1, 2)[..., None], out, jnp.zeros((), out.dtype))
    return out, extras


def _flatten_batch(x: Array) -> tuple[Array, tuple[int, ...]]:
    """[batch..., s, h, d] -> ([B, s, h, d], batch_shape); a missing batch axis becomes 1."""
    batch_shape = tuple(x.shape[:-3])
    return x.reshape(-1, *x.shape[-3:]), batch_shape


def core(spec: AttentionSpec, options: LayerOptions, q: Array, k: Array, v: Array, *,
         q_norm: Callable[[Array], Array] | None = None,
         k_norm: Callable[[Array], Array] | None = None,
         cache: KVCache | None = None, mask=None, bias=None, softmax_offset=None,
         sequence=None, dropout_rng=None, deterministic: bool = True, fp8_state=None,
         return_max_logit: bool = False) -> tuple[Array, KVCache | None, OpExtras]:
    """Everything between the projections: QK norm, RoPE, decode cache, attention.

    Args:
      spec, options: the layer's config and static choices.
      q: [batch..., sq, h, d]; k: [batch..., skv, h_kv, d]; v: [batch..., skv, h_kv, dv].
      q_norm, k_norm: per-head normalisations of q and k (applied before RoPE), or None.
      cache: the decode KVCache ([batch..., max_len, h_kv, d]), or None (no decoding).
        The new k/v are written at cache.index and the queries attend, bottom-right
        causally (padding_causal_bottom_right with kv length index + sq), to the
        filled part of the cache; with a non-causal config mask ("no_mask",
        "padding") they see all of the filled part ("padding").
      mask: bool, broadcastable to [batch..., h, sq, skv (max_len when decoding)].
      bias, softmax_offset, sequence, dropout_rng, deterministic, fp8_state,
        return_max_logit: as in `attend`.

    Returns:
      (out [batch..., sq, h, dv], the updated cache or None, OpExtras).
    """
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q, batch_shape = _flatten_batch(q)
    k, _ = _flatten_batch(k)
    v, _ = _flatten_batch(v)
    if cache is not None and spec.context_axis is not None:
        raise ValueError(
            "decode: the KV cache is not sharded over a sequence axis, but "
            f"config.context_parallel.axis is {spec.context_axis!r}; decode with a config "
            "whose context_parallel.axis is None."
        )
    if cache is not None:
        index = jnp.asarray(cache.index, jnp.int32)
        positions_q = index + jnp.arange(q.shape[1], dtype=jnp.int32)
        positions_kv = positions_q
    elif sequence is not None and options.rope_theta is not None:
        if not isinstance(sequence, SequenceDescriptor):
            raise TypeError(f"sequence: expected a fusedattn.ops.SequenceDescriptor, got "
                            f"{type(sequence).__name__}.")
        sequence.check(spec, q.shape[0], q.shape[1], k.shape[1])
        tokens = sequence.token_info(spec, q.shape[1], k.shape[1])
        positions_q, positions_kv = tokens.q_pos, tokens.kv_pos
    else:
        positions_q = jnp.arange(q.shape[1], dtype=jnp.int32)
        positions_kv = jnp.arange(k.shape[1], dtype=jnp.int32)
    if options.rope_theta is not None:
        q = apply_rope(q, context_parallel.to_device_layout(spec, positions_q, -1),
                       options.rope_theta)
        k = apply_rope(k, context_parallel.to_device_layout(spec, positions_kv, -1),
                       options.rope_theta)
    new_cache, overflow = None, None
    fused = options.fused_qkv
    if cache is not None:
        spec, k, v, sequence, new_cache, overflow = kv_cache.decode(spec, cache, k, v, sequence)
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        fused = False
    sq, h, skv = q.shape[1], q.shape[2], k.shape[1]
    if mask is not None:
        mask = broadcast_mask(mask, batch_shape, h, sq, skv)
    if bias is not None and spec.bias in (BiasType.PRE_SCALE_BIAS, BiasType.POST_SCALE_BIAS):
        bias = broadcast_bias(bias, batch_shape, h, sq, skv)
    out, extras = attend(spec, q, k, v, mask=mask, bias=bias, softmax_offset=softmax_offset,
                         sequence=sequence, dropout_rng=dropout_rng,
                         deterministic=deterministic, fused=fused, fp8_state=fp8_state,
                         return_max_logit=return_max_logit)
    if overflow is not None:  # past max_len: the cache write was clamped, so no numbers
        out = jnp.where(overflow, jnp.asarray(jnp.nan, out.dtype), out)
    return out.reshape(*batch_shape, *out.shape[1:]), new_cache, extras


def missing_dropout_rng(spec: AttentionSpec, how: str) -> ValueError:
    """The error for training with dropout and no randomness; `how` says how to supply it."""
    return ValueError(
        f"dropout_rng: config.dropout_rate is {spec.dropout_rate} and the layer is not "
        f"deterministic, so dropout needs randomness; {how}"
    )
