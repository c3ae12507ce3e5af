"""`af.autocast`: bf16/fp16 compute with fp32 master params and optimizer state.

The forward runs under `torch.autocast` on the params' device type; params, gradients and the optimizer
state stay float32. fp16 adds dynamic loss scaling: the scale lives in `state.extra["loss_scale"]` (so it
is checkpointed), a step whose gradients hold inf/nan is skipped (`metrics["skipped"] == 1`, params and
optimizer state unchanged) and halves the scale; `growth_interval` good steps double it.
`dtype="auto"` reads the launcher's `--mixed-precision` (env `ACCELFN_MIXED_PRECISION`).

Example:
    >>> import torch, accelfn as af
    >>> step = af.autocast(af.train_step(lambda m, b: m(b).float().pow(2).mean(), af.optim.sgd(0.1)), torch.bfloat16)
    >>> state = step.init(torch.nn.Linear(4, 4))
    >>> state, metrics = step(state, torch.randn(2, 4))
    >>> state.params["weight"].dtype
    torch.float32
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from .._typecheck import checked
from ..engine import LossScaleConfig, init_loss_scale
from ..launch_env import ACCELFN_MIXED_PRECISION
from ..step import Step
from ._base import TransformBase, conflict, find

if TYPE_CHECKING:
    from ..engine import Plan
    from ..lowering import Transform
    from ..state import TrainState

__all__ = ["autocast", "LossScaleConfig", "MIXED_PRECISION_ENV"]

MIXED_PRECISION_ENV = ACCELFN_MIXED_PRECISION
_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


@attrs.frozen
class Autocast(TransformBase):
    dtype: torch.dtype
    loss_scale: LossScaleConfig | None = None
    kind: str = "autocast"

    def describe(self) -> str:
        return f"autocast({str(self.dtype).removeprefix('torch.')})"

    def check(self, others: Sequence[Transform]) -> None:
        fp8 = find(others, "fp8")
        if fp8 is not None and self.dtype == torch.float16:
            raise conflict(self, fp8, "FP8 training needs bf16 (or fp32) for the rest of the model, not fp16")

    def lower(self, plan: Plan) -> None:
        # the device type is read in `Plan.finalize`, after `shard` has moved the model to its device
        plan.autocast_dtype = self.dtype
        if self.dtype == torch.float16 and plan.kind == "train":
            plan.loss_scale = self.loss_scale or LossScaleConfig()

    def init_state(self, plan: Plan, state: TrainState) -> TrainState:
        if plan.loss_scale is None:
            return state
        return state.replace(extra={**state.extra, "loss_scale": init_loss_scale(plan.loss_scale)})


def _resolve(dtype: Any) -> torch.dtype | None:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"autocast: dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        return dtype
    name = os.environ.get(MIXED_PRECISION_ENV, "no") if dtype == "auto" else str(dtype)
    if name in ("no", "fp32", "float32", ""):
        return None
    if name == "fp8":  # fp8 Linear layers + bf16 for the rest
        return torch.bfloat16
    if name not in _NAMES:
        raise ValueError(f"autocast: unknown precision {name!r}; expected one of bf16, fp16, fp8, no")
    return _NAMES[name]


@checked
def autocast(
    step: Step, dtype: torch.dtype | str = "auto", *, loss_scale: LossScaleConfig | None = None
) -> Step:
    """Run the forward in `dtype` (torch.bfloat16 / torch.float16, or "bf16"/"fp16"/"no"/"auto").

    `"auto"` follows `accelfn launch --mixed-precision` (`fp8` there also adds `af.autocast_fp8`).

    Example:
        >>> import accelfn as af
        >>> af.autocast(af.train_step(lambda m, b: m(b).float().pow(2).mean(), af.optim.adamw(1e-3)), "bf16")
        Step(train_step(<lambda>) -> autocast(bfloat16))
    """
    resolved = _resolve(dtype)
    if dtype == "auto" and os.environ.get(MIXED_PRECISION_ENV) == "fp8":
        from ..launch_env import ACCELFN_FP8_BACKEND, ACCELFN_FP8_RECIPE
        from .fp8 import autocast_fp8

        step = autocast_fp8(
            step,
            backend=os.environ.get(ACCELFN_FP8_BACKEND) or "auto",
            recipe=os.environ.get(ACCELFN_FP8_RECIPE) or None,
        )
    if resolved is None:
        return step
    return step.with_transform(Autocast(resolved, loss_scale))
