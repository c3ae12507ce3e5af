"""`Mesh`: the processes of a job as named axes (`dp`, `fsdp`, `tp`, ...) over torch's `DeviceMesh`.

The mesh is accelfn's only source of ranks and axes. Making one starts the process group (with the
platform's backend) if it is not running yet: from the launcher's environment (`RANK`, `WORLD_SIZE`,
`MASTER_ADDR`, ... as set by `torch.distributed.run` / `accelfn launch`), or as a world of one process.

Example:
    >>> import accelfn as af
    >>> with af.Mesh.from_env() as mesh:          # not launched: a world of one process
    ...     mesh.axis_names, mesh.world_size, mesh.is_main, mesh.device_type
    (('dp',), 1, True, 'cpu')
"""

from __future__ import annotations

import atexit
import gc
import math
import os
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import dry_mode, platforms
from ._typecheck import checked
from .launch_env import ACCELFN_MESH, parse_mesh
from .platforms import Platform

__all__ = [
    "Mesh",
    "MeshAxisError",
    "MESH_ENV",
    "DATA_AXES",
    "GRAD_AXES",
    "parse_axes",
    "init_process_group",
    "destroy_process_group",
]

MESH_ENV = ACCELFN_MESH
"""Environment variable with the mesh shape set by `accelfn launch --mesh`, e.g. `dp=2,tp=1`."""

DATA_AXES: tuple[str, ...] = ("dp", "dp_replicate", "dp_shard", "fsdp", "ep")
"""Axis names over which the batch is split (data-parallel axes), in mesh order. `ep` (expert parallel) is one:
its ranks read their own rows and are data-parallel for the dense layers (torchtitan's borrowed ranks)."""

GRAD_AXES: tuple[str, ...] = (*DATA_AXES, "cp")
"""Axis names over which gradients are summed: the data axes and `cp` (context-parallel ranks read the same
rows but hold different tokens of them, so each has a part of every gradient)."""

_current: Mesh | None = None
_live: weakref.WeakSet[Mesh] = weakref.WeakSet()


class MeshAxisError(KeyError):
    """An axis name the mesh does not have."""

    def __str__(self) -> str:
        return str(self.args[0])


_atexit_registered = False
_control: Any = None  # the gloo group of `control_group()`


def parse_axes(text: str) -> dict[str, int]:
    """Parse `"dp=2,tp=1"` (the `ACCELFN_MESH` format) into `{"dp": 2, "tp": 1}`.

    Example:
        >>> parse_axes("dp=-1, tp=2")
        {'dp': -1, 'tp': 2}
    """
    axes = parse_mesh(text)
    if not axes:
        raise ValueError(f"the mesh shape {text!r} names no axes; expected e.g. 'dp=2,tp=1'")
    return axes


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


_generation = 0  # process groups started in this process (a new af.Mesh after close() starts another)


def _init_launched(platform: Platform) -> None:
    """`init_process_group` from the launcher's variables. The first group uses them as torchrun would; a
    later one (a new Mesh after `close()`) gets its own key prefix in the launcher's store, since the keys of
    the destroyed group are still there and would be read as this one's (a hang or a refused connection)."""
    global _generation
    kwargs = platform.process_group_kwargs()
    if _generation == 0:
        dist.init_process_group(**kwargs)
    else:
        store, rank, world_size = next(dist.rendezvous(kwargs.pop("init_method")))
        store = dist.PrefixStore(f"accelfn/generation-{_generation}", store)
        dist.init_process_group(**kwargs, store=store, rank=rank, world_size=world_size)
    _generation += 1


