"""`af.plan`'s time bound with the all-to-alls (`prune.comm_bound`): below the dry run's predicted step of every
candidate it bounds, pruning MoE candidates at `time bound` without changing the choice, and nothing for a dense
model.

A tiny Qwen3-MoE (examples/train_moe.py, 4 experts) at 8 fake ranks on an H100 row: a pruned plan and the
exhaustive one (seconds each), and a few single dry runs of one ep mesh under other knobs.
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import pytest

import accelfn as af
from accelfn import launch_env
from accelfn.planner import tiers
from accelfn.planner.candidates import Candidate
from accelfn.planner.prune import Exchanges, all_to_all_time, comm_bound, routed_bound
from accelfn.platforms.specs import spec
from tests._launch import ROOT, WORKERS
from tests.plan_memo import shared_dry_runs

MOE = str(ROOT / "examples" / "train_moe.py")
MOE_ARGS = ["--steps", "2", "--experts", "4", "--remat", "none", "--offload", "none", "--accumulate", "1"]
H100 = spec("h100-sxm")


def _env(**knobs: object) -> tuple[tuple[str, str], ...]:
    return tuple((launch_env.KNOBS[k][0], str(v)) for k, v in knobs.items())


@pytest.fixture(scope="module")
def plans() -> dict[str, Any]:
    """The MoE script's plans (no memory limit: every mesh fits, dp=8 ddp is the fastest): `pruned`, `learned`
    (pruned with the all-to-alls learned from dry runs only, `prune.routed_bound` off) and `exhaustive`; every
    report the exhaustive plan's search measured, and the probe's facts `routed_bound` was given."""
    out: dict[str, Any] = {"reports": [], "routed": []}
    real_time, real_routed = tiers.all_to_all_time, tiers.routed_bound

    def keep(report: dict[str, Any], *args: Any) -> tuple[float, float]:
        out["reports"].append(report)
        return real_time(report, *args)

    def routed(c: Candidate, moe: dict[str, int], tokens: int, *args: Any) -> float:
        out["routed"].append((moe, tokens))
        return real_routed(c, moe, tokens, *args)

    kw: dict[str, Any] = dict(nproc_per_node=8, global_batch_size=16, axes=("dp", "ep"), workers=1)
    kw["strategies"] = ("ddp", "fsdp")
    with pytest.MonkeyPatch.context() as mp, shared_dry_runs():
        mp.setattr(tiers, "routed_bound", routed)
        out["pruned"] = af.plan(MOE, MOE_ARGS, **kw)
        mp.setattr(tiers, "routed_bound", lambda *a: 0.0)
        out["learned"] = af.plan(MOE, MOE_ARGS, **kw)
        mp.setattr(tiers, "all_to_all_time", keep)
        out["exhaustive"] = af.plan(MOE, MOE_ARGS, prune=False, **kw)
    return out


def test_the_all_to_all_bound_is_below_every_measured_candidates_exposed_communication(plans) -> None:
    """Each ep candidate's all-to-alls, timed from its report's bytes and counts, and the bound every other
    candidate of its mesh gives it, are at most the communication its predicted step waits for (step less
    compute and bubble): what the time bound adds to the compute is below the dry run's own step."""
    exhaustive, reports = plans["exhaustive"], plans["reports"]
    rows = {
        (tuple(sorted(r.candidate.mesh.items())), r.step_time_s): r
        for r in exhaustive.rows + exhaustive.unfit
    }
    measured = []
    for report in reports:
        row = rows[(tuple(sorted(report["mesh"].items())), report["predicted"]["step_time_s"])]
        latency, seconds = all_to_all_time(report, H100, 8)
        assert (latency > 0) == (report["mesh"].get("ep", 1) > 1), row.candidate.label
        assert latency + seconds <= row.exposed_comm_s + 1e-12, row.candidate.label
        if latency:
            measured.append((row, Exchanges(row.candidate, latency, seconds)))
    assert len(measured) == 4  # dp=4,ep=2 and dp=2,ep=4, each ddp and fsdp
    transferred = 0
    for (row, own), (_, other) in itertools.product(measured, measured):
        bound, source = comm_bound(row.candidate, [other])
        assert bound <= row.exposed_comm_s + 1e-12, (row.candidate.label, other.candidate.label)
        if source is not None and source is not row.candidate:
            transferred += 1
            assert bound >= 0.5 * (
                own.latency_s + own.bytes_s
            )  # the latencies are the same, the bytes halved
    assert transferred == 4  # ddp <-> fsdp on each of the two meshes


