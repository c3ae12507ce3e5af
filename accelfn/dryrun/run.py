"""`af.dry_run`: a script run as one rank of a large world, on torch's fake process group, every tensor fake.

The script runs unmodified (`runpy`), through the real `af.Mesh`, `af.shard` and combinators; its training
calls go through a `Session` (an `accelfn.dry_mode.Watcher`) that measures the first `steps` calls of each
step object with a `StepTracker` and stops the script when its loop comes round (a step object called once
more). The report covers every step object called: memory counts the states of the others that are alive
beside each one, communication and FLOPs sum over one iteration of the script's loop.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import runpy
import sys
import time
import weakref
from collections import defaultdict
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
from .tracker import CATEGORIES, HostReads, InitTracker, StepTracker

__all__ = ["dry_run", "Session", "StopDryRun"]


# calls of one step object in a row (after its measured ones) skipped before it counts as the whole loop
REPEATS = 16


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
    # bytes (by category) of the other step objects' states alive beside this call: they share the memory
    others: dict[str, int] = attrs.Factory(dict)
    host: int = 0  # host memory the call holds at its peak (af.offload's state and buffers), not the device's

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


def _scaled(batch: Any, rows: int, new_rows: int) -> Any:
    """`batch` with every leaf of `rows` rows made `new_rows` long (fake values)."""

    def scale(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.ndim > 0 and x.shape[0] == rows:
            return x.new_zeros((new_rows, *x.shape[1:]))
        return x

    return _tree.map(scale, batch)


class Session(dry_mode.Watcher):
    """Measures the first `steps` calls of each step object the script calls; stops the script at the next
    call of a step object measured `steps` times (its loop came round). With `target` N, such calls are
    skipped (returned at once, their state unchanged) until the N-th step object has been measured, and only
    then stop the script."""

    def __init__(self, steps: int, capacity: int | None, search: bool, target: int | None = None) -> None:
        super().__init__()
        self.steps = steps
        self.capacity = capacity
        self.search = search
        self.target = target
        self.measured: list[Measured] = []
        self.records: list[StepRecord] = []
        self.calls: list[int] = []  # the step object (its index) of each training call, skipped ones too
        self.stopped_by: int | None = None  # the step object whose call stopped the script
        self.stopped_by_repeats = False  # ... after REPEATS calls of it in a row (its own loop)
        self.watch: Any = None  # the LoopWatch of an inner loop being skipped (see _in_inner_loop)
        self.uneven: set[str] = set()  # mesh dimensions with uneven shards
        self.layout: tuple[dict[str, int], dict[str, tuple[str, ...]], int] | None = None
        self.tracker: StepTracker | None = None
        self.max_micro_batch: int | None = None
        self.micro_batch: int | None = None
        self._grads = 0
        self.init: InitTracker | None = None  # the memory before the first training step (a dry run's)
        self.device_is_host = False  # the real run computes on the host (device "cpu"): no separate device

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

    def init_call(self, step: Any, model: Any, call: Callable[[], Any]) -> Any:
        init = self.init
        if init is None or not init.active or self.device_is_host:
            return call()
        # the lowering places the model on the mesh's device (the host copy is freed) and allocates there
        init.to_device(_locals([*model.parameters(), *model.buffers()]))
        init.where = "device"
        try:
            return call()
        finally:
            init.where = "host"

    @contextlib.contextmanager
    def on_host(self) -> Iterator[None]:
        trackers = [t for t in (self.init if self.init is not None and self.init.active else None, self.tracker)
                    if t is not None]  # fmt: skip
        saved = [t.where for t in trackers]
        for t in trackers:
            t.where = "host"
        try:
            yield
        finally:
            for t, where in zip(trackers, saved):
                t.where = where

    def models_a_device(self) -> bool:
        return not self.device_is_host

    def train_call(self, step: Any, state: Any, batch: Any, call: Callable[[], Any]) -> Any:
        if self.init is not None and self.init.active:
            self.init.stop()
        if self.watch is not None and self.watch.inner_done:
            self.watch.end()  # an inner loop ended and the outer loop calls a step object: no more tracing
        rec = self._record(step)
        if len(rec.measured) < self.steps:
            rec.calls += 1
            self.calls.append(rec.index)
            m, out = self.measure(step, state, batch, call)
            rec.measured.append(m)
            self.measured.append(m)
            if len(rec.measured) == 1:
                self._describe(rec, step)
            rec.resident = _storages(out[0])
            rec.own |= {key for _, key, _, _ in _storages(state) + rec.resident}
            rec.state_ref, rec.batch = _weak(out[0]), batch
            rec.rest = tuple(out[1:])  # what a skipped call returns after the state (its metrics)
            if self.search and self.capacity is not None:  # the search may run after the script ended
                for other in self.records:  # only the latest step object's (the others': while the script
                    other.held = None  # keeps them)
                rec.held = out[0]
            m.others = self.others(rec)
            self.uneven |= _uneven_dims(out[0].params)
            # now: a script's `with af.Mesh(...) as mesh:` closes the mesh before the report
            self.layout = _layout() or self.layout
            return out
        done = self.target is None or self._target_done()
        run = self._run_length(rec.index)
        if done and run < REPEATS and self.calls and self.calls[-1] == rec.index and self._in_inner_loop(rec):
            # called again with no other step object in between, in a loop inside another loop of the script
            # (a GAN's critic steps): skipped until the inner loop ends (see accelfn.dryrun.loops)
            rec.calls += 1
            rec.repeated += 1
            self.calls.append(rec.index)
            return (state, *rec.rest)
        if done:  # the loop came round: measured
            self.end_watch()
            self.stopped_by = rec.index
            self.stopped_by_repeats = run >= REPEATS
            for r in self._loop_records():  # in the loop, the others' states are alive beside each step
                now = self.others(r)
                for m in r.measured:
                    if sum(now.values()) > sum(m.others.values()):
                        m.others = now
            if self.search and self.capacity is not None:
                self.max_micro_batch = self._search(rec, state, batch)
            raise StopDryRun
        rec.calls += 1  # before the target step object: skipped, so that the script goes on to it
        rec.skipped += 1
        self.calls.append(rec.index)
        return (state, *rec.rest)

    def _record(self, step: Any) -> StepRecord:
        for rec in self.records:
            if rec.ref() is step:
                return rec
        rec = StepRecord(index=len(self.records) + 1, ref=_weak(step))
        self.records.append(rec)
        return rec

    def _describe(self, rec: StepRecord, step: Any) -> None:
        plan = step.plan
        rec.name = str(step).splitlines()[0]
        rec.microbatches = max(1, int(getattr(plan, "microbatches", 1) or 1))
        dtype = torch.float32
        if plan.autocast_dtype is not None:
            dtype = plan.autocast_dtype
        else:
            floats = [p.dtype for p in plan.module.parameters() if p.is_floating_point()]
            dtype = floats[0] if floats else torch.float32
        if any(t.kind == "fp8" for t in plan.transforms):
            dtype = torch.float8_e4m3fn
        rec.dtype = dtype

    def _in_inner_loop(self, rec: StepRecord) -> bool:
        """Whether this call (of the step object called just before) runs in an inner loop of the script that
        has not ended: a loop around the call with another loop around it in the same function. The first such
        call starts a line tracer on the script's frame; a call after the inner loop ended is the loop coming
        round (the outer loop calls nothing else)."""
        from .loops import LoopWatch, loop_lines, script_frame

        w = self.watch
        if w is not None and w.index == rec.index:
            if w.inner_done:
                self.watch = None
                return False
            return True
        self.end_watch()
        frame = script_frame()
        if frame is None:
            return False
        inner, outer = loop_lines(frame)
        if inner is None or outer is None:
            return False
        self.watch = LoopWatch(frame, inner, outer, StopDryRun())
        self.watch.index = rec.index
        self.watch.start()
        return True

    def end_watch(self) -> None:
        """Stop the loop watch's tracing and put back the tracers installed before it (a watch that stopped
        the script has unset tracing by raising)."""
        if self.watch is not None:
            self.watch.end()
            self.watch.restore()
            self.watch = None

    def finish(self) -> None:
        """The script ended without its loop coming round (fewer calls than REPEATS in a row): the micro-batch
        search runs on the last step object called, from the state it returned."""
        if self.stopped_by is not None or not self.calls or not (self.search and self.capacity is not None):
            return
        last = self.records[self.calls[-1] - 1]
        if last.held is not None and last.batch is not None:
            self.max_micro_batch = self._search(last, last.held, last.batch)
        for rec in self.records:
            rec.held = None

    def _run_length(self, index: int) -> int:
        """How many of the latest calls were of step object `index`, in a row."""
        n = 0
        for c in reversed(self.calls):
            if c != index:
                break
            n += 1
        return n

    def _target_done(self) -> bool:
        assert self.target is not None
        return len(self.records) >= self.target and len(self.records[self.target - 1].measured) >= self.steps

    def others(self, rec: StepRecord) -> dict[str, int]:
        """Bytes by category of the storages of the other step objects' states alive now (not shared with
        `rec`'s)."""
        out: dict[str, int] = defaultdict(int)
        seen = set(rec.own)
        for other in self.records:
            if other is rec:
                continue
            for ref, key, nbytes, category in other.resident:
                if key not in seen and ref() is not None:
                    seen.add(key)
                    out[category] += nbytes
        return dict(out)

    def loop(self) -> dict[int, int]:
        """One iteration of the script's loop: {step object index: calls per iteration}.

        The last step object called (the one whose call stopped the script, or the last one when the script
        ended) closes the iteration; it starts at the first call of that step object's previous run of calls in
        a row, so an inner loop counts (5 critic calls per generator call: {1: 5, 2: 1}). A step object stopped
        after REPEATS calls in a row, or whose last run has no earlier one, is its own loop ({n: 1}); every step
        object once if the last one was called only once."""
        seq = self.calls + ([self.stopped_by] if self.stopped_by is not None else [])
        if not seq:
            return {}
        last = seq[-1]
        if self.stopped_by is not None and self.stopped_by_repeats:
            return {last: 1}
        run_start = len(seq) - 1
        while run_start > 0 and seq[run_start - 1] == last:
            run_start -= 1
        earlier = [i for i, c in enumerate(seq[:run_start]) if c == last]
        if not earlier:
            return {last: 1} if run_start < len(seq) - 1 else {rec.index: 1 for rec in self.records}
        start = earlier[-1]
        while start > 0 and seq[start - 1] == last:
            start -= 1
        out: dict[int, int] = {}
        for c in seq[start:run_start]:
            out[c] = out.get(c, 0) + 1
        return out

    def _loop_records(self) -> list[StepRecord]:
        loop = self.loop()
        return [r for r in self.records if r.index in loop]

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
            offloaded = _offloads(step) and not self.device_is_host
            sizes = {
                "params": tracker.label(_locals(state.params), "params"),
                "buffers": tracker.label(_locals(state.buffers), "buffers"),
            }
            with self.on_host() if offloaded else contextlib.nullcontext():  # af.offload: host memory
                sizes["optimizer"] = tracker.label(_locals(state.opt_state), "optimizer")
                if offloaded:  # its master params and pending gradients
                    tracker.label(_locals(state.extra), "optimizer")
            out = call()
            new = out[0]
            tracker.label(_locals(new.params), "params")
            tracker.label(_locals(new.buffers), "buffers")
            with self.on_host() if offloaded else contextlib.nullcontext():
                sizes["optimizer"] = max(
                    sizes["optimizer"], tracker.label(_locals(new.opt_state), "optimizer")
                )
                if offloaded:
                    tracker.label(_locals(new.extra), "optimizer")
            if offloaded:
                sizes["optimizer"] = 0  # on the host: in `host`
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
                host=tracker.host_peak_bytes,
            ),
            out,
        )

    def _search(self, stopping: StepRecord, state: Any, batch: Any) -> int | None:
        """The largest per-rank micro-batch that fits, in rows of the loop's step object with the largest peak
        (the others' batches scaled alike), counting the other states alive beside each. The peak is close to
        linear in the rows: each probe is the secant through the last two measurements, kept strictly between
        the largest size known to fit and the smallest known not to, until they are adjacent (2-4 extra steps
        in practice; at most 10)."""
        from ..engine import run_train

        assert self.capacity is not None
        runs: list[tuple[StepRecord, Any, Any, Any]] = []  # (record, step, state, batch) of the loop's steps
        for rec in self._loop_records():
            live = (state, batch) if rec is stopping else (rec.state_ref() or rec.held, rec.batch)
            step = rec.ref()
            if live[0] is None or step is None:
                self.notes.append(
                    f"micro-batch search: step object {rec.index}'s state was no longer alive: left out"
                )
                continue
            runs.append((rec, step, *live))
        runs = [r for r in runs if r[0].measured[-1].rows]
        if not runs:
            return None
        main = max(runs, key=lambda r: r[0].measured[-1].total_peak)[0]
        self.micro_batch = main.measured[-1].rows // main.microbatches  # type: ignore[operator]
        if not self.micro_batch:
            return None

        def peak_at(size: int) -> int:
            worst = 0
            for rec, step, st, b in runs:
                rows = rec.measured[-1].rows
                assert rows
                new_rows = max(1, round(rows * size / self.micro_batch / rec.microbatches)) * rec.microbatches
                scaled = _scaled(b, rows, new_rows)
                call = functools.partial(run_train, step.plan, st, scaled)
                m, _ = self.measure(step, st, scaled, call)
                worst = max(worst, m.peak + sum(self.others(rec).values()))
            return worst

        start = max(r[0].measured[-1].peak + sum(self.others(r[0]).values()) for r in runs)
        points = [(self.micro_batch, start)]  # (micro-batch rows, peak)
        lo, hi = 0, None  # the largest size known to fit, the smallest known not to
        probe = 2 * self.micro_batch
        for _ in range(10):
            points.append((probe, peak_at(probe)))
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
            HostReads(real_bookkeeping=True) as reads,
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


