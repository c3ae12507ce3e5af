"""af.shard(backend="deepspeed"): ZeRO 1-3 on 2 real processes equal af.shard(strategy="ddp"); config generation.

The multi-process tests need `deepspeed` (the `[test]` extra installs it) and are skipped without it. Set
TORCH_EXTENSIONS_DIR to a cached folder: DeepSpeed compiles native ops on first use (its shm comm op,
~60 s, and for the offload test DeepSpeedCPUAdam, ~150 s on 2 shared cores; seconds once cached).
"""

import importlib.util
import json

import pytest
import torch

import accelfn as af
from accelfn.lowering import CompositionError
from accelfn.transforms.shard.deepspeed import config_for, make_optimizer
from tests._launch import output_of, run_workers

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (pip install 'accelfn[deepspeed]')",
)


def _ok(proc, configs):
    out = output_of(proc)
    assert proc.returncode == 0, out
    for c in configs:
        stage, kind, *extra = c.split(":")
        for rank in (0, 1):
            assert f"rank {rank}: OK {stage} {kind} {sorted(extra)}" in proc.stdout, out


@pytest.mark.slow
@needs_deepspeed
def test_zero_1_2_3_on_two_ranks_equal_ddp_and_a_frozen_teacher_needs_nothing_special():
    # `abort`: a step raising in its second micro-batch (in the loss, the model's forward, the middle of the
    # backward), caught: the engine's micro-step counter and the ZeRO optimizer's partial gradients are dropped,
    # so the next steps equal a run without that step (ZeRO-0 to 3); one raising in its update (the optimizer's
    # step, caught or a KeyboardInterrupt) refuses the next steps; ZeRO-3: a second engine in the process trains
    # on undisturbed
    configs = [
        "zero1:mlp", "zero2:mlp", "zero3:mlp",                      # fp32, Loss(total, count), uneven counts
        "zero3:gpt2:compile", "zero1:gpt2:accumulate",              # a tiny GPT-2, compiled per block (and
                                                                    # vs plain PyTorch); accumulate with Loss
        "zero3:mlp:accumulate", "zero2:mlp:accumulate:schedule",    # warmup-cosine -> LambdaLR
        "zero2:distill", "zero3:distill:accumulate",                # student + frozen teacher in the loss
        "zero2:mlp:bf16",                                           # bf16 trains (looser tolerance)
        "zero0:mlp:accumulate", "zero0:mlp:accumulate:bf16",        # ZeRO-0: fp32 optimizer, bf16's
        "zero2:mlp:accumulate:bf16",                                # an af.Loss over 2 micro-batches, clipped,
                                                                    # in as many forwards as ddp (each config)
        "zero3:mlp:accumulate:countfwd",                            # fp16's lowering: counted by forwards first
        "zero0:abort", "zero1:abort", "zero2:abort", "zero3:abort", # a step raising in micro-batch 2 of 2
    ]  # fmt: skip
    _ok(run_workers("deepspeed_worker.py", 2, *configs, timeout=400), configs)


@pytest.mark.slow
@needs_deepspeed
def test_zero_offload_with_deepspeed_cpu_adam_equals_ddp():
    # Separate because DeepSpeedCPUAdam is compiled on first use (~150 s here; cached afterwards). `abort`: a
    # step that raised leaves nothing in ZeRO-Offload's host gradient copies either; `accumulate`: an af.Loss over
    # 2 micro-batches, the update dividing the host gradient partitions by the count
    configs = ["zero2:mlp:offload", "zero2:abort:offload", "zero3:abort:offload", "zero2:mlp:accumulate:offload",
               "zero3:mlp:accumulate:offload"]  # fmt: skip
    _ok(run_workers("deepspeed_worker.py", 2, *configs, timeout=500), configs)


@pytest.mark.slow
@needs_deepspeed
def test_zero_offload_checkpoints_resume_exactly_and_load_into_ddp(tmp_path):
    proc = run_workers("deepspeed_ckpt_worker.py", 2, str(tmp_path), "zero2:adamw:offload", timeout=500)
    assert proc.returncode == 0, output_of(proc)
    assert all(f"rank {r}: OK zero2:adamw:offload" in proc.stdout for r in (0, 1)), output_of(proc)


