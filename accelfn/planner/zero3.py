"""What DeepSpeed ZeRO-3 (0.19, its defaults) keeps gathered of a model between its gathers: the planner's
estimate of ZeRO-3's all-gathers (`traffic`) reads it from the probe's model.

DeepSpeed's parameter coordinator (`partitioned_param_coordinator.py`) gathers a module's params before its
forward and its backward and releases them after each, but

- not the **persistent** params (`ds_persist`: at most `stage3_param_persistence_threshold` elements, 1e5): they
  are gathered once a step, after the update (`_post_step`), and held through every micro-batch;
- once the step's trace is recorded, not the params used again within `stage3_max_reuse_distance` elements
  (1e9) of the trace ahead (`__params_to_release`). A module's params are used again at its backward, after
  the forward of the modules after it and the backward of those: twice their elements. So the params of the
  modules that fewer than 5e8 elements follow (a decoder's last ones: its head, where that is under 5e8
  elements; all of a model under that) stay gathered from their forward to their backward (**reused**).

Example:
    >>> from torch import nn
    >>> shape = zero3_shape(nn.Sequential(nn.Linear(1000, 1000), nn.Linear(100, 100)))
    >>> round(shape["persistent"], 3), round(shape["reused"], 3)  # the biases and the second's weight; the first's
    (0.011, 0.989)
"""

from __future__ import annotations

from typing import Any

import attrs
from torch import nn

__all__ = ["PERSISTENCE_THRESHOLD", "MAX_REUSE_DISTANCE", "Zero3Shape", "zero3_shape"]

PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold (elements)
MAX_REUSE_DISTANCE = 1_000_000_000  # stage3_max_reuse_distance (elements)


@attrs.frozen
class Zero3Shape:
    """What ZeRO-3 holds gathered of a model (`zero3_shape`: `persistent` and `reused`, fractions of its params'
    bytes), whether its step's loss counts its elements (`loss_counts`: an af.Loss) and whether the step runs in
    fp16 (`fp16`: DeepSpeed's dynamic loss scale, where its step counts each of several micro-batches of an
    af.Loss by a forward first, `deepspeed.phases.counted_forwards`; elsewhere the update divides by the count
    and no micro-batch runs a forward more). The default: nothing held, no count forwards."""

    persistent: float = 0.0
    reused: float = 0.0
    loss_counts: bool = False
    fp16: bool = False

    @property
    def count_forwards(self) -> bool:
        """Whether several micro-batches run a count forward each (an af.Loss under fp16)."""
        return self.loss_counts and self.fp16

    @classmethod
    def of_probe(cls, probe: dict[str, Any]) -> Zero3Shape:
        """From the planner's probe (`tiers._probe`: its `zero3`, `loss_counts` and the step it described: fp16
        where it runs under `autocast(float16)`).

        Example:
            >>> Zero3Shape.of_probe({"zero3": {"persistent": 0.5, "reused": 0.25}, "loss_counts": True})
            Zero3Shape(persistent=0.5, reused=0.25, loss_counts=True, fp16=False)
        """
        shape = probe.get("zero3") or {}
        described = str((probe.get("report") or {}).get("strategy", ""))
        return cls(
            persistent=float(shape.get("persistent", 0.0)),
            reused=float(shape.get("reused", 0.0)),
            loss_counts=bool(probe.get("loss_counts", False)),
            fp16="autocast(float16" in described,
        )


def zero3_shape(model: nn.Module) -> dict[str, Any]:
    """The fractions of the model's param bytes that ZeRO-3 holds gathered (module docs): `persistent` (at
    most 1e5 elements each) and `reused` (the others, kept from their forward to their backward). The modules
    are taken in the order they are registered, as a decoder's forward runs them (its norms aside, which are
    persistent)."""
    owned = [(m, list(m.parameters(recurse=False))) for m in model.modules()]
    owned = [(m, ps) for m, ps in owned if ps]
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not total:
        return {"persistent": 0.0, "reused": 0.0}
    persistent = {id(p): p for p in model.parameters() if p.numel() <= PERSISTENCE_THRESHOLD}
    reused: dict[int, Any] = {}
    after = 0  # the elements of the modules after this one, in the forward's order
    for _, ps in reversed(owned):
        if 2 * after < MAX_REUSE_DISTANCE:  # seen again at its backward, before the reuse distance ends
            reused.update((id(p), p) for p in ps if id(p) not in persistent)
        after += sum(p.numel() for p in ps)

    def share(params: dict[int, Any]) -> float:
        return sum(p.numel() * p.element_size() for p in params.values()) / total

    return {"persistent": share(persistent), "reused": share(reused)}
