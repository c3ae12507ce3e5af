"""A DeepSpeed step's state in `af.checkpoint`: full fp32 params and moments, in accelfn's own layout.

The engine keeps the fp32 master params and the optimizer's moments (partitioned under ZeRO 1-3).
`export` assembles them per parameter with DeepSpeed's `safe_get_full_fp32_param` /
`safe_get_full_optimizer_state` (collectives under ZeRO-3: every rank calls it) into the state that the
same step with `backend="torch"` has — `params`, and `opt_state` shaped by `tx.init` (`mu`/`nu` from
`exp_avg`/`exp_avg_sq`, SGD's `momentum` from `momentum_buffer`, `count` and `lr`). `restore` writes such
a state back: the model params (re-partitioned under ZeRO-3), the fp32 master params and moments through
`safe_set_full_*`, the optimizer's step counters and the learning-rate schedule. So a checkpoint of a
DeepSpeed run loads into the ddp/fsdp step of the same model and optimizer, at any world size, and back.
No pickle (DeepSpeed's own `save_checkpoint` uses `torch.save`).

Not covered: fp16 (DeepSpeed's loss scaler state) raises a `CheckpointError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .... import tree as _tree
from ....checkpoint.format import CheckpointError
from ....state import TrainState
from .lowering import DeepSpeedSync
from .types import DeepSpeedRun, DeepSpeedState

if TYPE_CHECKING:
    from ....engine import Plan

__all__ = ["DeepSpeedStateAdapter"]


def runs_on_deepspeed(plan: Plan) -> bool:
    """Whether a lowered plan is a DeepSpeed step's."""
    return isinstance(plan.grad_sync, DeepSpeedSync)


def run_of(plan: Plan) -> DeepSpeedRun:
    """The DeepSpeed run (engine, group, config) of a DeepSpeed step's plan."""
    assert isinstance(plan.grad_sync, DeepSpeedSync)
    return plan.grad_sync.run


# accelfn optimizer-state field -> the key of the same tensor in torch's optimizer state
_MOMENTS = {"mu": "exp_avg", "nu": "exp_avg_sq", "momentum": "momentum_buffer"}


def _plan_of(state: TrainState) -> Plan:
    """The live DeepSpeed step whose engine owns `state`'s params."""
    from ....engine.plan import _TRAINING

    for plan in list(_TRAINING):
        if not runs_on_deepspeed(plan) or plan.slots is None:
            continue
        run = run_of(plan)
        first = next(iter(plan.slots.trainable))
        if state.params.get(first) is run.engine.module.get_parameter(first):
            return plan
    raise CheckpointError(
        "this state's opt_state is a DeepSpeedState, but its params belong to no live DeepSpeed step: pass the "
        "state returned by step.init() or by the step's last call"
    )


def _moment_of(path: str) -> tuple[str, str] | None:
    """`("exp_avg", "fc.weight")` for an optimizer-state path like `1.mu.fc.weight`."""
    parts = path.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in _MOMENTS:
            return _MOMENTS[part], ".".join(parts[i + 1 :])
    return None


def _base_optimizer(engine: Any) -> torch.optim.Optimizer:
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def _ensure_optimizer_state(engine: Any, base: torch.optim.Optimizer) -> None:
    """Create the optimizer state torch creates lazily at the first step, and link DeepSpeed's per-param views
    of it (a never-stepped engine has none to load into)."""
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)  # ZeRO-3 keeps them aside
    for i, group in enumerate(base.param_groups):
        momentum = group.get("momentum", 0.0)
        for p in [flats[i]] if flats is not None else group["params"]:
            st = base.state[p]
            if st:
                continue
            if "betas" in group:  # Adam, AdamW, DeepSpeedCPUAdam
                st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            elif momentum:
                st["momentum_buffer"] = torch.zeros_like(p)
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None and getattr(engine.optimizer, "_hp_optimizer_states_linked", True) is False:
        link()


def _set_full(param: torch.nn.Parameter, value: torch.Tensor, key: str | None = None) -> None:
    """`safe_set_full_fp32_param` / `safe_set_full_optimizer_state`; under ZeRO-3, this rank's slice of it.

    DeepSpeed 0.19's ZeRO-3 `set_full_hp_param` cuts the slice at `partition size * rank`, where the
    partition size includes the last rank's padding, and fails when the size does not divide evenly; the
    local API takes the (padded) slice itself.
    """
    from deepspeed import utils as ds

    if hasattr(param, "ds_id"):
        n = param.ds_tensor.numel()  # type: ignore[attr-defined]
        part = value.flatten()[n * dist.get_rank() : n * (dist.get_rank() + 1)]
        local = torch.zeros(n, dtype=value.dtype, device=value.device)
        local[: part.numel()] = part
        if key is None:
            ds.safe_set_local_fp32_param(param, local)
        else:
            ds.safe_set_local_optimizer_state(param, local, key)
    elif key is None:
        ds.safe_set_full_fp32_param(param, value)
    else:
        ds.safe_set_full_optimizer_state(param, value, key)


