"""The optax protocol: a `GradientTransformation` is a pair of functions `(init, update)`.

`update(updates, state, params) -> (updates, state)` maps gradients to parameter updates; `chain` composes
transformations; `apply_updates(params, updates)` adds them. A transformation may also offer `apply`, the
same step done in place on donated params with a fused kernel (`torch._fused_adamw_`, ...); the training
step uses it when present (`apply_gradients`). Transformations may reuse the storage of the `updates` they
receive (donation), never of `params` except in `apply`.

Example:
    >>> import torch, accelfn as af
    >>> params = {"w": torch.ones(3)}
    >>> tx = af.optim.chain(af.optim.clip_by_global_norm(1.0), af.optim.sgd(0.1))
    >>> opt_state = tx.init(params)
    >>> updates, opt_state = tx.update({"w": torch.full((3,), 10.0)}, opt_state, params)
    >>> af.optim.apply_updates(params, updates)["w"].double().round(decimals=4).tolist()
    [0.9423, 0.9423, 0.9423]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from .. import tree as _tree
from ..dtensor import is_dtensor

Params = Any
Updates = Any
OptState = Any

__all__ = [
    "GradientTransformation",
    "EmptyState",
    "chain",
    "identity",
    "apply_updates",
    "apply_gradients",
    "learning_rate",
]


class GradientTransformation(NamedTuple):
    """`init(params) -> state`; `update(updates, state, params) -> (updates, state)`;
    optional `apply(grads, state, params) -> state` doing the update in place on `params`;
    optional `hyperparams`: what the transformation is, e.g. `{"name": "adamw", "lr": 1e-3, ...}`, so that
    a backend that brings its own optimizer (DeepSpeed) can build the same one."""

    init: Callable[[Params], OptState]
    update: Callable[[Updates, OptState, Params], tuple[Updates, OptState]]
    apply: Callable[[Updates, OptState, Params], OptState] | None = None
    hyperparams: Mapping[str, Any] | None = None


class EmptyState(NamedTuple):
    """State of a stateless transformation."""


def identity() -> GradientTransformation:
    """Pass updates through unchanged."""

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(updates: Updates, state: OptState, params: Params = None) -> tuple[Updates, OptState]:
        return updates, state

    return GradientTransformation(init, update)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply `transforms` one after the other; the state is the tuple of their states.

    When the last one has a fused in-place `apply`, the chain has one too: the others transform the
    gradients, the last updates the params in place.
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(f"chain(): argument {i} is a {type(t).__name__}, not a GradientTransformation")

    def init(params: Params) -> tuple[OptState, ...]:
        return tuple(t.init(params) for t in transforms)

    def update(updates: Updates, state: tuple[OptState, ...], params: Params = None) -> tuple[Updates, Any]:
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    hyperparams = {"name": "chain", "parts": tuple(t.hyperparams for t in transforms)}
    last_apply = transforms[-1].apply if transforms else None
    if last_apply is None:
        return GradientTransformation(init, update, hyperparams=hyperparams)

    def apply(grads: Updates, state: tuple[OptState, ...], params: Params) -> tuple[OptState, ...]:
        new_state = []
        for t, s in zip(transforms[:-1], state[:-1]):
            grads, s = t.update(grads, s, params)
            new_state.append(s)
        new_state.append(last_apply(grads, state[-1], params))
        return tuple(new_state)

    return GradientTransformation(init, update, apply, hyperparams)


def apply_updates(params: Params, updates: Updates) -> Params:
    """`params + updates`, leaf by leaf (a new pytree; `params` is not modified)."""
    return _tree.map(lambda p, u: p if u is None else p + u.to(p.dtype), params, updates)


@torch.no_grad()
def apply_gradients(tx: GradientTransformation, grads: Updates, state: OptState, params: Params) -> OptState:
    """Update `params` in place from `grads` and return the new optimizer state.

    Uses the transformation's fused `apply` when it has one, else `update` plus a multi-tensor add.
    `params` and `grads` are donated: their storage is reused.
    """
    if tx.apply is not None:
        return tx.apply(grads, state, params)
    updates, state = tx.update(grads, state, params)
    p_leaves, u_leaves = _tree.leaves(params), _tree.leaves(updates)
    torch._foreach_add_(p_leaves, u_leaves)
    return state


def _names(hyperparams: Any) -> list[str]:
    parts = (hyperparams or {}).get("parts")
    if parts:
        return [n for h in parts for n in _names(h)]
    return [str((hyperparams or {}).get("name"))]


@torch.no_grad()
def apply_gradients_on_shards(
    tx: GradientTransformation, grads: Updates, state: OptState, params: Params
) -> OptState:
    """`apply_gradients` on each rank's local shards, for params that mix DTensors with plain tensors (tensor
    parallel: multi-tensor kernels refuse such lists); the state keeps its DTensors. A transformation that reduces over all elements would see
    only this rank's shards, so it is refused."""
    reducing = [n for n in _names(tx.hyperparams) if n == "clip_by_global_norm"]
    if reducing:
        raise ValueError(
            "the optimizer's clip_by_global_norm would see only this rank's tensor-parallel shards: clip with "
            "af.train_step(..., clip_grad_norm=max_norm), whose norm counts every element once"
        )
    originals: dict[int, Any] = {}

    def local(t: Any) -> Any:
        if not is_dtensor(t):
            return t
        view = t.to_local()
        originals[id(view)] = t
        return view

    new_state = apply_gradients(
        tx, _tree.map(local, grads), _tree.map(local, state), _tree.map(local, params)
    )
    return _tree.map(lambda x: originals.get(id(x), x), new_state)


def learning_rate(state: OptState) -> torch.Tensor | None:
    """The learning rate of the last update, found in an optimizer state (`None` if it has none)."""
    if isinstance(state, tuple) and hasattr(state, "lr") and isinstance(state.lr, torch.Tensor):
        return state.lr
    if isinstance(state, (tuple, list)):
        for s in state:
            found = learning_rate(s)
            if found is not None:
                return found
    return None
