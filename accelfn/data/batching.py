"""The batching arithmetic of a sharded epoch: global batches, per-rank slices, the last batch.

A stream of samples (dataset indices, or the items of an iterable dataset) is cut into *global batches* of
`per_rank * ranks` samples; data rank `r` reads slice `r` of each. The last, incomplete global batch is
handled by the loader's `last_batch` mode (`LAST_BATCH`): `"pad"` wraps around to the first samples,
`"short"` leaves it smaller and splits it over the ranks as evenly as possible, `"drop"` drops it; and
`"uneven"` (the loader's `even_batches=False`) leaves it smaller in `per_rank` slices, so the last ranks may
get no batch at all. Pure functions, no torch, no processes.

Example:
    >>> [(b, pad) for b, pad in global_batches(range(7), 3)]
    [([0, 1, 2], 0), ([3, 4, 5], 0), ([6, 0, 1], 2)]
    >>> rank_slices([6, 0, 1, 2], per_rank=2, ranks=2)
    [[6, 0], [1, 2]]
    >>> rank_slices([6, 7, 8], per_rank=2, ranks=2, balanced=True)
    [[6, 7], [8]]
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch

__all__ = [
    "LAST_BATCH",
    "last_batch_mode",
    "global_batches",
    "rank_slices",
    "batches_per_rank",
    "epoch_order",
]

T = TypeVar("T")

LAST_BATCH = ("pad", "short", "drop")
"""The choices of `DataLoader(last_batch=...)`."""


def last_batch_mode(
    last_batch: str | None, *, drop_last: bool = False, even_batches: bool | None = None
) -> str:
    """The loader's mode for the last global batch: one of `LAST_BATCH`, or `"uneven"` (`even_batches=False`).

    `last_batch` is the loader's argument; `drop_last` and `even_batches` are Accelerate's names for two of
    the modes (`drop_last=True` is `"drop"`, `even_batches=True` is `"pad"`; `even_batches=False` leaves the
    ranks different numbers of batches). Contradicting arguments are a `ValueError`.

    Example:
        >>> last_batch_mode(None), last_batch_mode("short"), last_batch_mode(None, drop_last=True)
        ('pad', 'short', 'drop')
        >>> last_batch_mode(None, even_batches=False)
        'uneven'
    """
    if last_batch is not None and last_batch not in LAST_BATCH:
        raise ValueError(
            f"DataLoader: last_batch={last_batch!r} is not one of {', '.join(map(repr, LAST_BATCH))} "
            "(wrap around to the first samples / a smaller last batch / drop it)"
        )
    if drop_last:
        if last_batch not in (None, "drop"):
            raise ValueError(
                f"DataLoader: drop_last=True contradicts last_batch={last_batch!r}; pass only last_batch="
            )
        if even_batches is False:
            raise ValueError("DataLoader: drop_last=True and even_batches=False: pass only one of them")
        return "drop"
    if even_batches is None:
        return last_batch if last_batch is not None else "pad"
    wanted = "pad" if even_batches else "uneven"
    if last_batch is not None and last_batch != wanted:
        raise ValueError(
            f"DataLoader: even_batches={even_batches} contradicts last_batch={last_batch!r}; pass only "
            "last_batch= (even_batches=True is last_batch='pad'; even_batches=False gives the ranks different "
            "numbers of batches, which last_batch='short' avoids)"
        )
    return wanted


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


def rank_slices(batch: list[T], per_rank: int, ranks: int, *, balanced: bool = False) -> list[list[T]]:
    """Split a global batch into `ranks` consecutive slices of `per_rank` items. A short batch leaves the last
    slices short or empty; with `balanced`, it is split as evenly as possible instead (the first
    `len(batch) % ranks` slices one item longer; empty slices only when there are fewer items than ranks).

    Example:
        >>> rank_slices([0, 1, 2, 3, 4], per_rank=3, ranks=2)
        [[0, 1, 2], [3, 4]]
        >>> rank_slices([0, 1, 2, 3, 4], per_rank=3, ranks=4, balanced=True)
        [[0, 1], [2], [3], [4]]
        >>> rank_slices([0], per_rank=3, ranks=2, balanced=True)
        [[0], []]
    """
    if not balanced or len(batch) >= per_rank * ranks:
        return [batch[r * per_rank : (r + 1) * per_rank] for r in range(ranks)]
    q, extra = divmod(len(batch), ranks)
    starts = [r * q + min(r, extra) for r in range(ranks + 1)]
    return [batch[starts[r] : starts[r + 1]] for r in range(ranks)]


def batches_per_rank(
    n: int,
    per_rank: int,
    ranks: int,
    rank: int,
    *,
    drop_last: bool = False,
    even_batches: bool = True,
    last_batch: str | None = None,
) -> int:
    """How many batches data rank `rank` reads from `n` samples (what `global_batches` + `rank_slices` give):
    with `last_batch="pad"` or `"short"` every rank reads one per global batch.

    Example:
        >>> [batches_per_rank(21, 3, 2, r, even_batches=False) for r in (0, 1)]
        [4, 3]
        >>> [batches_per_rank(21, 3, 2, r, last_batch=mode) for mode in ("pad", "short", "drop") for r in (0, 1)]
        [4, 4, 4, 4, 3, 3]
    """
    mode = (
        last_batch
        if last_batch is not None
        else ("drop" if drop_last else "pad" if even_batches else "uneven")
    )
    size = per_rank * ranks
    full, rest = divmod(n, size)
    if rest == 0 or mode == "drop":
        return full
    if mode in ("pad", "short"):
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
