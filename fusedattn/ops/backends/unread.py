"""Backward results no one reads, learnt by a custom_vjp's forward rule from symbolic zeros.

A backend op defined with `defvjp(..., symbolic_zeros=True)` gets each primal as a
CustomVJPPrimal (its value, and whether it is differentiated). `Unread` names the backward
results of the operands nobody differentiates (a bias array or a softmax offset that is not
a parameter, such as a mask given as a bias), so that the backward call need not compute
them; it is static (a pytree without leaves), so it travels in the residuals.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.custom_derivatives import CustomVJPPrimal


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Unread:
    """The backward results (indexes) whose operands are not differentiated."""

    results: frozenset[int]

    @classmethod
    def of(cls, pairs) -> "Unread":
        """From (result index, CustomVJPPrimal of its operand) pairs."""
        return cls(frozenset(index for index, primal in pairs if not primal.perturbed))


def values(tree):
    """`tree` with every CustomVJPPrimal replaced by its value."""
    return jax.tree.map(lambda primal: primal.value, tree,
                        is_leaf=lambda x: isinstance(x, CustomVJPPrimal))
