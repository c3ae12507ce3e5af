"""The dry run's searches: the largest micro-batch that fits (a secant search on the measured peak) and the
ranks `rank="worst"` runs (one per class of ranks the lowering treats apart).

Example:
    >>> from accelfn.dryrun.search import rank_candidates
    >>> rank_candidates({"pp": 2, "dp": 4}, set(), 8)  # both pipeline stages, the middle and last rank
    [0, 4, 7]
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch

from .. import tree as _tree
from .records import Measured, StepRecord


def _scaled(batch: Any, rows: int, new_rows: int) -> Any:
    """`batch` with every leaf of `rows` rows made `new_rows` long (fake values)."""

    def scale(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.ndim > 0 and x.shape[0] == rows:
            return x.new_zeros((new_rows, *x.shape[1:]))
        return x

    return _tree.map(scale, batch)


def largest_micro_batch(
    runs: list[tuple[StepRecord, Any, Any, Any]],
    micro_batch: int,
    capacity: int,
    measure: Callable[[Any, Any, Any, Callable[[], Any]], tuple[Measured, Any]],
    others: Callable[[StepRecord], dict[str, int]],
) -> int | None:
    """The largest per-rank micro-batch that fits in `capacity` bytes, in rows of the step object with the
    largest peak (now `micro_batch` rows) of `runs` (the loop's (record, step, state, batch); the others'
    batches scaled alike), each probe a `measure(step, state, batch, call)` of every one, counting the `others`
    states alive beside each. The peak is close to linear in the rows: each probe is the secant through the
    last two measurements, kept strictly between the largest size known to fit and the smallest known not to,
    until they are adjacent (2-4 extra steps in practice; at most 10)."""
    from ..engine import run_train

    def peak_at(size: int) -> int:
        worst = 0
        for rec, step, st, b in runs:
            rows = rec.measured[-1].rows
            assert rows
            new_rows = max(1, round(rows * size / micro_batch / rec.microbatches)) * rec.microbatches
            scaled = _scaled(b, rows, new_rows)
            call = functools.partial(run_train, step.plan, st, scaled)
            m, _ = measure(step, st, scaled, call)
            worst = max(worst, m.peak + sum(others(rec).values()))
        return worst

    start = max(r[0].measured[-1].peak + sum(others(r[0]).values()) for r in runs)
    points = [(micro_batch, start)]  # (micro-batch rows, peak)
    lo, hi = 0, None  # the largest size known to fit, the smallest known not to
    probe = 2 * micro_batch
    for _ in range(10):
        points.append((probe, peak_at(probe)))
        for size, p in points[-2:]:
            if p <= capacity:
                lo = max(lo, size)
            elif hi is None or size < hi:
                hi = size
        if hi is not None and hi - lo <= 1:
            break
        (r1, p1), (r2, p2) = sorted(points[-2:])
        slope = (p2 - p1) / (r2 - r1) if r2 != r1 and p2 > p1 else max(1.0, p2 / max(r2, 1))
        guess = int(r2 + (capacity - p2) / slope)
        probe = max(guess, lo + 1) if hi is None else min(max(guess, lo + 1), hi - 1)
        if probe > 1 << 20:  # fits at any sensible size
            return probe
    return lo or None


def rank_candidates(shape: dict[str, int], uneven: set[str], world: int) -> list[int]:
    """The ranks `rank="worst"` runs: 0, the middle one and the last (ranks a script may treat apart), and one
    rank per class of ranks the lowering treats apart: every coordinate along `pp` (each pipeline stage holds
    other layers), the first and the last along each axis in `uneven` (mesh dimension names along which
    shards are uneven; a flattened `dp_fsdp` names both), combined. Ranks are laid out row-major over `shape`.

    Example:
        >>> rank_candidates({"pp": 4, "dp": 2}, set(), 8)
        [0, 2, 4, 6, 7]
        >>> rank_candidates({"dp": 8, "tp": 4}, {"dp"}, 32)
        [0, 16, 28, 31]
    """
    base = {0, world // 2, world - 1}
    size = 1
    for n in shape.values():
        size *= n
    if size != world:  # not a mesh over the whole world (or none): the three
        return sorted(base)
    axes = set()
    for name in uneven:
        axes |= {name} if name in shape else {a for a in name.split("_") if a in shape}
    coords = [
        range(n) if axis == "pp" else ((0, n - 1) if axis in axes and n > 1 else (0,))
        for axis, n in shape.items()
    ]
    strides = [1] * len(shape)
    sizes = list(shape.values())
    for i in range(len(sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * sizes[i + 1]
    for combo in itertools.product(*coords):
        base.add(sum(c * st for c, st in zip(combo, strides)))
    return sorted(base)
