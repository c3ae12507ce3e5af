"""Zero the updates of some leaves (optax's `set_to_zero` and `transforms.freeze`): those params stay as they
are while the others train. `masked` alone does not do this: its masked-out leaves pass their gradient through
unchanged, as in optax, and a gradient added to a param is not a training step.

Example:
    >>> import torch, accelfn as af
    >>> params = {"w": torch.ones(1), "b": torch.ones(1)}
    >>> tx = af.optim.chain(af.optim.sgd(0.5), af.optim.freeze({"w": False, "b": True}))
    >>> u, _ = tx.update({"w": torch.ones(1), "b": torch.ones(1)}, tx.init(params), params)
    >>> u["w"].item(), u["b"].item()
    (-0.5, 0.0)
"""

from __future__ import annotations

from typing import Any

import torch

from .. import tree as _tree
from .._typecheck import checked
from ._kernels import MaskLike
from .base import EmptyState, GradientTransformation
from .masked import masked

__all__ = ["set_to_zero", "freeze"]


def set_to_zero() -> GradientTransformation:
    """Every update becomes zero (the params it reaches do not change)."""

    def init(params: Any) -> EmptyState:
        return EmptyState()

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        return _tree.map(torch.zeros_like, updates), state

    return GradientTransformation(init, update, hyperparams={"name": "set_to_zero"})


@checked
def freeze(mask: MaskLike) -> GradientTransformation:
    """Zero the updates where `mask` (pytree of bools, or callable params -> pytree) is True; put it last in a
    `chain` so that nothing (weight decay included) moves the frozen params."""
    return masked(set_to_zero(), mask)
