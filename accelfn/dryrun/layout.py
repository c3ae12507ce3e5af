"""Where a dry run's collectives run: the current mesh's shape and the axes each process group spans, whether a
group stays within a node, and a call's collectives by kind and mesh axis with their bus bytes.

Example:
    >>> from accelfn.dryrun.layout import _intra_node
    >>> shape = {"dp": 8, "tp": 8}  # row-major: tp's 8 ranks are adjacent
    >>> _intra_node(("tp",), shape, 8), _intra_node(("dp",), shape, 8)
    (True, False)
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch.distributed as dist


def _axes_of_groups() -> dict[str, tuple[str, ...]]:
    """Process group name -> the mesh axes it spans (the world group -> every axis)."""
    from .. import mesh as _mesh

    out: dict[str, tuple[str, ...]] = {}
    m = _mesh._current
    if m is None or m._mesh is None:
        return out
    names = tuple(m.shape)
    if dist.is_initialized():
        out[dist.group.WORLD.group_name] = names  # type: ignore[union-attr]
    for axis in names:
        with contextlib.suppress(Exception):
            out[m._mesh.get_group(axis).group_name] = (axis,)
    for axes, sub in m._flat.items():
        with contextlib.suppress(Exception):
            out[sub.get_group().group_name] = tuple(axes)
    return out


def _layout() -> tuple[dict[str, int], dict[str, tuple[str, ...]], int] | None:
    """The current mesh's shape, its process groups' axes and its data-parallel size (None without one)."""
    from .. import mesh as _mesh

    m = _mesh._current
    if m is None or m._mesh is None:
        return None
    return dict(m.shape), _axes_of_groups(), m.data_size


def _intra_node(axes: tuple[str, ...], shape: dict[str, int], nproc_per_node: int) -> bool:
    """Whether a group over `axes` of a row-major mesh stays within one node of `nproc_per_node` ranks."""
    names = list(shape)
    span = 1
    for a in axes:
        if a not in shape:
            return False
        stride = 1
        for b in names[names.index(a) + 1 :]:
            stride *= shape[b]
        span += (shape[a] - 1) * stride
    return span <= nproc_per_node


def _axes_comm(
    comm: dict[tuple[str, str], dict[str, int]],
    groups: dict[str, tuple[str, ...]],
    shape: dict[str, int],
    nproc_per_node: int,
    into: dict[str, dict[str, dict[str, Any]]] | None = None,
    times: int = 1,
) -> dict[str, dict[str, dict[str, Any]]]:
    """A call's collectives by (kind, process group) as the report's {kind: {axis: row}}, `times` over, added
    to `into`."""
    out = into if into is not None else {}
    for (kind, group), row in comm.items():
        axes = groups.get(group, (group,))
        slot = out.setdefault(kind, {}).setdefault(
            "x".join(axes), {"count": 0, "bytes": 0, "bus_bytes": 0, "group_size": row["size"]}
        )
        slot["count"] += row["count"] * times
        slot["bytes"] += row["bytes"] * times
        slot["bus_bytes"] += row["bus_bytes"] * times
        slot["intra_node"] = _intra_node(axes, shape, nproc_per_node)
    return out


def _bus(comm: dict[str, dict[str, dict[str, Any]]]) -> int:
    return sum(r["bus_bytes"] for by in comm.values() for r in by.values())
