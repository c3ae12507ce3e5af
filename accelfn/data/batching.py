"""The batching arithmetic of a sharded epoch: global batches, per-rank slices, wrap-around padding.

A stream of samples (dataset indices, or the items of an iterable dataset) is cut into *global batches* of
`per_rank * ranks` samples; data rank `r` reads slice `r` of each. Pure functions, no torch, no processes.

Example:
    >>> [(b, pad) for b, pad in global_batches(range(7), 3)]
    [([0, 1, 2], 0), ([3, 4, 5], 0), ([6, 0, 1], 2)]
    >>> rank_slices([6, 0, 1, 2], per_rank=2, ranks=2)
    [[6, 0], [1, 2]]
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch

__all__ = ["global_batches", "rank_slices", "batches_per_rank", "epoch_order"]

T = TypeVar("T")


def global_batches(
    stream: Iterable[T], size: int, *, drop_last: bool = False, even_batches: bool = True
) -> Iterator[tuple[list[T], int]]:
    """Cut `stream` into lists of `size` items; yields `(batch, padding)`.

    The last, short batch is dropped (`drop_last`), padded by wrapping around to the start of the stream
    (`even_batches`; `padding` counts the repeated items), or yielded short.

    Example:
        >>> list(global_batches("abcde", 2, even_batches=False))
        [(['a', 'b'], 0), (['c', 'd'], 0), (['e'], 0)]
        >>> list(global_batches("abcde", 2, drop_last=True))
        [(['a', 'b'], 0), (['c', 'd'], 0)]
    """
    head: list[T] = []
    it = iter(stream)
    while True:
        batch = list(itertools.islice(it, size))
        if not head:
            head = batch
        if len(batch) == size:
            yield batch, 0
            continue
        if batch and not drop_last:
            padding = size - len(batch) if even_batches else 0
            yield batch + list(itertools.islice(itertools.cycle(head), padding)), padding
        return


def rank_slices(batch: list[T], per_rank: int, ranks: int) -> list[list[T]]:
    """Split a global batch into `ranks` consecutive slices of `per_rank` items (the last ones may be short
    or empty when the batch is).

    Example:
        >>> rank_slices([0, 1, 2, 3, 4], per_rank=3, ranks=2)
        [[0, 1, 2], [3, 4]]
    """
    return [batch[r * per_rank : (r + 1) * per_rank] for r in range(ranks)]


def batches_per_rank(
    n: int, per_rank: int, ranks: int, rank: int, *, drop_last: bool = False, even_batches: bool = True
) -> int:
    """How many batches data rank `rank` reads from `n` samples (what `global_batches` + `rank_slices` give).

    Example:
        >>> [batches_per_rank(21, 3, 2, r, even_batches=False) for r in (0, 1)]
        [4, 3]
    """
    size = per_rank * ranks
    full, rest = divmod(n, size)
    if rest == 0 or drop_last:
        return full
    if even_batches:
        return full + 1
    return full + (1 if rest > rank * per_rank else 0)


def epoch_order(n: int, *, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The sample order of one epoch: `range(n)`, or a permutation drawn from `seed + epoch` (the same on
    every process and every run).

    Example:
        >>> epoch_order(5, shuffle=False, seed=0, epoch=3)
        [0, 1, 2, 3, 4]
        >>> epoch_order(5, shuffle=True, seed=0, epoch=1) == epoch_order(5, shuffle=True, seed=1, epoch=0)
        True
    """
    if not shuffle:
        return list(range(n))
    g = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()