def test_moe_candidates_fall_at_the_time_bound_and_the_choice_is_the_exhaustive_ones(plans) -> None:
    """With the routed rows' bound every ep candidate but the first falls at `time bound` before it runs (the
    tiny model's all-to-alls are their latencies: 0.1-0.3 ms on a 2.4 ms step; the bound is trusted once a
    measured candidate's all-to-alls take at least it: a dispatcher the script swaps in may send less); with the
    learned one alone, each ep mesh's second strategy (its first measured the all-to-alls). Each is slower in the exhaustive search (or fails to
    lower there), and the choice is the exhaustive one's."""
    exhaustive = plans["exhaustive"]
    assert exhaustive.best is not None
    slower = {r.candidate: r.step_time_s for r in exhaustive.rows}
    lowering = {f.candidate for f in exhaustive.fallen if f.tier == "lowering"}
    for name, n, how in (("pruned", 4, "MoE layers' routed rows"), ("learned", 2, "measured them")):
        plan = plans[name]
        assert plan.best is not None and plan.best.candidate == exhaustive.best.candidate, name
        bounded = [f for f in plan.fallen if f.tier == "time bound"]
        assert len(bounded) == n and all(f.candidate.mesh.get("ep", 1) > 1 for f in bounded), name  # (docs)
        assert all("all-to-alls >=" in f.reason for f in bounded), [f.reason for f in bounded]
        # the learned bound alone: each by its mesh's measured one; with the routed one, the meshes not measured
        named = [f for f in bounded if how in f.reason]
        assert named if name == "pruned" else len(named) == n, [f.reason for f in bounded]
        for f in bounded:  # truly slower, or not a configuration at all
            assert f.candidate in lowering or slower[f.candidate] > exhaustive.best.step_time_s, (
                f.candidate.label
            )
        assert plan.dry_runs == exhaustive.dry_runs - len(bounded), name


def test_the_routed_rows_bound_is_below_every_measured_all_to_all_and_near_it(plans) -> None:
    """The bound from the model's facts (the probe's MoE layers, row width, top-k and tokens) before any run,
    against each ep candidate's measured all-to-alls: below, and within 1% (the tiny model's rows are bf16 under
    autocast, its router's rows spread evenly enough that the busiest rank's are the mean's)."""
    moe, tokens = plans["routed"][0]
    assert moe == {"layers": 2, "hidden": 32, "top_k": 2} and tokens == 16 * 16
    exhaustive, checked = plans["exhaustive"], 0
    rows = {(tuple(sorted(r.candidate.mesh.items())), r.step_time_s): r for r in exhaustive.rows}
    for report in plans["reports"]:
        row = rows[(tuple(sorted(report["mesh"].items())), report["predicted"]["step_time_s"])]
        measured = sum(all_to_all_time(report, H100, 8))
        bound = routed_bound(row.candidate, moe, tokens, H100, 8)
        assert bound <= measured + 1e-12, row.candidate.label
        if measured:
            checked += 1
            assert bound >= 0.99 * measured, (row.candidate.label, bound, measured)
    assert checked == 4


