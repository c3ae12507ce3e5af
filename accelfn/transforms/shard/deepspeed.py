"""DeepSpeed backend of `af.shard`: ZeRO stages 0-3 and ZeRO-Offload through `deepspeed.initialize`.

The step's combinators become the DeepSpeed config: `af.autocast` -> `bf16` / `fp16` (dynamic loss scale),
`af.accumulate(n)` -> `gradient_accumulation_steps`, `clip_grad_norm` (or a leading
`clip_by_global_norm` in a `chain`) -> `gradient_clipping`, and the stage from `zero_stage` (else the
user's `ds_config`, else `strategy`: "ddp" -> ZeRO-1, "fsdp" -> ZeRO-3). The optimizer's recorded
hyper-parameters (`tx.hyperparams`) build the same torch optimizer (`torch.optim.AdamW` / `Adam` / `SGD`,
`DeepSpeedCPUAdam` with optimizer offload), and a schedule becomes a `LambdaLR` stepped once per update.
A user's `ds_config` (dict or JSON path) is merged in; a key that disagrees with a combinator raises
`CompositionError` naming the key. `deepspeed` is imported only when such a step is lowered.

Exact batch arithmetic: DeepSpeed averages gradients over the data-parallel ranks (and, by default, over
micro-batches). So each micro-batch back-propagates `total * world_size / global_count`, where the global
count is all-reduced once per call before the first backward: the update is the one of one process on the
global batch, as with `backend="torch"`. A mean (scalar) loss counts the rows of its micro-batch. An
`af.Loss` with `af.accumulate(n)`, n > 1, is counted by a forward of each micro-batch without gradients
first (one extra, cheaper forward per micro-batch; keeping all micro-batches' graphs alive instead would
cost their activations, and ZeRO-3 does not support that order). Metrics are global.

The state's params are the engine module's own parameters (under ZeRO-3 the partitioned ones, with their
`ds_tensor`); `state.opt_state` is a `DeepSpeedState(count, lr)`: the optimizer's moments live inside the
engine. `af.checkpoint.save`/`load` reach them through `deepspeed_state` (full fp32 params and moments in
accelfn's own layout: the same checkpoint as the equivalent `backend="torch"` step's).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import attrs
import torch
import torch.distributed as dist

from ...engine import LossScaleConfig, loss_parts, split_batch
from ...lowering import CompositionError
from ...module import read_buffers
from ...optim import GradientTransformation
from ...optim._kernels import mask_leaves
from ...optim.schedules import as_schedule
from ...state import TrainState
from .common import batch_transform

if TYPE_CHECKING:
    from ...engine import Plan
    from ...step import Step
    from . import Shard

__all__ = ["DeepSpeedState", "Settings", "build_config", "config_for", "engine_of", "make_optimizer"]

STRATEGY_STAGE = {"ddp": 1, "fsdp": 3}
_NOMINAL_MICRO_BATCH = 1  # DeepSpeed needs one; it only uses it for its own data loader and logs


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


# ---- configuration ----------------------------------------------------------------------------------------------
def load_user_config(ds_config: Mapping[str, Any] | str | Path | None) -> dict[str, Any] | None:
    """A copy of the user's DeepSpeed config (a dict, or the path of a JSON file)."""
    if ds_config is None:
        return None
    if isinstance(ds_config, (str, Path)):
        path = Path(ds_config)
        if not path.is_file():
            raise FileNotFoundError(f"shard(backend='deepspeed'): ds_config file {str(path)!r} does not exist")
        with path.open() as f:
            loaded = json.load(f)
        if not isinstance(loaded, dict):
            raise ValueError(f"shard(backend='deepspeed'): {str(path)!r} holds a {type(loaded).__name__}, not a JSON object")
        return loaded
    return copy.deepcopy(dict(ds_config))


def split_optimizer(tx: GradientTransformation | None) -> tuple[Mapping[str, Any] | None, float | None]:
    """`(hyper-parameters of the optimizer proper, max_norm of a leading clip_by_global_norm or None)`."""
    if tx is None:
        return None, None
    hp = tx.hyperparams
    if hp is None:
        raise CompositionError(
            "shard(backend='deepspeed') builds a torch optimizer from the step's optimizer, but this "
            "GradientTransformation does not describe itself (no `hyperparams`): use af.optim.adamw, adam or sgd"
        )
    if hp.get("name") != "chain":
        return hp, None
    parts = [p for p in hp["parts"] if p is not None]
    clip = None
    while parts and parts[0].get("name") == "clip_by_global_norm":
        clip = float(parts.pop(0)["max_norm"])
    if len(parts) != 1 or len(hp["parts"]) != len(parts) + (clip is not None):
        names = [p.get("name") if p else "?" for p in hp["parts"]]
        raise CompositionError(
            f"shard(backend='deepspeed') supports chain(clip_by_global_norm(...), <one optimizer>), got chain{tuple(names)}"
        )
    return parts[0], clip


