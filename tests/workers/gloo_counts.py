"""Count a real run's collectives with an instrument independent of the dry run's tracker: gloo's own sequence
number of each process group (the backend increments it once per collective or point-to-point call it runs,
whatever path reached it: torch.distributed's functions, functional collectives, DTensor, FSDP2, C++ hooks).

    with counting_first_call() as counts:   # before and after the first call of a training step
        measure_real(script, args)
    counts  # [{"ranks": [0, 1], "count": 7}, ...] for each group used by the step
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

import accelfn as af


def _numbers() -> dict[tuple[int, ...], int]:
    """The sequence number of each process group this rank belongs to, keyed by its (global) ranks."""
    from torch.distributed.distributed_c10d import _world

    out: dict[tuple[int, ...], int] = {}
    for pg, ranks in _world.pg_group_ranks.items():
        if not isinstance(pg, dist.ProcessGroup):  # a group this rank is not in
            continue
        key = tuple(sorted(ranks))
        out[key] = out.get(key, 0) + pg._get_sequence_number_for_group()
    return out


@contextlib.contextmanager
def counting_first_call() -> Iterator[list[dict[str, Any]]]:
    """Within the block, the collectives each process group ran during the first call of a training step
    (`af.Step.__call__`), appended to the yielded list when that call returns."""
    counts: list[dict[str, Any]] = []
    original = af.Step.__call__
    calls = 0

    def counted(self: af.Step, state: Any, batch: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > 1 or self.kind == "eval":
            return original(self, state, batch)
        before = _numbers() if dist.is_initialized() else {}
        out = original(self, state, batch)
        after = _numbers()
        for ranks, n in sorted(after.items()):
            if n - before.get(ranks, 0):
                counts.append({"ranks": list(ranks), "count": n - before.get(ranks, 0)})
        return out

    af.Step.__call__ = counted  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        af.Step.__call__ = original  # type: ignore[method-assign]