def test_the_bound_carries_over_remat_strategy_and_accumulation_below_each_dry_run() -> None:
    """One ep mesh dry-run under other remat, strategy and accumulation: each candidate's bound from every other
    (the same all-to-alls; remat full's recomputed ones; at least half the bytes under another strategy; the
    latencies of fewer micro-batches) is below its own exposed communication, and the same knobs but offload
    give exactly its own all-to-alls."""
    from accelfn.planner.search import Job, run_job

    args = ["--steps", "2", "--experts", "4", "--offload", "none", "--bf16"]
    runs = []
    for strategy, remat, acc in (
        ("ddp", "none", 1),
        ("fsdp", "full", 2),
        ("ddp", "full", 1),
    ):
        job = Job(MOE, (*args, "--remat", remat, "--accumulate", str(acc)), 8, 1, mesh="dp=2,ep=4",
                  env=_env(strategy=strategy, global_batch_size=16), gpu="h100-sxm")  # fmt: skip
        report = run_job(job)["report"]
        c = Candidate({"dp": 2, "ep": 4}, strategy, remat, acc, global_batch_size=16)
        p = report["predicted"]
        runs.append((c, Exchanges(c, *all_to_all_time(report, H100, 8)), p["exposed_comm_s"]))
    full = {c.remat: e.latency_s for c, e, _ in runs if c.accumulate == 1}
    assert full["full"] > 1.4 * full["none"]  # remat full dispatches and combines the forward's rows again
    for (c, own, exposed), (_, other, _) in itertools.product(runs, runs):
        assert comm_bound(c, [other])[0] <= exposed + 1e-12, (c.label, other.candidate.label)
        same = comm_bound(attrs.evolve(c, offload="optimizer"), [own])[0]
        assert same == pytest.approx(own.latency_s + own.bytes_s)
    assert comm_bound(runs[0][0], [runs[2][1]])[1] is None  # full -> none is not a bound (fewer all-to-alls)
    moe, tokens = {"layers": 2, "hidden": 32, "top_k": 2}, 16 * 16  # the probe's (checked above)
    for c, own, _ in runs:  # the bound from the model: full remat's 6 all-to-alls per layer, not 4
        assert 0.99 * own.latency_s <= routed_bound(c, moe, tokens, H100, 8) <= own.latency_s + own.bytes_s


def test_the_routed_rows_bound_with_tp_and_cp_borrowed_by_ep_is_below_each_dry_run() -> None:
    """ep borrowing tp (each tp rank dispatches its share of the tokens) and cp (a rank's part of each sequence,
    here with 2 micro-batches): the bound from the probe's facts is below the measured all-to-alls and within 1%."""
    from accelfn.planner.search import Job, run_job

    moe, tokens = {"layers": 2, "hidden": 32, "top_k": 2}, 16 * 16  # the probe's (checked above)
    args = ["--steps", "2", "--experts", "4", "--offload", "none", "--remat", "none"]
    for mesh, acc in (({"dp": 2, "ep": 2, "tp": 2}, 1), ({"dp": 2, "ep": 2, "cp": 2}, 2)):
        c = Candidate(mesh, "ddp", "none", acc, global_batch_size=16)
        job = Job(MOE, (*args, "--accumulate", str(acc)), 8, 1, mesh=c.mesh_spec,
                  env=_env(strategy="ddp", global_batch_size=16), gpu="h100-sxm")  # fmt: skip
        report = run_job(job)["report"]
        assert report["mesh"] == mesh
        measured = sum(all_to_all_time(report, H100, 8))
        bound = routed_bound(c, moe, tokens, H100, 8)
        assert 0.99 * measured <= bound <= measured <= report["predicted"]["exposed_comm_s"], c.label


def test_a_dense_model_has_no_all_to_all_bound() -> None:
    """A dense Llama (tests/workers/plan_worker.py) under tensor parallel: no all-to-alls, so the time bound is
    the compute's alone, as before."""
    from accelfn.planner.search import Job, run_job

    job = Job(str(WORKERS / "plan_worker.py"), ("--remat", "none", "--compile", "none"), 8, 1, mesh="dp=4,tp=2",
              env=_env(strategy="fsdp", accumulate=1, global_batch_size=8, offload="none"), gpu="h100-sxm")  # fmt: skip
    report = run_job(job)["report"]
    assert report["comm"] and all_to_all_time(report, H100, 8) == (0.0, 0.0)
    c = Candidate({"dp": 4, "tp": 2}, "fsdp")
    assert comm_bound(c, [Exchanges(attrs.evolve(c, strategy="ddp"), 0.0, 0.0)]) == (0.0, None)


