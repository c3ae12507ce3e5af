"""The planner's estimate of a full dry run's wall time from its cut runs (issue 30): what it reserves of the
budget to confirm the chosen row. The reference is the full dry run itself, measured in the same worker process;
the machine is loaded and shared, so times are compared as generous ratios, never absolutely.

The planned script is tests/workers/plan_worker.py (a tiny Llama), with 16 identical blocks.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
from typing import Any

import attrs

import accelfn as af
from accelfn import launch_env
from accelfn.planner.search import Job, _init_worker, run_job
from tests._launch import WORKERS

SCRIPT = str(WORKERS / "plan_worker.py")
ARGS = ("--remat", "none", "--offload", "none", "--compile", "none", "--layers", "16")
# the estimate over the full dry run: upper-ish (measured 0.93-1.6 on tiny Llamas and 8B), the loaded machine's
# noise on top (a dry run's time varies by +-30% from one to the next)
LOW, HIGH = 0.7, 3.0


def _estimate(cut: dict[str, Any]) -> float:
    """The plan's estimate of the job's full dry run (`tiers._extrapolated`)."""
    from accelfn.planner.tiers import _extrapolated

    return float(_extrapolated(cut)["elapsed_s"])


def test_the_full_dry_runs_wall_time_is_estimated_on_a_fresh_and_a_warm_worker() -> None:
    """One spawned worker (as `Pool` starts them): its first job, the cut runs of a 16-block model, pays the
    process's warm-up (imports, first tracing) and runs its first cut again (`warmup_s`, the time taken apart);
    then the full dry run (the reference), then the cut runs again, warm. Both estimates are within [0.7, 3]x
    the full dry run's wall time. (The line through the cut runs' times, the old estimate, fell back to the
    3-block run's time on the fresh worker: 0.26x here, 0.14x at 8B on 64 ranks.)"""
    env = tuple((launch_env.KNOBS[k][0], v) for k, v in (("strategy", "fsdp"), ("global_batch_size", "8")))
    full_job = Job(SCRIPT, ARGS, 8, 1, mesh="dp=8", env=env, gpu="h100-sxm")
    cut_job = attrs.evolve(full_job, blocks=(2, 3))
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=1, mp_context=ctx, initializer=_init_worker) as worker:
        fresh = worker.submit(run_job, cut_job).result()
        full = worker.submit(run_job, full_job).result()
        warm = worker.submit(run_job, cut_job).result()
    assert "reports" in fresh and "reports" in warm and "report" in full
    assert fresh["warmup_s"] > 0.0 and "warmup_s" not in warm
    reference = full["report"]["elapsed_s"]
    for name, cut in (("fresh", fresh), ("warm", warm)):
        ratio = _estimate(cut) / reference
        assert LOW <= ratio <= HIGH, f"{name} worker: estimate {_estimate(cut):.2f} s, full {reference:.2f} s"


def test_a_plan_with_a_tight_budget_stays_within_it() -> None:
    """A plan of the 16-block model whose budget cuts its search short (candidates fall at "budget"; measured:
    17 s without a budget, 6 of 11 runnable candidates cut at 12 s) still confirms its chosen row by a full dry
    run and ends within its budget plus 35% (the estimate reserved the confirmation; the job started last is
    bounded by the longest one so far; measured: 12.0 s alone, 14.9 s with another test file running beside it,
    as CI runs them; without a budget: 17 s alone)."""
    budget_s = 12.0
    p = af.plan(
        SCRIPT, ARGS, nproc_per_node=8, global_batch_size=8, axes=("dp", "tp"), workers=2, confirm=1,
        extrapolate_min_blocks=4, budget_minutes=budget_s / 60,
    )  # fmt: skip
    assert any(f.tier == "budget" for f in p.fallen), "the budget did not bind: the test measures nothing"
    assert p.best is not None and not p.best.extrapolated and p.confirmed >= 1
    assert p.elapsed_s <= 1.35 * budget_s, f"{p.elapsed_s:.1f} s for a budget of {budget_s:g} s"
