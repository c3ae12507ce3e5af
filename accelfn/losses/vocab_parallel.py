"""Cross entropy on logits split over the vocabulary (tensor parallel's `loss_parallel`), chunked over rows.

Each rank keeps its vocabulary shard of the logits; the loss needs per row only the global maximum, the global
sum of exponentials and the target's logit (held by one rank), three numbers a row summed or maxed over the
ranks (two all-reduces of one fp32 vector each). The backward needs no collective: with the global log-sum-exp
each rank writes `softmax - onehot` for its own columns. Beyond its shard's gradient (in the logits' dtype), a
rank makes one fp32 chunk of its shard at a time (torch's `loss_parallel` holds about four fp32 copies of it).

Example (on every rank of a tensor-parallel group; `logits` a DTensor sharded on its last dim):
    >>> total = vocab_parallel_cross_entropy(logits, labels)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

from accelfn.losses.chunked import (
    SCOPE,
    _compute_dtype,
    _no_double_backward,
    chunk_logsumexp,
    default_chunk_rows,
    row_chunks,
    rows_of,
    scope,
    write_chunk_grad,
)

__all__ = ["vocab_parallel_cross_entropy", "vocab_sharded_dim"]


def vocab_sharded_dim(logits: DTensor) -> int | None:
    """The mesh dim that splits `logits`' last dim when every other mesh dim replicates it; else None."""
    last = logits.dim() - 1
    split = [i for i, p in enumerate(logits.placements) if p.is_shard() and p.dim % logits.dim() == last]  # type: ignore[attr-defined]
    others = [p for i, p in enumerate(logits.placements) if i not in split]
    if len(split) != 1 or not all(p.is_replicate() for p in others):
        return None
    return split[0]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Summed cross entropy of a DTensor's vocabulary shards; saves the logits (no copy), labels, log-sum-exp.

    It takes the DTensor (not its local shard) so that it gives back the gradient as a DTensor laid out like
    the logits: through `to_local()`'s backward, uneven shards would get other strides, and autograd would copy
    the gradient to match the logits' layout."""

    @staticmethod
    def forward(  # type: ignore[override]
        logits: DTensor,
        labels: torch.Tensor,
        ignore_index: int,
        chunk_rows: int,
        first: int,
        group: Any,
        inplace: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        local = logits.to_local()
        with scope(SCOPE):
            valid = labels != ignore_index
            mine = valid & (labels >= first) & (labels < first + local.shape[-1])
            here = torch.where(mine, labels - first, 0)
            dtype = _compute_dtype(local.dtype)
            row_max = torch.empty(labels.shape, dtype=dtype, device=local.device)
            sums = torch.zeros(
                (2, labels.numel()), dtype=dtype, device=local.device
            )  # sum of exp, target logit
            for start, x in row_chunks(local, chunk_rows):
                row_max[start : start + rows_of(x)] = x.amax(-1).reshape(-1)
            row_max = funcol.all_reduce(row_max, "max", group)
            for start, x in row_chunks(local, chunk_rows):
                rows = slice(start, start + rows_of(x))
                sums[0, rows] = chunk_logsumexp(x, row_max[rows])
                sums[1, rows] = x.gather(-1, here[rows].view(x.shape[:-1]).unsqueeze(-1)).reshape(-1)
            sums[1] = torch.where(mine, sums[1], 0.0)
            sums = funcol.all_reduce(sums, "sum", group)
            lse = sums[0].log() + torch.where(row_max.isinf(), 0.0, row_max)
            total = torch.where(valid, lse - sums[1], 0.0).sum()
            return total, lse

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        logits, labels, ignore_index, chunk_rows, first, _, inplace = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(logits, labels, output[1])
        ctx.ignore_index, ctx.chunk_rows, ctx.first, ctx.inplace = ignore_index, chunk_rows, first, inplace

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor, _grad_lse: Any) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        _no_double_backward()
        logits, labels, lse = ctx.saved_tensors
        local = logits.to_local()
        with scope(SCOPE + ".backward"):
            valid = labels != ctx.ignore_index
            scale = torch.where(valid, grad_total.to(lse.dtype), 0.0)
            mine = valid & (labels >= ctx.first) & (labels < ctx.first + local.shape[-1])
            target = torch.where(mine, labels - ctx.first, -1)
            inplace = ctx.inplace  # the gradient over this rank's logits: they are not read again
            grad = (
                local.detach()
                if inplace
                else torch.empty(local.shape, dtype=local.dtype, device=local.device)
            )
            # a new gradient is contiguous: its rows in the order row_chunks walks the local shard's
            flat = grad if inplace else grad.view(-1, grad.shape[-1])
            for start, x in row_chunks(local, ctx.chunk_rows):
                rows = slice(start, start + rows_of(x))
                write_chunk_grad(x if inplace else flat[rows], x, lse[rows], scale[rows], target[rows])
        contiguous = logits.stride() if inplace else torch.empty(logits.shape, device="meta").stride()
        out = DTensor.from_local(
            grad,
            logits.device_mesh,
            logits.placements,
            run_check=False,
            shape=logits.shape,
            stride=contiguous,
        )
        return out, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: DTensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
    inplace_backward: bool = False,
) -> torch.Tensor:
    """Summed cross entropy of `logits` (a DTensor split over its last dim, see `vocab_sharded_dim`).

    `labels` has the global row shape, the same on every rank of the vocabulary split (a tensor or a DTensor).
    Returns a plain 0-d tensor, equal on those ranks; the logits' gradient keeps their placements."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh_dim = vocab_sharded_dim(logits)
    if mesh_dim is None:
        raise ValueError(
            f"cross_entropy: logits placements {logits.placements} do not split only the vocabulary (last) dim"
        )
    if isinstance(labels, DTensor):  # torch's loss_parallel takes replicated labels as a DTensor too
        labels = labels.full_tensor()
    _, offset = compute_local_shape_and_global_offset(logits.shape, logits.device_mesh, logits.placements)
    rows = chunk_rows if chunk_rows is not None else default_chunk_rows(logits.to_local().shape[-1])
    group = (logits.device_mesh, mesh_dim)
    total, _ = _VocabParallelCrossEntropy.apply(
        logits, labels.reshape(-1), ignore_index, rows, offset[-1], group, inplace_backward
    )
    return total  # type: ignore[no-any-return]
