"""QKV layouts: checking the arrays and turning them into canonical BSHD q, k, v.

Layout letters (API.md): b batch, s sequence, h heads, d head dim, t packed
tokens (THD arrays are [b, t, h, d]), 3/2 packed Q,K,V or K,V on their own axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fusedattn.ops.enums import QKVLayout

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)

_ARRAY_NAMES = {1: ("qkv",), 2: ("q", "kv"), 3: ("q", "k", "v")}


def _expected_shapes(layout: QKVLayout) -> tuple[str, ...]:
    seq_first = layout.format == "sbhd"
    single = "[s, b, h, d]" if seq_first else "[b, s, h, d]"
    if layout.num_arrays == 1:
        return ("[s, b, 3, h, d]" if seq_first else "[b, s, 3, h, d]",)
    if layout.num_arrays == 2:
        return (single, "[s, b, 2, h_kv, d]" if seq_first else "[b, s, 2, h_kv, d]")
    return (single, single, single)


def check_arrays(qkv, layout: QKVLayout, allow_fp8: bool = False) -> tuple:
    """Validates the qkv tuple against the layout; returns it as a tuple.

    Works on arrays or on anything with .shape and .dtype (jax.ShapeDtypeStruct).
    allow_fp8: also accept float8_e4m3fn arrays (FP8 attention, ops/fp8.py).
    """
    if not isinstance(qkv, (tuple, list)):
        qkv = (qkv,)
    names = _ARRAY_NAMES[layout.num_arrays]
    expected = _expected_shapes(layout)
    if len(qkv) != layout.num_arrays:
        raise ValueError(
            f"qkv: layout {str(layout)!r} takes {layout.num_arrays} array(s) "
            f"({', '.join(f'{n} {s}' for n, s in zip(names, expected))}), got {len(qkv)}. "
            "Pass the arrays that match config.qkv_layout, or change config.qkv_layout."
        )
    for array, name, shape in zip(qkv, names, expected):
        check_array(array, name, shape, layout, allow_fp8)
    packed_axis = {1: 3, 2: 2}.get(layout.num_arrays)
    if packed_axis is not None:
        packed = qkv[-1]
        if packed.shape[2] != packed_axis:
            raise ValueError(
                f"qkv: {names[-1]} must have size {packed_axis} on axis 2 for layout "
                f"{str(layout)!r} ({expected[-1]}), got shape {tuple(packed.shape)}."
            )
    check_same_dtype(qkv, names)
    return tuple(qkv)


def check_array(array, name: str, shape: str, layout: QKVLayout, allow_fp8: bool = False
                ) -> None:
    """One array of the qkv tuple: an array of rank len(shape) and a supported dtype.

    shape: the expected shape as text, e.g. "[b, s, h, d]" (its rank is what is checked).
    """
    if not hasattr(array, "shape") or not hasattr(array, "dtype"):
        raise TypeError(f"qkv: {name} must be an array, got {type(array).__name__}.")
    if len(array.shape) != shape.count(",") + 1:
        raise ValueError(
            f"qkv: {name} must have shape {shape} for layout {str(layout)!r}, "
            f"got {tuple(array.shape)}."
        )
    accepted = SUPPORTED_DTYPES + ((jnp.float8_e4m3fn,) if allow_fp8 else ())
    if jnp.dtype(array.dtype) not in [jnp.dtype(d) for d in accepted]:
        raise TypeError(
            f"qkv: {name} has dtype {jnp.dtype(array.dtype)}; expected bfloat16, float16 or "
            "float32 (or float8_e4m3fn with config.fp8.enabled). Cast the inputs with "
            ".astype(jnp.bfloat16) (or float16/float32)."
        )


def check_same_dtype(qkv, names) -> None:
    dtypes = {jnp.dtype(a.dtype) for a in qkv}
    if len(dtypes) > 1:
        raise TypeError(
            f"qkv: {', '.join(names)} must share one dtype, got {', '.join(map(str, dtypes))}. "
            "Cast them to a common dtype."
        )


def to_bshd(qkv: tuple, layout: QKVLayout) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Canonical (q [b, sq, h, d], k [b, skv, h_kv, d], v [b, skv, h_kv, dv])."""
    if layout.format == "sbhd":
        qkv = tuple(jnp.swapaxes(a, 0, 1) for a in qkv)
    if layout.num_arrays == 1:
        (packed,) = qkv
        q, k, v = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
    elif layout.num_arrays == 2:
        q, kv = qkv
        k, v = kv[:, :, 0], kv[:, :, 1]
    else:
        q, k, v = qkv
    return q, k, v


def from_bshd(out: jax.Array, layout: QKVLayout) -> jax.Array:
    """The [b, sq, h, dv] output in q's layout (SBHD layouts swap back)."""
    return jnp.swapaxes(out, 0, 1) if layout.format == "sbhd" else out


def check_canonical(q, k, v) -> None:
    """Cross-array agreement of canonical shapes (batch, lengths, heads, head dims)."""
    b, _, h, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(
            f"qkv: batch sizes differ: q {b}, k {k.shape[0]}, v {v.shape[0]}. "
            "q, k and v need one batch size."
        )
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(
            f"qkv: k {tuple(k.shape)} and v {tuple(v.shape)} must agree on sequence length and "
            "number of heads."
        )
    if k.shape[3] != d:
        raise ValueError(
            f"qkv: q head dim {d} differs from k head dim {k.shape[3]}; q and k need one head dim."
        )
    if d < 1 or v.shape[3] < 1:
        raise ValueError(
            f"qkv: head dims must be >= 1, got q/k {d} and v {v.shape[3]}; each head needs at "
            "least one feature."
        )
    h_kv = k.shape[2]
    if h_kv == 0 or h % h_kv:
        raise ValueError(
            f"qkv: q has {h} heads and k/v {h_kv}; grouped-query attention needs the q head "
            "count to be a multiple of the k/v head count."
        )