def _worst(measured: Sequence[Measured]) -> Measured:
    """The call with the largest peak (its own and the other states alive beside it); the later of equals."""
    return max(reversed(measured), key=lambda m: m.total_peak)


def _combined(parts: list[tuple[Any, int, int]], tokens: int | None) -> Any:
    """One loop iteration's prediction from its step objects' (prediction, flops, calls per iteration): times
    add up (each step object's overlap is within its own step)."""
    from .report import Prediction

    if len(parts) == 1 and parts[0][2] == 1:
        return parts[0][0]
    step = sum(p.step_time_s * n for p, _, n in parts)
    main = max(parts, key=lambda x: x[1] * x[2])[0]
    peak = main.assumes["peak_tflops"]
    flops = sum(f * n for _, f, n in parts)
    return Prediction(
        step_time_s=step,
        compute_s=sum(p.compute_s * n for p, _, n in parts),
        comm_s=sum(p.comm_s * n for p, _, n in parts),
        tokens_per_s=tokens / step if tokens and step > 0 else None,
        mfu=flops / (step * peak * 1e12) if peak and step > 0 else None,
        assumes={**main.assumes, "loop": "the sum of the step objects' times in one iteration of the loop"},
    )


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
    from ..platforms import specs

    shape, groups, data = _layout() or session.layout or ({"world": world}, {}, world)
    loop = session.loop()
    comm: dict[str, dict[str, dict[str, Any]]] = {}
    flops = 0
    tokens: int | None = None
    parts: list[tuple[Any, int, int]] = []
    objects: list[dict[str, Any]] = []
    for rec in session.records:
        last, worst = rec.measured[-1], _worst(rec.measured)
        times = loop.get(rec.index, 0)
        own = _axes_comm(last.comm, groups, shape, nproc_per_node)
        rec_tokens = last.tokens * data if last.tokens else None
        prediction = None
        if spec is not None:
            prediction = predict(
                flops=last.flops,
                comm=own,
                peak_tflops=specs.peak_tflops(spec, rec.dtype),
                bandwidth_gbs={True: spec.intra_node_gbs, False: spec.inter_node_gbs},
                tokens_per_step=rec_tokens,
                assumptions=assumptions,
                dtype=str(rec.dtype).removeprefix("torch."),
            )
        if times:
            _axes_comm(last.comm, groups, shape, nproc_per_node, into=comm, times=times)
            flops += last.flops * times
            if rec_tokens is not None:
                tokens = max(tokens or 0, rec_tokens)
            if prediction is not None:
                parts.append((prediction, last.flops, times))
        objects.append(
            {
                "index": rec.index,
                "strategy": rec.name,
                "calls": rec.calls,
                "measured": len(rec.measured),
                "skipped": rec.skipped,
                "repeated": rec.repeated,
                "per_iteration": times,
                "per_rank": {
                    "params": worst.params,
                    "buffers": worst.buffers,
                    "grads": worst.grads,
                    "optimizer": worst.optimizer,
                    "activations": worst.own_peak["activations"],
                    "peak": worst.peak,
                    "other_states": sum(worst.others.values()),
                    "peak_with_other_states": worst.total_peak,
                },
                "comm": own,
                "total_bus_bytes": _bus(own),
                "flops_per_step": last.flops,
                "tokens_per_step": rec_tokens,
                "predicted": attrs.asdict(prediction) if prediction is not None else None,
            }
        )
    worst = _worst(session.measured)
    others = worst.others
    per_rank = {
        "params": worst.params + others.get("params", 0),
        "buffers": worst.buffers + others.get("buffers", 0),
        "grads": worst.grads,
        "optimizer": worst.optimizer + others.get("optimizer", 0),
        "activations": worst.own_peak["activations"],
        "temporary": worst.at_peak["temporary"],
        "comm_buffers": worst.at_peak["comm_buffers"],
        "peak": worst.total_peak,
        "host": worst.host,
    }
    at_peak = {c: worst.at_peak[c] + others.get(c, 0) for c in CATEGORIES}
    predicted = _combined(parts, tokens) if parts else None
    capacity = fits = headroom = None
    if spec is not None:
        capacity = spec.memory_bytes - assumptions.reserve_bytes
        headroom = capacity - worst.total_peak
        fits = headroom >= 0
    top = sorted(worst.by_module.items(), key=lambda kv: -kv[1])[:8]
    notes = list(session.notes)
    init = _init_report(session, nproc_per_node, capacity, assumptions, notes)
    if init is not None and init["fits"] is False:
        fits = False
    if session.requested_kinds:
        notes.append(
            f"the script asked for {', '.join(session.requested_kinds)}: ran as fake CPU tensors "
            "(CPU autocast casts a different op list than CUDA's; fused kernels are torch's CPU ones)"
        )
    peak_rec = next(r for r in session.records if any(x is worst for x in r.measured))
    if len(session.records) > 1:
        in_loop = ", ".join(f"{i} (x{n})" for i, n in sorted(loop.items()))
        notes.append(
            f"{len(session.records)} step objects called (see step_objects): communication, FLOPs and the "
            f"prediction sum one iteration of the loop, step objects {in_loop}; memory is step object "
            f"{peak_rec.index}'s peak with the other states alive beside it"
        )
    elif (
        session.stopped_by is not None
        and session.target is None
        and world > 1
        and "shard(" not in peak_rec.name
    ):
        notes.append(
            f"the step measured is not sharded over the {world} ranks (each trains the whole model); if the "
            "script trains another step object after this loop (a 2nd phase), --step 2 / step=2 measures it"
        )
    inner = [(i, n) for i, n in sorted(loop.items()) if n > 1]
    if inner:
        notes.append(
            "called several times per loop iteration (calls in a row: after the measured ones they were not run, "
            "the state returned unchanged; communication, FLOPs and the prediction count every call): "
            + ", ".join(f"step object {i} x{n}" for i, n in inner)
        )
    skipped = [r for r in session.records if r.skipped]
    if skipped:
        notes.append(
            "calls skipped (not run, the state returned unchanged) to reach step object "
            f"{session.target}: " + ", ".join(f"{r.skipped} of step object {r.index}" for r in skipped)
        )
    return Report(
        world_size=world,
        rank=rank,
        mesh=shape,
        device=device,
        gpu=spec.key if spec is not None else None,
        per_rank=per_rank,
        at_peak=at_peak,
        top_modules=top,
        comm=comm,
        total_bus_bytes=_bus(comm),
        flops_per_step=flops,
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
        strategy=peak_rec.name,
        ranks_tried=[rank],
        step_objects=objects,
        init=init,
    )


