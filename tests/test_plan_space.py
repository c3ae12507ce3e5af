"""`accelfn plan`'s search space beyond the dense mesh: optimizer offload with tensor parallel, expert parallel
for a mixture-of-experts script, ZeRO 1-3 through the DeepSpeed backend.

Each planner check runs a tiny model at 8 fake ranks: the planner's choice against an exhaustive search of the
same grid, and its legality against the lowering's own errors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import attrs
import pytest

import accelfn as af
from accelfn import launch_env
from accelfn.planner import Space, States, enumerate_candidates, states_bound
from tests._launch import ROOT, WORKERS, output_of, run_workers

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
        space = Space(
            world=16, nproc_per_node=8, open=frozenset({"mesh"}), axes=("dp", "tp", "ep"), experts=experts
        )
        return sorted(tuple(sorted(c.mesh.items())) for c in enumerate_candidates(space))

    want = []  # every (dp, ep, tp) multiplying to 16 with ep x tp dividing a node's 8
    for tp in (1, 2, 4, 8):
        for ep in (1, 2, 4, 8):
            if 8 % (ep * tp) == 0:
                mesh = {"dp": 16 // (ep * tp), "ep": ep, "tp": tp}
                want.append(tuple(sorted((k, v) for k, v in mesh.items() if v > 1 or k == "dp")))
    assert meshes(8) == sorted(want)
    assert all(dict(m).get("ep", 1) == 1 for m in meshes(0))  # a dense model: no ep
    assert len(meshes(0)) == 4


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
    _, exhaustive = moe_plans
    ddp = next(r for r in exhaustive.rows + exhaustive.unfit if r.candidate.label == "dp=8 ddp")
    whole = States(params=ddp.states, grads=0, optimizer=0)  # ddp over dp: every rank holds the whole model
    for r in exhaustive.rows + exhaustive.unfit:
        assert states_bound(r.candidate, whole, script_strategy=None) <= r.states, r.candidate.label
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
            "--workers", "1"]  # fmt: skip
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
