"""`accelfn plan`'s search space beyond the dense mesh: optimizer offload with tensor parallel, expert parallel
for a mixture-of-experts script, ZeRO 1-3 through the DeepSpeed backend.

Each planner check runs a tiny model at 8 fake ranks: the planner's choice against an exhaustive search of the
same grid, and its legality against the lowering's own errors.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path

import attrs
import pytest

import accelfn as af
from accelfn import launch_env
from accelfn.planner import Space, States, enumerate_candidates, states_bound
from tests._launch import ROOT, WORKERS, output_of, run_workers
from tests.plan_memo import shared_dry_runs

PLAN_WORKER = str(WORKERS / "plan_worker.py")
MOE = str(ROOT / "examples" / "train_moe.py")


def _env(**knobs: object) -> tuple[tuple[str, str], ...]:
    return tuple((launch_env.KNOBS[k][0], str(v)) for k, v in knobs.items())


# ---- offload with tensor parallel ------------------------------------------------------------------------------


def test_optimizer_offload_with_tensor_parallel_lowers_on_the_modelled_gpu() -> None:
    """The candidate an earlier plan reported failing (`aten.copy_ got mixed torch.Tensor and DTensor`): ddp with
    optimizer offload on dp=4,tp=2, dry-run on the modelled H100 (the host update's copying path, on each rank's
    tp pieces). The offloaded optimizer state is on the host, the rest as without offload."""
    from accelfn.planner.search import Job, run_job

    args = ("--remat", "none", "--compile", "none")
    knobs = dict(strategy="ddp", accumulate=1, global_batch_size=8)
    job = Job(PLAN_WORKER, args, 8, 1, mesh="dp=4,tp=2", gpu="h100-sxm")
    off = run_job(attrs.evolve(job, env=_env(**knobs, offload="optimizer")))
    on = run_job(attrs.evolve(job, env=_env(**knobs, offload="none")))
    assert "error" not in off, off.get("error")
    got, ref = off["report"]["per_rank"], on["report"]["per_rank"]
    assert ref["optimizer"] > 0 and got["optimizer"] == 0
    assert got["host"] >= ref["optimizer"] + ref["grads"]  # the state, and the gradients' host buffers
    assert (got["params"], got["grads"]) == (ref["params"], ref["grads"])
    assert got["peak"] <= ref["peak"] - ref["optimizer"]


# ---- expert parallel: an ep axis for a model with experts -------------------------------------------------------

MOE_ARGS = ["--steps", "2", "--experts", "4", "--remat", "none", "--offload", "none", "--accumulate", "1"]
MOE_MEMORY_GIB = 300 / 2**20  # usable: 300 KiB, which only meshes with ep fit (the ep=1 meshes: 0.65-1.1 MiB)


def test_ep_is_enumerated_only_for_a_model_with_experts_inside_a_node() -> None:
    def meshes(experts: int) -> list[tuple[tuple[str, int], ...]]:
        space = Space(world=16, nproc_per_node=8, open=frozenset({"mesh"}), experts=experts)
        return sorted(tuple(sorted(c.mesh.items())) for c in enumerate_candidates(space))

    want = []  # every (pp, dp, ep, cp, tp) multiplying to 16 with ep x cp x tp dividing a node's 8
    for pp, ep, cp, tp in itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)):
        if 8 % (ep * cp * tp) == 0 and 16 % (pp * ep * cp * tp) == 0:
            mesh = {"pp": pp, "dp": 16 // (pp * ep * cp * tp), "ep": ep, "cp": cp, "tp": tp}
            want.append(tuple(sorted((k, v) for k, v in mesh.items() if v > 1 or k == "dp")))
    assert meshes(8) == sorted(want)
    dense = [m for m in want if dict(m).get("ep", 1) == 1]
    assert meshes(0) == sorted(dense)  # a dense model: no ep


def test_the_probe_counts_the_experts_of_the_scripts_model() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from accelfn.planner.experts import count_experts

    qwen = Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_experts=6,
                          num_experts_per_tok=2)  # fmt: skip
    llama = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    assert count_experts(Qwen3MoeForCausalLM(qwen)) == 6
    assert count_experts(LlamaForCausalLM(llama)) == 0


@pytest.fixture(scope="module")
def moe_plans() -> tuple[af.planner.Plan, af.planner.Plan]:
    kw = dict(nproc_per_node=8, global_batch_size=16, axes=("dp", "ep"), memory_gib=MOE_MEMORY_GIB, workers=1)
    kw["strategies"] = ("ddp", "fsdp", "hsdp")  # (ZeRO: below)
    with shared_dry_runs():
        return af.plan(MOE, MOE_ARGS, **kw), af.plan(MOE, MOE_ARGS, prune=False, **kw)  # type: ignore[arg-type]


def test_the_moe_plan_chooses_an_ep_mesh_within_3_percent_of_the_exhaustive_best(moe_plans) -> None:
    pruned, exhaustive = moe_plans
    assert pruned.best is not None and exhaustive.best is not None
    assert pruned.best.candidate.mesh.get("ep", 1) > 1
    best = max(r.tokens_per_s_per_gpu or 0.0 for r in exhaustive.rows)
    assert pruned.best.tokens_per_s_per_gpu >= 0.97 * best
    assert exhaustive.dry_runs == exhaustive.candidates - exhaustive.counts()["legality"]
    assert pruned.dry_runs < exhaustive.dry_runs
    assert all(r.peak <= exhaustive.capacity_bytes for r in exhaustive.rows)
    assert not [f for f in exhaustive.fallen if f.tier == "failed"], exhaustive.fallen


def test_the_moe_legality_is_the_lowerings(moe_plans) -> None:
    """ep=8 does not divide the 4 experts: the lowering's error, once per mesh; fsdp with ep and no other data
    axis falls at the planner's legality, a rule the lowering enforces too (checked by running it)."""
    from accelfn.planner.search import Job, run_job

    pruned, exhaustive = moe_plans
    for plan in (pruned, exhaustive):
        falls = {f.candidate.label: f for f in plan.fallen}
        bad = falls["dp=1,ep=8 ddp"]
        assert bad.tier == "lowering" and "4 experts on dim 0, which ep=8 does not divide" in bad.reason
        assert falls["dp=1,ep=8 fsdp"].tier == "legality"
    job = Job(MOE, tuple(MOE_ARGS), 2, 1, mesh="dp=1,ep=2", env=_env(strategy="fsdp", global_batch_size=16))
    result = run_job(job)
    assert (
        result.get("lowering")
        and "the experts are FSDP-sharded over the data axes other than ep" in result["error"]
    )


