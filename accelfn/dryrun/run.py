"""`af.dry_run`: a script run as one rank of a large world, on torch's fake process group, every tensor fake.

The script runs unmodified (`runpy`), through the real `af.Mesh`, `af.shard` and combinators; its training
calls go through a `Session` (an `accelfn.dry_mode.Watcher`) that measures the first `steps` calls of each
step object with a `StepTracker` and stops the script when its loop comes round (a step object called once
more). The report covers every step object called: memory counts the states of the others that are alive
beside each one, communication and FLOPs sum over one iteration of the script's loop.

The parts, one module each (imports flow down): `world` (the fake process group and fake tensors), `records`
and `session` (the watcher of training calls and what it records), `search` (the micro-batch and rank
searches), `layout` (process groups to mesh axes, bus bytes), `summary` (the `Report` from a session), and this
module, the entry point that runs the script in them.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from .. import dry_mode
from .fused_attention import fused_dropout_attention
from .report import Assumptions, Report
from .search import rank_candidates
from .session import Session, StopDryRun
from .summary import _report
from .tracker import InitTracker
from .world import _clear_dtensor_caches, fake_world

# Session, StopDryRun: this module's since it was one; rank_candidates, _clear_dtensor_caches: imported from
# here by tests
__all__ = ["dry_run", "Session", "StopDryRun", "rank_candidates", "fake_world", "_clear_dtensor_caches"]


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


class _StderrTail:
    """`sys.stderr` while the script runs: written through, its last `keep` characters kept, so that a script
    exiting on its own (argparse's usage error) can be quoted where its stderr is not shown (the planner's
    workers)."""

    def __init__(self, stream: Any, keep: int = 1500) -> None:
        self._stream, self._keep, self.tail = stream, keep, ""

    def write(self, text: str) -> int:
        self.tail = (self.tail + text)[-self._keep :]
        return int(self._stream.write(text))

    def __getattr__(self, name: str) -> Any:  # flush, isatty, fileno, encoding, ...
        return getattr(self._stream, name)


@contextlib.contextmanager
def _stderr_tail() -> Iterator[_StderrTail]:
    saved = sys.stderr
    sys.stderr = tail = _StderrTail(saved)
    try:
        yield tail
    finally:
        sys.stderr = saved


def _exit_message(code: Any, tail: str) -> str:
    """Why the script exited before its first training step, with what it last wrote to stderr."""
    said = tail.strip()
    text = f"af.dry_run: the script exited ({code!r}) before its first training step"
    if code == 2:
        text += (
            " (status 2: argparse's, for a command line it refuses; the dry run's own options, such as --gpu or "
            "--nproc-per-node, go before the script's path, the script's own after it)"
        )
    else:
        text += (
            ". The dry run measures training steps (af.train_step, possibly under af.shard and other "
            "combinators); a script with none (inference only) has nothing to measure, and its own checks read "
            "fake values (0) here"
        )
    return text + (f". Its last words on stderr:\n{said}" if said else "")


_BEFORE_FIRST_STEP = (
    "af.dry_run: raised before the script's first training step. The dry run measures training steps "
    "(af.train_step, possibly under af.shard and other combinators); a script with none (inference only) has "
    "nothing to measure, and runs here on fake tensors (no values)"
)


def _execute(
    script: str | os.PathLike[str] | Callable[[], Any], args: Sequence[str], session: Session
) -> None:
    """Run the script (as `python script.py args` would) until the session stops it."""
    tail: _StderrTail | None = None
    try:
        with _stderr_tail() as tail:
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
                raise RuntimeError(_exit_message(e.code, tail.tail if tail is not None else "")) from e
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
    step object and stops the script when its loop comes round (`step` as for `dry_run`). Collectives (functional
    and c10d's, point to point aside) run on copies and are waited for at once, so the backend's worker thread,
    which drops its references after the wait returns, frees nothing the step counts (the measured run does not
    overlap them); c10d's write their results into the caller's tensors and return a completed Work."""
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
    on_model: Callable[[Any], None] | None = None,
) -> tuple[Report, Session]:
    from torch._guards import detect_fake_mode

    capacity = spec.memory_bytes - assumptions.reserve_bytes if spec is not None else None
    session = Session(steps, capacity, search, step)
    session.on_model = on_model
    session.device_is_host = device == "cpu"
    session.spec = spec
    session.routing = assumptions.moe_routing
    start = time.perf_counter()
    # a GPU runs attention with dropout as one fused kernel, the CPU as its math path (fused_attention)
    fused = fused_dropout_attention() if device != "cpu" else contextlib.nullcontext()
    with dry_mode.watching(session), fake_world(world, rank, nproc_per_node, mesh) as reads, fused:
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
    on_model: Callable[[Any], None] | None = None,
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
    `af.Mesh.from_env()`. `search=False` skips the search for the largest micro-batch. `on_model` is called
    with each model given to `step.init`, before its lowering (the planner's layer-extrapolated tier keeps a
    few of its blocks). Errors the real first step would raise are raised unchanged.

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
    common: dict[str, Any] = dict(
        world=world,
        nproc_per_node=nproc_per_node,
        steps=steps,
        step=step,
        spec=spec,
        device=device,
        mesh=mesh,
        assumptions=assumptions,
        on_model=on_model,
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
