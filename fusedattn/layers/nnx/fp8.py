"""The FP8 state of the NNX layer (config.fp8.enabled; fusedattn.ops.fp8 underneath).

The layer keeps fp8_scale float32 [7] and fp8_amax_history float32 [L, 7] as `Fp8Meta`
variables. Each call records the forward's amaxes in them; the gradient with respect
to them is the state with the backward's amaxes recorded as well, which
`apply_fp8_gradients` writes into the model.
"""

from __future__ import annotations

from flax import nnx

from fusedattn.ops import Fp8State, fp8_state_init
from fusedattn.ops.spec import AttentionSpec

__all__ = ["Fp8Meta", "apply_fp8_gradients", "read", "variables", "write"]


class Fp8Meta(nnx.Variable):
    """FP8 scales and amax histories of an attention layer (fusedattn.ops.fp8): their
    gradient is their new value, not a direction to step in."""


def apply_fp8_gradients(model: nnx.Module, grads: nnx.State) -> None:
    """Writes the Fp8Meta entries of `grads` (the new FP8 states) into `model`."""
    nnx.update(model, nnx.filter_state(grads, Fp8Meta))


def variables(spec: AttentionSpec):
    """(fp8_scale, fp8_amax_history) for a layer of `spec`: Fp8Meta variables at their
    initial values with FP8 on, else two None attributes (nnx.data)."""
    if not spec.fp8_enabled:
        return nnx.data(None), nnx.data(None)
    initial = fp8_state_init(spec)
    return Fp8Meta(initial.scale), Fp8Meta(initial.amax_history)


def read(scale: Fp8Meta | None, amax_history: Fp8Meta | None) -> Fp8State | None:
    """The state to hand to the op, or None without FP8."""
    return None if scale is None else Fp8State(scale[...], amax_history[...])


def write(scale: Fp8Meta, amax_history: Fp8Meta, state: Fp8State) -> None:
    """Stores the op's state after a call (the forward's amaxes recorded) in the variables."""
    scale[...], amax_history[...] = state
