"""Cross entropy one chunk of rows at a time: the loss holds no more than one fp32 chunk beyond the logits.

The plain loss upcasts the whole logits to fp32 and keeps its log-softmax for the backward; its backward makes
two more full fp32 tensors. At a 128,256-token vocabulary that is three fp32 copies of the logits. Here the
forward upcasts one chunk of rows at a time and keeps only each row's log-sum-exp (4 bytes a row); the backward
recomputes `softmax - onehot` per chunk and writes it, in the logits' dtype, into one gradient buffer.
The design follows torchtune's chunked cross entropy (chunks over rows, fp32 per chunk) and Liger's and Apple's
Cut Cross-Entropy (keep the log-sum-exp, rebuild the softmax in the backward).

Example:
    >>> import torch
    >>> from accelfn.losses.chunked import chunked_cross_entropy
    >>> logits = torch.randn(6, 10, requires_grad=True)
    >>> labels = torch.tensor([1, 2, -100, 4, 5, 9])
    >>> total = chunked_cross_entropy(logits, labels, chunk_rows=4)
    >>> ref = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    >>> bool(torch.allclose(total, ref))
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "CHUNK_ELEMENTS",
    "chunked_cross_entropy",
    "default_chunk_rows",
    "row_blocks",
    "row_chunks",
    "rows_of",
]

# An fp32 chunk of 2**26 elements is 256 MiB: at a 128,256-token vocabulary 523 rows, 6% of the bf16 logits of
# 2 x 8192 tokens, and large enough that each chunk's kernels fill a GPU (launch costs stay below 1%).
CHUNK_ELEMENTS = 1 << 26
SCOPE = "accelfn.losses.cross_entropy"  # the profiler scope the loss's forward and backward run in


def scope(name: str) -> contextlib.AbstractContextManager[Any]:
    """The profiler scope the loss runs in (`record_function`; its ops show the dry run which allocations are the
    loss's); nothing while compiling, where dynamo would drop it with a warning."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch.profiler.record_function(name)


def default_chunk_rows(classes: int) -> int:
    """Rows per chunk so that one fp32 chunk has at most `CHUNK_ELEMENTS` elements (256 MiB)."""
    return max(1, CHUNK_ELEMENTS // max(classes, 1))


def _flattens_to_a_view(x: torch.Tensor) -> bool:
    """Whether `x.reshape(-1, x.shape[-1])` is a view (no copy): its leading dims are laid out contiguously."""
    expected = x.stride(-2) if x.dim() >= 2 else 0
    for size, stride in zip(reversed(x.shape[:-1]), reversed(x.stride()[:-1]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected = stride * size if size != 1 else expected
    return True


def rows_of(x: torch.Tensor) -> int:
    """The rows of `x` (shape `(*, classes)`): every element of its last dimension is one class of a row."""
    return x.numel() // x.shape[-1] if x.dim() else 1


def row_blocks(x: torch.Tensor, batch_rows: int = 0) -> list[torch.Tensor]:
    """Views of `x` (shape `(*, classes)`) covering its rows in row-major order, no copy: 2-D `(rows, classes)`,
    or with `batch_rows` 3-D `(sequences, rows, classes)` of at most `batch_rows` rows each.

    One 2-D view when the leading dims flatten without a copy; otherwise (e.g. `logits[:, :-1]`) one per leading
    index, recursively, unless each leading index flattens and `batch_rows` holds at least two of them: then
    3-D views of as many leading indices as `batch_rows` holds (several sequences a chunk).

    Example:
        >>> x = torch.zeros(6, 5, 3)[:, :-1]
        >>> [tuple(b.shape) for b in row_blocks(x)], [tuple(b.shape) for b in row_blocks(x, batch_rows=8)]
        ([(4, 3), (4, 3), (4, 3), (4, 3), (4, 3), (4, 3)], [(2, 4, 3), (2, 4, 3), (2, 4, 3)])
    """
    if x.dim() == 1:
        return [x.unsqueeze(0)]
    if x.dim() == 2 or _flattens_to_a_view(x):
        return [x.reshape(-1, x.shape[-1])]
    inner = rows_of(x[0]) if x.shape[0] else 0
    if inner and batch_rows >= 2 * inner and (x.dim() == 3 or _flattens_to_a_view(x[0])):
        per = batch_rows // inner
        return [x[i : i + per].reshape(-1, inner, x.shape[-1]) for i in range(0, x.shape[0], per)]
    return [block for i in range(x.shape[0]) for block in row_blocks(x[i], batch_rows)]


def row_chunks(
    x: torch.Tensor, chunk_rows: int, *, batched: bool = True
) -> Iterator[tuple[int, torch.Tensor]]:
    """`(first row, chunk)` for chunks of at most `chunk_rows` rows of `x` (shape `(*, classes)`), as views: 2-D
    `(rows, classes)`, or (`batched`, where the rows do not flatten into one view, as in `logits[:, :-1]`) 3-D
    `(sequences, rows, classes)` holding several whole sequences. `rows_of(chunk)` is a chunk's row count."""
    start = 0
    for block in row_blocks(x, chunk_rows if batched else 0):
        n = rows_of(block)
        if block.dim() == 3:
            yield start, block
        else:
            for lo in range(0, n, chunk_rows):
                yield start + lo, block[lo : lo + chunk_rows]
        start += n


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def chunk_logsumexp(x: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """Per-row `log(sum(exp(x - row_max))) + row_max` in fp32 (or wider), with one fp32 chunk of temporaries.

    `row_max` (fp32, one per row) may be the maximum over more columns than `x` has (loss parallel); rows whose
    maximum is infinite are shifted by 0, as `torch.logsumexp` does."""
    shift = torch.where(row_max.isinf(), 0.0, row_max).view(x.shape[:-1])
    e = torch.sub(x, shift.unsqueeze(-1).to(_compute_dtype(x.dtype)))  # the one fp32 chunk
    e.exp_()
    return e.sum(-1).reshape(-1)


def write_chunk_grad(
    out: torch.Tensor, x: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, target: torch.Tensor | None
) -> None:
    """`out = (softmax(x) - onehot(target)) * scale` per row, with one fp32 chunk; `target` None: no onehot here.

    `lse` is each row's global log-sum-exp, `scale` each row's gradient (0 on ignored rows); `target` the class
    index within `x`'s columns (rows whose target lies elsewhere pass -1: no onehot on that row). `out` may be
    `x` itself (the gradient written over the logits), or its rows flattened (`x` 3-D: several sequences); `lse`,
    `scale` and `target` have one entry per row, flat."""
    rows = x.shape[:-1]
    p = torch.sub(x, lse.view(rows).unsqueeze(-1).to(_compute_dtype(x.dtype)))  # the one fp32 chunk
    p.exp_()
    p.mul_(scale.view(rows).unsqueeze(-1))
    if target is not None:
        here = (target >= 0).view(rows)
        p.scatter_add_(
            -1,
            torch.where(here, target.view(rows), 0).unsqueeze(-1),
            torch.where(here, -scale.view(rows), 0.0).unsqueeze(-1),
        )
    out.copy_(p.view(out.shape))


def _no_double_backward() -> None:
    if torch.is_grad_enabled():
        raise RuntimeError(
            "af.losses.cross_entropy: the chunked loss has no second derivative (double backward / "
            "create_graph=True); pass impl='plain' to differentiate it twice"
        )


def fill_chunk(
    x: torch.Tensor, safe: torch.Tensor, rows: slice, lse: torch.Tensor, target: torch.Tensor
) -> None:
    """Write one chunk's rows of the log-sum-exp and the target logit (`safe`: labels with ignored rows at 0);
    `x` 2-D `(rows, classes)` or 3-D `(sequences, rows, classes)`."""
    row_max = x.amax(-1).to(lse.dtype).reshape(-1)
    lse[rows] = chunk_logsumexp(x, row_max).log_().add_(row_max)
    target[rows] = x.gather(-1, safe[rows].view(x.shape[:-1]).unsqueeze(-1)).reshape(-1)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross entropy over rows; saves the logits (no copy), the labels and each row's log-sum-exp."""

    @staticmethod
    def forward(  # type: ignore[override]
        logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, chunk_rows: int, inplace: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with scope(SCOPE):
            valid = labels != ignore_index
            safe = torch.where(valid, labels, 0)
            lse = torch.empty(labels.shape, dtype=_compute_dtype(logits.dtype), device=logits.device)
            target = torch.empty_like(lse)
            for start, x in row_chunks(logits, chunk_rows):
                rows = slice(start, start + rows_of(x))
                fill_chunk(x, safe, rows, lse, target)
            total = torch.where(valid, lse - target, 0.0).sum()
            return total, lse

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        logits, labels, ignore_index, chunk_rows, inplace = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(logits, labels, output[1])
        ctx.ignore_index, ctx.chunk_rows, ctx.inplace = ignore_index, chunk_rows, inplace

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor, _grad_lse: Any) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        _no_double_backward()
        logits, labels, lse = ctx.saved_tensors
        with scope(SCOPE + ".backward"):
            valid = labels != ctx.ignore_index
            scale = torch.where(valid, grad_total.to(lse.dtype), 0.0)
            target = torch.where(valid, labels, -1)
            if ctx.inplace:  # each chunk's gradient over its logits: they are not read again
                for start, x in row_chunks(logits, ctx.chunk_rows):
                    rows = slice(start, start + rows_of(x))
                    write_chunk_grad(x, x, lse[rows], scale[rows], target[rows])
                return logits.detach(), None, None, None, None
            grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            # contiguous: its rows in the order row_chunks walks the logits'
            flat = grad.view(-1, grad.shape[-1])
            for start, x in row_chunks(logits, ctx.chunk_rows):
                rows = slice(start, start + rows_of(x))
                write_chunk_grad(flat[rows], x, lse[rows], scale[rows], target[rows])
        return grad, None, None, None, None


def chunked_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
    inplace_backward: bool = False,
) -> torch.Tensor:
    """Summed cross entropy of `logits` `(*, classes)` against `labels` `(*)`, `chunk_rows` rows at a time.

    Equal to `F.cross_entropy(logits.float(), labels, reduction="sum")` to fp32 round-off, value and gradient;
    the gradient comes back in the logits' dtype. No double backward. `inplace_backward=True` writes the
    gradient over the logits (no gradient buffer): after the backward they hold it, and a backward that
    needs them afterwards (another loss on them) fails on autograd's in-place check."""
    rows = chunk_rows if chunk_rows is not None else default_chunk_rows(logits.shape[-1])
    if rows < 1:
        raise ValueError(f"cross_entropy: chunk_rows must be a positive number of rows, got {chunk_rows}")
    total, _ = _ChunkedCrossEntropy.apply(logits, labels.reshape(-1), ignore_index, rows, inplace_backward)
    return total  # type: ignore[no-any-return]