def build_config(settings: Settings) -> dict[str, Any]:
    """The DeepSpeed config for `settings`, merged with the user's config (conflicts raise)."""
    user = copy.deepcopy(dict(settings.user_config or {}))
    opt_hp, chain_clip = split_optimizer(settings.optimizer)
    clip = settings.clip_grad_norm
    if chain_clip is not None:
        if clip is not None and clip != chain_clip:
            raise CompositionError(
                f"train_step(clip_grad_norm={clip}) and the optimizer's clip_by_global_norm({chain_clip}) disagree"
            )
        clip = chain_clip

    for key, what in (("optimizer", "the step's optimizer"), ("scheduler", "the optimizer's learning-rate schedule")):
        if key in user:
            name = opt_hp.get("name") if opt_hp else None
            raise CompositionError(
                f"ds_config[{key!r}] conflicts with {what} ({name}): accelfn builds the optimizer and its schedule "
                f"from train_step(..., optimizer); remove {key!r} from ds_config"
            )

    zero_user = user.get("zero_optimization", {})
    stage = settings.zero_stage
    if stage is None:
        stage = zero_user.get("stage", STRATEGY_STAGE[settings.strategy])
    offload = settings.offload_optimizer
    user_offload = zero_user.get("offload_optimizer", {}).get("device", "none") not in ("none", None)
    if offload is None:
        offload = user_offload

    dtype = settings.autocast_dtype
    fp16: dict[str, Any] = {"enabled": dtype == torch.float16}
    if dtype == torch.float16:
        ls = settings.loss_scale or LossScaleConfig()
        if ls.growth_factor != 2.0 or ls.backoff_factor != 0.5:
            raise CompositionError(
                f"autocast(float16, loss_scale={ls}) cannot be expressed in DeepSpeed, whose dynamic loss scale "
                "grows by 2 and backs off by 1/2"
            )
        fp16.update(
            loss_scale=0, initial_scale_power=int(round(math.log2(ls.init_scale))),
            loss_scale_window=ls.growth_interval, hysteresis=1, min_loss_scale=1,
        )  # fmt: skip
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    generated: dict[str, Any] = {
        "gradient_accumulation_steps": settings.microbatches,
        "gradient_clipping": float(clip) if clip is not None else 0.0,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": fp16,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
    }
    # What the combinators decided; the user's config must agree with each of these.
    decided = {
        "gradient_accumulation_steps": (settings.microbatches, f"accumulate({settings.microbatches})"),
        "gradient_clipping": (generated["gradient_clipping"], f"clip_grad_norm={clip}"),
        "bf16.enabled": (dtype == torch.bfloat16, f"autocast({_dtype_name(dtype)})"),
        "fp16.enabled": (dtype == torch.float16, f"autocast({_dtype_name(dtype)})"),
        "zero_optimization.stage": (stage, f"zero_stage={stage}"),
        "zero_optimization.offload_optimizer.device": ("cpu" if offload else "none", f"offload_optimizer={offload}"),
    }
    for dotted, (want, who) in decided.items():
        have = _get(user, dotted)
        if have is None or have == "auto":
            continue
        if dotted == "zero_optimization.offload_optimizer.device" and (have in ("cpu", "nvme")) == bool(offload):
            continue
        if have != want:
            raise CompositionError(f"ds_config[{dotted!r}] = {have!r} conflicts with {who} (which needs {want!r})")
    if "train_batch_size" not in user:
        generated["train_micro_batch_size_per_gpu"] = _NOMINAL_MICRO_BATCH
    generated["steps_per_print"] = 2**31 - 1  # DeepSpeed's periodic log lines, unless the user asks for them
    return _merge(generated, user)


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "off" if dtype is None else str(dtype).removeprefix("torch.")


