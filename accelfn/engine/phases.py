"""The training step as a sequence of named phases over a lowered `Plan`:

    check -> split -> forward_backward -> reduce -> clip -> update -> metrics

- `check`: refuse a foreign state, transform the batch (the strategy's shard of it), place it on the model's
  device, bind the state's params to the module; the strategy's `prepare`;
- `split`: micro-batches (`af.accumulate`);
- `forward_backward`: per micro-batch, the loss under autocast and the step's seeded RNG, then its backward;
  gradients are read from `.grad` of the bound params;
- `reduce`: the strategy sums gradients, loss and count over the ranks; gradients are divided by the global
  count (exact averaging), unscaled and checked for inf (fp16);
- `clip`: by the global norm (the strategy's, for sharded gradients);
- `update`: the optimizer, in place (or the `af.offload` updater), then the `after_update` hooks and the
  strategy's `after_update` (local SGD averages the params there);
- `metrics`: loss, grad norm, lr, aux averaged over micro-batches and ranks (under a sharding strategy also
  `rank_loss`, the loss of this rank's own rows); the new `TrainState`.

A strategy hooks the phases through its `GradSync` (`accelfn.engine.contract`); a backend that owns phases
(DeepSpeed's engine runs backward, clipping and the update) subclasses `TrainPhases` and overrides those.
"""

from __future__ import annotations

import warnings
from contextlib import ExitStack
from typing import Any

import attrs
import torch

from .. import dry_mode
from .. import random as _random
from .. import tree as _tree
from ..dtensor import local_tensor
from ..module import bind, read_buffers
from ..optim import apply_gradients, learning_rate
from ..optim.base import apply_gradients_on_shards
from ..optim.clip import clip_
from ..state import TrainState
from .batches import loss_parts, place_batch, rows, split_batch
from .contract import GradSync
from .plan import LossScaleConfig, Plan, exclusive

__all__ = ["StepRun", "TrainPhases", "run_train", "next_state", "STANDARD"]


@attrs.define
class StepRun:
    """What one call of a training step has computed so far; each phase reads and adds to it."""

    plan: Plan
    sync: GradSync
    state: TrainState
    batch: Any
    params: dict[str, torch.Tensor] = attrs.Factory(dict)
    keys: list[torch.Tensor] = attrs.Factory(list)  # [the next state's key, this step's key]
    step_key: torch.Tensor | None = None  # this rank's key for this step
    micro: list[Any] = attrs.Factory(list)
    scaler: dict[str, torch.Tensor] | None = None  # fp16's loss scale (state.extra["loss_scale"])
    exact: bool = False  # one micro-batch, one process: the count is known locally, divided before backward
    loss_sum: torch.Tensor | None = None
    count_sum: torch.Tensor | None = None
    aux_sum: dict[str, Any] = attrs.Factory(dict)
    # fp16 without a local count to divide by (sums of micro-batches / ranks): the backward runs on
    # `total * scale / norm`, with `norm` the first micro-batch's count times the number of micro-batches,
    # agreed over the ranks (the same constant everywhere): the effective scale of each micro-batch's mean is
    # about `scale / n_micro`, as with torch's GradScaler and a loss divided by the accumulation steps, and
    # unscaling stays exact
    norm: torch.Tensor | None = None
    grads: dict[str, torch.Tensor] = attrs.Factory(dict)
    metrics: dict[str, torch.Tensor] = attrs.Factory(dict)
    skipped: bool | None = None  # fp16: an inf/nan gradient skipped the update
    opt_state: Any = None
    extra: dict[str, Any] = attrs.Factory(dict)