def test_the_states_bound_with_ep_is_below_every_measured_rank(moe_plans) -> None:
    """The bound splits the experts' bytes (the probe's `expert_bytes`) as expert parallel does and the dense
    layers' as the strategy does: below every measured rank, and under ddp with ep within 1% of it (the whole
    model over ep, before the split: 42% and 68% of the measured ep=4 and ep=2 ranks)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from train_moe import make_model

    from accelfn.planner.experts import expert_bytes
    from accelfn.planner.search import Job, run_job

    _, exhaustive = moe_plans
    model = make_model(4, 0)
    params = 4 * sum(p.numel() for p in model.parameters())  # fp32; adamw's two moments
    probe = run_job(Job(MOE, tuple(MOE_ARGS), 1, 1, env=_env(strategy="ddp", global_batch_size=16)))
    # the probe records the bytes the bound splits
    assert probe["expert_bytes"] == expert_bytes(model) > params / 2
    whole = States(params=params, grads=params, optimizer=2 * params, experts=probe["expert_bytes"])
    unsplit = attrs.evolve(whole, experts=0)  # the bound before: the whole model over ep x cp
    ddp_ep = 0
    for r in exhaustive.rows + exhaustive.unfit:
        bound = states_bound(r.candidate, whole, script_strategy=None)
        assert bound <= r.states, r.candidate.label
        if r.candidate.strategy == "ddp" and r.candidate.mesh.get("ep", 1) > 1:
            ddp_ep += 1
            assert bound >= 0.99 * r.states, (r.candidate.label, bound, r.states)
            assert states_bound(r.candidate, unsplit, script_strategy=None) <= 0.7 * r.states
    assert ddp_ep == 2  # dp=2,ep=4 and dp=4,ep=2 (ep=8 falls at lowering)
    bounded = [f for f in moe_plans[0].fallen if f.tier == "states bound"]
    assert bounded and all(f.candidate.mesh.get("ep", 1) == 1 for f in bounded)


@pytest.mark.slow
def test_accelfn_plan_writes_an_ep_config_that_accelfn_launch_trains(tmp_path: Path, monkeypatch) -> None:
    """On 2 ranks with 2 MiB usable only ep=2 fits (without ep, transformers' batched expert GEMMs gather each
    token's expert weights); the written config launches examples/train_moe.py on 2 CPU processes on that mesh,
    and its loss falls as the example checks (expert parallel against one process: tests/test_expert_parallel.py)."""
    from accelfn.cli.main import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no calibration of this machine's user
    path, js = tmp_path / "plan.yaml", tmp_path / "plan.json"
    args = ["--nproc-per-node", "2", "--global-batch-size", "16", "--axes", "dp,ep", "--memory-gib", "0.002",
            "--workers", "1", "--strategies", "ddp,fsdp,hsdp"]  # fmt: skip
    code = main(["plan", *args, "--no-progress", "--write", str(path), "--json", str(js), MOE, *MOE_ARGS])
    assert code == 0
    chosen = json.loads(js.read_text())["chosen"]["candidate"]
    assert chosen["mesh"] == {"dp": 1, "ep": 2} and chosen["strategy"] == "ddp"
    train = ["--steps", "20", *MOE_ARGS[2:]]  # 20 steps: the example's loss check
    proc = run_workers(MOE, 2, *train, launch_args=("--config", str(path)))
    assert proc.returncode == 0 and "CHECK moe loss falls: OK" in proc.stdout, output_of(proc)
    ran = re.search(r"config mesh=(\{.*?\}) strategy=(\w+)", proc.stdout)
    assert ran and eval(ran.group(1)) == chosen["mesh"] and ran.group(2) == "ddp", output_of(proc)  # noqa: S307
    assert "each rank holds 2 of 4 experts" in proc.stdout and "batch=8 per data rank" in proc.stdout


# ---- ZeRO 1-3 through DeepSpeed: the strategy knob's zero1|zero2|zero3 --------------------------------------------

ZERO_ARGS = ["--remat", "none", "--compile", "none", "--offload", "none", "--accumulate", "1"]


def _zero_main(**shard: object) -> object:
    """examples/train_llama.py's tiny Llama under af.shard(**shard) on a dp mesh, one step (a dry run's script)."""

    def main() -> None:
        import torch

        sys.path.insert(0, str(ROOT / "examples"))
        from train_llama import build, loss_fn

        mesh = af.Mesh({"dp": -1})
        step = af.shard(af.train_step(loss_fn, af.optim.adamw(1e-3), clip_grad_norm=1.0), mesh, **shard)  # type: ignore[arg-type]
        state = step.init(build("tiny", 128))
        step(state, torch.zeros(2, 129, dtype=torch.long))

    return main


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_strategy_zero_n_is_deepspeed_at_that_stage(stage: int) -> None:
    """`af.shard(strategy="zeroN")` (what a script passing the strategy knob runs) is `backend="deepspeed",
    zero_stage=N`: the same per-rank bytes and collectives in the dry run (whose ZeRO figures are checked against
    the real engine: tests/test_dry_run_zero.py), and the stage's split of each state."""
    short = af.dry_run(_zero_main(strategy=f"zero{stage}"), nproc_per_node=8, device="cpu", search=False)
    long = af.dry_run(
        _zero_main(backend="deepspeed", zero_stage=stage), nproc_per_node=8, device="cpu", search=False
    )
    assert short.per_rank == long.per_rank and short.comm == long.comm
    ddp = af.dry_run(_zero_main(strategy="ddp"), nproc_per_node=8, device="cpu", search=False)
    (p, g, o) = (ddp.per_rank[k] for k in ("params", "grads", "optimizer"))
    assert short.per_rank["optimizer"] < o  # stage 1 on: the optimizer state split over the 8 ranks
    assert (short.per_rank["grads"] < g) == (stage >= 2) and (short.per_rank["params"] < p) == (stage >= 3)


