"""The DeepSpeed config and torch optimizer that a step's combinators ask for (no `deepspeed` import here)."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .... import platforms
from ....engine.plan import LossScaleConfig
from ....lowering import CompositionError
from ....optim import GradientTransformation
from ....optim._kernels import mask_leaves
from ....optim.schedules import as_schedule
from ..._base import find
from .types import Settings

if TYPE_CHECKING:
    from ....step import Step

__all__ = [
    "STRATEGY_STAGE",
    "zero_stage_of",
    "build_config",
    "config_for",
    "load_user_config",
    "make_optimizer",
    "split_optimizer",
]

STRATEGY_STAGE = {"ddp": 1, "fsdp": 3}
_NOMINAL_MICRO_BATCH = 1  # DeepSpeed needs one; it only uses it for its own data loader and logs


# ---- configuration ----------------------------------------------------------------------------------------------
def load_user_config(ds_config: Mapping[str, Any] | str | Path | None) -> dict[str, Any] | None:
    """A copy of the user's DeepSpeed config (a dict, or the path of a JSON file)."""
    if ds_config is None:
        return None
    if isinstance(ds_config, (str, Path)):
        path = Path(ds_config)
        if not path.is_file():
            raise FileNotFoundError(
                f"shard(backend='deepspeed'): ds_config file {str(path)!r} does not exist"
            )
        with path.open() as f:
            loaded = json.load(f)
        if not isinstance(loaded, dict):
            raise ValueError(
                f"shard(backend='deepspeed'): {str(path)!r} holds a {type(loaded).__name__}, not a JSON object"
            )
        return loaded
    return copy.deepcopy(dict(ds_config))


def zero_stage_of(shard: Any) -> int:
    """The ZeRO stage an `af.shard(..., backend="deepspeed")` transform runs (as `build_config` resolves it:
    `zero_stage`, else the user's `ds_config`, else its strategy's), known before its lowering.

    Example:
        >>> import accelfn as af
        >>> mesh = af.Mesh({"dp": -1}, device="cpu")
        >>> step = af.shard(af.train_step(lambda m, b: m(b).sum(), af.optim.adamw(1e-3)), mesh, strategy="zero3")
        >>> zero_stage_of(step.transforms[-1])
        3
        >>> mesh.close()
    """
    if shard.zero_stage is not None:
        return int(shard.zero_stage)
    user = load_user_config(shard.ds_config) or {}
    return int(user.get("zero_optimization", {}).get("stage", STRATEGY_STAGE[shard.strategy]))


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

    for key, what in (
        ("optimizer", "the step's optimizer"),
        ("scheduler", "the optimizer's learning-rate schedule"),
    ):
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
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": settings.pin_memory}
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
        "zero_optimization.offload_optimizer.device": (
            "cpu" if offload else "none",
            f"offload_optimizer={offload}",
        ),
    }
    for dotted, (want, who) in decided.items():
        have = _get(user, dotted)
        if have is None or have == "auto":
            continue
        if dotted == "zero_optimization.offload_optimizer.device" and (have in ("cpu", "nvme")) == bool(
            offload
        ):
            continue
        if have != want:
            raise CompositionError(
                f"ds_config[{dotted!r}] = {have!r} conflicts with {who} (which needs {want!r})"
            )
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
    shard = find(step.transforms, "shard")
    if shard is None or shard.backend != "deepspeed":
        raise ValueError("config_for(step): the step has no af.shard(..., backend='deepspeed')")
    acc, cast = find(step.transforms, "accumulate"), find(step.transforms, "autocast")
    return build_config(
        Settings(
            zero_stage=shard.zero_stage, strategy=shard.strategy, offload_optimizer=shard.offload_optimizer,
            microbatches=acc.microbatches if acc is not None else 1,
            autocast_dtype=cast.dtype if cast is not None else None,
            loss_scale=(cast.loss_scale or LossScaleConfig()) if cast is not None and cast.dtype == torch.float16 else None,
            clip_grad_norm=step.clip_grad_norm, optimizer=step.optimizer, user_config=load_user_config(shard.ds_config),
            pin_memory=platforms.pins_host_copies(shard.mesh.device),
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
            raise CompositionError(
                f"DeepSpeed optimizer offload needs adam or adamw (DeepSpeedCPUAdam), got {name}"
            )
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt: torch.optim.Optimizer = DeepSpeedCPUAdam(
            groups,
            lr=lr,
            betas=(hp["b1"], hp["b2"]),
            eps=hp["eps"],
            weight_decay=wd,
            adamw_mode=name == "adamw",
        )
    elif name == "adamw":
        opt = torch.optim.AdamW(groups, lr=lr, betas=(hp["b1"], hp["b2"]), eps=hp["eps"], weight_decay=wd)
    elif name == "adam":
        opt = torch.optim.Adam(groups, lr=lr, betas=(hp["b1"], hp["b2"]), eps=hp["eps"], weight_decay=wd)
    elif name == "sgd":
        opt = torch.optim.SGD(
            groups, lr=lr, momentum=hp["momentum"], nesterov=hp["nesterov"], weight_decay=wd
        )
    else:
        raise CompositionError(
            f"shard(backend='deepspeed') supports the optimizers adamw, adam and sgd, not {name}"
        )
    return opt, schedule


def _lambda_lr(schedule: Any) -> Any:
    def make(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda k: float(schedule(torch.tensor(k, dtype=torch.int64)))
        )

    return make
