"""Lowering a step onto a DeepSpeed engine: `deepspeed.initialize` with the generated config, and the
strategy's `GradSync`, whose phases (`DeepSpeedPhases`) hand backward, clipping and the update to the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .... import dry_mode, platforms
from ....engine.contract import GradSync
from ....module import move
from .config import _get, _lambda_lr, build_config, load_user_config, make_optimizer
from .phases import DeepSpeedPhases, current_lr, divides_at_update
from .types import DeepSpeedRun, DeepSpeedState, Settings

if TYPE_CHECKING:
    from ....engine import Plan
    from ....step import Step
    from .. import Shard

__all__ = ["DeepSpeedSync", "engine_of", "lower_deepspeed"]


class DeepSpeedSync(GradSync):
    """A DeepSpeed step's strategy: its engine owns the backward, the gradient reduction, clipping and the update
    (`DeepSpeedPhases`), and keeps the optimizer's moments (`state.opt_state` is a `DeepSpeedState`)."""

    def __init__(self, run: DeepSpeedRun) -> None:
        self.run = run
        self.phases = DeepSpeedPhases(run)

    def init_opt_state(self, trainable: dict[str, torch.Tensor]) -> Any:
        return DeepSpeedState(
            torch.zeros((), dtype=torch.int64), torch.tensor(current_lr(self.run.engine), dtype=torch.float32)
        )

    def abandon(self) -> None:
        """The step raised before its update: drop what it left in the engine (`DeepSpeedPhases.abandon`)."""
        assert isinstance(self.phases, DeepSpeedPhases)
        self.phases.abandon()

    def describe(self) -> str:
        zero = self.run.config["zero_optimization"]
        return f"DeepSpeed ZeRO-{zero['stage']} over {self.run.world} ranks"


def engine_of(step: Step) -> Any:
    """The `deepspeed.DeepSpeedEngine` of an initialised DeepSpeed step (for `save_checkpoint` & co.)."""
    sync = step.plan.grad_sync
    if not isinstance(sync, DeepSpeedSync):
        raise ValueError("engine_of(step): the step was not lowered with af.shard(..., backend='deepspeed')")
    return sync.run.engine


def lower_deepspeed(shard: Shard, plan: Plan) -> DeepSpeedSync:
    try:
        import deepspeed
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"af.shard(backend='deepspeed') needs DeepSpeed: pip install 'accelfn[deepspeed]' ({e})"
        ) from None
    if plan.kind != "train":
        raise ValueError(
            "af.shard(backend='deepspeed') applies to training steps; shard eval steps with backend='torch'"
        )
    if not plan.donate:
        raise ValueError(
            "af.shard(backend='deepspeed') updates the engine's parameters in place: use donate=True"
        )
    mesh = shard.mesh
    if mesh.data_size != mesh.world_size:
        raise ValueError(
            f"af.shard(backend='deepspeed') runs data-parallel over all {mesh.world_size} processes, but the mesh's "
            f"data axes {mesh.data_axes} cover {mesh.data_size}: use a mesh like af.Mesh({{'dp': -1}})"
        )
    assert plan.optimizer is not None
    settings = Settings(
        zero_stage=shard.zero_stage, strategy=shard.strategy, offload_optimizer=shard.offload_optimizer,
        microbatches=plan.microbatches, autocast_dtype=plan.autocast_dtype, loss_scale=plan.loss_scale,
        clip_grad_norm=plan.clip_grad_norm, optimizer=plan.optimizer, user_config=load_user_config(shard.ds_config),
        pin_memory=platforms.pins_host_copies(mesh.device),
    )  # fmt: skip
    config = build_config(settings)
    offload = _get(config, "zero_optimization.offload_optimizer.device") in ("cpu", "nvme")
    if (
        dry_mode.active() is not None
    ):  # DeepSpeed's engine does not run on fake tensors: its ZeRO stage, modelled
        from .dry import lower_modelled

        return lower_modelled(shard, plan, config)  # type: ignore[return-value]

    module = move(plan.module, mesh.device)
    with torch.no_grad():  # every rank starts from rank 0's weights, as with backend="torch"
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)
    named = {n: p for n, p in module.named_parameters() if p.requires_grad}
    if not named:
        raise ValueError("Step.init(): the model has no trainable parameters (all requires_grad=False)")
    optimizer, schedule = make_optimizer(plan.optimizer, named, offload=offload)
    engine, *_ = deepspeed.initialize(
        model=module, optimizer=optimizer, config=config, dist_init_required=False,
        lr_scheduler=_lambda_lr(schedule) if schedule is not None else None,
    )  # fmt: skip

    run = DeepSpeedRun(engine, None, dist.get_world_size(), config, bool(config["fp16"].get("enabled")))
    run.divides = divides_at_update(engine)
    plan.module = engine.module
    plan.autocast_device_type = mesh.device_type
    plan.loss_scale = None  # DeepSpeed keeps the fp16 loss scale itself
    zero = config["zero_optimization"]
    plan.notes.append(
        f"deepspeed ZeRO-{zero['stage']}{' + optimizer offload' if offload else ''} over {mesh.world_size} ranks"
    )
    return DeepSpeedSync(run)
