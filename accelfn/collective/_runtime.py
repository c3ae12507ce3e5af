"""Who am I in the job, and where collectives run; shared by the `af.dist` modules."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .. import platforms
from ..mesh import Mesh

__all__ = [
    "rank",
    "world_size",
    "local_rank",
    "is_main_process",
    "is_local_main_process",
    "active",
    "comm_device",
]


def _env(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 when not launched)."""
    return dist.get_rank() if _initialized() else _env("RANK", 0)


def world_size() -> int:
    """Number of processes in the job (1 when not launched)."""
    return dist.get_world_size() if _initialized() else _env("WORLD_SIZE", 1)


def local_rank() -> int:
    """This process's rank within its node (`LOCAL_RANK`; 0 when not launched)."""
    mesh = Mesh.current()
    return mesh.local_rank if mesh is not None else _env("LOCAL_RANK", 0)


def is_main_process() -> bool:
    """Whether this is global rank 0 (true when not launched)."""
    return rank() == 0


def is_local_main_process() -> bool:
    """Whether this is the first process of its node."""
    return local_rank() == 0


def active(fn: str) -> bool:
    """Whether collective `fn` has to talk to other processes (False in a world of one).

    Raises when the job was launched with several processes but no process group was started.
    """
    if _initialized():
        return dist.get_world_size() > 1
    if _env("WORLD_SIZE", 1) > 1:
        raise RuntimeError(
            f"af.dist.{fn}: this process is one of WORLD_SIZE={os.environ['WORLD_SIZE']} but no process group "
            "is running; create the mesh first: `mesh = af.Mesh.from_env()`"
        )
    return False


def comm_device() -> torch.device:
    """The device the process group's backend communicates from (tensors are moved there and back)."""
    mesh = Mesh.current()
    if mesh is not None:
        return mesh.device
    return platforms.from_backend(str(dist.get_backend())).device(local_rank())
