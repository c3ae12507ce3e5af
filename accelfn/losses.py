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

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["Loss", "cross_entropy", "mse"]


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


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> Loss:
    """Summed cross entropy over every position whose label is not `ignore_index`.

    `logits` has shape `(*, classes)` and `labels` shape `(*)`.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"cross_entropy: logits shape {tuple(logits.shape)} does not match labels shape "
            f"{tuple(labels.shape)} (expected logits = labels.shape + (num_classes,))"
        )
    flat_labels = labels.reshape(-1)
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), flat_labels, ignore_index=ignore_index, reduction="sum"
    )
    count = (flat_labels != ignore_index).sum()
    return Loss(total, count)


def mse(pred: torch.Tensor, target: torch.Tensor) -> Loss:
    """Summed squared error and the number of elements."""
    if pred.shape != target.shape:
        raise ValueError(f"mse: pred shape {tuple(pred.shape)} != target shape {tuple(target.shape)}")
    diff = pred.float() - target.float()
    return Loss((diff * diff).sum(), torch.tensor(diff.numel(), device=diff.device))
