"""What the modelled ZeRO stages share: DeepSpeed's defaults, the phases, the bucket, the update."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist

from .....engine.batches import rows
from .....engine.contract import GradSync
from .....engine.phases import StepRun, TrainPhases, next_state
from ..phases import counted_forwards, local_count, micro_forward

if TYPE_CHECKING:
    from .....engine import Plan


__all__ = ["ZeroPhases"]

_DEFAULT_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size (elements)
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_FAR = -(10**10)  # DeepSpeed's "never fetched" step id


def _moments(config_optimizer: dict[str, Any] | None) -> int:
    """How many partition-sized fp32 tensors the torch optimizer DeepSpeed is given keeps per parameter."""
    if config_optimizer is None:
        return 0
    name = config_optimizer.get("name")
    if name in ("adam", "adamw"):
        return 2
    if name == "sgd":
        return 1 if config_optimizer.get("momentum") else 0
    return 2


def _global_sum(values: list[torch.Tensor], device: torch.device, group: Any) -> torch.Tensor:
    """`DeepSpeedPhases._global_sum`: the values summed over the ranks, in one float64 all-reduce."""
    flat = torch.stack([v.detach().to(device, torch.float64).reshape(()) for v in values])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    return flat


@attrs.define(eq=False)
class _Bucket:
    """DeepSpeed's ipg bucket: the params whose gradients it holds (names, in order) and their elements."""

    names: list[str] = attrs.Factory(list)
    elements: int = 0
    # reduce_bucket_size elements each (two with overlap_comm)
    buffers: list[torch.Tensor] = attrs.Factory(list)
    extra: str | None = None  # a param larger than the bucket, reduced on its own