class DeepSpeedStateAdapter:
    """`af.checkpoint`'s adapter for states whose `opt_state` is a `DeepSpeedState`."""

    def template(self, like: TrainState) -> TrainState:
        """The exported state's structure, shapes and dtypes (values unset): what `load` reads into."""
        plan = _plan_of(like)
        module = run_of(plan).engine.module
        assert plan.slots is not None and plan.optimizer is not None

        def empty(name: str) -> torch.Tensor:
            p = module.get_parameter(name)
            return torch.zeros(tuple(getattr(p, "ds_shape", p.shape)), dtype=torch.float32)

        params = {n: empty(n) for n in like.params}
        return TrainState(
            step=like.step, params=params, buffers={k: v.detach().cpu() for k, v in like.buffers.items()},
            opt_state=plan.optimizer.init({n: params[n] for n in plan.slots.trainable}), rng=like.rng,
            extra=like.extra,
        )  # fmt: skip

    def export(self, state: TrainState) -> TrainState:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        plan = _plan_of(state)
        run = run_of(plan)
        if run.fp16:
            raise CheckpointError(
                "af.checkpoint does not save DeepSpeed's fp16 loss-scaler state: use bf16, or "
                "engine_of(step).save_checkpoint(dir)"
            )
        engine, base = run.engine, _base_optimizer(run.engine)
        module = engine.module
        assert plan.slots is not None and plan.optimizer is not None
        trainable = list(plan.slots.trainable)

        def full(name: str) -> torch.Tensor:
            p = module.get_parameter(name)
            hp = safe_get_full_fp32_param(p) if p.requires_grad else None
            if hp is None and hasattr(p, "ds_id"):  # a ZeRO-3 param without a master copy (frozen)
                import deepspeed

                with deepspeed.zero.GatheredParameters([p]):
                    return p.detach().to("cpu", torch.float32, copy=True)
            return (hp if hp is not None else p.detach()).to("cpu", torch.float32, copy=True)

        params = {n: full(n) for n in state.params}
        template = plan.optimizer.init({n: params[n] for n in trainable})
        count, lr = state.opt_state.count, state.opt_state.lr

        def fill(path: str, leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            field = path.rsplit(".", 1)[-1]
            moment = _moment_of(path)
            if moment is None:
                if field == "count":
                    return count.detach().clone().to(leaf.dtype)
                if field == "lr":
                    return lr.detach().clone().to(leaf.dtype)
                raise CheckpointError(
                    f"cannot export opt_state.{path} of a DeepSpeed step (no engine counterpart)"
                )
            key, name = moment
            p = module.get_parameter(name)
            value = safe_get_full_optimizer_state(p, key)
            if (
                value is None
            ):  # ZeRO-0: the torch optimizer's own per-param state (none before the first step)
                value = base.state.get(p, {}).get(key)
            return leaf if value is None else value.to("cpu", leaf.dtype, copy=True).reshape(leaf.shape)

        paths = [p for p, _ in _tree.flatten_with_path(template)]
        leaves = [fill(p, x) for p, x in zip(paths, _tree.leaves(template))]
        opt_state = _tree.unflatten(_tree.structure(template), leaves)
        return TrainState(
            step=state.step, params=params, buffers={k: v.detach().cpu() for k, v in state.buffers.items()},
            opt_state=opt_state, rng=state.rng, extra=state.extra,
        )  # fmt: skip

    def restore(self, like: TrainState, loaded: TrainState) -> TrainState:

        plan = _plan_of(like)
        engine, base = run_of(plan).engine, _base_optimizer(run_of(plan).engine)
        module = engine.module
        device = next(iter(like.params.values())).device
        _ensure_optimizer_state(engine, base)
        with torch.no_grad():
            zero3 = [n for n in loaded.params if hasattr(module.get_parameter(n), "ds_id")]
            if zero3:  # every rank holds the same full values: write them, then re-partition
                import deepspeed

                params = [module.get_parameter(n) for n in zero3]
                with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                    if dist.get_rank() == 0:
                        for n, p in zip(zero3, params):
                            p.copy_(loaded.params[n].to(p.device, p.dtype))
            for n, value in loaded.params.items():
                p = module.get_parameter(n)
                if n not in zero3:
                    p.copy_(value.to(p.device, p.dtype))
                if p.requires_grad:
                    _set_full(p, value.to(device))
            for n, value in loaded.buffers.items():
                module.get_buffer(n).copy_(value)

            count: int | None = None
            for path, leaf in _tree.flatten_with_path(loaded.opt_state):
                field = path.rsplit(".", 1)[-1]
                if field == "count" and count is None:
                    count = int(leaf)
                moment = _moment_of(path)
                if moment is None:
                    continue
                key, name = moment
                p = module.get_parameter(name)
                if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):
                    _set_full(p, leaf.to(device), key)
                else:  # ZeRO-0: a plain torch optimizer keyed by the param
                    base.state.setdefault(p, {})[key] = leaf.to(p.device, torch.float32, copy=True)
            count = count or 0
            for st in base.state.values():  # bias correction and friends continue from the loaded count
                if "step" in st:
                    st["step"] = torch.tensor(float(count)) if isinstance(st["step"], torch.Tensor) else count
                elif "exp_avg" in st:
                    st["step"] = torch.tensor(float(count))
            for group in base.param_groups:
                if "step" in group:  # DeepSpeedCPUAdam counts per group
                    group["step"] = count
            sched = engine.lr_scheduler
            if sched is not None:  # LambdaLR stepped once per update
                sched.last_epoch = count
                lrs = [b * lam(count) for b, lam in zip(sched.base_lrs, sched.lr_lambdas)]
                for group, lr in zip(base.param_groups, lrs):
                    group["lr"] = lr
                sched._last_lr = lrs
            engine.global_steps = count
        lr = torch.tensor(float(base.param_groups[0]["lr"]), dtype=torch.float32)
        learned = [x for p, x in _tree.flatten_with_path(loaded.opt_state) if p.rsplit(".", 1)[-1] == "lr"]
        return TrainState(
            step=loaded.step, params=like.params, buffers=like.buffers,
            opt_state=DeepSpeedState(torch.tensor(count, dtype=torch.int64), learned[0] if learned else lr),
            rng=loaded.rng, extra=loaded.extra,
        )  # fmt: skip