def _get(config: Mapping[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _merge(base: dict[str, Any], user: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `user` laid over it (nested dicts merged; the user's "auto" values filled from `base`)."""
    out = dict(base)
    for k, v in user.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(dict(out[k]), v)
        elif v != "auto" or k not in out:
            out[k] = v
    return out


def _find(transforms: Any, kind: str) -> Any:
    return next((t for t in transforms if t.kind == kind), None)


def config_for(step: Step) -> dict[str, Any]:
    """The DeepSpeed config that `step` (an `af.shard(..., backend="deepspeed")` step) will run with.

    Example (needs deepspeed only at `step.init`, not here):
        >>> import torch, accelfn as af
        >>> from accelfn.transforms.shard.deepspeed import config_for
        >>> mesh = af.Mesh({"dp": -1}, device="cpu")
        >>> step = af.train_step(lambda m, b: m(b).sum(), af.optim.adamw(1e-3), clip_grad_norm=1.0)
        >>> cfg = config_for(af.shard(af.accumulate(step, 4), mesh, backend="deepspeed", zero_stage=2))
        >>> cfg["gradient_accumulation_steps"], cfg["gradient_clipping"], cfg["zero_optimization"]["stage"]
        (4, 1.0, 2)
        >>> mesh.close()
    """
    shard = _find(step.transforms, "shard")
    if shard is None or shard.backend != "deepspeed":
        raise ValueError("config_for(step): the step has no af.shard(..., backend='deepspeed')")
    acc, cast = _find(step.transforms, "accumulate"), _find(step.transforms, "autocast")
    return build_config(
        Settings(
            zero_stage=shard.zero_stage, strategy=shard.strategy, offload_optimizer=shard.offload_optimizer,
            microbatches=acc.microbatches if acc is not None else 1,
            autocast_dtype=cast.dtype if cast is not None else None,
            loss_scale=(cast.loss_scale or LossScaleConfig()) if cast is not None and cast.dtype == torch.float16 else None,
            clip_grad_norm=step.clip_grad_norm, optimizer=step.optimizer, user_config=load_user_config(shard.ds_config),
        )
    )  # fmt: skip


# ---- optimizer --------------------------------------------------------------------------------------------------
def make_optimizer(
    tx: GradientTransformation, named: Mapping[str, torch.nn.Parameter], *, offload: bool
) -> tuple[torch.optim.Optimizer, Any]:
    """The torch optimizer equal to `tx` over the parameters `named`, and its schedule (or None if constant)."""
    hp, _ = split_optimizer(tx)
    assert hp is not None
    name = hp["name"]
    lr, schedule = hp["lr"], None
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        schedule, lr = as_schedule(lr), 1.0  # LambdaLR multiplies the base lr 1.0 by schedule(count)
    params = list(named.values())
    wd = float(hp.get("weight_decay", 0.0))
    groups: list[dict[str, Any]] = [{"params": params, "weight_decay": wd}]
    if hp.get("mask") is not None and wd:
        flags = mask_leaves(hp["mask"], dict(named), name)
        groups = [
            {"params": [p for p, f in zip(params, flags) if f], "weight_decay": wd},
            {"params": [p for p, f in zip(params, flags) if not f], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
    if offload:
        if name not in ("adam", "adamw"):
            raise CompositionError(f"DeepSpeed optimizer offload needs adam or adamw (DeepSpeedCPUAdam), got {name}")
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt: torch.optim.Optimizer = DeepSpeedCPUAdam(
            groups, lr=lr, betas=(hp["b1"], hp["b2"]), eps=hp["eps"], weight_decay=wd, adamw_mode=name == "adamw"
        )
    elif name == "adamw":
        opt = torch.optim.AdamW(groups, lr=lr, betas=(hp["b1"], hp["b2"]), eps=hp["eps"], weight_decay=wd)
    elif name == "adam":
        opt = torch.optim.Adam(groups, lr=lr, betas=(hp["b1"], hp["b2"]), eps=hp["eps"], weight_decay=wd)
    elif name == "sgd":
        opt = torch.optim.SGD(groups, lr=lr, momentum=hp["momentum"], nesterov=hp["nesterov"], weight_decay=wd)
    else:
        raise CompositionError(f"shard(backend='deepspeed') supports the optimizers adamw, adam and sgd, not {name}")
    return opt, schedule


def _lambda_lr(schedule: Any) -> Any:
    def make(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: float(schedule(torch.tensor(k, dtype=torch.int64))))

    return make


# ---- lowering -----------------------------------------------------------------------------------------------------
@attrs.define
class DeepSpeedRun:
    """The lowered DeepSpeed step: the engine, its data-parallel group and the config it runs with."""

    engine: Any
    group: dist.ProcessGroup | None
    world: int
    config: dict[str, Any]
    fp16: bool
    loss_has_count: bool | None = None  # does loss_fn return an af.Loss? (learnt on the first call)


def engine_of(step: Step) -> Any:
    """The `deepspeed.DeepSpeedEngine` of an initialised DeepSpeed step (for `save_checkpoint` & co.)."""
    run = step.plan.backend
    if not isinstance(run, DeepSpeedRun):
        raise ValueError("engine_of(step): the step was not lowered with af.shard(..., backend='deepspeed')")
    return run.engine


def lower_deepspeed(shard: Shard, plan: Plan) -> None:
    try:
        import deepspeed
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"af.shard(backend='deepspeed') needs DeepSpeed: pip install 'accelfn[deepspeed]' ({e})"
        ) from None
    if plan.kind != "train":
        raise ValueError("af.shard(backend='deepspeed') applies to training steps; shard eval steps with backend='torch'")
    if not plan.donate:
        raise ValueError("af.shard(backend='deepspeed') updates the engine's parameters in place: use donate=True")
    mesh = shard.mesh
    if mesh.data_size != mesh.world_size:
        raise ValueError(
            f"af.shard(backend='deepspeed') runs data-parallel over all {mesh.world_size} processes, but the mesh's "
            f"data axes {mesh.data_axes} cover {mesh.data_size}: use a mesh like af.Mesh({{'dp': -1}})"
        )
    assert plan.optimizer is not None
    settings = Settings(
        zero_stage=shard.zero_stage, strategy=shard.strategy, offload_optimizer=shard.offload_optimizer,
        microbatches=plan.microbatches, autocast_dtype=plan.autocast_dtype, loss_scale=plan.loss_scale,
        clip_grad_norm=plan.clip_grad_norm, optimizer=plan.optimizer, user_config=load_user_config(shard.ds_config),
    )  # fmt: skip
    config = build_config(settings)
    offload = _get(config, "zero_optimization.offload_optimizer.device") in ("cpu", "nvme")

    module = plan.module.to(mesh.device)
    with torch.no_grad():  # every rank starts from rank 0's weights, as with backend="torch"
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)
    named = {n: p for n, p in module.named_parameters() if p.requires_grad}
    if not named:
        raise ValueError("Step.init(): the model has no trainable parameters (all requires_grad=False)")
    optimizer, schedule = make_optimizer(plan.optimizer, named, offload=offload)
    engine, *_ = deepspeed.initialize(
        model=module, optimizer=optimizer, config=config, dist_init_required=False,
        lr_scheduler=_lambda_lr(schedule) if schedule is not None else None,
    )  # fmt: skip

    plan.backend = DeepSpeedRun(engine, None, dist.get_world_size(), config, bool(config["fp16"].get("enabled")))
    plan.module = engine.module
    plan.autocast_device_type = mesh.device_type
    plan.loss_scale = None  # DeepSpeed keeps the fp16 loss scale itself
    plan.batch_transform = batch_transform(mesh, shard.inputs)
    plan.rank_key = mesh.data_rank
    plan.train_override = _train
    plan.opt_state_init = lambda _params: DeepSpeedState(
        torch.zeros((), dtype=torch.int64), torch.tensor(_current_lr(engine), dtype=torch.float32)
    )
    zero = config["zero_optimization"]
    plan.notes.append(
        f"deepspeed ZeRO-{zero['stage']}{' + optimizer offload' if offload else ''} over {mesh.world_size} ranks"
    )


def _current_lr(engine: Any) -> float:
    return float(engine.optimizer.param_groups[0]["lr"])


# ---- the step ---------------------------------------------------------------------------------------------------
def _train(plan: Plan, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
    from ... import random as _random

    run: DeepSpeedRun = plan.backend
    engine = run.engine
    assert plan.loss_call is not None and plan.slots is not None
    first_name = next(iter(plan.slots.trainable))
    if state.params.get(first_name) is not engine.module.get_parameter(first_name):
        raise ValueError(
            "a DeepSpeed step updates its engine's parameters in place: pass the state returned by step.init() "
            "or by the previous call (or by af.checkpoint.load(path, like=that state))"
        )
    if plan.batch_transform is not None:
        batch = plan.batch_transform(batch)
    if not engine.training:
        engine.train()
    keys = _random.split(state.rng, 2)
    step_key = _random.fold_in(keys[1], plan.rank_key or 0)
    micro = [batch] if plan.microbatches == 1 else split_batch(batch, plan.microbatches, plan.uneven)
    n = len(micro)
    device = plan.devices[0] if plan.devices else torch.device("cpu")

    def forward(i: int, grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
        key = step_key if n == 1 else _random.fold_in(step_key, i)
        with _random.seeded(key, plan.devices), plan.forward_context(), torch.set_grad_enabled(grad):
            out = plan.loss_call(engine, micro[i])  # type: ignore[misc]
        total, count, aux = loss_parts(out)
        if grad and not total.requires_grad:
            raise ValueError(
                "the loss does not depend on any trainable parameter: loss_fn must compute it from `model`, "
                "the module it receives (not another copy of the network)"
            )
        return total, count, aux

    def global_sum(values: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.stack([v.detach().to(device, torch.float64).reshape(()) for v in values])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=run.group)
        return flat

    # The divisor (the global count) must be known before the first backward. One micro-batch: its forward
    # gives it. Several: a mean loss counts rows (known now); an af.Loss counts in the forward, so a
    # forward without gradients counts each micro-batch first (running all forwards with gradients before
    # the backwards would keep every micro-batch's activations, and ZeRO-3 does not support that order).
    first = forward(0) if n == 1 else None
    if n > 1 and run.loss_has_count is None:
        run.loss_has_count = forward(0, grad=False)[1] is not None
    has_count = first[1] is not None if first is not None else bool(run.loss_has_count)
    if not has_count:
        counts: list[torch.Tensor | None] = [torch.tensor(float(_rows(mb))) for mb in micro]
    elif first is not None:
        counts = [first[1]]
    else:
        counts = [forward(i, grad=False)[1] for i in range(n)]
        if any(c is None for c in counts):
            raise ValueError("loss_fn returned an af.Loss for some micro-batches and a scalar for others")
    global_count = global_sum([sum((c.detach().float().cpu() for c in counts if c is not None), torch.zeros(()))])[0]
    inv = run.world / global_count.clamp_min(1).item()

    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    aux_sum: dict[str, torch.Tensor] = {}
    skipped_before = engine.skipped_steps
    lr = _current_lr(engine)  # the learning rate this update uses
    for i in range(n):
        total, count, aux = first if first is not None else forward(i)
        if (count is not None) != has_count:
            raise ValueError("loss_fn returned an af.Loss for some micro-batches and a scalar for others")
        if count is None:
            total = total * counts[i].to(total)  # type: ignore[union-attr]
        elif n > 1 and not torch.equal(count.detach().cpu().float(), counts[i].detach().cpu().float()):  # type: ignore[union-attr]
            raise ValueError(
                f"micro-batch {i}: the loss count changed between the counting forward ({float(counts[i])}) and the "  # type: ignore[arg-type]
                f"training forward ({float(count)}); a Loss count must depend on the batch only"
            )
        loss_sum += total.detach().to(torch.float64)
        for k, v in aux.items():
            if isinstance(v, torch.Tensor):
                aux_sum[k] = v.detach().float() if k not in aux_sum else aux_sum[k] + v.detach().float()
        engine.backward(total * inv, scale_wrt_gas=False)
        engine.step()

    scalars = global_sum([loss_sum, *aux_sum.values()])
    metrics: dict[str, torch.Tensor] = {"loss": (scalars[0] / global_count.clamp_min(1)).to(torch.float32)}
    metrics.update(
        {k: (v / (n * run.world)).to(torch.float32) for k, v in zip(aux_sum, scalars[1:].unbind(0))}
    )
    skipped = engine.skipped_steps != skipped_before
    if run.fp16:
        metrics["skipped"] = torch.tensor(float(skipped))
        metrics["loss_scale"] = torch.tensor(float(engine.optimizer.loss_scale))
    if run.config.get("gradient_clipping"):
        norm = engine.get_global_grad_norm()
        if norm is not None:
            metrics["grad_norm"] = torch.as_tensor(norm, dtype=torch.float32).reshape(())
    metrics["lr"] = torch.tensor(lr, dtype=torch.float32)
    opt_state = state.opt_state
    if isinstance(opt_state, DeepSpeedState) and not skipped:
        opt_state = DeepSpeedState(opt_state.count + 1, metrics["lr"])
    new_state = TrainState(
        step=state.step + 1, params=state.params, buffers=read_buffers(plan.slots), opt_state=opt_state,
        rng=keys[0], extra=state.extra,
    )  # fmt: skip
    return new_state, metrics


def _register_checkpoint_adapter() -> None:
    from ...checkpoint import adapters
    from .deepspeed_state import DeepSpeedStateAdapter

    adapters.register(DeepSpeedState, DeepSpeedStateAdapter())


_register_checkpoint_adapter()


def _rows(batch: Any) -> int:
    from ... import tree as _tree

    leaves = _tree.leaves(batch)
    return int(leaves[0].shape[0]) if leaves and leaves[0].dim() > 0 else 1
