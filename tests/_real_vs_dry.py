"""Comparing a dry run with a real run (tests/workers/dry_run_worker.py, dry_run_script_worker.py) rank by rank:
the collectives per process group, as gloo counted them on the real run (tests/workers/gloo_counts.py, an
instrument independent of the dry run's tracker), and the bytes by category.

    real = read_rank(out_dir, r)          # the real run's report (our tracker) and gloo's counts, rank r
    assert groups_of(dry, "dp=2,tp=2", r) == real.gloo
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple


class RealRank(NamedTuple):
    report: dict[str, Any]  # the dry run's report, measured on the real run's tensors
    gloo: dict[tuple[int, ...], int]  # collectives per process group (its global ranks), counted by gloo
    # the storages the tracker saw freed on another thread than the main one ({"frees", "bytes"}): gloo's worker
    # dropping a collective's tensors at a point of the step that varies from run to run; none is expected
    off_thread: dict[str, int]


def read_rank(out: Path, rank: int) -> RealRank:
    """What the worker wrote for `rank`; fails if the tracker saw a storage freed on another thread (its free
    landed at a point of the step that varies from run to run, so its figures may not repeat)."""
    report = json.loads((out / f"rank{rank}.json").read_text())
    gloo = {tuple(g["ranks"]): g["count"] for g in json.loads((out / f"rank{rank}.gloo.json").read_text())}
    off_thread = json.loads((out / f"rank{rank}.threads.json").read_text())
    assert off_thread == {"frees": 0, "bytes": 0}, (
        f"rank {rank}: the tracker saw frees on another thread: {off_thread}"
    )
    return RealRank(report, gloo, off_thread)


def mesh_shape(mesh: str) -> dict[str, int]:
    """`"dp=2,tp=2"` -> `{"dp": 2, "tp": 2}`."""
    return {k: int(v) for k, v in (part.split("=") for part in mesh.split(","))}


def axis_ranks(mesh: str, axis: str, rank: int) -> tuple[int, ...]:
    """The global ranks of `rank`'s group over `axis` (one mesh axis, or several joined by "x" as the report
    names a flattened group: "dpxtp"), the mesh laid out row-major as torch's DeviceMesh does."""
    shape = mesh_shape(mesh)
    names, sizes = list(shape), list(shape.values())
    over = axis.split("x")
    unknown = [a for a in over if a not in shape]
    if unknown:
        raise KeyError(f"the report's axis {axis!r} is not made of the mesh's axes {names}")
    coords = list(itertools.product(*(range(n) for n in sizes)))  # coords[r]: rank r's place in the mesh
    mine = coords[rank]
    keep = [i for i, name in enumerate(names) if name not in over]
    return tuple(r for r, c in enumerate(coords) if all(c[i] == mine[i] for i in keep))


def groups_of(report: Mapping[str, Any], mesh: str, rank: int) -> dict[tuple[int, ...], int]:
    """A report's collectives (every kind) summed per process group, the group named by its global ranks."""
    out: dict[tuple[int, ...], int] = {}
    for by_axis in report["comm"].values():
        for axis, row in by_axis.items():
            ranks = axis_ranks(mesh, axis, rank)
            out[ranks] = out.get(ranks, 0) + row["count"]
    return out


def counts(report: Mapping[str, Any]) -> dict[tuple[str, str], tuple[int, int]]:
    """(kind, axis) -> (count, bus bytes) of a report."""
    return {(k, a): (v["count"], v["bus_bytes"]) for k, by in report["comm"].items() for a, v in by.items()}


def over_count(dry: Mapping[str, Any], real: Mapping[str, Any]) -> dict[str, int]:
    """The dry run's bytes minus the real run's, per category (those that differ)."""
    return {
        k: dry["per_rank"][k] - real["per_rank"][k]
        for k in real["per_rank"]
        if dry["per_rank"][k] != real["per_rank"][k]
    }
