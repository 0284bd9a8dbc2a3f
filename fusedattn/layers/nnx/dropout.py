"""The dropout key of an NNX layer call, from the call's and the layer's randomness."""

from __future__ import annotations

import jax
from flax import nnx

from fusedattn.layers import common
from fusedattn.ops.spec import AttentionSpec

__all__ = ["dropout_key"]


def dropout_key(spec: AttentionSpec, deterministic: bool | None,
                layer_deterministic: bool | None, rngs: nnx.Rngs | nnx.RngStream | None,
                layer_rngs: nnx.RngStream | None) -> tuple[jax.Array | None, bool]:
    """(dropout key or None, deterministic) of one call.

    Args:
      spec: the call's spec; without dropout (rate 0) the call is deterministic.
      deterministic, rngs: the call's arguments (None: the layer's).
      layer_deterministic: the layer's default (constructor or nnx.view).
      layer_rngs: the "dropout" stream the layer kept, or None.

    Raises ValueError when dropout is on and neither flag says whether to apply it, or
    when it applies and no "dropout" stream is at hand.
    """
    if spec.dropout_rate == 0:
        return None, True
    deterministic = layer_deterministic if deterministic is None else deterministic
    if deterministic is None:
        raise ValueError(
            f"deterministic: config.dropout_rate is {spec.dropout_rate}, so pass "
            "deterministic=True/False to the call or the constructor."
        )
    if deterministic:
        return None, True
    stream = layer_rngs if rngs is None else rngs
    if isinstance(stream, nnx.Rngs):
        stream = getattr(stream, "dropout", None)   # None: no "dropout" stream
    if stream is None:
        raise common.missing_dropout_rng(
            spec, "pass rngs=nnx.Rngs(dropout=...) to the call (the layer keeps "
            "none when built with keep_rngs=False; an Rngs without a 'dropout' "
            "stream does not count), or deterministic=True.")
    return stream(), False
