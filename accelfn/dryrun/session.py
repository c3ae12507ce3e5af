"""The dry run's session: the `accelfn.dry_mode.Watcher` the script's training calls go through. It measures the
first `steps` calls of each step object with a `StepTracker`, skips the calls it need not run, and stops the
script when its loop comes round (a step object called once more); the loop's step objects, their states
alive beside each other and the micro-batch search are its to know.

Example:
    >>> from accelfn.dryrun.session import Session
    >>> session = Session(steps=1, capacity=None, search=False)
    >>> session.calls = [1, 2, 2, 2, 1]  # a generator step, then 3 critic steps, then the generator again
    >>> session.loop()  # one iteration of the script's loop: {step object: calls}
    {1: 1, 2: 3}
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import dry_mode
from .allocator import Trace
from .layout import _layout
from .records import (
    Measured,
    StepRecord,
    _locals,
    _module_tracker,
    _offloads,
    _rows,
    _storages,
    _uneven_dims,
    _weak,
)
from .search import largest_micro_batch
from .step_time import pipeline_of
from .tracker import InitTracker, StepTracker

__all__ = ["Session", "StopDryRun"]


# calls of one step object in a row (after its measured ones) skipped before it counts as the whole loop
REPEATS = 16


class StopDryRun(BaseException):  # noqa: N818 - not an error: ends the script after the measured steps
    """Raised in the script after the steps asked for (a BaseException: a script's `except Exception` lets
    it through)."""


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
        self.spec: Any = None  # the device table's row the run models (`accelfn.platforms.specs.DeviceSpec`)
        self.on_model: Callable[[Any], None] | None = None  # called with each model before its lowering
        self.routing: str | float = "uniform"  # how MoE layers route their rows (`Assumptions.moe_routing`)
        self.moe: dict[int, tuple[torch.Tensor, int]] = {}  # MoE layer -> (counts [ep, E], rank simulated)
        self._searching = False  # the micro-batch search's probes: their routing is not the report's

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
        if self.on_model is not None:
            self.on_model(model)
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

    def comm_buffer(self, tensor: Any) -> None:
        if self.tracker is not None:
            self.tracker.mark_comm(tensor)

    def gradients(self, tensors: Any) -> None:
        if self.tracker is not None:
            self.tracker.label(tensors, "grads", known_only=True)  # (a relabelling: nothing allocated here)

    def keeps_process_group(self) -> bool:
        return True  # the search after a script ended runs its steps on their groups (`finish`)

    def models_a_device(self) -> bool:
        return not self.device_is_host

    def fp8_support(self, kind: str) -> bool | None:
        """Whether the modelled device's row has an fp8 peak (every kind executes as the host here, so the row
        answers for any `kind` asked); None where the host is the device or no row is known."""
        if self.device_is_host or self.spec is None:
            return None
        return "fp8" in self.spec.tflops

    def grouped_mm_dtypes(self) -> tuple[Any, ...] | None:
        if self.device_is_host or self.spec is None:
            return None
        from .timing import grouped_mm_dtypes

        return grouped_mm_dtypes(self.spec)

    def modelled_device(self) -> str | None:
        return None if self.device_is_host or self.spec is None else str(self.spec.name)

    def untracked(self) -> contextlib.AbstractContextManager[Any]:
        from torch.utils._python_dispatch import _disable_current_modes

        return _disable_current_modes()  # the fake mode and the step's tracker

    def moe_routing(self) -> str | float:
        return self.routing

    def moe_routed(self, layer: int, counts: Any, rank: int) -> None:
        if not self._searching:
            self.moe[layer] = (counts, rank)

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
        # a pipeline splits the batch itself (its plan then says 1): its lowering's note counts the micro-batches
        # (accumulation's included), else its description does
        split = re.search(r"(\d+) micro-batches, bubble", str(step))
        pipe = pipeline_of(str(step))
        if split is not None:
            rec.microbatches *= int(split[1])
        elif pipe is not None:
            rec.microbatches *= pipe.microbatches
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
            tracker.step_start = len(tracker.events)  # the caching allocator's replay (allocator.Trace)
            tracker.state_in = tracker.records(_locals((state.params, state.buffers, state.opt_state)))
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
            tracker.state_out = tracker.records(_locals((new.params, new.buffers, new.opt_state)))
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
                fp8_flops=tracker.fp8_flops,
                rows=rows,
                tokens=tokens,
                host=tracker.host_peak_bytes,
                timeline=tracker.timeline,
                # (the events up to here: the storages freed later, as the script goes on or ends, come after)
                trace=Trace(list(tracker.events), tracker.step_start, tracker.state_in, tracker.state_out),
            ),
            out,
        )

    def _search(self, stopping: StepRecord, state: Any, batch: Any) -> int | None:
        """The largest per-rank micro-batch that fits (`accelfn.dryrun.search.largest_micro_batch`), in rows of
        the loop's step object with the largest peak, over the loop's step objects whose states are alive."""
        assert self.capacity is not None
        self._searching = True
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
        return largest_micro_batch(runs, self.micro_batch, self.capacity, self.measure, self.others)
