"""`af.plan`: the fastest configuration of an unmodified training script that fits, chosen on this CPU.

The tiers, cheapest first: a one-process dry run of the script (a probe) tells which knobs it leaves open
("auto", `accelfn.launch_env.knob`), the whole model's states, its blocks and its compute; the candidates of
those knobs and of the mesh are enumerated (`candidates`); the planner's own legality and the exact states bound
prune them (`prune`); the survivors are dry-run on fake ranks two processes at a time (`search`), the most
promising first (where memory binds, each memory group's most frugal candidate first: `memory`), each skipped
where an earlier one shows it cannot win: a lowering error of its mesh (a tp that does not divide the heads), a
smaller accumulation of the same configuration that fits or one of its group needing no more memory that does
not fit (dominated), or a lower bound of its step time (the probe's compute shared by the ranks, plus the
pipeline's bubble, plus the all-to-alls it waits for: those of the model's routed rows, `prune.routed_bound`, or
those a candidate of its mesh was measured to run, `prune.comm_bound`) above the best step time found (time bound). A model of many identical blocks per pipeline
stage is dry-run with 2 and 3 of its blocks per stage and extrapolated (`extrapolate`); the best rows so
measured are confirmed by full dry runs, within the budget: the search stops early enough to leave the
chosen row's confirmation its estimated time. The measured ones are ranked by predicted tokens/s per GPU
(`table`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from .. import launch_env
from ..transforms.shard import NO_PIPELINE
from .calibrate import Calibration
from .candidates import Candidate, Space, enumerate_candidates, parse_remats
from .critical import critical_traffic, gathers_in_fp8
from .extrapolate import BLOCKS, extrapolate
from .memory import BINDS, activation_share, frugal_candidates, needs_more_memory
from .memory import group as memory_group
from .prune import (
    Exchanges,
    States,
    all_to_all_time,
    comm_bound,
    illegal,
    lowered_remat,
    lowered_strategy,
    routed_bound,
    states_bound,
    time_bound,
)
from .search import Job, Pool
from .table import Fallen, Plan, Row
from .traffic import step_floor, traffic_of
from .zero3 import Zero3Shape

__all__ = ["plan"]

AXES = ("dp", "tp", "pp", "cp", "ep")  # ep: only for a model with experts (the probe counts them)
BOUND_SLACK = 0.98  # the time bound's margin below the least measured ratio
CONFIRM_SLACK = 1.2  # the margin on a confirmation's estimated wall time (the machine's load varies)
HSDP_PROBE_MESH = "dp=1,fsdp=1"  # the probe's mesh for a script whose strategy needs dp and fsdp axes (hsdp)


def _check(name: str, value: Any, minimum: float = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise ValueError(f"af.plan: {name} must be a number >= {minimum}, got {value!r}")


def _probe(
    pool: Pool,
    script: str,
    args: tuple[str, ...],
    gpu: str | None,
    device: str,
    gbs: int | None,
    torch_version: str | None = None,
    precision: tuple[tuple[str, str], ...] = (),
) -> dict[str, Any]:
    """The script as one process: which knobs it asks for, and the whole model's states; where its lowering
    refuses the mesh of dp alone, on `HSDP_PROBE_MESH` (a script that fixes hsdp)."""
    env = {
        launch_env.ACCELFN_STRATEGY: "ddp",
        launch_env.ACCELFN_OFFLOAD: "none",
        launch_env.ACCELFN_COMPILE: "none",
    }
    if gbs:
        env[launch_env.ACCELFN_GLOBAL_BATCH_SIZE] = str(gbs)
    job = Job(script, args, 1, 1, mesh=None, env=tuple(env.items()), device=device, gpu=gpu, one_chunk=True,
              torch_version=torch_version, precision=precision)  # fmt: skip
    result = pool.run(job)
    # a strategy the script fixes that needs a dp and an fsdp axis (hsdp): the probe again on both
    if "error" in result and result["lowering"] and "'fsdp'" in result["error"]:
        again = pool.run(attrs.evolve(job, mesh=HSDP_PROBE_MESH))
        result = again if "error" not in again else result
    if "error" in result:
        raise RuntimeError(
            f"af.plan: the script fails as one process (the planner's probe): {result['error']}"
        )
    return result


def _job(c: Candidate, base: Job) -> Job:
    """The dry run of `c`: `base` (the script, the world, the device) with its mesh and knobs."""
    env = tuple((launch_env.KNOBS[k][0], str(v)) for k, v in c.knobs().items())
    rank: int | str = "ends" if c.mesh.get("pp", 1) > 1 else 0
    return attrs.evolve(base, mesh=c.mesh_spec or None, env=env, rank=rank)


def _sync_each(described: str, fixed: Mapping[str, object]) -> bool:
    """Whether the script's pipeline reduce-scatters each micro-batch's gradients where a candidate does not
    say: its probe's step description (`Pipeline.describe`, where it lowered af.pipeline), else the value the
    script gave the knob (`launch_env.FIXED`: a script that builds its pipeline only when pp > 1 shows its
    one-process probe none). Where the script leaves the knob open the plan searches it (each candidate's own).

    Example:
        >>> _sync_each("Step(... -> pipeline(1f1b, microbatches=4, sync_each_microbatch=True) -> ...)", {})
        True
        >>> _sync_each("Step(... -> shard(fsdp))", {"pipeline_sync_each_microbatch": True})
        True
    """
    if "sync_each_microbatch=True" in described:
        return True
    return fixed.get("pipeline_sync_each_microbatch") is True


def plan(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    nproc_per_node: int = 8,
    nnodes: int = 1,
    gpu: str | None = None,
    device: str = "cuda",
    global_batch_size: int | None = None,
    budget_minutes: float = 15.0,
    axes: Sequence[str] = AXES,
    strategies: Sequence[str] | None = None,
    remats: Sequence[str] | None = None,
    workers: int = 2,
    progress: bool = False,
    prune: bool = True,
    memory_gib: float | None = None,
    calibration: Calibration | None = None,
    confirm: int = 3,
    extrapolate_min_blocks: int | None = 8,
    torch_version: str | None = None,
    mixed_precision: str = "no",
) -> Plan:
    """Search the configurations of `script` (run unmodified, with `args`) on `nproc_per_node` x `nnodes`
    devices of row `gpu` (default h100-sxm) and return the `Plan`: candidates ranked by predicted tokens/s per
    GPU among those that fit, and what fell at each tier and why.

    What the script leaves open is searched: the mesh when it reads `af.Mesh.from_env()` (over `axes`: dp,
    tp, pp, cp, and ep for a model with experts; tp, cp and ep inside a node), and each knob it passes
    as "auto" to `accelfn.launch_env.knob`
    (strategy, remat, accumulate, global_batch_size, pipeline_schedule, pipeline_microbatches, offload); what
    it fixes is kept, and the plan says so. `global_batch_size` is the batch the plan holds fixed (needed when
    the script leaves it open). `budget_minutes` bounds the dry runs (those not started by then fall at the
    tier "budget"); `workers` dry runs run at a time, each in its own spawned process (1: in this one).
    `memory_gib` is the usable memory per device (default: the row's memory less the dry run's reserve).
    `calibration` (`accelfn.planner.calibrate.load(gpu)`, from `accelfn plan --calibrate RUN_DIR`) scales the
    compute model to the measured runs on that device and gives each row its error band.
    `strategies` are the strategies searched where the script leaves its own open (default: ddp, fsdp, hsdp, and
    zero1-3, DeepSpeed's ZeRO stages, where DeepSpeed is installed); `remats` the remat values searched where it
    leaves remat open, any the knob takes (a policy, or ``POLICY:N``: that policy on every n-th block, e.g.
    ``("none", "full", "full:2", "selective:3")``; default: none, selective:2, selective, full), each checked by the
    knob's parser, duplicates dropped. Where the script fixes the knob, `strategies` and `remats` are not searched,
    and the plan's notes say so.
    `prune=False` dry-runs every candidate (the exhaustive search the pruned one is checked against).
    A candidate of a model with at least `extrapolate_min_blocks` periods of blocks per pipeline stage (None:
    never; a period is one block where they are alike: `extrapolate.Layout`) is measured by dry runs of its
    model cut to 2 and 3 periods per stage, extrapolated to all of them (rows marked `~`); blocks without a
    period, and a pipeline of blocks whose period is several, are full dry runs (the plan's notes say so);
    the best `confirm` rows are then re-measured by full dry runs (the chosen row's always, the budget or not).
    `torch_version` is the torch the job will run (default: the installed one, e.g. "2.11.0"): every dry run
    times attention as the SDPA kernel it picks (`accelfn dry-run --torch-version`), and the plan's notes say so.
    `mixed_precision` ("no", "bf16", "fp16", "fp8") is the one the job launches with (`accelfn launch
    --mixed-precision`): every dry run sets it as the launcher does, for a step under `af.autocast` (dtype
    "auto") or `af.autocast_fp8` to read, and the written config keeps it.

    Example:
        >>> import pathlib, tempfile, accelfn as af
        >>> script = pathlib.Path(tempfile.mkdtemp()) / "train.py"
        >>> _ = script.write_text(
        ...     "import torch, accelfn as af\\n"
        ...     "from accelfn.launch_env import knob\\n"
        ...     "mesh = af.Mesh.from_env()\\n"
        ...     "step = af.train_step(lambda m, b: af.losses.mse(m(b), b), af.optim.adamw(1e-3))\\n"
        ...     "step = af.shard(step, mesh, strategy=knob('strategy', 'auto', 'ddp'))\\n"
        ...     "state = step.init(torch.nn.Linear(512, 512))\\n"
        ...     "for _ in range(2):\\n"
        ...     "    state, _ = step(state, torch.randn(8, 512))\\n"
        ... )
        >>> p = af.plan(script, nproc_per_node=2, axes=("dp",), workers=1)
        >>> p.open_knobs, sorted(r.candidate.label for r in p.rows)
        (['mesh', 'strategy'], ['dp=2 ddp', 'dp=2 fsdp', 'dp=2 zero1', 'dp=2 zero2', 'dp=2 zero3'])
        >>> p.write_config(script.parent / "plan.yaml").name  # accelfn launch --config plan.yaml train.py
        'plan.yaml'
    """
    from ..dryrun.attention_speeds import sdpa_backend
    from ..dryrun.report import Assumptions, gib
    from ..launch.config import Config
    from ..platforms import specs

    start = time.monotonic()
    path = Path(script)
    if not path.is_file():
        raise ValueError(f"af.plan: no such script: {str(path)!r}")
    for name, value in (("nproc_per_node", nproc_per_node), ("nnodes", nnodes), ("workers", workers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"af.plan: {name} must be an integer >= 1, got {value!r}")
    if global_batch_size is not None and (
        isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1
    ):
        raise ValueError(f"af.plan: global_batch_size must be an integer >= 1, got {global_batch_size!r}")
    _check("budget_minutes", budget_minutes, minimum=0)
    bad_strategies = [s for s in strategies or () if s not in launch_env.STRATEGIES]
    if bad_strategies:
        raise ValueError(
            f"af.plan: strategies {bad_strategies} are not strategies; use some of {launch_env.STRATEGIES}"
        )
    searched_remats = parse_remats(remats, source="af.plan: remats") if remats is not None else None
    if torch_version is not None:
        try:
            sdpa_backend(torch_version, "")
        except (ValueError, AttributeError) as e:
            raise ValueError(f"af.plan: torch_version={torch_version!r}: {e}") from None
    if mixed_precision not in launch_env.MIXED_PRECISION:
        raise ValueError(
            f"af.plan: mixed_precision={mixed_precision!r} is not one of {', '.join(launch_env.MIXED_PRECISION)}"
        )
    precision = tuple(Config(mixed_precision=mixed_precision).precision_env().items())  # as the launcher's
    bad = [a for a in axes if a not in AXES]
    if bad:
        raise ValueError(f"af.plan: axes {bad} are not mesh axes the planner searches; use some of {AXES}")
    if gpu is None:
        gpu = "cpu" if device == "cpu" else "h100-sxm"
    try:
        spec = specs.spec(gpu)
    except ValueError as e:
        raise ValueError(f"af.plan: gpu={gpu!r}: {e}") from None
    reserve: int | None = None
    capacity = spec.memory_bytes - Assumptions().reserve_bytes
    scale, band = 1.0, None
    if calibration is not None:
        if calibration.gpu != gpu:
            raise ValueError(f"af.plan: the calibration is of {calibration.gpu!r}, the plan is for {gpu!r}")
        scale, band = calibration.scale, calibration.residual
    if memory_gib is not None:
        _check("memory_gib", memory_gib, minimum=0)
        capacity = int(memory_gib * 2**30)
        if capacity > spec.memory_bytes:
            raise ValueError(
                f"af.plan: memory_gib={memory_gib} is more than the {gpu} row's {spec.memory_bytes / 2**30:g} GiB"
            )
        reserve = spec.memory_bytes - capacity
    args = tuple(args)
    text = str(path)

    with Pool(workers) as pool:
        probe = _probe(pool, text, args, gpu, device, global_batch_size, torch_version, precision)
        asked = set(probe["asked"])
        if "global_batch_size" in asked and global_batch_size is None:
            raise ValueError(
                "af.plan: the script leaves the global batch size to the launch configuration ('auto'): give "
                "global_batch_size (accelfn plan --global-batch-size B), the batch the plan holds fixed"
            )
        # (not searched, neither open nor fixed: the script's default, or its launch config's)
        knobs = [k for k in launch_env.KNOBS if k != "pipeline_sync_each_microbatch"]
        open_knobs = ["mesh", *[k for k in knobs if k in asked]]
        fixed = [k for k in knobs if k not in asked and k != "global_batch_size"]
        totals = States.of(probe["report"]["per_rank"], experts=int(probe.get("expert_bytes", 0)))
        zero3 = Zero3Shape.of_probe(probe)  # what ZeRO-3 keeps gathered of the model (`traffic`)
        # a pipeline that reduce-scatters each micro-batch (no held gradients in the states bound), as the script
        # fixes it (seen where its probe lowered af.pipeline, or the value it gave the knob)
        script_sync_each = _sync_each(probe["report"].get("strategy", ""), probe.get("fixed") or {})
        # the strategy the script fixes, as its probe lowered it (it ignores the probe's ACCELFN_STRATEGY=ddp):
        # its legality (no af.offload with fsdp) and its states bound; None where it leaves it open
        fixed_strategy = (
            None if "strategy" in asked else lowered_strategy(probe["report"].get("strategy", ""))
        )
        # the remat the script fixes, as its probe lowered it: full remat's recomputed all-to-alls count in the
        # routed rows' bound (`prune.routed_bound`); None where it leaves remat open (each candidate's own)
        script_remat = None if "remat" in asked else lowered_remat(probe["report"].get("strategy", ""))
        space = Space(
            world=nproc_per_node * nnodes,
            nproc_per_node=nproc_per_node,
            open=frozenset(open_knobs),
            axes=tuple(axes),
            global_batch_size=global_batch_size,
            experts=int(probe.get("experts", 0)),
            fixed_strategy=fixed_strategy,
        )
        if strategies:
            space = attrs.evolve(space, strategies=tuple(strategies))
        if searched_remats is not None:
            space = attrs.evolve(space, remats=searched_remats)
        given = {"strategy": ("strategies", strategies or None), "remat": ("remats", searched_remats)}
        ignored = [
            f"{name}={','.join(values)} not searched: the script fixes its {knob} (kept as it is)"
            for knob, (name, values) in given.items()
            if values is not None and knob not in open_knobs
        ]
        candidates = enumerate_candidates(space)
        fallen: list[Fallen] = []
        survivors: list[Candidate] = []
        probed_blocks = int(probe.get("blocks", 0))
        for c in candidates:
            why = illegal(c, fixed_strategy)
            if why is None and "none" in space.remats and 0 < probed_blocks < _remat_every(c):
                # blocks n, 2n, ... checkpointed: none of a model of fewer blocks, the step of remat=none
                why = (f"remat={c.remat} checkpoints blocks {_remat_every(c)}, {2 * _remat_every(c)}, ... "
                       f"and the model has {probed_blocks}: the same step as remat=none")  # fmt: skip
            if why is None and prune:
                bound = states_bound(c, totals, script_strategy=None, script_sync_each=script_sync_each)
                if bound > capacity:
                    fallen.append(Fallen(c, "states bound", f"{c.label}: params + grads + optimizer >= "
                                         f"{gib(bound)} per rank > {gib(capacity)} usable"))  # fmt: skip
                    continue
            if why is not None:
                fallen.append(Fallen(c, "legality", f"{c.label}: {why}"))
            else:
                survivors.append(c)

        rows: list[Row] = []
        unfit: list[Row] = []
        notes: list[str] = list(ignored)
        version = torch_version or str(Assumptions().timing.torch_version)
        kernel = {"flash2": "FlashAttention-2", "cudnn": "cuDNN"}.get(sdpa_backend(version, spec.key))
        notes.append(f"times predicted for torch {version}{'' if torch_version else ' (the installed one)'}: "
                     f"attention as its SDPA kernel on {gpu}, {kernel}'s")  # fmt: skip
        if mixed_precision != "no":
            notes.append(f"mixed precision {mixed_precision}, as `accelfn launch --mixed-precision "
                         f"{mixed_precision}` sets it (a step under af.autocast or af.autocast_fp8 reads it)")  # fmt: skip
        deadline = start + budget_minutes * 60
        bar = _bar(len(survivors), progress)
        base = Job(text, args, nproc_per_node, nnodes, device=device, gpu=gpu, reserve_bytes=reserve,
                   scale=scale, torch_version=torch_version, precision=precision,
                   zero3=fixed_strategy == "zero3")  # fmt: skip
        blocks = int(probe.get("blocks", 0))
        # the compute of the whole global batch at the probe's (one process, the largest matmuls) efficiency:
        # a rank's share of it is a lower bound of any candidate's step time (only with the global batch fixed)
        probe_compute = (probe["report"].get("predicted") or {}).get("compute_s")
        # what expert parallel's all-to-alls move (`prune.routed_bound`): the model's MoE layers, row width and
        # top-k, and the global batch's tokens per step
        moe, tokens = probe.get("moe") or {}, int(probe["report"].get("tokens_per_step") or 0)
        bounded = prune and bool(probe_compute) and "global_batch_size" in asked and bool(global_batch_size)
        world = nproc_per_node * nnodes
        by_job: dict[Job, Candidate] = {}
        bad_mesh: dict[str, str] = {}
        # by (mesh, strategy): a lowering error that names its strategy (`af.shard(strategy=...)`'s own refusal)
        bad_strategy: dict[tuple[str, str | None], str] = {}
        no_pipeline: list[str] = []  # the lowering's error when the script's step has no af.pipeline
        # the meshes the script lowered another strategy on than as one process (its probe)
        other_strategy: dict[str, str | None] = {}
        # each (mesh, strategy)'s first candidate in the order run (its error prunes the mesh, or the strategy)
        first: dict[tuple[str, str | None], Candidate] = {}
        first_of_mesh: dict[str, Candidate] = {}  # each mesh's first candidate in the order run
        # each group's (every knob but accumulate) smallest accumulation that fits
        fitting: dict[tuple[object, ...], int] = {}
        # by memory group: the candidates measured not to fit (those needing at least their memory cannot)
        too_big: dict[tuple[object, ...], list[Row]] = {}
        # (pp, tp, cp, remat): the largest activations (peak less states) of a candidate measured not to fit over
        # the estimate's (`estimate`), by the split of the model, which the estimate's share scales alike: a later
        # candidate of that split whose estimate so corrected is above the usable memory runs after the others
        # (an order, not a pruning)
        activation_ratio: dict[tuple[object, ...], float] = {}
        # by memory group: its most frugal candidate, until measured (the rest of the group waits for it)
        frugal: dict[tuple[object, ...], Candidate] = {}
        best: list[float] = []  # the best fitting step time so far
        ratios: dict[str | None, list[float]] = {}  # by compile: each measured rank's compute / its share
        # by mesh: each dry-run candidate's all-to-alls (`prune.comm_bound` bounds its mesh's others' by them)
        exchanges: dict[str, list[Exchanges]] = {}
        # the routed bound checked against a measured candidate (None: not yet, False: one took less)
        routed_holds: bool | None = None
        counts = {"runs": 0, "extrapolated": 0, "confirmed": 0}
        walls: list[float] = []  # each finished job's wall time
        # each confirmed row's full dry run's wall time over the estimate its cut runs gave
        measured: list[float] = []

        def confirm_cost(r: Row) -> float:
            """What confirming `r` will take: its full dry run's wall time, estimated from its cut runs
            (`extrapolate.dry_run_seconds`, upper-ish) and scaled by the largest ratio of a full dry run's to its
            estimate that the plan measured (its confirmations), x CONFIRM_SLACK; none for a full dry run."""
            if not r.extrapolated:
                return 0.0
            return CONFIRM_SLACK * max(measured, default=1.0) * (r.dry_run_s or 0.0)

        def confirm_reserve() -> float:
            """What confirming the best row so far will take (`confirm_cost`)."""
            top = min(rows, key=_rank, default=None)
            return confirm_cost(top) if top is not None else 0.0

        def cutoff() -> float:
            """The last moment to start a dry run: the budget less the confirmation's reserve and the longest
            job's wall time so far (a job started then still runs; the median let the 405B plan's longer jobs run
            134 s past its budget), so that the whole plan fits in the budget."""
            return deadline - confirm_reserve() - (max(walls) if walls else 0.0)

        def lower(c: Candidate) -> float:
            """The probe's compute, scaled by the least ratio of a measured rank's compute to its share of it
            (the probe's efficiency is a model's, not a bound: 4% above the 8B fsdp ranks'), 2% below; the
            ratios of the candidate's own compile choice where one was measured (compiled: fewer kernels)."""
            mine = ratios.get(c.compile) or [r for rs in ratios.values() for r in rs]
            return time_bound(c, (probe_compute or 0.0) * min(mine, default=0.0) * BOUND_SLACK, world)

        def least_time(c: Candidate) -> tuple[float, str]:
            """`lower(c)` (where a compute was measured) plus the all-to-alls `c` waits for at least, x BOUND_SLACK:
            the larger of those a candidate of its mesh was measured to run (`prune.comm_bound`) and those the
            model's routed rows take (`prune.routed_bound`); and what the bound counts, in words."""
            compute = lower(c) if ratios else 0.0
            learned, source = comm_bound(c, exchanges.get(c.mesh_spec, ()))
            routed = routed_bound(c, moe, tokens, spec, nproc_per_node, script_remat) if routed_holds else 0.0
            comm = max(learned, routed) * BOUND_SLACK
            if not comm:
                return compute, f"its compute and bubble alone take >= {_ms(compute)} ms"
            how = (
                f"as {source.label} measured them"
                if source is not None and learned >= routed
                else f"its {moe['layers']} MoE layers' routed rows"
            )
            return compute + comm, (
                f"its compute and bubble take >= {_ms(compute)} ms and its all-to-alls >= {_ms(comm)} ms ({how})"
            )

        def extrapolating(c: Candidate) -> bool:
            """At least `extrapolate_min_blocks` periods of blocks per pipeline stage (the whole model without one;
            a period is a block where the blocks are alike: `extrapolate.Layout`, and `n` of them for remat every
            n-th block); never for blocks without a period, nor for a pipeline of blocks whose period is several
            blocks (the split ignores periods)."""
            period = probe.get("period")
            if extrapolate_min_blocks is None or period is None:
                return False
            period = math.lcm(period, _remat_every(c))  # blocks n, 2n, ... checkpointed: a period of its own
            if period > 1 and _stages(c) > 1:
                return False
            return blocks // period >= extrapolate_min_blocks * _stages(c)

        def job_of(c: Candidate) -> Job:
            job = _job(c, base)
            return attrs.evolve(job, blocks=BLOCKS, stages=_stages(c)) if extrapolating(c) else job

        notes.extend(_layout_notes(probe, extrapolate_min_blocks))

        def skip(job: Job) -> dict[str, Any] | None:
            c = by_job[job]
            if c.mesh_spec in bad_mesh:
                return {
                    "fell": "lowering",
                    "why": f"{bad_mesh[c.mesh_spec]} (as an earlier candidate of its mesh)",
                }
            if (c.mesh_spec, c.strategy) in bad_strategy:
                return {
                    "fell": "lowering",
                    "why": f"{bad_strategy[c.mesh_spec, c.strategy]} (as an earlier {c.strategy} candidate of its mesh)",
                }
            if no_pipeline and c.mesh.get("pp", 1) > 1:  # every pp mesh fails alike: one dry run says so
                return {
                    "fell": "lowering",
                    "why": f"{no_pipeline[0]} (as an earlier candidate with a pp axis)",
                }
            if not prune:
                return None
            over = next(
                (r for r in too_big.get(memory_group(c), []) if needs_more_memory(c, r.candidate)), None
            )
            if over is not None:
                return {
                    "fell": "dominated",
                    "why": f"needs at least the memory of {over.candidate.label}, measured not to fit "
                    f"(peak {gib(over.peak)} per rank > {gib(capacity)} usable)",
                }
            smaller = fitting.get(_group(c))
            if smaller is not None and c.accumulate is not None and smaller < c.accumulate:
                return {"fell": "dominated", "why": f"acc={smaller} fits (larger micro-batches, fewer steps)"}
            if bounded and best:
                least, what = least_time(c)
                if least > best[0]:
                    return {"fell": "time bound", "why": f"{what}, the best so far {_ms(best[0])} ms"}
            ratio = activation_ratio.get(_split_key(c))
            if ratio is not None and estimate(c, ratio) > capacity:
                return {"defer": True}
            return None

        def waits(job: Job) -> bool:
            c = by_job[job]
            return frugal.get(memory_group(c), c) is not c

        def record(c: Candidate, result: dict[str, Any] | None) -> None:
            nonlocal routed_holds
            if frugal.get(memory_group(c)) is c:
                del frugal[memory_group(c)]
            if result is not None and "wall_s" in result:
                walls.append(result["wall_s"])
            if result is None:
                fallen.append(
                    Fallen(c, "budget", f"{c.label}: not run, the budget of {budget_minutes:g} min ran out")
                )
                return
            if "fell" in result:
                fallen.append(Fallen(c, result["fell"], f"{c.label}: {result['why']}"))
                return
            counts["runs"] += 1
            if "error" in result:
                tier = "lowering" if result["lowering"] else "failed"
                fallen.append(Fallen(c, tier, f"{c.label}: {result['error']}"))
                if prune and result["lowering"] and first.get((c.mesh_spec, c.strategy)) is c:
                    # the first of its mesh: the mesh's error, unless the error is its strategy's own refusal (the
                    # mesh's other strategies may lower); the first of a later strategy: that strategy's
                    if first_of_mesh.get(c.mesh_spec) is c and not strategy_error(
                        result["error"], c.strategy
                    ):
                        bad_mesh[c.mesh_spec] = result["error"]
                    else:
                        bad_strategy[c.mesh_spec, c.strategy] = result["error"]
                if prune and result["lowering"] and NO_PIPELINE in result["error"] and not no_pipeline:
                    no_pipeline.append(result["error"])
                    notes.append("pp not searched further: the script's step has no af.pipeline (its first pp "
                                 "candidate's lowering says so)")  # fmt: skip
                return
            report = result["report"] if "report" in result else _extrapolated(result)
            counts["extrapolated"] += "report" not in result
            if c.mesh and report["mesh"] != c.mesh:
                fallen.append(
                    Fallen(c, "script fixes the mesh", f"{c.label}: the script ran on {report['mesh']}")
                )
                return
            latency, seconds = all_to_all_time(report, spec, nproc_per_node)
            if latency:
                exchanges.setdefault(c.mesh_spec, []).append(Exchanges(c, latency, seconds))
            if routed_holds is not False:
                # the routed bound assumes the default dispatcher's traffic (every token's top_k rows, 16-bit or
                # wider); one the script swaps in (`af.shard(ep_dispatcher=)`: fp8 rows, one row per destination
                # rank) may send less, and the one-process probe cannot see it (ep=1): trusted only once a measured
                # candidate's all-to-alls take at least their bound, never again once one takes less
                routed = routed_bound(c, moe, tokens, spec, nproc_per_node, script_remat)
                if routed:
                    routed_holds = routed <= (latency + seconds) * (1 + 1e-6)
            ran = lowered_strategy(report.get("strategy", ""))
            # one note per plan: the first mesh that lowered another strategy
            if fixed_strategy is not None and ran != fixed_strategy and not other_strategy:
                other_strategy[c.mesh_spec] = ran
                notes.append(f"the script lowered {ran or 'another strategy'} on {c.mesh_spec}, {fixed_strategy} as "
                             f"one process: its legality assumed {fixed_strategy}")  # fmt: skip
            row = Row.of(c, report)
            if band is not None and row.error_band is None:
                row = attrs.evolve(row, error_band=band)
            expected = activations * activation_share(c)
            if row.fits is False and row.peak and row.states and expected > 0:
                # (only from candidates that did not fit: where one fits, a higher ratio would only defer the
                # rest, and a fitting row's fixed overheads, FSDP's gathered blocks, over its smallest activations
                # would inflate it)
                ratio = max(0.0, row.peak - row.states) / expected
                activation_ratio[_split_key(c)] = max(activation_ratio.get(_split_key(c), 0.0), ratio)
            if row.fits is False:
                unfit.append(row)
                too_big.setdefault(memory_group(c), []).append(row)
                fallen.append(Fallen(c, "does not fit", f"{c.label}: peak {gib(row.peak)} per rank"))
                return
            rows.append(row)
            if row.compute_s and probe_compute:
                ratios.setdefault(c.compile, []).append(row.compute_s / (probe_compute / world))
            if c.accumulate is not None:
                group = _group(c)
                fitting[group] = min(fitting.get(group, c.accumulate), c.accumulate)
            if row.step_time_s and (not best or row.step_time_s < best[0]):
                best[:] = [row.step_time_s]

        share = (probe_compute or 0.0) / world
        activations = int(probe["report"]["per_rank"].get("activations", 0))
        # the params' bytes a gather moves: FSDP's bf16 copy of them under af.autocast, else as the probe holds them
        described = probe["report"].get("strategy", "")
        gather_ratio = 2.0 if "autocast(" in described else 1.0

        def estimate(c: Candidate, ratio: float = 1.0) -> float:
            """`c`'s peak per rank as the shapes go: its states bound and its share of the probe's activations
            (times `ratio`: what a measured candidate of its split held over its estimate)."""
            bound = states_bound(c, totals, script_strategy=None, script_sync_each=script_sync_each)
            return bound + activations * activation_share(c) * ratio

        decoder = probe.get("decoder") or {}
        fp8_gathers = gathers_in_fp8(described)

        def promise(c: Candidate) -> tuple[bool, float, int]:
            """The order of the search: those the estimate says may fit first (where pruning), then the least
            step floor (`traffic.step_floor`: the compute share and bubble with tp's and cp's collectives on the
            critical path, `critical.critical_traffic`, or the strategy's traffic of the states, whichever is
            longer: what the compute alone does not rank, a mesh gathering most of the experts every
            micro-batch, a tp mesh gathering the activations), then the fewest micro-batches. Not the routed
            rows' all-to-alls (`prune.routed_bound`): with them Qwen3-30B on 64 reached fewer ep candidates
            (35 dry runs, 3,669 tokens/s/GPU chosen against 7,183 without them; before tp's and cp's
            collectives were counted, 7 dry runs and 3,631)."""
            states = traffic_of(
                c, totals, spec, nproc_per_node, fixed_strategy, gather_ratio, zero3, script_sync_each
            )
            critical = critical_traffic(
                c, decoder, tokens, spec, nproc_per_node, gather_ratio > 1, fp8_gathers, script_remat
            )
            floor = step_floor(time_bound(c, share, 1), states, critical)
            return (prune and estimate(c) > capacity, round(floor, 9), c.accumulate or 1)

        # the most promising first, so that the bound and the dominance prune the most; among equal floors (the
        # compute-bound candidates) the (tp, cp) groups interleaved, so that a search the budget cuts short has
        # tried every intra-node split
        order = sorted(_interleaved(survivors), key=promise)
        if prune:  # where memory binds, each group's most frugal candidate first, the likeliest to fit first
            # a group's frugal candidate is waited for by the rest of its group (its verdict may prune them)
            first_runs = frugal_candidates(order, estimate, capacity)
            frugal.update((memory_group(c), c) for c in first_runs)
            # those estimated under half the usable memory (the likeliest to fit) first, in the search's
            # order: the least estimate first would start with the costliest dry runs (the most split meshes,
            # the most micro-batches: at 8B on 64, two pp=8 runs of 128 micro-batch passes took the budget)
            pos = {id(c): i for i, c in enumerate(order)}
            likely = sorted(
                (c for c in first_runs if estimate(c) <= capacity * BINDS), key=lambda c: pos[id(c)]
            )
            chosen = {id(c) for c in likely}
            first_runs = likely + [c for c in first_runs if id(c) not in chosen]
            chosen = {id(c) for c in first_runs}
            order, bound_order = first_runs + [c for c in order if id(c) not in chosen], order
        else:
            bound_order = order
        for c in order:
            first.setdefault((c.mesh_spec, c.strategy), c)
            first_of_mesh.setdefault(c.mesh_spec, c)
        jobs = []
        job_of_c: dict[int, Job] = {}
        for c in order:
            job = job_of(c)
            by_job[job] = c
            job_of_c[id(c)] = job
            jobs.append(job)

        def found() -> bool:
            """Once a candidate fits, the rest run in the time bound's order, the most promising first (the
            frugal candidates' order is for finding one that fits: it runs the most micro-batches, the most
            split meshes, the costliest dry runs first), each group's frugal candidate still ahead of its group."""
            return bool(rows)

        later: list[Job] = []
        ahead = dict(frugal)
        leads = {id(f) for f in frugal.values()}
        for c in bound_order:
            lead = ahead.pop(memory_group(c), None)
            if lead is not None and lead is not c:
                later.append(job_of_c[id(lead)])
            if lead is c or id(c) not in leads:
                later.append(job_of_c[id(c)])
        for job, result in pool.map(
            jobs, deadline=cutoff, done=lambda: bar.update(1), skip=skip, wait=waits, then=(found, later)
        ):
            record(by_job[job], result)
        bar.close()

        # the best rows measured by extrapolation are confirmed by full dry runs until the first `confirm` are
        # full dry runs: the chosen row's always (its figures are the exact dry run's; the search left it a
        # reserve of the budget), the others where their estimated full dry run fits in what is left of it
        while True:
            rows.sort(key=_rank)
            left = deadline - time.monotonic()
            todo = []
            for r in rows[:confirm]:  # counted as if one after another (two at once share this machine)
                cost = confirm_cost(r)
                if r.extrapolated and (r is rows[0] or cost <= left):
                    todo.append(r)
                    left -= cost
            if not todo:
                break
            full = {_job(r.candidate, base): r for r in todo}
            for job, result in pool.map(list(full)):
                r = full[job]
                rows.remove(r)
                counts["confirmed"] += 1
                if r.dry_run_s and ((result or {}).get("report") or {}).get("elapsed_s"):
                    measured.append((result or {})["report"]["elapsed_s"] / r.dry_run_s)
                record(r.candidate, result)
    rows.sort(key=_rank)
    if any(r.extrapolated for r in rows[:confirm]):
        notes.append("rows marked ~ are extrapolated from dry runs with a few blocks (the budget ran out before "
                     "their full dry runs)")  # fmt: skip
    if "mesh" in open_knobs and any(f.tier == "script fixes the mesh" for f in fallen):
        notes.append("the script fixes its mesh (it does not read af.Mesh.from_env()): the plan keeps it")
    if calibration is not None:
        notes.append(
            f"calibrated on {gpu} from {len(calibration.points)} run(s): compute model x {calibration.scale:.3f}, "
            f"residual {calibration.residual:.1%}"
        )
    elif rows and rows[0].error_band is None:
        notes.append("the predictions carry no error band yet (uncalibrated time model): compare close rows "
                     "with care")  # fmt: skip
    return Plan(
        script=text,
        args=list(args),
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        gpu=gpu,
        rows=rows,
        fallen=fallen,
        open_knobs=open_knobs,
        fixed_knobs=fixed,
        candidates=len(candidates),
        elapsed_s=time.monotonic() - start,
        notes=notes,
        unfit=sorted(unfit, key=lambda r: -(r.tokens_per_s_per_gpu or 0.0)),
        capacity_bytes=capacity,
        global_batch_size=global_batch_size,
        dry_runs=counts["runs"],
        extrapolated=counts["extrapolated"],
        confirmed=counts["confirmed"],
        mixed_precision=mixed_precision,
    )


def _ms(seconds: float) -> str:
    """Seconds as milliseconds, 3 significant digits below 100 ms (a tiny model's bound and best step differ in
    the second decimal).

    Example:
        >>> _ms(0.00236), _ms(12.9)
        ('2.36', '12,900.0')
    """
    ms = seconds * 1e3
    return f"{ms:,.1f}" if ms >= 100 else f"{ms:.3g}"


def _rank(r: Row) -> tuple[float, float, int]:
    """Best first: tokens/s per GPU, then the step time, then the peak."""
    return (-(r.tokens_per_s_per_gpu or 0.0), r.step_time_s or 0.0, r.peak)


def _split_key(c: Candidate) -> tuple[object, ...]:
    """What decides how far `memory.activation_share` misses a candidate's activations: the model's split (pp,
    tp, cp; the schedule's in-flight micro-batches it counts) and the remat.

    Example:
        >>> _split_key(Candidate({"pp": 2, "dp": 4}, "fsdp", "full", accumulate=2))
        (2, 1, 1, 'full')
    """
    return c.mesh.get("pp", 1), c.mesh.get("tp", 1), c.mesh.get("cp", 1), c.remat


def _group(c: Candidate) -> tuple[object, ...]:
    """What identifies a candidate but its accumulation (the candidates among which the fewest micro-batches
    that fit is the fastest)."""
    return (c.mesh_spec, *((k, v) for k, v in c.knobs().items() if k != "accumulate"))


def _stages(c: Candidate) -> int:
    """The pipeline stages `c` splits the model into: pp x the stages per rank of its schedule (1 without a
    pipeline; the script's schedule, when it fixes one, is read from the dry runs)."""
    from ..transforms.pipeline import SCHEDULES

    pp = c.mesh.get("pp", 1)
    info = SCHEDULES.get(c.pipeline_schedule or "1f1b")
    return pp * (info.stages_per_rank if pp > 1 and info is not None else 1)


def strategy_error(error: str, strategy: str | None) -> bool:
    """Whether a lowering `error` is `strategy`'s own refusal (`af.shard(strategy=...)`'s lowering names it:
    "shard(strategy='fsdp'): ..."), which says nothing of the mesh's other strategies.

    Example:
        >>> strategy_error("ValueError: shard(strategy='fsdp'): x is split over ep=2 x cp=2 x tp=2 ...", "fsdp")
        True
        >>> strategy_error("ValueError: tp=8 does not divide 4 kv heads", "fsdp")
        False
    """
    if strategy is None:
        return False
    # hsdp lowers through fsdp's code, whose messages name 'fsdp'
    names = (strategy, "fsdp") if strategy == "hsdp" else (strategy,)
    return any(f"shard(strategy={s!r})" in error for s in names)


def _remat_every(c: Candidate) -> int:
    """The `every` of `c`'s remat (`POLICY:N`: every N-th block), 1 without one.

    Example:
        >>> _remat_every(Candidate({"dp": 8}, "fsdp", "selective:2")), _remat_every(Candidate({"dp": 8}, "fsdp"))
        (2, 1)
    """
    return int(launch_env.remat_args(c.remat)["every"]) if c.remat not in (None, "none") else 1


def _layout_notes(probe: dict[str, Any], min_blocks: int | None) -> list[str]:
    """What the layer-extrapolated tier does not do for the probed model's blocks (`extrapolate.Layout`)."""
    blocks, lead, period = int(probe.get("blocks", 0)), int(probe.get("lead", 0)), probe.get("period")
    if min_blocks is None or blocks < min_blocks:
        return []
    if period is None:
        return [f"the model's {blocks} blocks have no period of at most a quarter of the {blocks - lead} after its "
                f"{lead} leading unlike ones (blocks compared by parameters and per-layer compute: layer types, "
                "sliding windows): every candidate is a full dry run, none extrapolated"]  # fmt: skip
    if period > 1:
        many = blocks // period >= min_blocks
        return [f"the model's blocks alternate every {period} blocks (after {lead} leading unlike ones): "
                + (f"candidates without a pipeline are extrapolated over periods of {period} blocks; " if many else
                   f"{blocks // period} periods, fewer than {min_blocks}: full dry runs; ")
                + "candidates with a pipeline are full dry runs (its balanced split does not follow periods)"]  # fmt: skip
    return []


def _extrapolated(result: dict[str, Any]) -> dict[str, Any]:
    """The report of a layer-extrapolated job (`search.run_job` with `Job.blocks`): each rank's two cut runs
    extrapolated along the line through the blocks that rank ran in each (`"at"`) to those it runs in the
    whole model (`"full"`), the rank with the larger peak kept; `elapsed_s` the ranks' full dry runs together
    (what confirming the row costs)."""
    k1, k2 = BLOCKS
    r1s, r2s = result["reports"][k1], result["reports"][k2]
    done = [extrapolate(a, b, a["at"], b["at"], a["full"]) for a, b in zip(r1s, r2s, strict=True)]
    worst = max(done, key=lambda r: r["per_rank"]["peak"])
    return {**worst, "elapsed_s": sum(r.get("elapsed_s") or 0.0 for r in done)}


def _interleaved(candidates: list[Candidate]) -> list[Candidate]:
    """Round-robin over the (tp, cp) groups, each in its order (pp ascending): a search the budget cuts short
    has tried every intra-node split, not only the first ones enumerated.

    Example:
        >>> cs = [Candidate({"dp": 4}), Candidate({"pp": 2, "dp": 2}), Candidate({"dp": 2, "tp": 2})]
        >>> [c.mesh_spec for c in _interleaved(cs)]
        ['dp=4', 'dp=2,tp=2', 'pp=2,dp=2']
    """
    groups: dict[tuple[int, int], list[Candidate]] = {}
    for c in candidates:
        groups.setdefault((c.mesh.get("tp", 1), c.mesh.get("cp", 1)), []).append(c)
    out: list[Candidate] = []
    queues = list(groups.values())
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(total: int, enabled: bool) -> Any:
    """A progress bar over the dry runs (tqdm, on stderr), or nothing."""
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc="accelfn plan: dry runs", unit="run")
