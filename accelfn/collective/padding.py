"""`pad_across_processes`: make tensors the same size along one dim on every rank (before `gather`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import tree as _tree
from . import debug
from ._runtime import active, comm_device, world_size
from .collectives import tensor_leaves

__all__ = ["pad_across_processes"]


def pad_across_processes(tree: Any, dim: int = 0, pad_index: int | float = 0, pad_first: bool = False) -> Any:
    """Pad each tensor along `dim` with `pad_index` to the largest size any rank has there.

    `pad_first=True` pads before the data instead of after it.

    Example:
        >>> import torch, accelfn as af
        >>> af.dist.pad_across_processes(torch.tensor([1, 2, 3]), pad_index=-1)   # world of one: unchanged
        tensor([1, 2, 3])
    """
    items = tensor_leaves("pad_across_processes", tree)
    dims = []
    for path, t in items:
        if not -t.ndim <= dim < max(t.ndim, 1) or t.ndim == 0:
            where = f" {path!r}" if path else ""
            raise ValueError(
                f"af.dist.pad_across_processes: dim={dim} is out of range for tensor{where} of shape "
                f"{tuple(t.shape)}; pass a dim between {-t.ndim} and {t.ndim - 1}"
            )
        dims.append(dim % t.ndim)
    if not active("pad_across_processes") or not items:
        return tree
    if debug.enabled():
        debug.check(
            f"pad_across_processes[dim={dim}]",
            [(p, debug.describe(t, free_dim=d)) for (p, t), d in zip(items, dims)],
        )
    sizes = torch.tensor(
        [t.shape[d] for (_, t), d in zip(items, dims)], dtype=torch.int64, device=comm_device()
    )
    everyone = [torch.empty_like(sizes) for _ in range(world_size())]
    dist.all_gather(everyone, sizes)
    target = torch.stack(everyone).amax(dim=0).tolist()
    leaves, spec = _tree.flatten(tree)
    out = [_pad(t, d, int(n), pad_index, pad_first) for t, d, n in zip(leaves, dims, target)]
    return _tree.unflatten(spec, out)


def _pad(t: torch.Tensor, dim: int, size: int, value: int | float, first: bool) -> torch.Tensor:
    missing = size - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    fill = torch.full(shape, value, dtype=t.dtype, device=t.device)
    return torch.cat([fill, t] if first else [t, fill], dim=dim)
