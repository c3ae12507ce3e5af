"""Which data shard each process reads: the data-parallel layout of a mesh (or of a plain process group).

Example:
    >>> from accelfn.data.layout import DataLayout
    >>> DataLayout.resolve(None)            # not launched, no mesh: one process reads everything
    DataLayout(data_size=1, data_rank=0, device=device(type='cpu'), data_rank_of=(0,))
"""

from __future__ import annotations

import itertools
import os

import attrs
import torch
import torch.distributed as dist

from ..mesh import Mesh

__all__ = ["DataLayout"]


@attrs.frozen
class DataLayout:
    """`data_size` shards, this process reads shard `data_rank` onto `device`; `data_rank_of[g]` is the
    shard global rank `g` reads (processes that differ only in non-data axes, e.g. `tp`, share a shard)."""

    data_size: int
    data_rank: int
    device: torch.device
    data_rank_of: tuple[int, ...]

    @staticmethod
    def resolve(mesh: Mesh | None) -> DataLayout:
        """The layout of `mesh`; with None, of `af.Mesh.current()`, else of the running process group
        (one shard per process), else of a single process. A launched process (`WORLD_SIZE` > 1) with neither
        is an error: its shard is not known yet."""
        mesh = mesh if mesh is not None else Mesh.current()
        if mesh is not None:
            return DataLayout(mesh.data_size, mesh.data_rank, mesh.device, _data_rank_of(mesh))
        if dist.is_available() and dist.is_initialized():
            n = dist.get_world_size()
            return DataLayout(n, dist.get_rank(), torch.device("cpu"), tuple(range(n)))
        world = os.environ.get("WORLD_SIZE", "1")
        if world.isdigit() and int(world) > 1:  # launched, but the mesh is not made yet
            raise RuntimeError(
                f"DataLoader: this process is rank {os.environ.get('RANK', '?')} of a launched job of {world} "
                "processes, but no af.Mesh exists yet, so the loader cannot know its data shard (every rank would "
                "read the whole dataset). Create the mesh first (`mesh = af.Mesh.from_env()`), or pass mesh="
            )
        return DataLayout(1, 0, torch.device("cpu"), (0,))

    @property
    def world_size(self) -> int:
        return len(self.data_rank_of)

    def first_rank_of_each_shard(self) -> list[int]:
        """For each shard in order, the lowest global rank that reads it."""
        return [self.data_rank_of.index(d) for d in range(self.data_size)]


def _data_rank_of(mesh: Mesh) -> tuple[int, ...]:
    shape = dict(mesh.shape)
    ranks = mesh.torch_mesh.mesh.reshape(-1).tolist()
    out = [0] * len(ranks)
    for g, coords in zip(ranks, itertools.product(*(range(s) for s in shape.values()))):
        index = 0
        for name, c in zip(shape, coords):
            if name in mesh.data_axes:
                index = index * shape[name] + c
        out[int(g)] = index
    return tuple(out)
