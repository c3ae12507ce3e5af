"""Collectives and process helpers over all processes of the job (gloo, nccl, ... via torch.distributed).

Every function also works in a single, un-launched process (a world of one). Set `ACCELFN_DEBUG=1` to
have collectives compare the ranks' tensor shapes first and raise `CollectiveMismatchError` instead of
hanging.

Example:
    >>> import torch, accelfn as af
    >>> af.dist.rank(), af.dist.world_size(), af.dist.is_main_process()
    (0, 1, True)
    >>> af.dist.all_reduce({"loss": torch.tensor(2.0)}, op="mean")
    {'loss': tensor(2.)}
    >>> af.dist.any(False), af.dist.gather_object([0], flatten=True)
    (False, [0])
"""

from ._runtime import is_local_main_process, is_main_process, local_rank, rank, world_size
from .collectives import all_reduce, barrier, broadcast, broadcast_object, gather, gather_object
from .debug import CollectiveMismatchError
from .metrics import gather_for_metrics
from .padding import pad_across_processes
from .process import main_process_first, print
from .progress import progress
from .split import split_between_processes
from .triggers import all, any  # noqa: A004 - af.dist.any / af.dist.all, as torch.any

__all__ = [
    "rank",
    "world_size",
    "local_rank",
    "is_main_process",
    "is_local_main_process",
    "gather",
    "gather_object",
    "all_reduce",
    "broadcast",
    "broadcast_object",
    "barrier",
    "any",
    "all",
    "pad_across_processes",
    "split_between_processes",
    "main_process_first",
    "print",
    "progress",
    "CollectiveMismatchError",
    "gather_for_metrics",
]
