"""`DataLoader`: each data-parallel rank's shard of a dataset, in batches on its device, resumable mid-epoch.

Example:
    >>> import accelfn as af
    >>> loader = af.data.DataLoader(range(10), batch_size=4)
    >>> [b.tolist() for b in loader], len(loader)
    ([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]], 3)
    >>> loader.padding                     # the last batch wrapped around to the start
    2
    >>> [b.tolist() for b in af.data.DataLoader(range(10), batch_size=4, last_batch="short")]
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.data as tud

from .. import platforms
from .. import tree as _tree
from .._typecheck import checked
from ..mesh import Mesh
from .batches import BatchInfo, EpochBatches, EpochSpec, keep
from .batching import batches_per_rank, last_batch_mode
from .layout import DataLayout

__all__ = ["DataLoader", "STATE_VERSION"]

STATE_VERSION = 1
"""Version of the `DataLoader.state_dict()` format."""


class DataLoader:
    """Batches of `dataset` for this process's data-parallel shard, moved to the mesh's device.

    Global batch `k` of the epoch's sample order is `batch_size * data_size` consecutive samples; data rank
    `r` gets its `r`-th slice (`batch_size` is per rank; with `split_batches=True` it is the global size and
    each rank gets `batch_size / data_size`). The mesh is `mesh`, else `af.Mesh.current()`, else the running
    process group, else this single process.

    - `shuffle`: a permutation drawn from `torch.Generator().manual_seed(seed + epoch)`: the same on every
      rank and every run. Each new `for` loop over the loader starts the next epoch; `set_epoch(e)` picks one.
    - `last_batch`: the last, incomplete global batch is
      - `"pad"` (the default): padded by wrapping around to the epoch's first samples, so every rank gets as
        many equal batches (`padding` and `gather_for_metrics` know which samples repeat);
      - `"short"`: left smaller, split over the data ranks as evenly as possible (every rank still gets a
        batch, with 0 rows when the batch has fewer samples than ranks): each sample once per epoch, and
        with `af.Loss(total, count)` the last update is exact;
      - `"drop"`: dropped.
      Accelerate's names work too: `drop_last=True` is `"drop"`, `even_batches=True` is `"pad"`, and
      `even_batches=False` leaves the last batch short in `batch_size` slices, so the last ranks may get
      fewer batches than the others (not for a sharded step, whose ranks must step together).
    - `dataset`: map-style (`len` and `[i]`), a dict of equally long tensors (columns), or an iterable (every
      rank reads the stream and keeps its slices; `dispatch=True`: rank 0 reads it and sends each rank its
      batch). An iterable's `set_epoch(e)` is called at the start of each epoch.
    - `num_workers` worker processes build batches (torch's DataLoader underneath); `collate_fn` makes a
      batch from a list of samples (default: torch's `default_collate`).
    - `state_dict()` / `load_state_dict()`: a JSON-able position; a new loader resumes with exactly the
      batches not yet yielded, which are never read again.

    Example:
        >>> import torch, accelfn as af
        >>> data = {"x": torch.arange(6.0).reshape(3, 2), "y": torch.tensor([0, 1, 0])}
        >>> loader = af.data.DataLoader(data, batch_size=2, drop_last=True)
        >>> next(iter(loader))
        {'x': tensor([[0., 1.],
                [2., 3.]]), 'y': tensor([0, 1])}
    """

    @checked
    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        mesh: Mesh | None = None,
        shuffle: bool = False,
        seed: int = 0,
        last_batch: str | None = None,
        drop_last: bool = False,
        even_batches: bool | None = None,
        split_batches: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        dispatch: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"DataLoader: batch_size={batch_size} must be at least 1")
        if num_workers < 0:
            raise ValueError(f"DataLoader: num_workers={num_workers} must be 0 (no workers) or more")
        mode = last_batch_mode(last_batch, drop_last=drop_last, even_batches=even_batches)
        self._layout = DataLayout.resolve(mesh)
        ranks = self._layout.data_size
        if split_batches:
            if batch_size % ranks:
                raise ValueError(
                    f"DataLoader: with split_batches=True the global batch_size={batch_size} must split evenly "
                    f"across the {ranks} data-parallel ranks; use a multiple of {ranks}, or split_batches=False "
                    f"for {batch_size} samples per rank"
                )
            batch_size //= ranks
        self._dataset, self._is_map = _as_dataset(dataset)
        if shuffle and not self._is_map:
            raise ValueError(
                f"DataLoader: shuffle=True needs a map-style dataset (with len() and [i]); "
                f"{type(dataset).__name__} is an iterable: shuffle its stream itself (its set_epoch(e) is called)"
            )
        self._per_rank = batch_size
        self._shuffle, self._seed, self._mode = shuffle, seed, mode
        self._collate = collate_fn if collate_fn is not None else tud.default_collate
        self._num_workers, self._dispatch = num_workers, dispatch
        self._pin = pin_memory and not platforms.is_host(self._layout.device)
        self._epoch, self._done = 0, 0
        self._fresh, self._resumed, self._finished = True, False, False
        self._last: BatchInfo | None = None
        self._padding = 0
        if mode == "uneven":
            self._warn_uneven_counts()

    def _warn_uneven_counts(self) -> None:
        """`even_batches=False` where the data ranks get different numbers of batches: a collective per batch
        (a sharded step, `gather_for_metrics`) waits forever on the ranks that have one more. Said once, on global
        rank 0 (every rank computes the same counts: no collective here)."""
        n, lay = self._num_samples(), self._layout
        first = not dist.is_initialized() or dist.get_rank() == 0  # once per job (not per tp, cp or pp rank)
        if n is None or lay.data_size == 1 or not first:
            return
        counts = [
            batches_per_rank(n, self._per_rank, lay.data_size, r, last_batch="uneven")
            for r in range(lay.data_size)
        ]
        if len(set(counts)) == 1:
            return
        fewer = [r for r, c in enumerate(counts) if c < max(counts)]
        warnings.warn(
            f"DataLoader(even_batches=False): the data ranks get different numbers of batches per epoch "
            f"({max(counts)}, but {min(counts)} on data rank{'s' if len(fewer) > 1 else ''} "
            f"{', '.join(map(str, fewer[:8]))}{', ...' if len(fewer) > 8 else ''}). A collective in each "
            "iteration (a sharded step, gather_for_metrics) then waits forever for the ranks with no batch left. "
            "Keep even_batches=True (the default: the last batch is padded by wrap-around, which "
            "gather_for_metrics drops) unless each rank's loop runs no collective",
            stacklevel=4,  # the user's DataLoader(...) (through the type-checking wrapper)
        )

    # ---- shape of an epoch ---------------------------------------------------------------------------------
    @property
    def dataset(self) -> Any:
        return self._dataset

    @property
    def batch_size(self) -> int:
        """Samples per batch on each rank."""
        return self._per_rank

    @property
    def global_batch_size(self) -> int:
        """Samples per batch over all data-parallel ranks."""
        return self._per_rank * self._layout.data_size

    @property
    def layout(self) -> DataLayout:
        """The data shards: `data_size`, this process's `data_rank`, its `device`."""
        return self._layout

    @property
    def epoch(self) -> int:
        return self._epoch

    def __len__(self) -> int:
        """Batches this rank reads per epoch."""
        n = self._num_samples()
        if n is None:
            raise TypeError(f"DataLoader: the iterable dataset {type(self._dataset).__name__} has no len()")
        lay = self._layout
        return batches_per_rank(
            n,
            self._per_rank,
            lay.data_size,
            lay.data_rank,
            last_batch=self._mode,
        )

    @property
    def last_batch_mode(self) -> str:
        """What the last global batch of an epoch becomes: `"pad"`, `"short"`, `"drop"` (the `last_batch=`
        argument), or `"uneven"` (`even_batches=False`)."""
        return self._mode

    # ---- padding, for gather_for_metrics -------------------------------------------------------------------
    @property
    def last_batch(self) -> BatchInfo | None:
        """`BatchInfo(step, padding, sizes)` of the batch yielded last (None before the first). (The
        constructor's `last_batch=` mode is `last_batch_mode`.)"""
        return self._last

    @property
    def batch_padding(self) -> int:
        """How many samples of the batch yielded last, over all ranks, are wrap-around padding."""
        return self._last.padding if self._last is not None else 0

    @property
    def padding(self) -> int:
        """How many samples of this epoch, over all ranks, are wrap-around padding (for an iterable dataset
        without len(): of the batches yielded so far)."""
        n = self._num_samples()
        if n is None or self._mode != "pad":
            return self._padding
        return -n % self.global_batch_size

    # ---- epochs and iteration ------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Make the next `for` loop read epoch `epoch` (from its start, unless resuming into that epoch)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"DataLoader.set_epoch: epoch={epoch!r} must be an int >= 0")
        if not (self._resumed and epoch == self._epoch):
            self._done, self._finished = 0, False
        self._epoch, self._fresh = epoch, True

    def __iter__(self) -> Iterator[Any]:
        if not self._fresh or self._finished:
            self._epoch, self._done, self._finished = self._epoch + 1, 0, False
        self._fresh = self._resumed = False
        self._last, self._padding = None, 0
        return self._run()

    def _run(self) -> Iterator[Any]:
        lay = self._layout
        dispatching = self._dispatch and lay.world_size > 1
        spec = EpochSpec(
            self._per_rank, lay.data_size, None if dispatching else lay.data_rank, self._epoch, self._done,
            self._shuffle, self._seed, self._mode,
        )  # fmt: skip
        source: Iterable[tuple[Any, BatchInfo]]
        if dispatching:
            source = self._receive(spec)
        else:
            source = self._read(spec)
        for batch, info in source:
            self._done, self._last = self._done + 1, info
            self._padding += info.padding
            yield self._place(batch)
        self._finished = True

    def _read(self, spec: EpochSpec) -> Iterable[tuple[Any, BatchInfo]]:
        batches = EpochBatches(self._dataset, spec, self._collate, self._is_map)
        if self._num_workers == 0:
            return batches
        return tud.DataLoader(batches, batch_size=None, num_workers=self._num_workers, collate_fn=keep)

    def _receive(self, spec: EpochSpec) -> Iterator[tuple[Any, BatchInfo]]:
        """Rank 0 reads every rank's batch and scatters them; each message says whether it is the last."""
        lay, me = self._layout, dist.get_rank()
        nothing: tuple[Any, Any] = (None, None)
        upcoming = iter(self._read(spec)) if me == 0 else iter(())
        current = next(upcoming, nothing)
        while True:
            box: list[Any] = [None]
            if me == 0:
                after = next(upcoming, nothing) if current is not nothing else nothing
                batches, info = current
                last = after is nothing
                messages = [
                    (batches[lay.data_rank_of[g]] if batches is not None else None, info, last)
                    for g in range(lay.world_size)
                ]
                dist.scatter_object_list(box, messages, src=0)
                current = after
            else:
                dist.scatter_object_list(box, None, src=0)
            batch, info, last = box[0]
            if batch is not None:
                yield batch, info
            if last:
                return

    def _place(self, batch: Any) -> Any:
        device = self._layout.device
        if platforms.is_host(device):
            return batch

        def move(x: Any) -> Any:
            if isinstance(x, Mapping) and not isinstance(
                x, dict
            ):  # a pytree leaf: Hugging Face's BatchEncoding
                moved = {k: _tree.map(move, v) for k, v in x.items()}
                kind: Any = type(x)
                try:
                    return kind(moved)  # the collator's type, as Accelerate's send_to_device keeps it
                except Exception:
                    return moved
            if not isinstance(x, torch.Tensor):
                return x
            if self._pin:
                try:
                    x = x.pin_memory()
                except RuntimeError:  # no pinned memory here (e.g. a CPU-only torch build)
                    self._pin = False
            return x.to(device, non_blocking=self._pin)

        return _tree.map(move, batch)

    # ---- resuming ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position to resume from, as JSON-able data (the same on every rank).

        Example:
            >>> import accelfn as af
            >>> loader = af.data.DataLoader(range(8), batch_size=2)
            >>> it = iter(loader); _ = next(it)
            >>> state = loader.state_dict()
            >>> state["epoch"], state["batches_done"]
            (0, 1)
            >>> again = af.data.DataLoader(range(8), batch_size=2)
            >>> again.load_state_dict(state)
            >>> [b.tolist() for b in again]
            [[2, 3], [4, 5], [6, 7]]
        """
        epoch, done = (self._epoch + 1, 0) if self._finished else (self._epoch, self._done)
        return {
            "version": STATE_VERSION,
            "epoch": epoch,
            "batches_done": done,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "global_batch_size": self.global_batch_size,
            "data_size": self._layout.data_size,
            "num_samples": self._num_samples(),
            "last_batch": self._mode,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at `state` (from `state_dict()`): the next `for` loop yields the rest of its epoch.

        The seed, shuffling, global batch size, dataset length and `last_batch` mode must match; the number
        of data-parallel ranks may differ when the global batch size is the same.
        """
        self.check_state_dict(state)
        self._epoch, self._done = int(state["epoch"]), int(state["batches_done"])
        self._fresh, self._resumed, self._finished = True, True, False
        self._last, self._padding = None, 0

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Raise `ValueError` naming the key where this loader cannot resume at `state`; change nothing
        (`af.checkpoint.load(..., loader=)` checks before it writes any weights)."""
        missing = [
            k
            for k in ("version", "epoch", "batches_done", "seed", "shuffle", "global_batch_size")
            if k not in state
        ]
        if missing:
            raise ValueError(
                f"DataLoader.load_state_dict: the state has no {', '.join(missing)} (got keys {sorted(state)})"
            )
        if state["version"] != STATE_VERSION:
            raise ValueError(
                f"DataLoader.load_state_dict: state version {state['version']!r} is not {STATE_VERSION}"
            )
        mine = self.state_dict()
        for key in ("seed", "shuffle", "global_batch_size", "num_samples", "last_batch"):
            if key in state and state[key] != mine[key]:
                raise ValueError(
                    f"DataLoader.load_state_dict: the state has {key}={state[key]!r} but this loader has "
                    f"{key}={mine[key]!r}; resuming needs the same {key} to yield the same batches"
                )

    def _num_samples(self) -> int | None:
        if self._is_map:
            return len(self._dataset)
        try:
            return len(self._dataset)
        except TypeError:
            return None

    def __repr__(self) -> str:
        lay = self._layout
        return (
            f"DataLoader({type(self._dataset).__name__}, batch_size={self._per_rank} per rank, "
            f"data rank {lay.data_rank}/{lay.data_size}, last_batch={self._mode!r}, epoch {self._epoch})"
        )


class _Columns(tud.Dataset[dict[str, Any]]):
    """A dict of equally long tensors as a dataset of dicts (row `i` of every column)."""

    def __init__(self, columns: Mapping[str, torch.Tensor]) -> None:
        self.columns = dict(columns)
        self.n = len(next(iter(self.columns.values())))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {k: v[i] for k, v in self.columns.items()}


def _as_dataset(dataset: Any) -> tuple[Any, bool]:
    """`(dataset, is_map_style)`; a dict of tensors becomes a dataset of rows."""
    if isinstance(dataset, tud.DataLoader):  # Accelerate's `prepare(loader)` habit: its items are batches
        raise TypeError(
            "DataLoader: got a torch.utils.data.DataLoader, whose items are batches already; give its dataset "
            "and batch size instead: af.data.DataLoader(loader.dataset, batch_size=loader.batch_size, "
            "collate_fn=loader.collate_fn, shuffle=...), which batches, shards by rank and saves its position "
            "itself (a loader built with a batch_sampler: the batch size its sampler gives)"
        )
    if (
        isinstance(dataset, Mapping)
        and dataset
        and all(isinstance(v, torch.Tensor) for v in dataset.values())
    ):
        lengths = {k: (len(v) if v.ndim else None) for k, v in dataset.items()}
        if len(set(lengths.values())) != 1 or None in lengths.values():
            raise ValueError(
                f"DataLoader: a dict-of-tensors dataset needs columns of one length, got {lengths}"
            )
        return _Columns(dataset), True
    if isinstance(dataset, Mapping):  # e.g. a dict of lists, or a tokenizer's BatchEncoding of lists
        kinds = {k: type(v).__name__ for k, v in dataset.items()}
        raise TypeError(
            f"DataLoader: a dict is read as columns only when every value is a tensor of one length; got {kinds}. "
            "Convert the columns with torch.tensor(...) (a tokenizer: return_tensors='pt'), or pass a map-style "
            "dataset of rows"
        )
    if isinstance(dataset, tud.IterableDataset):
        return dataset, False
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        return dataset, True
    if isinstance(dataset, Iterable):
        return dataset, False
    raise TypeError(
        f"DataLoader: dataset must be map-style (len() and [i]), a dict of tensors, or an iterable; "
        f"got {type(dataset).__name__}"
    )
