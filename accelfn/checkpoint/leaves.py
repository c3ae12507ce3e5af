"""A `TrainState` as a flat list of `(path, leaf)` pairs, and how each pair is stored.

Paths are `af.tree.flatten_with_path` paths (`params.lm_head.weight`, `opt_state.1.mu.fc.weight`); the first
component is the `TrainState` field, which picks the file group (see `format.GROUPS`).

Example:
    >>> import torch, accelfn as af
    >>> from accelfn.checkpoint.leaves import split_path, dtype_name, dtype_of
    >>> split_path("opt_state.1.mu.fc.weight"), dtype_of(dtype_name(torch.bfloat16))
    (('opt_state', '1.mu.fc.weight'), torch.bfloat16)
"""

from __future__ import annotations

from typing import Any

import torch

from .. import tree as _tree
from ._dist import is_dtensor

__all__ = ["flatten", "split_path", "dtype_name", "dtype_of", "alias_key", "JSON_TYPES", "describe"]

JSON_TYPES = (bool, int, float, str)


def flatten(state: Any) -> tuple[list[tuple[str, Any]], Any]:
    """`([(path, leaf), ...], treespec)` of a state (None is not a leaf)."""
    return _tree.flatten_with_path(state), _tree.structure(state)


def split_path(path: str) -> tuple[str, str]:
    """`("opt_state", "1.mu.w")` from `"opt_state.1.mu.w"`; `("step", "")` from `"step"`."""
    field, _, rest = path.partition(".")
    return field, rest


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in checkpoint")
    return dtype


def alias_key(t: torch.Tensor) -> Any:
    """Identity of the memory a tensor shows: two leaves with the same key are one shared tensor."""
    if is_dtensor(t):
        return ("dtensor", id(t))
    if t.numel() == 0 or t.device.type == "meta":
        return ("object", id(t))
    return (
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        t.stride(),
        t.dtype,
        str(t.device),
    )


def describe(x: Any) -> str:
    """A short description of a leaf for error messages."""
    if isinstance(x, torch.Tensor):
        kind = "DTensor" if is_dtensor(x) else "tensor"
        return f"{kind} {dtype_name(x.dtype)}{list(x.shape)}"
    return f"{type(x).__name__} {x!r:.40}"
