"""The planner's estimate of a candidate's data-parallel traffic before it runs (`planner.traffic`): the bytes of
each gather and reduction as the dry run measures them afterwards, and the order it gives an MoE search.

A tiny Qwen3-MoE (examples/train_moe.py, 4 experts, bf16 autocast) at 8 fake ranks: the one-process probe gives
the states, three dry runs (fsdp and ddp over dp x ep with 2 micro-batches, hsdp) give the measured collectives.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from accelfn import launch_env
from accelfn.planner import tiers
from accelfn.planner.candidates import Candidate
from accelfn.planner.prune import States
from accelfn.planner.search import Job, Pool, run_job
from accelfn.planner.traffic import states_traffic, step_floor, traffic_of
from accelfn.planner.zero3 import Zero3Shape
from accelfn.platforms.specs import spec
from tests._launch import ROOT

MOE = str(ROOT / "examples" / "train_moe.py")
ARGS = ("--steps", "2", "--experts", "4", "--offload", "none", "--bf16", "--remat", "none")
H100 = spec("h100-sxm")


def _env(**knobs: object) -> tuple[tuple[str, str], ...]:
    return tuple((launch_env.KNOBS[k][0], str(v)) for k, v in knobs.items())


@pytest.fixture(scope="module")
def totals() -> States:
    with Pool(1) as pool:
        probe = tiers._probe(pool, MOE, ARGS, "h100-sxm", "cuda", 16)
    return States.of(probe["report"]["per_rank"], experts=int(probe.get("expert_bytes", 0)))


@pytest.mark.parametrize(
    "mesh, strategy",
    [("dp=2,ep=4", "fsdp"), ("dp=2,ep=4", "ddp"), ("dp=2,fsdp=2,ep=2", "hsdp")],
)
def test_the_estimated_bytes_are_the_dry_runs_gathers_and_reductions(
    totals: States, mesh: str, strategy: str
) -> None:
    """Before any run: each collective of the strategy (fsdp: 2 gathers and a reduce-scatter per micro-batch, of
    the dense params over dp x ep and the experts' over dp; ddp: one all-reduce a step; hsdp: its shards, then the
    replicas' all-reduce) has the bytes the dry run then measures, within 3% (the estimate counts buffers as
    params, the dry run FSDP's padding), and the estimate has no collective the dry run has not."""
    job = Job(MOE, (*ARGS, "--accumulate", "2"), 8, 1, mesh=mesh, gpu="h100-sxm",
              env=_env(strategy=strategy, global_batch_size=16))  # fmt: skip
    report = run_job(job)["report"]
    assert strategy in report["strategy"]
    moved = traffic_of(Candidate(report["mesh"], strategy, accumulate=2), totals, H100, 8).moved
    measured: dict[tuple[str, str], Any] = {
        (kind, group): row["bytes"]
        for kind, rows in report["comm"].items()
        for group, row in rows.items()
        if kind in ("all_gather", "reduce_scatter") or (kind == "all_reduce" and row["bytes"] > 1024)
    }  # (the clip's and the loss's all-reduces are a few bytes, not the states')
    ours = {(kind, "x".join(axes)): nbytes for (kind, axes), nbytes in moved.items()}
    assert set(ours) == set(measured), (ours, measured)
    for key, nbytes in ours.items():
        assert nbytes == pytest.approx(measured[key], rel=0.03), key


def test_a_mesh_that_splits_the_experts_over_few_ranks_gathers_more_of_them() -> None:
    """DeepSeek-V3's states (671B in fp32, 97% of them experts) on 256 H100s, 8 per node: `dp=16,ep=2,tp=8`
    (experts split 16 ways: each rank gathers a sixteenth of them from 16 ranks, every micro-batch) moves more
    than `dp=8,ep=32` (a 32nd from 8 ranks), though its compute share is the same: the step floor ranks it after.
    Under fsdp the traffic grows with the micro-batches (each gathers and reduce-scatters); under ddp it does
    not (one all-reduce a step)."""
    params = 671 * 10**9 * 4
    totals = States(params=params, grads=params, optimizer=2 * params, experts=int(0.975 * params))
    few = Candidate({"dp": 16, "ep": 2, "tp": 8}, "fsdp", accumulate=4)
    many = Candidate({"dp": 8, "ep": 32}, "fsdp", accumulate=4)
    t_few, t_many = (states_traffic(c, totals, H100, 8) for c in (few, many))
    assert t_few > 1.05 * t_many
    floors = [step_floor(12.0, traffic_of(c, totals, H100, 8)) for c in (few, many)]
    assert t_many > 12.0 and floors[0] > floors[1]
    double = Candidate({"dp": 8, "ep": 32}, "fsdp", accumulate=8)
    assert states_traffic(double, totals, H100, 8) == pytest.approx(2 * t_many, rel=1e-6)
    ddp = [Candidate({"dp": 8, "ep": 32}, "ddp", accumulate=a) for a in (1, 8)]
    assert states_traffic(ddp[0], totals, H100, 8) == states_traffic(ddp[1], totals, H100, 8) > 0
    assert states_traffic(Candidate({"dp": 8, "ep": 32}), totals, H100, 8) == 0.0  # the script's own: unknown


DENSE = str(ROOT / "tests" / "workers" / "plan_worker.py")
DENSE_ARGS = ("--remat", "none", "--compile", "none")
# the same Llama 8x wider (hidden 512): its matrices over ZeRO-3's persistence threshold (1e5 elements)
WIDE_ARGS = (*DENSE_ARGS, "--hidden", "512", "--heads", "8")


def _dense_totals(args: tuple[str, ...]) -> tuple[States, Zero3Shape]:
    with Pool(1) as pool:
        probe = tiers._probe(pool, DENSE, args, "h100-sxm", "cuda", 16)
    assert "autocast(" not in probe["report"]["strategy"]  # fp32: gathered as held (gather_ratio 1)
    return States.of(probe["report"]["per_rank"]), Zero3Shape.of_probe(probe)


@pytest.fixture(scope="module")
def dense_totals() -> tuple[States, Zero3Shape]:
    return _dense_totals(DENSE_ARGS)


@pytest.fixture(scope="module")
def wide_totals() -> tuple[States, Zero3Shape]:
    return _dense_totals(WIDE_ARGS)


def _dense_run(strategy: str, args: tuple[str, ...], accumulate: int = 2) -> dict[str, Any]:
    """The dry run of the dense Llama at dp=8 as the planner makes it (`Job.steps`: ZeRO-3's second step)."""
    c = Candidate({"dp": 8}, strategy, accumulate=accumulate, global_batch_size=16, offload="none")
    job = tiers._job(c, Job(DENSE, args, 8, 1, gpu="h100-sxm"))
    assert job.steps == (2 if strategy == "zero3" else 1)
    return run_job(job)["report"]


def _dp_bytes(report: dict[str, Any]) -> dict[str, int]:
    """The states' collectives over dp: not the small all-reduces (the clip's, the loss's) nor ZeRO-3's
    broadcasts of its trace (module ids, checked across the ranks)."""
    return {
        k: rows["dp"]["bytes"]
        for k, rows in report["comm"].items()
        if rows["dp"]["bytes"] > 1024 and k != "broadcast"
    }


@pytest.mark.parametrize("strategy", ["fsdp", "zero1", "zero2", "zero3"])
def test_a_dense_fp32_models_gathers_and_deepspeeds_reductions_are_the_dry_runs(
    dense_totals: tuple[States, Zero3Shape], strategy: str
) -> None:
    """A dense Llama in fp32 (no autocast) at dp=8 with 2 micro-batches: fsdp gathers the fp32 params as held;
    ZeRO-1 all-reduces the gradients once a step, ZeRO-2 each micro-batch, each all-gathering the updated params
    once; ZeRO-3 reduce-scatters as fsdp, and this Llama's params being all persistent (at most 1e5 elements
    each), gathers them once a step, after the update, from its second step on (the first, which records
    DeepSpeed's trace, gathers 3.85x their bytes; 4.85x when an af.Loss's count forwards ran before the
    micro-batches)."""
    pytest.importorskip("deepspeed")
    report = _dense_run(strategy, DENSE_ARGS)
    totals, zero3 = dense_totals
    c = Candidate(report["mesh"], strategy, accumulate=2)
    moved = traffic_of(c, totals, H100, 8, gather_ratio=1, zero3=zero3).moved
    measured = _dp_bytes(report)
    ours = {kind: nbytes for (kind, axes), nbytes in moved.items() if axes == ("dp",)}
    assert set(ours) == set(measured), (ours, measured)
    for kind, nbytes in ours.items():
        assert nbytes == pytest.approx(measured[kind], rel=0.03), kind
    assert zero3.persistent == pytest.approx(1.0) and zero3.loss_counts


@pytest.mark.parametrize("accumulate, times", [(1, 1), (2, 2)])
def test_zero3_gathers_each_param_once_a_micro_batch_and_keeps_it_for_the_backward(
    wide_totals: tuple[States, Zero3Shape], accumulate: int, times: int
) -> None:
    """ZeRO-3 of the Llama 8x wider (its matrices not persistent, 5M params: under the reuse distance). Each
    micro-batch gathers each param once, kept from its forward to its backward: also two of an af.Loss, whose
    update divides by the count (no count forward per micro-batch: before, each micro-batch gathered them for
    its count forward, its forward and its backward, DeepSpeed keeping none from forward to backward after the
    count forwards' forward-only trace: 6x the params' bytes). The persistent ones (norms) once; within 3%."""
    pytest.importorskip("deepspeed")
    totals, zero3 = wide_totals
    assert (
        zero3.loss_counts and not zero3.count_forwards and 0 < zero3.persistent < 0.01 and zero3.reused > 0.99
    )
    report = _dense_run("zero3", WIDE_ARGS, accumulate)
    c = Candidate(report["mesh"], "zero3", accumulate=accumulate)
    moved = traffic_of(c, totals, H100, 8, gather_ratio=1, zero3=zero3).moved
    measured = _dp_bytes(report)
    assert moved["all_gather", ("dp",)] == pytest.approx(measured["all_gather"], rel=0.03)
    assert measured["all_gather"] == pytest.approx(times * totals.params, rel=0.03)


def test_zero3_under_fp16_gathers_an_af_loss_for_each_count_forward_too(
    wide_totals: tuple[States, Zero3Shape], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lowering fp16 gets (DeepSpeed's dynamic loss scale: the count known before the first backward), on
    the 8x wider Llama at 2 micro-batches of an af.Loss: each micro-batch gathers the params for its count
    forward and its forward, and keeps them for its backward (the count forwards' cached release decisions
    cleared: 6x the params' bytes without that); 4x the params' bytes, within 3%."""
    pytest.importorskip("deepspeed")
    import importlib

    dry = importlib.import_module("accelfn.transforms.shard.deepspeed.dry")
    monkeypatch.setattr(dry, "_divides", lambda *a: False)  # as under fp16 (this dry run is fp32)
    totals, zero3 = wide_totals
    fp16 = attrs.evolve(zero3, fp16=True)
    assert fp16.count_forwards and not zero3.count_forwards
    report = _dense_run("zero3", WIDE_ARGS, 2)
    c = Candidate(report["mesh"], "zero3", accumulate=2)
    moved = traffic_of(c, totals, H100, 8, gather_ratio=1, zero3=fp16).moved
    measured = _dp_bytes(report)
    assert moved["all_gather", ("dp",)] == pytest.approx(measured["all_gather"], rel=0.03)
    assert measured["all_gather"] == pytest.approx(4 * totals.params, rel=0.03)


LLAMA = str(ROOT / "examples" / "train_llama.py")
LLAMA_ARGS = ("--model", "tiny", "--seq-len", "32", "--remat", "none", "--compile", "none", "--steps", "1")


def test_a_pipeline_reduce_scattering_each_micro_batch_moves_its_count_times_the_held_ones(
    dense_totals: tuple[States, Zero3Shape],
) -> None:
    """pp=2 x dp=4 fsdp, 4 pipeline micro-batches: a stage holding its gradients reduce-scatters them once a
    step; `af.pipeline(..., sync_each_microbatch=True)` (the candidate's knob, or the script's) once per
    micro-batch, 4x the bytes, as the dry run of a tiny Llama (examples/train_llama.py) measures; the params
    gathered once a step either way."""
    totals, _ = dense_totals
    measured = {}
    for each in (False, True):
        env = _env(strategy="fsdp", global_batch_size=16, pipeline_microbatches=4,
                   pipeline_sync_each_microbatch=each)  # fmt: skip
        job = Job(LLAMA, LLAMA_ARGS, 8, 1, mesh="pp=2,dp=4", gpu="h100-sxm", env=env)
        report = run_job(job)["report"]
        assert ("sync_each_microbatch=True" in report["strategy"]) is each
        measured[each] = {k: report["comm"][k]["dp"]["bytes"] for k in ("all_gather", "reduce_scatter")}
    c = Candidate({"pp": 2, "dp": 4}, "fsdp", pipeline_microbatches=4)
    held = traffic_of(c, totals, H100, 8, gather_ratio=1).moved
    each = traffic_of(Candidate({"pp": 2, "dp": 4}, "fsdp", pipeline_microbatches=4, pipeline_sync_each_microbatch=True),
                      totals, H100, 8, gather_ratio=1).moved  # fmt: skip
    assert traffic_of(c, totals, H100, 8, gather_ratio=1, script_sync_each=True).moved == each
    rs, ag = ("reduce_scatter", ("dp",)), ("all_gather", ("dp",))
    assert each[rs] == pytest.approx(4 * held[rs]) and each[ag] == held[ag]
    assert measured[True]["reduce_scatter"] == pytest.approx(4 * measured[False]["reduce_scatter"], rel=0.03)
    assert measured[True]["all_gather"] == pytest.approx(measured[False]["all_gather"], rel=0.03)


def test_a_script_fixing_its_pipelines_gradient_sync_is_seen_by_the_probe() -> None:
    """examples/train_llama.py --pp-sync-each-microbatch builds its pipeline only when pp > 1, so its
    one-process probe lowers none; the value it gives the knob (`launch_env.FIXED`) is what tells the plan that
    its pipelines hold no gradients (`tiers._sync_each`), and the states bound of a pp candidate drops them."""
    from accelfn.planner.prune import states_bound

    with Pool(1) as pool:
        probe = tiers._probe(pool, LLAMA, (*LLAMA_ARGS, "--pp-sync-each-microbatch"), "h100-sxm", "cuda", 16)
    described = probe["report"]["strategy"]
    assert "pipeline(" not in described and probe["fixed"]["pipeline_sync_each_microbatch"] is True
    each = tiers._sync_each(described, probe["fixed"])
    totals = States.of(probe["report"]["per_rank"])
    c = Candidate({"pp": 2, "dp": 4}, "fsdp")
    held = states_bound(c, totals, script_strategy=None)
    assert each and states_bound(c, totals, script_strategy=None, script_sync_each=each) < held


def test_a_script_fixing_zero3_is_dry_run_at_its_steady_step_like_a_candidate_choosing_it() -> None:
    """The estimate models ZeRO-3's steady step; its dry runs measure the second step (`Job.steps`), where a
    candidate sets the strategy and where the script fixes it (`Job.zero3`, the plan's base job), not where
    a candidate sets another."""
    base = Job(DENSE, DENSE_ARGS, 8, 1, zero3=True)
    assert base.steps == 2
    assert tiers._job(Candidate({"dp": 8}), base).steps == 2
    assert tiers._job(Candidate({"dp": 8}, "fsdp"), base).steps == 1
    assert tiers._job(Candidate({"dp": 8}, "zero3"), Job(DENSE, DENSE_ARGS, 8, 1)).steps == 2
