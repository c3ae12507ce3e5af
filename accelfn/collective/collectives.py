"""Collectives over all processes, on tensors or pytrees of tensors; each returns new tensors.

In a world of one process (not launched) they return their input's values without communicating.
Results carry no gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import tree as _tree
from . import debug
from ._runtime import active, comm_device, world_size

__all__ = [
    "gather",
    "gather_object",
    "all_reduce",
    "broadcast",
    "broadcast_object",
    "barrier",
    "tensor_leaves",
]

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def tensor_leaves(fn: str, tree: Any) -> list[tuple[str, torch.Tensor]]:
    """`[(path, tensor), ...]` of `tree`, raising `TypeError` naming the first leaf that is not a tensor."""
    items = _tree.flatten_with_path(tree)
    for path, leaf in items:
        if not isinstance(leaf, torch.Tensor):
            where = f" at {path!r}" if path else ""
            raise TypeError(
                f"af.dist.{fn}: expected a tensor or a pytree of tensors, got {type(leaf).__name__}{where}; "
                f"use af.dist.{'gather_object' if fn == 'gather' else 'broadcast_object'} for Python objects"
            )
    return items


def _map(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    return _tree.map(fn, tree)


def _debug(op: str, items: list[tuple[str, torch.Tensor]], **kw: Any) -> None:
    if debug.enabled():
        debug.check(op, [(path, debug.describe(t, **kw)) for path, t in items])


def _to_comm(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A contiguous copy of `t` on the communication device (never the caller's storage)."""
    return t.detach().to(device, memory_format=torch.contiguous_format, copy=True)


def gather(tree: Any) -> Any:
    """All-gather along dim 0: every rank gets the ranks' tensors concatenated in rank order.

    Tensors must have the same shape on every rank (see `pad_across_processes`); a 0-d tensor
    becomes one element per rank.

    Example:
        >>> import torch, accelfn as af
        >>> af.dist.gather({"pred": torch.tensor([1, 2]), "loss": torch.tensor(0.5)})["loss"]
        tensor([0.5000])
    """
    items = tensor_leaves("gather", tree)
    if not active("gather"):
        return _map(lambda t: t.reshape(1) if t.ndim == 0 else t, tree)
    _debug("gather", items)
    device, n = comm_device(), world_size()

    def one(t: torch.Tensor) -> torch.Tensor:
        src = _to_comm(t.reshape(1) if t.ndim == 0 else t, device)
        if src.dtype == torch.bool:
            src = src.to(torch.uint8)
        parts = [torch.empty_like(src) for _ in range(n)]
        dist.all_gather(parts, src)
        return torch.cat(parts).to(device=t.device, dtype=t.dtype)

    return _map(one, tree)


def all_reduce(tree: Any, op: str = "mean") -> Any:
    """Reduce across ranks with `op` in `"mean"`, `"sum"`, `"max"`, `"min"`; every rank gets the result.

    `"mean"` of an integer tensor gives a float tensor.

    Example:
        >>> import torch, accelfn as af
        >>> af.dist.all_reduce(torch.tensor([1.0, 3.0]), op="sum")
        tensor([1., 3.])
    """
    if op not in _OPS:
        raise ValueError(f"af.dist.all_reduce: unknown op {op!r}; use one of {', '.join(map(repr, _OPS))}")
    items = tensor_leaves("all_reduce", tree)
    if not active("all_reduce"):
        return _map(lambda t: t.detach().clone(), tree)
    _debug(f"all_reduce[{op}]", items)
    device, n = comm_device(), world_size()

    def one(t: torch.Tensor) -> torch.Tensor:
        buf = _to_comm(t, device)
        dist.all_reduce(buf, op=_OPS[op])
        if op == "mean":
            buf = buf / n
        return buf.to(t.device)

    return _map(one, tree)


def broadcast(tree: Any, src: int = 0) -> Any:
    """Every rank gets rank `src`'s tensors (which must have the same shapes and dtypes on every rank).

    Example:
        >>> import torch, accelfn as af
        >>> af.dist.broadcast(torch.arange(3), src=0)
        tensor([0, 1, 2])
    """
    _check_src("broadcast", src)
    items = tensor_leaves("broadcast", tree)
    if not active("broadcast"):
        return _map(lambda t: t.detach().clone(), tree)
    _debug(f"broadcast[src={src}]", items)
    device = comm_device()

    def one(t: torch.Tensor) -> torch.Tensor:
        buf = _to_comm(t, device)
        dist.broadcast(buf, src=src)
        return buf.to(t.device)

    return _map(one, tree)


def gather_object(obj: Any, *, flatten: bool = False) -> list[Any]:
    """Every rank gets the list of all ranks' (picklable) objects, one entry per rank, in rank order.

    With `flatten=True` each rank passes a list (or tuple) and every rank gets their concatenation in rank
    order, as Accelerate's `gather_object` returns: `[rank]` on 2 ranks gives `[0, 1]`, not `[[0], [1]]`.
    A rank passing something else is a `TypeError` on every rank (after the one collective, so none hangs).

    Example:
        >>> import accelfn as af
        >>> af.dist.gather_object({"n": 3})
        [{'n': 3}]
        >>> af.dist.gather_object(["a", "b"], flatten=True)
        ['a', 'b']
    """
    if not active("gather_object"):
        out: list[Any] = [obj]
    else:
        if debug.enabled():
            debug.check("gather_object", "object")
        out = [None] * world_size()
        dist.all_gather_object(out, obj)
    if not flatten:
        return out
    wrong = {r: type(o).__name__ for r, o in enumerate(out) if not isinstance(o, (list, tuple))}
    if wrong:
        which = ", ".join(f"rank {r} passed {name}" for r, name in wrong.items())
        raise TypeError(
            f"af.dist.gather_object: flatten=True concatenates the ranks' lists, but {which}; pass a list "
            "(e.g. [obj]), or flatten=False for one entry per rank"
        )
    return [x for part in out for x in part]


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Every rank gets rank `src`'s (picklable) object; the others' arguments are ignored.

    Example:
        >>> import accelfn as af
        >>> af.dist.broadcast_object({"seed": 7})
        {'seed': 7}
    """
    _check_src("broadcast_object", src)
    if not active("broadcast_object"):
        return obj
    if debug.enabled():
        debug.check(f"broadcast_object[src={src}]", "object")
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    """Wait until every process has reached this point.

    Example:
        >>> import accelfn as af
        >>> af.dist.barrier()
    """
    if active("barrier"):
        if debug.enabled():
            debug.check("barrier", "")
        dist.barrier()


def _check_src(fn: str, src: int) -> None:
    n = world_size()
    if not isinstance(src, int) or not 0 <= src < n:
        raise ValueError(
            f"af.dist.{fn}: src={src!r} is not a rank of this world of {n} processes (0..{n - 1})"
        )
