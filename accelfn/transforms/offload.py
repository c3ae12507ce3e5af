"""`af.offload`: keep the optimizer state (and optionally fp32 master params) in host memory.

The update runs on the host with torch's fused CPU kernel (ZeRO-Offload style): gradients stream to
pinned host buffers, the host state and master params are updated, and the new params stream back. On a
CPU-only machine the state is already in host memory and the step is unchanged. Results equal the
non-offloaded step (up to the rounding differences between the CPU and device kernels). With
`delayed_update_from=N` the update of each step from N on runs one step late, overlapped with the next step's
forward and backward (the data path is in `host_update`).

Example:
    >>> import torch, accelfn as af
    >>> step = af.offload(af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.adamw(1e-3)))
    >>> state = step.init(torch.nn.Linear(4, 4))
    >>> state.opt_state.mu["weight"].device.type
    'cpu'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from .. import dry_mode
from .. import tree as _tree
from .._typecheck import checked
from ..state import TrainState
from ..step import Step
from ._base import TransformBase, conflict, find
from .host_update import (
    MASTER_KEY,
    PENDING_KEY,
    DelayedHostUpdater,
    HostUpdater,
    host_threads,
    share_of_cores,
    to_host,
)

if TYPE_CHECKING:
    from ..engine import Plan
    from ..lowering import Transform

__all__ = ["offload", "apply_pending_update", "to_host", "share_of_cores", "host_threads"]


@attrs.frozen
class Offload(TransformBase):
    optimizer_state: bool = True
    params: bool = False
    delayed_update_from: int | None = None
    kind: str = "offload"

    def describe(self) -> str:
        delayed = (
            "" if self.delayed_update_from is None else f", delayed_update_from={self.delayed_update_from}"
        )
        return f"offload(optimizer_state={self.optimizer_state}, params={self.params}{delayed})"

    def check(self, others: Sequence[Transform]) -> None:
        shard = find(others, "shard")
        if shard is not None and getattr(shard, "backend", "torch") == "deepspeed":
            raise conflict(
                self, shard, "DeepSpeed offloads through its own config (zero_optimization.offload_*)"
            )
        if (
            shard is not None
            and getattr(shard, "strategy", "ddp") == "local_sgd"
            and (self.params or self.delayed_update_from is not None)
        ):
            raise conflict(
                self,
                shard,
                "local SGD averages the params on the device after an update, which a host master copy "
                "(params=True) or a delayed update would undo: offload only the optimizer state",
            )
        if shard is not None and getattr(shard, "strategy", "ddp") in ("fsdp", "hsdp"):
            raise conflict(
                self,
                shard,
                "offloading FSDP-sharded state is not supported yet (use strategy='ddp', or "
                "backend='deepspeed' with offload_optimizer=True)",
            )

    def lower(self, plan: Plan) -> None:
        if plan.kind != "train":
            raise ValueError("offload() applies to training steps only")
        # pinned host buffers when the model computes on a device that pins (decided for plan.device, the device
        # the model runs on, also when it was built on the host)
        if self.delayed_update_from is None:
            plan.updater = HostUpdater(keep_master=self.params, pin=_pins(plan))
        else:
            plan.updater = DelayedHostUpdater(
                keep_master=self.params, pin=_pins(plan), start=self.delayed_update_from
            )
            plan.notes.append(
                f"offload: from step {self.delayed_update_from} on, each update runs one step late, during the next "
                "step's forward and backward (gradients one step stale)"
            )

    def init_state(self, plan: Plan, state: TrainState) -> TrainState:
        # the host update runs in fp32 (like ZeRO-Offload), so the host state is fp32 whatever the params are
        pin = _pins(plan)

        def host(t: torch.Tensor) -> torch.Tensor:
            t = t.float() if t.is_floating_point() and t.dtype != torch.float32 else t
            return to_host(
                t, pin=pin and t.dim() > 0
            )  # 0-d leaves (count, lr) are read by the host, never copied

        with dry_mode.on_host():  # (host memory in a dry run's figures before the first step)
            state = state.replace(opt_state=_tree.map(host, state.opt_state))
            if self.params:
                assert plan.slots is not None
                master = {
                    n: to_host(state.params[n].float(), copy=True, pin=pin) for n in plan.slots.trainable
                }
                state = state.replace(extra={**state.extra, MASTER_KEY: master})
            if isinstance(plan.updater, DelayedHostUpdater):
                assert plan.slots is not None
                pending = plan.updater.init_pending({n: state.params[n] for n in plan.slots.trainable})
                state = state.replace(extra={**state.extra, PENDING_KEY: pending})
        return state


def _pins(plan: Plan) -> bool:
    try:
        return bool(plan.platform.supports_pinned_memory())
    except (RuntimeError, ValueError):
        return False


@checked
def offload(
    step: Step, *, optimizer_state: bool = True, params: bool = False, delayed_update_from: int | None = None
) -> Step:
    """Keep the optimizer state (and with `params=True` fp32 master params) in host memory between steps.

    With `delayed_update_from=N`, from step N on each step's host update runs one step late, on a host thread
    during the next step's forward and backward (ZeRO-Offload's delayed parameter update): the gradients applied
    are one step stale, and the host update no longer adds to the step time when it is shorter than the device's
    forward and backward. The pending gradients are part of the state (`state.extra["offload_pending"]`).

    Example:
        >>> import torch, accelfn as af
        >>> step = af.offload(af.train_step(lambda m, b: m(b).sum(), af.optim.adamw(1e-3)), params=True)
        >>> sorted(step.init(torch.nn.Linear(2, 2)).extra["offload_master"])
        ['bias', 'weight']
    """
    if not optimizer_state:
        raise ValueError(
            "offload: optimizer_state=False is not supported: the update runs in host memory, so the optimizer "
            "state lives there (params=True additionally keeps fp32 master params on the host)"
        )
    if delayed_update_from is not None and delayed_update_from < 0:
        raise ValueError(
            f"offload: delayed_update_from must be a step number >= 0, got {delayed_update_from}"
        )
    return step.with_transform(Offload(optimizer_state, params, delayed_update_from))


@checked
def apply_pending_update(step: Step, state: TrainState) -> TrainState:
    """Apply the gradients a delayed `af.offload(..., delayed_update_from=N)` step left pending in `state`.

    The last step of a run with a delayed update leaves its gradients pending (the next step would apply them):
    call this before evaluating, exporting or publishing the final weights. The state is updated in place and
    returned; a state with nothing pending, or a step without a delayed update, is returned unchanged. A
    checkpoint does not need it: the pending gradients are saved with the state and applied after resuming.

    Example:
        >>> import torch, accelfn as af
        >>> step = af.offload(af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1)), delayed_update_from=0)
        >>> state, _ = step(step.init(torch.nn.Linear(2, 1)), torch.ones(1, 2))
        >>> before = state.params["bias"].item()
        >>> state = af.apply_pending_update(step, state)
        >>> round(before - state.params["bias"].item(), 6), int(state.extra["offload_pending"]["full"])
        (0.1, 0)
    """
    updater = step.plan.updater
    if not isinstance(updater, DelayedHostUpdater):
        return state
    assert step.plan.optimizer is not None
    with torch.no_grad():
        updater.flush(step.plan.optimizer, state)
    return state
