"""`af.accumulate`: split each batch into micro-batches, one optimizer update per call.

With `af.Loss(total, count)` losses the update equals the full-batch step exactly, even when micro-batches
hold different numbers of valid tokens: gradients of the *sums* are accumulated (in the parameters'
dtype, fp32 master weights) and divided once by the global count.

When the gradients meet (`sync_each_microbatch`): under `af.shard(strategy="fsdp")` each micro-batch's
gradients are reduce-scattered as its backward runs and accumulated sharded (torchtitan's way), so a rank never
holds more than a block's unsharded gradients; under "hsdp" they are reduce-scattered each micro-batch and
all-reduced over the replicas once, in the last. `sync_each_microbatch=False` is FSDP2's `no_sync`
(Accelerate's default, `sync_each_batch=False`): one reduce-scatter per step, but every parameter's unsharded
gradient is held from the first micro-batch to the last, the whole model's gradients on every rank (DeepSeek-V3,
671B, at `dp=8,ep=32` on 256 GPUs: 2.2 GiB per MoE layer, 130 GiB of a 185 GiB peak per rank; `accelfn dry-run`
counts them under `grads`). DDP's gradients are whole on every rank either way: it
all-reduces once, in the last micro-batch. Under `af.pipeline` the schedule runs the micro-batches, so
`af.pipeline(..., sync_each_microbatch=...)` chooses (default False: once, after the stage's last backward);
accumulate's own, if given, must say the same.

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
    sync_each_microbatch: bool | None = None
    kind: str = "accumulate"

    def describe(self) -> str:
        sync = (
            "" if self.sync_each_microbatch is None else f", sync_each_microbatch={self.sync_each_microbatch}"
        )
        return f"accumulate({self.microbatches}{', uneven=True' if self.uneven else ''}{sync})"

    def lower(self, plan: Plan) -> None:
        if plan.kind != "train":
            raise ValueError("accumulate() applies to training steps only")
        plan.microbatches = self.microbatches
        plan.uneven = self.uneven
        plan.sync_each_microbatch = self.sync_each_microbatch


@checked
def accumulate(
    step: Step, microbatches: int, *, uneven: bool = False, sync_each_microbatch: bool | None = None
) -> Step:
    """Split every tensor leaf of the batch along dim 0 into `microbatches` parts; accumulate gradients.

    A batch whose size is not divisible by `microbatches` is an error, unless `uneven=True`, which splits
    it as evenly as possible and weights each part by its count (or its number of rows for mean losses); a
    batch with fewer rows than `microbatches` (the short last batch of an epoch, `DataLoader(last_batch=
    "short")`, on a rank that got few or no rows) then has empty micro-batches, which add nothing.

    `sync_each_microbatch` (FSDP and HSDP; see the module docs): None, the default, or True reduce-scatters
    every micro-batch's gradients (sharded accumulation, the least memory); False reduces once, in the last
    micro-batch (FSDP2's `no_sync`: the fewest collectives, the whole model's unsharded gradients held). DDP
    and DeepSpeed reduce once either way.

    Example:
        >>> import torch, accelfn as af
        >>> step = af.accumulate(af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)), 4)
        >>> state, metrics = step(step.init(torch.nn.Linear(3, 1)), torch.randn(8, 3))  # 4 micro-batches of 2
        >>> int(state.step)
        1
    """
    if microbatches < 1:
        raise ValueError(f"accumulate: microbatches must be >= 1, got {microbatches}")
    return step.with_transform(Accumulate(microbatches, uneven, sync_each_microbatch))
