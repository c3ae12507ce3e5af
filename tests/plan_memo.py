"""Dry runs shared between the planner tests' fixtures.

A plan and its exhaustive twin (`prune=False`) dry-run many of the same candidates, and several test files plan
the same tiny scripts over the same meshes. Inside `shared_dry_runs()`, a `search.Pool` job that ran once in this
pytest process is answered with a copy of its result: a dry run of the same `Job` (script, args, world, mesh,
knobs' env, device row) is deterministic, only its `wall_s` differs. The plans' own counts (`dry_runs`, the tiers'
falls) are those of fresh runs: the planner sees a result, as from a run. Not for tests of the planner's wall
time or budget.

Example:
    >>> with shared_dry_runs():  # doctest: +SKIP
    ...     pruned, exhaustive = af.plan(SCRIPT, ARGS), af.plan(SCRIPT, ARGS, prune=False)
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest

from accelfn.planner import search

_RESULTS: dict[search.Job, dict[str, Any]] = {}


@contextlib.contextmanager
def shared_dry_runs() -> Iterator[None]:
    real_map, real_run = search.Pool.map, search.Pool.run

    def run(self: search.Pool, job: search.Job) -> dict[str, Any]:
        if job not in _RESULTS:
            _RESULTS[job] = real_run(self, job)
        return copy.deepcopy(_RESULTS[job])

    def map(self: search.Pool, jobs: Any, *, skip: Any = None, **kw: Any) -> Iterator[Any]:
        verdicts: set[search.Job] = set()  # the jobs the planner's own `skip` answered: not runs

        def known(job: search.Job) -> dict[str, Any] | None:
            verdict = skip(job) if skip is not None else None  # the planner's verdict first, as without this
            if verdict is not None:
                verdicts.add(job)
                return verdict
            return copy.deepcopy(_RESULTS[job]) if job in _RESULTS else None

        for job, result in real_map(self, jobs, skip=known, **kw):
            if result is not None and job not in verdicts and job not in _RESULTS:
                _RESULTS[job] = copy.deepcopy(result)
            yield job, result

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(search.Pool, "map", map)
        mp.setattr(search.Pool, "run", run)
        yield
