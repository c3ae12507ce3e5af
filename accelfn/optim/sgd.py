"""SGD with momentum, Nesterov and weight decay, on torch's fused kernel (`torch._fused_sgd_`).

Numerically equal to `torch.optim.SGD(lr, momentum, nesterov=..., weight_decay=...)`.

Example:
    >>> import torch, accelfn as af
    >>> params = {"w": torch.ones(2)}
    >>> tx = af.optim.sgd(0.1, momentum=0.9)
    >>> state = af.optim.apply_gradients(tx, {"w": torch.ones(2)}, tx.init(params), params)
    >>> params["w"].tolist()
    [0.8999999761581421, 0.8999999761581421]
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .. import tree as _tree
from .._typecheck import checked
from ._kernels import groups, pick, try_fused, zeros_like_tree
from .base import GradientTransformation
from .schedules import ScheduleLike, as_schedule

__all__ = ["SgdState", "sgd"]


class SgdState(NamedTuple):
    """`count`: updates done; `lr`: learning rate of the last update; `momentum`: buffers (or `None`)."""

    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    lr: torch.Tensor
    momentum: Any


@checked
def sgd(
    lr: ScheduleLike, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0
) -> GradientTransformation:
    """Stochastic gradient descent; `weight_decay` is an L2 penalty added to the gradient (as in torch)."""
    if not momentum >= 0.0 or not weight_decay >= 0.0:  # as torch.optim.SGD (NaN included)
        raise ValueError(
            f"sgd: momentum and weight_decay must be >= 0, got momentum={momentum}, weight_decay={weight_decay}"
        )
    if nesterov and momentum <= 0:
        raise ValueError(f"sgd: nesterov=True needs momentum > 0, got momentum={momentum}")
    schedule = as_schedule(lr)

    def init(params: Any) -> SgdState:
        leaves = _tree.leaves(params)
        device = leaves[0].device if leaves else torch.device("cpu")
        count = torch.zeros((), dtype=torch.int64, device=device)
        # Zero-initialised buffers give the same first step as torch's "buffer = grad" (dampening is 0).
        return SgdState(count, schedule(count), zeros_like_tree(params) if momentum else None)

    def update(grads: Any, state: SgdState, params: Any = None) -> tuple[Any, SgdState]:
        g, spec = _tree.flatten(grads)
        lr_t = schedule(state.count)
        if weight_decay:
            if params is None:
                raise ValueError("sgd with weight_decay needs params in update(grads, state, params)")
            g = list(torch._foreach_add(g, _tree.leaves(params), alpha=weight_decay))
        if momentum:
            buf = _tree.leaves(state.momentum)
            torch._foreach_mul_(buf, momentum)
            torch._foreach_add_(buf, g)
            g = list(torch._foreach_add(g, buf, alpha=momentum) if nesterov else torch._foreach_mul(buf, 1.0))
        upd = torch._foreach_mul(g, -lr_t)
        return _tree.unflatten(spec, list(upd)), SgdState(state.count + 1, lr_t, state.momentum)

    def apply(grads: Any, state: SgdState, params: Any) -> SgdState:
        p, g = _tree.leaves(params), _tree.leaves(grads)
        buf = _tree.leaves(state.momentum) if momentum else []
        lr_t = schedule(state.count)

        def run() -> None:
            for grp in groups(p):
                torch._fused_sgd_(
                    pick(p, grp),
                    pick(g, grp),
                    pick(buf, grp) if momentum else [],
                    weight_decay=weight_decay,
                    momentum=momentum,
                    lr=lr_t,
                    dampening=0.0,
                    nesterov=nesterov,
                    maximize=False,
                    is_first_step=False,
                )

        def traffic() -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
            return [(pick(g, grp), pick(p, grp) + (pick(buf, grp) if momentum else [])) for grp in groups(p)]

        if p and try_fused("sgd", p[0].device, run, traffic):
            return SgdState(state.count + 1, lr_t, state.momentum)
        updates, new_state = update(grads, state, params)
        torch._foreach_add_(p, _tree.leaves(updates))
        return new_state

    hyperparams = {
        "name": "sgd",
        "lr": lr,
        "momentum": momentum,
        "nesterov": nesterov,
        "weight_decay": weight_decay,
    }
    return GradientTransformation(init, update, apply, hyperparams)
