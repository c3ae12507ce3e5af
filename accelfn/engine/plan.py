"""`Plan`: what a lowered step needs at run time, filled in once by the combinators' lowering.

Who sets what (each field is written by one stage of `accelfn.lowering`, in its order, and by no one after
`finalize`, which freezes the plan):

| fields                                                        | set by                              |
|---------------------------------------------------------------|-------------------------------------|
| module, kind, fn, optimizer, clip_grad_norm, donate, device    | `Step.init` (from the step)         |
| microbatches, uneven, sync_each_microbatch                     | `af.accumulate`                     |
| autocast_dtype, loss_scale                                     | `af.autocast`                       |
| fp8_skipped, after_update (fp8 scale refresh)                  | `af.autocast_fp8`                   |
| forward_contexts, backward_contexts                            | fp8 (TE), tp (loss parallel), cp, remat (budget), compile (blocks) |
| grad_sync, batch_transform, rank_key                           | `af.shard` (its strategy; cp wraps the batch transform) |
| loss_call                                                      | `af.compile` (whole-step)           |
| updater                                                        | `af.offload`                        |
| notes, transforms, stages                                      | every stage / `lower`               |
| slots, devices, input_device, autocast_device_type, update_on_shards | `finalize` (derived from the module) |
| opt_state_type                                                 | `Step.init` (after the optimizer's init) |
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from torch import nn

from ..module import Slots, slots_of
from ..optim import GradientTransformation
from ..state import TrainState
from .contract import LOCAL, GradSync, Updater

__all__ = ["Plan", "LossScaleConfig", "init_loss_scale", "exclusive"]

LossFn = Callable[[nn.Module, Any], Any]


@attrs.frozen
class LossScaleConfig:
    """Dynamic loss scaling for fp16 (same defaults as `torch.amp.GradScaler`).

    Example:
        >>> import torch, accelfn as af
        >>> cfg = af.LossScaleConfig(init_scale=1024.0, growth_interval=100)
        >>> base = af.train_step(lambda m, b: m(b).float().sum(), af.optim.sgd(0.1))
        >>> af.autocast(base, "fp16", loss_scale=cfg).init(torch.nn.Linear(2, 1)).extra["loss_scale"]["scale"].item()
        1024.0
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


