"""`af.dry_run`: a script run as one rank of a large world, on torch's fake process group, every tensor fake.

The script runs unmodified (`runpy`), through the real `af.Mesh`, `af.shard` and combinators; its training
calls go through a `Session` (an `accelfn.dry_mode.Watcher`) that measures each one with a `StepTracker`
and stops the script after `steps` of them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import runpy
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from .. import dry_mode
from .. import tree as _tree
from ..dtensor import local_tensor
from .report import Assumptions, Report, predict
from .tracker import CATEGORIES, HostReads, StepTracker

__all__ = ["dry_run", "Session", "StopDryRun"]


class StopDryRun(BaseException):  # noqa: N818 - not an error: ends the script after the measured steps
    """Raised in the script after the steps asked for (a BaseException: a script's `except Exception` lets
    it through)."""


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


def _locals(tree: Any) -> list[torch.Tensor]:
    return [local_tensor(x) for x in _tree.leaves(tree) if isinstance(x, torch.Tensor)]


def _rows(batch: Any) -> tuple[int | None, int | None]:
    from ..meter import _batch_size

    tokens, rows = _batch_size(batch, None)
    return rows, tokens


def _scaled(batch: Any, rows: int, new_rows: int) -> Any:
    """`batch` with every leaf of `rows` rows made `new_rows` long (fake values)."""

    def scale(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.ndim > 0 and x.shape[0] == rows:
            return x.new_zeros((new_rows, *x.shape[1:]))
        return x

    return _tree.map(scale, batch)


class Session(dry_mode.Watcher):
    """Measures the script's training calls; stops it after `steps`."""

    def __init__(self, steps: int, capacity: int | None, search: bool) -> None:
        super().__init__()
        self.steps = steps
        self.capacity = capacity
        self.search = search
        self.measured: list[Measured] = []
        self.tracker: StepTracker | None = None
        self.step: Any = None
        self.max_micro_batch: int | None = None
        self.micro_batch: int | None = None
        self._grads = 0

    # ---- hooks -------------------------------------------------------------------------------------------------
    def real_tensors(self) -> contextlib.AbstractContextManager[Any]:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        return unset_fake_temporarily()

    def device_kind(self, kind: str) -> str:
        if kind != "cpu" and kind not in self.requested_kinds:
            self.requested_kinds.append(kind)
        return "cpu"

    def phase(self, name: str, run: Any) -> None:
        t = self.tracker
        if t is None:
            return
        t.phase = name
        if name == "reduce":
            self._grads = t.label(_locals(run.grads), "grads")

    def train_call(self, step: Any, state: Any, batch: Any, call: Callable[[], Any]) -> Any:
        self.step = step
        m, out = self.measure(step, state, batch, call)
        self.measured.append(m)
        if len(self.measured) >= self.steps:
            if self.search and self.capacity is not None and m.rows:
                self.max_micro_batch = self._search(step, state, batch, m)
            raise StopDryRun
        return out

    # ---- measuring ---------------------------------------------------------------------------------------------
    def measure(self, step: Any, state: Any, batch: Any, call: Callable[[], Any]) -> tuple[Measured, Any]:
        module_name = _module_tracker()
        from torch._guards import detect_fake_mode

        tracker = StepTracker(
            module_name=module_name.current if module_name else None,
            fake_mode=detect_fake_mode(),
        )
        self.tracker, self._grads = tracker, 0
        with contextlib.ExitStack() as stack:
            if module_name is not None:
                stack.enter_context(module_name)
            stack.enter_context(tracker)
            sizes = {
                "params": tracker.label(_locals(state.params), "params"),
                "buffers": tracker.label(_locals(state.buffers), "buffers"),
                "optimizer": tracker.label(_locals(state.opt_state), "optimizer"),
            }
            out = call()
            new = out[0]
            tracker.label(_locals(new.params), "params")
            tracker.label(_locals(new.buffers), "buffers")
            sizes["optimizer"] = max(sizes["optimizer"], tracker.label(_locals(new.opt_state), "optimizer"))
        self.tracker = None
        peak, at_peak, own_peak, by_module = tracker.breakdown()
        rows, tokens = _rows(batch)
        return (
            Measured(
                peak=peak,
                at_peak=at_peak,
                own_peak=own_peak,
                by_module=by_module,
                params=sizes["params"],
                buffers=sizes["buffers"],
                optimizer=sizes["optimizer"],
                grads=self._grads,
                comm=tracker.collectives_by_group(),
                flops=tracker.flops,
                rows=rows,
                tokens=tokens,
            ),
            out,
        )

    def _fits(self, step: Any, state: Any, batch: Any, rows: int, new_rows: int) -> tuple[bool, int]:
        from ..engine import run_train

        plan = step.plan
        scaled = _scaled(batch, rows, new_rows)
        m, _ = self.measure(step, state, scaled, lambda: run_train(plan, state, scaled))
        assert self.capacity is not None
        return m.peak <= self.capacity, m.peak

    def _search(self, step: Any, state: Any, batch: Any, m: Measured) -> int | None:
        """The largest per-rank micro-batch that fits. The peak is close to linear in the rows: each probe is the
        secant through the last two measurements, kept strictly between the largest size known to fit and the
        smallest known not to, until they are adjacent (2-4 extra steps in practice)."""
        assert self.capacity is not None and m.rows
        micro = max(1, step.plan.microbatches)
        self.micro_batch = m.rows // micro
        points = [(self.micro_batch, m.peak)]  # (micro-batch rows, peak)
        lo, hi = 0, None  # the largest size known to fit, the smallest known not to
        probe = 2 * self.micro_batch
        for _ in range(10):
            _, peak = self._fits(step, state, batch, m.rows, probe * micro)
            points.append((probe, peak))
            for size, p in points[-2:]:
                if p <= self.capacity:
                    lo = max(lo, size)
                elif hi is None or size < hi:
                    hi = size
            if hi is not None and hi - lo <= 1:
                break
            (r1, p1), (r2, p2) = sorted(points[-2:])
            slope = (p2 - p1) / (r2 - r1) if r2 != r1 and p2 > p1 else max(1.0, p2 / max(r2, 1))
            guess = int(r2 + (self.capacity - p2) / slope)
            probe = max(guess, lo + 1) if hi is None else min(max(guess, lo + 1), hi - 1)
            if probe > 1 << 20:  # fits at any sensible size
                return probe
        return lo or None


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