def init_process_group(platform: Platform) -> bool:
    """Start the default process group for `platform` if none is running; return whether it started one.

    Launched (`WORLD_SIZE` set): the launcher's rendezvous variables. Otherwise: a world of one process on
    an in-memory store.
    """
    global _atexit_registered
    if dist.is_initialized():
        return False
    if not dist.is_available():  # pragma: no cover - torch built without distributed
        raise RuntimeError("this torch build has no torch.distributed; accelfn.Mesh needs it")
    local_rank = _env_int("LOCAL_RANK", 0)
    platform.set_device(platform.device(local_rank))
    if "WORLD_SIZE" in os.environ:
        missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing and _env_int("WORLD_SIZE", 1) > 1:
            raise RuntimeError(
                f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but {', '.join(missing)} "
                "is not: start the script with `accelfn launch` (or torch.distributed.run)"
            )
        if not missing:
            _init_launched(platform)
    if not dist.is_initialized():
        dist.init_process_group(platform.backend, store=dist.HashStore(), rank=0, world_size=1)
    if not _atexit_registered:
        atexit.register(destroy_process_group)
        _atexit_registered = True
    return True


def control_group() -> Any:
    """A group over every rank on the host platform's backend, for host-side coordination (checkpoint saves: they
    may run in a background thread, apart from the training's collectives). Made with the first `Mesh` of a
    launched job, because making a group needs every rank: a save called on one rank only then fails with a clear
    error instead of hanging."""
    global _control
    if _control is None:
        _control = dist.new_group(backend=platforms.host().backend)
    return _control


def destroy_process_group() -> None:
    """Tear down the default process group if one is running (a process that exits without it may abort).

    Every open `Mesh` is closed too: a `DeviceMesh` still referring to the group after it is destroyed keeps
    gloo's threads alive until interpreter exit, where they abort the process (seen in 3 of 6 runs).
    """
    global _current, _control
    _current = None
    _control = None
    for mesh in list(_live):
        mesh._mesh = None
        mesh._flat.clear()
    _live.clear()
    running = dist.is_available() and dist.is_initialized()
    if running and dry_mode.keeps_process_group():  # a dry run destroys its fake group itself, later
        return
    # torch's fake process group (dry runs, tests) has no threads to outlive it: no collection needed (a full
    # collection costs ~0.7 s in a large process, per fake world)
    threads = not running or dist.get_backend() != "fake"
    if threads:
        gc.collect()
    if running:
        dist.destroy_process_group()
        if threads:
            gc.collect()