def _init_report(
    session: Session, nproc_per_node: int, capacity: int | None, assumptions: Assumptions, notes: list[str]
) -> dict[str, Any] | None:
    """The memory held before the first training step (host and device, per rank; the host per node), whether
    it fits, and advice in `notes` where it does not."""
    from .report import gib

    t = session.init
    if t is None:
        return None
    host, device = t.peak["host"], t.peak["device"]
    per_node = host * nproc_per_node
    fits_host = per_node <= assumptions.host_memory_bytes
    fits_device = None if capacity is None or session.device_is_host else device <= capacity
    meta = (
        "build the model on the meta device (`with af.init_empty(): model = ...`): step.init shards it first "
        "and allocates only this rank's shards on the device, with the modules' own init rules; load weights "
        "into them with af.checkpoint.load_pretrained(path, like=state.params)"
    )
    if not fits_host:
        notes.append(
            f"before the first step each rank holds {gib(host)} on the host, {gib(per_node)} per node of "
            f"{nproc_per_node} ranks: more than the {gib(assumptions.host_memory_bytes)} of host memory "
            "assumed (--host-memory-gib). Every rank builds the whole model there; " + meta
        )
    if fits_device is False:
        notes.append(
            f"step.init holds {gib(device)} on the device, more than its {gib(capacity or 0)} usable: the "
            "model is placed on the device whole before it is sharded; "
            + ("building it on the meta device (above) avoids that too" if not fits_host else meta)
        )
    return {
        "host_peak": host,
        "host_per_node": per_node,
        "host_memory": assumptions.host_memory_bytes,
        "device_peak": device,
        "fits_host": fits_host,
        "fits_device": fits_device,
        "fits": fits_host and fits_device is not False,
    }