# ---- the fake world ----------------------------------------------------------------------------------------------
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
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with (
            _object_collectives(),
            _real_device_meshes(),
            FakeTensorMode(allow_non_fake_inputs=True) as mode,
            _swappable_fakes(mode),
            HostReads() as reads,
        ):
            yield reads
    finally:
        _mesh.destroy_process_group()
        _clear_dtensor_caches()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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
    saved = {name: getattr(dist, name) for name in _OBJECT_COLLECTIVES}
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


@contextlib.contextmanager
def _argv(argv: list[str], path: str | None) -> Iterator[None]:
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = argv
    if path is not None:
        sys.path.insert(0, path)
    try:
        yield
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


# ---- the report --------------------------------------------------------------------------------------------------
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


def _report(
    session: Session,
    *,
    world: int,
    rank: int,
    nproc_per_node: int,
    device: str,
    spec: Any,
    assumptions: Assumptions,
) -> Report:
    from .. import mesh as _mesh
    from ..platforms import specs

    last = session.measured[-1]
    worst = max(session.measured, key=lambda m: m.peak)
    m = _mesh._current
    shape = dict(m.shape) if m is not None else {"world": world}
    groups = _axes_of_groups()
    comm: dict[str, dict[str, dict[str, Any]]] = {}
    for (kind, group), row in last.comm.items():
        axes = groups.get(group, (group,))
        key = "x".join(axes)
        slot = comm.setdefault(kind, {}).setdefault(
            key, {"count": 0, "bytes": 0, "bus_bytes": 0, "group_size": row["size"]}
        )
        slot["count"] += row["count"]
        slot["bytes"] += row["bytes"]
        slot["bus_bytes"] += row["bus_bytes"]
        slot["intra_node"] = _intra_node(axes, shape, nproc_per_node)
    total_bus = sum(r["bus_bytes"] for by in comm.values() for r in by.values())
    per_rank = {
        "params": last.params,
        "buffers": last.buffers,
        "grads": last.grads,
        "optimizer": last.optimizer,
        "activations": worst.own_peak["activations"],
        "temporary": worst.at_peak["temporary"],
        "comm_buffers": worst.at_peak["comm_buffers"],
        "peak": worst.peak,
    }
    step = session.step
    plan = step.plan if step is not None else None
    dtype = torch.float32
    if plan is not None:
        if plan.autocast_dtype is not None:
            dtype = plan.autocast_dtype
        else:
            floats = [p.dtype for p in plan.module.parameters() if p.is_floating_point()]
            dtype = floats[0] if floats else torch.float32
        if any(t.kind == "fp8" for t in plan.transforms):
            dtype = torch.float8_e4m3fn
    data = m.data_size if m is not None else world
    tokens = last.tokens * data if last.tokens else None
    predicted = None
    capacity = fits = headroom = None
    if spec is not None:
        predicted = predict(
            flops=last.flops,
            comm=comm,
            peak_tflops=specs.peak_tflops(spec, dtype),
            bandwidth_gbs={True: spec.intra_node_gbs, False: spec.inter_node_gbs},
            tokens_per_step=tokens,
            assumptions=assumptions,
            dtype=str(dtype).removeprefix("torch."),
        )
        capacity = spec.memory_bytes - assumptions.reserve_bytes
        headroom = capacity - worst.peak
        fits = headroom >= 0
    top = sorted(worst.by_module.items(), key=lambda kv: -kv[1])[:8]
    notes = list(session.notes)
    if session.requested_kinds:
        notes.append(
            f"the script asked for {', '.join(session.requested_kinds)}: ran as fake CPU tensors "
            "(CPU autocast casts a different op list than CUDA's; fused kernels are torch's CPU ones)"
        )
    return Report(
        world_size=world,
        rank=rank,
        mesh=shape,
        device=device,
        gpu=spec.key if spec is not None else None,
        per_rank=per_rank,
        at_peak={c: worst.at_peak[c] for c in CATEGORIES},
        top_modules=top,
        comm=comm,
        total_bus_bytes=total_bus,
        flops_per_step=last.flops,
        tokens_per_step=tokens,
        micro_batch=session.micro_batch,
        predicted=predicted,
        capacity_bytes=capacity,
        fits=fits,
        headroom_bytes=headroom,
        max_micro_batch=session.max_micro_batch,
        steps=len(session.measured),
        notes=notes,
        skipped=list(session.skipped),
        strategy=str(step).splitlines()[0] if step is not None else "",
        ranks_tried=[rank],
    )


