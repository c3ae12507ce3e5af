"""`accelfn plan` / `af.plan`: the candidates, the tiers (legality by the lowering's own checks, the exact
states bound), the choice against an exhaustive search, the written config applied by `accelfn launch` and
`accelfn dry-run`, and bad input.

The planned script is tests/workers/plan_worker.py: a tiny Llama (4 heads, 2 kv heads) that leaves its mesh and
its strategy / accumulate / global batch (and remat / offload, unless fixed by a flag) to the launch config.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import attrs
import pytest
import torch

import accelfn as af
from accelfn import launch_env
from accelfn.launch.config import Config, ConfigError, load
from accelfn.planner import Candidate, Space, States, enumerate_candidates, states_bound
from accelfn.planner.candidates import REMATS
from tests._launch import WORKERS, output_of, run_workers
from tests.plan_memo import shared_dry_runs

SCRIPT = str(WORKERS / "plan_worker.py")
FIXED = [
    "--remat",
    "none",
    "--offload",
    "none",
    "--compile",
    "none",
]  # the grid: mesh x strategy x accumulate
MEMORY_GIB = 1.3 / 1024  # usable memory: ddp over 8 ranks cannot hold the states, fsdp can


# ---- the knobs and the config ----------------------------------------------------------------------------------


def test_knob_auto_takes_the_launch_config_and_a_fixed_value_is_kept() -> None:
    env = {"ACCELFN_STRATEGY": "hsdp", "ACCELFN_ACCUMULATE": "4"}
    launch_env.ASKED.clear()
    assert launch_env.knob("strategy", "auto", "ddp", environ=env) == "hsdp"
    assert launch_env.knob("accumulate", "auto", 1, environ=env) == 4
    assert launch_env.knob("remat", "auto", "none", environ=env) == "none"  # unset: the script's default
    assert launch_env.knob("strategy", "fsdp", "ddp", environ=env) == "fsdp"  # fixed by the script: kept
    assert {"strategy", "accumulate", "remat"} == launch_env.ASKED


def test_a_config_plan_section_round_trips_and_reaches_the_launched_env(tmp_path: Path) -> None:
    from accelfn.launch.launcher import LaunchOptions, resolve

    cfg = Config.from_dict(
        {"num_processes": 2, "mesh": "dp=2", "plan": {"strategy": "fsdp", "accumulate": 2}}
    )
    path = tmp_path / "plan.yaml"
    from accelfn.launch.config import save

    save(cfg, path)
    assert load(path) == cfg
    env = resolve(LaunchOptions(script="x.py", config_file=str(path), cpu=True), environ={}).env
    assert (env["ACCELFN_STRATEGY"], env["ACCELFN_ACCUMULATE"], env["ACCELFN_MESH"]) == ("fsdp", "2", "dp=2")
    assert "ACCELFN_REMAT" not in env


@pytest.mark.parametrize(
    ("plan", "culprit"),
    [
        ({"strategy": "zero9"}, "plan.strategy"),
        ({"accumulate": 0}, "plan.accumulate"),
        ({"remat": "some"}, "plan.remat"),
        ({"stratgy": "ddp"}, "plan.stratgy"),
    ],
)
def test_a_bad_plan_section_names_the_key(plan: dict[str, object], culprit: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(culprit)):
        Config.from_dict({"plan": plan})


def test_a_bad_knob_in_the_environment_names_the_variable() -> None:
    with pytest.raises(ValueError, match="ACCELFN_STRATEGY='zero9'"):
        launch_env.knob("strategy", "auto", environ={"ACCELFN_STRATEGY": "zero9"})
    with pytest.raises(ValueError, match="unknown knob 'stratgy'"):
        launch_env.knob("stratgy")


# ---- candidates and the states bound ---------------------------------------------------------------------------


def test_candidates_are_every_mesh_with_tp_and_cp_inside_a_node() -> None:
    space = Space(world=32, nproc_per_node=8, open=frozenset({"mesh"}), axes=("dp", "tp", "pp", "cp"))
    got = sorted(tuple(sorted(c.mesh.items())) for c in enumerate_candidates(space))
    want = []  # every (pp, dp, cp, tp) multiplying to 32 with tp x cp dividing a node's 8
    for pp in range(1, 33):
        for cp in range(1, 9):
            for tp in range(1, 9):
                if 32 % (pp * cp * tp) == 0 and 8 % (tp * cp) == 0:
                    mesh = {"pp": pp, "dp": 32 // (pp * cp * tp), "cp": cp, "tp": tp}
                    want.append(tuple(sorted((k, v) for k, v in mesh.items() if v > 1 or k == "dp")))
    assert got == sorted(want)


def test_candidates_split_the_global_batch_evenly() -> None:
    space = Space(
        world=8,
        nproc_per_node=8,
        open=frozenset({"mesh", "accumulate", "global_batch_size"}),
        axes=("dp", "tp"),
        global_batch_size=16,
    )
    for c in enumerate_candidates(space):
        dp = c.mesh["dp"]
        assert c.global_batch_size == 16 and (16 // dp) % c.accumulate == 0, c.label


# ---- the planner on the tiny Llama, pruned and exhaustive ------------------------------------------------------


@pytest.fixture(scope="module")
def plans() -> tuple[af.planner.Plan, af.planner.Plan]:
    kw = dict(nproc_per_node=8, global_batch_size=8, axes=("dp", "tp"), memory_gib=MEMORY_GIB)
    with shared_dry_runs():
        return af.plan(SCRIPT, FIXED, **kw), af.plan(SCRIPT, FIXED, prune=False, **kw)  # type: ignore[arg-type]


def test_the_plan_says_what_it_chooses_and_what_the_script_fixes(plans) -> None:
    pruned, _ = plans
    assert pruned.open_knobs == ["mesh", "strategy", "accumulate", "global_batch_size"]
    assert "remat" in pruned.fixed_knobs and "offload" in pruned.fixed_knobs


def test_legality_prunes_a_tp_that_does_not_divide_the_heads_with_the_lowerings_reason(plans) -> None:
    pruned, _ = plans
    heads, kv_heads = 4, 2  # plan_worker.py's defaults
    for f in pruned.fallen:
        tp = f.candidate.mesh.get("tp", 1)
        if kv_heads % tp:
            field, n = ("num_attention_heads", heads) if heads % tp else ("num_key_value_heads", kv_heads)
            assert f.tier == "lowering", f
            assert f"tp={tp} does not divide the model's {field} = {n}" in f.reason
    assert not [r for r in pruned.rows if kv_heads % r.candidate.mesh.get("tp", 1)]
    assert {f.candidate.mesh.get("tp") for f in pruned.fallen if f.tier == "lowering"} == {4, 8}


def test_the_states_bound_is_below_every_measured_rank_and_prunes_only_what_does_not_fit(plans) -> None:
    pruned, exhaustive = plans
    params = 4 * sum(p.numel() for p in _model().parameters())  # fp32; adamw's two moments
    totals = States(params=params, grads=params, optimizer=2 * params)
    for r in (
        exhaustive.rows + exhaustive.unfit
    ):  # the bound from the model's size, below what the dry run counts
        assert states_bound(r.candidate, totals, script_strategy=None) <= r.states, r.candidate.label
    bounded = [f.candidate for f in pruned.fallen if f.tier == "states bound"]
    assert bounded, "the usable memory was chosen so that ddp over 8 ranks falls at the states bound"
    unfit = {r.candidate.key for r in exhaustive.unfit}
    assert all(c.key in unfit for c in bounded)  # the dry run agrees: none of them fits
    assert "does not fit" in {f.tier for f in pruned.fallen}  # the bound is not the whole memory


def test_the_choice_is_within_3_percent_of_the_exhaustive_best(plans) -> None:
    pruned, exhaustive = plans
    assert pruned.best is not None and exhaustive.best is not None
    best = max(r.tokens_per_s_per_gpu or 0.0 for r in exhaustive.rows)
    assert pruned.best.tokens_per_s_per_gpu >= 0.97 * best
    assert exhaustive.dry_runs == exhaustive.candidates
    skipped = sum("as an earlier candidate of its mesh" in f.reason for f in pruned.fallen)
    assert skipped > 0  # the tiers saved dry runs: the states bound, and a mesh whose lowering fails
    counts = pruned.counts()  # (here each group's acc=2 runs first, memory binding: `dominated` below)
    saved = counts["states bound"] + skipped + counts["dominated"] + counts["time bound"]
    assert pruned.dry_runs == exhaustive.dry_runs - saved


def test_the_ranking_is_by_predicted_tokens_per_s_and_everything_in_it_fits(plans) -> None:
    pruned, _ = plans
    tokens = [r.tokens_per_s_per_gpu for r in pruned.rows]
    assert tokens == sorted(tokens, reverse=True)
    assert all(r.fits and r.peak <= pruned.capacity_bytes for r in pruned.rows)
    assert all(r.peak > pruned.capacity_bytes for r in pruned.unfit)


def test_the_dry_run_of_the_written_config_reproduces_the_plan(plans, tmp_path: Path) -> None:
    from accelfn.cli.main import main

    pruned, _ = plans
    path = pruned.write_config(tmp_path / "plan.yaml")
    best = pruned.best
    assert best is not None
    assert load(path).mesh == best.candidate.mesh_spec
    out = tmp_path / "report.json"
    code = main(["dry-run", "--config", str(path), "--no-search", "--json", str(out), SCRIPT, *FIXED])
    report = json.loads(out.read_text())
    assert report["mesh"] == best.candidate.mesh and report["world_size"] == 8
    assert report["per_rank"]["peak"] == best.peak
    assert math.isclose(report["predicted"]["step_time_s"], best.step_time_s, rel_tol=1e-9)
    assert code == 0  # (against the whole device: the plan's usable memory was an argument of the plan)


def test_the_table_json_and_picture(plans, tmp_path: Path) -> None:
    pruned, _ = plans
    text = pruned.table(top=3)
    assert pruned.best.candidate.label in text and "candidates by tier" in text and "states bound" in text
    data = json.loads(pruned.to_json())
    assert data["chosen"]["candidate"]["label"] == pruned.best.candidate.label
    assert sum(data["tiers"].values()) == data["candidates"] == len(pruned.fallen) + len(pruned.rows)
    png = pruned.plot(tmp_path / "plan.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- the written config launched --------------------------------------------------------------------------------


def _model() -> torch.nn.Module:
    """plan_worker.py's model with its defaults, built by transformers directly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         use_cache=False, attn_implementation="sdpa")  # fmt: skip
    return LlamaForCausalLM(config)