# ---- the entry point ---------------------------------------------------------------------------------------------
_BEFORE_FIRST_STEP = (
    "af.dry_run: raised before the script's first training step. The dry run measures training steps "
    "(af.train_step, possibly under af.shard and other combinators); a script with none (inference only) has "
    "nothing to measure, and runs here on fake tensors (no values)"
)


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
            if not session.calls:
                raise RuntimeError(
                    f"af.dry_run: the script exited ({e.code!r}) before its first training step. The dry run "
                    "measures training steps (af.train_step, possibly under af.shard and other combinators); "
                    "a script with none (inference only) has nothing to measure, and its own checks read "
                    "fake values (0) here"
                ) from e
            if session.target is not None and not session._target_done():
                raise RuntimeError(_target_missed(session) + f" when the script exited ({e.code!r})") from e
            session.notes.append(
                f"the script exited ({e.code!r}) after the measured steps: its checks read fake values (0)"
            )
    except (DynamicOutputShapeException, DataDependentOutputException) as e:
        where = _script_line(e, script)
        raise RuntimeError(
            f"af.dry_run: {where}`{e.func}` needs the values of a tensor (the shape of its result depends on them); "
            "in a dry run every tensor is fake and has no values. Compute such data outside the dry run, or give "
            "it a fixed shape (e.g. masks instead of nonzero / boolean indexing)"
        ) from e
    except Exception as e:
        if not session.calls and not _raised_by_accelfn(e):  # the same exception, with a note
            e.add_note(_BEFORE_FIRST_STEP)
        elif session.target is not None and not session._target_done():
            e.add_note(_target_missed(session) + " when the script raised this")
        raise
    if not session.measured:
        raise RuntimeError(
            "af.dry_run: the script ended without calling a training step (af.train_step, possibly under "
            "af.shard and other combinators): nothing to measure"
        )
    if session.target is not None and not session._target_done():
        raise RuntimeError(_target_missed(session) + " when the script ended")


