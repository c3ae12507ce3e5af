"""Lowering: turn a step's recorded combinators into one concrete `Plan`, in one canonical order.

Users write combinators in any order — `shard(accumulate(step, 4), mesh)` and
`accumulate(shard(step, mesh), 4)` mean the same thing. Each combinator records a `Transform`; at
`step.init(model)` the transforms are sorted by `order` and applied once to the model and the plan.
The order of model rewrites is fixed, as in torchtitan's `parallelize`:

    fp8 layer swap (10) -> tensor parallel (20) -> activation checkpointing (30)
        -> compile regions (40) -> FSDP/DDP wrapping (50) -> context parallel (55) -> offload (60)

(20 is `af.shard`'s tensor parallel over a `tp` mesh axis, 30 is `af.remat`, 55 `af.shard`'s sequence split
over a `cp` axis: it wraps the batch transform FSDP/DDP set, and the attention.)

Run-time settings (accumulate, autocast) have no model rewrite and come first (order < 10). Before
anything runs, every transform checks the others and raises `CompositionError` naming both sides of an
impossible combination (e.g. fp16 autocast with fp8).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .engine import Plan
    from .state import TrainState

__all__ = ["Transform", "CompositionError", "ORDER", "canonical", "lower"]

ORDER = {
    "accumulate": 1,
    "autocast": 2,
    "fp8": 10,
    "tensor_parallel": 20,
    "activation_checkpointing": 30,
    "compile": 40,
    "shard": 50,
    "context_parallel": 55,
    "offload": 60,
}


class CompositionError(ValueError):
    """Two combinators cannot be used together (the message names both).

    Example:
        >>> import accelfn as af
        >>> base = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1))
        >>> try:
        ...     af.autocast(af.autocast(base, "bf16"), "fp16")
        ... except af.CompositionError as e:
        ...     print(e)
        autocast(float16) and autocast(bfloat16): each combinator may be applied once
    """


@runtime_checkable
class Transform(Protocol):
    """What a combinator records. `kind` is a key of `ORDER`."""

    @property
    def kind(self) -> str:
        """The combinator's name, a key of `ORDER`."""
        ...

    def describe(self) -> str:
        """Short text for `repr(step)`, e.g. `accumulate(4)`."""
        ...

    def check(self, others: Sequence[Transform]) -> None:
        """Raise `CompositionError` if this transform cannot be combined with one of `others`."""
        ...

    def lower(self, plan: Plan) -> None:
        """Apply this transform to the plan (rewrite `plan.module`, set run-time options)."""
        ...

    def init_state(self, plan: Plan, state: TrainState) -> TrainState:
        """Adjust the initial state: add `extra` entries (loss scale), place or shard tensors."""
        ...


def canonical(transforms: Sequence[Transform]) -> list[Transform]:
    """The transforms in the canonical order (stable for equal kinds, which `check` forbids anyway)."""
    return sorted(transforms, key=lambda t: ORDER[t.kind])


def lower(plan: Plan, transforms: Sequence[Transform]) -> Plan:
    """Check all transforms against each other, then apply them to `plan` in the canonical order."""
    seen: dict[str, Transform] = {}
    for t in transforms:
        if t.kind in seen:
            raise CompositionError(f"{t.describe()} and {seen[t.kind].describe()}: each combinator may be applied once")
        seen[t.kind] = t
    for t in transforms:
        t.check([o for o in transforms if o is not t])
    plan.transforms = canonical(transforms)
    for t in plan.transforms:
        t.lower(plan)
    return plan
