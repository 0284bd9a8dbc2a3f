"""The public op: fused_attn() and explain()."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fusedattn.ops import (context_parallel, fp8, layouts, masked_values, max_logit, paged,
                           philox, registry, validation)
from fusedattn.ops.backends.base import CallShapes, CanonicalArgs
from fusedattn.ops.enums import BiasType, SoftmaxType
from fusedattn.ops.sequence import SequenceDescriptor, dense_token_info
from fusedattn.ops.spec import AttentionSpec


def fused_attn(qkv, *, config, bias=None, softmax_offset=None, sequence=None,
               dropout_rng=None, is_training=False, page_table=None, fp8_state=None,
               return_max_logit=False):
    """Multi-head attention over the layout named by config.qkv_layout.

    Args:
      qkv: (q, k, v), (q, kv) or (qkv,) matching config.qkv_layout, e.g. for
        "bshd_bshd_bshd" q [b, sq, h, d], k [b, skv, h_kv, d], v [b, skv, h_kv, dv].
      config: the attention ConfigDict (fusedattn.configs.attention_config()) or
        an AttentionSpec.
      bias: [b|1, h|1, sq, skv] for pre/post-scale bias; [h] ALiBi slopes or None.
      softmax_offset: float32 [h], required by softmax "learnable".
      sequence: SequenceDescriptor, required by padding masks and THD layouts.
      dropout_rng: JAX PRNG key, required when is_training and dropout_rate > 0.
      is_training: False turns dropout off.
      page_table: paged layouts ("paged_kv_*") only: int32 [sequences, max_pages_per_seq],
        page i of sequence s is entry page_table[s, i] of the k/v page pools
        [num_pages, page_size, h_kv, d]; see fusedattn.ops.paged.
      fp8_state: with config.fp8.enabled, the fusedattn.ops.Fp8State of this call's scales
        (fusedattn.ops.fp8_state_init(config) makes the first); may be None under
        config.fp8.scaling "current". The gradient with respect to it is the state with
        every amax recorded (fusedattn.ops.fp8).
      return_max_logit: also return each head's largest logit (fusedattn.ops.max_logit).

    Returns:
      The attention output in q's layout: [b, sq, h, dv] (SBHD: [sq, b, h, dv]). With
      config.fp8.enabled: (out, new_fp8_state), the state with the forward's amaxes
      recorded. With return_max_logit: max_logit float32 [h] last, (out, max_logit) or
      (out, new_fp8_state, max_logit).
    """
    spec = AttentionSpec.from_config(config)
    _check_extras(spec, fp8_state, return_max_logit)
    if spec.qkv_layout.is_paged:
        out, largest = _paged_attn(spec, _as_tuple(qkv), bias, softmax_offset, sequence,
                                   page_table, dropout=is_training and spec.dropout_rate > 0,
                                   return_max_logit=return_max_logit)
        return (out, largest) if return_max_logit else out
    _check_no_page_table(spec, page_table)
    qkv = layouts.check_arrays(_as_tuple(qkv), spec.qkv_layout, allow_fp8=spec.fp8_enabled)
    q, k, v = layouts.to_bshd(tuple(jnp.asarray(a) for a in qkv), spec.qkv_layout)
    bias = None if bias is None else jnp.asarray(bias)
    softmax_offset = None if softmax_offset is None else jnp.asarray(softmax_offset)
    shapes = _call_shapes(spec, q, k, v, bias, softmax_offset, sequence,
                          dropout=is_training and spec.dropout_rate > 0)
    backend = registry.select(spec, shapes, registry.current_platform())

    if shapes.dropout:
        if dropout_rng is None:
            raise ValueError(
                f"dropout_rng: config.dropout_rate is {spec.dropout_rate} and is_training=True, "
                "so a PRNG key is needed; pass dropout_rng=jax.random.key(...), or "
                "is_training=False to turn dropout off."
            )
        dropout_seed = philox.seed_from_key(_checked_key(dropout_rng))
    else:
        dropout_seed = None
    args = CanonicalArgs(
        q=q, k=k, v=v,
        tokens=(sequence.token_info(spec, shapes.seqlen_q, shapes.seqlen_kv) if spec.uses_segments
                else dense_token_info(spec, shapes.batch, shapes.seqlen_q, shapes.seqlen_kv)),
        bias=bias,
        softmax_offset=_softmax_offset(spec, softmax_offset, shapes.num_heads),
        dropout_seed=dropout_seed,
        sequence=sequence if spec.uses_segments else None,
    )
    scale = spec.scale if spec.scale is not None else 1.0 / math.sqrt(shapes.head_dim_qk)
    extras = ()
    if spec.fp8_enabled:
        out, new_state, largest = backend.fp8_attention(
            spec, args, scale, fp8.check_call(spec, fp8_state, q.dtype))
        extras = (new_state,)
    elif spec.context_axis is not None:
        out = _exact_at_masked_values(
            spec, backend, lambda a: context_parallel.attention(spec, backend.name, a, scale), args)
        largest = context_parallel.max_logit(spec, args, scale) if return_max_logit else None
    else:
        out = _exact_at_masked_values(spec, backend,
                                      lambda a: backend.attention(spec, a, scale), args)
        largest = max_logit.max_logit(spec, args, scale) if return_max_logit else None
    if spec.uses_segments:
        broken = validation.broken_rows(sequence, spec, shapes.seqlen_q, shapes.seqlen_kv)
        out = jnp.where(broken[:, None, None, None], jnp.asarray(jnp.nan, out.dtype), out)
    out = layouts.from_bshd(out, spec.qkv_layout)
    extras += (largest,) if return_max_logit else ()
    return (out, *extras) if extras else out


def _exact_at_masked_values(spec: AttentionSpec, backend, attention, args: CanonicalArgs
                            ) -> jax.Array:
    """attention(args); with config.guard_masked_values, guarded (masked_values) where the
    backend's kernels would let a masked NaN/Inf key or value leak into other rows."""
    if not masked_values.applies(spec, backend, registry.current_platform()):
        return attention(args)
    return masked_values.guarded(attention, args)


