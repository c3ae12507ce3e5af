"""The phases of a DeepSpeed step: the engine runs the backward (with its gradient reduction), clipping and the
update, so `DeepSpeedPhases` overrides those phases of the standard engine and keeps the others.

Exact batch arithmetic: DeepSpeed averages gradients over the data-parallel ranks (and, by default, over
micro-batches); the update is the one of one process on the global batch, as with `backend="torch"`: the
gradients of the summed loss divided by the global count (the loss's count summed over the micro-batches and
ranks; a mean (scalar) loss counts the rows of its micro-batch). One micro-batch: its forward gives the count,
all-reduced once before its backward, which back-propagates `total * world_size / global_count`. Several
micro-batches (`af.accumulate(n)`): each back-propagates `total * world_size` (the gradients accumulate the
global sum), the counts are all-reduced after the last forward, and the engine's update divides the accumulated
gradients by the global count (`divided_update`: DeepSpeed's own loss scale, which its ZeRO-1/2/3 optimizers and
its bf16 ZeRO-0 optimizer divide out before the norm, the clipping and the update; a plain fp32 ZeRO-0
optimizer's gradients divided in place), so no micro-batch runs a forward more. Under fp16 (DeepSpeed's dynamic
loss scale: a sum's larger gradients would overflow where a mean's do not) and with DeepSpeed's
`BF16_Optimizer` (a user's `data_types.grad_accum_dtype`: no loss scale), the divisor is applied before the
backwards instead, and an `af.Loss` is counted by a forward of each micro-batch without gradients first
(`counted_forwards`: one extra forward per micro-batch; under ZeRO-3 the release decisions those forwards made
DeepSpeed cache are cleared after them, `forget_release_decisions`).

A step that raises before its update (the loss, a forward or a backward of micro-batch k of n) is dropped
from the engine (`DeepSpeedPhases.abandon`, the strategy's `GradSync.abandon`): the micro-step counter goes
back to its value when the step began and the optimizer's partial gradients are dropped (`abandon.py`), so the
caller may catch the error and step again as if that step never ran. A step interrupted otherwise
(KeyboardInterrupt) is dropped at the start of the next one. A step that raised in its update (the last
micro-batch's `engine.step()`: the optimizer's step, partway through ZeRO's per-group update, the lr scheduler)
is not dropped: the parameters and moments may already be partly or fully updated, so a retry would apply that
batch twice. There, and where the engine cannot be reset, every later step raises rather than train on what the
failed step left (rebuild the step, load a checkpoint).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
import torch.distributed as dist

from .... import random as _random
from ....engine.batches import loss_parts, rows
from ....engine.phases import StepRun, TrainPhases, next_state
from ....engine.plan import Plan
from ....state import TrainState
from .abandon import drop_partial_step, module_stack_depth
from .types import DeepSpeedRun, DeepSpeedState

__all__ = [
    "DeepSpeedPhases",
    "counted_forwards",
    "local_count",
    "micro_forward",
    "divided_update",
    "divides_at_update",
    "reported_norm_scale",
    "forget_release_decisions",
]


@attrs.define
class DeepSpeedStepRun(StepRun):
    """A DeepSpeed step's record: what the engine reports besides the standard fields."""

    global_count: torch.Tensor | None = None  # the loss count over all ranks and micro-batches
    lr: float = 0.0  # the learning rate this update uses
    aux_count: int = 1  # aux metrics are averaged over micro-batches x ranks
    # what the engine's reported gradient norm is multiplied by (`reported_norm_scale`)
    norm_scale: float = 1.0


# forward(i, grad=True) -> (total, count, aux): micro-batch i's loss
Forward = Callable[..., tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]]


