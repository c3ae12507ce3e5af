"""One epoch of a rank's batches as a torch `IterableDataset`, so torch's worker processes can build them.

Each item is `(batch, BatchInfo)`. With `W` workers, worker `w` builds the batches `k` with
`(k - skip) % W == w`; torch's loader returns workers' items round-robin, so batches come out in order.
Batches before `skip` (already consumed before a resume) are never fetched nor collated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import attrs
from torch.utils.data import IterableDataset, get_worker_info

from .batching import epoch_order, global_batches, rank_slices

__all__ = ["BatchInfo", "EpochSpec", "EpochBatches", "keep"]


class BatchInfo(NamedTuple):
    """Where a batch sits in its epoch: global batch `step`, how many of its samples (over all ranks) are
    wrap-around `padding`, and the number of samples each data rank got (`sizes`, in data-rank order)."""

    step: int
    padding: int
    sizes: tuple[int, ...]


@attrs.frozen
class EpochSpec:
    """What one epoch reads: `rank=None` builds every rank's batch (the dispatching process)."""

    per_rank: int
    ranks: int
    rank: int | None
    epoch: int
    skip: int
    shuffle: bool = False
    seed: int = 0
    drop_last: bool = False
    even_batches: bool = True


class EpochBatches(IterableDataset[tuple[Any, BatchInfo]]):
    """The batches of one epoch for `spec.rank` (or a list with every rank's batch), with their `BatchInfo`."""

    def __init__(
        self, dataset: Any, spec: EpochSpec, collate: Callable[[list[Any]], Any], is_map: bool
    ) -> None:
        self.dataset, self.spec, self.collate, self.is_map = dataset, spec, collate, is_map

    def __iter__(self) -> Iterator[tuple[Any, BatchInfo]]:
        s = self.spec
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if self.is_map:
            stream: Any = epoch_order(len(self.dataset), shuffle=s.shuffle, seed=s.seed, epoch=s.epoch)
        else:
            if callable(getattr(self.dataset, "set_epoch", None)):
                self.dataset.set_epoch(s.epoch)
            stream = self.dataset
        batches = global_batches(
            stream, s.per_rank * s.ranks, drop_last=s.drop_last, even_batches=s.even_batches
        )
        for k, (batch, padding) in enumerate(batches):
            slices = rank_slices(batch, s.per_rank, s.ranks)
            if s.rank is not None and not slices[s.rank]:
                return  # uneven batches: this rank has no share of the last global batch
            if k < s.skip or (k - s.skip) % workers != worker:
                continue
            meta = BatchInfo(k, padding, tuple(len(x) for x in slices))
            if s.rank is not None:
                yield self._build(slices[s.rank]), meta
            else:
                yield [self._build(x) if x else None for x in slices], meta

    def _build(self, part: list[Any]) -> Any:
        if not self.is_map:
            return self.collate(part)
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(part) if callable(getitems) else [self.dataset[i] for i in part]
        return self.collate(samples)


def keep(item: Any) -> Any:
    """torch's `collate_fn` for already-built batches (module-level, so worker processes can pickle it)."""
    return item