def _check_extras(spec: AttentionSpec, fp8_state, return_max_logit) -> None:
    """The FP8 and max-logit arguments against the config."""
    if not isinstance(return_max_logit, bool):
        raise TypeError(f"return_max_logit: expected True or False, got {return_max_logit!r}.")
    if fp8_state is not None and not spec.fp8_enabled:
        raise ValueError(
            "fp8_state: config.fp8.enabled is False, so the call has no FP8 scales to read; "
            "drop the argument or set config.fp8.enabled = True.")


def explain(qkv, *, config, bias=None, sequence=None, platform=None,
            page_table=None) -> registry.Explanation:
    """Which backend fused_attn would use for this call, and every backend's reason.

    qkv may hold arrays or jax.ShapeDtypeStruct; platform defaults to the
    default device's ("cpu", "cuda" or "rocm"; "gpu" means "cuda"); page_table
    (an array or ShapeDtypeStruct) is needed by the paged layouts.
    """
    spec = AttentionSpec.from_config(config)
    platform = {"gpu": "cuda"}.get(platform, platform) or registry.current_platform()
    if spec.qkv_layout.is_paged:
        q, k, v = paged.check_arrays(_as_tuple(qkv), spec.qkv_layout)
        _check_softmax_offset(spec, jax.ShapeDtypeStruct((q.shape[2],), jnp.float32)
                              if spec.softmax == SoftmaxType.LEARNABLE else None, q.shape[2])
        shapes = paged.call_shapes(spec, q, k, v, bias, sequence, page_table, dropout=False)
        return registry.explain_spec(spec, shapes, platform)
    _check_no_page_table(spec, page_table)
    qkv = layouts.check_arrays(_as_tuple(qkv), spec.qkv_layout, allow_fp8=spec.fp8_enabled)
    if spec.fp8_enabled:
        fp8.check_config(spec, qkv[0].dtype)
    structs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in qkv)
    q, k, v = jax.eval_shape(lambda arrays: layouts.to_bshd(arrays, spec.qkv_layout), structs)
    offset = jax.ShapeDtypeStruct((q.shape[2],), jnp.float32)
    shapes = _call_shapes(spec, q, k, v, bias,
                          offset if spec.softmax == SoftmaxType.LEARNABLE else None, sequence,
                          dropout=spec.dropout_rate > 0)
    return registry.explain_spec(spec, shapes, platform)


