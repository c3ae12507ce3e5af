"""Gradient clipping by global norm (same rule as `torch.nn.utils.clip_grad_norm_`).

Example:
    >>> import torch, accelfn as af
    >>> g = {"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}
    >>> float(af.optim.global_norm(g))
    5.0
    >>> tx = af.optim.clip_by_global_norm(1.0)
    >>> u, _ = tx.update(g, tx.init(g))
    >>> [round(float(x), 4) for x in (u["a"], u["b"])]
    [0.6, 0.8]
"""

from __future__ import annotations

from typing import Any

import torch

from .. import tree as _tree
from .._typecheck import checked
from .base import EmptyState, GradientTransformation

__all__ = ["global_norm", "clip_by_global_norm", "clip_"]


def global_norm(tree: Any) -> torch.Tensor:
    """The L2 norm of all leaves together, as a float32 0-d tensor."""
    leaves = _tree.leaves(tree)
    if not leaves:
        return torch.zeros(())
    norms = torch._foreach_norm(leaves)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))


def clip_(leaves: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale `leaves` in place by `min(1, max_norm / (norm + 1e-6))`."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(leaves, coef.to(leaves[0].device))


@checked
def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale the updates so their global L2 norm is at most `max_norm`."""
    if max_norm <= 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be > 0, got {max_norm}")

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        leaves = _tree.leaves(updates)
        if leaves:
            clip_(leaves, global_norm(leaves), max_norm)
        return updates, state

    return GradientTransformation(
        lambda params: EmptyState(), update, hyperparams={"name": "clip_by_global_norm", "max_norm": max_norm}
    )
