"""DeepSpeed ZeRO in a dry run: DeepSpeed's engine cannot run on fake tensors (it builds flat buffers from real
storage and swaps the module's tensors), so the dry run lowers a `backend="deepspeed"` step onto torch ops that
hold and move per rank what the ZeRO stage does, after checking its config as the real lowering does:

- **stage 1 and 2** (`ZeroSync`, `ZeroPhases`): the module in the engine's dtype (bf16 / fp16 when enabled), the
  forward and backward of plain data parallel, then the gradients in DeepSpeed's flat order reduced bucket by
  bucket (`reduce_bucket_size`) into this rank's 1/N partition: stage 2 during the backward, each gradient
  copied into the bucket buffer and freed as soon as it is ready; stage 1 after it, from the full gradients.
  DeepSpeed reduces each partition owner's slice with `dist.reduce`; the model counts the same bytes as one
  reduce-scatter per bucket; the update on an fp32 master copy of the partition with the
  optimizer's moments of the partition only (DeepSpeed's `single_partition_of_fp32_groups`); the updated
  partition all-gathered bucket by bucket (`allgather_bucket_size`; the fake values are not copied back).
  With optimizer offload the master copy and the moments are host memory (not counted on the device).
- **stage 3**: FSDP2 (`fully_shard` per block: the same all-gathers in forward and backward and reduce-scatters
  of the gradients); DeepSpeed also keeps an fp32 master copy of each partition, which FSDP2 does not (under
  bf16 DeepSpeed holds 2 + 4 + 8 bytes per parameter / N where FSDP2 holds 4 + 8: a note says so).
- stage 0: plain data parallel (ddp).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist

from .... import dry_mode
from ....dtensor import local_tensor
from ....engine.contract import GradSync
from ....engine.phases import StepRun, TrainPhases
from ....lowering import CompositionError
from ....module import move
from ..common import mean_metrics
from .config import _get, make_optimizer, split_optimizer

if TYPE_CHECKING:
    from ....engine import Plan
    from .. import Shard

__all__ = ["lower_modelled", "ZeroSync", "ZeroPhases"]

_DEFAULT_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size / allgather_bucket_size (elements)


def _moments(config_optimizer: dict[str, Any] | None) -> int:
    """How many partition-sized fp32 tensors the torch optimizer DeepSpeed is given keeps per parameter."""
    if config_optimizer is None:
        return 0
    name = config_optimizer.get("name")
    if name in ("adam", "adamw"):
        return 2
    if name == "sgd":
        return 1 if config_optimizer.get("momentum") else 0
    return 2


@attrs.define(eq=False)
class ZeroSync(GradSync):
    """ZeRO-1/2's per-rank tensors and collectives over `group` (see the module docs)."""

    group: dist.ProcessGroup | None
    stage: int
    world: int
    rank: int
    padded: int  # the trainable elements, padded to a multiple of the world size
    offsets: dict[str, int]  # each trainable param's start in DeepSpeed's flat order
    moments: int
    offload: bool
    reduce_bucket: int
    gather_bucket: int
    phases: Any = attrs.field(factory=lambda: ZeroPhases())
    partition: torch.Tensor | None = (
        None  # this rank's gradient partition (stage 2: filled during the backward)
    )
    pending: int = 0  # gradient elements in the bucket not reduced yet
    ipg: torch.Tensor | None = None  # stage 2: DeepSpeed's bucket buffer (reduce_bucket_size elements)
    names: dict[int, str] = attrs.Factory(dict)  # id of each bound param -> its name (refreshed every step)

    @property
    def part(self) -> int:
        return self.padded // self.world

    def init_opt_state(self, trainable: dict[str, torch.Tensor]) -> Any:
        device = torch.device("cpu") if self.offload else next(iter(trainable.values())).device
        master = torch.zeros(self.part, dtype=torch.float32, device=device)
        return {"master": master, "moments": [torch.zeros_like(master) for _ in range(self.moments)]}

    def prepare(self, params: dict[str, torch.Tensor]) -> None:
        first = params[next(iter(self.offsets))]
        self.partition = torch.zeros(self.part, dtype=first.dtype, device=first.device)
        self.pending = 0
        if self.stage != 2:
            return
        # stage 2: DeepSpeed copies each gradient into its bucket buffer as soon as it is ready, and frees it
        self.ipg = torch.empty(min(self.reduce_bucket, self.padded), dtype=first.dtype, device=first.device)
        self.names = {id(params[n]): n for n in self.offsets}
        for name in self.offsets:
            p = params[name]
            if (
                getattr(p, "_accelfn_zero_sync", None) is not self
            ):  # once per tensor (a new state: new tensors)
                p.register_post_accumulate_grad_hook(self._ready)
                p._accelfn_zero_sync = self  # type: ignore[attr-defined]

    def _ready(self, p: torch.Tensor) -> None:
        """Stage 2: keep this rank's slice of the gradient in the partition, free the rest, reduce full buckets."""
        name = self.names.get(id(p))
        if name is None or p.grad is None or self.partition is None:
            return
        g = local_tensor(p.grad).reshape(-1)
        start, lo, hi = self.offsets[name], self.rank * self.part, (self.rank + 1) * self.part
        a, b = max(start, lo), min(start + g.numel(), hi)
        if a < b:
            self.partition[a - lo : b - lo] += g[a - start : b - start]
        p.grad = None
        self.pending += g.numel()
        while self.pending >= self.reduce_bucket:
            self._reduce_bucket(self.reduce_bucket)
            self.pending -= self.reduce_bucket

    def _reduce_bucket(self, numel: int) -> None:
        """One bucket's reduction out of the bucket buffer: DeepSpeed reduces each partition owner's slice to it
        (`dist.reduce` per owner), the bytes of one reduce-scatter, counted as one (values not needed here)."""
        assert self.ipg is not None
        per_rank = max(math.ceil(numel / self.world), 1)
        out = torch.empty(per_rank, dtype=self.ipg.dtype, device=self.ipg.device)
        send = self.ipg[: per_rank * self.world] if per_rank * self.world <= self.ipg.numel() else None
        if send is None:  # the last, padded bucket of a model smaller than one bucket per rank
            send = torch.zeros(per_rank * self.world, dtype=self.ipg.dtype, device=self.ipg.device)
        dist.reduce_scatter_tensor(out, send, group=self.group)

    def reduce_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return mean_metrics(values, self.group)

    def describe(self) -> str:
        what = "gradients and optimizer state" if self.stage == 2 else "optimizer state"
        return f"DeepSpeed ZeRO-{self.stage} (modelled for the dry run): {what} partitioned over {self.world} ranks"


