"""DDP strategy of `af.shard`: replicated params; gradients summed in buckets, overlapped with backward.

Buckets of about `bucket_mb` are formed over the trainable parameters in reverse registration order (the
order in which their gradients become ready, as in torch DDP). A post-accumulate-grad hook launches a
bucket's asynchronous all-reduce once its last gradient is ready and all earlier buckets have been
launched — during the backward pass of the step's last micro-batch only, so `af.accumulate` still syncs
once per call. Buckets are always launched in index order on every rank, whatever gradients a rank's
backward produced: buckets whose hooks did not fire (parameters this rank did not use, e.g. another
expert of a mixture of experts, or params rebound after a checkpoint load) are launched after the backward
pass, in order, and the loss sum and the count meet in one more tiny all-reduce after all buckets. As in
torch DDP (`broadcast_buffers=True`), buffers (e.g. BatchNorm statistics) are broadcast from the group's
first rank before each step's forward, so all replicas run and save the same ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from ...dtensor import local_tensor
from ...engine.contract import GradSync
from ...module import move
from ...optim.clip import global_norm
from .common import (
    NOT_SUMMED,
    broadcast_buffers,
    broadcast_from_first,
    check_same_model,
    group_size,
    max_over,
    mean_metrics,
    split_groups,
)

if TYPE_CHECKING:
    from ...engine import Plan
    from . import Shard


@attrs.define
class _Bucket:
    names: list[str]
    index: list[int]  # positions in the engine's gradient list (the trainable order)
    group: Any = None  # the ranks its gradients are summed over
    ready: int = 0
    flat: torch.Tensor | None = None
    work: Any = None


@attrs.define(eq=False)
class DDPSync(GradSync):
    """Sum gradients over the data-parallel group, bucket by bucket, as they become ready."""

    group: dist.ProcessGroup | None
    bucket_bytes: int
    overlap: bool = True
    buckets: list[_Bucket] = attrs.Factory(list)
    bucket_of: dict[int, _Bucket] = attrs.Factory(dict)
    hooked: dict[str, int] = attrs.Factory(dict)  # name -> id of the Parameter object carrying our hook
    armed: bool = False
    next_launch: int = 0  # buckets launch strictly in index order (the same collective order on every rank)
    module: nn.Module | None = None  # whose buffers are broadcast before each step
    overlapped: int = 0  # buckets launched during a backward pass so far (a statistic)
    params: dict[str, torch.Tensor] = attrs.Factory(dict)  # the bound params of the current step

    # ---- set-up -------------------------------------------------------------------------------------------
    def build(
        self, module: nn.Module, trainable: tuple[str, ...], groups: Mapping[str, Any] | None = None
    ) -> None:
        """Buckets over `trainable`; `groups` maps the params summed over other ranks than `self.group` (experts
        split over `ep`, see `contract.summed_axes`) to theirs, or to `NOT_SUMMED`."""
        self.module = module
        groups = groups or {}
        params = dict(module.named_parameters())
        order = {n: i for i, n in enumerate(trainable)}
        current: list[str] = []
        size, key = 0, None
        for name in reversed(trainable):
            group = groups.get(name, self.group)
            if group is NOT_SUMMED:
                continue
            p = local_tensor(params[name])  # under tensor parallel: this rank's shard
            k = (p.device, p.dtype, id(group))
            nbytes = p.numel() * p.element_size()
            if current and (k != key or size + nbytes > self.bucket_bytes):
                self.buckets.append(
                    _Bucket(current, [order[n] for n in current], groups.get(current[0], self.group))
                )
                current, size = [], 0
            current.append(name)
            size += nbytes
            key = k
        if current:
            self.buckets.append(
                _Bucket(current, [order[n] for n in current], groups.get(current[0], self.group))
            )
        self.hook(params)

    def hook(self, params: Mapping[str, torch.Tensor]) -> None:
        """(Re-)register the readiness hooks on the current parameter objects."""
        if not self.overlap:
            return
        for bucket in self.buckets:
            for name in bucket.names:
                p = params[name]
                if self.hooked.get(name) == id(p):
                    continue
                self.bucket_of[id(p)] = bucket
                p.register_post_accumulate_grad_hook(self._ready)
                self.hooked[name] = id(p)

    def _ready(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        bucket = self.bucket_of.get(id(p))
        if bucket is None:
            return
        bucket.ready += 1
        while self.next_launch < len(self.buckets):
            head = self.buckets[self.next_launch]
            if head.ready < len(head.names):
                return
            self._launch(head, None)
            self.next_launch += 1
            self.overlapped += 1

    def _launch(self, bucket: _Bucket, grads: list[torch.Tensor] | None) -> None:
        if grads is None:  # from the hook: read the params' .grad
            parts = [local_tensor(self.params[n].grad).reshape(-1) for n in bucket.names]  # type: ignore[arg-type]
        else:
            parts = [local_tensor(grads[i]).reshape(-1) for i in bucket.index]
        bucket.flat = torch.cat(parts)
        bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, group=bucket.group, async_op=True)

    # ---- the engine's protocol ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def microbatch(self, last: bool) -> Iterator[None]:
        self.armed = last and self.overlap
        try:
            yield
        finally:
            self.armed = False

    def prepare(self, params: dict[str, torch.Tensor]) -> None:
        """Called before the step's backward passes with the bound params."""
        self.params = params
        self.hook(params)
        for b in self.buckets:
            b.ready, b.flat, b.work = 0, None, None
        self.next_launch = 0
        if self.module is not None:
            broadcast_buffers(self.module, self.group)

    def reduce(
        self, grads: list[torch.Tensor], loss_sum: torch.Tensor, count: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for bucket in self.buckets[self.next_launch :]:  # not launched during the backward, in index order
            self._launch(bucket, grads)
        self.next_launch = len(self.buckets)
        scalars = torch.stack([loss_sum.detach().float().reshape(()), count.detach().float().reshape(())])
        scalar_work = dist.all_reduce(scalars, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        for bucket in self.buckets:
            bucket.work.wait()
            offset = 0
            assert bucket.flat is not None
            for i in bucket.index:
                g = local_tensor(grads[i])
                n = g.numel()
                g.copy_(bucket.flat[offset : offset + n].view_as(g))
                offset += n
            bucket.flat, bucket.work, bucket.ready = None, None, 0
        scalar_work.wait()
        return scalars[0].to(loss_sum.dtype), scalars[1].to(count.dtype)  # counts stay exact (fp32+)

    def describe(self) -> str:
        when = "during the backward" if self.overlap else "after the backward"
        return f"ddp: {len(self.buckets)} bucket(s) all-reduced over {group_size(self.group)} ranks {when}"

    def norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return global_norm(grads)  # gradients are identical on every rank after the sum

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        return max_over(x, self.group)

    def reduce_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return mean_metrics(values, self.group)


def lower_ddp(shard: Shard, plan: Plan) -> DDPSync:
    from ...module import slots_of

    mesh = shard.mesh
    move(plan.module, mesh.device)
    group = (
        mesh.grad_group()
    )  # the data axes, and the context-parallel axis (its ranks hold parts of each gradient)
    check_same_model(plan.module, group)
    groups = split_groups(mesh, plan.module)
    broadcast_from_first(plan.module, group, groups, NOT_SUMMED)
    overlap = mesh.platform.overlaps_communication() if shard.overlap is None else shard.overlap
    sync = DDPSync(group, int(shard.bucket_mb * 2**20), overlap=overlap)
    sync.build(plan.module, slots_of(plan.module).trainable, groups)
    plan.notes.append(
        f"ddp over {mesh.grad_size} ranks, {len(sync.buckets)} bucket(s)"
        + (", overlapped with backward" if overlap else "")
    )
    return sync
