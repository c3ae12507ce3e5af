"""The types shared by the DeepSpeed backend's modules (below all of them: the lowering, its phases and its
checkpoint adapter import these, never each other)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import attrs
import torch
import torch.distributed as dist

from ....engine.plan import LossScaleConfig
from ....optim import GradientTransformation

__all__ = ["DeepSpeedState", "DeepSpeedRun", "Settings"]


class DeepSpeedState(NamedTuple):
    """The optimizer state of a DeepSpeed step as seen from accelfn: `count` (updates applied) and `lr`
    (learning rate of the last update). The moments live in the engine (`engine_of(step)`)."""

    count: torch.Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    lr: torch.Tensor


@attrs.frozen
class Settings:
    """What the combinators ask of DeepSpeed (read from the lowered plan, or from a step's records)."""

    zero_stage: int | None
    strategy: str
    offload_optimizer: bool | None
    microbatches: int
    autocast_dtype: torch.dtype | None
    loss_scale: LossScaleConfig | None
    clip_grad_norm: float | None
    optimizer: GradientTransformation | None
    user_config: Mapping[str, Any] | None
    pin_memory: bool = (
        False  # ZeRO-Offload's host buffers pinned (where the mesh's platform pins host copies)
    )


@attrs.define
class DeepSpeedRun:
    """The lowered DeepSpeed step: the engine, its data-parallel group and the config it runs with."""

    engine: Any
    group: dist.ProcessGroup | None
    world: int
    config: dict[str, Any]
    fp16: bool
    loss_has_count: bool | None = None  # does loss_fn return an af.Loss? (learnt on the first call)
    # the update divides the gradients by the global count (`phases.divides_at_update`): no count forwards
    divides: bool = False
    started: int | None = None  # the engine's micro-step counter when the step in its backwards began
    # ZeRO-3's module stack (`FWD_MODULE_STACK`, one per process, every engine's) depth when that step began
    stack_depth: int = 0
    updating: bool = False  # the step is in its update (the boundary `engine.step()`): it cannot be dropped
    broken: str | None = None  # why later steps are refused (a step that raised could not be dropped)
