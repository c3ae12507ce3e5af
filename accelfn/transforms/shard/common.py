"""Pieces shared by the sharding strategies: batch slicing/moving, loss and metric reduction."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch import nn

from ... import tree as _tree
from ...dtensor import local_tensor
from ...engine.contract import summed_axes
from ...mesh import Mesh


def batch_transform(mesh: Mesh, inputs: str) -> Callable[[Any], Any]:
    """Move the batch to this rank's device; with `inputs="global"`, first take this rank's rows."""
    device, n, r = mesh.device, mesh.data_size, mesh.data_rank

    def take(batch: Any) -> Any:
        def one(path: tuple[Any, ...], t: torch.Tensor) -> torch.Tensor:
            if (
                inputs == "global" and t.dim()
            ):  # 0-d leaves (a temperature, a flag) go to every rank as they are
                rows = t.shape[0]
                if rows % n:
                    where = "batch" + "".join(f"[{p!r}]" for p in path)
                    raise ValueError(
                        f"shard(inputs='global'): {where} has {rows} rows, not divisible by the {n} data-parallel ranks"
                    )
                t = t[r * rows // n : (r + 1) * rows // n]
            return t.to(device, non_blocking=True) if t.device != device else t

        return optree.tree_map_with_path(one, batch, namespace=_tree.NAMESPACE)

    return take


def reduce_scalars(values: list[torch.Tensor], group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Sum a few scalars over `group` in one collective."""
    flat = torch.stack([v.detach().float().reshape(()) for v in values])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    return list(flat.unbind(0))


def max_over(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The maximum of `x` over `group` (a copy; `x` is left as it is)."""
    x = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def mean_metrics(values: dict[str, torch.Tensor], group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """Average metric scalars over `group` in one collective."""
    if not values:
        return values
    summed = reduce_scalars(list(values.values()), group)
    n = dist.get_world_size(group)
    return {k: v / n for k, v in zip(values, summed)}


@torch.no_grad()
def broadcast_buffers(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Give every rank of `group` its first rank's buffers (BatchNorm statistics), as torch DDP does before
    each forward (`broadcast_buffers=True`): one broadcast of all of them. A buffer tensor parallel made a DTensor
    (Gemma's `embed_scale` in its parallel embedding, beside the plain rotary `inv_freq`) is broadcast as its
    local tensor: the group's first rank holds the same part of it."""
    buffers = [local_tensor(b) for b in module.buffers()]
    if not buffers or dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    flat = torch.cat([buf.detach().reshape(-1).to(torch.float64) for buf in buffers])
    dist.broadcast(flat, src=src, group=group)
    offset = 0
    with torch.no_grad():
        for buf in buffers:
            buf.copy_(flat[offset : offset + buf.numel()].view_as(buf))
            offset += buf.numel()


def check_same_model(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Every rank of `group` has the same params (names, shapes) and trains the same ones: else a ValueError on
    every rank naming the first difference (a rank that froze other layers would pair its gradients with the
    others' wrong ones in the bucketed all-reduce and the replicas would drift apart silently)."""
    if dist.get_world_size(group) < 2:
        return
    mine = [
        (n, list(p.shape), bool(p.requires_grad), local_tensor(p).is_meta)
        for n, p in module.named_parameters()
    ]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)

    def what(params: dict[str, Any], name: str) -> str:
        if name not in params:
            return "missing"
        shape, grad, meta = params[name]
        return f"{'trainable' if grad else 'frozen'} {shape}" + (" on the meta device" if meta else "")

    for r, theirs in enumerate(everyone[1:], start=1):
        if theirs == everyone[0]:
            continue
        a, b = ({n: (shape, grad, meta) for n, shape, grad, meta in ps} for ps in (everyone[0], theirs))
        rank0, rank = (dist.get_global_rank(group, i) if group is not None else i for i in (0, r))
        diff = next(
            (
                f"{n!r}: {what(a, n)} on rank {rank0}, {what(b, n)} on rank {rank}"
                for n in [*a, *b]
                if a.get(n) != b.get(n)
            ),
            "the params are in another order",
        )
        raise ValueError(
            f"the ranks' models differ: {diff}. Every rank must build the same model (on the meta device or not) "
            "and freeze the same params (requires_grad) before step.init()"
        )


NOT_SUMMED = object()  # `split_groups`: a param whose gradient no other rank shares


def split_groups(mesh: Mesh, module: nn.Module) -> dict[str, Any]:
    """The params split over a gradient axis (experts over `ep`), each with the group its gradient is summed over
    (`NOT_SUMMED` when it is split over every gradient axis); see `contract.summed_axes`."""
    out: dict[str, Any] = {}
    for name, p in module.named_parameters():
        axes = summed_axes(p, mesh.grad_axes)
        if axes != mesh.grad_axes:
            out[name] = mesh.axes_group(axes) if axes else NOT_SUMMED
    return out


def split_units(mesh: Mesh, module: nn.Module) -> list[tuple[nn.Module, tuple[str, ...]]]:
    """The modules that own params split over a gradient axis (experts modules under ep), each with the gradient
    axes its params are summed over (FSDP shards such a module over those: torchtitan's `efsdp`)."""
    out: list[tuple[nn.Module, tuple[str, ...]]] = []
    for m in module.modules():
        axes = {summed_axes(p, mesh.grad_axes) for p in m._parameters.values() if p is not None}
        axes.discard(mesh.grad_axes)
        if len(axes) > 1:
            raise ValueError(f"{type(m).__name__} has params split over different mesh axes: {sorted(axes)}")
        if axes:
            out.append((m, axes.pop()))
    return out


def broadcast_from_first(
    module: nn.Module,
    group: dist.ProcessGroup | None,
    groups: Mapping[str, Any] | None = None,
    skip: object = None,
) -> None:
    """Give every rank of `group` the params and buffers of its first rank (as torch DDP does at start); a param
    named in `groups` among the ranks of its own group there (experts split over `ep`: among their replicas), or
    not at all where that is `skip`."""
    groups = groups or {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        g = groups.get(name, group)
        if g is skip and name in groups:
            continue
        src = dist.get_global_rank(g, 0) if g is not None else 0
        dist.broadcast(local_tensor(t.data), src=src, group=g)  # a tensor-parallel shard: among its replicas


def group_size(group: dist.ProcessGroup | None) -> int | str:
    """The size of `group` for descriptions ("?" once the process group is gone, e.g. after `mesh.close()`)."""
    try:
        return dist.get_world_size(group)
    except (RuntimeError, ValueError):
        return "?"
