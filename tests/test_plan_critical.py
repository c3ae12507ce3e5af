"""The planner's estimate of the collectives on a candidate's critical path before it runs (`planner.critical`):
tensor parallel's sequence gathers and scatters and context parallel's key/value gathers, against what dry runs
of a tiny Llama (examples/train_llama.py, 2 blocks, 8 fake ranks) then measure.
"""

from __future__ import annotations

from typing import Any

import pytest

from accelfn import launch_env
from accelfn.planner import tiers
from accelfn.planner.candidates import Candidate
from accelfn.planner.critical import critical_traffic, gathers_in_fp8
from accelfn.planner.search import Job, Pool, run_job
from accelfn.platforms.specs import spec
from tests._launch import ROOT

LLAMA = str(ROOT / "examples" / "train_llama.py")
H100 = spec("h100-sxm")


def _env(**knobs: object) -> tuple[tuple[str, str], ...]:
    return tuple((launch_env.KNOBS[k][0], str(v)) for k, v in knobs.items())


@pytest.fixture(scope="module")
def probes() -> dict[tuple[str, ...], dict[str, Any]]:
    """The planner's one-process probe of the script with each set of flags (made on first use)."""
    return {}


@pytest.mark.parametrize(
    "mesh, flags, remat, accumulate",
    [
        ("dp=4,tp=2", ("--bf16",), "none", 1),  # bf16 activations, sequence parallel
        ("dp=4,tp=2", (), "full", 2),  # fp32, recomputed blocks gather again, 2 micro-batches
        ("dp=2,cp=2,tp=2", ("--bf16",), "full", 1),  # cp's key/value gathers of this tp rank's heads
        ("dp=4,cp=2", ("--bf16",), "selective", 1),  # selective remat gathers again, scatters not
        ("dp=4,tp=2", ("--bf16", "--fp8"), "full", 1),  # torchao's float8 styles gather in fp8
    ],
)
def test_the_estimated_bytes_are_the_dry_runs_tp_and_cp_collectives(
    probes: dict[tuple[str, ...], dict[str, Any]],
    mesh: str,
    flags: tuple[str, ...],
    remat: str,
    accumulate: int,
) -> None:
    """Before any run, from the probe's decoder shape and tokens: each tp and cp gather and scatter has the
    bytes the dry run then measures, within 3% (the dry run pads the 129-token sequence tp splits), and the
    estimate has no group the dry run has not."""
    args = ("--model", "tiny", "--steps", "2", *flags)
    if flags not in probes:
        with Pool(1) as pool:
            probes[flags] = tiers._probe(pool, LLAMA, args, "h100-sxm", "cuda", 16)
    probe = probes[flags]
    job = Job(LLAMA, args, 8, 1, mesh=mesh, gpu="h100-sxm",
              env=_env(strategy="fsdp", global_batch_size=16, remat=remat, accumulate=accumulate))  # fmt: skip
    report = run_job(job)["report"]
    c = Candidate(report["mesh"], "fsdp", remat, accumulate=accumulate)
    described = probe["report"]["strategy"]  # what the planner knows before the run
    fp8 = gathers_in_fp8(described)
    assert fp8 == ("float8 tensor-parallel" in report["strategy"])
    tokens = probe["report"]["tokens_per_step"]
    moved = critical_traffic(c, probe["decoder"], tokens, H100, 8, "autocast(" in described, fp8).moved
    measured = {
        (kind, group): row["bytes"]
        for kind, rows in report["comm"].items()
        for group, row in rows.items()
        if kind in ("all_gather", "reduce_scatter") and group in ("tp", "cp")
    }
    ours = {(kind, "x".join(axes)): nbytes for (kind, axes), nbytes in moved.items()}
    assert set(ours) == set(measured), (ours, measured)
    for key, nbytes in ours.items():
        assert nbytes == pytest.approx(measured[key], rel=0.03), key


