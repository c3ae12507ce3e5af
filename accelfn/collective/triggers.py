"""Cross-rank triggers: `af.dist.any(flag)` / `af.dist.all(flag)`, one tiny all-reduce, the same `bool` on
every rank (Accelerate's `set_trigger()` + `check_trigger()` as one function call).

Example:
    >>> import accelfn as af
    >>> af.dist.any(False), af.dist.all(True)     # one process: the flag itself
    (False, True)
"""

from __future__ import annotations

import builtins
from typing import Any

import torch
import torch.distributed as dist

from . import debug
from ._runtime import active, comm_device

__all__ = ["any", "all"]


def any(flag: Any) -> bool:  # noqa: A001 - af.dist.any, as jnp.any / torch.any
    """True on every rank if `flag` is true on at least one rank: one all-reduce (MAX) of one integer.

    `flag` is a `bool` (or anything `bool()` takes: a number, a one-element tensor on any device). Every rank
    must call it at the same point (it is a collective). In one process it returns `bool(flag)`.

    Example (early stopping: each rank checks its own value, all stop at the same step):
        >>> import torch, accelfn as af
        >>> for step, loss in enumerate([0.9, 0.5, 0.2, 0.1]):
        ...     if af.dist.any(loss < 0.3):
        ...         break
        >>> step
        2
    """
    return _reduce("any", flag, dist.ReduceOp.MAX)


def all(flag: Any) -> bool:  # noqa: A001
    """True on every rank if `flag` is true on every rank: one all-reduce (MIN) of one integer. In one process
    it returns `bool(flag)`.

    Example:
        >>> import torch, accelfn as af
        >>> af.dist.all(torch.tensor(True))
        True
    """
    return _reduce("all", flag, dist.ReduceOp.MIN)


def _reduce(fn: str, flag: Any, op: Any) -> bool:
    value = _as_bool(fn, flag)
    if not active(fn):
        return value
    if debug.enabled():
        debug.check(fn, "flag")
    buf = torch.tensor([int(value)], dtype=torch.int32, device=comm_device())
    dist.all_reduce(buf, op=op)
    return builtins.bool(buf.item())


def _as_bool(fn: str, flag: Any) -> bool:
    if isinstance(flag, torch.Tensor):
        if flag.numel() != 1:
            raise ValueError(
                f"af.dist.{fn}: flag is a tensor of shape {tuple(flag.shape)}; pass one value, e.g. "
                f"(x > 0).{fn}() over the elements of this rank's tensor"
            )
        return builtins.bool(flag.item())
    try:
        return builtins.bool(flag)
    except Exception as e:  # numpy arrays of many elements, objects whose __bool__ raises
        raise ValueError(
            f"af.dist.{fn}: flag {type(flag).__name__} has no single truth value ({e})"
        ) from None
