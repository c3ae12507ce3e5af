"""The few collectives a distributed save needs (over a private gloo group), and DTensor geometry.

Everything here is a no-op in a single process. Messages travel as JSON encoded in uint8 tensors.
"""

from __future__ import annotations

import itertools
import json
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..dtensor import is_dtensor
from ..mesh import control_group

__all__ = ["Comm", "is_dtensor", "region", "writes_piece", "is_sharded"]


def region(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """`(global_offset, local_shape)` of this rank's part of `t` (the whole tensor for a plain one)."""
    if not is_dtensor(t):
        return [0] * t.ndim, list(t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)  # type: ignore[attr-defined]
    return list(offset), list(shape)


def is_sharded(t: Any) -> bool:
    """A DTensor with at least one `Shard` placement."""
    return is_dtensor(t) and any(p.is_shard() for p in t.placements)


def writes_piece(t: torch.Tensor, rank: int, first: int = 0) -> bool:
    """Whether this rank writes its part of `t`: for plain tensors, `first` (the lowest rank holding this leaf:
    rank 0, or under pipeline parallel the first rank of the stage that holds it); for a DTensor, the ranks at
    coordinate 0 of every replicated mesh dimension, in the copy of its mesh that holds `first` (each distinct
    piece is written once)."""
    if not is_dtensor(t):
        return rank == first
    coord = t.device_mesh.get_coordinate()  # type: ignore[attr-defined]
    if coord is None:
        return False
    # a DTensor on a sub-mesh (FSDP's data axis under tensor parallel) is replicated over the other axes: of the
    # sub-mesh's copies (which partition the world), the one holding `first` writes
    if first not in t.device_mesh.mesh.flatten().tolist():  # type: ignore[attr-defined]
        return False
    for dim, p in enumerate(t.placements):  # type: ignore[attr-defined]
        if p.is_partial():
            raise ValueError("cannot save a DTensor with a Partial placement: reduce it first (redistribute)")
        if p.is_replicate() and coord[dim] != 0:
            return False
    return True


_ROLL_CALLS = itertools.count()


def _store() -> Any:
    """The default process group's c10d store (the launcher's rendezvous store), or None."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


class Comm:
    """Rank, world size and the collectives of a save, on a private gloo group (so a save in a background
    thread does not interleave with the training's collectives)."""

    def __init__(self) -> None:
        self.active = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.active else 0
        self.world = dist.get_world_size() if self.active else 1
        self.group = control_group() if self.active else None

    def roll_call(self, what: str) -> None:
        """Check that every rank called `what` (a collective), within `ACCELFN_COLLECTIVE_TIMEOUT` seconds
        (default 120): a call on some ranks only fails on *each* rank that called it with an error naming the
        ranks that did not (instead of hanging). Under `ACCELFN_DEBUG=1` the ranks also compare what they are
        doing, so a rank still in a training step is named with it."""
        if not self.active:
            return
        from ..collective import debug

        if debug.enabled():
            debug.check(what, "")
        seconds = float(os.environ.get("ACCELFN_COLLECTIVE_TIMEOUT", "120"))
        n = next(
            _ROLL_CALLS
        )  # the k-th collective call of this process: the same on every rank that keeps step
        store = _store()
        if store is None:  # no c10d store to meet at: rank 0 watches (the others wait out the group timeout)
            try:
                dist.monitored_barrier(
                    group=self.group, timeout=timedelta(seconds=seconds), wait_all_ranks=True
                )
            except RuntimeError as e:
                raise RuntimeError(self._missing(what, seconds, str(e))) from None
            return
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # the agent's store outlives a restart
        keys = [f"accelfn/roll-call/{attempt}/{n}/{r}" for r in range(self.world)]
        store.set(keys[self.rank], what)
        try:
            store.wait(keys, timedelta(seconds=seconds))
        except RuntimeError:  # DistStoreError: timed out
            absent = [r for r, k in enumerate(keys) if not store.check([k])]
            raise RuntimeError(self._missing(what, seconds, f"ranks {absent} did not call it")) from None

    def _missing(self, what: str, seconds: float, detail: str) -> str:
        return (
            f"{what} is collective: every rank must call it (the state lives on all of them, and rank 0 "
            f"commits only when every rank has written), but rank {self.rank} waited {seconds:g} s "
            f"(ACCELFN_COLLECTIVE_TIMEOUT) for the others: {detail}. Call it on every rank, not under "
            "`if mesh.is_main:` (nor after a rank ran out of data: even_batches=False)"
        )

    def barrier(self) -> None:
        if self.active:
            dist.barrier(group=self.group)

    def broadcast_str(self, text: str) -> str:
        """Rank 0's `text` on every rank."""
        if not self.active:
            return text
        return self.all_gather_json(text if self.rank == 0 else None)[0]

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's JSON-able `obj`, in rank order."""
        if not self.active:
            return [obj]
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(sizes, size, group=self.group)
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(bufs, padded, group=self.group)
        return [json.loads(bytes(b[: int(s.item())].numpy())) for b, s in zip(bufs, sizes)]