@pytest.fixture
def mesh():
    m = af.Mesh({"dp": -1}, device="cpu")
    yield m
    m.close()


def _loss(m, b):
    return af.losses.mse(m(b), b)


def test_config_for_bf16_accumulate_clip_adamw(mesh):
    step = af.train_step(_loss, af.optim.adamw(1e-3, weight_decay=0.1), clip_grad_norm=1.0)
    step = af.shard(
        af.autocast(af.accumulate(step, 4), torch.bfloat16), mesh, backend="deepspeed", zero_stage=2
    )
    cfg = config_for(step)
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"]["enabled"] is False
    assert cfg["gradient_accumulation_steps"] == 4 and cfg["train_micro_batch_size_per_gpu"] == 1
    assert cfg["gradient_clipping"] == 1.0
    assert cfg["zero_optimization"] == {"stage": 2}
    assert "optimizer" not in cfg and cfg["zero_allow_untested_optimizer"] is True  # a client torch optimizer
    json.dumps(cfg)  # what deepspeed.initialize receives is plain JSON


def test_strategy_picks_the_stage_and_offload_and_fp16_map_to_deepspeed_keys(mesh):
    step = af.train_step(_loss, af.optim.adamw(1e-3))
    assert config_for(af.shard(step, mesh, backend="deepspeed"))["zero_optimization"]["stage"] == 1
    cfg = config_for(af.shard(af.autocast(step, torch.float16), mesh, strategy="fsdp", backend="deepspeed",
                              offload_optimizer=True))  # fmt: skip
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert cfg["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 2000,
                           "hysteresis": 1, "min_loss_scale": 1}  # fmt: skip
    assert config_for(af.shard(step, mesh, backend="deepspeed", ds_config={"zero_optimization": {"stage": 2}}))[
        "zero_optimization"]["stage"] == 2  # fmt: skip


def test_chain_clip_becomes_gradient_clipping(mesh):
    tx = af.optim.chain(af.optim.clip_by_global_norm(0.5), af.optim.sgd(0.1, momentum=0.9))
    assert (
        config_for(af.shard(af.train_step(_loss, tx), mesh, backend="deepspeed"))["gradient_clipping"] == 0.5
    )


def test_user_json_is_merged_and_a_conflicting_key_is_named(mesh, tmp_path):
    step = af.accumulate(af.train_step(_loss, af.optim.adamw(1e-3), clip_grad_norm=1.0), 4)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_accumulation_steps": "auto", "wall_clock_breakdown": True,
                                "bf16": {"enabled": False}}))  # fmt: skip
    cfg = config_for(af.shard(step, mesh, backend="deepspeed", ds_config=str(path)))
    assert cfg["gradient_accumulation_steps"] == 4 and cfg["wall_clock_breakdown"] is True
    with pytest.raises(
        CompositionError,
        match=r"ds_config\['gradient_accumulation_steps'\] = 8 conflicts with accumulate\(4\)",
    ):
        config_for(af.shard(step, mesh, backend="deepspeed", ds_config={"gradient_accumulation_steps": 8}))
    with pytest.raises(
        CompositionError, match=r"ds_config\['bf16.enabled'\] = True conflicts with autocast\(off\)"
    ):
        config_for(af.shard(step, mesh, backend="deepspeed", ds_config={"bf16": {"enabled": True}}))
    with pytest.raises(CompositionError, match=r"ds_config\['gradient_clipping'\] = 2.0 conflicts"):
        config_for(af.shard(step, mesh, backend="deepspeed", ds_config={"gradient_clipping": 2.0}))
    with pytest.raises(
        CompositionError, match=r"ds_config\['optimizer'\] conflicts with the step's optimizer \(adamw\)"
    ):
        config_for(af.shard(step, mesh, backend="deepspeed", ds_config={"optimizer": {"type": "Adam"}}))
    with pytest.raises(
        CompositionError, match=r"ds_config\['zero_optimization.stage'\] = 3 conflicts with zero_stage=2"
    ):
        config_for(
            af.shard(
                step, mesh, backend="deepspeed", zero_stage=2, ds_config={"zero_optimization": {"stage": 3}}
            )
        )