class TrainPhases:
    """The engine: one training step as named phases (see the module docs). Stateless; one instance serves
    every step whose strategy does not bring its own."""

    def run(self, plan: Plan, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        run = self.start(plan, state, batch)
        mark = dry_mode.phase  # a no-op unless a dry run watches
        mark("check", run)
        try:
            self.check(run)
            self.split(run)
            mark("forward_backward", run)
            self.forward_backward(run)
        except (
            Exception
        ) as error:  # e.g. the loss raising in a micro-batch: the caller may catch it, step again
            # (not on KeyboardInterrupt / SystemExit: FSDP2's reset waits for gathers in flight); a failure of the
            # abandon itself is a warning, the step's own error is the one raised
            try:
                run.sync.abandon()
            except Exception as e:
                warnings.warn(
                    f"the step raised ({type(error).__name__}) and its partial gradient state could not be dropped "
                    f"({type(e).__name__}: {e}): the next step may carry it",
                    RuntimeWarning,
                    stacklevel=2,
                )
            raise
        mark("reduce", run)
        self.reduce(run)
        mark("clip", run)
        self.clip(run)
        mark("update", run)
        self.update(run)
        mark("metrics", run)
        return self.metrics(run)

    def start(self, plan: Plan, state: TrainState, batch: Any) -> StepRun:
        """The record of this call (a backend with more to carry between its phases returns a subclass)."""
        return StepRun(plan, plan.sync, state, batch)

    # ---- check --------------------------------------------------------------------------------------------------
    def check(self, run: StepRun) -> None:
        plan, state = run.plan, run.state
        assert plan.optimizer is not None and plan.slots is not None and plan.loss_call is not None
        if plan.opt_state_type is not None and type(state.opt_state) is not plan.opt_state_type:
            raise ValueError(
                f"state.opt_state is a {type(state.opt_state).__name__}, but this step's optimizer keeps a "
                f"{plan.opt_state_type.__name__}: pass the state returned by this step's init() or its last call "
                "(not one from another step, e.g. an eval_step)"
            )
        batch = plan.batch_transform(run.batch) if plan.batch_transform is not None else run.batch
        run.batch = place_batch(batch, plan.input_device)
        run.params = bind(plan.module, state.params, state.buffers, plan.slots)
        _check_trainable(run.params, plan.slots.trainable)
        run.sync.prepare(run.params)
        if not plan.module.training:
            plan.module.train()
        run.keys = _random.split_list(state.rng, 2)
        run.step_key = run.keys[1] if plan.rank_key is None else _random.fold_in(run.keys[1], plan.rank_key)

    # ---- split --------------------------------------------------------------------------------------------------
    def split(self, run: StepRun) -> None:
        plan = run.plan
        run.micro = (
            [run.batch] if plan.microbatches == 1 else split_batch(run.batch, plan.microbatches, plan.uneven)
        )

    # ---- forward and backward ---------------------------------------------------------------------------------
    def forward_backward(self, run: StepRun) -> None:
        plan, sync, params, micro = run.plan, run.sync, run.params, run.micro
        assert plan.slots is not None and plan.loss_call is not None and run.step_key is not None
        for n in (
            plan.slots.trainable
        ):  # drop gradients another step's backward may have left (a GAN's other half)
            params[n].grad = None
        run.scaler = run.state.extra.get("loss_scale") if plan.loss_scale is not None else None
        run.exact = len(micro) == 1 and plan.grad_sync is None
        for i, mb in enumerate(micro):
            key = run.step_key if len(micro) == 1 else _random.fold_in(run.step_key, i)
            with _random.seeded(key, plan.devices), plan.forward_context():
                out = plan.loss_call(plan.module, mb)
            total, count, aux = loss_parts(out)
            if not total.requires_grad:
                raise ValueError(
                    "the loss does not depend on any trainable parameter: loss_fn must compute it from `model`, "
                    "the module it receives (not another copy of the network)"
                )
            if run.exact:
                objective = total / count.clamp_min(1) if count is not None else total  # no valid element: 0
                run.loss_sum, run.count_sum = (
                    local_tensor(objective.detach()),
                    None,
                )  # loss-parallel: replicated
            else:
                if count is None:  # a mean over this micro-batch: weight it by its size
                    count = torch.tensor(float(rows(mb)), device=total.device)
                    # an empty micro-batch (a short last batch) weighs 0: its mean is NaN, not its weight
                    total = torch.where(count > 0, total * count, torch.zeros_like(total))
                objective = total
                value = local_tensor(
                    total.detach()
                )  # a loss-parallel loss is a replicated DTensor: its value
                run.loss_sum = value if run.loss_sum is None else run.loss_sum + value
                run.count_sum = count.detach() if run.count_sum is None else run.count_sum + count.detach()
            if run.scaler is not None:
                if not run.exact and run.norm is None:
                    assert count is not None
                    run.norm = sync.max_over_ranks(
                        count.detach().float().clamp_min(1).reshape(()) * len(micro)
                    )
                scale = run.scaler["scale"].to(objective.device)
                norm = run.norm
                objective = objective * (scale / norm.to(objective.device) if norm is not None else scale)
            with ExitStack() as stack:
                stack.enter_context(sync.microbatch(i == len(micro) - 1))
                for make in plan.backward_contexts:
                    stack.enter_context(make())
                objective.backward()
            for k, v in aux.items():
                run.aux_sum[k] = v.detach() if k not in run.aux_sum else run.aux_sum[k] + v.detach()
        self.collect(run)

    def collect(self, run: StepRun) -> None:
        """The gradients, read from (and cleared off) the bound params' `.grad`, laid out like their params."""
        plan, params = run.plan, run.params
        assert plan.slots is not None
        names = plan.slots.trainable
        run.sync.record_unused(names, {n for n in names if params[n].grad is None})
        grads: dict[str, torch.Tensor] = {}
        for n in names:
            p = params[n]
            g = p.grad
            if g is not None and getattr(g, "placements", None) != getattr(p, "placements", None):
                # DTensor autograd may leave a gradient laid out otherwise than its param (a tensor-parallel
                # embedding's is replicated): lay it out like the param, as the optimizer works shard by shard
                g = g.redistribute(p.device_mesh, p.placements)  # type: ignore[attr-defined]
            grads[n] = torch.zeros_like(p) if g is None else g
            p.grad = None
        run.grads = grads

    # ---- reduce -------------------------------------------------------------------------------------------------
    def reduce(self, run: StepRun) -> None:
        g_leaves = list(run.grads.values())
        assert run.loss_sum is not None
        inv: torch.Tensor | None = None
        if not run.exact:
            assert run.count_sum is not None
            if run.plan.grad_sync is not None and run.sync.rank_loss:  # this rank's own rows (early stopping)
                run.metrics["rank_loss"] = (run.loss_sum / run.count_sum.clamp_min(1)).detach()
            run.loss_sum, run.count_sum = run.sync.reduce(g_leaves, run.loss_sum, run.count_sum)
            inv = 1.0 / run.count_sum.clamp_min(1)
            loss_value = run.loss_sum / run.count_sum.clamp_min(1)
        else:
            loss_value = run.loss_sum
        run.metrics["loss"] = loss_value
        scaler = run.scaler
        if scaler is not None:
            inv_scale = (1.0 / scaler["scale"]).to(g_leaves[0].device, torch.float32)
            if inv is not None:
                assert run.norm is not None
                inv_scale = inv_scale * (inv * run.norm.to(inv)).to(inv_scale)
            found_inf = torch.zeros((), device=g_leaves[0].device)
            torch._amp_foreach_non_finite_check_and_unscale_(
                [local_tensor(g) for g in g_leaves], found_inf, inv_scale
            )
            found_inf = run.sync.any_rank(
                found_inf
            )  # sharded gradients: inf in one rank's shard skips everywhere
            run.skipped = bool(found_inf.item())
            run.metrics["skipped"] = found_inf
            run.metrics["loss_scale"] = scaler["scale"]
        elif inv is not None:
            local = [
                local_tensor(g) for g in g_leaves
            ]  # elementwise: act on shards, skipping DTensor dispatch
            torch._foreach_mul_(local, inv.to(local[0].device, local[0].dtype))

    # ---- clip ---------------------------------------------------------------------------------------------------
    def clip(self, run: StepRun) -> None:
        limit = run.plan.clip_grad_norm
        if limit is None or run.skipped:
            return
        g_leaves = list(run.grads.values())
        norm = run.sync.norm(g_leaves)
        clip_([local_tensor(g) for g in g_leaves], norm, limit)
        run.metrics["grad_norm"] = norm

    # ---- update -------------------------------------------------------------------------------------------------
    def update(self, run: StepRun) -> None:
        plan, params = run.plan, run.params
        assert plan.slots is not None and plan.optimizer is not None
        names = plan.slots.trainable
        run.opt_state, run.extra = run.state.opt_state, run.state.extra
        trainable = params if len(names) == len(params) else {n: params[n] for n in names}
        if not run.skipped:
            if plan.updater is None:
                apply = apply_gradients_on_shards if plan.update_on_shards else apply_gradients
                run.opt_state = apply(plan.optimizer, run.grads, run.opt_state, trainable)
            else:
                run.opt_state, run.extra = plan.updater(
                    plan.optimizer, run.grads, run.opt_state, trainable, run.extra
                )
            for hook in plan.after_update:
                hook(plan.module)
        run.sync.after_update(trainable, run.state.step)  # also after a skipped update: the step still counts

    # ---- metrics and the new state ------------------------------------------------------------------------------
    def metrics(self, run: StepRun) -> tuple[TrainState, dict[str, torch.Tensor]]:
        plan, metrics = run.plan, run.metrics
        assert plan.slots is not None
        lr = learning_rate(run.opt_state)
        if lr is not None:
            metrics["lr"] = lr
        n_micro = len(run.micro)
        aux = {
            k: v / n_micro if n_micro > 1 else v
            for k, v in run.aux_sum.items()
            if isinstance(v, torch.Tensor)
        }
        metrics.update(run.sync.reduce_metrics(aux) if plan.grad_sync is not None else aux)
        extra = run.extra
        if run.scaler is not None:
            assert plan.loss_scale is not None
            extra = {**extra, "loss_scale": _next_scale(run.scaler, bool(run.skipped), plan.loss_scale)}
        return next_state(run, extra), metrics


def next_state(run: StepRun, extra: dict[str, Any]) -> TrainState:
    """The state after this step: the bound params (updated in place), the module's buffers, the new key."""
    assert run.plan.slots is not None
    return TrainState(
        step=run.state.step + 1,
        params=run.params,
        buffers=read_buffers(run.plan.slots),
        opt_state=run.opt_state,
        rng=run.keys[0],
        extra=extra,
    )


STANDARD = TrainPhases()


def run_train(plan: Plan, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
    """One training step: the strategy's phases (the standard ones unless its backend owns some)."""
    phases = (
        plan.grad_sync.phases
        if plan.grad_sync is not None and plan.grad_sync.phases is not None
        else STANDARD
    )
    with exclusive(plan, state):
        if not plan.donate:
            state = _clone_state(state)
        if plan.updater is None:
            return phases.run(plan, state, batch)
        assert plan.optimizer is not None
        with plan.updater.overlapped(
            plan.optimizer, state
        ):  # an update running during this forward and backward
            return phases.run(plan, state, batch)


def _clone_state(state: TrainState) -> TrainState:
    return _tree.map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, state)


def _next_scale(
    scaler: dict[str, torch.Tensor], found_inf: bool, cfg: LossScaleConfig
) -> dict[str, torch.Tensor]:
    scale, good = scaler["scale"], scaler["good_steps"]
    if found_inf:
        return {"scale": scale * cfg.backoff_factor, "good_steps": torch.zeros_like(good)}
    good = good + 1
    if int(good) >= cfg.growth_interval:
        return {"scale": scale * cfg.growth_factor, "good_steps": torch.zeros_like(good)}
    return {"scale": scale, "good_steps": good}


def _check_trainable(params: dict[str, torch.Tensor], trainable: tuple[str, ...]) -> None:
    """The params that train are fixed at `step.init` (the optimizer state is built for them)."""
    if all(params[n].requires_grad for n in trainable) and sum(
        p.requires_grad for p in params.values()
    ) == len(trainable):
        return
    frozen = [n for n in trainable if not params[n].requires_grad]
    thawed = [n for n, p in params.items() if p.requires_grad and n not in trainable]
    what = (
        f"frozen after step.init(): {frozen[:3]}" if frozen else f"unfrozen after step.init(): {thawed[:3]}"
    )
    raise ValueError(
        f"params {what}. The trainable params (and the optimizer state built for them) are fixed when a step is "
        "initialised: set requires_grad before step.init() (a new step.init(step.model) starts from the current "
        "weights with a fresh optimizer state), or keep them trainable and zero their updates: "
        "af.train_step(loss_fn, af.optim.chain(optimizer, af.optim.freeze(mask)))"
    )
