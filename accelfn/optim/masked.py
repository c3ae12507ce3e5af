"""Apply a transformation to some leaves only (optax's `masked`).

Leaves where the mask is False pass through unchanged (their gradient *is* their update), so combine with
another transformation for them: `freeze(mask)` to leave those params as they are, or use `adamw(mask=...)`
for the common "no weight decay on biases and norms" case.

Example:
    >>> import torch, accelfn as af
    >>> params = {"w": torch.ones(1), "b": torch.ones(1)}
    >>> tx = af.optim.masked(af.optim.sgd(0.5), {"w": True, "b": False})
    >>> u, _ = tx.update({"w": torch.ones(1), "b": torch.ones(1)}, tx.init(params), params)
    >>> u["w"].item(), u["b"].item()
    (-0.5, 1.0)
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .. import tree as _tree
from .._typecheck import checked
from ._kernels import MaskLike, mask_leaves
from .base import GradientTransformation

__all__ = ["MaskedState", "masked"]


class MaskedState(NamedTuple):
    inner_state: Any


def _select(tree: Any, flags: list[bool]) -> dict[str, Any]:
    return {path: leaf for (path, leaf), f in zip(_tree.flatten_with_path(tree), flags) if f}


@checked
def masked(inner: GradientTransformation, mask: MaskLike) -> GradientTransformation:
    """Apply `inner` where `mask` (pytree of bools, or callable params -> pytree) is True."""

    def init(params: Any) -> MaskedState:
        return MaskedState(inner.init(_select(params, mask_leaves(mask, params, "masked"))))

    def update(updates: Any, state: MaskedState, params: Any = None) -> tuple[Any, MaskedState]:
        flags = mask_leaves(mask, params if params is not None else updates, "masked")
        sub_u = _select(updates, flags)
        sub_p = _select(params, flags) if params is not None else None
        new_sub, inner_state = inner.update(sub_u, state.inner_state, sub_p)
        leaves, spec = _tree.flatten(updates)
        paths = [p for p, _ in _tree.flatten_with_path(updates)]
        merged = [new_sub[p] if f else u for p, u, f in zip(paths, leaves, flags)]
        return _tree.unflatten(spec, merged), MaskedState(inner_state)

    return GradientTransformation(init, update)