def test_offload_combinator_and_unsupported_optimizers_are_composition_errors(mesh):
    step = af.train_step(_loss, af.optim.lion(1e-4))
    with pytest.raises(CompositionError, match="does not describe itself"):
        config_for(af.shard(step, mesh, backend="deepspeed"))
    with pytest.raises(CompositionError, match="DeepSpeed offloads through its own config"):
        af.offload(af.shard(af.train_step(_loss, af.optim.adamw(1e-3)), mesh, backend="deepspeed")).init(
            torch.nn.Linear(2, 2)
        )
    with pytest.raises(ValueError, match="apply to backend='deepspeed' only"):
        af.shard(af.train_step(_loss, af.optim.adamw(1e-3)), mesh, zero_stage=2)


def test_config_errors_name_the_conflict(mesh):
    step = af.train_step(_loss, af.optim.adamw(af.optim.warmup_cosine(1e-3, warmup=2, total=10)))
    with pytest.raises(
        CompositionError, match=r"ds_config\['scheduler'\] conflicts with the optimizer's learning-rate"
    ):
        config_for(af.shard(step, mesh, backend="deepspeed", ds_config={"scheduler": {"type": "WarmupLR"}}))
    chained = af.optim.chain(af.optim.clip_by_global_norm(0.5), af.optim.adamw(1e-3))
    with pytest.raises(
        CompositionError, match=r"clip_grad_norm=1.0\) and the optimizer's clip_by_global_norm\(0.5\)"
    ):
        config_for(af.shard(af.train_step(_loss, chained, clip_grad_norm=1.0), mesh, backend="deepspeed"))
    odd_scale = af.autocast(af.train_step(_loss, af.optim.adamw(1e-3)), torch.float16,
                            loss_scale=af.LossScaleConfig(growth_factor=4.0))  # fmt: skip
    with pytest.raises(CompositionError, match="cannot be expressed in DeepSpeed"):
        config_for(af.shard(odd_scale, mesh, backend="deepspeed"))
    with pytest.raises(CompositionError, match="optimizer offload needs adam or adamw"):
        make_optimizer(af.optim.sgd(0.1), dict(torch.nn.Linear(2, 2).named_parameters()), offload=True)


@needs_deepspeed
def test_lowering_refuses_donate_false_and_eval_steps(mesh):
    kept = af.shard(af.train_step(_loss, af.optim.adamw(1e-3), donate=False), mesh, backend="deepspeed")
    with pytest.raises(ValueError, match="updates the engine's parameters in place: use donate=True"):
        kept.init(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="applies to training steps"):
        af.shard(af.eval_step(lambda m, b: m(b)), mesh, backend="deepspeed").init(torch.nn.Linear(2, 2))


@needs_deepspeed
def test_a_failed_step_the_engine_cannot_drop_refuses_the_next_calls():
    # the reset itself failing (here: an optimizer accelfn does not know) is remembered: the next call raises
    # instead of updating with what the failed step left in the engine
    from types import SimpleNamespace

    from accelfn.engine.phases import StepRun
    from accelfn.transforms.shard.deepspeed import DeepSpeedRun
    from accelfn.transforms.shard.deepspeed.phases import DeepSpeedPhases

    ds = DeepSpeedRun(SimpleNamespace(optimizer=object(), micro_steps=3), None, 1, {}, False, started=2)
    phases = DeepSpeedPhases(ds)
    with pytest.raises(TypeError, match="optimizer is a object, whose held gradients accelfn cannot drop"):
        phases.abandon()
    run = StepRun(SimpleNamespace(loss_call=_loss, slots=object()), None, None, None)  # type: ignore[arg-type]
    with pytest.raises(
        RuntimeError, match=r"could not be dropped \(TypeError: the engine's optimizer is a obj"
    ):
        phases.check(run)
    phases.abandon()  # that call's own abandon: it raised before the engine ran anything


