"""The dropout key of a linen layer call, from the call's and the module's randomness."""

from __future__ import annotations

import flax.linen as nn
import jax

from fusedattn.layers import common
from fusedattn.ops.spec import AttentionSpec

__all__ = ["dropout_key"]


def dropout_key(layer: nn.Module, spec: AttentionSpec, deterministic: bool | None,
                dropout_rng: jax.Array | None) -> tuple[jax.Array | None, bool]:
    """(dropout key or None, deterministic) of one call; must run inside the layer's
    compact `__call__`.

    Args:
      spec: the call's spec; without dropout (rate 0) the call is deterministic.
      deterministic: the call's flag, merged with the layer's (nn.merge_param: exactly
        one of them must be given when dropout is on).
      dropout_rng: the call's explicit key, else the "dropout" RNG stream's.

    Raises ValueError when dropout applies and there is neither a key nor a "dropout"
    stream.
    """
    if spec.dropout_rate == 0:
        return dropout_rng, True
    deterministic = nn.merge_param("deterministic", layer.deterministic, deterministic)
    if not deterministic and dropout_rng is None:
        if not layer.has_rng("dropout"):
            raise common.missing_dropout_rng(
                spec, "pass rngs={'dropout': key} to init/apply (or dropout_rng=...), "
                "or deterministic=True.")
        dropout_rng = layer.make_rng("dropout")
    return dropout_rng, deterministic
