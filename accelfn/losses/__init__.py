"""Losses as `Loss(total, count)`: a sum and the number of elements it sums over.

Returning a sum and a count (instead of a mean) is what makes gradient accumulation and data parallelism
exact: the divisor is the global count, so uneven numbers of valid tokens per micro-batch or rank do not
bias the update.

Example:
    >>> import torch, accelfn as af
    >>> logits, labels = torch.zeros(2, 3, 5), torch.tensor([[1, 2, -100], [0, 4, 4]])
    >>> loss = af.losses.cross_entropy(logits, labels)
    >>> int(loss.count), round(float(loss.mean()), 4)
    (5, 1.6094)
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from accelfn.losses.chunked import chunked_cross_entropy

__all__ = ["Loss", "cross_entropy", "linear_cross_entropy", "mse"]


class Loss(NamedTuple):
    """A loss as `total` (sum over elements) and `count` (number of elements); `mean()` is their ratio.

    Example:
        >>> import torch, accelfn as af
        >>> af.Loss(torch.tensor(6.0), torch.tensor(4)).mean().item()
        1.5
    """

    total: torch.Tensor
    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count

    def mean(self) -> torch.Tensor:
        return self.total / self.count


Impl = Literal["auto", "chunked", "plain"]
_IMPLS = ("auto", "chunked", "plain")


def _path(logits: torch.Tensor, impl: str) -> str:
    """Which cross entropy runs: "vocab_parallel", "chunked" or "plain" (see `cross_entropy`)."""
    if impl not in _IMPLS:
        raise ValueError(f"cross_entropy: impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "plain":
        return "plain"
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        from accelfn.losses.vocab_parallel import vocab_sharded_dim

        if isinstance(logits, DTensor):
            return "vocab_parallel" if vocab_sharded_dim(logits) is not None else "plain"
    if torch.compiler.is_compiling():
        return "chunked"
    if torch._C._functorch.is_functorch_wrapped_tensor(logits):  # under torch.func.vmap / grad
        if impl == "chunked":
            raise ValueError(
                "cross_entropy(impl='chunked') does not run under torch.func transforms (vmap, grad): "
                "use impl='plain' there"
            )
        return "plain"
    if impl == "auto" and type(logits) not in (torch.Tensor, torch.nn.Parameter) and not _is_fake(logits):
        return "plain"  # another tensor subclass: its own dispatch decides what the plain loss does
    return "chunked"


def _is_fake(x: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    *,
    impl: Impl = "auto",
    chunk_rows: int | None = None,
    inplace_backward: bool = False,
) -> Loss:
    """Summed cross entropy over every position whose label is not `ignore_index`, in fp32.

    `logits` has shape `(*, classes)` and `labels` shape `(*)`. `impl="auto"` (the default) computes it one chunk
    of `chunk_rows` rows at a time (`"chunked"`): the loss then holds the logits in their own dtype, their
    gradient and one fp32 chunk (default: 2**26 elements, 256 MiB), instead of three fp32 copies of the logits;
    logits split over the vocabulary (a DTensor under `shard(..., loss_parallel=True)`) are chunked on each
    rank's shard. Equal to `impl="plain"` (`F.cross_entropy` on the fp32 logits) to fp32 round-off; only the
    plain path has a second derivative, and it is the one "auto" takes for other tensor subclasses and under
    `torch.func` transforms. `inplace_backward=True` (chunked paths) writes the gradient over the logits
    instead of a new buffer, one logits-sized buffer less; the logits hold the gradient after the backward,
    and a backward that still needs them (another loss on the same logits) fails on autograd's in-place check.

    Example:
        >>> import torch, accelfn as af
        >>> logits, labels = torch.randn(4, 7, 50, dtype=torch.bfloat16), torch.randint(0, 50, (4, 7))
        >>> chunked = af.losses.cross_entropy(logits, labels, chunk_rows=8)
        >>> plain = af.losses.cross_entropy(logits, labels, impl="plain")
        >>> bool(torch.allclose(chunked.total, plain.total))
        True
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"cross_entropy: logits shape {tuple(logits.shape)} does not match labels shape "
            f"{tuple(labels.shape)} (expected logits = labels.shape + (num_classes,))"
        )
    flat_labels = labels.reshape(-1)
    path = _path(logits, impl)
    if inplace_backward and path == "plain":
        raise ValueError(
            f"cross_entropy(inplace_backward=True) needs the chunked loss, but this call takes the plain path "
            f"(impl={impl!r}, logits a {type(logits).__name__})"
        )
    if path == "vocab_parallel":
        from accelfn.losses.vocab_parallel import vocab_parallel_cross_entropy

        total = vocab_parallel_cross_entropy(logits, labels, ignore_index, chunk_rows, inplace_backward)  # type: ignore[arg-type]
    elif path == "chunked":
        total = chunked_cross_entropy(logits, labels, ignore_index, chunk_rows, inplace_backward)
    else:
        from accelfn.losses.plain import plain_cross_entropy

        total = plain_cross_entropy(logits, flat_labels, ignore_index)
    count = (flat_labels != ignore_index).sum()
    return Loss(total, count)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    *,
    chunk_rows: int | None = None,
) -> Loss:
    """`cross_entropy(hidden @ weight.T, labels)` without ever holding the whole logits (an output layer and loss).

    `hidden` `(*, features)`, `weight` `(classes, features)` (an `nn.Linear`'s, no bias), `labels` `(*)`. It works
    `chunk_rows` rows at a time (default: chunks of logits of 2**26 elements): the forward keeps each row's
    log-sum-exp, the backward recomputes a chunk's logits and gives `hidden` and `weight` their gradients. Equal
    to the plain path to fp32 round-off; no double backward; whole tensors only (not DTensors).

    Example:
        >>> import torch, accelfn as af
        >>> hidden, head = torch.randn(2, 6, 16), torch.nn.Linear(16, 50, bias=False)
        >>> labels = torch.randint(0, 50, (2, 6))
        >>> loss = af.losses.linear_cross_entropy(hidden, head.weight, labels)
        >>> bool(torch.allclose(loss.total, af.losses.cross_entropy(head(hidden), labels).total))
        True
    """
    from accelfn.losses.linear import linear_cross_entropy_total

    total = linear_cross_entropy_total(hidden, weight, labels, ignore_index, chunk_rows)
    return Loss(total, (labels.reshape(-1) != ignore_index).sum())


def mse(pred: torch.Tensor, target: torch.Tensor) -> Loss:
    """Summed squared error and the number of elements."""
    if pred.shape != target.shape:
        raise ValueError(f"mse: pred shape {tuple(pred.shape)} != target shape {tuple(target.shape)}")
    diff = pred.float() - target.float()
    return Loss((diff * diff).sum(), torch.tensor(diff.numel(), device=diff.device))
