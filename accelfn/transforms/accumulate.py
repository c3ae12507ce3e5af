"""`af.accumulate`: split each batch into micro-batches, one optimizer update (and one sync) per call.

With `af.Loss(total, count)` losses the update equals the full-batch step exactly, even when micro-batches
hold different numbers of valid tokens: gradients of the *sums* are accumulated (in the parameters'
dtype, fp32 master weights) and divided once by the global count.

Example:
    >>> import torch, accelfn as af
    >>> step = af.accumulate(af.train_step(lambda m, b: af.losses.mse(m(b), b), af.optim.sgd(0.1)), 4)
    >>> state = step.init(torch.nn.Linear(3, 3))
    >>> state, metrics = step(state, torch.randn(8, 3))   # 4 micro-batches of 2 rows
    >>> step
    Step(train_step(<lambda>) -> accumulate(4))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from .._typecheck import checked
from ..step import Step
from ._base import TransformBase

if TYPE_CHECKING:
    from ..engine import Plan

__all__ = ["accumulate"]


@attrs.frozen
class Accumulate(TransformBase):
    microbatches: int
    uneven: bool = False
    kind: str = "accumulate"

    def describe(self) -> str:
        return f"accumulate({self.microbatches}{', uneven=True' if self.uneven else ''})"

    def lower(self, plan: Plan) -> None:
        if plan.kind != "train":
            raise ValueError("accumulate() applies to training steps only")
        plan.microbatches = self.microbatches
        plan.uneven = self.uneven


@checked
def accumulate(step: Step, microbatches: int, *, uneven: bool = False) -> Step:
    """Split every tensor leaf of the batch along dim 0 into `microbatches` parts; accumulate gradients.

    A batch whose size is not divisible by `microbatches` is an error, unless `uneven=True`, which splits
    it as evenly as possible and weights each part by its count (or its number of rows for mean losses); a
    batch with fewer rows than `microbatches` (the short last batch of an epoch, `DataLoader(last_batch=
    "short")`, on a rank that got few or no rows) then has empty micro-batches, which add nothing.

    Example:
        >>> import torch, accelfn as af
        >>> step = af.accumulate(af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)), 4)
        >>> state, metrics = step(step.init(torch.nn.Linear(3, 1)), torch.randn(8, 3))  # 4 micro-batches of 2
        >>> int(state.step)
        1
    """
    if microbatches < 1:
        raise ValueError(f"accumulate: microbatches must be >= 1, got {microbatches}")
    return step.with_transform(Accumulate(microbatches, uneven))
