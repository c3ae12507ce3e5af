"""Cross entropy of a linear layer's output that never holds the whole logits (`hidden @ weight.T`).

The output layer and the loss run together one chunk of rows at a time: the forward computes a chunk's logits,
keeps its rows' log-sum-exp and drops them; the backward computes them again and turns them into the
chunk's rows of the hidden states' gradient and its share of the weight's. The logits of the whole batch exist
at no point, in either direction (Liger's fused linear cross entropy and Apple's Cut Cross-Entropy, written
here in plain torch ops: the backward recomputes each chunk's logits, one more matmul for the memory saved).

Example:
    >>> import torch, accelfn as af
    >>> hidden, weight = torch.randn(2, 5, 16), torch.randn(50, 16)
    >>> labels = torch.randint(0, 50, (2, 5))
    >>> loss = af.losses.linear_cross_entropy(hidden, weight, labels, chunk_rows=4)
    >>> plain = af.losses.cross_entropy(hidden @ weight.T, labels, impl="plain")
    >>> bool(torch.allclose(loss.total, plain.total, rtol=1e-5))
    True
"""

from __future__ import annotations

from typing import Any

import torch

from accelfn.losses.chunked import (
    SCOPE,
    _compute_dtype,
    _no_double_backward,
    default_chunk_rows,
    fill_chunk,
    row_chunks,
    scope,
    write_chunk_grad,
)

__all__ = ["linear_cross_entropy_total"]

LINEAR_SCOPE = SCOPE.replace("cross_entropy", "linear_cross_entropy")


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed cross entropy of `hidden @ weight.T`; saves hidden, weight (no copies), labels and log-sum-exp."""

    @staticmethod
    def forward(  # type: ignore[override]
        hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int, chunk_rows: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with scope(LINEAR_SCOPE):
            valid = labels != ignore_index
            safe = torch.where(valid, labels, 0)
            lse = torch.empty(labels.shape, dtype=_compute_dtype(hidden.dtype), device=hidden.device)
            target = torch.empty_like(lse)
            for start, h in row_chunks(hidden, chunk_rows, batched=False):
                rows = slice(start, start + h.shape[0])
                x = h @ weight.T  # this chunk's logits, in the compute dtype
                fill_chunk(x, safe, rows, lse, target)
            total = torch.where(valid, lse - target, 0.0).sum()
            return total, lse

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        hidden, weight, labels, ignore_index, chunk_rows = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(hidden, weight, labels, output[1])
        ctx.ignore_index, ctx.chunk_rows = ignore_index, chunk_rows

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor, _grad_lse: Any) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        _no_double_backward()
        hidden, weight, labels, lse = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        with scope(LINEAR_SCOPE + ".backward"):
            valid = labels != ctx.ignore_index
            scale = torch.where(valid, grad_total.to(lse.dtype), 0.0)
            target = torch.where(valid, labels, -1)
            grad_hidden = (
                torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if want_hidden else None
            )
            flat = grad_hidden.view(-1, hidden.shape[-1]) if grad_hidden is not None else None
            # the weight's gradient sums over every chunk: in fp32 (or wider), rounded once at the end
            grad_weight = torch.zeros(weight.shape, dtype=_compute_dtype(weight.dtype), device=weight.device)
            for start, h in row_chunks(hidden, ctx.chunk_rows, batched=False):
                rows = slice(start, start + h.shape[0])
                x = h @ weight.T
                g = torch.empty_like(x)  # this chunk's gradient of the logits, in their dtype
                write_chunk_grad(g, x, lse[rows], scale[rows], target[rows])
                del x
                if flat is not None:
                    torch.mm(g, weight, out=flat[rows])
                if want_weight:
                    grad_weight.add_(g.T @ h)
        return grad_hidden, grad_weight.to(weight.dtype) if want_weight else None, None, None, None


def linear_cross_entropy_total(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Summed cross entropy of `hidden @ weight.T` against `labels`, chunked (see the module docs)."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        for name, t in (("hidden", hidden), ("weight", weight)):
            if isinstance(t, DTensor):
                raise ValueError(
                    f"linear_cross_entropy: {name} is a DTensor ({t.placements}); it takes whole tensors. Under "
                    "tensor parallel use af.losses.cross_entropy on the output layer's logits (loss_parallel); "
                    "under fsdp, the output layer's weight is whole only inside that layer's forward"
                )
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: weight shape {tuple(weight.shape)} must be (classes, {hidden.shape[-1]}) for "
            f"hidden of shape {tuple(hidden.shape)}"
        )
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"linear_cross_entropy: hidden shape {tuple(hidden.shape)} does not match labels shape "
            f"{tuple(labels.shape)} (expected hidden = labels.shape + (features,))"
        )
    device = hidden.device.type
    if torch.is_autocast_enabled(device):  # the matmul autocast would run: cast here, where autograd sees it
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    elif hidden.dtype != weight.dtype:
        raise ValueError(
            f"linear_cross_entropy: hidden is {hidden.dtype} but weight is {weight.dtype}; cast one of them"
        )
    rows = chunk_rows if chunk_rows is not None else default_chunk_rows(weight.shape[0])
    if rows < 1:
        raise ValueError(
            f"linear_cross_entropy: chunk_rows must be a positive number of rows, got {chunk_rows}"
        )
    with torch.autocast(device, enabled=False):
        total, _ = _LinearCrossEntropy.apply(hidden, weight, labels.reshape(-1), ignore_index, rows)
    return total  # type: ignore[no-any-return]
