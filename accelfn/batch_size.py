"""`find_executable_batch_size`: run a function at the largest batch size that fits in memory.

Example:
    >>> import torch
    >>> from accelfn.batch_size import find_executable_batch_size
    >>> @find_executable_batch_size(starting_batch_size=64)
    ... def train(batch_size):
    ...     if batch_size > 16:
    ...         raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    ...     return batch_size
    >>> train()
    16
"""

from __future__ import annotations

import functools
import gc
import logging
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from . import platforms

if TYPE_CHECKING:
    from .mesh import Mesh
    from .platforms import Platform

__all__ = ["find_executable_batch_size", "is_out_of_memory"]

log = logging.getLogger(__name__)
R = TypeVar("R")

_OK, _OOM, _FAILED = 2, 1, 0  # per-attempt status; the ranks agree on the MIN


def is_out_of_memory(exc: BaseException, platform: Platform | None = None) -> bool:
    """Whether `exc` is an allocation failure on `platform`'s devices (default: the detected kind) or on the
    host, as the platform adapters recognise them (`Platform.is_out_of_memory`).

    Example:
        >>> from accelfn.batch_size import is_out_of_memory
        >>> is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to ..."))
        True
    """
    platform = platform if platform is not None else platforms.detect()
    return platform.is_out_of_memory(exc) or platforms.get("cpu").is_out_of_memory(exc)


def _next_size(size: int, factor: float, minimum: int) -> int:
    smaller = int(size * factor)
    if smaller >= size:  # a factor near 1 on a small size: go down by one at least
        smaller = size - 1
    return max(smaller, minimum)


def _agree(status: int, mesh: Mesh | None) -> int:
    """The worst status over all processes of `mesh` (one all-reduce MIN); this process's without a mesh."""
    if mesh is None or mesh.world_size == 1:
        return status
    import torch.distributed as dist

    flag = torch.tensor([status], dtype=torch.int32, device=mesh.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return int(flag.item())


def _free_memory(platform: Platform) -> None:
    gc.collect()
    platform.empty_cache()


def find_executable_batch_size(
    fn: Callable[..., R] | None = None,
    *,
    starting_batch_size: int = 128,
    min_batch_size: int = 1,
    factor: float = 0.5,
    mesh: Mesh | None = None,
) -> Any:
    """Decorate `fn(batch_size, *args, **kwargs)`: calling the result runs `fn` with `starting_batch_size`, and
    after an out-of-memory error (`Platform.is_out_of_memory`: `torch.OutOfMemoryError`, the CUDA/XPU/NPU/MLU/
    XLA messages, the CPU allocator's "can't allocate memory") runs it again with the size times `factor`,
    down to `min_batch_size`. Between attempts it runs the garbage collector and empties the device's cache.
    Returns `fn`'s result; when even `min_batch_size` runs out of memory it raises a `RuntimeError` naming
    every size tried. Other exceptions pass through at once. Each call starts again at `starting_batch_size`.

    Under a multi-process `mesh` (default: `af.Mesh.current()`), every attempt ends with one all-reduce MIN of
    a status flag, so all ranks retry together with the same size (a rank alone out of memory does not leave
    the others waiting), and a rank's non-memory error makes the other ranks raise too instead of hanging.
    The ranks must call the decorated function together, and `fn` itself must not run collectives before the
    point where it may run out of memory: when one rank fails inside `fn` while another goes on into a
    collective (a gradient all-reduce), the status all-reduce meets that collective and the job hangs or
    fails (as with any rank-divergent collective). Under a multi-process mesh, probe the size with local work
    (a forward and backward of one batch on the unsharded model) and train afterwards with the size found.

    Example:
        >>> from accelfn.batch_size import find_executable_batch_size
        >>> @find_executable_batch_size(starting_batch_size=8, factor=0.5)
        ... def sizes(batch_size, limit):
        ...     if batch_size > limit:
        ...         raise RuntimeError("CUDA out of memory. Tried to allocate 1.00 GiB")
        ...     return batch_size
        >>> sizes(3)
        2
    """
    if fn is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            min_batch_size=min_batch_size,
            factor=factor,
            mesh=mesh,
        )
    if isinstance(min_batch_size, bool) or not isinstance(min_batch_size, int) or min_batch_size < 1:
        raise ValueError(f"min_batch_size={min_batch_size!r}: expected an integer >= 1")
    if isinstance(starting_batch_size, bool) or not isinstance(starting_batch_size, int):
        raise ValueError(f"starting_batch_size={starting_batch_size!r}: expected an integer")
    if starting_batch_size < min_batch_size:
        raise ValueError(
            f"starting_batch_size={starting_batch_size} is below min_batch_size={min_batch_size}"
        )
    if not 0 < factor < 1:
        raise ValueError(f"factor={factor!r}: expected a number between 0 and 1 (0.5 halves the batch)")
    body = fn

    @functools.wraps(body)
    def run(*args: Any, **kwargs: Any) -> R:
        from .mesh import Mesh

        group = mesh if mesh is not None else Mesh.current()
        platform = group.platform if group is not None else platforms.detect()
        size, tried = starting_batch_size, []
        while True:
            tried.append(size)
            status, result, error, last = _OK, None, None, ""
            try:
                result = body(size, *args, **kwargs)
            except Exception as exc:
                if not is_out_of_memory(exc, platform):
                    status, error = _FAILED, exc
                else:
                    status, last = _OOM, f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
                    if size > min_batch_size:
                        traceback.clear_frames(exc.__traceback__)  # let the failed attempt's tensors go
                    else:
                        error = exc
            agreed = _agree(status, group)
            if agreed == _OK:
                return result  # type: ignore[return-value]
            if agreed == _FAILED:
                if status == _FAILED and error is not None:
                    raise error
                raise RuntimeError(
                    f"find_executable_batch_size({getattr(body, '__name__', body)!r}): another rank raised an error "
                    f"at batch size {size} (not out of memory); its traceback is in that rank's output"
                )
            result = None
            if size <= min_batch_size:
                where = last or "on another rank"
                raise RuntimeError(
                    f"find_executable_batch_size({getattr(body, '__name__', body)!r}): out-of-memory at every batch "
                    f"size tried ({', '.join(map(str, tried))}; min_batch_size={min_batch_size}); last error: "
                    f"{where}. Make the model or sequence smaller, shard it (af.shard(step, mesh, strategy='fsdp')), "
                    "or offload"
                ) from error
            new = _next_size(size, factor, min_batch_size)
            log.warning(
                "find_executable_batch_size: batch size %d ran out of memory%s; retrying with %d",
                size, "" if status == _OOM else " on another rank", new,
            )  # fmt: skip
            _free_memory(platform)
            size = new

    return run