def _reference_losses(global_batch: int, steps: int) -> list[float]:
    """One process, plain PyTorch on the global batch: the same model, data and AdamW as plan_worker.py."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 256, (global_batch, 33), generator=gen)
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_accelfn_plan_writes_a_config_that_accelfn_launch_applies(tmp_path: Path, monkeypatch) -> None:
    from accelfn.cli.main import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no calibration of this machine's user

    path, js = tmp_path / "plan.yaml", tmp_path / "plan.json"
    args = ["--nproc-per-node", "2", "--global-batch-size", "4", "--axes", "dp,tp", "--no-progress"]
    args += ["--strategies", "ddp,fsdp,hsdp"]  # (a ZeRO plan launches DeepSpeed: tests/test_deepspeed.py)
    code = main(["plan", *args, "--write", str(path), "--json", str(js), SCRIPT, "--offload", "none"])
    assert code == 0
    chosen = json.loads(js.read_text())["chosen"]["candidate"]
    proc = run_workers("plan_worker.py", 2, "--offload", "none", launch_args=("--config", str(path)))
    assert proc.returncode == 0, output_of(proc)
    ran = re.search(
        r"config mesh=(\{.*?\}) strategy=(\w+) remat=([\w:]+) accumulate=(\d+) global_batch=(\d+)",
        proc.stdout,
    )
    assert ran, output_of(proc)
    assert eval(ran.group(1)) == chosen["mesh"]  # noqa: S307 - a dict the worker printed
    assert (ran.group(2), ran.group(3), int(ran.group(4)), int(ran.group(5))) == (
        chosen["strategy"], chosen["remat"], chosen["accumulate"], 4,
    )  # fmt: skip
    losses = [float(x) for x in re.findall(r"step \d+ loss ([0-9.]+)", proc.stdout)]
    assert losses == pytest.approx(_reference_losses(4, 2), abs=2e-5)


# ---- calibration ----------------------------------------------------------------------------------------------


def test_calibration_fits_a_runs_step_time_and_later_plans_predict_it(tmp_path: Path, monkeypatch) -> None:
    from accelfn.launch.config import PlanConfig, save
    from accelfn.planner.calibrate import calibrate
    from accelfn.planner.calibrate import load as load_calibration

    knobs = {"strategy": "fsdp", "accumulate": 1, "global_batch_size": 8}
    save(Config(num_processes=8, mesh="dp=8", plan=PlanConfig(**knobs)), tmp_path / "run.yaml")
    for name, value in knobs.items():  # the reference: the dry run of that configuration, uncalibrated
        monkeypatch.setenv(launch_env.KNOBS[name][0], str(value))
    report = af.dry_run(SCRIPT, FIXED, nproc_per_node=8, mesh="dp=8", search=False)
    for name in knobs:
        monkeypatch.delenv(launch_env.KNOBS[name][0])
    compute, step = report.predicted.compute_s, report.predicted.step_time_s
    # the run measured compute three times slower than the model: a warm-up, then steps within +-1%
    measured = [3 * compute + (step - compute)] * 4
    times = [10 * measured[0], measured[0] * 0.99, measured[0], measured[0] * 1.01, measured[0]]
    run = tmp_path / "runs" / "exp"
    run.mkdir(parents=True)
    run.joinpath("metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "step_time": t}) + "\n" for i, t in enumerate(times))
    )
    store = tmp_path / "calibration.json"
    cal = calibrate(run, SCRIPT, FIXED, config=tmp_path / "run.yaml", store=store)
    assert cal.gpu == "h100-sxm" and len(cal.points) == 1
    assert cal.residual == pytest.approx(0.01 / math.sqrt(2), rel=1e-6)  # the spread of the measured steps
    kw = dict(nproc_per_node=8, global_batch_size=8, axes=("dp",), workers=1)
    calibrated = af.plan(SCRIPT, FIXED, calibration=load_calibration("h100-sxm", store), **kw)  # type: ignore[arg-type]
    row = next(r for r in calibrated.rows if r.candidate.label == "dp=8 fsdp acc=1")
    assert row.step_time_s == pytest.approx(measured[0], rel=1e-3)
    assert row.error_band == cal.residual and "calibrated on h100-sxm from 1 run(s)" in calibrated.table()


def test_a_calibrations_scale_divides_every_kernels_time() -> None:
    import attrs

    from accelfn.dryrun.timing import OpCost, TimingAssumptions, cost_time, fused_time
    from accelfn.planner.calibrate import scaled_assumptions
    from accelfn.platforms.specs import spec

    h100, scale = spec("h100-sxm"), 0.5
    base = scaled_assumptions(1.0, "h100-sxm").timing
    scaled = scaled_assumptions(scale, "h100-sxm").timing
    for field in attrs.fields(TimingAssumptions):  # every efficiency the model has, one added later too
        if field.name.endswith(("efficiency", "_scale")) and isinstance(getattr(base, field.name), float):
            assert getattr(scaled, field.name) == pytest.approx(getattr(base, field.name) * scale), field.name
    kernels = [
        OpCost("matmul", 8192, 8192, 8192),
        OpCost("memory", nbytes=10**9),  # an eager ATen kernel (eager_memory_efficiency)
        *(
            OpCost("attention", flops=10**12, seq=2048, causal=c, backward_kernel=b)
            for c in (False, True)
            for b in (False, True)
        ),
    ]
    for backend in ("flash2", "cudnn"):
        b, s = (attrs.evolve(t, attention_backend=backend) for t in (base, scaled))
        for k in kernels:
            assert cost_time(k, h100, s) == pytest.approx(cost_time(k, h100, b) / scale), (backend, k)
    # a compiled kernel with a reduction, at torch.compile's measured table (reduction_efficiency None) or not
    assert base.reduction_efficiency is None and scaled.reduction_scale == pytest.approx(scale)
    for reduce in (0, 256, 2048, 1 << 20):
        assert fused_time(10**9, reduce, h100, scaled) == pytest.approx(
            fused_time(10**9, reduce, h100, base) / scale
        )


def test_a_calibrated_compiled_prediction_is_the_models_compute_over_the_scale() -> None:
    """Under af.compile(regions="blocks") the blocks' fused kernels with a reduction (RMSNorm over 256 elements)
    run at torch.compile's measured bandwidth table (`reduction_fraction`): the calibration scales it too, so the
    dry run's compute is exactly the model's over `scale`, the eager launch floor (the embedding, head, loss and
    update outside the blocks) over it too."""
    import attrs

    from accelfn.dryrun import Assumptions
    from accelfn.dryrun.report import Prediction
    from accelfn.planner.calibrate import scaled_assumptions

    args = ["--strategy", "ddp", "--remat", "none", "--accumulate", "1", "--offload", "none",
            "--compile", "blocks", "--global-batch-size", "4", "--hidden", "256", "--layers", "2"]  # fmt: skip

    def predicted(assumptions: Assumptions) -> Prediction:
        report = af.dry_run(
            SCRIPT, args, nproc_per_node=2, mesh="dp=2", search=False, assumptions=assumptions
        )
        assert report.predicted is not None and "2/2 blocks as partitioned graphs" in report.strategy
        return report.predicted

    base = predicted(scaled_assumptions(1.0, "h100-sxm"))
    assert base.assumes["compiled"] == "blocks" and base.assumes["launch_bound_kernels"] > 0
    plain = Assumptions()  # the table is used: a factor on it alone changes the compute
    table = predicted(attrs.evolve(plain, timing=attrs.evolve(plain.timing, reduction_scale=0.5)))
    assert table.compute_s > base.compute_s * 1.001
    for scale in (0.5, 1.7):
        scaled = predicted(scaled_assumptions(scale, "h100-sxm"))
        assert scaled.compute_s == pytest.approx(base.compute_s / scale, rel=1e-12), scale
        assert scaled.assumes["launch_s"] == pytest.approx(base.assumes["launch_s"] / scale)
        assert scaled.assumes["launch_bound_kernels"] == base.assumes["launch_bound_kernels"]


def test_calibration_names_a_run_without_step_times(tmp_path: Path) -> None:
    from accelfn.planner.calibrate import calibrate

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    with pytest.raises(ValueError, match="has no 'step_time' in its metrics.jsonl"):
        calibrate(tmp_path, SCRIPT, store=tmp_path / "c.json")


# ---- bad input --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"script": "no_such.py"}, "no such script: 'no_such.py'"),
        ({"nproc_per_node": 0}, "nproc_per_node must be an integer >= 1, got 0"),
        ({"global_batch_size": 0}, "global_batch_size must be an integer >= 1, got 0"),
        ({"axes": ("dp", "xp")}, "axes ['xp'] are not mesh axes"),
        ({"gpu": "h900"}, "gpu='h900'"),
        ({"memory_gib": 1000.0}, "memory_gib=1000.0 is more than the h100-sxm row's"),
    ],
)
def test_bad_arguments_name_the_culprit(kwargs: dict[str, object], message: str) -> None:
    script = kwargs.pop("script", SCRIPT)
    with pytest.raises(ValueError, match=re.escape(message)):
        af.plan(script, **kwargs)  # type: ignore[arg-type]


def test_a_script_leaving_the_global_batch_open_needs_one(capsys: pytest.CaptureFixture[str]) -> None:
    from accelfn.cli.main import main

    code = main(["plan", "--nproc-per-node", "2", "--axes", "dp", "--workers", "1", "--no-progress", SCRIPT])
    assert code == 2
    assert "give global_batch_size (accelfn plan --global-batch-size B)" in capsys.readouterr().err


def test_the_cli_rejects_a_bad_config_for_the_dry_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from accelfn.cli.main import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("plan:\n  strategy: zero9\n")
    assert main(["dry-run", "--config", str(bad), SCRIPT]) == 2
    assert "plan.strategy" in capsys.readouterr().err


def test_a_candidate_label_names_its_mesh_and_knobs() -> None:
    c = Candidate({"dp": 4, "tp": 2}, "fsdp", "full", 2, 16)
    assert c.label == "dp=4,tp=2 fsdp remat=full acc=2" and c.knobs()["global_batch_size"] == 16


# ---- the layer-extrapolated tier -------------------------------------------------------------------------------

DEEP = [*FIXED, "--layers", "10"]  # ten identical blocks


@pytest.mark.parametrize(
    "mesh, env",
    [
        ("dp=8", {"strategy": "fsdp", "accumulate": 2, "global_batch_size": 16}),
        ("dp=4,tp=2", {"strategy": "fsdp", "accumulate": 1, "global_batch_size": 8}),
        ("dp=8", {"strategy": "ddp", "accumulate": 1, "global_batch_size": 8}),
    ],
)
def test_two_and_three_blocks_extrapolate_to_the_full_dry_run(mesh: str, env: dict[str, object]) -> None:
    """The model cut to 2 and to 3 of its 10 blocks, each dry-run, extrapolated to 10: the full dry run's peak
    to 0.5% and its states exactly, its predicted step time to 1% (measured: peak and states exact, step time
    within 0.01%)."""
    from accelfn.planner.extrapolate import extrapolate
    from accelfn.planner.search import Job, run_job

    knobs = tuple((launch_env.KNOBS[k][0], str(v)) for k, v in env.items())
    job = Job(SCRIPT, tuple(DEEP), 8, 1, mesh=mesh, env=knobs, gpu="h100-sxm")
    full = run_job(job)
    cut = run_job(attrs.evolve(job, blocks=(2, 3)))
    assert full["blocks"] == cut["blocks"] == 10
    (two,), (three,) = cut["reports"][2], cut["reports"][3]
    assert two["per_rank"]["peak"] < three["per_rank"]["peak"] < full["report"]["per_rank"]["peak"]
    ex, ref = extrapolate(two, three, 2, 3, 10), full["report"]
    for k in ("params", "grads", "optimizer"):
        assert ex["per_rank"][k] == ref["per_rank"][k], k
    assert math.isclose(ex["per_rank"]["peak"], ref["per_rank"]["peak"], rel_tol=5e-3)
    for k in ("step_time_s", "compute_s", "tokens_per_s"):
        assert math.isclose(ex["predicted"][k], ref["predicted"][k], rel_tol=1e-2), k


def test_the_plan_ranks_on_extrapolations_and_its_top_rows_are_full_dry_runs() -> None:
    """With the tier on (a model of 10 blocks), every candidate is first measured on 2 and 3 blocks; the best
    `confirm` rows are then full dry runs, and the chosen row's figures are its exact dry run's."""
    from accelfn.planner.search import Job, run_job

    p = af.plan(
        SCRIPT, DEEP, nproc_per_node=8, global_batch_size=8, axes=("dp",), workers=1, confirm=2,
        extrapolate_min_blocks=4,
    )  # fmt: skip
    assert p.extrapolated == p.dry_runs - p.confirmed and p.extrapolated >= 3
    assert p.confirmed >= 2 and len(p.rows) >= 3
    assert not any(r.extrapolated for r in p.rows[:2])
    assert any(r.extrapolated for r in p.rows[2:])  # the rest stay extrapolated (marked ~ in the table)
    assert "~" in p.table()
    best = p.best
    assert best is not None
    env = tuple((launch_env.KNOBS[k][0], str(v)) for k, v in best.candidate.knobs().items())
    ref = run_job(Job(SCRIPT, tuple(DEEP), 8, 1, mesh=best.candidate.mesh_spec, env=env, gpu="h100-sxm"))
    assert best.peak == ref["report"]["per_rank"]["peak"]
    assert best.step_time_s == ref["report"]["predicted"]["step_time_s"]


# ---- the knobs added to the search ---------------------------------------------------------------------------


def test_compile_is_searched_where_the_script_leaves_it_auto(tmp_path: Path) -> None:
    """plan_worker.py leaves `compile` to the launch config: the plan dry-runs eager and per-block compiled
    (af.compile(regions="blocks")), chooses the compiled one (the time model counts fewer kernels: faster), and
    writes it to the config's plan section, which the launched script reads."""
    fixed = ["--strategy", "ddp", "--accumulate", "1", "--remat", "none", "--offload", "none"]
    p = af.plan(SCRIPT, fixed, nproc_per_node=2, global_batch_size=8, axes=("dp",), workers=1)
    assert "compile" in p.open_knobs
    by = {r.candidate.compile: r for r in p.rows}
    assert set(by) == {"none", "blocks"}
    assert by["blocks"].step_time_s < by["none"].step_time_s and p.rows[0] is by["blocks"]
    assert p.rows[0].candidate.label == "dp=2 compile=blocks"
    config = load(p.write_config(tmp_path / "plan.yaml"))
    assert config.plan.compile == "blocks"
    assert config.plan.env()[launch_env.ACCELFN_COMPILE] == "blocks"
    assert launch_env.knob("compile", "auto", "none", environ=config.plan.env()) == "blocks"