def test_a_script_that_fixes_full_remat_has_its_recomputed_all_to_alls_in_the_routed_bound() -> None:
    """A script that fixes remat leaves the candidates' remat unknown (None): the plan reads the one its probe
    lowered (`prune.lowered_remat` of the report's step), and full remat's 6 all-to-alls per MoE layer count."""
    from accelfn.planner.prune import lowered_remat

    args = [a if a != "none" or MOE_ARGS[i - 1] != "--remat" else "full" for i, a in enumerate(MOE_ARGS)]
    report = af.dry_run(MOE, args, nproc_per_node=1, search=False).to_dict()
    assert lowered_remat(report["strategy"]) == "full"
    moe, tokens = {"layers": 4, "hidden": 256, "top_k": 2}, 16 * 128
    c = Candidate({"dp": 2, "ep": 4}, "ddp", None, 1, global_batch_size=16)
    full = attrs.evolve(c, remat="full")
    assert routed_bound(c, moe, tokens, H100, 8, "full") == routed_bound(full, moe, tokens, H100, 8)
    assert routed_bound(c, moe, tokens, H100, 8, "full") == pytest.approx(
        1.5 * routed_bound(c, moe, tokens, H100, 8)
    )
    assert routed_bound(c, moe, tokens, H100, 8, "selective") == routed_bound(c, moe, tokens, H100, 8)


def test_the_plan_passes_the_remat_its_script_fixes_to_the_routed_bound() -> None:
    """tiers.plan reads the remat the probe lowered (the script fixes `--remat full`) and hands it to every routed
    bound it computes, so full remat's recomputed all-to-alls count there."""
    seen: list[Any] = []
    real = tiers.routed_bound

    def routed(c: Candidate, moe: dict[str, int], tokens: int, *args: Any) -> float:
        seen.append((c.remat, args[-1] if len(args) == 3 else None))
        return real(c, moe, tokens, *args)

    args = [a if a != "none" or MOE_ARGS[i - 1] != "--remat" else "full" for i, a in enumerate(MOE_ARGS)]
    kw: dict[str, Any] = dict(nproc_per_node=8, global_batch_size=16, axes=("dp", "ep"), workers=1)
    with pytest.MonkeyPatch.context() as mp, shared_dry_runs():
        mp.setattr(tiers, "routed_bound", routed)
        plan = af.plan(MOE, args, strategies=("ddp",), **kw)
    assert plan.best is not None and "remat" in plan.fixed_knobs
    assert seen and all(remat is None and script == "full" for remat, script in seen), seen


def test_a_script_without_a_pipeline_costs_one_dry_run_for_every_pp_mesh() -> None:
    """The MoE example has no af.pipeline: the first pp candidate's lowering says so, and every other pp mesh
    falls with that reason without a dry run of its own (one per mesh before)."""
    kw: dict[str, Any] = dict(nproc_per_node=8, global_batch_size=16, axes=("dp", "pp"), workers=1)
    with shared_dry_runs():
        plan = af.plan(MOE, MOE_ARGS, strategies=("ddp",), **kw)
    pp = [f for f in plan.fallen if f.candidate.mesh.get("pp", 1) > 1]
    assert {f.candidate.mesh["pp"] for f in pp} == {2, 4, 8} and all(f.tier == "lowering" for f in pp)
    own = [f for f in pp if "as an earlier candidate" not in f.reason]
    assert len(own) == 1 and "the step has no af.pipeline" in own[0].reason, [f.reason for f in own]
    assert all("(as an earlier candidate with a pp axis)" in f.reason for f in pp if f not in own)
    assert any("pp not searched further" in n for n in plan.notes), plan.notes
    assert plan.best is not None and "pp" not in plan.best.candidate.mesh
