"""The engine's written contracts: the phases call exactly the `GradSync` hooks its docstring lists, in that
order (fp16's `max_over_ranks` and `any_rank` too, and they decide); a frozen `Plan`; the one lowering order; the strategy table; `print(step)` after lowering."""

import contextlib

import pytest
import torch

import accelfn as af
from accelfn import lowering
from accelfn.engine import GradSync, Plan, run_train
from accelfn.module import partition
from accelfn.transforms.shard import TABLE, strategy_for


class RecordingSync(GradSync):
    """A world of one that records which hooks the engine calls, in order (the defaults compute)."""

    def __init__(self):
        self.calls = []

    def __getattribute__(self, name):
        attr = super().__getattribute__(name)
        hooks = ("prepare", "microbatch", "max_over_ranks", "record_unused", "reduce", "any_rank", "norm",
                 "reduce_metrics", "init_opt_state")  # fmt: skip
        if name in hooks:
            calls = super().__getattribute__("calls")

            def recorded(*args, **kwargs):
                calls.append(name if name != "microbatch" else f"microbatch({args[0]})")
                return attr(*args, **kwargs)

            return recorded
        return attr


def loss_fn(model, batch):
    return af.losses.mse(model(batch["x"]), batch["y"])


def lowered(sync, microbatches=2, **fields):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    plan = Plan(
        module=model, kind="train", fn=loss_fn, optimizer=af.optim.adamw(1e-2), clip_grad_norm=0.5,
        microbatches=microbatches, grad_sync=sync, **fields,
    )  # fmt: skip
    plan.finalize()
    params, buffers = partition(model)
    state = af.TrainState(
        step=torch.zeros((), dtype=torch.int64), params=params, buffers=buffers,
        opt_state=plan.optimizer.init(params), rng=af.random.key(0),
    )  # fmt: skip
    return plan, state


BATCH = {"x": torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), "y": torch.zeros(8, 2)}


def test_the_phases_call_the_strategy_hooks_the_contract_lists_in_its_order():
    sync = RecordingSync()
    plan, state = lowered(sync)
    run_train(plan, state, BATCH)
    assert sync.calls == [
        "prepare", "microbatch(False)", "microbatch(True)", "record_unused", "reduce", "norm", "reduce_metrics",
    ]  # fmt: skip
    documented = GradSync.__doc__
    for hook in ("prepare", "microbatch", "max_over_ranks", "record_unused", "reduce", "any_rank", "norm",
                 "reduce_metrics", "init_opt_state", "phases"):  # fmt: skip
        assert f"`{hook}" in documented, hook


class InfElsewhere(RecordingSync):
    """Another rank found an inf in its gradients' shard: `any_rank` says so."""

    def any_rank(self, flag):
        return torch.ones_like(flag)


def test_fp16_calls_max_over_ranks_and_any_rank_and_skips_on_another_ranks_inf():
    """fp16's loss scaling: the normaliser from `max_over_ranks` before the backward, `any_rank` on the found-inf
    flag after it; an inf found on another rank skips the step here too (params unchanged, the scale halved),
    with no inf in this rank's own gradients (and no clipping norm)."""
    from accelfn.engine.plan import LossScaleConfig, init_loss_scale

    want = ["prepare", "max_over_ranks", "microbatch(False)", "microbatch(True)", "record_unused", "reduce",
            "any_rank", "norm", "reduce_metrics"]  # fmt: skip
    for sync, skipped in ((RecordingSync(), 0), (InfElsewhere(), 1)):
        plan, state = lowered(sync, autocast_dtype=torch.float16, loss_scale=LossScaleConfig())
        state = state.replace(extra={"loss_scale": init_loss_scale(LossScaleConfig())})
        before = {n: p.clone() for n, p in state.params.items()}
        scale = float(state.extra["loss_scale"]["scale"])
        new, metrics = run_train(plan, state, BATCH)
        assert sync.calls == [c for c in want if not (skipped and c == "norm")], type(sync).__name__
        assert int(metrics["skipped"]) == skipped
        moved = [n for n in before if not torch.equal(new.params[n], before[n])]
        assert moved == ([] if skipped else list(before)), moved
        assert float(new.extra["loss_scale"]["scale"]) == (scale / 2 if skipped else scale)


