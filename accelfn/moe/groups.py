"""The ranks whose rows add up to the global batch, for the MoE balancing functions.

`group=mesh` is the safe spelling: it is the mesh's gradient group (its data axes and `cp`: under context
parallel each rank routes its part of every sequence, so the `cp` ranks' rows add up too; the `tp` ranks route
the same rows and are left out). A process group (or None: this process alone) is taken as given.

Example:
    >>> row_group(None) is None
    True
"""

from __future__ import annotations

from typing import Any

from ..mesh import Mesh

__all__ = ["row_group"]


def row_group(group: Any) -> Any:
    """`group` as a process group: a `Mesh` gives its `grad_group()`; anything else is returned unchanged."""
    return group.grad_group() if isinstance(group, Mesh) else group
