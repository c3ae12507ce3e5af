"""ZeRO-1 and 2 in the dry run: flat buffers, bucketed gradient reductions, the partitioned update (see the
package docs)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from ..... import dry_mode
from .....dtensor import local_tensor

if TYPE_CHECKING:
    pass


from .common import ZeroPhases, _Base, _Bucket, _update

__all__ = ["ZeroSync"]


# ---- ZeRO-1 and 2 ---------------------------------------------------------------------------------------------
@attrs.define(eq=False)
class _Group:
    """One optimizer param group's flat buffer: its params' offsets and sizes, its padded size."""

    names: list[str]
    offsets: list[int]
    numels: list[int]
    numel: int  # with the params' alignment padding
    aligned: int  # a multiple of 2 x N
    flat: torch.Tensor | None = None

    def owners(self, i: int, world: int) -> list[tuple[int, int]]:
        """(partition owner, elements) of param `i`'s slices, in order."""
        part, start, n = self.aligned // world, self.offsets[i], self.numels[i]
        out = []
        for rank in range(start // part, min((start + n - 1) // part, world - 1) + 1):
            lo, hi = max(start, rank * part), min(start + n, (rank + 1) * part)
            if hi > lo:
                out.append((rank, hi - lo))
        return out


@attrs.define(eq=False)
class ZeroSync(_Base):
    """ZeRO-1/2's per-rank tensors and collectives over `group` (see the module docs)."""

    group: Any
    stage: int
    world: int
    rank: int
    dtype: torch.dtype
    comm_dtype: torch.dtype
    groups: list[_Group]
    overflow_check: bool
    clip: float  # gradient_clipping (0: none)
    fp16_scale: float | None
    moments: int
    offload: bool
    reduce_bucket: int
    lr: Any
    hook_reduces: bool  # ZeRO-2, or ZeRO-1 with overlap_comm: reduce in the gradient hooks
    n_buffers: int  # ipg bucket buffers (2 with overlap_comm)
    multi_rank_allreduce: bool
    phases: Any = attrs.field(factory=lambda: ZeroPhases())
    bucket: _Bucket = attrs.Factory(_Bucket)
    where: dict[str, tuple[int, int]] = attrs.Factory(dict)  # name -> (group, index in it)
    names: dict[int, str] = attrs.Factory(dict)  # id of each bound param -> its name (refreshed every step)
    params: dict[str, torch.Tensor] = attrs.Factory(dict)
    in_partition: torch.Tensor | None = None  # grads_in_partition
    pads: list[torch.Tensor] = attrs.Factory(list)
    loss_has_count: bool | None = None  # does loss_fn return an af.Loss? (learnt on the first call)
    divides: bool = True  # the update divides by the global count (`phases.divides_at_update`)

    def __attrs_post_init__(self) -> None:
        for g_i, g in enumerate(self.groups):
            for i, name in enumerate(g.names):
                self.where[name] = (g_i, i)

    def part(self, g: _Group) -> int:
        return g.aligned // self.world

    def partition_numel(self) -> int:
        """grads_in_partition's size: the whole params that overlap this rank's partition of each group."""
        total = 0
        for g in self.groups:
            part = self.part(g)
            lo, hi = self.rank * part, (self.rank + 1) * part
            total += sum(n for o, n in zip(g.offsets, g.numels) if lo <= o < hi or o < lo < o + n)
        return total

    def init_opt_state(self, trainable: dict[str, torch.Tensor]) -> Any:
        device = torch.device("cpu") if self.offload else next(iter(trainable.values())).device
        masters = [torch.zeros(self.part(g), dtype=torch.float32, device=device) for g in self.groups]
        return {
            "master": masters,
            "moments": [[torch.zeros_like(m) for _ in range(self.moments)] for m in masters],
        }

    def prepare(self, params: dict[str, torch.Tensor]) -> None:
        self.bucket, self.in_partition, self.pads = _Bucket(), None, []
        self.params = params
        self.hook_gradients(params, list(self.where))

    def _ready(self, p: torch.Tensor) -> None:
        """A gradient is ready: DeepSpeed's hook allocates the bucket (`setup_buckets`), ZeRO-2 adds it."""
        name = self.names.get(id(p))
        if name is None or p.grad is None:
            return
        if not self.bucket.buffers:
            first = local_tensor(p)
            self.bucket.buffers = [
                torch.empty(self.reduce_bucket, dtype=self.dtype, device=first.device)
                for _ in range(self.n_buffers)
            ]
            # a communication buffer, not an activation of the module whose backward's gradient came first
            for b in self.bucket.buffers:
                dry_mode.comm_buffer(b)
        if self.hook_reduces:
            self._add(name)

    def _add(self, name: str) -> None:
        """`reduce_independent_p_g_buckets_and_remove_grads`: flush the bucket if the gradient does not fit,
        then take it (its values are copied into the bucket buffer: the gradient's own storage is freed)."""
        p, n = self.params[name], self.params[name].numel()
        if self.bucket.elements + n > self.reduce_bucket:
            self._flush()
        b = self.bucket
        if n > self.reduce_bucket:
            b.extra = name  # reduced from its own storage
        else:
            p.grad = None
        b.names.append(name)
        b.elements += n

    def _flush(self) -> None:
        """`reduce_ipg_grads`: the bucket's gradient slices reduced (see the module docs), then this rank's
        params copied into `grads_in_partition`."""
        b = self.bucket
        if not b.names:
            return
        # the slices, each param split at the partition owners, merged when consecutive with the same owner
        slices: list[tuple[int, int]] = []
        for name in b.names:
            g_i, i = self.where[name]
            for owner, n in self.groups[g_i].owners(i, self.world):
                if slices and slices[-1][0] == owner:
                    slices[-1] = (owner, slices[-1][1] + n)
                else:
                    slices.append((owner, n))
        lists: dict[Any, list[int]] = {}
        for owner, n in slices:
            lists.setdefault("all" if self.multi_rank_allreduce else owner, []).append(n)
        device = self.bucket.buffers[0].device if self.bucket.buffers else None
        for key, sizes in lists.items():
            # allreduce_and_scatter / allreduce_no_retain: split where the running size passes the bucket's
            pending = 0
            for n in sizes:
                pending += n
                if pending > self.reduce_bucket:
                    self._reduce(key, pending, device)
                    pending = 0
            if pending:
                self._reduce(key, pending, device)
        if self.in_partition is None and any(self._mine(name) for name in b.names):
            self.in_partition = torch.empty(self.partition_numel(), dtype=self.dtype, device=device)
        if b.extra is not None:
            self.params[b.extra].grad = None
        self.bucket = _Bucket(buffers=b.buffers)

    def _reduce(self, key: Any, numel: int, device: Any) -> None:
        """One collective of `numel` gradient elements: the bucket's slices flattened into a new tensor."""
        flat = torch.empty(numel, dtype=self.comm_dtype, device=device)
        if key == "all":
            dist.all_reduce(flat, group=self.group)
        else:
            dist.reduce(flat, dist.get_global_rank(self.group, key) if self.group else key, group=self.group)

    def _mine(self, name: str) -> bool:
        g_i, i = self.where[name]
        return any(owner == self.rank for owner, _ in self.groups[g_i].owners(i, self.world))

    def after_backward(self) -> None:
        if self.hook_reduces:
            self._epilogue()

    def _epilogue(self) -> None:
        """`independent_gradient_partition_epilogue`: the rest of the bucket, the partitions' padding zeros,
        the bucket buffers freed."""
        self._flush()
        device = self.bucket.buffers[0].device if self.bucket.buffers else None
        self.pads = []
        for g in self.groups:  # get_flat_partition: zeros where the partition holds no param
            part = self.part(g)
            lo, hi = self.rank * part, (self.rank + 1) * part
            covered = sum(max(0, min(o + n, hi) - max(o, lo)) for o, n in zip(g.offsets, g.numels))
            if covered < part:
                self.pads.append(torch.zeros(part - covered, dtype=self.dtype, device=device))
        self.bucket = _Bucket()

    def grads_now(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.hook_reduces:  # ZeRO-1: every param's full gradient, reduced next
            return {n: params[n].grad for n in self.where if params[n].grad is not None}  # type: ignore[misc]
        return self.partition_grads()

    def partition_grads(self) -> dict[str, torch.Tensor]:
        out = {f"pad{i}": t for i, t in enumerate(self.pads)}
        if self.in_partition is not None:
            out["partition"] = self.in_partition
        return out

    def end_reduction(self, params: dict[str, torch.Tensor]) -> None:
        if self.hook_reduces:
            return
        for g in self.groups:  # reduce_gradients: every param with a gradient, in the flat order
            for name in g.names:
                if params[name].grad is not None:
                    self._add(name)
        self._epilogue()

    def step_norm(self) -> torch.Tensor:
        device = self.groups[0].flat.device if self.groups[0].flat is not None else None
        if self.overflow_check:  # has_overflow
            dist.all_reduce(torch.zeros(1, dtype=torch.uint8, device=device), group=self.group)
        total = torch.zeros((), dtype=torch.float32, device=device)
        for _ in self.groups:  # get_grad_norm_direct, per group
            sq = torch.zeros((), dtype=torch.float32, device=device)
            dist.all_reduce(sq, group=self.group)
            total = total + sq
        return total.sqrt()

    def step(self, opt_state: Any, scale: torch.Tensor) -> None:
        self.pads, self.in_partition = [], None  # the gradient partitions, freed group by group
        for g, master, moments in zip(self.groups, opt_state["master"], opt_state["moments"]):
            assert g.flat is not None
            part = self.part(g)
            # the partition's gradients flattened (bf16) and made fp32 for the master
            grad = torch.empty(part, dtype=self.dtype, device=g.flat.device).float().to(master.device)
            grad.mul_(scale.to(grad.device))
            _update(master, moments, grad)
            del grad
            mine = g.flat[self.rank * part : (self.rank + 1) * part]
            mine.copy_(master.to(mine.device, mine.dtype))
            dist.all_gather_into_tensor(g.flat, mine, group=self.group)

    def describe(self) -> str:
        what = "gradients and optimizer state" if self.stage == 2 else "optimizer state"
        stage = f"DeepSpeed ZeRO-{self.stage} (modelled for the dry run)"
        return f"{stage}: {what} partitioned over {self.world} ranks"


def _flat_groups(
    module: nn.Module, param_groups: list[list[torch.Tensor]], world: int, align: bool
) -> list[_Group]:
    """DeepSpeed's flat buffers, one per optimizer param group: the trainable params made views into it."""
    names = {id(p): n for n, p in module.named_parameters()}
    groups = []
    for params in param_groups:
        offsets, numels, at = [], [], 0
        elsize = params[0].element_size()
        param_align = 16 // math.gcd(16, elsize) if align else 1
        for i, p in enumerate(params):
            offsets.append(at)
            numels.append(p.numel())
            at += p.numel()
            if i < len(params) - 1:
                at += (-at) % param_align
        alignment = 2 * world  # nccl_start_alignment_factor x world
        aligned = math.ceil(at / alignment) * alignment
        flat = torch.empty(aligned, dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            for p, o, n in zip(params, offsets, numels):
                p.data = flat[o : o + n].view_as(p)
        groups.append(_Group([names[id(p)] for p in params], offsets, numels, at, aligned, flat))
    return groups