@attrs.define(eq=False)  # identity semantics: plans are tracked in a WeakSet
class Plan:
    """Everything a lowered step needs at run time. Built by `Step.init`, filled in by the combinators' lowering
    (the module docs say which stage sets which field), frozen by `finalize`."""

    module: nn.Module
    kind: str
    fn: LossFn
    optimizer: GradientTransformation | None = None
    clip_grad_norm: float | None = None
    donate: bool = True
    microbatches: int = 1
    uneven: bool = False
    # FSDP/HSDP under accumulation: reduce-scatter every micro-batch's gradients (None: the strategy's default)
    sync_each_microbatch: bool | None = None
    autocast_dtype: torch.dtype | None = None
    autocast_device_type: str = "cpu"
    loss_scale: LossScaleConfig | None = None
    forward_contexts: list[Callable[[], contextlib.AbstractContextManager[Any]]] = attrs.Factory(list)
    # entered around each backward too (tensor parallel's loss_parallel: the loss's backward on vocabulary shards)
    backward_contexts: list[Callable[[], contextlib.AbstractContextManager[Any]]] = attrs.Factory(list)
    grad_sync: GradSync | None = None
    loss_call: LossFn | None = None
    updater: Updater | None = None
    after_update: list[Callable[[nn.Module], None]] = attrs.Factory(list)
    batch_transform: Callable[[Any], Any] | None = None
    rank_key: int | None = None
    notes: list[str] = attrs.Factory(list)
    transforms: list[Any] = attrs.Factory(list)
    stages: list[tuple[str, tuple[str, ...]]] = attrs.Factory(
        list
    )  # (combinator, its notes), in lowering order
    slots: Slots | None = None
    devices: list[torch.device] = attrs.Factory(list)
    opt_state_type: type | None = None  # what `init` built: a state from another step is refused
    # Where the model computes once lowered: the mesh's device under `af.shard` (a model built on the host is
    # moved there at lowering), else the model's own device. Known *before* the transforms lower, so that every
    # device-dependent decision (fp8 support, TE, autocast's device type, pinning) sees the device the model will
    # run on, not the host it was built on.
    device: torch.device = attrs.Factory(lambda: torch.device("cpu"))
    input_device: torch.device | None = None  # where host batch tensors are moved (None: left where they are)
    fp8_skipped: dict[str, str] = attrs.Factory(
        dict
    )  # Linear layers autocast_fp8 kept in high precision, and why
    # trainable params mixing DTensors with plain tensors (tensor parallel), or DTensors of several meshes (fsdp x tp
    # without sequence parallel): the update runs on local shards
    update_on_shards: bool = False
    _frozen: bool = attrs.field(default=False, init=False, repr=False)

    @property
    def platform(self) -> Any:
        """The `af.platforms.Platform` of `device`."""
        from .. import platforms

        try:
            return platforms.for_device(self.device)
        except ValueError:
            return platforms.get("cpu")

    def finalize(self) -> None:
        """Record where the (possibly rewritten) module's tensors live. Called after lowering."""
        self.slots = slots_of(self.module)
        named = dict(self.module.named_parameters())
        # one multi-tensor kernel takes DTensors of one mesh only: fsdp x tp without sequence parallel leaves the
        # norms on the fsdp mesh beside the tp-split weights on the 2-D one
        meshes = {getattr(named[n], "device_mesh", None) for n in self.slots.trainable if n in named}
        self.update_on_shards = len(meshes) > 1
        tensors = [*self.module.parameters(), *self.module.buffers()]
        self.devices = sorted({t.device for t in tensors}, key=str)
        computing = [d for d in self.devices if d.type != "meta"]
        # one device holds the whole model: batches go there (a model spread over devices by a device map moves
        # its inputs itself, through its hooks)
        self.input_device = computing[0] if len(computing) == 1 else None
        if self.autocast_dtype is not None:  # autocast where the (lowered, possibly moved) model computes
            kinds = {d.type for d in computing} - {"cpu"}
            self.autocast_device_type = (
                kinds.pop() if len(kinds) == 1 else self.platform.autocast_device_type if not kinds else "cpu"
            )
        if self.loss_call is None:
            self.loss_call = self.fn
        if self.kind == "train":
            _TRAINING.add(self)
        self._frozen = True

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False) and name != "opt_state_type":
            raise AttributeError(
                f"Plan.{name}: a lowered plan is frozen (combinators set its fields while lowering, before finalize)"
            )
        object.__setattr__(self, name, value)

    @property
    def sync(self) -> GradSync:
        """The gradient sync the engine calls (a world of one's when the step is not sharded)."""
        return self.grad_sync if self.grad_sync is not None else LOCAL

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.autocast_dtype is not None:
                stack.enter_context(torch.autocast(self.autocast_device_type, dtype=self.autocast_dtype))
            for make in self.forward_contexts:
                stack.enter_context(make())
            yield


# ---- several models ---------------------------------------------------------------------------------------
_TRAINING: weakref.WeakSet[Plan] = weakref.WeakSet()  # the lowered training steps of this process


@contextlib.contextmanager
def exclusive(plan: Plan, state: TrainState | None = None) -> Iterator[None]:
    """While `plan` runs, the trainable params of the process's *other* training steps stop requiring grad.

    A loss may use another step's model (a GAN's discriminator, a teacher): its parameters then get no
    gradient and fire none of their hooks (DDP buckets, DeepSpeed ZeRO reductions), while gradients still
    flow through it to this step's params. Free when there is only one training step. A `state` whose params
    are another step's (its `init` made it) is refused: this step would train that step's model.
    """
    if len(_TRAINING) < 2:
        yield
        return
    own = {id(p) for p in plan.module.parameters()}
    frozen = [
        p
        for other in list(_TRAINING)
        if other is not plan
        for p in other.module.parameters()
        if p.requires_grad and id(p) not in own
    ]
    if state is not None and frozen:
        theirs = {id(p) for p in frozen}
        foreign = [n for n, t in state.params.items() if id(t) in theirs]
        if foreign:
            raise ValueError(
                f"this state belongs to another training step: its params {foreign[:3]} are that step's model's "
                "(the step whose init made the state). Pass this step's own state (from its init), or a copy of "
                "the other (`af.tree.map(torch.clone, state)`) to start from its values"
            )
    for p in frozen:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)


def init_loss_scale(cfg: LossScaleConfig) -> dict[str, torch.Tensor]:
    return {
        "scale": torch.tensor(cfg.init_scale, dtype=torch.float32),
        "good_steps": torch.zeros((), dtype=torch.int64),
    }
