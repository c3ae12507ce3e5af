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

import contextlib
import os
from collections.abc import Iterator, Sequence
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

__all__ = ["offload", "to_host", "share_of_cores", "host_threads"]

def to_host(t: torch.Tensor, *, copy: bool = False, pin: bool = False) -> torch.Tensor:
    """A host copy of `t` (`copy`: even when it is on the host already), in pinned memory with `pin`."""
    if pin:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True).copy_(t.detach())
    return t.detach().to("cpu", copy=copy or t.device.type != "cpu")


MASTER_KEY = "offload_master"


@attrs.define
class HostUpdater:
    """Runs the optimizer update in host memory and writes the result back into the device params.

    ZeRO-Offload's data path, with buffers allocated once: each step, the gradients are copied (asynchronously)
    into persistent host buffers — pinned where the platform pins (`pin`), so the copies run on the copy engine —
    one synchronisation, the update by torch's fused multi-threaded CPU kernel on fp32 host params and state, and
    the new params copied back asynchronously (ordered before the next forward on the device's stream). The update
    uses this process's share of the host cores (`share_of_cores`), also when the launcher set
    `OMP_NUM_THREADS=1` for several processes per node.

    The host params are either fp32 master params kept in `state.extra["offload_master"]` (`keep_master`: they
    are checkpointed, and a loaded or replaced state brings its own), or a host mirror of the device params,
    refreshed only when a device param changed outside the update (tracked by tensor version counters, e.g. a
    checkpoint loaded into the state): no parameter copy to the host per step. The mirror holds exactly what the
    device holds (low-precision params are rounded on the host), so results do not depend on its lifetime. On a host whose params are
    already in host memory and without master params, the update runs in place as usual; `always_stream`
    forces the copying path there too (tests).
    """

    keep_master: bool
    pin: bool = False
    always_stream: bool = False
    threads: int | None = None  # host threads for the update (None: this process's share of the cores)
    grad_buffers: dict[str, torch.Tensor] = attrs.Factory(dict)
    mirror: dict[str, torch.Tensor] = attrs.Factory(dict)
    synced: dict[str, tuple[int, int]] = attrs.Factory(dict)  # name -> (id, version) of the device param mirrored

    def _buffer(self, store: dict[str, torch.Tensor], name: str, like: torch.Tensor) -> torch.Tensor:
        buf = store.get(name)
        if buf is None or buf.shape != like.shape:
            buf = torch.empty(like.shape, dtype=torch.float32, device="cpu", pin_memory=self.pin)
            store[name] = buf
        return buf

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
        with torch.no_grad():
            host_grads = {}
            for k, g in grads.items():
                buf = self._buffer(self.grad_buffers, k, g)
                buf.copy_(g.detach(), non_blocking=True)
                host_grads[k] = buf
            if self.keep_master:
                host_params = extra[MASTER_KEY]
            else:
                host_params = {}
                for k, p in params.items():
                    buf = self._buffer(self.mirror, k, p)
                    if self.synced.get(k) != (id(p), p._version):  # changed outside the update: read it again
                        buf.copy_(p.detach(), non_blocking=True)
                    host_params[k] = buf
            if first.device.type != "cpu":  # the copies into host memory must have landed before the update
                _synchronize(first.device)
            with host_threads(self.threads or share_of_cores()):
                new_state = apply_gradients(tx, host_grads, opt_state, host_params)
            if not self.keep_master:  # the mirror holds what the device holds: low-precision params rounded
                for k, p in params.items():
                    if p.dtype != torch.float32:
                        host_params[k].copy_(host_params[k].to(p.dtype))
            device_params = list(params.values())
            torch._foreach_copy_(device_params, list(host_params.values()), non_blocking=True)
            if not self.keep_master:
                self.synced = {k: (id(p), p._version) for k, p in params.items()}
        return new_state, extra


def share_of_cores() -> int:
    """This process's share of the host cores it may run on: the cores over the processes of this node
    (`LOCAL_WORLD_SIZE`, set by `accelfn launch`). The launcher sets `OMP_NUM_THREADS=1` for N processes per
    node; the host update, ZeRO-Offload's CPU Adam, is memory-bound work that needs more than one core.

    Example:
        >>> share_of_cores() >= 1
        True
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return max(1, cores // max(1, int(local) if local.isdigit() else 1))


@contextlib.contextmanager
def host_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to at least `n` inside the block (restored after)."""
    before = torch.get_num_threads()
    if n > before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _synchronize(device: torch.device) -> None:
    from .. import platforms

    try:
        platform = platforms.for_device(device)
    except ValueError:  # a kind accelfn has no adapter for: torch's generic accelerator API
        torch.accelerator.synchronize(device)
        return
    platform.synchronize(device)


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
        # pinned host buffers when the model computes on a device that pins (decided for plan.device, the device
        # the model runs on, also when it was built on the host)
        plan.updater = HostUpdater(keep_master=self.params, pin=_pins(plan))

    def init_state(self, plan: Plan, state: TrainState) -> TrainState:
        # the host update runs in fp32 (like ZeRO-Offload), so the host state is fp32 whatever the params are
        pin = _pins(plan)

        def host(t: torch.Tensor) -> torch.Tensor:
            t = t.float() if t.is_floating_point() and t.dtype != torch.float32 else t
            return to_host(t, pin=pin and t.dim() > 0)  # 0-d leaves (count, lr) are read by the host, never copied

        state = state.replace(opt_state=_tree.map(host, state.opt_state))
        if self.params:
            assert plan.slots is not None
            master = {n: to_host(state.params[n].float(), copy=True, pin=pin) for n in plan.slots.trainable}
            state = state.replace(extra={**state.extra, MASTER_KEY: master})
        return state


def _pins(plan: Plan) -> bool:
    try:
        return bool(plan.platform.supports_pinned_memory())
    except (RuntimeError, ValueError):
        return False


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