# ---- the entry point ---------------------------------------------------------------------------------------------
def _execute(
    script: str | os.PathLike[str] | Callable[[], Any], args: Sequence[str], session: Session
) -> None:
    """Run the script (as `python script.py args` would) until the session stops it."""
    try:
        if callable(script):
            script()
        else:
            path = str(Path(script).absolute())
            with _argv([path, *args], str(Path(path).parent)):
                runpy.run_path(path, run_name="__main__")
    except StopDryRun:
        pass
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    except (DynamicOutputShapeException, DataDependentOutputException) as e:
        where = _script_line(e, script)
        raise RuntimeError(
            f"af.dry_run: {where}`{e.func}` needs the values of a tensor (the shape of its result depends on them); "
            "in a dry run every tensor is fake and has no values. Compute such data outside the dry run, or give "
            "it a fixed shape (e.g. masks instead of nonzero / boolean indexing)"
        ) from e
    if not session.measured:
        raise RuntimeError(
            "af.dry_run: the script ended without calling a training step (af.train_step, possibly under "
            "af.shard and other combinators): nothing to measure"
        )


def _script_line(e: BaseException, script: Any) -> str:
    """`file:line: ` of the script's innermost frame in `e`'s traceback (empty when not found)."""
    import traceback

    path = str(Path(script).absolute()) if not callable(script) else None
    frames = traceback.extract_tb(e.__traceback__)
    library = (str(Path(torch.__file__).parent.parent), str(Path(__file__).parent.parent))
    mine = [f for f in frames if f.filename == path or (path is None and not f.filename.startswith(library))]
    if not mine:
        return ""
    f = mine[-1]
    return f"{Path(f.filename).name}:{f.lineno}: "


def measure_real(
    script: str | os.PathLike[str] | Callable[[], Any], args: Sequence[str] = (), *, steps: int = 1
) -> Report:
    """The dry run's measurements on a real run (this process, in a job started by `accelfn launch`): the same
    tracker on real tensors, for validating the dry run against the real thing. Stops the script after `steps`."""
    session = Session(steps, None, False)
    start = time.perf_counter()
    with dry_mode.watching(session):
        _execute(script, list(args), session)
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        report = _report(
            session,
            world=world,
            rank=rank,
            nproc_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
            device="cpu",
            spec=None,
            assumptions=Assumptions(),
        )
    report.elapsed_s = time.perf_counter() - start
    return report


