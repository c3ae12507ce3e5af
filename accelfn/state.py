"""`TrainState`: everything a training run carries from one step to the next, as one pytree.

Example:
    >>> import torch, accelfn as af
    >>> s = af.TrainState(step=torch.tensor(0), params={"w": torch.ones(2)}, buffers={}, opt_state=(),
    ...                   rng=af.random.key(0))
    >>> s.replace(step=s.step + 1).step.item()
    1
    >>> [p for p, _ in af.tree.flatten_with_path(s)][:2]
    ['step', 'params.w']
"""

from __future__ import annotations

import weakref
from typing import Any

import attrs
import optree
import torch
import torch.utils._pytree as torch_pytree

from . import tree as _tree

__all__ = ["TrainState"]

_FIELDS = ("step", "params", "buffers", "opt_state", "rng", "extra")


@attrs.frozen
class TrainState:
    """The training state: step counter, params and buffers (dotted module names -> tensors, as
    `named_parameters()` / `named_buffers()`), optimizer state, RNG key and `extra` (loss scaler, fp8 state).

    Example:
        >>> import torch, accelfn as af
        >>> state = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1)).init(torch.nn.Linear(2, 1))
        >>> int(state.step), sorted(state.params), state.replace(step=state.step + 1).step.item()
        (0, ['bias', 'weight'], 1)
    """

    step: torch.Tensor
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    opt_state: Any
    rng: torch.Tensor
    extra: dict[str, Any] = attrs.field(factory=dict)

    def replace(self, **changes: Any) -> TrainState:
        """A copy with the given fields replaced."""
        return attrs.evolve(self, **changes)

    def __repr__(self) -> str:
        n = sum(int(p.numel()) for p in self.params.values())
        return (
            f"TrainState(step={int(self.step)}, params={len(self.params)} tensors / {n:,} elements, "
            f"buffers={len(self.buffers)}, extra={sorted(self.extra)})"
        )


# donated TrainStates (by id, while they live) and what took them: their tensors now hold another state's values
_donated: dict[int, tuple[weakref.ref[TrainState], str]] = {}


def mark_donated(state: TrainState, by: str = "a training step") -> None:
    """Record that `by` (a training step, `af.checkpoint.load` as `like`) overwrote `state`'s tensors in place
    and returned a new state."""
    key = id(state)
    _donated[key] = (weakref.ref(state, lambda _: _donated.pop(key, None)), by)


def check_not_donated(state: TrainState, who: str | None = None) -> None:
    """A `ValueError` if `state` was donated: its tensors hold the newer state (the params after that update, or
    the checkpoint's) beside its own old step count and extras. `who` names the call that was given it."""
    entry = _donated.get(id(state))
    if entry is None or entry[0]() is not state:
        return
    by = entry[1]
    what = (
        f"{who}: this state ({state!r}) was already passed to {by}, which donated it: its params and optimizer "
        f"state were overwritten in place, so they are the new state's while its step count is this one's, and "
        f"{who} would mix the two"
        if who
        else f"this state ({state!r}) was already passed to {by}, which donated it: its tensors were overwritten "
        "in place, so they hold the newer state, not this one"
    )
    raise ValueError(
        f"{what}. Pass the state that call returned; to keep an earlier state (a retry, a best-so-far copy), "
        "clone it (`af.tree.map(torch.clone, state)`) or use af.train_step(..., donate=False)"
    )


def _flatten(s: TrainState) -> tuple[tuple[Any, ...], None, tuple[str, ...]]:
    return tuple(getattr(s, f) for f in _FIELDS), None, _FIELDS


def _unflatten(_: None, children: Any) -> TrainState:
    return TrainState(*children)


optree.register_pytree_node(TrainState, _flatten, _unflatten, namespace=_tree.NAMESPACE)  # type: ignore[arg-type]
torch_pytree.register_pytree_node(
    TrainState,
    lambda s: (list(_flatten(s)[0]), None),
    lambda children, _ctx: TrainState(*children),
    serialized_type_name="accelfn.TrainState",
    flatten_with_keys_fn=lambda s: ([(torch_pytree.GetAttrKey(f), getattr(s, f)) for f in _FIELDS], None),
)