def test_a_zero_strategy_with_another_stage_or_backend_names_both() -> None:
    step = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1))
    with af.Mesh({"dp": 1}, device="cpu") as mesh:
        with pytest.raises(ValueError, match=re.escape("strategy='zero2' is ZeRO stage 2, but zero_stage=3")):
            af.shard(step, mesh, strategy="zero2", zero_stage=3)
        with pytest.raises(ValueError, match=re.escape("strategy='zero1' runs on backend='deepspeed', not")):
            af.shard(step, mesh, strategy="zero1", backend="local")
        with pytest.raises(ValueError, match="strategy must be one of .*'zero3'"):
            af.shard(step, mesh, strategy="zero4")
    with pytest.raises(ValueError, match=re.escape("af.plan: strategies ['zero4'] are not strategies")):
        af.plan(PLAN_WORKER, strategies=("ddp", "zero4"))


def test_zero_is_enumerated_on_data_parallel_meshes_only_as_the_lowering_allows() -> None:
    """DeepSpeed runs data-parallel over all the processes: ZeRO candidates only on a dp mesh; the lowering
    refuses tp and cp (its errors, checked here), and af.offload with it (the planner's legality)."""
    from accelfn.planner.candidates import Candidate
    from accelfn.planner.prune import illegal
    from accelfn.planner.search import Job, run_job

    strategies = ("ddp", "fsdp", "hsdp", "zero1", "zero2", "zero3")
    open_ = frozenset({"mesh", "strategy"})
    space = Space(world=8, nproc_per_node=8, open=open_, axes=("dp", "tp", "cp"), strategies=strategies)
    labels = [c.label for c in enumerate_candidates(space)]
    assert len(labels) == len(set(labels))
    assert sorted(x for x in labels if "zero" in x) == ["dp=8 zero1", "dp=8 zero2", "dp=8 zero3"]
    refusals = {
        "dp=4,tp=2": "does not combine with tensor parallel",
        "dp=4,cp=2": "DeepSpeed splits no sequence",
    }
    for mesh, why in refusals.items():
        env = _env(strategy="zero2", global_batch_size=8)
        result = run_job(Job(PLAN_WORKER, tuple(ZERO_ARGS), 8, 1, mesh=mesh, env=env))
        assert result.get("lowering") and why in result["error"], result
    offloaded = _env(strategy="zero1", global_batch_size=8, offload="optimizer")
    result = run_job(
        Job(PLAN_WORKER, ("--remat", "none", "--compile", "none"), 8, 1, mesh="dp=8", env=offloaded)
    )
    assert result.get("lowering") and "DeepSpeed offloads through its own config" in result["error"]
    assert "offloads through its own config" in (
        illegal(Candidate({"dp": 8}, "zero1", offload="optimizer")) or ""
    )


