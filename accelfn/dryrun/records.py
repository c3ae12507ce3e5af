"""What a dry run records of the training calls it measures (`Measured`, one per call; `StepRecord`, one per
step object), and the readings of a state and a batch they are made from.

Example:
    >>> import torch
    >>> from accelfn.dryrun.records import _rows
    >>> _rows(torch.zeros(4, 16, dtype=torch.long))  # (rows, tokens)
    (4, 64)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import attrs
import torch

from .. import tree as _tree
from ..dtensor import local_tensor


@attrs.define
class Measured:
    """One measured training call."""

    peak: int
    at_peak: dict[str, int]
    own_peak: dict[str, int]
    by_module: dict[str, int]
    params: int
    buffers: int
    optimizer: int
    grads: int
    comm: dict[tuple[str, str], dict[str, int]]
    flops: int
    rows: int | None
    tokens: int | None
    # bytes (by category) of the other step objects' states alive beside this call: they share the memory
    others: dict[str, int] = attrs.Factory(dict)
    host: int = 0  # host memory the call holds at its peak (af.offload's state and buffers), not the device's
    # the kernels (timing.OpCost) and collectives (tracker.Collective) in the order they ran: the time model's
    timeline: list[Any] = attrs.Factory(list)
    fp8_flops: int = 0  # of `flops`, those of ops with fp8 operands (fp8 matmuls)
    trace: Any = None  # the call's allocations for the caching allocator's replay (allocator.Trace)

    @property
    def total_peak(self) -> int:
        return self.peak + sum(self.others.values())


@attrs.define(eq=False)
class StepRecord:
    """A step object the script called: its measured calls, and the storages its latest state holds."""

    index: int  # 1, 2, ...: the order of the step objects' first calls
    ref: Callable[[], Any]  # the step object (a weak reference where it takes one)
    name: str = ""
    dtype: torch.dtype = torch.float32
    microbatches: int = 1
    measured: list[Measured] = attrs.Factory(list)
    calls: int = 0
    skipped: int = 0
    repeated: int = 0  # calls in a row after its measured ones, skipped to find the loop's other step objects
    held: Any = None  # its latest state, held for the micro-batch search (only when there is one)
    # the state its latest call returned, while the script holds it
    state_ref: Callable[[], Any] = lambda: None
    batch: Any = None  # the latest measured call's batch (for the micro-batch search)
    rest: tuple[Any, ...] = ()  # its latest call's outputs after the state (a skipped call returns them)
    # its latest state's storages: (weakref to a storage, key, bytes, category)
    resident: list[tuple[Any, int, int, str]] = attrs.Factory(list)
    own: set[int] = attrs.Factory(set)  # the keys of the storages of its states


def _weak(x: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(x)
    except TypeError:  # pragma: no cover - an object without weak references: held
        return lambda: x


def _storages(state: Any) -> list[tuple[Any, int, int, str]]:
    """(weakref to the storage, key, bytes, category) of each local storage of a TrainState's params, buffers
    and optimizer state, each storage once."""
    out: list[tuple[Any, int, int, str]] = []
    keys: set[int] = set()
    for category, tree in (
        ("params", state.params),
        ("buffers", state.buffers),
        ("optimizer", state.opt_state),
    ):
        for t in _locals(tree):
            if t.device.type == "meta":
                continue
            try:
                st = t.untyped_storage()
                ref = weakref.ref(st)
            except Exception:  # noqa: BLE001 - storage-less tensors, storages without weak references
                continue
            if st._cdata not in keys:
                keys.add(st._cdata)
                out.append((ref, st._cdata, st.nbytes(), category))
    return out


def _uneven_dims(params: Any) -> set[str]:
    """Mesh dimension names along which some DTensor of `params` is sharded unevenly (ranks hold different
    sizes)."""
    out: set[str] = set()
    for p in _tree.leaves(params):
        placements = getattr(p, "placements", None)
        mesh = getattr(p, "device_mesh", None)
        if placements is None or mesh is None or not mesh.mesh_dim_names:
            continue
        for i, pl in enumerate(placements):
            if pl.is_shard() and p.shape[pl.dim] % mesh.size(i):
                out.add(mesh.mesh_dim_names[i])
    return out


def _locals(tree: Any) -> list[torch.Tensor]:
    return [local_tensor(x) for x in _tree.leaves(tree) if isinstance(x, torch.Tensor)]


def _rows(batch: Any) -> tuple[int | None, int | None]:
    from ..meter import _batch_size

    tokens, rows = _batch_size(batch, None)
    return rows, tokens


def _offloads(step: Any) -> bool:
    """Whether `step` keeps its optimizer state in host memory (af.offload)."""
    from ..transforms.host_update import HostUpdater

    return isinstance(getattr(step.plan, "updater", None), HostUpdater)


def _module_tracker() -> Any:
    """A torch ModTracker with `.current()` naming the innermost module running (None if unavailable)."""
    try:
        from torch.distributed._tools.mod_tracker import ModTracker
    except ImportError:  # pragma: no cover - older torch
        return None

    class Named(ModTracker):  # type: ignore[misc]
        def current(self) -> str:
            parents = [p for p in self.parents if p != "Global"]
            return max(parents, key=lambda p: p.count(".")) if parents else ""

    return Named()