def _buckets(total: int, size: int) -> list[tuple[int, int]]:
    """`[start, end)` element ranges of at most `size` covering `[0, total)`."""
    return [(s, min(s + size, total)) for s in range(0, total, max(size, 1))]


class ZeroPhases(TrainPhases):
    """Standard forward and backward; the gradients' reduction, clipping and the update as ZeRO-1/2 run them."""

    def collect(self, run: StepRun) -> None:
        sync = run.sync
        assert isinstance(sync, ZeroSync) and sync.partition is not None
        if sync.stage == 1:
            super().collect(run)
            return
        for name in sync.offsets:  # a param whose hook did not fire (unused): no gradient
            run.params[name].grad = None
        run.grads = {"partition": sync.partition}

    def reduce(self, run: StepRun) -> None:
        sync = run.sync
        assert isinstance(sync, ZeroSync) and run.loss_sum is not None and run.count_sum is not None
        assert sync.partition is not None
        run.metrics["rank_loss"] = (run.loss_sum / run.count_sum.clamp_min(1)).detach()
        scalars = torch.stack(
            [run.loss_sum.detach().float().reshape(()), run.count_sum.detach().float().reshape(())]
        )
        dist.all_reduce(scalars, group=sync.group)
        run.loss_sum, run.count_sum = scalars[0], scalars[1]
        run.metrics["loss"] = scalars[0] / scalars[1].clamp_min(1)
        if sync.stage == 2:  # the rest of the last bucket
            if sync.pending:
                sync._reduce_bucket(sync.pending)
                sync.pending = 0
        else:  # ZeRO-1: the full gradients reduce-scattered bucket by bucket, each rank's slice of each bucket
            for start, end in _buckets(sync.part, max(sync.reduce_bucket // sync.world, 1)):
                # the bucket's send buffer (DeepSpeed's copy of the gradients; their values do not matter here)
                send = torch.zeros(
                    sync.world * (end - start), dtype=sync.partition.dtype, device=sync.partition.device
                )
                dist.reduce_scatter_tensor(sync.partition[start:end], send, group=sync.group)
        grad = sync.partition.float() / scalars[1].clamp_min(1)  # fp32, for the fp32 master partition
        run.grads = {"partition": grad} if sync.stage == 2 else {**run.grads, "partition": grad}

    def clip(self, run: StepRun) -> None:
        if run.plan.clip_grad_norm is None:
            return
        sync = run.sync
        assert isinstance(sync, ZeroSync)
        sq = run.grads["partition"].pow(2).sum()
        dist.all_reduce(sq, group=sync.group)
        norm = sq.sqrt()
        run.grads["partition"].mul_((run.plan.clip_grad_norm / (norm + 1e-6)).clamp(max=1.0))
        run.metrics["grad_norm"] = norm

    def update(self, run: StepRun) -> None:
        sync = run.sync
        assert isinstance(sync, ZeroSync)
        opt = run.state.opt_state
        master, moments = opt["master"], opt["moments"]
        grad = run.grads["partition"].to(master.device)
        for m in moments:  # the moments' update, elementwise (values do not matter in a dry run)
            m.mul_(0.9).add_(grad)
        master.add_(moments[0] if moments else grad, alpha=-1e-3)
        run.opt_state, run.extra = opt, run.state.extra
        # the updated partition in the params' dtype, all-gathered bucket by bucket (DeepSpeed gathers into the
        # flat buffer its params view: no more memory than a bucket; values do not matter in a dry run)
        first = local_tensor(run.params[next(iter(sync.offsets))])
        mine = master.to(first.device, first.dtype)
        for start, end in _buckets(sync.part, max(sync.gather_bucket // sync.world, 1)):
            out = torch.empty(sync.world * (end - start), dtype=first.dtype, device=first.device)
            dist.all_gather_into_tensor(out, mine[start:end].contiguous(), group=sync.group)


def lower_modelled(shard: Shard, plan: Plan, config: dict[str, Any]) -> GradSync:
    """The dry run's stand-in for `deepspeed.initialize` (see the module docs)."""
    mesh = shard.mesh
    stage = int(config["zero_optimization"]["stage"])
    offload = _get(config, "zero_optimization.offload_optimizer.device") in ("cpu", "nvme")
    if stage == 3:
        from ..fsdp import lower_fsdp

        dry_mode.note(
            "DeepSpeed ZeRO-3 is modelled by FSDP2 (the same partitioning and collectives). Per parameter and rank, "
            "DeepSpeed keeps an fp32 master copy beside the partitioned params: with bf16 it holds 2 (params) + 2 "
            "(grads) + 12 (master and moments) bytes / N where FSDP2 holds 4 + 4 + 8, the same total; in fp32 "
            "DeepSpeed holds 4 bytes / N more than reported"
        )
        return lower_fsdp(shard, plan)
    if stage == 0:
        from ..ddp import lower_ddp

        dry_mode.note(
            "DeepSpeed ZeRO-0 is modelled by ddp; with bf16 DeepSpeed's BF16_Optimizer also keeps fp32 master "
            "params and gradients (8 bytes per parameter more than reported)"
        )
        return lower_ddp(shard, plan)
    dtype = (
        torch.bfloat16
        if _get(config, "bf16.enabled")
        else torch.float16
        if _get(config, "fp16.enabled")
        else None
    )
    module = move(plan.module, mesh.device)
    if dtype is not None:
        module.to(dtype)  # DeepSpeed's engine casts the module (its params are bf16 / fp16)
        plan.loss_scale = None  # DeepSpeed keeps the fp16 loss scale itself
    named = {n: p for n, p in module.named_parameters() if p.requires_grad}
    if not named:
        raise ValueError("Step.init(): the model has no trainable parameters (all requires_grad=False)")
    assert plan.optimizer is not None
    make_optimizer(
        plan.optimizer, named, offload=False
    )  # the errors the real lowering raises for the optimizer
    hp, _ = split_optimizer(plan.optimizer)
    if offload and hp is not None and hp["name"] not in ("adam", "adamw"):
        raise CompositionError(
            f"DeepSpeed optimizer offload needs adam or adamw (DeepSpeedCPUAdam), got {hp['name']}"
        )
    plan.autocast_device_type = mesh.device_type
    offsets, numel = {}, 0
    for name, p in module.named_parameters():
        if p.requires_grad:
            offsets[name], numel = numel, numel + p.numel()
    world = mesh.world_size
    zero = config["zero_optimization"]
    sync = ZeroSync(
        group=mesh.grad_group(),
        stage=stage,
        world=world,
        rank=mesh.grad_rank,
        padded=math.ceil(numel / world) * world,
        offsets=offsets,
        moments=_moments(dict(hp) if hp is not None else None),
        offload=offload,
        reduce_bucket=int(zero.get("reduce_bucket_size", _DEFAULT_BUCKET)),
        gather_bucket=int(zero.get("allgather_bucket_size", _DEFAULT_BUCKET)),
    )
    dry_mode.note(
        f"DeepSpeed ZeRO-{stage} is modelled (its engine does not run on fake tensors): gradients reduce-scattered "
        "into 1/N partitions, the update on an fp32 master partition, params all-gathered"
    )
    plan.notes.append(
        f"deepspeed ZeRO-{stage}{' + optimizer offload' if offload else ''} (modelled) over {world} ranks"
    )
    return sync
