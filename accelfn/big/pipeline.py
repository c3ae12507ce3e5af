"""`pipeline`: pipeline-parallel inference, one stage per process of a mesh axis (torch.distributed.pipelining)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._typecheck import checked
from ..mesh import Mesh
from ..stages import balanced_split, split_at

__all__ = ["pipeline"]


@checked
def pipeline(
    model: nn.Module,
    split_points: Sequence[str] | None,
    mesh: Mesh,
    *,
    example_args: tuple[Any, ...],
    microbatches: int = 4,
    axis: str = "pp",
    broadcast: bool = True,
) -> Callable[..., Any]:
    """Split `model` before each module named in `split_points` (None: a Hugging Face decoder's layers, balanced
    by parameter count, as `accelfn.stages.balanced_split`) into `len(split_points) + 1` stages, one per
    rank of `mesh`'s `axis`, and return `run(*inputs) -> output` that runs a batch through them as a GPipe
    schedule of `microbatches` microbatches.

    Every rank calls `run` with the same full batch (only the first stage reads it). The output is the last
    stage's: with `broadcast=True` every rank receives it; with `broadcast=False` the last stage returns it
    and the others return None. `example_args` is a full batch of the shapes `run` will see (the model is
    traced on one microbatch of it with `torch.export`); its dim 0 must divide by `microbatches`, and `run`
    refuses a batch of other shapes (pad a short last batch). Models
    must trace with `torch.export` (plain `nn.Module` stacks do; see docs/big_models.md).

    Example (on 2 processes started by `accelfn launch`):
        run = af.pipeline(model, ["layers.2"], af.Mesh({"pp": 2}), example_args=(x,), microbatches=4)
        y = run(x)      # == model(x), on every rank
    """
    from torch.distributed.pipelining import ScheduleGPipe, SplitPoint
    from torch.distributed.pipelining import pipeline as trace

    n_stages = mesh.axis_size(axis)
    if split_points is None:  # the same automatic split as training: decoder layers, balanced by params
        split_points = balanced_split(model, n_stages).points
    if len(split_points) + 1 != n_stages:
        raise ValueError(
            f"af.pipeline: {len(split_points)} split points make {len(split_points) + 1} stages, but mesh axis "
            f"{axis!r} has {n_stages} processes; give {n_stages - 1} split points"
        )
    split_at(model, split_points)  # names, order and non-empty stages, as for training
    for x in example_args:
        if isinstance(x, torch.Tensor) and x.shape[0] % microbatches:
            raise ValueError(
                f"af.pipeline: example batch of {x.shape[0]} does not split into {microbatches} microbatches"
            )
    mb_args = tuple(x.chunk(microbatches)[0] if isinstance(x, torch.Tensor) else x for x in example_args)
    # tracing wraps the split modules' forward in place: trace a copy so the model can be traced again
    traced = copy.deepcopy(model)
    config: Any = getattr(traced, "config", None)
    if getattr(config, "use_cache", False):  # a Hugging Face KV cache does not trace (nor serve microbatches)
        config.use_cache = False
    pipe = trace(traced, mb_args=mb_args, split_spec={p: SplitPoint.BEGINNING for p in split_points})
    group = mesh.group(axis)
    index = mesh.axis_rank(axis)
    stage = pipe.build_stage(index, device=mesh.device, group=group)
    schedule = ScheduleGPipe(stage, microbatches)
    last = dist.get_global_rank(group, n_stages - 1)

    def signature(args: Any) -> list[Any]:
        return [(tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else None for x in args]

    shapes = signature(example_args)

    def run(*inputs: Any) -> Any:
        # the stages were traced and their buffers sized for example_args' shapes and dtypes; every rank gets the
        # same batch, so every rank refuses another one here, before any stage sends or waits
        got = signature(inputs)
        if got != shapes and (inputs or index == 0):  # (a later stage called without the batch reads none)
            raise ValueError(
                f"af.pipeline: run() got inputs of (shape, dtype) {got}, but the pipeline was traced for "
                f"example_args' {shapes}: every batch must have those shapes and dtypes (pad a short last batch "
                "to them, or build a pipeline for each shape)"
            )
        with torch.no_grad():
            out = schedule.step(*inputs) if index == 0 else schedule.step()
        if not broadcast:
            return out if index == n_stages - 1 else None
        meta = [(tuple(out.shape), out.dtype) if index == n_stages - 1 else None]
        dist.broadcast_object_list(meta, src=last, group=group)
        shape, dtype = meta[0]  # type: ignore[misc]
        if index != n_stages - 1:
            out = torch.empty(shape, dtype=dtype, device=mesh.device)
        dist.broadcast(out, src=last, group=group)
        return out

    return run
