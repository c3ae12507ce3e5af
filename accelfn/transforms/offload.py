"""`af.offload`: keep the optimizer state (and optionally fp32 master params) in host memory.

The update runs on the host with torch's fused CPU kernel (ZeRO-Offload style): gradients stream to
pinned host buffers, the host state and master params are updated, and the new params stream back. On a
CPU-only machine the state is already in host memory and the step is unchanged. Results equal the
non-offloaded step (up to the rounding differences between the CPU and device kernels).

Example:
    >>> import torch, accelfn as af
    >>> step = af.offload(af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.adamw(1e-3)))
    >>> state = step.init(torch.nn.Linear(4, 4))
    >>> state.opt_state.mu["weight"].device.type
    'cpu'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from .. import tree as _tree
from .._typecheck import checked
from ..optim import GradientTransformation, apply_gradients
from ..step import Step
from ._base import TransformBase, conflict, find

if TYPE_CHECKING:
    from ..engine import Plan
    from ..lowering import Transform
    from ..state import TrainState

__all__ = ["offload", "to_host"]

_PIN_OK: list[bool] = []


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t`, in pinned memory where the platform supports pinning."""
    host = t.detach().to("cpu", copy=t.device.type != "cpu")
    if _PIN_OK == [False]:
        return host
    try:
        pinned = host.pin_memory()
        if not _PIN_OK:
            _PIN_OK.append(True)
        return pinned
    except RuntimeError:  # no accelerator: pinning is not possible (nor needed)
        _PIN_OK.append(False)
        return host


@attrs.define
class HostUpdater:
    """Runs the optimizer update in host memory and writes the result back into the device params."""

    keep_master: bool
    master: dict[str, torch.Tensor] | None = None

    def __call__(
        self, tx: GradientTransformation, grads: dict[str, torch.Tensor], opt_state: Any, params: dict[str, torch.Tensor]
    ) -> Any:
        first = next(iter(params.values()))
        if first.device.type == "cpu":
            return apply_gradients(tx, grads, opt_state, params)
        host_grads = {k: to_host(g) for k, g in grads.items()}
        if self.keep_master and self.master is not None:
            host_params = self.master
        else:
            host_params = {k: to_host(p).float() for k, p in params.items()}
            if self.keep_master:
                self.master = host_params
        new_state = apply_gradients(tx, host_grads, opt_state, host_params)
        with torch.no_grad():
            torch._foreach_copy_(list(params.values()), list(host_params.values()), non_blocking=True)
        return new_state


@attrs.frozen
class Offload(TransformBase):
    optimizer_state: bool = True
    params: bool = False
    kind: str = "offload"

    def describe(self) -> str:
        return f"offload(optimizer_state={self.optimizer_state}, params={self.params})"

    def check(self, others: Sequence[Transform]) -> None:
        shard = find(others, "shard")
        if shard is not None and getattr(shard, "backend", "torch") == "deepspeed":
            raise conflict(self, shard, "DeepSpeed offloads through its own config (zero_optimization.offload_*)")

    def lower(self, plan: Plan) -> None:
        if plan.kind != "train":
            raise ValueError("offload() applies to training steps only")
        plan.updater = HostUpdater(keep_master=self.params)

    def init_state(self, plan: Plan, state: TrainState) -> TrainState:
        return state.replace(opt_state=_tree.map(to_host, state.opt_state))


@checked
def offload(step: Step, *, optimizer_state: bool = True, params: bool = False) -> Step:
    """Keep the optimizer state (and with `params=True` fp32 master params) in host memory between steps."""
    if not optimizer_state:
        raise ValueError(
            "offload: optimizer_state=False is not supported: the update runs in host memory, so the optimizer "
            "state lives there (params=True additionally keeps fp32 master params on the host)"
        )
    return step.with_transform(Offload(optimizer_state, params))
