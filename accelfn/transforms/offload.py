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


def to_host(t: torch.Tensor, *, copy: bool = False) -> torch.Tensor:
    """A host copy of `t`, in pinned memory where the platform supports pinning (`copy`: even on the host)."""
    host = t.detach().to("cpu", copy=copy or t.device.type != "cpu")
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


MASTER_KEY = "offload_master"


@attrs.define
class HostUpdater:
    """Runs the optimizer update in host memory and writes the result back into the device params.

    With `keep_master`, fp32 master params live on the host in `state.extra["offload_master"]` (so they are
    checkpointed, and a loaded or replaced state brings its own): the update runs on them and only the new
    params travel to the device. Without it, the params are copied to the host for each update. On a host
    whose params are already in host memory and without master params, the update runs in place as usual;
    `always_stream` forces the copying path there too (tests).
    """

    keep_master: bool
    always_stream: bool = False

    def __call__(
        self,
        tx: GradientTransformation,
        grads: dict[str, torch.Tensor],
        opt_state: Any,
        params: dict[str, torch.Tensor],
        extra: dict[str, Any],
    ) -> tuple[Any, dict[str, Any]]:
        first = next(iter(params.values()))
        on_host = first.device.type == "cpu" and not self.always_stream
        if on_host and not self.keep_master:
            return apply_gradients(tx, grads, opt_state, params), extra
        host_grads = {k: to_host(g, copy=self.always_stream).float() for k, g in grads.items()}
        if self.keep_master:
            host_params = extra[MASTER_KEY]
        else:
            host_params = {k: to_host(p, copy=True).float() for k, p in params.items()}
        new_state = apply_gradients(tx, host_grads, opt_state, host_params)
        with torch.no_grad():
            torch._foreach_copy_(list(params.values()), list(host_params.values()), non_blocking=True)
        return new_state, extra


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
        if shard is not None and getattr(shard, "strategy", "ddp") in ("fsdp", "hsdp"):
            raise conflict(
                self, shard, "offloading FSDP-sharded state is not supported yet (use strategy='ddp', or "
                "backend='deepspeed' with offload_optimizer=True)"
            )

    def lower(self, plan: Plan) -> None:
        if plan.kind != "train":
            raise ValueError("offload() applies to training steps only")
        plan.updater = HostUpdater(keep_master=self.params)

    def init_state(self, plan: Plan, state: TrainState) -> TrainState:
        # the host update runs in fp32 (like ZeRO-Offload), so the host state is fp32 whatever the params are
        def host(t: torch.Tensor) -> torch.Tensor:
            t = to_host(t)
            return t.float() if t.is_floating_point() and t.dtype != torch.float32 else t

        state = state.replace(opt_state=_tree.map(host, state.opt_state))
        if self.params:
            assert plan.slots is not None
            master = {n: to_host(state.params[n], copy=True).float() for n in plan.slots.trainable}
            state = state.replace(extra={**state.extra, MASTER_KEY: master})
        return state


@checked
def offload(step: Step, *, optimizer_state: bool = True, params: bool = False) -> Step:
    """Keep the optimizer state (and with `params=True` fp32 master params) in host memory between steps.

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
    return step.with_transform(Offload(optimizer_state, params))
