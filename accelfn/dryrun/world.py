"""The fake world a dry run's script runs in: torch's fake process group as one rank of the job, the launcher's
variables, every tensor fake; object collectives that hand every rank this rank's object, device meshes built
on real rank maps, fake parameters that `module.to` can swap.

Example:
    >>> import torch, torch.distributed as dist
    >>> from accelfn.dryrun.world import fake_world
    >>> with fake_world(64, 3, 8, None):
    ...     x = torch.ones(2)
    ...     dist.get_rank(), dist.get_world_size(), type(x).__name__
    (3, 64, 'FakeTensor')
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any, overload

import torch
import torch.distributed as dist

from ..launch_env import environ_set
from .tracker import HostReads


@contextlib.contextmanager
def fake_world(world_size: int, rank: int, nproc_per_node: int, mesh: str | None) -> Iterator[HostReads]:
    """Torch's fake process group as rank `rank` of `world_size`, the launcher's variables set, every tensor
    created inside fake (FakeTensorMode)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .. import mesh as _mesh

    if dist.is_initialized():
        raise RuntimeError(
            "af.dry_run: a process group is already running in this process; the dry run starts its own fake "
            "one (run it in a fresh process, or call af.mesh.destroy_process_group() first)"
        )
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % nproc_per_node),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(nproc_per_node),
        "GROUP_RANK": str(rank // nproc_per_node),
        "NODE_RANK": str(rank // nproc_per_node),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
        "ACCELFN_DEVICE": "cpu",
    }
    if mesh:
        env["ACCELFN_MESH"] = mesh
    with environ_set(env):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            with (
                _object_collectives(),
                _real_device_meshes(),
                FakeTensorMode(allow_non_fake_inputs=True) as mode,
                _swappable_fakes(mode),
                _lazy_fsdp_chunks(),
                HostReads(real_bookkeeping=True) as reads,
            ):
                yield reads
        finally:
            _mesh.destroy_process_group()  # the meshes (the group outlives them while the dry run watches)
            if dist.is_initialized():
                dist.destroy_process_group()
            _clear_dtensor_caches()


def _group_size(group: Any) -> int:
    return int(dist.get_world_size(group))


# torch's fake process group moves no bytes, so an object collective would unpickle garbage: in the dry run
# every rank runs the same script, so each one's object stands for all of them
def _all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    object_list[:] = [obj] * _group_size(group)


def _gather_object(
    obj: Any, object_gather_list: list[Any] | None = None, dst: Any = None, group: Any = None, **_: Any
) -> None:
    if object_gather_list is not None:
        object_gather_list[:] = [obj] * _group_size(group)


def _broadcast_object_list(object_list: list[Any], src: Any = None, group: Any = None, **_: Any) -> None:
    return None  # this rank's list stands for the source's


def _scatter_object_list(
    out: list[Any], inputs: list[Any] | None, src: Any = None, group: Any = None, **_: Any
) -> None:
    if inputs:
        out[0] = inputs[dist.get_rank(group) if group is not None else dist.get_rank()]


_OBJECT_COLLECTIVES = {
    "all_gather_object": _all_gather_object,
    "gather_object": _gather_object,
    "broadcast_object_list": _broadcast_object_list,
    "scatter_object_list": _scatter_object_list,
}


@contextlib.contextmanager
def _object_collectives() -> Iterator[None]:
    """Object collectives that hand every rank this rank's object; groups made with an explicit backend (a
    host `gloo` group for bookkeeping) made on the fake one."""
    saved = {name: getattr(dist, name) for name in (*_OBJECT_COLLECTIVES, "new_group")}
    new_group = saved["new_group"]

    def fake_new_group(*args: Any, **kwargs: Any) -> Any:
        args = tuple(None if i in (2, 3) else a for i, a in enumerate(args))  # backend, pg_options
        kwargs.pop("backend", None)
        kwargs.pop("pg_options", None)
        return new_group(*args, **kwargs)

    dist.new_group = fake_new_group
    for name, fn in _OBJECT_COLLECTIVES.items():
        setattr(dist, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


# A DeviceMesh keeps its rank map as a (host) tensor and reads it (`tolist`) to find its coordinates; under the
# fake mode that tensor would be fake. Meshes made inside torch (FSDP over TP concatenates the dp and tp meshes,
# slicing and flattening make sub-meshes) are built with real tensors in the dry run.
_MESH_METHODS = ("__init__", "__getitem__", "_flatten", "_unflatten", "_concatenate")


@contextlib.contextmanager
def _real_device_meshes() -> Iterator[None]:
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    def real(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with unset_fake_temporarily():
                return fn(*args, **kwargs)

        return functools.wraps(fn)(wrapper)

    saved = {name: DeviceMesh.__dict__[name] for name in _MESH_METHODS if name in DeviceMesh.__dict__}
    for name, attr in saved.items():
        if isinstance(attr, staticmethod):
            setattr(DeviceMesh, name, staticmethod(real(attr.__func__)))
        else:
            setattr(DeviceMesh, name, real(attr))
    try:
        yield
    finally:
        for name, attr in saved.items():
            setattr(DeviceMesh, name, attr)


def _clear_dtensor_caches() -> None:
    """DTensor caches sharding and redistribution plans by the mesh's layout, not its process groups: a second fake
    world in the same process (a second dry run, `--rank worst`, the micro-batch search's fresh world) would get
    plans naming the first world's groups."""
    from torch.distributed.tensor import DTensor, _redistribute

    with contextlib.suppress(AttributeError):
        torch._C._clear_DTensor_sharding_propagator_cache()  # the native dispatch's cache
    with contextlib.suppress(AttributeError):
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    with contextlib.suppress(AttributeError):
        _redistribute._gen_transform_infos.cache_clear()
    with contextlib.suppress(AttributeError):
        _redistribute._planner_cache.clear()


# `module.to(...)` swaps fake parameters (`torch.utils.swap_tensors`), which refuses tensors with weak references;
# the fake mode's own memo holds one to each fake tensor it made. Drop the memo's entry for the two tensors first.
@contextlib.contextmanager
def _swappable_fakes(mode: Any) -> Iterator[None]:
    import torch.utils

    original = torch.utils.swap_tensors
    memo = mode.fake_tensor_converter.meta_converter.tensor_memo

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        for key in [k for k, v in list(memo.items()) if v is t1 or v is t2]:
            memo.pop(key, None)
        original(t1, t2)

    torch.utils.swap_tensors = swap_tensors
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


class _LazyChunks(Sequence[torch.Tensor]):
    """FSDP2's `_chunk_with_empty(tensor, n, dim)` made on demand: chunk i is `torch.chunk(tensor, n, dim)[i]` (the
    same view), or an empty tensor past the last chunk, as the original pads its list."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int) -> None:
        self.tensor, self.num_chunks, self.dim = tensor, num_chunks, dim
        self.size = tensor.size(dim)
        self.step = -(-self.size // num_chunks)  # torch.chunk's chunk size: ceil(size / n)

    def __len__(self) -> int:
        return self.num_chunks

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, i: slice) -> list[torch.Tensor]: ...

    def __getitem__(self, i: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.num_chunks))]
        if not -self.num_chunks <= i < self.num_chunks:
            raise IndexError(f"chunk {i} of {self.num_chunks}")
        i %= self.num_chunks
        start = i * self.step
        if start >= self.size:
            return self[0].new_empty(0)
        return self.tensor.narrow(self.dim, start, min(self.step, self.size - start))


# FSDP2 shards a parameter by cutting it into one chunk per rank of its shard group and keeping its own (and chunk 0's
# size): at 1,024 ranks that is 1,024 fake views per parameter, each through the fake mode and the tracker (0.1 s
# a parameter, most of a DeepSeek-V3 dry run's time). The dry run makes only the chunks FSDP reads.
@contextlib.contextmanager
def _lazy_fsdp_chunks() -> Iterator[None]:
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    original = _fsdp_param._chunk_with_empty

    def chunk_with_empty(tensor: torch.Tensor, num_chunks: int, dim: int) -> Sequence[torch.Tensor]:
        if num_chunks <= 1 or tensor.size(dim) == 0:
            return original(tensor, num_chunks, dim)
        return _LazyChunks(tensor, num_chunks, dim)

    _fsdp_param._chunk_with_empty = chunk_with_empty  # type: ignore[assignment]  # FSDP2 only indexes it
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original