def _target_missed(session: Session) -> str:
    n = session.target
    assert n is not None
    text = f"af.dry_run: step={n}, but the script had called {len(session.records)} step object(s)"
    if len(session.records) >= n:
        text += f", step object {n} {len(session.records[n - 1].measured)} time(s) (< steps={session.steps})"
    return text + " (the calls of the others after their first were skipped, so it ran on past their loops)"


def _raised_by_accelfn(e: BaseException) -> bool:
    """Whether `e` passed through accelfn's own code (a configuration error of the mesh or a step, not the
    dry run's), the dry run's frames aside."""
    import traceback

    package = Path(__file__).parent.parent
    own = (str(Path(__file__).parent), str(package / "dry_mode.py"))
    return any(
        f.filename.startswith(str(package)) and not f.filename.startswith(own)
        for f in traceback.extract_tb(e.__traceback__)
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
    script: str | os.PathLike[str] | Callable[[], Any],
    args: Sequence[str] = (),
    *,
    steps: int = 1,
    step: int | None = None,
) -> Report:
    """The dry run's measurements on a real run (this process, in a job started by `accelfn launch`): the same
    tracker on real tensors, for validating the dry run against the real thing. Measures `steps` calls of each
    step object and stops the script when its loop comes round (`step` as for `dry_run`)."""
    session = Session(steps, None, False, step)
    start = time.perf_counter()
    with dry_mode.watching(session):
        try:
            _execute(script, list(args), session)
        finally:
            session.end_watch()
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
    step: int | None,
    spec: Any,
    device: str,
    mesh: str | None,
    search: bool,
    assumptions: Assumptions,
) -> tuple[Report, Session]:
    from torch._guards import detect_fake_mode

    capacity = spec.memory_bytes - assumptions.reserve_bytes if spec is not None else None
    session = Session(steps, capacity, search, step)
    session.device_is_host = device == "cpu"
    start = time.perf_counter()
    with dry_mode.watching(session), fake_world(world, rank, nproc_per_node, mesh) as reads:
        session.init = InitTracker(fake_mode=detect_fake_mode())
        try:
            with session.init:
                _execute(script, args, session)
        finally:
            session.end_watch()
        session.finish()
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
    return report, session


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


