"""DDP strategy of `af.shard`: replicated params, one bucketed all-reduce of the gradients per step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch
import torch.distributed as dist

from ...optim.clip import global_norm
from .common import batch_transform

if TYPE_CHECKING:
    from ...engine import Plan
    from . import Shard


@attrs.define
class DDPSync:
    """Sum gradients over the data-parallel group in ~`bucket_bytes` flat buckets (async, then wait)."""

    group: dist.ProcessGroup | None
    bucket_bytes: int

    def _buckets(self, grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        buckets: list[list[torch.Tensor]] = []
        current: list[torch.Tensor] = []
        size = 0
        key = None
        for g in grads:
            k = (g.device, g.dtype)
            if current and (k != key or size + g.numel() * g.element_size() > self.bucket_bytes):
                buckets.append(current)
                current, size = [], 0
            current.append(g)
            size += g.numel() * g.element_size()
            key = k
        if current:
            buckets.append(current)
        return buckets

    def reduce(
        self, grads: list[torch.Tensor], loss_sum: torch.Tensor, count: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        buckets = self._buckets(grads)
        flats, works = [], []
        for i, bucket in enumerate(buckets):
            parts = [g.reshape(-1) for g in bucket]
            if i == len(buckets) - 1:  # the scalars ride along in the last bucket
                dt = bucket[0].dtype
                parts += [loss_sum.reshape(1).to(dt), count.reshape(1).to(dt)]
            flat = torch.cat(parts)
            flats.append(flat)
            works.append(dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True))
        if not buckets:
            flat = torch.stack([loss_sum.float(), count.float()])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            return flat[0], flat[1]
        for w in works:
            w.wait()
        for bucket, flat in zip(buckets, flats):
            offset = 0
            for g in bucket:
                n = g.numel()
                g.copy_(flat[offset : offset + n].view_as(g))
                offset += n
        tail = flats[-1]
        return tail[-2].to(loss_sum.dtype), tail[-1].to(loss_sum.dtype)

    def norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return global_norm(grads)  # gradients are identical on every rank after the sum

    def reduce_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not values:
            return values
        flat = torch.stack([v.float().reshape(()) for v in values.values()])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        flat /= dist.get_world_size(self.group)
        return dict(zip(values, flat.unbind(0)))


def _data_group(shard: Shard) -> dist.ProcessGroup | None:
    mesh = shard.mesh
    axes = mesh.data_axes
    if len(axes) == 1:
        return mesh.group(axes[0])
    return mesh.submesh(*axes)._flatten().get_group()


def lower_ddp(shard: Shard, plan: Plan) -> None:
    mesh = shard.mesh
    plan.module.to(mesh.device)
    group = _data_group(shard)
    with torch.no_grad():  # every rank starts from rank 0's weights, as torch DDP does
        tensors = [*plan.module.parameters(), *plan.module.buffers()]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        for t in tensors:
            dist.broadcast(t.data, src=src, group=group)
    plan.batch_transform = batch_transform(mesh, shard.inputs)
    plan.rank_key = mesh.data_rank
    plan.grad_sync = DDPSync(group, int(shard.bucket_mb * 2**20))
    plan.notes.append(f"ddp over {mesh.data_size} ranks")