# ---- memory dominance and the most frugal candidate first ------------------------------------------------------

MEMORY_ARGS = ["--strategy", "ddp", "--offload", "none", "--compile", "none"]  # the grid: mesh x remat x acc
MEMORY_BINDS_GIB = 1.8 / 1024  # dp=4 ddp holds 2.04 MiB at its most frugal; dp=2,tp=2 fits at every remat


def test_a_candidate_needs_more_memory_only_by_its_memory_knobs_in_one_group() -> None:
    from accelfn.planner.memory import needs_more_memory

    unfit = Candidate({"pp": 2, "dp": 2}, "fsdp", "selective", 2, 16, "1f1b", 4, "optimizer", "none")
    more = [
        attrs.evolve(unfit, accumulate=1),  # a larger micro-batch
        attrs.evolve(unfit, remat="none"),
        attrs.evolve(unfit, offload="none"),
        attrs.evolve(unfit, pipeline_schedule="gpipe"),  # every micro-batch in flight
        attrs.evolve(unfit, accumulate=1, remat="none", offload="none"),
        unfit,
    ]
    less = [
        attrs.evolve(unfit, accumulate=4),
        attrs.evolve(unfit, remat="full"),
        attrs.evolve(unfit, accumulate=1, remat="full"),  # one knob each way: unknown
    ]
    other_group = [
        attrs.evolve(unfit, mesh={"pp": 2, "dp": 1, "tp": 2}),
        attrs.evolve(unfit, strategy="ddp"),
        attrs.evolve(unfit, compile="blocks"),
        attrs.evolve(unfit, pipeline_microbatches=8),
        attrs.evolve(unfit, remat=None),  # the script's choice: not comparable
    ]
    assert all(needs_more_memory(c, unfit) for c in more)
    assert not any(needs_more_memory(c, unfit) for c in less + other_group)