class _Base(GradSync):
    """What the modelled ZeRO stages share: the config read at lowering, the engine's parts of the phases."""

    group: Any
    world: int
    rank: int
    stage: int
    dtype: torch.dtype  # the params' (the engine's) dtype
    comm_dtype: torch.dtype  # communication_data_type
    overflow_check: bool
    clip: float  # gradient_clipping (0: none)
    fp16_scale: float | None  # fp16's initial loss scale (the metric)
    moments: int
    offload: bool
    reduce_bucket: int  # reduce_bucket_size (elements)
    lr: Callable[[torch.Tensor], Any]  # the optimizer's learning rate at a step count
    loss_has_count: bool | None
    divides: bool  # the update divides by the global count (`phases.divides_at_update`): no count forwards

    def after_backward(self) -> None:
        """The end of one micro-batch's backward (DeepSpeed's epilogue)."""

    def forget_release_decisions(self) -> None:
        """ZeRO-3: `phases.forget_release_decisions` (the cached release decisions cleared)."""

    def grads_now(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The gradients DeepSpeed keeps when the backward ends, as the dry run counts them."""
        return self.partition_grads()

    def end_reduction(self, params: dict[str, torch.Tensor]) -> None:
        """What DeepSpeed reduces after the last backward, once the gradients are counted (ZeRO-1)."""

    def partition_grads(self) -> dict[str, torch.Tensor]:
        """The gradient partitions the update reads."""
        raise NotImplementedError

    def step_norm(self) -> torch.Tensor:
        """The step's overflow check and gradient norm (their collectives)."""
        raise NotImplementedError

    def step(self, opt_state: Any, scale: torch.Tensor) -> None:
        """The update of the master partitions and what follows it (their collectives)."""
        raise NotImplementedError

    def hook_gradients(self, params: dict[str, torch.Tensor], names: list[str]) -> None:
        """Call `self._ready(p)` when each named param's gradient is ready (DeepSpeed's gradient hooks),
        registered once per tensor (a new state brings new tensors)."""
        self.names = {id(params[n]): n for n in names}
        for name in names:
            p = params[name]
            if getattr(p, "_accelfn_zero_sync", None) is not self:
                p.register_post_accumulate_grad_hook(self._ready)  # type: ignore[attr-defined]
                p._accelfn_zero_sync = self  # type: ignore[attr-defined]


@attrs.define
class _ZeroRun(StepRun):
    """A modelled DeepSpeed step's record: DeepSpeedStepRun's aux count and the clip factor of the step."""

    aux_count: int = 1
    scale: torch.Tensor | None = None
    divisor: torch.Tensor | None = None  # what the update divides the gradients by (several micro-batches)


class ZeroPhases(TrainPhases):
    """`DeepSpeedPhases` over a modelled engine: the forward and backward (the engine's gradient hooks are
    the strategy's), the engine's step as the reduce (ZeRO-1's reduction), clip (overflow check and norm) and
    update phases, the count summed before the first backward and the loss after the step as DeepSpeed's
    phases do (one float64 all-reduce each)."""

    def start(self, plan: Plan, state: Any, batch: Any) -> StepRun:
        return _ZeroRun(plan, plan.sync, state, batch)

    def forward_backward(self, run: StepRun) -> None:
        plan, sync, micro = run.plan, run.sync, run.micro
        assert isinstance(sync, _Base) and isinstance(run, _ZeroRun)
        assert plan.loss_call is not None and run.step_key is not None
        n = len(micro)
        device = plan.devices[0] if plan.devices else torch.device("cpu")
        # as DeepSpeedPhases: several micro-batches back-propagate their sums and the update divides by the
        # global count, summed after the last forward (fp16: counted before the first backward, by count forwards)
        after = n > 1 and sync.divides
        counts: list[torch.Tensor | None] = []
        if after:
            forward, first = micro_forward(plan, micro, run.step_key, plan.module), None
        else:
            forward, first, counts, has_count, mine = counted_forwards(
                plan, micro, run.step_key, plan.module, sync
            )
            if n > 1 and has_count:
                sync.forget_release_decisions()  # ZeRO-3: the count forwards' cached decisions
            global_count = _global_sum([mine], device, sync.group)[0]
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        aux_sum: dict[str, torch.Tensor] = {}
        for i in range(n):
            total, count, aux = first if first is not None else forward(i)
            if after:
                counts.append(count if count is not None else torch.tensor(float(rows(micro[i]))))
                if i == n - 1:
                    global_count = _global_sum([local_count(counts)], device, sync.group)[0]
            if count is None:
                total = total * counts[i].to(total)  # type: ignore[union-attr]
            loss_sum += total.detach().to(torch.float64)
            for k, v in aux.items():
                if isinstance(v, torch.Tensor):
                    aux_sum[k] = v.detach().float() if k not in aux_sum else aux_sum[k] + v.detach().float()
            scale = sync.world if after else sync.world / global_count.clamp_min(1)
            (total * torch.as_tensor(scale).to(total)).backward()
            sync.after_backward()
        run.divisor = global_count.clamp_min(1) if after else None
        run.loss_sum, run.count_sum, run.aux_sum, run.aux_count = (
            loss_sum,
            global_count,
            aux_sum,
            n * sync.world,
        )
        run.grads = sync.grads_now(run.params)  # what the dry run counts as gradients (at the reduce phase)

    def reduce(self, run: StepRun) -> None:
        sync = run.sync
        assert isinstance(sync, _Base) and isinstance(run, _ZeroRun)
        assert run.loss_sum is not None and run.count_sum is not None
        run.grads = {}  # ZeRO-1's full gradients: freed by the reduction
        sync.end_reduction(run.params)
        run.grads = sync.partition_grads()

    def clip(self, run: StepRun) -> None:
        sync = run.sync
        assert isinstance(sync, _Base) and isinstance(run, _ZeroRun)
        norm = sync.step_norm()
        if run.divisor is not None:  # DeepSpeed's loss scale times the divisor, divided out with the clip
            norm = norm / run.divisor.to(norm)
        run.scale = (
            (sync.clip / (norm + 1e-6)).clamp(max=1.0) if sync.clip else torch.ones((), device=norm.device)
        )
        if run.divisor is not None:
            run.scale = run.scale / run.divisor.to(run.scale)
        if sync.fp16_scale is not None:
            run.metrics["skipped"] = torch.zeros(())
            run.metrics["loss_scale"] = torch.tensor(sync.fp16_scale)
        if sync.clip:
            run.metrics["grad_norm"] = norm.float().reshape(())

    def update(self, run: StepRun) -> None:
        sync = run.sync
        assert isinstance(sync, _Base) and isinstance(run, _ZeroRun) and run.scale is not None
        run.grads = {}
        sync.step(run.state.opt_state, run.scale)
        run.metrics["lr"] = torch.as_tensor(sync.lr(run.state.step), dtype=torch.float32).reshape(())
        run.opt_state = run.state.opt_state
        # the loss and aux summed over the ranks after the engine's step, as DeepSpeedPhases does (the engine
        # steps inside its forward_backward)
        assert run.loss_sum is not None and run.count_sum is not None
        scalars = _global_sum([run.loss_sum, *run.aux_sum.values()], run.loss_sum.device, sync.group)
        summed = {"loss": (scalars[0] / run.count_sum.clamp_min(1)).to(torch.float32)}
        summed.update({k: (v / run.aux_count).to(torch.float32) for k, v in zip(run.aux_sum, scalars[1:])})
        run.metrics = {**summed, **run.metrics}  # in the real phases' order: the loss first

    def metrics(self, run: StepRun) -> tuple[Any, dict[str, torch.Tensor]]:
        return next_state(run, run.state.extra), run.metrics


def _update(master: torch.Tensor, moments: list[torch.Tensor], grad: torch.Tensor) -> None:
    """The optimizer's update of a master partition, elementwise (the values do not matter in a dry run)."""
    for m in moments:
        m.mul_(0.9).add_(grad)
    master.add_(moments[0] if moments else grad, alpha=-1e-3)