def test_zero_is_searched_where_deepspeed_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelfn.planner import candidates

    for installed in (False, True):
        monkeypatch.setattr(candidates, "deepspeed_installed", lambda installed=installed: installed)
        space = Space(world=8, nproc_per_node=8, open=frozenset({"mesh", "strategy"}), axes=("dp",))
        zero = [c.label for c in enumerate_candidates(space) if c.strategy in candidates.ZERO]
        assert zero == (["dp=8 zero1", "dp=8 zero2", "dp=8 zero3"] if installed else [])


@pytest.fixture(scope="module")
def zero_plans() -> tuple[af.planner.Plan, af.planner.Plan]:
    """Plans of the tiny Llama over dp and the strategy, ZeRO searched (in this process: workers=1) as where
    DeepSpeed is installed (the dry run models its engine without it)."""
    from accelfn.planner import candidates

    kw = dict(nproc_per_node=8, global_batch_size=8, axes=("dp",), workers=1)
    with pytest.MonkeyPatch.context() as mp, shared_dry_runs():
        mp.setattr(candidates, "deepspeed_installed", lambda: True)
        return af.plan(PLAN_WORKER, ZERO_ARGS, **kw), af.plan(PLAN_WORKER, ZERO_ARGS, prune=False, **kw)  # type: ignore[arg-type]


