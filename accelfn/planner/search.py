"""The planner's last tier: dry runs of the candidates that survived, two worker processes at a time.

Each `Job` is one `af.dry_run` of the unmodified script with the candidate's mesh and knobs in the
environment (as `accelfn launch --config plan.yaml` passes them); a worker process is reused from job to job
(the imports and the script's module-level work are paid once). A job returns plain data: the report as a
dict, or the error the lowering raised, and the knobs the script asked for ("auto").

Example:
    >>> job = Job(script="train.py", args=("--model", "tiny"), nproc_per_node=8, nnodes=1, mesh="dp=8")
    >>> job.world
    8
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import io
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs

from .. import launch_env
from ..dryrun.report import error_summary

__all__ = ["Job", "run_job", "Pool"]


@attrs.frozen
class Job:
    """One dry run: the script and its args, the world, the device row, the mesh and the knobs' env."""

    script: str
    args: tuple[str, ...]
    nproc_per_node: int
    nnodes: int
    mesh: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    device: str = "cuda"
    gpu: str | None = None
    rank: int | str = (
        0  # or "ends": the first and the last rank (a pipeline's first and last stages), the worse
    )
    reserve_bytes: int | None = None  # the device memory kept free (None: the dry run's default)
    scale: float = 1.0  # the calibrated compute speed (`calibrate.scaled_assumptions`)
    blocks: tuple[int, ...] = ()  # the layer-extrapolated tier: the blocks kept per stage (see extrapolate)
    stages: int = 1  # the pipeline stages the mesh and schedule split the model into (pp x v)
    one_chunk: bool = False  # the loss in one chunk (the probe: the same FLOPs, far fewer fake ops)
    torch_version: str | None = None  # the torch the job runs (None: the installed one): its SDPA kernel
    # the mixed precision it launches with, as `accelfn launch` passes it (`Config.precision_env`; (): none set)
    precision: tuple[tuple[str, str], ...] = ()
    zero3: bool = False  # the script fixes DeepSpeed ZeRO-3 (measured at its second step, as `steps` says)

    @property
    def world(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def steps(self) -> int:
        """The calls of the step the dry run measures (its report's collectives and time are the last one's):
        ZeRO-3's first step records DeepSpeed's trace (each param gathered for its forward and its backward,
        under fp16 also for an af.Loss's count forwards), its second is the steady step the plan is for."""
        strategy = dict(self.env).get(launch_env.ACCELFN_STRATEGY)
        return 2 if strategy == "zero3" or (strategy is None and self.zero3) else 1


def run_job(job: Job) -> dict[str, Any]:
    """Run `job` in this process: `{"report": dict, "asked": [...]}`, or `{"error": str, "lowering": bool,
    "asked": [...]}` where the script (its lowering, when `lowering`) raised. With `job.blocks`, one dry run
    per (rank, periods) with the model cut to that many periods of blocks per stage (`extrapolate.keep_blocks`):
    `{"reports": {periods: [one per rank]}, "asked": [...]}`, each report with `"at"`, the blocks its rank
    ran, and `"full"`, those it runs in the whole model (a pipeline's split read from the balanced split); a
    full dry run instead where the model cannot be cut (`"whole"`: why) or the cut runs do not give two
    points of each rank's line. Each result but an error also has the model's `"blocks"`, its leading unlike
    blocks `"lead"` and their `"period"` (None: none; `extrapolate.Layout`); `"wall_s"`: the job's wall time.
    A cut run that paid a one-off cost of this process (its first dry run, or one that imported modules: a
    strategy's backend, inductor) is run again and the second kept (`_warm_run`): its `elapsed_s` is what the
    full dry run's wall time is extrapolated from; `"warmup_s"`: the time the first ones took over it."""
    start = time.monotonic()
    out = _run_job(job)
    return {**out, "wall_s": time.monotonic() - start}


def _run_job(job: Job) -> dict[str, Any]:
    counts: dict[str, bool] = {}
    with _loss_counts(counts):
        out = _run_job_seen(job)
    return out if "error" in out else {**out, "loss_counts": counts.get("loss_counts", False)}


def _run_job_seen(job: Job) -> dict[str, Any]:
    from ..transforms.shard.expert_parallel import GIVEN
    from .experts import recording_shapes
    from .extrapolate import keep_blocks

    launch_env.ASKED.clear()
    launch_env.FIXED.clear()
    GIVEN.clear()  # the ep plan this job's script gives af.shard (read by recording_shapes)
    ranks = [0, job.world - 1] if job.rank == "ends" else [int(job.rank)]
    # the stage counts to read each rank's blocks for: the expected one, and those of a schedule the script
    # fixes with another number of stages per rank
    stages = (
        tuple(s for s in (job.stages, 2 * job.stages, job.stages // 2) if s > 1) if job.stages > 1 else ()
    )
    try:
        seen: dict[str, Any] = {}
        done: list[Any] = []  # full dry runs made already: the cut hook left a model whole that it cannot cut
        if job.blocks:
            every = _remat_every(job)
            seen, cut, done, ran = _cut_runs(job, ranks, stages, every)
            if ran != every:  # the script fixes its own af.remat(every=n): cut again, to whole periods of it
                seen, cut, done, ran = _cut_runs(job, ranks, stages, ran)
            complete = not done and all(len(cut[n]) == len(ranks) for n in job.blocks)
            if complete and all(
                len({cut[n][i]["at"] for n in job.blocks}) == len(job.blocks) for i in range(len(ranks))
            ):
                warmup = {"warmup_s": seen["warmup_s"]} if seen.get("warmup_s") else {}
                return {"reports": cut, "asked": sorted(launch_env.ASKED), **_layout(seen), **warmup}
            # a rank's blocks did not change between the cuts (no line through them): measured in full
        reports = done + [
            _dry_run(job, rank, recording_shapes(keep_blocks(None, seen), seen))
            for rank in ranks[len(done) :]
        ]
        report = max(reports, key=lambda r: r.per_rank["peak"])  # the first of equals
        return {
            "report": report.to_dict(),
            "experts": seen.get("experts", 0),
            "expert_bytes": seen.get("expert_bytes", 0),
            "moe": seen.get("moe") or {},
            "decoder": seen.get("decoder") or {},
            "zero3": seen.get("zero3") or {},
            "asked": sorted(launch_env.ASKED),
            # the knobs the script fixes, those of plain values (JSON: the probe's result crosses processes)
            "fixed": {k: v for k, v in launch_env.FIXED.items() if isinstance(v, (bool, int, str))},
            **_layout(seen),
        }
    except Exception as e:  # noqa: BLE001 - the script's (or its lowering's) error is the candidate's verdict
        lowering = isinstance(e, (ValueError, NotImplementedError))  # (not a stage's wrapped error)
        return {"error": error_summary(e), "lowering": lowering, "asked": sorted(launch_env.ASKED)}


def _cut_runs(
    job: Job, ranks: list[int], stages: tuple[int, ...], every: int
) -> tuple[dict[str, Any], dict[int, list[dict[str, Any]]], list[Any], int]:
    """The dry runs of `job` as each of `ranks` with the model cut to each of `job.blocks` periods per stage
    (`keep_blocks`, the script's `af.remat` taken to checkpoint every `every`-th block): `(seen, reports by
    periods, each with "at" and "full", full runs, every)`. Stopped at the first run where the hook left the
    model whole (that run, a full dry run, in the third), or where the step's remat checkpoints every n-th
    block for another n (returned last: the cut is run again with it)."""
    from .experts import recording_shapes
    from .extrapolate import keep_blocks, rank_blocks, remat_every

    seen: dict[str, Any] = {}
    cut: dict[int, list[dict[str, Any]]] = {n: [] for n in job.blocks}
    for n in job.blocks:
        for rank in ranks:
            hook = recording_shapes(keep_blocks(n, seen, stages, every), seen)
            run, warmup = _warm_run(job, rank, hook, again=lambda: "whole" not in seen)
            seen["warmup_s"] = seen.get("warmup_s", 0.0) + warmup
            if "whole" in seen:
                return seen, cut, [run], every
            report = run.to_dict()
            ran = remat_every(report.get("strategy") or "")
            if ran != every:
                return seen, cut, [], ran
            on = rank_blocks(report, seen.get("cut", {}))
            full = rank_blocks(report, seen.get("full", {}))
            if on is None:  # no pipeline: the rank's blocks are those kept (leading unlike ones too)
                on, full = seen.get("kept", 0), seen.get("blocks", 0)
            cut[n].append({**report, "at": on, "full": full})
    return seen, cut, [], every


# what the script reads its mixed precision from (set by `Job.precision`, else unset)
PRECISION_VARS = (
    launch_env.ACCELFN_MIXED_PRECISION,
    launch_env.ACCELFN_FP8_BACKEND,
    launch_env.ACCELFN_FP8_RECIPE,
)
_RUNS = [0]  # the dry runs this process has made (its first pays the process's warm-up)


def _warm_run(
    job: Job, rank: int, hook: Callable[[Any], None], again: Callable[[], bool]
) -> tuple[Any, float]:
    """`_dry_run(job, rank, hook)` timed apart from this process's one-off costs: a run that is the process's
    first, or that imported modules (the script's, a strategy's backend), is run again where `again()` (the
    figures are the same; the time is not: a cold worker's first cut of 8B took 2.6 s more than the next), and
    the second is returned with the time the first took over it."""
    first, modules = _RUNS[0] == 0, len(sys.modules)
    run = _dry_run(job, rank, hook)
    if (not first and len(sys.modules) == modules) or not again():
        return run, 0.0
    warm = _dry_run(job, rank, hook)
    return warm, max(run.elapsed_s - warm.elapsed_s, 0.0)


def _remat_every(job: Job) -> int:
    """The `every` of the remat knob `job` gives the script (1 without one: the script may fix its own)."""
    value = dict(job.env).get(launch_env.KNOBS["remat"][0], "none")
    try:
        return int(launch_env.remat_args(value)["every"]) if value not in ("none", "auto") else 1
    except ValueError:
        return 1


def _layout(seen: dict[str, Any]) -> dict[str, Any]:
    """What the hooks saw of the model's blocks (`extrapolate.keep_blocks`): how many, the leading unlike ones,
    their period (None: none), and why they were not cut where they were not."""
    out = {"blocks": seen.get("blocks", 0), "lead": seen.get("lead", 0), "period": seen.get("period")}
    return {**out, "whole": seen["whole"]} if "whole" in seen else out


def _dry_run(job: Job, rank: int, on_model: Callable[[Any], None] | None) -> Any:
    """One `af.dry_run` of `job` as `rank`, the knobs' environment set and the script's output kept quiet."""
    from ..dryrun import dry_run
    from ..losses import chunked
    from .calibrate import scaled_assumptions

    _RUNS[0] += 1
    # the knobs and the precision are the job's alone: none leaks in from this process's environment
    unset = [var for var, _ in launch_env.KNOBS.values()] + list(PRECISION_VARS)
    quiet = io.StringIO()  # the script's own prints and progress bars
    with (
        launch_env.environ_set({**dict(job.env), **dict(job.precision)}, unset=unset),
        contextlib.redirect_stdout(quiet),
        contextlib.redirect_stderr(quiet),
        _one_chunk(chunked) if job.one_chunk else contextlib.nullcontext(),
    ):
        return dry_run(
            job.script,
            job.args,
            nproc_per_node=job.nproc_per_node,
            nnodes=job.nnodes,
            device=job.device,
            gpu=job.gpu,
            mesh=job.mesh,
            rank=rank,
            search=False,
            assumptions=scaled_assumptions(job.scale, job.gpu, job.reserve_bytes, job.torch_version),
            on_model=on_model,
            steps=job.steps,
        )


@contextlib.contextmanager
def _one_chunk(chunked: Any) -> Iterator[None]:
    """The chunked cross entropy in one chunk, for the probe (its states and compute are read, not its peak: a
    global batch of 8k-token sequences at a 128k vocabulary is thousands of chunks, minutes of fake ops)."""
    saved = chunked.CHUNK_ELEMENTS
    chunked.CHUNK_ELEMENTS = 1 << 62
    try:
        yield
    finally:
        chunked.CHUNK_ELEMENTS = saved


@contextlib.contextmanager
def _loss_counts(seen: dict[str, bool]) -> Iterator[None]:
    """Records in `seen["loss_counts"]` whether the step's loss counts its elements (an af.Loss; a mean loss
    does not), as the engine's forward and backward reads it: under fp16 DeepSpeed's step counts each of
    several micro-batches of an af.Loss by a forward first (`deepspeed.phases.counted_forwards`), which ZeRO-3
    gathers the params for (`traffic`)."""
    from ..engine import phases

    read = phases.loss_parts

    def parts(out: Any) -> Any:
        total, count, aux = read(out)
        seen["loss_counts"] = seen.get("loss_counts", False) or count is not None
        return total, count, aux

    phases.loss_parts = parts  # type: ignore[assignment]
    try:
        yield
    finally:
        phases.loss_parts = read  # type: ignore[assignment]


def _init_worker() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


class Pool:
    """`workers` spawned processes that run jobs (this process when `workers` is 1); a context manager.

    Example:
        >>> with Pool(workers=1) as pool:  # doctest: +SKIP
        ...     result = pool.run(Job("train.py", (), 8, 1))
    """

    def __init__(self, workers: int = 2) -> None:
        self.workers = workers
        self._pool: cf.ProcessPoolExecutor | None = None

    def __enter__(self) -> Pool:
        if self.workers > 1:
            ctx = multiprocessing.get_context("spawn")
            self._pool = cf.ProcessPoolExecutor(
                max_workers=self.workers, mp_context=ctx, initializer=_init_worker
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def run(self, job: Job) -> dict[str, Any]:
        """One job, waited for."""
        return self._pool.submit(run_job, job).result() if self._pool is not None else run_job(job)

    def map(
        self,
        jobs: Iterable[Job],
        *,
        deadline: float | Callable[[], float] | None = None,
        done: Callable[[], None] | None = None,
        skip: Callable[[Job], dict[str, Any] | None] | None = None,
        wait: Callable[[Job], bool] | None = None,
        then: tuple[Callable[[], bool], Sequence[Job]] | None = None,
    ) -> Iterator[tuple[Job, dict[str, Any] | None]]:
        """Yield `(job, result)` as jobs finish, `result` None for the jobs not started before `deadline` (a
        `time.monotonic()` value, or a function giving it as the jobs finish); `skip(job)`, asked as each job is about to start (so it sees what the jobs
        before it found), returns the result to yield instead of running it (None: run it). A job for which
        `wait(job)` is true while others run is started after them (the first pending job not waiting runs
        meanwhile, and first where none runs): its verdict may depend on theirs. `then=(switch, order)`: once `switch()` is true, the jobs
        not yet started go in `order`'s order (the same jobs, another order). A `skip` verdict `{"defer": True}`
        puts the job after every other pending one, once (asked again when it comes round, it runs unless
        skipped otherwise)."""
        pending = list(jobs)
        running: dict[cf.Future[dict[str, Any]], Job] = {}
        width = self.workers if self._pool is not None else 1
        deferred: set[Job] = set()
        while pending or running:
            if then is not None and then[0]():
                left = set(pending)
                pending = [j for j in then[1] if j in left and j not in deferred]
                pending += [j for j in then[1] if j in left and j in deferred]
                then = None
            while pending and len(running) < width:
                # the first pending job not waiting (a scan that stops there: thousands of jobs may be pending);
                # with none running, the first pending one where all wait (a deferred job they wait for, at the
                # end of the queue, still runs before them)
                ready = next((i for i, j in enumerate(pending) if wait is None or not wait(j)), None)
                if ready is None:
                    if running:
                        break
                    ready = 0
                job = pending.pop(ready)
                verdict = skip(job) if skip is not None else None
                if verdict is not None and verdict.get("defer"):
                    if job not in deferred:  # after the others, once
                        deferred.add(job)
                        pending.append(job)
                        continue
                    verdict = None
                if verdict is not None:
                    yield job, verdict
                elif deadline is not None and time.monotonic() > (
                    deadline() if callable(deadline) else deadline
                ):
                    yield job, None
                elif self._pool is None:
                    yield job, run_job(job)
                else:
                    running[self._pool.submit(run_job, job)] = job
                    continue
                if done:
                    done()
            if not running:
                continue
            finished, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for f in finished:
                job = running.pop(f)
                yield job, f.result()
                if done:
                    done()