class Mesh:
    """Named axes over all processes of the job, on one device kind.

    `shape` maps axis names to sizes, outermost first; one size may be `-1` for "the rest of the world".
    `device` is a device kind (one of `af.platforms.KINDS`), a `Platform`, or `"auto"`
    (`af.platforms.detect()`, which honours `ACCELFN_DEVICE`).

    Example:
        >>> import accelfn as af
        >>> mesh = af.Mesh({"dp": -1}, device="cpu")
        >>> mesh.axis_size("dp"), mesh.rank, str(mesh.device)
        (1, 0, 'cpu')
        >>> mesh.close()
    """

    @checked
    def __init__(self, shape: Mapping[str, int], *, device: str | Platform = "auto") -> None:
        global _current
        if not shape:
            raise ValueError("a Mesh needs at least one axis, e.g. af.Mesh({'dp': -1})")
        if isinstance(device, Platform):
            self._platform = device
        elif device == "auto":
            self._platform = platforms.detect()
        else:
            self._platform = platforms.get(device)
        started = init_process_group(self._platform)
        try:
            self._shape = _resolve(dict(shape), dist.get_world_size())
        except ValueError:
            if started:  # a refused shape leaves no process group behind (a later Mesh would find it running)
                destroy_process_group()
            raise
        self._local_rank = _env_int("LOCAL_RANK", 0)
        self._device = self._platform.device(self._local_rank)
        with dry_mode.real_tensors():  # its rank map is read on the host (sub-meshes: see accelfn.dryrun)
            self._mesh: DeviceMesh | None = init_device_mesh(
                self._platform.device_type, tuple(self._shape.values()), mesh_dim_names=tuple(self._shape)
            )
        self._flat: dict[tuple[str, ...], DeviceMesh] = {}  # flattened sub-meshes over several axes
        if (
            dist.get_world_size() > 1 and dist.get_backend() != "fake"
        ):  # (torch's fake group for tests: no gloo)
            control_group()
        _live.add(self)
        _current = self

    @classmethod
    def from_env(cls, *, device: str | Platform = "auto", **axes: int) -> Mesh:
        """The mesh of a launched job: `axes` if given, else `$ACCELFN_MESH` (`accelfn launch --mesh`),
        else `{"dp": world_size}`.

        Example:
            >>> import accelfn as af
            >>> with af.Mesh.from_env(dp=-1, tp=1) as mesh:
            ...     dict(mesh.shape)
            {'dp': 1, 'tp': 1}
        """
        if not axes:
            text = os.environ.get(MESH_ENV, "").strip()
            axes = parse_axes(text) if text else {"dp": -1}
        return cls(axes, device=device)

    @staticmethod
    def current() -> Mesh | None:
        """The most recently made mesh that is still open (None if there is none)."""
        return _current

    # ---- teardown ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Destroy the process group, closing every mesh of this process (they share it). Safe to call twice.

        Drop your own references to `torch_mesh` and its groups before, so they can be freed with it.
        """
        destroy_process_group()

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        axes = ", ".join(f"{k}={v}" for k, v in self._shape.items())
        where = (
            f"rank {self.rank}/{self.world_size}"
            if self._mesh is not None and dist.is_initialized()
            else "closed"
        )
        return f"Mesh({axes}; {self._platform.kind}, {where})"

    # ---- properties ----------------------------------------------------------------------------------------
    @property
    def platform(self) -> Platform:
        """The device kind's adapter (`af.platforms.Platform`)."""
        return self._platform

    @property
    def device_type(self) -> str:
        """torch's device type of this mesh, e.g. `"cuda"`."""
        return self._platform.device_type

    @property
    def device(self) -> torch.device:
        """This process's device."""
        return self._device

    @property
    def shape(self) -> Mapping[str, int]:
        """Axis names to sizes (with `-1` resolved), outermost first."""
        return dict(self._shape)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self._shape)

    @property
    def rank(self) -> int:
        """This process's global rank."""
        self._check_open("rank")
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        self._check_open("world_size")
        return dist.get_world_size()

    def _check_open(self, what: str) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                f"{self!r} is closed (Mesh.close(), or the end of its `with af.Mesh(...)` block, destroyed its "
                f"process group): read Mesh.{what} before closing, or make a new af.Mesh"
            )

    @property
    def local_rank(self) -> int:
        """This process's rank within its node (`LOCAL_RANK`)."""
        return self._local_rank

    @property
    def is_main(self) -> bool:
        """Whether this is global rank 0."""
        return self.rank == 0

    @property
    def torch_mesh(self) -> DeviceMesh:
        """The underlying `torch.distributed.device_mesh.DeviceMesh`, with the same axis names."""
        if self._mesh is None:
            raise RuntimeError(f"{self!r} is closed: its process group was destroyed; make a new af.Mesh")
        return self._mesh

    def axis_size(self, name: str) -> int:
        """Size of axis `name`."""
        return self._shape[self._check_axis(name)]

    def axis_rank(self, name: str) -> int:
        """This process's coordinate along axis `name`."""
        return self.torch_mesh.get_local_rank(self._check_axis(name))

    def submesh(self, *names: str) -> DeviceMesh:
        """The `DeviceMesh` over the given axes (this process's slice), e.g. `mesh.submesh("dp")`."""
        if not names:
            raise ValueError(f"submesh() needs axis names; this mesh has {self.axis_names}")
        for n in names:
            self._check_axis(n)
        return self.torch_mesh[names if len(names) > 1 else names[0]]

    def group(self, name: str) -> dist.ProcessGroup:
        """The process group of the processes that share every coordinate but `name` with this one."""
        return self.torch_mesh.get_group(self._check_axis(name))

    # ---- data parallelism ----------------------------------------------------------------------------------
    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes that split the batch (those named in `DATA_AXES`), in mesh order."""
        return tuple(n for n in self._shape if n in DATA_AXES)

    @property
    def data_size(self) -> int:
        """How many shards the global batch is split into (product of the data axes)."""
        return math.prod(self._shape[n] for n in self.data_axes)

    @property
    def data_rank(self) -> int:
        """Which shard of the global batch this process reads (0 <= data_rank < data_size)."""
        return self._index(self.data_axes)

    def data_group(self) -> dist.ProcessGroup | None:
        """The process group over all data axes (the processes that hold replicas of one model shard and
        read different data), or None when the mesh has no data axis. Collective on first use."""
        axes = self.data_axes
        return self._flattened(axes).get_group() if axes else None

    # ---- gradient reduction (data axes + context parallel) -----------------------------------------------------
    @property
    def grad_axes(self) -> tuple[str, ...]:
        """The axes over which gradients are summed (those named in `GRAD_AXES`: the data axes and `cp`)."""
        return tuple(n for n in self._shape if n in GRAD_AXES)

    @property
    def grad_size(self) -> int:
        """How many processes hold a part of each gradient (product of the gradient axes)."""
        return math.prod(self._shape[n] for n in self.grad_axes)

    @property
    def grad_rank(self) -> int:
        """This process's index among the `grad_size` processes (its random stream differs from theirs)."""
        return self._index(self.grad_axes)

    def grad_mesh(self) -> DeviceMesh | None:
        """The 1-D `DeviceMesh` over the gradient axes (flattened when there are several; FSDP shards over it),
        or None when the mesh has none. Collective on first use."""
        axes = self.grad_axes
        return self._flattened(axes) if axes else None

    def grad_group(self) -> dist.ProcessGroup | None:
        """The process group over the gradient axes: the data axes and `cp`. Collective on first use."""
        mesh = self.grad_mesh()
        return mesh.get_group() if mesh is not None else None

    def axes_group(self, axes: tuple[str, ...]) -> dist.ProcessGroup:
        """The process group over `axes` (flattened when there are several). Collective on first use."""
        for n in axes:
            self._check_axis(n)
        return self._flattened(axes).get_group()

    def _index(self, axes: tuple[str, ...]) -> int:
        """This process's coordinate over `axes`, as one index (the first axis outermost)."""
        index = 0
        for n in axes:
            index = index * self._shape[n] + self.axis_rank(n)
        return index

    def _flattened(self, axes: tuple[str, ...]) -> DeviceMesh:
        """The 1-D `DeviceMesh` over `axes` (one axis: its own; several: flattened once, then kept)."""
        if len(axes) == 1:
            return self.submesh(axes[0])
        if axes not in self._flat:
            self._flat[axes] = self.submesh(*axes)._flatten("_".join(axes))
        return self._flat[axes]

    def _check_axis(self, name: str) -> str:
        if name not in self._shape:
            raise MeshAxisError(
                f"this mesh has no axis {name!r}; its axes are {self.axis_names} (shape {self._shape})"
            )
        return name


def _resolve(shape: dict[str, int], world_size: int) -> dict[str, Any]:
    """Replace a `-1` size with the rest of the world and check the product is the world size."""
    for name, size in shape.items():
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise ValueError(
                f"mesh axis {name!r} has size {size!r}; sizes are positive ints, or -1 for the rest"
            )
    rest = [n for n, s in shape.items() if s == -1]
    if len(rest) > 1:
        raise ValueError(f"mesh shape {shape}: only one axis may be -1 (got {', '.join(rest)})")
    known = math.prod(s for s in shape.values() if s != -1)
    if rest:
        if world_size % known:
            raise ValueError(
                f"mesh shape {shape} does not fit the world of {world_size} processes: the other axes "
                f"multiply to {known}, which does not divide {world_size}"
            )
        shape[rest[0]] = world_size // known
    elif known != world_size:
        raise ValueError(
            f"mesh shape {shape} multiplies to {known} but the world has {world_size} processes; "
            f"make the sizes multiply to {world_size}, or set one axis to -1"
        )
    return shape
