"""States whose optimizer state lives outside the state (a backend's engine): how they are checkpointed.

A backend registers an adapter for the type of its `state.opt_state`. `save` then writes
`adapter.export(state)` — an ordinary `TrainState` with full tensors in accelfn's own layout, so the
checkpoint is the same as that of the equivalent `backend="torch"` step and loads into either — and
`load(path, like)` reads into `adapter.template(like)` (the exported structure, values unset) and hands the
result to `adapter.restore(like, loaded)`, which writes it back into the engine.

Example:
    >>> from accelfn.checkpoint import adapters
    >>> adapters.adapter_for(object()) is None
    True
"""

from __future__ import annotations

from typing import Any, Protocol

from ..state import TrainState

__all__ = ["StateAdapter", "register", "adapter_for"]


class StateAdapter(Protocol):
    def template(self, like: TrainState) -> TrainState:
        """What `export(like)` would return, with any values (only structure, shapes and dtypes count)."""
        ...

    def export(self, state: TrainState) -> TrainState:
        """A plain state (full tensors, accelfn's optimizer-state layout) with the values of `state`."""
        ...

    def restore(self, like: TrainState, loaded: TrainState) -> TrainState:
        """Write `loaded` (shaped like `export(like)`) into the backend; return the state to train on."""
        ...


_ADAPTERS: dict[type, StateAdapter] = {}


def register(opt_state_type: type, adapter: StateAdapter) -> None:
    """Checkpoint states whose `opt_state` is a `opt_state_type` through `adapter`."""
    _ADAPTERS[opt_state_type] = adapter


def adapter_for(state: Any) -> StateAdapter | None:
    """The adapter registered for `state.opt_state`'s type, if any."""
    return _ADAPTERS.get(type(getattr(state, "opt_state", None)))