def _paged_attn(spec: AttentionSpec, qkv: tuple, bias, softmax_offset, sequence, page_table,
                dropout: bool, return_max_logit: bool) -> tuple[jax.Array, jax.Array | None]:
    """fused_attn for the paged layouts (fusedattn.ops.paged): q's layout in and out, and
    max_logit [h] when asked (else None)."""
    q, k, v = (jnp.asarray(a) for a in paged.check_arrays(qkv, spec.qkv_layout))
    softmax_offset = None if softmax_offset is None else jnp.asarray(softmax_offset)
    _check_softmax_offset(spec, softmax_offset, q.shape[2])
    page_table = None if page_table is None else jnp.asarray(page_table)
    shapes = paged.call_shapes(spec, q, k, v, bias, sequence, page_table, dropout)
    backend = registry.select(spec, shapes, registry.current_platform())
    args = paged.canonical(spec, q, k, v, sequence, page_table,
                           _softmax_offset(spec, softmax_offset, shapes.num_heads),
                           kernel_checks_sequences=getattr(backend, "checks_sequences", False))
    scale = spec.scale if spec.scale is not None else 1.0 / math.sqrt(shapes.head_dim_qk)
    largest = (max_logit.max_logit(spec, paged.dense_view(spec, args)[0], scale)
               if return_max_logit else None)
    return backend.paged_attention(spec, args, scale), largest


def _check_no_page_table(spec: AttentionSpec, page_table) -> None:
    if page_table is not None:
        raise ValueError(
            f"page_table: only the paged layouts ('paged_kv_bshd_bshd_bshd', "
            f"'paged_kv_thd_bshd_bshd') read a page table, but config.qkv_layout is "
            f"{str(spec.qkv_layout)!r}; drop the argument or set a paged layout."
        )
def _checked_key(key):
    """The dropout key if it is one JAX PRNG key (typed [], or raw uint32 [2]), else TypeError."""
    shape, dtype = getattr(key, "shape", None), getattr(key, "dtype", None)
    typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
    if (typed and shape == ()) or (not typed and dtype == jnp.uint32 and shape == (2,)):
        return key
    got = (f"{type(key).__name__}" if shape is None
           else f"an array of dtype {dtype} and shape {tuple(shape)}")
    raise TypeError(
        f"dropout_rng: expected one JAX PRNG key (jax.random.key(seed), or a raw uint32 [2] "
        f"key), got {got}. For a key per example, jax.vmap the call over the keys. The layers "
        "take it from linen's 'dropout' RNG stream (or dropout_rng=), nnx's "
        "rngs=nnx.Rngs(dropout=...), or Equinox's key=."
    )


def _as_tuple(qkv) -> tuple:
    return tuple(qkv) if isinstance(qkv, (tuple, list)) else (qkv,)


