"""`Step`: a training (or evaluation) step `(state, batch) -> (state, metrics)`, and its constructors.

`loss_fn(model, batch)` receives the module bound to the state's params and buffers. Gradients come from
ordinary autograd; the optimizer updates the params in place (the input state is donated). Combinators
(`af.accumulate`, `af.autocast`, `af.shard`, ...) return new steps that record what they want; the step
is lowered once, at `init` (see `accelfn.lowering`).

Example:
    >>> import torch, accelfn as af
    >>> net = torch.nn.Linear(4, 1)
    >>> step = af.train_step(lambda m, b: af.losses.mse(m(b["x"]), b["y"]), af.optim.sgd(0.1))
    >>> state = step.init(net, seed=0)
    >>> state, metrics = step(state, {"x": torch.ones(8, 4), "y": torch.zeros(8, 1)})
    >>> int(state.step), sorted(metrics)
    (1, ['loss', 'lr'])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from . import dry_mode
from . import random as _random
from ._typecheck import checked
from .engine import Plan, check_batch, loss_parts, run_eval, run_train
from .lowering import CompositionError, Transform, canonical, lower
from .materialize import has_meta, materialize, seeding
from .module import bind, partition
from .optim import GradientTransformation
from .state import TrainState, check_not_donated, mark_donated

__all__ = ["Step", "train_step", "eval_step", "check_batch", "loss_parts"]

LossFn = Callable[[nn.Module, Any], Any]


def target_device(model: nn.Module, transforms: Sequence[Transform]) -> torch.device:
    """Where `model` will compute once lowered: the mesh's device under `af.shard` (which moves it there), else the
    device holding its tensors (the host when they are spread out or still on the meta device)."""
    shard = next((t for t in transforms if t.kind == "shard"), None)
    mesh = getattr(shard, "mesh", None)
    if mesh is not None:
        return mesh.device
    devices = {t.device for t in [*model.parameters(), *model.buffers()]} - {torch.device("meta")}
    return devices.pop() if len(devices) == 1 else torch.device("cpu")


class Step:
    """A step function with its configuration; build with `af.train_step` / `af.eval_step`.

    `init(model, seed=0)` lowers the step for `model` and returns the initial `TrainState`; calling the
    step runs it. Combinators return new `Step`s; the original is left unchanged.

    Example:
        >>> import torch, accelfn as af
        >>> step = af.accumulate(af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)), 2)
        >>> state = step.init(torch.nn.Linear(3, 1), seed=0)
        >>> state, metrics = step(state, torch.randn(4, 3))
        >>> int(state.step), sorted(metrics)
        (1, ['loss', 'lr'])
    """

    def __init__(
        self,
        kind: str,
        fn: LossFn,
        optimizer: GradientTransformation | None = None,
        *,
        clip_grad_norm: float | None = None,
        donate: bool = True,
        transforms: Sequence[Transform] = (),
    ) -> None:
        self.kind = kind
        self.fn = fn
        self.optimizer = optimizer
        self.clip_grad_norm = clip_grad_norm
        self.donate = donate
        self.transforms: tuple[Transform, ...] = tuple(transforms)
        self._plan: Plan | None = None

    def with_transform(self, transform: Transform) -> Step:
        """A new step with `transform` recorded (used by the combinators)."""
        for t in self.transforms:
            if t.kind == transform.kind:
                raise CompositionError(
                    f"{transform.describe()} and {t.describe()}: each combinator may be applied once"
                )
        return Step(
            self.kind,
            self.fn,
            self.optimizer,
            clip_grad_norm=self.clip_grad_norm,
            donate=self.donate,
            transforms=(*self.transforms, transform),
        )

    # ---- set-up ---------------------------------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        """The module this step runs (after `init`; possibly rewritten by combinators, e.g. fp8 layers)."""
        return self.plan.module

    @property
    def plan(self) -> Plan:
        """The lowered plan (after `init`)."""
        if self._plan is None:
            raise RuntimeError("this step has no model yet: call `state = step.init(model)` first")
        return self._plan

    def init(self, model: nn.Module | TrainState, *, seed: int = 0) -> TrainState:
        """Lower the step for `model` and return its initial state (params are the module's own tensors).

        Given a `TrainState` instead (e.g. a loaded checkpoint), binds it to the model set earlier. A model built
        on the meta device (`af.init_empty()`) is sharded first; then only this rank's shards are allocated and
        initialised by the modules' own init rules, from `seed` (`accelfn.materialize`).
        """
        if isinstance(model, TrainState):
            bind(self.model, model.params, model.buffers, self.plan.slots)
            return model
        if not isinstance(model, nn.Module):
            raise TypeError(f"Step.init(): expected an nn.Module or a TrainState, got {type(model).__name__}")
        if self.kind == "eval":
            from .stages import is_carved

            if is_carved(model):
                raise ValueError(
                    "eval_step: this model is cut into pipeline stages (af.pipeline); this rank holds only its "
                    "stages, so its forward is not the model's. Evaluate with the training step's loss on held-out "
                    "batches (a step with a zero learning rate), or load the checkpoint into a whole model"
                )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"Step.init(): seed must be an int, got {type(seed).__name__}")
        watcher = dry_mode.active()
        if watcher is not None:
            return watcher.init_call(self, model, lambda: self._init(model, seed))  # type: ignore[no-any-return]
        return self._init(model, seed)

    def _init(self, model: nn.Module, seed: int) -> TrainState:
        plan = Plan(
            module=model,
            kind=self.kind,
            fn=self.fn,
            optimizer=self.optimizer,
            clip_grad_norm=self.clip_grad_norm,
            donate=self.donate,
        )
        plan.device = target_device(model, self.transforms)
        if self.kind == "train":
            from . import platforms

            platforms.tune_allocator(plan.device)  # e.g. the host's: training-size tensors stay in the heap
        with seeding(seed):  # a model on the meta device is initialised from `seed` (accelfn.materialize)
            lower(plan, self.transforms)
        if has_meta(plan.module):  # built on the meta device, not materialised by a sharding strategy
            materialize(plan.module, plan.device, seed)
        plan.finalize()
        if self.kind == "train":
            _warn_unused_precision_flag(self.transforms)
            _warn_unsharded_under_launch(self.transforms)
        self._plan = plan
        assert plan.slots is not None
        params, buffers = partition(plan.module)
        opt_state: Any = ()
        if self.optimizer is not None:
            if not plan.slots.trainable:
                raise ValueError(
                    "Step.init(): the model has no trainable parameters (all requires_grad=False)"
                )
            trainable = (
                params
                if len(plan.slots.trainable) == len(params)
                else {n: params[n] for n in plan.slots.trainable}
            )
            opt_state = plan.sync.init_opt_state(
                trainable
            )  # a backend's own (DeepSpeed's), else the optimizer's
            if opt_state is None:
                opt_state = self.optimizer.init(trainable)
            plan.opt_state_type = type(opt_state)
        state = TrainState(
            step=torch.zeros((), dtype=torch.int64),
            params=params,
            buffers=buffers,
            opt_state=opt_state,
            rng=_random.key(seed),
        )
        for t in canonical(self.transforms):
            state = t.init_state(plan, state)
        return state

    # ---- running ----------------------------------------------------------------------------------------------
    def __call__(self, state: TrainState, batch: Any) -> Any:
        if not isinstance(state, TrainState):
            raise TypeError(
                f"a step takes (state: af.TrainState, batch), got state of type {type(state).__name__}"
            )
        plan = self.plan
        batch = check_batch(batch)  # a Mapping (BatchEncoding) becomes a dict
        if self.kind == "eval":
            check_not_donated(state, "an eval step")
            _debug_check_step(state, "eval step")
            return run_eval(plan, state, batch)
        check_not_donated(state)
        if plan.grad_sync is not None:
            _debug_check_step(state)
        watcher = dry_mode.active()
        if watcher is not None:
            out = watcher.train_call(self, state, batch, lambda: run_train(plan, state, batch))
        else:
            out = run_train(plan, state, batch)
        if plan.donate and out[0] is not state:
            mark_donated(state)
        return out

    def __str__(self) -> str:
        """After `init`: the lowered step (mesh, strategy, each combinator in lowering order and what it did, the
        dtype of each phase); before: the same line as `repr`."""
        if self._plan is None:
            return repr(self)
        from .lowering import describe

        return describe(self._plan, repr(self))

    def __repr__(self) -> str:
        fn = getattr(self.fn, "__qualname__", repr(self.fn))
        if self.kind == "eval":
            base = f"eval_step({fn})"
        else:
            extra = f", clip_grad_norm={self.clip_grad_norm}" if self.clip_grad_norm is not None else ""
            extra += ", donate=False" if not self.donate else ""
            base = f"train_step({fn}{extra})"
        parts = [base] + [t.describe() for t in canonical(self.transforms)]
        text = " -> ".join(parts)
        if self._plan is not None and self._plan.notes:
            text += "  [" + "; ".join(self._plan.notes) + "]"
        return f"Step({text})"


def _warn_unused_precision_flag(transforms: Sequence[Transform]) -> None:
    """`accelfn launch --mixed-precision X` reaches a step through `af.autocast(step)` (dtype "auto") or
    `af.autocast_fp8`; say so when a step has neither (Accelerate applies its flag to every forward)."""
    import os
    import warnings

    from .launch_env import ACCELFN_MIXED_PRECISION

    wanted = os.environ.get(ACCELFN_MIXED_PRECISION, "no")
    if wanted in ("", "no") or any(t.kind in ("autocast", "fp8") for t in transforms):
        return
    how = (
        "af.autocast_fp8(step)" if wanted == "fp8" else "af.autocast(step) (its dtype 'auto' reads the flag)"
    )
    warnings.warn(
        f"ACCELFN_MIXED_PRECISION={wanted} (accelfn launch --mixed-precision) has no effect on this step: it has no "
        f"autocast combinator, so it computes in its params' dtype. Wrap it: {how}",
        UserWarning,
        stacklevel=4,  # the caller of Step.init
    )


# the transforms that make processes train one model together
_DISTRIBUTED = ("shard", "pipeline", "tensor_parallel", "context_parallel", "expert_parallel")


def _warn_unsharded_under_launch(transforms: Sequence[Transform]) -> None:
    """`accelfn launch` started several processes, but this training step has no `af.shard` (nor another
    parallelism): each process trains its own copy and they never sync; say so once, on rank 0 (Accelerate's
    `prepare` wraps the model in DDP whatever the script says; here the script says it)."""
    import os
    import warnings

    from .launch_env import ACCELFN_LAUNCHED

    world = os.environ.get("WORLD_SIZE", "1")
    if (
        os.environ.get(ACCELFN_LAUNCHED) != "1"
        or not world.isdigit()
        or int(world) < 2
        or os.environ.get("RANK", "0") != "0"
        or dry_mode.active() is not None
        or any(t.kind in _DISTRIBUTED for t in transforms)
    ):
        return
    warnings.warn(
        f"accelfn started {world} processes (accelfn launch, notebook_launch), but this training step has no "
        "af.shard: each process trains its own copy of the model on its own batches, and they never sync (their "
        "checkpoints to one path overwrite each other). Wrap it: af.shard(step, af.Mesh.from_env()); or launch one "
        "process",
        UserWarning,
        stacklevel=4,  # the caller of Step.init
    )


def _debug_check_step(state: TrainState, kind: str = "training step") -> None:
    """`ACCELFN_DEBUG=1`: the ranks of a sharded step compare their step numbers first, so a rank that runs a
    different number of steps (or an af.dist collective where the others train) fails on every rank instead of
    pairing its collectives with the others' gradient reduction (a hang or wrong numbers)."""
    from .collective import debug

    if not (
        debug.enabled() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    ):
        return
    if kind == "eval step" and not any(hasattr(p, "placements") for p in state.params.values()):
        return  # an unsharded model's forward runs no collective: an eval on one rank is fine
    debug.check("af.Step", f"{kind}, state.step={int(state.step)}")


@checked
def train_step(
    loss_fn: Callable[..., Any],
    optimizer: GradientTransformation,
    *,
    clip_grad_norm: float | None = None,
    donate: bool = True,
) -> Step:
    """A training step: `loss_fn(model, batch)` -> loss; gradients; optional clipping; optimizer update.

    `loss_fn` returns a scalar tensor (mean over its batch), an `af.Loss(total, count)`, or
    `(loss, aux_dict)`; `aux` tensors are added to the metrics. With `donate=False` the input state stays
    valid after the call (at the cost of a copy).

    Example:
        >>> import torch, accelfn as af
        >>> loss_fn = lambda m, b: af.losses.mse(m(b["x"]), b["y"])
        >>> step = af.train_step(loss_fn, af.optim.adamw(1e-3), clip_grad_norm=1.0)
        >>> state = step.init(torch.nn.Linear(3, 1))
        >>> state, metrics = step(state, {"x": torch.randn(8, 3), "y": torch.randn(8, 1)})
        >>> sorted(metrics)
        ['grad_norm', 'loss', 'lr']
    """
    if clip_grad_norm is not None and clip_grad_norm <= 0:
        raise ValueError(f"train_step: clip_grad_norm must be > 0, got {clip_grad_norm}")
    return Step("train", loss_fn, optimizer, clip_grad_norm=clip_grad_norm, donate=donate)


@checked
def eval_step(fn: Callable[..., Any]) -> Step:
    """An evaluation step: `fn(model, batch) -> outputs`, run in eval mode without gradients.

    Calling it returns `fn`'s outputs; the state is not changed.

    Example:
        >>> import torch, accelfn as af
        >>> train = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1))
        >>> state = train.init(torch.nn.Linear(3, 2))
        >>> evaluate = af.eval_step(lambda m, b: m(b).argmax(-1))
        >>> _ = evaluate.init(train.model)
        >>> evaluate(state, torch.randn(5, 3)).shape
        torch.Size([5])
    """
    return Step("eval", fn)
