"""`af.profile`: torch.profiler over a few training steps, one Chrome trace per rank under `RUN_DIR/profile`.

Example:
    >>> import tempfile, torch, accelfn as af
    >>> step = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1))
    >>> state = step.init(torch.nn.Linear(4, 2))
    >>> with tempfile.TemporaryDirectory() as run, af.profile(run, wait=0, warmup=1, active=1) as prof:
    ...     for _ in range(3):
    ...         state, _ = step(state, torch.randn(8, 4))
    ...         prof.step()
    ...     traces = sorted(p.name.split(".")[0] for p in prof.dir.glob("*.json"))
    >>> traces
    ['rank0']
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from torch import profiler as _profiler

from . import platforms
from .collective import rank as _rank

__all__ = ["profile", "Profile"]


class Profile:
    """What `af.profile` yields: call `step()` once per training step. `dir` is where the traces go;
    `profiler` is the `torch.profiler.profile` itself (e.g. for `key_averages()`)."""

    def __init__(self, prof: _profiler.profile, directory: Path) -> None:
        self.profiler = prof
        self.dir = directory

    def step(self) -> None:
        """Mark the end of one training step (moves the profiler's schedule on)."""
        self.profiler.step()


def _activities(platform: platforms.Platform) -> list[_profiler.ProfilerActivity]:
    """CPU, and the platform's own device when torch's profiler can trace it (CUDA, XPU, ...)."""
    supported = _profiler.supported_activities()
    found = [_profiler.ProfilerActivity.CPU]
    device = getattr(_profiler.ProfilerActivity, platform.device_type.upper(), None)
    if device is not None and device not in found and device in supported and platform.is_available():
        found.append(device)
    return found


@contextlib.contextmanager
def profile(
    run_dir: str | os.PathLike[str],
    *,
    wait: int = 1,
    warmup: int = 1,
    active: int = 3,
    repeat: int = 1,
    record_shapes: bool = False,
    profile_memory: bool = False,
    with_stack: bool = False,
    memory_snapshot: bool | None = None,
) -> Iterator[Profile]:
    """Profile the steps of the `with` block with torch.profiler; call `.step()` on what it yields each step.

    The schedule skips `wait` steps, warms up for `warmup`, records `active` (`repeat` times; 0: until the
    block ends). Each rank writes its Chrome trace to `run_dir/profile/rank{r}.<time>.pt.trace.json` (open it in
    https://ui.perfetto.dev, chrome://tracing, or TensorBoard with the `torch-tb-profiler` plugin). CPU
    activity is always traced, the device's (CUDA, XPU) when the platform has it. `memory_snapshot` (default:
    on where the platform records allocations, i.e. CUDA) records every allocation during the block and writes
    `run_dir/profile/rank{r}_memory.pickle` on exit, for https://pytorch.org/memory_viz (torch's own format, a
    pickle: accelfn only writes it, never reads it).

    Example:
        >>> import tempfile, torch, accelfn as af
        >>> with tempfile.TemporaryDirectory() as run, af.profile(run, wait=0, warmup=1, active=1) as prof:
        ...     for _ in range(2):
        ...         _ = torch.ones(4, 4) @ torch.ones(4, 4)
        ...         prof.step()
        ...     any(prof.dir.iterdir())
        True
    """
    for name, value in (("wait", wait), ("warmup", warmup), ("repeat", repeat)):
        if value < 0:
            raise ValueError(f"af.profile: {name} must be >= 0, got {value}")
    if active < 1:
        raise ValueError(f"af.profile: active must be >= 1, got {active}")
    platform = platforms.detect()
    rank = _rank()
    directory = Path(run_dir) / "profile"
    directory.mkdir(parents=True, exist_ok=True)
    if memory_snapshot is None:
        snapshot = platform.record_memory_history(True)
    elif memory_snapshot:
        snapshot = platform.record_memory_history(True)
        if not snapshot:
            raise ValueError(
                f"af.profile(memory_snapshot=True): the {platform.kind} platform records no allocation history "
                "(only CUDA does); leave memory_snapshot unset or use profile_memory=True"
            )
    else:
        snapshot = False
    prof = _profiler.profile(
        activities=_activities(platform),
        schedule=_profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=repeat),
        on_trace_ready=_profiler.tensorboard_trace_handler(str(directory), worker_name=f"rank{rank}"),
        record_shapes=record_shapes,
        profile_memory=profile_memory,
        with_stack=with_stack,
    )
    try:
        with prof:
            yield Profile(prof, directory)
    finally:
        if snapshot:
            try:
                platform.dump_memory_history(str(directory / f"rank{rank}_memory.pickle"))
            finally:
                platform.record_memory_history(False)