def _call_shapes(spec: AttentionSpec, q, k, v, bias, softmax_offset, sequence,
                 dropout: bool) -> CallShapes:
    """Validates everything but array values; returns the static facts of the call."""
    layouts.check_canonical(q, k, v)
    b, sq, h, d = q.shape
    skv, h_kv = k.shape[1], k.shape[2]
    _check_bias(spec, bias, b, h, sq, skv)
    _check_softmax_offset(spec, softmax_offset, h)
    if spec.uses_segments:
        if sequence is None:
            why = ("padding masks" if spec.mask.is_padding else "THD layouts")
            raise ValueError(
                f"sequence: config mask {str(spec.mask)!r} with layout {str(spec.qkv_layout)!r} "
                f"needs a SequenceDescriptor ({why} read lengths from it); pass sequence="
                "SequenceDescriptor.from_seqlens(...) or another constructor."
            )
        if not isinstance(sequence, SequenceDescriptor):
            raise TypeError(
                f"sequence: expected a fusedattn.ops.SequenceDescriptor, got "
                f"{type(sequence).__name__}."
            )
        sequence.check(spec, b, sq, skv)
    elif sequence is not None:
        raise ValueError(
            f"sequence: config mask {str(spec.mask)!r} with layout {str(spec.qkv_layout)!r} does "
            f"not read a SequenceDescriptor, so padding and packing would be ignored; use mask "
            f"{str(spec.mask.with_padding)!r} to apply it, or pass sequence=None."
        )
    return CallShapes(batch=b, seqlen_q=sq, seqlen_kv=skv, num_heads=h, num_kv_heads=h_kv,
                      head_dim_qk=d, head_dim_v=v.shape[3], dtype=jnp.dtype(q.dtype),
                      bias_shape=(tuple(bias.shape) if bias is not None and spec.bias != BiasType.ALIBI
                                  else None),
                      dropout=dropout,
                      alibi_slopes=bias is not None and spec.bias == BiasType.ALIBI)


def _check_bias(spec: AttentionSpec, bias, b: int, h: int, sq: int, skv: int) -> None:
    if spec.bias == BiasType.NO_BIAS:
        if bias is not None:
            raise ValueError(
                "bias: config.bias is 'no_bias' but a bias array was passed; set config.bias to "
                "'post_scale_bias' or 'pre_scale_bias', or drop the array."
            )
        return
    if spec.bias == BiasType.ALIBI:
        if bias is not None and tuple(bias.shape) != (h,):
            raise ValueError(
                f"bias: with config.bias 'alibi' the bias argument is optional slopes of shape "
                f"[h] = ({h},), got {tuple(bias.shape)}; pass None for the standard slopes."
            )
        return
    if bias is None:
        raise ValueError(
            f"bias: config.bias is {str(spec.bias)!r}, which needs a bias array of shape "
            f"[b or 1, h or 1, sq, skv] = [{b} or 1, {h} or 1, {sq}, {skv}]."
        )
    shape = tuple(bias.shape)
    if (len(shape) != 4 or shape[0] not in (1, b) or shape[1] not in (1, h)
            or shape[2:] != (sq, skv)):
        raise ValueError(
            f"bias: expected shape [b or 1, h or 1, sq, skv] = [{b} or 1, {h} or 1, {sq}, {skv}], "
            f"got {shape}."
        )
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"bias: expected a floating-point array, got dtype {bias.dtype}.")


def _check_softmax_offset(spec: AttentionSpec, softmax_offset, h: int) -> None:
    if spec.softmax != SoftmaxType.LEARNABLE:
        if softmax_offset is not None:
            raise ValueError(
                f"softmax_offset: only used with config.softmax 'learnable', but config.softmax "
                f"is {str(spec.softmax)!r}; drop the argument or set config.softmax='learnable'."
            )
        return
    if softmax_offset is None:
        raise ValueError(
            f"softmax_offset: config.softmax 'learnable' needs a float32 array of shape [h] = "
            f"({h},), e.g. jnp.zeros(({h},), jnp.float32) as the initial value."
        )
    if tuple(softmax_offset.shape) != (h,) or not jnp.issubdtype(softmax_offset.dtype,
                                                                 jnp.floating):
        raise ValueError(
            f"softmax_offset: expected a float32 array of shape [h] = ({h},), got "
            f"{softmax_offset.dtype} {tuple(softmax_offset.shape)}."
        )


def _softmax_offset(spec: AttentionSpec, softmax_offset, h: int):
    if spec.softmax == SoftmaxType.LEARNABLE:
        return jnp.asarray(softmax_offset, jnp.float32)
    if spec.softmax == SoftmaxType.OFF_BY_ONE:
        return jnp.zeros((h,), jnp.float32)
    return None