def test_the_plan_searches_zero_stages_within_3_percent_of_the_exhaustive_best(zero_plans) -> None:
    pruned, exhaustive = zero_plans
    measured = {r.candidate.strategy for r in exhaustive.rows}
    assert {"zero1", "zero2", "zero3"} <= measured
    best = max(r.tokens_per_s_per_gpu or 0.0 for r in exhaustive.rows)
    assert pruned.best is not None and pruned.best.tokens_per_s_per_gpu >= 0.97 * best
    assert exhaustive.dry_runs == exhaustive.candidates == 7  # ddp, fsdp, 2 hsdp, 3 ZeRO stages


def test_the_zero_states_bound_is_each_stages_split_and_below_the_measured_rank(zero_plans) -> None:
    _, exhaustive = zero_plans
    rows = {r.candidate.strategy: r for r in exhaustive.rows}
    ddp = rows["ddp"]  # every rank holds every state whole
    params = 4 * sum(p.numel() for p in _plan_worker_model().parameters())
    whole = States(params=params, grads=params, optimizer=2 * params)
    assert ddp.states >= whole.params + whole.grads + whole.optimizer
    for name in ("zero1", "zero2", "zero3"):
        bound = states_bound(rows[name].candidate, whole, script_strategy=None)
        assert bound <= rows[name].states, name
    assert rows["zero1"].states > rows["zero2"].states
    # ZeRO-3 from its second step (the one the plan measures, `Job.steps`): its partitions of every state, and
    # this Llama's params all persistent (at most 1e5 elements each) every param gathered besides
    assert rows["zero3"].states >= whole.params + (whole.params + whole.grads + whole.optimizer) // 8


def test_the_dry_run_of_a_written_zero_config_reproduces_its_row(zero_plans, tmp_path: Path) -> None:
    from accelfn.cli.main import main
    from accelfn.launch.config import Config, PlanConfig, save

    _, exhaustive = zero_plans
    row = next(r for r in exhaustive.rows if r.candidate.strategy == "zero2")
    knobs = {k: v for k, v in row.candidate.knobs().items() if k in ("strategy", "global_batch_size")}
    path = save(
        Config(num_processes=8, mesh=row.candidate.mesh_spec, plan=PlanConfig(**knobs)), tmp_path / "p.yaml"
    )
    out = tmp_path / "report.json"
    assert (
        main(["dry-run", "--config", str(path), "--no-search", "--json", str(out), PLAN_WORKER, *ZERO_ARGS])
        == 0
    )
    report = json.loads(out.read_text())
    assert report["per_rank"]["peak"] == row.peak and report["mesh"] == {"dp": 8}


def _plan_worker_model() -> object:
    """tests/workers/plan_worker.py's model with its defaults, built by transformers directly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         use_cache=False, attn_implementation="sdpa")  # fmt: skip
    return LlamaForCausalLM(config)
