"""Adam and AdamW, with torch's fused multi-tensor kernels (`torch._fused_adam_/_fused_adamw_`).

Numerically equal to `torch.optim.Adam` / `torch.optim.AdamW` with the same hyper-parameters.

Example:
    >>> import torch, accelfn as af
    >>> params = {"w": torch.ones(2), "b": torch.zeros(2)}
    >>> tx = af.optim.adamw(1e-2, weight_decay=0.1, mask=lambda p: {k: v.ndim > 0 and k != "b" for k, v in p.items()})
    >>> state = tx.init(params)
    >>> state = af.optim.apply_gradients(tx, {"w": torch.ones(2), "b": torch.ones(2)}, state, params)
    >>> params["w"].double().round(decimals=4).tolist(), params["b"].double().round(decimals=4).tolist(), int(state.count)
    ([0.989, 0.989], [-0.01, -0.01], 1)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .. import platforms
from .. import tree as _tree
from .._typecheck import checked
from ._kernels import MaskLike, groups, mask_leaves, pick, try_fused, zeros_like_tree
from .base import GradientTransformation
from .schedules import ScheduleLike, as_schedule

__all__ = ["AdamState", "adam", "adamw"]


class AdamState(NamedTuple):
    """`count`: updates done (int64); `lr`: learning rate of the last update; `mu`, `nu`: moments."""

    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    lr: torch.Tensor
    mu: Any
    nu: Any


def _adam(
    lr: ScheduleLike,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    mask: MaskLike | None,
    decoupled: bool,
) -> GradientTransformation:
    schedule = as_schedule(lr)
    name = "adamw" if decoupled else "adam"
    for what, value in (("b1", b1), ("b2", b2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name}: {what} must be in [0, 1), got {value}")
    if not eps >= 0.0 or not weight_decay >= 0.0:
        raise ValueError(
            f"{name}: eps and weight_decay must be >= 0, got eps={eps}, weight_decay={weight_decay}"
        )
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_

    def init(params: Any) -> AdamState:
        leaves = _tree.leaves(params)
        device = leaves[0].device if leaves else torch.device("cpu")
        count = torch.zeros((), dtype=torch.int64, device=device)
        if weight_decay and mask is not None:
            mask_leaves(mask, params, name)  # a mask that does not fit fails here, not at the first step
        return AdamState(count, schedule(count), zeros_like_tree(params), zeros_like_tree(params))

    def decay_flags(params: Any, n: int) -> list[bool]:
        if weight_decay == 0.0:
            return [False] * n
        return [True] * n if mask is None else mask_leaves(mask, params, name)

    def update(grads: Any, state: AdamState, params: Any = None) -> tuple[Any, AdamState]:
        g, g_spec = _tree.flatten(grads)
        m, v = _tree.leaves(state.mu), _tree.leaves(state.nu)
        p = _tree.leaves(params) if params is not None else None
        if weight_decay and p is None:
            raise ValueError(f"{name} with weight_decay needs params in update(grads, state, params)")
        flags = decay_flags(params, len(g))
        lr_t = schedule(state.count)
        count = state.count + 1
        if weight_decay and not decoupled:  # Adam's L2 penalty: added to the gradient
            dec = [i for i, f in enumerate(flags) if f]
            g = list(g)
            for i, gi in zip(dec, torch._foreach_add(pick(g, dec), pick(p, dec), alpha=weight_decay)):  # type: ignore[arg-type]
                g[i] = gi
        torch._foreach_lerp_(m, g, 1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, g, g, 1 - b2)
        cnt = count.to(platforms.count_dtype(count.device))
        bc1 = 1 - b1**cnt
        bc2_sqrt = torch.sqrt(1 - b2**cnt)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bc2_sqrt.to(torch.float32))
        torch._foreach_add_(denom, eps)
        upd = torch._foreach_div(m, denom)
        torch._foreach_mul_(upd, (-lr_t / bc1).to(torch.float32))
        if weight_decay and decoupled:
            dec = [i for i, f in enumerate(flags) if f]
            if dec:
                decay = torch._foreach_mul(pick(p, dec), (-lr_t * weight_decay).to(torch.float32))  # type: ignore[arg-type]
                torch._foreach_add_(pick(upd, dec), decay)
        return _tree.unflatten(g_spec, list(upd)), AdamState(count, lr_t, state.mu, state.nu)

    def apply(grads: Any, state: AdamState, params: Any) -> AdamState:
        p, g = _tree.leaves(params), _tree.leaves(grads)
        m, v = _tree.leaves(state.mu), _tree.leaves(state.nu)
        flags = decay_flags(params, len(p))
        lr_t = schedule(state.count)
        count = state.count + 1
        step_f = count.to(torch.float32)
        calls = []
        for wd in {weight_decay if f else 0.0 for f in flags}:
            idx = [i for i, f in enumerate(flags) if (weight_decay if f else 0.0) == wd]
            for grp in groups(p, idx):
                calls.append((grp, wd))

        def run() -> None:
            for grp, wd in calls:
                kernel(
                    pick(p, grp),
                    pick(g, grp),
                    pick(m, grp),
                    pick(v, grp),
                    [],
                    [step_f] * len(grp),
                    lr=lr_t,
                    beta1=b1,
                    beta2=b2,
                    weight_decay=wd,
                    eps=eps,
                    amsgrad=False,
                    maximize=False,
                )

        def traffic() -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
            return [(pick(g, grp), pick(p, grp) + pick(m, grp) + pick(v, grp)) for grp, _ in calls]

        if p and try_fused(name, p[0].device, run, traffic):
            return AdamState(count, lr_t, state.mu, state.nu)
        updates, new_state = update(grads, state, params)
        torch._foreach_add_(p, _tree.leaves(updates))
        return new_state

    hyperparams = {
        "name": name,
        "lr": lr,
        "b1": b1,
        "b2": b2,
        "eps": eps,
        "weight_decay": weight_decay,
        "mask": mask,
    }
    return GradientTransformation(init, update, apply, hyperparams)


@checked
def adam(
    lr: ScheduleLike, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0
) -> GradientTransformation:
    """Adam (`weight_decay` is an L2 penalty added to the gradient, as in `torch.optim.Adam`)."""
    return _adam(lr, b1, b2, eps, weight_decay, None, decoupled=False)


@checked
def adamw(
    lr: ScheduleLike,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    mask: MaskLike | None = None,
) -> GradientTransformation:
    """AdamW: Adam with decoupled weight decay, applied only where `mask` is True (default: everywhere).

    `mask` is a pytree of bools like the params, or a callable `params -> pytree of bools`.
    """
    return _adam(lr, b1, b2, eps, weight_decay, mask, decoupled=True)