@needs_deepspeed
def test_a_step_interrupted_in_its_update_refuses_the_next_calls_without_resetting_the_engine():
    # the update (optimizer step, lr scheduler) may have changed params and moments: nothing is reset (the
    # optimizer here would make a reset raise), the next call refuses; also when the interrupt skipped abandon
    from types import SimpleNamespace

    from accelfn.engine.phases import StepRun
    from accelfn.transforms.shard.deepspeed import DeepSpeedRun
    from accelfn.transforms.shard.deepspeed.phases import DeepSpeedPhases

    run = StepRun(SimpleNamespace(loss_call=_loss, slots=object()), None, None, None)  # type: ignore[arg-type]
    for caught in (True, False):  # an Exception (the engine calls abandon), a KeyboardInterrupt (it does not)
        engine = SimpleNamespace(optimizer=object(), micro_steps=3)
        phases = DeepSpeedPhases(DeepSpeedRun(engine, None, 1, {}, False, started=2, updating=True))
        if caught:
            phases.abandon()
        with pytest.raises(
            RuntimeError, match=r"interrupted in its update.*Reload the state from a checkpoint"
        ):
            phases.check(run)
        assert engine.micro_steps == 3 and phases.ds.started is None and not phases.ds.updating


def test_a_deepspeed_state_without_its_engine_is_refused_not_saved_without_moments(tmp_path):
    from accelfn.checkpoint import CheckpointError
    from accelfn.transforms.shard.deepspeed import DeepSpeedState

    state = af.train_step(_loss, af.optim.adamw(1e-3)).init(torch.nn.Linear(2, 2))
    ds_state = state.replace(opt_state=DeepSpeedState(torch.tensor(3), torch.tensor(1e-3)))
    with pytest.raises(
        CheckpointError, match=r"opt_state is a DeepSpeedState, but its params belong to no live"
    ):
        af.checkpoint.save(tmp_path / "c", ds_state)
    assert not (tmp_path / "c").exists()
    af.checkpoint.save(tmp_path / "c", state)
    with pytest.raises(CheckpointError, match="belong to no live DeepSpeed step"):
        af.checkpoint.load(tmp_path / "c", like=ds_state)


@pytest.mark.slow
@needs_deepspeed
def test_deepspeed_checkpoints_resume_exactly_and_load_into_ddp(tmp_path):
    # ZeRO 0-3 (fp32 and bf16, a schedule, SGD momentum; offload in the test below): af.checkpoint saves full params and moments in
    # accelfn's layout; resuming equals the uninterrupted run, and the same files resume a backend="torch"
    # ddp step (and a ddp checkpoint resumes DeepSpeed), against the uninterrupted ddp run.
    configs = ["zero0:adamw", "zero1:adamw:schedule", "zero2:sgd", "zero3:adamw", "zero2:adamw:bf16"]
    proc = run_workers("deepspeed_ckpt_worker.py", 2, str(tmp_path), *configs, timeout=500)
    out = output_of(proc)
    assert proc.returncode == 0, out
    for c in configs:
        for rank in (0, 1):
            assert f"rank {rank}: OK {c}" in proc.stdout, out

    # another world size: the 2-rank ZeRO-3 and scheduled ZeRO-1 checkpoints resume in this one process
    from tests.workers import deepspeed_ckpt_worker as w

    for name in ("zero3-adamw", "zero1-adamw-schedule"):
        extra = name.split("-")[1:]
        whole_step = w.make(extra)
        whole = w.run(whole_step, whole_step.init(w.model()), w.batches())
        step = w.make(extra)
        state = af.checkpoint.load(tmp_path / name, like=step.init(w.model()))
        assert int(state.step) == w.SPLIT
        state = w.run(step, state, w.batches()[w.SPLIT :])
        assert w.max_diff(state.params, whole.params) <= 1e-4, name


def test_make_optimizer_matches_the_accelfn_hyperparameters():
    net = torch.nn.Linear(3, 2)
    named = dict(net.named_parameters())
    tx = af.optim.adamw(
        2e-3, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1, mask=lambda p: {k: k != "bias" for k in p}
    )
    opt, schedule = make_optimizer(tx, named, offload=False)
    assert isinstance(opt, torch.optim.AdamW) and schedule is None
    g = opt.param_groups
    assert [len(x["params"]) for x in g] == [1, 1] and [x["weight_decay"] for x in g] == [0.1, 0.0]
    assert g[0]["lr"] == 2e-3 and g[0]["betas"] == (0.8, 0.99) and g[0]["eps"] == 1e-6
    opt, schedule = make_optimizer(af.optim.sgd(af.optim.linear(1.0, 0.0, 10), momentum=0.9, nesterov=True), named,
                                   offload=False)  # fmt: skip
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["nesterov"] is True
    assert float(schedule(torch.tensor(5))) == pytest.approx(0.5)