def test_the_default_hooks_are_a_world_of_one():
    """A step with the base GradSync gives the update of the unsharded step (no sync at all)."""
    ref_plan, ref_state = lowered(None)
    plan, state = lowered(GradSync())
    want, want_metrics = run_train(ref_plan, ref_state, BATCH)
    got, got_metrics = run_train(plan, state, BATCH)
    for name in want.params:
        torch.testing.assert_close(got.params[name], want.params[name], rtol=0, atol=0)
    assert sorted(got_metrics) == sorted([*want_metrics, "rank_loss"])  # a sharded step's: this rank's rows
    torch.testing.assert_close(got_metrics["loss"], want_metrics["loss"])
    torch.testing.assert_close(got_metrics["rank_loss"], want_metrics["loss"])


def test_a_lowered_plan_is_frozen():
    plan, _ = lowered(None)
    with pytest.raises(AttributeError, match=r"Plan\.microbatches: a lowered plan is frozen"):
        plan.microbatches = 4


def test_lowering_order_is_one_list_and_a_transform_outside_it_is_named():
    kinds = [k for k, _ in lowering.ORDER]
    assert kinds.index("tensor_parallel") < kinds.index("activation_checkpointing") < kinds.index("compile")
    assert kinds.index("compile") < kinds.index("shard") < kinds.index("offload")

    class Stray(af.transforms._base.TransformBase):
        kind = "stray"

    with pytest.raises(ValueError, match="kind 'stray', which has no place in lowering.ORDER"):
        lowering.canonical([Stray()])


def test_every_strategy_of_the_table_lowers_through_a_function_that_exists():
    for row in TABLE:
        if row.backend == "deepspeed":
            pytest.importorskip("deepspeed")
        assert callable(row.lower_fn()), row
    assert strategy_for("fsdp", "torch").lower == "fsdp:lower_fsdp"
    with pytest.raises(
        ValueError, match=r"supports strategy 'ddp' \(ZeRO-1\) or 'fsdp' \(ZeRO-3\), not 'hsdp'"
    ):
        strategy_for("hsdp", "deepspeed")


def test_print_step_after_init_shows_mesh_strategy_stages_in_order_and_phase_dtypes():
    with af.Mesh({"dp": -1}, device="cpu") as mesh:
        step = af.train_step(loss_fn, af.optim.sgd(0.1), clip_grad_norm=1.0)
        step = af.shard(af.autocast(af.accumulate(step, 2), "bf16"), mesh)
        assert str(step) == repr(step)  # before init: the one line
        step.init(torch.nn.Linear(4, 2))
        text = str(step)
    lines = text.splitlines()
    assert lines[0] == repr(step)
    assert "  mesh: {'dp': 1} (world 1)" in lines
    assert any(line.startswith("  strategy: ddp: 1 bucket(s)") for line in lines)
    stages = lines.index("  stages (in lowering order):")
    assert lines[stages + 1 : stages + 4] == [
        "    accumulate(2)", "    autocast(bfloat16)", "    shard(ddp, dp=1): ddp over 1 ranks, 1 bucket(s)",
    ]  # fmt: skip
    assert "  forward: autocast bfloat16 (cpu), params float32" in lines
    assert "  update: float32, in place" in lines


def test_remat_budget_and_block_compile_settings_are_contexts_of_their_step_not_process_settings():
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config

    before = (functorch_config.activation_memory_budget, dynamo_config.capture_scalar_outputs)
    base = af.train_step(loss_fn, af.optim.sgd(0.1))
    step = af.compile(af.remat(base, memory_budget=0.3), regions="blocks")
    step.init(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    assert (functorch_config.activation_memory_budget, dynamo_config.capture_scalar_outputs) == before
    with contextlib.ExitStack() as stack:
        for make in step.plan.forward_contexts:
            stack.enter_context(make())
        assert functorch_config.activation_memory_budget == 0.3 and dynamo_config.capture_scalar_outputs
    assert (functorch_config.activation_memory_budget, dynamo_config.capture_scalar_outputs) == before
