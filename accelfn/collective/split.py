"""`split_between_processes`: give each rank its contiguous share of a list, tuple, tensor or dict of them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ._runtime import rank, world_size

__all__ = ["split_between_processes", "share"]


def share(n: int, ranks: int, r: int) -> tuple[int, int]:
    """`(start, stop)` of rank `r`'s share of `n` items: the first `n % ranks` ranks get one more.

    Example:
        >>> [share(17, 2, r) for r in range(2)]
        [(0, 9), (9, 17)]
    """
    base, extra = divmod(n, ranks)
    start = r * base + min(r, extra)
    return start, start + base + (1 if r < extra else 0)


@contextlib.contextmanager
def split_between_processes(inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
    """Yield this rank's contiguous share of `inputs` (rank 0 first, the first ranks one item more).

    `inputs` is a list, tuple, tensor (split along dim 0), any sliceable sequence, or a dict whose values
    are those (all of one length). With `apply_padding=True` every rank gets the same number of items,
    the short ones repeating their last item (or the input's last item when their share is empty),
    so that results can be gathered; drop the padding afterwards.

    Example:
        >>> import accelfn as af
        >>> with af.dist.split_between_processes(["a", "b", "c"]) as mine:   # world of one: everything
        ...     mine
        ['a', 'b', 'c']
    """
    n_ranks, r = world_size(), rank()
    if isinstance(inputs, Mapping):
        lengths = {k: _length(v, str(k)) for k, v in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"af.dist.split_between_processes: the dict's values must all have the same length, got {lengths}"
            )
        yield {k: _part(v, n_ranks, r, apply_padding, str(k)) for k, v in inputs.items()}
    else:
        yield _part(inputs, n_ranks, r, apply_padding, None)


def _length(seq: Any, key: str | None) -> int:
    try:
        return len(seq)
    except TypeError:
        where = f" (dict key {key!r})" if key is not None else ""
        raise TypeError(
            f"af.dist.split_between_processes: cannot split a {type(seq).__name__}{where}; pass a list, tuple, "
            "tensor, sliceable sequence, or a dict of those"
        ) from None


def _part(seq: Any, n_ranks: int, r: int, pad: bool, key: str | None) -> Any:
    n = _length(seq, key)
    if pad and not isinstance(seq, torch.Tensor | list | tuple):  # on every rank, whatever the length
        raise TypeError(
            f"af.dist.split_between_processes: apply_padding=True supports lists, tuples and tensors, "
            f"not {type(seq).__name__}"
        )
    start, stop = share(n, n_ranks, r)
    part = seq[start:stop]
    want = -(-n // n_ranks)
    if not pad or stop - start == want or n == 0:
        return part
    missing = want - (stop - start)
    last = seq[stop - 1 : stop] if stop > start else seq[n - 1 : n]
    if isinstance(seq, torch.Tensor):
        return torch.cat([part, last.expand(missing, *last.shape[1:])])
    return part + type(seq)(last) * missing