def test_a_tp_mesh_waits_for_its_gathers_where_a_data_parallel_one_of_the_same_compute_does_not() -> None:
    """At the same compute share, a mesh splitting the blocks over tp 8 pays its gathers and scatters on the
    critical path (Llama 3 8B, 64 x 8192 tokens a step: 194 gathers of 512 MiB a rank, bf16), which the step floor
    adds to the compute; a data-parallel mesh with little states traffic (ddp, 1 GiB of grads) has only its
    compute. Without tp or cp, or without the probe's shape, nothing is on the critical path."""
    from accelfn.planner.traffic import Traffic, step_floor

    decoder = {"blocks": 32, "hidden": 4096, "kv_width": 1024, "bytes": 4}
    tp = Candidate({"dp": 8, "tp": 8}, "ddp", "full", accumulate=1)
    dp = Candidate({"dp": 64}, "ddp", "full", accumulate=1)
    crit_tp = critical_traffic(tp, decoder, 64 * 8192, H100, 8, autocast=True)
    crit_dp = critical_traffic(dp, decoder, 64 * 8192, H100, 8, autocast=True)
    assert crit_tp.intra > 0.1 and crit_tp.inter == 0.0  # tp inside a node
    assert crit_dp.moved == {} and crit_dp.busiest == 0.0
    assert critical_traffic(tp, {}, 64 * 8192, H100, 8).moved == {}
    states = Traffic(inter=0.5)
    assert step_floor(1.0, states, crit_tp) == pytest.approx(1.0 + crit_tp.intra)
    assert step_floor(1.0, states, crit_dp) == 1.0
    fp8 = critical_traffic(tp, decoder, 64 * 8192, H100, 8, autocast=True, fp8_gathers=True)
    assert fp8.intra < crit_tp.intra  # the blocks' gathers in fp8


def test_a_deferred_job_runs_after_the_others_once() -> None:
    """`Pool.map`'s `skip` may defer a job (`{"defer": True}`: a candidate whose estimate, corrected by a
    measured one of its split, is above the memory): it comes after every other pending job, and is asked
    again then; a second deferral does not loop (it would run)."""
    jobs = [Job(f"s{i}.py", (), 1, 1) for i in range(3)]
    asked: list[str] = []

    def skip(job: Job) -> dict[str, object]:
        asked.append(job.script)
        if job is jobs[0] and asked.count(job.script) == 1:
            return {"defer": True}
        return {"fell": "test", "why": job.script}

    pool = Pool(1)  # (no worker processes: skip answers every job here)
    order = [job.script for job, _ in pool.map(jobs, skip=skip)]
    assert order == ["s1.py", "s2.py", "s0.py"] and asked == ["s0.py", "s1.py", "s2.py", "s0.py"]


def test_a_deferred_lead_still_runs_before_the_jobs_waiting_for_it() -> None:
    """A group's frugal lead deferred to the end of the queue: when nothing else runs, the jobs waiting for its
    verdict (`wait`) do not overtake it (they run after it, as with workers busy), the others do."""
    lead, m1, m2, other = (Job(f"{n}.py", (), 1, 1) for n in ("lead", "m1", "m2", "other"))
    asked: list[str] = []
    finished: set[str] = set()

    def skip(job: Job) -> dict[str, object]:
        asked.append(job.script)
        if job is lead and asked.count("lead.py") == 1:
            return {"defer": True}
        finished.add(job.script)
        return {"fell": "test", "why": job.script}

    def wait(job: Job) -> bool:
        return job in (m1, m2) and "lead.py" not in finished

    order = [job.script for job, _ in Pool(1).map([lead, m1, m2, other], skip=skip, wait=wait)]
    assert order == ["other.py", "lead.py", "m1.py", "m2.py"]


def test_a_pipelines_bound_counts_the_experts_gradients_at_their_split_where_only_they_train() -> None:
    """An expert-only fine-tune (the experts 90% of the params and all of the gradients) at pp=2, ep=8: the
    states bound holds a stage's gradients unsharded over the data axes but split over ep, so its gradients'
    part is at most the experts' over pp x ep (E / 16), not a dense share of them held whole."""
    from accelfn.planner.prune import States, states_bound

    params = 10**10
    experts = int(0.9 * params)
    c = Candidate({"pp": 2, "dp": 1, "ep": 8}, "fsdp", accumulate=1, pipeline_microbatches=2)
    with_grads = States(params=params, grads=experts, optimizer=2 * experts, experts=experts)
    without = States(params=params, grads=0, optimizer=2 * experts, experts=experts)
    held = states_bound(c, with_grads, script_strategy=None) - states_bound(c, without, script_strategy=None)
    assert held <= experts // 16 + 1


def test_the_states_bound_splits_the_optimizer_of_an_expert_only_fine_tune_at_the_experts_split() -> None:
    """ddp over ep=8, only the experts (90% of the params) train: their gradients and optimizer state are split
    over ep, the dense params held whole. The bound must not exceed that (it split the optimizer by the params'
    share, 10% of it held whole: 7.1 GB against 5.5)."""
    from accelfn.planner.prune import States, states_bound

    params, experts = 10 * 10**9, 9 * 10**9
    totals = States(params=params, grads=experts, optimizer=2 * experts, experts=experts)
    c = Candidate({"dp": 1, "ep": 8}, "ddp", accumulate=1)
    held = (params - experts) + experts // 8 + experts // 8 + 2 * experts // 8  # 5.5 GB
    assert states_bound(c, totals, script_strategy=None) <= held
