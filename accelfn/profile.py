"""`af.profile`: torch.profiler over the `with` block (every step by default, as Accelerate's
`accelerator.profile()`), one Chrome trace per rank under `RUN_DIR/profile`.

Example:
    >>> import tempfile, torch, accelfn as af
    >>> step = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1))
    >>> state = step.init(torch.nn.Linear(4, 2))
    >>> with tempfile.TemporaryDirectory() as run:
    ...     with af.profile(run, with_flops=True) as prof:
    ...         for _ in range(3):
    ...             state, _ = step(state, torch.randn(8, 4))
    ...             prof.step()
    ...     traces = [p.name.split(".")[0] for p in prof.traces]
    >>> traces
    ['rank0']
    >>> [e.flops for e in prof.key_averages() if e.key == "aten::addmm"]  # 3 steps x 2*8*4*2
    [384]
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from torch import profiler as _profiler

from . import platforms
from .collective import rank as _rank

__all__ = ["profile", "Profile"]

_SCHEDULE_KEYS = ("wait", "warmup", "active", "repeat", "skip_first")
_KEYWORD_DEFAULTS = {"wait": 1, "warmup": 1, "active": 3, "repeat": 1, "skip_first": 0}
"""What the schedule keywords not given default to once one is given (af.profile's former fixed schedule)."""


class Profile:
    """What `af.profile` yields. Call `step()` once per training step (it marks `ProfilerStep#N` in the trace and
    moves a schedule on); the block is profiled without it too. `dir` is where the traces go (None without a
    run dir), `traces` the Chrome traces this rank wrote so far, and `profiler` the `torch.profiler.profile`
    itself; its methods are also reachable here, as on what `accelerator.profile()` yields:
    `prof.key_averages().table(...)`, `prof.export_chrome_trace(path)`."""

    def __init__(self, prof: _profiler.profile, directory: Path | None) -> None:
        self.profiler = prof
        self.dir = directory
        self.traces: list[Path] = []

    def step(self) -> None:
        """Mark the end of one training step (moves the profiler's schedule on)."""
        self.profiler.step()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("profiler", "dir", "traces"):
            raise AttributeError(name)
        return getattr(self.profiler, name)


def _activities(platform: platforms.Platform) -> list[_profiler.ProfilerActivity]:
    """CPU, and the platform's own device when torch's profiler can trace it (CUDA, XPU, ...)."""
    supported = _profiler.supported_activities()
    found = [_profiler.ProfilerActivity.CPU]
    device = getattr(_profiler.ProfilerActivity, platform.device_type.upper(), None)
    if device is not None and device not in found and device in supported and platform.is_available():
        found.append(device)
    return found


def _activity(item: str | _profiler.ProfilerActivity) -> _profiler.ProfilerActivity:
    """A `ProfilerActivity`, or its name as Accelerate's `ProfileKwargs(activities=["cpu", "cuda"])` spells it."""
    if isinstance(item, _profiler.ProfilerActivity):
        activity = item
    else:
        named = getattr(_profiler.ProfilerActivity, str(item).upper(), None)
        if not isinstance(named, _profiler.ProfilerActivity):
            names = ", ".join(repr(n.lower()) for n in _profiler.ProfilerActivity.__members__)
            raise ValueError(f"af.profile: unknown activity {item!r}; one of {names} (or a ProfilerActivity)")
        activity = named
    supported = _profiler.supported_activities()
    if activity not in supported:
        names = ", ".join(sorted(repr(a.name.lower()) for a in supported))
        raise ValueError(
            f"af.profile: torch's profiler cannot trace {activity.name.lower()!r} here (it can: {names})"
        )
    return activity


def _schedule(
    schedule: Callable[[int], _profiler.ProfilerAction] | Mapping[str, int] | None,
    keywords: dict[str, int | None],
) -> Callable[[int], _profiler.ProfilerAction]:
    """The profiler's schedule: the one given, torch.profiler.schedule of a dict (Accelerate's `schedule_option`),
    of the keywords (those not given take af.profile's defaults), or every step recorded."""
    given = {k: v for k, v in keywords.items() if v is not None}
    if schedule is not None and given:
        raise ValueError(f"af.profile: give either schedule= or the keywords {', '.join(given)}, not both")
    if schedule is None and not given:
        # the whole block, with a ProfilerStep# marker per step()
        return lambda _step: _profiler.ProfilerAction.RECORD
    if schedule is not None and not isinstance(schedule, Mapping):
        if not callable(schedule):
            raise TypeError(
                f"af.profile: schedule= takes torch.profiler.schedule(...), a function of the step, or a dict of "
                f"its arguments; got {type(schedule).__name__}"
            )
        return schedule
    if schedule is not None:  # a dict: torch.profiler.schedule's arguments and defaults, as Accelerate's
        unknown = sorted(set(schedule) - set(_SCHEDULE_KEYS))
        if unknown:
            raise ValueError(
                f"af.profile: unknown schedule key(s) {unknown}; known: {', '.join(_SCHEDULE_KEYS)}"
            )
        missing = [k for k in ("wait", "warmup", "active") if k not in schedule]
        if missing:
            raise ValueError(
                f"af.profile: the schedule dict needs {', '.join(missing)} (torch.profiler.schedule's)"
            )
        args = {"repeat": 0, "skip_first": 0, **schedule}
    else:
        args = {**_KEYWORD_DEFAULTS, **given}
    for name, value in args.items():
        if not isinstance(value, int) or value < (1 if name == "active" else 0):
            raise ValueError(f"af.profile: {name} must be >= {1 if name == 'active' else 0}, got {value!r}")
    return _profiler.schedule(**args)


@contextlib.contextmanager
def profile(
    run_dir: str | os.PathLike[str] | None = None,
    *,
    schedule: Callable[[int], _profiler.ProfilerAction] | Mapping[str, int] | None = None,
    wait: int | None = None,
    warmup: int | None = None,
    active: int | None = None,
    repeat: int | None = None,
    skip_first: int | None = None,
    activities: Iterable[str | _profiler.ProfilerActivity] | None = None,
    record_shapes: bool = False,
    profile_memory: bool = False,
    with_stack: bool = False,
    with_flops: bool = False,
    with_modules: bool = False,
    on_trace_ready: Callable[[_profiler.profile], Any] | None = None,
    memory_snapshot: bool | None = None,
) -> Iterator[Profile]:
    """Profile the `with` block with torch.profiler; call `.step()` on what it yields once per training step.

    By default every step of the block is recorded, as Accelerate's `accelerator.profile()` does, and each
    rank writes one Chrome trace when the block ends, `run_dir/profile/rank{r}.<time>.pt.trace.json` (open it
    in https://ui.perfetto.dev, chrome://tracing, or TensorBoard with the `torch-tb-profiler` plugin; listed
    in `prof.traces`). Without `run_dir` nothing is written: read `prof.key_averages()` after the block.

    A schedule records only some steps, each window written as it ends: `schedule=` takes a
    `torch.profiler.schedule(...)` (or any function of the step), or a dict of its arguments (Accelerate's
    `ProfileKwargs(schedule_option=...)`, torch's defaults: `repeat=0` cycles until the block ends); or give
    the keywords `wait`, `warmup`, `active`, `repeat`, `skip_first` (those left out default to 1, 1, 3, 1, 0:
    skip 1 step, warm up 1, record 3, once).

    `activities` (default: CPU, and the platform's device, CUDA or XPU, when it has one) takes
    `ProfilerActivity` values or their names (`["cpu", "cuda"]`, as `ProfileKwargs`). `record_shapes`,
    `profile_memory`, `with_stack`, `with_flops` (FLOPs of matmuls and convolutions, in
    `key_averages()`) and `with_modules` are torch.profiler's options; `on_trace_ready(profiler)`
    is called each time a trace is ready, after this rank's trace file is written. `memory_snapshot` (default:
    on where the platform records allocations, i.e. CUDA, with a `run_dir`) records every allocation during
    the block and writes `run_dir/profile/rank{r}_memory.pickle` on exit, for https://pytorch.org/memory_viz
    (torch's own format, a pickle: accelfn only writes it, never reads it).

    Example:
        >>> import tempfile, torch, accelfn as af
        >>> with tempfile.TemporaryDirectory() as run, af.profile(run, wait=0, warmup=1, active=1) as prof:
        ...     for _ in range(2):
        ...         _ = torch.ones(4, 4) @ torch.ones(4, 4)
        ...         prof.step()
        ...     any(prof.dir.iterdir())
        True
    """
    keywords = {"wait": wait, "warmup": warmup, "active": active, "repeat": repeat, "skip_first": skip_first}
    schedule_fn = _schedule(schedule, keywords)
    platform = platforms.detect()
    wanted = _activities(platform) if activities is None else [_activity(a) for a in activities]
    if not wanted:
        raise ValueError("af.profile: activities is empty; leave it unset for CPU and the device")
    rank = _rank()
    directory = None if run_dir is None else Path(run_dir) / "profile"
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
    if memory_snapshot and directory is None:
        raise ValueError("af.profile(memory_snapshot=True) writes run_dir/profile/...: give a run_dir")
    if memory_snapshot is None:
        snapshot = directory is not None and platform.record_memory_history(True)
    elif memory_snapshot:
        snapshot = platform.record_memory_history(True)
        if not snapshot:
            raise ValueError(
                f"af.profile(memory_snapshot=True): the {platform.kind} platform records no allocation history "
                "(only CUDA does); leave memory_snapshot unset or use profile_memory=True"
            )
    else:
        snapshot = False
    result: Profile | None = None

    def trace_ready(prof: _profiler.profile) -> None:
        if directory is not None and result is not None:
            path = (
                directory / f"rank{rank}.{time.time_ns()}.pt.trace.json"
            )  # tensorboard_trace_handler's naming
            prof.export_chrome_trace(str(path))
            result.traces.append(path)
        if on_trace_ready is not None:
            on_trace_ready(prof)

    try:
        prof = _profiler.profile(
            activities=wanted,
            schedule=schedule_fn,
            on_trace_ready=trace_ready,
            record_shapes=record_shapes,
            profile_memory=profile_memory,
            with_stack=with_stack,
            with_flops=with_flops,
            with_modules=with_modules,
        )
        result = Profile(prof, directory)
        with prof:
            yield result
    finally:
        if snapshot and directory is not None:
            try:
                platform.dump_memory_history(str(directory / f"rank{rank}_memory.pickle"))
            finally:
                platform.record_memory_history(False)
