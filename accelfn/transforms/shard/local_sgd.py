"""Local SGD strategy of `af.shard`: each rank updates its own replica from its own rows, with no gradient
communication; every `sync_every` updates the replicas' params are averaged over the data-parallel ranks.

This is `accelerate.local_sgd.LocalSGD` (Stich 2019, "Local SGD converges fast and communicates little") as a
strategy: params start equal (broadcast from the first rank at `init`, as DDP); each step's loss, gradient,
clipping norm and update are the rank's own (its loss is the mean over its own rows, as a plain loop's);
after the update of step `k * sync_every` the floating-point trainable params are summed over the ranks and
divided by their number (one all-reduce per dtype), as LocalSGD's `reduce(param, "mean")`. The optimizer
state stays each rank's own, and so do buffers (LocalSGD averages parameters only).

`metrics["loss"]` (and `rank_loss`) is this rank's loss: the point is to not communicate every step;
`af.dist.all_reduce(metrics["loss"])` gives the mean over the ranks where you want it. Between two
averagings the replicas differ: `af.average_params(state, mesh)` averages them now (LocalSGD's exit from its
`with` block), e.g. before a final save.

A step that raises in a micro-batch (and is caught) leaves nothing to drop (`GradSync.abandon`'s default): no
gradient sync is armed or pending, the gradients are `.grad`, which the next step clears before its first
backward, and the state (step counter, so the averaging schedule) only advances with an update.

Accelerate counts `local_sgd.step()` calls, one per batch even under gradient accumulation; `sync_every`
counts updates: `sync_every = local_sgd_steps // gradient_accumulation_steps`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import attrs
import torch
import torch.distributed as dist

from ... import dry_mode
from ...engine.contract import GradSync
from ...module import move
from .common import broadcast_from_first, check_same_model, group_size

if TYPE_CHECKING:
    from ...engine import Plan
    from ...mesh import Mesh
    from ...state import TrainState
    from . import Shard

__all__ = ["LocalSGDSync", "lower_local_sgd", "average", "average_params"]


def average(
    tensors: Iterable[torch.Tensor], group: dist.ProcessGroup | None, bucket_mb: float = 64.0
) -> None:
    """Replace each floating-point tensor by its mean over `group`, in place: all-reduces of buckets of about
    `bucket_mb` per dtype and device (sum, then divide by the group's size: LocalSGD's `reduce(..., "mean")`)."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.is_floating_point():
            by_kind.setdefault((t.device, t.dtype), []).append(t)
    n = dist.get_world_size(group)
    limit = int(bucket_mb * 2**20)
    for parts in by_kind.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for i, p in enumerate(parts):
            bucket.append(p)
            size += p.numel() * p.element_size()
            if size >= limit or i == len(parts) - 1:
                _average_bucket(bucket, group, n)
                bucket, size = [], 0


def _average_bucket(parts: list[torch.Tensor], group: dist.ProcessGroup | None, n: int) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in parts])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat /= n
    offset = 0
    with torch.no_grad():
        for p in parts:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def average_params(state: TrainState, mesh: Mesh) -> TrainState:
    """Average `state`'s floating-point params over `mesh`'s data-parallel ranks, in place, and return `state`:
    local SGD's averaging now (as leaving Accelerate's `LocalSGD` block), e.g. before the final save.

    Example:
        >>> import torch, accelfn as af
        >>> with af.Mesh({"dp": -1}, device="cpu") as mesh:  # 1 process here; N under `accelfn launch`
        ...     step = af.shard(af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)), mesh,
        ...                     strategy="local_sgd", sync_every=4)
        ...     state, _ = step(step.init(torch.nn.Linear(3, 1)), torch.randn(4, 3))
        ...     state = af.average_params(state, mesh)
        >>> int(state.step)
        1
    """
    if any(hasattr(p, "placements") for p in state.params.values()):
        raise ValueError(
            "af.average_params averages replicated params (local SGD's replicas), but this state's params are "
            "sharded DTensors (fsdp / tensor parallel): they are not replicas to average"
        )
    if not mesh.grad_axes:
        raise ValueError(
            f"af.average_params: the mesh {dict(mesh.shape)} has no data-parallel axis to average over"
        )
    if mesh.grad_size > 1:
        average(state.params.values(), mesh.grad_group())
    return state


@attrs.define(eq=False)
class LocalSGDSync(GradSync):
    """No gradient sync; the trainable params averaged over `group` after every `sync_every`-th update."""

    group: dist.ProcessGroup | None
    sync_every: int

    def after_update(self, params: dict[str, torch.Tensor], step: torch.Tensor) -> None:
        done = int(step) + 1  # updates so far (a dry run reads 0: it counts the averaging in every step)
        if done % self.sync_every == 0 or dry_mode.active() is not None:
            average(params.values(), self.group)

    def describe(self) -> str:
        return (
            f"local SGD: no gradient sync; params averaged over {group_size(self.group)} ranks "
            f"every {self.sync_every} updates"
        )


def lower_local_sgd(shard: Shard, plan: Plan) -> LocalSGDSync:
    from ...module import slots_of

    mesh = shard.mesh
    move(plan.module, mesh.device)
    group = mesh.grad_group()
    check_same_model(plan.module, group)
    broadcast_from_first(plan.module, group)
    every = 1 if shard.sync_every is None else shard.sync_every
    sync = LocalSGDSync(group, every)
    if dry_mode.active() is not None:
        dry_mode.note(
            f"local SGD: each measured step includes the params' averaging (it runs every {every} updates)"
        )
    n_trainable = len(slots_of(plan.module).trainable)
    plan.notes.append(
        f"local SGD over {mesh.grad_size} ranks: {n_trainable} params averaged every {every} updates"
    )
    return sync
