"""The two DTensor questions asked across the package: is a tensor a DTensor (sharded by FSDP2 or tensor
parallel), and which part of it does this rank hold.

Example:
    >>> import torch
    >>> from accelfn.dtensor import is_dtensor, local_tensor
    >>> t = torch.ones(2)
    >>> is_dtensor(t), local_tensor(t) is t
    (False, True)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_dtensor", "local_tensor"]


def is_dtensor(x: Any) -> bool:
    """Whether `x` is a `torch.distributed.tensor.DTensor`."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(x, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view of its storage, outside autograd), or the tensor itself."""
    return getattr(t, "_local_tensor", t)