def micro_forward(plan: Plan, micro: list[Any], step_key: torch.Tensor, module: Any) -> Forward:
    """The forward of micro-batch i (its random key folded from the step's), with gradients or without."""
    n = len(micro)

    def forward(i: int, grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
        key = step_key if n == 1 else _random.fold_in(step_key, i)
        with _random.seeded(key, plan.devices), plan.forward_context(), torch.set_grad_enabled(grad):
            out = plan.loss_call(module, micro[i])  # type: ignore[misc]
        total, count, aux = loss_parts(out)
        if grad and not total.requires_grad:
            raise ValueError(
                "the loss does not depend on any trainable parameter: loss_fn must compute it from `model`, "
                "the module it receives (not another copy of the network)"
            )
        return total, count, aux

    return forward


def counted_forwards(
    plan: Plan, micro: list[Any], step_key: torch.Tensor, module: Any, holder: Any
) -> tuple[Forward, Any, list[torch.Tensor | None], bool, torch.Tensor]:
    """The forward of micro-batch i, and what the divisor needs before the first backward (the lowering where
    the update cannot divide, `divides_at_update`, or one micro-batch): the first
    micro-batch's result when there is one micro-batch (its forward gives the count), each micro-batch's count,
    whether the loss counts (an af.Loss) and this rank's count. Several micro-batches: a mean loss counts rows
    (known now); an af.Loss counts in the forward, so a forward without gradients counts each micro-batch first
    (all forwards with gradients before the backwards would keep every micro-batch's activations, and ZeRO-3
    does not support that order). `holder.loss_has_count` remembers whether the loss counts (the real engine's
    `DeepSpeedState`, or the dry run's model of it)."""
    n = len(micro)
    forward = micro_forward(plan, micro, step_key, module)
    first = forward(0) if n == 1 else None
    if n > 1 and holder.loss_has_count is None:
        holder.loss_has_count = forward(0, grad=False)[1] is not None
    has_count = first[1] is not None if first is not None else bool(holder.loss_has_count)
    if not has_count:
        counts: list[torch.Tensor | None] = [torch.tensor(float(rows(mb))) for mb in micro]
    elif first is not None:
        counts = [first[1]]
    else:
        counts = [forward(i, grad=False)[1] for i in range(n)]
        if any(c is None for c in counts):
            raise ValueError("loss_fn returned an af.Loss for some micro-batches and a scalar for others")
    return forward, first, counts, has_count, local_count(counts)


def local_count(counts: list[torch.Tensor | None]) -> torch.Tensor:
    """This rank's count over its micro-batches (a float on the CPU; the all-reduce's input)."""
    return sum((c.detach().float().cpu() for c in counts if c is not None), torch.zeros(()))


def _divisor_holder(engine: Any) -> Any:
    """Where the engine's update divides the accumulated gradients by (`divided_update`): the loss scaler of
    a ZeRO-1/2/3 optimizer (`loss_scaler.cur_scale`, divided out in `unscale_and_clip_grads` and from the norm),
    the bf16 ZeRO-0 optimizer's (`FP16_Optimizer` / `FP16_UnfusedOptimizer.loss_scale_config`), the module whose gradients a plain fp32
    ZeRO-0 optimizer steps on; None where the count must be known before the backwards (fp16's dynamic loss
    scale, `BF16_Optimizer`, a torch GradScaler, a loss scale the user overrides)."""
    opt = engine.optimizer
    if engine.fp16_enabled() or type(opt).__name__ == "BF16_Optimizer":
        return None
    if engine.zero_optimization():
        scaler = getattr(opt, "loss_scaler", None)
        if getattr(opt, "custom_loss_scaler", False) or not _is_scale(getattr(scaler, "cur_scale", None)):
            return None
        return scaler
    config = getattr(opt, "loss_scale_config", None)
    if config is not None:
        return config if _is_scale(getattr(config, "cur_scale", None)) else None
    if isinstance(opt, torch.optim.Optimizer) and not engine.bfloat16_enabled():
        return None if getattr(engine, "torch_autocast_z0_gradscaler", None) else engine.module
    return None


def _is_scale(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def divides_at_update(engine: Any) -> bool:
    """Whether the engine's update can divide the accumulated gradients by the global count (`divided_update`):
    then several micro-batches need no count forwards."""
    return _divisor_holder(engine) is not None


@contextlib.contextmanager
def divided_update(engine: Any, divisor: float) -> Iterator[None]:
    """The boundary `engine.step()` in this context divides the accumulated gradients by `divisor` before its
    norm, clipping and update: DeepSpeed's loss scale times `divisor` for that step (its optimizer divides the
    gradients and the norm by the scale; put back after), or a plain ZeRO-0 optimizer's gradients divided."""
    holder = _divisor_holder(engine)
    assert holder is not None, "divided_update on an engine that cannot divide at its update"
    if isinstance(holder, torch.nn.Module):
        with torch.no_grad():
            for p in holder.parameters():
                if p.grad is not None:
                    p.grad.div_(divisor)
        yield
        return
    before = holder.cur_scale
    holder.cur_scale = before * divisor
    try:
        yield
    finally:
        holder.cur_scale = before


def reported_norm_scale(engine: Any, divisor: float) -> float:
    """What the gradient norm the engine reports after a `divided_update` by `divisor` is multiplied by to be the
    divided gradients' norm: DeepSpeed's `FP16_UnfusedOptimizer` (bf16 ZeRO-0 with a torch optimizer) reports the
    norm before it divides out its loss scale (it clips by the divided one); the others report the divided one."""
    return 1.0 / divisor if type(engine.optimizer).__name__ == "FP16_UnfusedOptimizer" else 1.0


def forget_release_decisions(engine: Any) -> None:
    """ZeRO-3: clear DeepSpeed's cached release decisions (`__params_to_release`, an lru_cache keyed by module
    and trace position that nothing clears). Count forwards (forward-only traces) fill it with decisions that
    keep nothing gathered for the backward; cleared after them, the training forwards decide again with the
    step's recorded trace (and keep what its backward reuses)."""
    if engine.zero_optimization_stage() != 3:
        return
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as C

    cached = getattr(C, "_PartitionedParameterCoordinator__params_to_release", None)
    # the lru_cache under DeepSpeed's `instrument_w_nvtx` wrapper (which keeps it in its closure)
    for fn in (cached, *(c.cell_contents for c in getattr(cached, "__closure__", None) or ())):
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
            return
    warnings.warn(
        "DeepSpeed ZeRO-3's cached release decisions (PartitionedParameterCoordinator.__params_to_release, "
        "DeepSpeed 0.19) were not found: the count forwards' decisions may keep no params gathered from a "
        "forward to its backward",
        stacklevel=2,
    )


class DeepSpeedPhases(TrainPhases):
    """check (the engine's params) -> split -> forward_backward + the engine's step per micro-batch -> reduce
    (loss and aux over the ranks) -> clip (done by the engine: its norm is read) -> update (counted) -> metrics."""

    def __init__(self, run: DeepSpeedRun) -> None:
        self.ds = run

    def start(self, plan: Plan, state: TrainState, batch: Any) -> StepRun:
        return DeepSpeedStepRun(plan, plan.sync, state, batch)

    def check(self, run: StepRun) -> None:
        plan, state, engine = run.plan, run.state, self.ds.engine
        assert plan.loss_call is not None and plan.slots is not None
        # a step interrupted without its abandon (KeyboardInterrupt): drop it now
        if self.ds.started is not None:
            self.abandon()
        if self.ds.broken is not None:
            raise RuntimeError(self.ds.broken)
        first_name = next(iter(plan.slots.trainable))
        if state.params.get(first_name) is not engine.module.get_parameter(first_name):
            raise ValueError(
                "a DeepSpeed step updates its engine's parameters in place: pass the state returned by step.init() "
                "or by the previous call (or by af.checkpoint.load(path, like=that state))"
            )
        if plan.batch_transform is not None:
            run.batch = plan.batch_transform(run.batch)
        if not engine.training:
            engine.train()
        run.params = state.params
        run.keys = list(_random.split(state.rng, 2))
        run.step_key = _random.fold_in(run.keys[1], plan.rank_key or 0)

    def forward_backward(self, run: StepRun) -> None:
        assert isinstance(run, DeepSpeedStepRun) and run.step_key is not None
        plan, ds, engine, micro = run.plan, self.ds, self.ds.engine, run.micro
        n = len(micro)
        device = plan.devices[0] if plan.devices else torch.device("cpu")
        ds.started, ds.stack_depth = engine.micro_steps, module_stack_depth()
        # several micro-batches: the update divides by the global count (no count forwards), where it can
        after = n > 1 and ds.divides
        counts: list[torch.Tensor | None] = []
        has_count: bool | None = None
        if after:
            forward, first = micro_forward(plan, micro, run.step_key, engine), None
        else:
            forward, first, counts, has_count, mine = counted_forwards(plan, micro, run.step_key, engine, ds)
            if n > 1 and has_count:
                forget_release_decisions(engine)  # the count forwards' forward-only decisions (ZeRO-3)
            run.global_count = self._global_sum([mine], device)[0]
        scale = ds.world if after else ds.world / run.global_count.clamp_min(1).item()  # type: ignore[union-attr]

        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        aux_sum: dict[str, torch.Tensor] = {}
        skipped_before = engine.skipped_steps
        run.lr = current_lr(engine)  # the learning rate this update uses
        for i in range(n):
            total, count, aux = first if first is not None else forward(i)
            if has_count is None:
                has_count = count is not None
            if (count is not None) != has_count:
                raise ValueError("loss_fn returned an af.Loss for some micro-batches and a scalar for others")
            if after:
                counts.append(count if count is not None else torch.tensor(float(rows(micro[i]))))
            if count is None:
                total = total * counts[i].to(total)  # type: ignore[union-attr]
            elif (
                not after
                and n > 1
                and not torch.equal(count.detach().cpu().float(), counts[i].detach().cpu().float())  # type: ignore[union-attr]
            ):
                raise ValueError(
                    f"micro-batch {i}: the loss count changed between the counting forward ({float(counts[i])}) and "  # type: ignore[arg-type]
                    f"the training forward ({float(count)}); a Loss count must depend on the batch only"
                )
            if after and i == n - 1:  # every count is known: the global one, for the update's divisor
                run.global_count = self._global_sum([local_count(counts)], device)[0]
            loss_sum += total.detach().to(torch.float64)
            for k, v in aux.items():
                if isinstance(v, torch.Tensor):
                    aux_sum[k] = v.detach().float() if k not in aux_sum else aux_sum[k] + v.detach().float()
            engine.backward(total * scale, scale_wrt_gas=False)
            # the update, at the last micro-batch (DeepSpeed counts them): from here the step cannot be dropped
            ds.updating = engine.is_gradient_accumulation_boundary()
            if after and ds.updating:
                assert run.global_count is not None
                divisor = run.global_count.clamp_min(1).item()
                run.norm_scale = reported_norm_scale(engine, divisor)
                with divided_update(engine, divisor):
                    engine.step()
            else:
                engine.step()
        ds.started, ds.updating = None, False
        run.loss_sum, run.aux_sum, run.aux_count = loss_sum, aux_sum, n * ds.world
        run.skipped = engine.skipped_steps != skipped_before

    def abandon(self) -> None:
        """The step raised before its update: put the engine back as it was when the step began (its micro-step
        counter, the optimizer's partial gradients; local, no collective). A step that raised in its update, and
        a failure to reset the engine, are kept: every later step raises (`check`) instead of updating with what
        the failed step left."""
        ds = self.ds
        started, updating, ds.started, ds.updating = ds.started, ds.updating, None, False
        if started is None:  # the step raised before its first backward: nothing in the engine to drop
            return
        if updating:  # params, moments, the lr schedule and the counters may be partly or fully updated
            ds.broken = (
                "an earlier DeepSpeed step was interrupted in its update (the engine's optimizer step or lr "
                "scheduler raised): the parameters and optimizer state may be partly or fully updated, so that "
                "step can be neither dropped nor retried (a retry would apply its batch twice). Reload the state "
                "from a checkpoint into a new engine: af.checkpoint.load(path, like=step.init(model))"
            )
            return
        try:
            drop_partial_step(ds.engine, started, ds.stack_depth)
        except Exception as e:
            ds.broken = (
                "an earlier DeepSpeed step raised and what its finished backwards left in the engine could not be "
                f"dropped ({type(e).__name__}: {e}): the next update would include them. Build the step again "
                "(step.init) or load a checkpoint (af.checkpoint.load(path, like=a new step's state))"
            )
            raise

    def reduce(self, run: StepRun) -> None:
        assert isinstance(run, DeepSpeedStepRun) and run.loss_sum is not None and run.global_count is not None
        scalars = self._global_sum([run.loss_sum, *run.aux_sum.values()], run.loss_sum.device)
        run.metrics["loss"] = (scalars[0] / run.global_count.clamp_min(1)).to(torch.float32)
        run.metrics.update(
            {k: (v / run.aux_count).to(torch.float32) for k, v in zip(run.aux_sum, scalars[1:].unbind(0))}
        )

    def clip(self, run: StepRun) -> None:
        """DeepSpeed clipped in its step (`gradient_clipping`); its norm becomes the metric."""
        assert isinstance(run, DeepSpeedStepRun)
        if self.ds.fp16:
            run.metrics["skipped"] = torch.tensor(float(bool(run.skipped)))
            run.metrics["loss_scale"] = torch.tensor(float(self.ds.engine.optimizer.loss_scale))
        if self.ds.config.get("gradient_clipping"):
            norm = self.ds.engine.get_global_grad_norm()
            if norm is not None:
                run.metrics["grad_norm"] = torch.as_tensor(
                    norm * run.norm_scale, dtype=torch.float32
                ).reshape(())

    def update(self, run: StepRun) -> None:
        """DeepSpeed updated in its step; the state counts the update."""
        assert isinstance(run, DeepSpeedStepRun)
        run.metrics["lr"] = torch.tensor(run.lr, dtype=torch.float32)
        run.opt_state = run.state.opt_state
        if isinstance(run.opt_state, DeepSpeedState) and not run.skipped:
            run.opt_state = DeepSpeedState(run.opt_state.count + 1, run.metrics["lr"])

    def metrics(self, run: StepRun) -> tuple[TrainState, dict[str, torch.Tensor]]:
        return next_state(run, run.state.extra), run.metrics

    def _global_sum(self, values: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        flat = torch.stack([v.detach().to(device, torch.float64).reshape(()) for v in values])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.ds.group)
        return flat


def current_lr(engine: Any) -> float:
    """The learning rate of the engine's optimizer (its first parameter group)."""
    return float(engine.optimizer.param_groups[0]["lr"])
