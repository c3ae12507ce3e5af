"""Debug mode (`ACCELFN_DEBUG=1`): before a collective, compare what every rank passes; raise instead of hanging."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DEBUG_ENV", "CollectiveMismatchError", "enabled", "check", "describe"]

DEBUG_ENV = "ACCELFN_DEBUG"


class CollectiveMismatchError(RuntimeError):
    """Ranks called a collective with different tensors (or different collectives)."""


def enabled() -> bool:
    """Whether `ACCELFN_DEBUG` is set to a true value (1, true, yes)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def describe(t: torch.Tensor, *, free_dim: int | None = None) -> str:
    """`float32[3, 4]`; with `free_dim`, that size is shown as `*` (it may differ between ranks)."""
    dims = ["*" if i == free_dim else str(s) for i, s in enumerate(t.shape)]
    return f"{str(t.dtype).removeprefix('torch.')}[{', '.join(dims)}]"


def check(op: str, signature: Any) -> None:
    """All-gather `(op, signature)` from every rank; raise `CollectiveMismatchError` naming the ranks if they
    differ. Call only when `enabled()` and the world has more than one process; every rank raises."""
    mine = (op, signature)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if all(s == mine for s in everyone):
        return
    groups: dict[str, list[int]] = {}
    for r, (other_op, sig) in enumerate(everyone):
        groups.setdefault(f"{_name(other_op)}({_fmt(sig)})", []).append(r)
    lines = "\n".join(
        f"  {'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))}: {text}"
        for text, rs in groups.items()
    )
    raise CollectiveMismatchError(
        f"{_name(op)} on rank {dist.get_rank()}: the ranks disagree on what they pass, so the collective "
        f"would hang or fail:\n{lines}\nEvery rank must call the same collective with tensors of the same "
        "structure, dtypes and shapes (use af.dist.pad_across_processes for different lengths), and run the same "
        "training steps (a data loader with even_batches=False can give ranks different numbers of batches)."
    )


def _name(op: str) -> str:
    """`af.dist.all_reduce[sum]` for af.dist's collectives; other callers pass a full name (`af.Step`)."""
    return op if op.startswith("af.") else f"af.dist.{op}"


def _fmt(sig: Any) -> str:
    if isinstance(sig, list):
        return ", ".join(f"{path}: {d}" if path else d for path, d in sig)
    return str(sig)
