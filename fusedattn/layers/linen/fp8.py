"""The FP8 state of the linen layer (config.fp8.enabled; fusedattn.ops.fp8 underneath).

The layer keeps fp8_scale float32 [10] and fp8_amax_history float32 [L, 10] in the
collection flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT ("_overwrite_with_gradient"), the
convention of Flax's own FP8 ops: the gradient with respect to that collection is the
state with every amax of the step recorded, which flax.training.train_state.TrainState.
apply_gradients writes back; applying with mutable=[OVERWRITE_WITH_GRADIENT] records the
forward's amaxes too.

Each function takes the layer and must run inside its compact `__call__`.
"""

from __future__ import annotations

import flax.linen as nn
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT

from fusedattn.ops import Fp8State, fp8_state_init
from fusedattn.ops.spec import AttentionSpec

__all__ = ["read", "variables", "write"]


def variables(layer: nn.Module, spec: AttentionSpec) -> Fp8State | None:
    """(fp8_scale, fp8_amax_history) variables at their initial values with FP8 on, else
    None."""
    if not spec.fp8_enabled:
        return None
    initial = fp8_state_init(spec)
    return Fp8State(*(layer.variable(OVERWRITE_WITH_GRADIENT, name, lambda x=x: x)
                      for name, x in zip(("fp8_scale", "fp8_amax_history"), initial)))


def read(fp8_vars: Fp8State | None) -> Fp8State | None:
    """The state to hand to the op, or None without FP8."""
    return None if fp8_vars is None else Fp8State(*(v.value for v in fp8_vars))


def write(layer: nn.Module, fp8_vars: Fp8State, state: Fp8State) -> None:
    """Stores the op's state after a call (the forward's amaxes recorded) in the variables,
    when the collection is mutable and the layer is not being initialised."""
    if not layer.is_initializing() and layer.is_mutable_collection(OVERWRITE_WITH_GRADIENT):
        for variable, value in zip(fp8_vars, state):
            variable.value = value
