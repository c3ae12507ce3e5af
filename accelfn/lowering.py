"""Lowering: turn a step's recorded combinators into one concrete `Plan`, in one canonical order.

Users write combinators in any order — `shard(accumulate(step, 4), mesh)` and
`accumulate(shard(step, mesh), 4)` mean the same thing. Each combinator records a `Transform`; at
`step.init(model)` the transforms are checked against each other, sorted by their place in `ORDER`, and
applied once to the model and the plan. `ORDER` is the whole order, in one list: run-time settings first
(accumulate, autocast: no model rewrite), then the model rewrites in torchtitan's `parallelize` order:

    fp8 layer swap -> pipeline stages -> tensor parallel -> activation checkpointing -> compile regions
        -> FSDP/DDP/DeepSpeed wrapping -> context parallel -> offload

(tensor parallel is `af.shard` over a `tp` mesh axis, activation checkpointing is `af.remat`, context parallel
`af.shard`'s sequence split over a `cp` axis: it wraps the batch transform the data-parallel strategy set, and
the attention.) Before anything runs, every transform checks the others and raises `CompositionError` naming
both sides of an impossible combination (e.g. fp16 autocast with fp8). Each stage's notes are recorded in
`Plan.stages`; `describe(plan)` prints the lowered step (`print(step)` after `init`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .engine import Plan
    from .state import TrainState

__all__ = ["Transform", "CompositionError", "ORDER", "canonical", "lower"]

# The canonical order: (kind, what it does). A new combinator is one entry here, where it must run.
ORDER: tuple[tuple[str, str], ...] = (
    ("accumulate", "split each batch into micro-batches"),
    ("autocast", "mixed precision of the forward"),
    ("fp8", "swap Linear layers for fp8 ones"),
    ("pipeline", "keep this rank's pipeline stages of the model"),
    ("tensor_parallel", "shard layers over the tp axis"),
    ("expert_parallel", "shard experts over the ep axis"),
    ("activation_checkpointing", "recompute blocks in the backward"),
    ("compile", "torch.compile the step or its blocks"),
    ("shard", "data-parallel strategy over the data axes"),
    ("context_parallel", "split sequences over the cp axis"),
    ("offload", "optimizer state and update on the host"),
)
_RANK = {kind: i for i, (kind, _) in enumerate(ORDER)}


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
    """What a combinator records. `kind` is one of the kinds of `ORDER`."""

    @property
    def kind(self) -> str:
        """The combinator's name, one of the kinds of `ORDER`."""
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
    for t in transforms:
        if t.kind not in _RANK:
            raise ValueError(
                f"transform {t.describe()} has kind {t.kind!r}, which has no place in lowering.ORDER"
            )
    return sorted(transforms, key=lambda t: _RANK[t.kind])


def lower(plan: Plan, transforms: Sequence[Transform]) -> Plan:
    """Check all transforms against each other, then apply them to `plan` in the canonical order, recording
    each stage's notes in `plan.stages`."""
    seen: dict[str, Transform] = {}
    for t in transforms:
        if t.kind in seen:
            raise CompositionError(
                f"{t.describe()} and {seen[t.kind].describe()}: each combinator may be applied once"
            )
        seen[t.kind] = t
    for t in transforms:
        t.check([o for o in transforms if o is not t])
    plan.transforms = canonical(transforms)
    for t in plan.transforms:
        before = len(plan.notes)
        t.lower(plan)
        plan.stages.append((t.describe(), tuple(plan.notes[before:])))
    return plan


def describe(plan: Plan, head: str) -> str:
    """The lowered step as text: the step, where it runs, each combinator in the order it was applied with what
    it did, and the dtype of each phase. What `print(step)` shows after `init`."""
    lines = [head]
    lines.append(
        f"  device: {plan.device}" + (f" ({len(plan.devices)} devices)" if len(plan.devices) > 1 else "")
    )
    mesh = next(
        (getattr(t, "mesh", None) for t in plan.transforms if getattr(t, "mesh", None) is not None), None
    )
    if mesh is not None:
        lines.append(f"  mesh: {dict(mesh.shape)} (world {math.prod(mesh.shape.values())})")
    if plan.grad_sync is not None:
        lines.append(f"  strategy: {plan.grad_sync.describe()}")
    lines.append("  stages (in lowering order):" if plan.stages else "  stages: none")
    for what, notes in plan.stages:
        lines.append(f"    {what}" + (f": {'; '.join(notes)}" if notes else ""))
    for phase, dtype in phase_dtypes(plan).items():
        lines.append(f"  {phase}: {dtype}")
    return "\n".join(lines)


def phase_dtypes(plan: Plan) -> dict[str, str]:
    """The dtype each phase of the lowered step computes in."""
    params = [p for n, p in plan.module.named_parameters() if plan.slots is None or n in plan.slots.trainable]
    param_dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params}) or ["-"]
    forward = "/".join(param_dtypes)
    if plan.autocast_dtype is not None:
        forward = f"autocast {str(plan.autocast_dtype).removeprefix('torch.')} ({plan.autocast_device_type}), params {forward}"
    if plan.fp8_skipped or any(t.kind == "fp8" for t in plan.transforms):
        forward += ", fp8 matmuls"
    out = {"forward": forward}
    if plan.kind == "train":
        out["gradients"] = "/".join(param_dtypes) + (
            ", fp16 loss scaling" if plan.loss_scale is not None else ""
        )
        out["loss and count"] = "float32 or wider (exact sums over micro-batches and ranks)"
        out["update"] = "/".join(param_dtypes) + (
            " on the host" if plan.updater is not None else ", in place"
        )
    return out