def _run_once(
    script: str | os.PathLike[str] | Callable[[], Any],
    args: Sequence[str],
    *,
    world: int,
    rank: int,
    nproc_per_node: int,
    steps: int,
    spec: Any,
    device: str,
    mesh: str | None,
    search: bool,
    assumptions: Assumptions,
) -> Report:
    capacity = spec.memory_bytes - assumptions.reserve_bytes if spec is not None else None
    session = Session(steps, capacity, search)
    start = time.perf_counter()
    with dry_mode.watching(session), fake_world(world, rank, nproc_per_node, mesh) as reads:
        _execute(script, args, session)
        if reads.count:  # (HostReads is under every step's tracker: it sees the steps' reads too)
            session.notes.append(
                f"host reads of fake values (.item(), .tolist(), float()) returned 0: {reads.count} of them"
            )
        report = _report(
            session,
            world=world,
            rank=rank,
            nproc_per_node=nproc_per_node,
            device=device,
            spec=spec,
            assumptions=assumptions,
        )
    report.elapsed_s = time.perf_counter() - start
    return report


def dry_run(
    script: str | os.PathLike[str] | Callable[[], Any],
    args: Sequence[str] = (),
    *,
    nproc_per_node: int = 8,
    nnodes: int = 1,
    device: str = "cuda",
    gpu: str | None = None,
    steps: int = 1,
    rank: int | str = 0,
    mesh: str | None = None,
    search: bool = True,
    assumptions: Assumptions | None = None,
) -> Report:
    """Run `script` (a path, with `args`, or a function) as rank `rank` of `nproc_per_node` x `nnodes`
    processes over a fake process group, every tensor fake, for `steps` training calls; return the `Report`.

    `device`/`gpu` choose the row of the device table the report measures against (`gpu` defaults to
    `h100-sxm` for cuda; `device="cpu"` uses the nominal CPU row). `rank="worst"` runs ranks 0, the middle
    one and the last, and reports the one with the largest peak. `mesh` is `accelfn launch --mesh`'s spec
    (`"dp=8,tp=8"`) for scripts that read it with `af.Mesh.from_env()`. `search=False` skips the search
    for the largest micro-batch. Errors the real first step would raise are raised unchanged.

    Example:
        >>> import torch, accelfn as af
        >>> def main():
        ...     mesh = af.Mesh({"dp": -1})
        ...     step = af.shard(af.train_step(lambda m, b: af.losses.mse(m(b), b), af.optim.adamw(1e-3)), mesh)
        ...     state = step.init(torch.nn.Linear(1024, 1024))
        ...     step(state, torch.randn(8, 1024))
        >>> report = af.dry_run(main, nproc_per_node=64, device="cpu", search=False)
        >>> report.world_size, report.per_rank["params"], report.comm["all_reduce"]["dp"]["count"]
        (64, 4198400, 2)
    """
    from ..platforms import specs

    world = nproc_per_node * nnodes
    if nproc_per_node < 1 or nnodes < 1:
        raise ValueError(
            f"af.dry_run: nproc_per_node and nnodes must be >= 1, got {nproc_per_node}, {nnodes}"
        )
    if steps < 1:
        raise ValueError(f"af.dry_run: steps must be >= 1, got {steps}")
    if gpu is None:
        gpu = "cpu" if device == "cpu" else ("h100-sxm" if device == "cuda" else None)
    spec = specs.spec(gpu) if gpu is not None else None
    assumptions = assumptions or Assumptions()
    if rank == "worst":
        candidates = sorted({0, world // 2, world - 1})
    elif isinstance(rank, int) and 0 <= rank < world:
        candidates = [rank]
    else:
        raise ValueError(f"af.dry_run: rank must be in [0, {world}) or 'worst', got {rank!r}")
    reports = [
        _run_once(
            script,
            list(args),
            world=world,
            rank=r,
            nproc_per_node=nproc_per_node,
            steps=steps,
            spec=spec,
            device=device,
            mesh=mesh,
            search=search and len(candidates) == 1,
            assumptions=assumptions,
        )
        for r in candidates
    ]
    report = max(reports, key=lambda r: r.per_rank["peak"])
    if len(candidates) > 1:
        report.ranks_tried = candidates
        report.elapsed_s = sum(r.elapsed_s for r in reports)
    return report