def test_the_first_dry_runs_at_405b_on_512_are_the_least_estimated_frugal_ones() -> None:
    """The 405B row's space (benchmarks/plan.py: 512 ranks, 8 a node, one sequence a rank): with the probe's
    states and activations of that model (16 bytes a parameter; activations far above the states), the first
    dry runs are each memory group's most frugal candidate, the least estimated memory first, the model split
    over 64 ranks (pp x tp x cp) among them. A pipeline's stage holds its fp32 gradients unsharded (torch's
    schedules sync them in the last backward only): `pp=8,dp=64` (no tp) holds 1/8 of the model's, 189 GiB,
    which no micro-batch count reduces, and is not among them."""
    from accelfn.planner.memory import activation_share, frugal_first, group

    open_ = {"mesh", "strategy", "accumulate", "global_batch_size", "pipeline_schedule"}
    open_ |= {"pipeline_microbatches"}
    space = Space(world=512, nproc_per_node=8, open=frozenset(open_), global_batch_size=512)
    totals = States(params=4 * 405 * 10**9, grads=4 * 405 * 10**9, optimizer=8 * 405 * 10**9)
    capacity, activations = 75 * 2**30, 400 * 2**40

    def estimate(c: Candidate) -> float:
        return states_bound(c, totals, script_strategy=None) + activations * activation_share(c)

    order = frugal_first(enumerate_candidates(space), estimate, capacity)
    first = order[:20]
    assert all(c.accumulate == max(d.accumulate for d in order if group(d) == group(c)) for c in first)
    least = [round(estimate(c) / 2**30, 1) for c in first]
    assert least == sorted(least) and least[0] == min(round(estimate(c) / 2**30, 1) for c in order)
    assert any(c.mesh.get("pp", 1) > 1 for c in first) and any(c.mesh.get("pp", 1) == 1 for c in first)
    pp8 = Candidate({"pp": 8, "dp": 64}, "fsdp", accumulate=1, pipeline_microbatches=8)
    assert states_bound(pp8, totals, script_strategy=None) >= 4 * 405 * 10**9 // 8
    assert all(c.mesh_spec != "pp=8,dp=64" for c in first)