def dry_run(
    script: str | os.PathLike[str] | Callable[[], Any],
    args: Sequence[str] = (),
    *,
    nproc_per_node: int = 8,
    nnodes: int = 1,
    device: str = "cuda",
    gpu: str | None = None,
    steps: int = 1,
    step: int | None = None,
    rank: int | str = 0,
    mesh: str | None = None,
    search: bool = True,
    assumptions: Assumptions | None = None,
) -> Report:
    """Run `script` (a path, with `args`, or a function) as rank `rank` of `nproc_per_node` x `nnodes`
    processes over a fake process group, every tensor fake, measuring the first `steps` calls of each step
    object it trains, until its loop comes round (a step object called once more); return the `Report`.

    `device`/`gpu` choose the row of the device table the report measures against (`gpu` defaults to
    `h100-sxm` for cuda; `device="cpu"` uses the nominal CPU row). A script that trains several step objects
    (a GAN's two, a pretraining phase then a fine-tuning one) is measured as a whole: the report lists each
    (`step_objects`), memory counts the other states alive beside each, communication and FLOPs sum one
    iteration of the loop. `step=N` skips the calls of the step objects before the N-th one after their first
    `steps` (returned at once, the state unchanged) so that the script reaches the N-th, which a later phase
    needs. `rank="worst"` runs 0, the middle and the last rank and one rank per pipeline stage and per end of
    an unevenly sharded axis, and reports the one with the largest peak (the micro-batch search runs on it).
    `mesh` is `accelfn launch --mesh`'s spec (`"dp=8,tp=8"`) for scripts that read it with
    `af.Mesh.from_env()`. `search=False` skips the search for the largest micro-batch. Errors the real first
    step would raise are raised unchanged.

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
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 1):
        raise ValueError(f"af.dry_run: step must be a step object's number (1, 2, ...) or None, got {step!r}")
    if gpu is None:
        gpu = "cpu" if device == "cpu" else ("h100-sxm" if device == "cuda" else None)
    spec = specs.spec(gpu) if gpu is not None else None
    assumptions = assumptions or Assumptions()
    if rank != "worst" and not (isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"af.dry_run: rank must be in [0, {world}) or 'worst', got {rank!r}")
    common = dict(
        world=world,
        nproc_per_node=nproc_per_node,
        steps=steps,
        step=step,
        spec=spec,
        device=device,
        mesh=mesh,
        assumptions=assumptions,
    )
    if rank != "worst":
        return _run_once(script, list(args), rank=int(rank), search=search, **common)[0]
    first, session = _run_once(script, list(args), rank=0, search=False, **common)
    candidates = rank_candidates(first.mesh, session.uneven, world)
    reports = [first] + [
        _run_once(script, list(args), rank=r, search=False, **common)[0] for r in candidates if r != 0
    ]
    report = max(reports, key=lambda r: r.per_rank["peak"])  # the lowest rank of equals
    elapsed = sum(r.elapsed_s for r in reports)
    if search and spec is not None:  # the search on the worst rank
        report = _run_once(script, list(args), rank=report.rank, search=True, **common)[0]
        elapsed += report.elapsed_s
    report.ranks_tried = candidates
    report.elapsed_s = elapsed
    return report
