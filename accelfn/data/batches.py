"""One epoch of a rank's batches as a torch `IterableDataset`, so torch's worker processes can build them.

Each item is `(batch, BatchInfo)`. With `W` workers, worker `w` builds the batches `k` with
`(k - skip) % W == w`; torch's loader returns workers' items round-robin, so batches come out in order.
Batches before `skip` (already consumed before a resume) are never fetched nor collated. With
`last_batch="short"` a rank whose share of the last global batch is empty gets an empty batch: the structure
of a batch with every tensor (and list of samples) cut to 0 rows, so it still takes part in the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import attrs
import torch
from torch.utils.data import IterableDataset, get_worker_info

from .batching import epoch_order, global_batches, rank_slices

__all__ = ["BatchInfo", "EpochSpec", "EpochBatches", "keep", "no_rows"]


class BatchInfo(NamedTuple):
    """Where a batch sits in its epoch: global batch `step`, how many of its samples (over all ranks) are
    wrap-around `padding`, and the number of samples each data rank got (`sizes`, in data-rank order; 0 for
    a rank with an empty batch)."""

    step: int
    padding: int
    sizes: tuple[int, ...]


@attrs.frozen
class EpochSpec:
    """What one epoch reads: `rank=None` builds every rank's batch (the dispatching process). `last_batch`:
    `"pad"`, `"short"`, `"drop"` or `"uneven"` (see `accelfn.data.batching`)."""

    per_rank: int
    ranks: int
    rank: int | None
    epoch: int
    skip: int
    shuffle: bool = False
    seed: int = 0
    last_batch: str = "pad"


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
        short = s.last_batch == "short"
        batches = global_batches(
            stream, s.per_rank * s.ranks, drop_last=s.last_batch == "drop", even_batches=s.last_batch == "pad"
        )
        for k, (batch, padding) in enumerate(batches):
            slices = rank_slices(batch, s.per_rank, s.ranks, balanced=short)
            if s.rank is not None and not slices[s.rank] and not short:
                return  # uneven batches: this rank has no share of the last global batch
            if k < s.skip or (k - s.skip) % workers != worker:
                continue
            meta = BatchInfo(k, padding, tuple(len(x) for x in slices))
            if s.rank is not None:
                yield self._part(slices[s.rank], batch), meta
            else:
                yield [self._part(x, batch) if x or short else None for x in slices], meta

    def _part(self, part: list[Any], batch: list[Any]) -> Any:
        """The batch of `part`; an empty part (a short last batch with fewer samples than ranks) gives the
        structure of `batch`'s first sample with 0 rows."""
        return self._build(part) if part else no_rows(self._build(batch[:1]))

    def _build(self, part: list[Any]) -> Any:
        if not self.is_map:
            return self.collate(part)
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(part) if callable(getitems) else [self.dataset[i] for i in part]
        return self.collate(samples)


def no_rows(batch: Any) -> Any:
    """`batch` with 0 rows: every tensor cut to `[:0]` along dim 0, every list of samples (a list whose items
    are not tensors, mappings, lists or tuples, e.g. strings) emptied; dicts, tuples and lists of those keep
    their structure.

    Example:
        >>> import torch
        >>> no_rows({"x": torch.ones(1, 3), "text": ["a"], "pair": [torch.zeros(1), torch.zeros(1)]})
        {'x': tensor([], size=(0, 3)), 'text': [], 'pair': [tensor([]), tensor([])]}
    """
    if isinstance(batch, torch.Tensor):
        return batch[:0] if batch.dim() else batch
    if isinstance(batch, Mapping):
        items = {k: no_rows(v) for k, v in batch.items()}
        try:
            return type(batch)(items)  # type: ignore[call-arg]
        except Exception:
            return items
    if isinstance(batch, (list, tuple)):
        nested = (torch.Tensor, Mapping, list, tuple)
        if batch and not any(isinstance(v, nested) for v in batch):
            return type(batch)() if type(batch) in (list, tuple) else []
        parts = [no_rows(v) for v in batch]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
            return type(batch)(*parts)
        return type(batch)(parts)
    return batch


def keep(item: Any) -> Any:
    """torch's `collate_fn` for already-built batches (module-level, so worker processes can pickle it)."""
    return item