@pytest.fixture(scope="module")
def memory_plans() -> tuple[af.planner.Plan, af.planner.Plan]:
    kw = dict(nproc_per_node=2, nnodes=2, global_batch_size=8, axes=("dp", "tp"), memory_gib=MEMORY_BINDS_GIB)
    with shared_dry_runs():
        return af.plan(SCRIPT, MEMORY_ARGS, **kw), af.plan(SCRIPT, MEMORY_ARGS, prune=False, **kw)  # type: ignore[arg-type]


def test_where_memory_binds_the_choice_is_the_exhaustive_best(memory_plans) -> None:
    pruned, exhaustive = memory_plans
    assert pruned.best is not None and exhaustive.dry_runs == exhaustive.candidates
    assert {r.candidate.mesh_spec for r in exhaustive.rows} == {"dp=2,tp=2"}  # dp=4 fits at no remat
    best = max(exhaustive.rows, key=lambda r: r.tokens_per_s_per_gpu or 0.0)
    assert pruned.best.candidate.key == best.candidate.key


def test_a_mesh_whose_most_frugal_candidate_does_not_fit_falls_by_one_dry_run(memory_plans) -> None:
    pruned, exhaustive = memory_plans
    measured = [r.candidate.label for r in pruned.unfit]  # dp=4's most frugal: full remat, most micro-batches
    assert measured == ["dp=4 remat=full acc=2"]
    dominated = [f for f in pruned.fallen if f.candidate.mesh_spec == "dp=4" and f.tier == "dominated"]
    assert len(dominated) == 2 * len(REMATS) - 1  # its group (each remat x acc 1, 2) but the frugal one
    for f in dominated:
        assert "needs at least the memory of dp=4 remat=full acc=2, measured not to fit" in f.reason
    truly_unfit = {r.candidate.key for r in exhaustive.unfit}
    assert all(f.candidate.key in truly_unfit for f in dominated)  # the exhaustive search agrees
    smaller_fits = [
        f for f in pruned.fallen if f.tier == "dominated" and f.candidate.mesh_spec == "dp=2,tp=2"
    ]
    smaller = [re.search(r"acc=(\d+) fits", f.reason) for f in smaller_fits]  # a smaller accumulation fits
    assert smaller_fits and all(
        m and int(m[1]) < (f.candidate.accumulate or 1) for m, f in zip(smaller, smaller_fits)
    )
    unrun = sum(pruned.counts()[t] for t in ("states bound", "dominated", "time bound"))
    assert pruned.dry_runs == exhaustive.dry_runs - unrun  # the dominated ones were never dry-run


