"""Lion (Chen et al., 2023): sign of an interpolated momentum, decoupled weight decay.

Example:
    >>> import torch, accelfn as af
    >>> params = {"w": torch.ones(2)}
    >>> tx = af.optim.lion(0.1)
    >>> state = af.optim.apply_gradients(tx, {"w": torch.tensor([1.0, -1.0])}, tx.init(params), params)
    >>> params["w"].tolist()
    [0.8999999761581421, 1.100000023841858]
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .. import tree as _tree
from .._typecheck import checked
from ._kernels import MaskLike, mask_leaves, pick, zeros_like_tree
from .base import GradientTransformation
from .schedules import ScheduleLike, as_schedule

__all__ = ["LionState", "lion"]


class LionState(NamedTuple):
    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    lr: torch.Tensor
    mu: Any


@checked
def lion(
    lr: ScheduleLike,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 0.0,
    mask: MaskLike | None = None,
) -> GradientTransformation:
    """Lion: `p -= lr * (sign(b1*m + (1-b1)*g) + weight_decay*p)`; then `m = b2*m + (1-b2)*g`."""
    for what, value in (("b1", b1), ("b2", b2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"lion: {what} must be in [0, 1), got {value}")
    if not weight_decay >= 0.0:
        raise ValueError(f"lion: weight_decay must be >= 0, got {weight_decay}")
    schedule = as_schedule(lr)

    def init(params: Any) -> LionState:
        leaves = _tree.leaves(params)
        count = torch.zeros((), dtype=torch.int64, device=leaves[0].device if leaves else "cpu")
        if weight_decay and mask is not None:
            mask_leaves(mask, params, "lion")  # a mask that does not fit fails here, not at the first step
        return LionState(count, schedule(count), zeros_like_tree(params))

    def update(grads: Any, state: LionState, params: Any = None) -> tuple[Any, LionState]:
        g, spec = _tree.flatten(grads)
        m = _tree.leaves(state.mu)
        lr_t = schedule(state.count)
        c = torch._foreach_lerp(m, g, 1 - b1)
        torch._foreach_sign_(c)
        if weight_decay:
            if params is None:
                raise ValueError("lion with weight_decay needs params in update(grads, state, params)")
            p = _tree.leaves(params)
            dec = [
                i for i, f in enumerate(mask_leaves(mask, params, "lion") if mask else [True] * len(p)) if f
            ]
            if dec:
                torch._foreach_add_(pick(c, dec), pick(p, dec), alpha=weight_decay)
        torch._foreach_mul_(c, -lr_t)
        torch._foreach_lerp_(m, g, 1 - b2)
        return _tree.unflatten(spec, list(c)), LionState(state.count + 1, lr_t, state.mu)

    return GradientTransformation(init, update)