# ---- the layer-extrapolated tier for pipelines ------------------------------------------------------------------

PIPELINE = str(Path(__file__).parent.parent / "examples" / "train_llama.py")
PIPELINE_ARGS = ("--model", "tiny", "--seq-len", "32", "--remat", "none", "--compile", "none")


@pytest.mark.parametrize(
    "layers, mesh, schedule, stages, ends, each",
    [
        (18, "pp=4,dp=2", "1f1b", 4, [4, 4], False),  # 18 blocks over 4 stages: 4, 5, 5, 4 (uneven)
        (14, "pp=2,dp=4", "interleaved_1f1b", 4, [7, 7], False),  # 3, 4, 4, 3: rank 0 holds stages 0 and 2
        (18, "pp=4,dp=2", "1f1b", 4, [4, 4], True),  # gradients reduce-scattered each micro-batch, not held
    ],
)
def test_a_pipeline_cut_to_2_and_3_blocks_per_stage_extrapolates_to_its_full_dry_run(
    layers: int, mesh: str, schedule: str, stages: int, ends: list[int], each: bool
) -> None:
    """A pipeline candidate dry-run with its model cut to 2 and to 3 blocks per stage (the same stage count and
    shapes): each end rank's blocks are read from the balanced split of the cut and of the whole model, and the
    line through the two runs gives the full dry run's states exactly, its peak to 1.5%, its step time, compute
    and bubble to 1% and its exposed communication to 1% of the step. Measured: 1F1B equal to fp64 round-off
    (1e-13) but its exposed communication (2.2%); interleaved, whose rank 0 holds stages of 3 and 4 blocks (equal in the cut runs, and each stage holds its
    own number of micro-batches in flight), peak +0.79%, step time +0.04%."""
    from accelfn.planner.search import Job, run_job
    from accelfn.planner.tiers import _extrapolated

    env = {"strategy": "fsdp", "global_batch_size": 16, "pipeline_schedule": schedule,
           "pipeline_sync_each_microbatch": each}  # fmt: skip
    knobs = tuple((launch_env.KNOBS[k][0], str(v)) for k, v in env.items())
    args = (*PIPELINE_ARGS, "--layers", str(layers))
    job = Job(PIPELINE, args, 8, 1, mesh=mesh, env=knobs, gpu="h100-sxm", rank="ends")
    full = run_job(job)
    cut = run_job(attrs.evolve(job, blocks=(2, 3), stages=stages))
    assert "error" not in full and "reports" in cut, (full.get("error"), cut.get("error"))
    assert [r["full"] for r in cut["reports"][2]] == ends
    v = stages // int(mesh.split(",")[0].removeprefix("pp="))  # stages per rank
    for k in (2, 3):  # k blocks per stage in the cut model, each end rank running v stages
        assert [r["at"] for r in cut["reports"][k]] == [k * v, k * v]
    ex, ref = _extrapolated(cut), full["report"]
    assert ("sync_each_microbatch=True" in ref["strategy"]) is each
    for k in ("params", "grads", "optimizer"):
        assert ex["per_rank"][k] == ref["per_rank"][k], k
    assert math.isclose(ex["per_rank"]["peak"], ref["per_rank"]["peak"], rel_tol=1.5e-2)
    for k in ("step_time_s", "compute_s", "bubble_s", "tokens_per_s"):
        assert math.isclose(ex["predicted"][k], ref["predicted"][k], rel_tol=1e-2), k
    # what of the communication shows is a max() per overlap window, not linear in the blocks once small
    # collectives take NCCL's LL protocol (rank 0 at 2, 3, 4 blocks: 125.7, 127.0, 131.2 us): to 1% of the step
    step = ref["predicted"]["step_time_s"]
    assert math.isclose(
        ex["predicted"]["exposed_comm_s"], ref["predicted"]["exposed_comm_s"], abs_tol=1e-2 * step
    )
    assert ref["predicted"]["bubble_s"] > 0 and ex["extrapolated"]["from"][0] < ex["extrapolated"]["from"][1]
