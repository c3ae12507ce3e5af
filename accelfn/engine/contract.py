"""The written contracts between the engine and what plugs into it: `GradSync` (a sharding strategy at run
time) and `Updater` (who applies the optimizer update). The engine calls exactly the methods declared here,
each with a default that is right for one process, and nothing else.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from ..optim.clip import global_norm

if TYPE_CHECKING:
    from ..optim import GradientTransformation
    from ..state import TrainState
    from .phases import TrainPhases

__all__ = ["GradSync", "Updater", "split_axes", "summed_axes"]


class GradSync:
    """What a sharding strategy (ddp, fsdp, hsdp, DeepSpeed ZeRO, tensor or context parallel) does at each phase
    of a training step. This docstring is the one place that says what a strategy may do.

    The engine runs the phases `check -> split -> forward_backward -> reduce -> clip -> update -> metrics`
    (`accelfn.engine.phases.TrainPhases`) and calls, in this order:

    - `prepare(params)` once, after binding the state's params and before any forward: register gradient hooks,
      broadcast buffers, refuse a state whose params are not the strategy's own;
    - `microbatch(last)` around each micro-batch's backward (a context): DDP launches its bucket all-reduces
      only in the last one; FSDP2 reduce-scatters in each (hsdp all-reduces only in the last), or only in the
      last with `af.accumulate(..., sync_each_microbatch=False)`;
    - `max_over_ranks(x)` (fp16 only): the largest value of a 0-d tensor over the ranks (the loss normaliser
      every rank must agree on);
    - `record_unused(names, missing)` after the backward passes: which trainable params got no gradient;
    - `reduce(grads, loss_sum, count)`: sum `grads` in place over the data-parallel ranks (if not already done
      during the backward), and return the global loss sum and token count;
    - `any_rank(flag)` (fp16 only): a found-inf flag, true on every rank if true on one (sharded gradients);
    - `norm(grads)` (clipping only): the global L2 norm of the (possibly sharded) gradients;
    - `after_update(params, step)` after the optimizer update (also when fp16 skipped it): `params` the trainable
      params, updated; `step` the state's step counter before this step (local SGD averages the params here; a
      backend whose phases own the update calls it itself, or refuses strategies that need it);
    - `reduce_metrics(values)`: average the `aux` metric scalars over the data-parallel ranks;
    - `abandon()` instead of the rest, when the step raised before `reduce` (in a forward or backward, the
      user's loss included, which the caller may catch and step again): drop what the finished backwards left
      (partial sums, held gradients, a backend's per-iteration state) so that the next step is as if this one
      never ran. Local only: the ranks that did not raise run on into their collectives.

    `rank_loss` (a flag) says whether the loss summed on a rank before `reduce` is the loss of its own rows,
    reported as `metrics["rank_loss"]` (not under a pipeline, where only the last stage has a loss).

    Parameters split over a gradient axis (experts sharded over `ep`: a DTensor `Shard(0)` over that axis, each
    rank holding other experts) are summed only over the gradient axes they are not split over (`summed_axes`):
    summing over `ep` too would add different experts' gradients (or, counted per rank, make them `ep` times too
    large: Megatron #5956). `norm` counts each element once however it is split (Megatron #5916).

    A strategy whose backend owns whole phases (DeepSpeed's engine runs backward, clipping and the update)
    sets `phases` to a `TrainPhases` subclass that overrides those phases, and may build its own optimizer
    state with `init_opt_state`. Nothing else of a strategy is called; the defaults are a world of one.
    """

    #: the phases of a step under this strategy (None: the engine's standard `TrainPhases`)
    phases: TrainPhases | None = None
    #: whether the loss summed on this rank is the loss of its own rows (`metrics["rank_loss"]`); not under a
    #: pipeline, where only the last stage computes it
    rank_loss: bool = True

    def prepare(self, params: dict[str, torch.Tensor]) -> None:
        """Called with the bound params before the step's first forward."""

    def microbatch(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """A context entered around each micro-batch's backward; `last` for the step's last micro-batch."""
        return contextlib.nullcontext()

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        """The maximum of the 0-d tensor `x` over the data-parallel ranks."""
        return x

    def record_unused(self, names: tuple[str, ...], missing: set[str]) -> None:
        """`missing`: the trainable params (of `names`) that got no gradient on this rank in this step."""

    def reduce(
        self, grads: list[torch.Tensor], loss_sum: torch.Tensor, count: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum `grads` in place, and `loss_sum` and `count`, over the data-parallel ranks."""
        return loss_sum, count

    def any_rank(self, flag: torch.Tensor) -> torch.Tensor:
        """A 0-d flag that is set on every rank where it is set on one (sharded gradients' found-inf)."""
        return flag

    def norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The global L2 norm of the (possibly sharded) gradients."""
        return global_norm(grads)

    def after_update(self, params: dict[str, torch.Tensor], step: torch.Tensor) -> None:
        """Called after the update with the trainable params and the step counter before this step."""

    def reduce_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Average metric scalars over the data-parallel ranks."""
        return values

    def abandon(self) -> None:
        """The step raised before `reduce`: drop its partial gradient state (no collective)."""

    def init_opt_state(self, trainable: dict[str, torch.Tensor]) -> Any:
        """The optimizer state of a backend that keeps its own (None: the step's optimizer's `init`)."""
        return None

    def describe(self) -> str:
        """One line for `print(step)`."""
        return type(self).__name__


def split_axes(param: torch.Tensor) -> tuple[str, ...]:
    """The mesh axes a parameter is split over: the named dims of a DTensor's mesh where it is sharded.

    Example:
        >>> split_axes(torch.zeros(2))
        ()
    """
    placements = getattr(param, "placements", None)
    if placements is None:
        return ()
    names = param.device_mesh.mesh_dim_names or ()  # type: ignore[attr-defined]
    return tuple(n for n, p in zip(names, placements) if p.is_shard())


def summed_axes(param: torch.Tensor, grad_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The gradient axes over which `param`'s gradient is summed: `grad_axes` less those it is split over.

    Example:
        >>> summed_axes(torch.zeros(2), ("dp", "ep"))
        ('dp', 'ep')
    """
    split = split_axes(param)
    return tuple(a for a in grad_axes if a not in split)


LOCAL = GradSync()  # one process: every hook is the identity


class Updater:
    """Runs the optimizer update (set by `af.offload`; without one the engine applies it in place on the params).

    `__call__` returns the new optimizer state and the new `state.extra` (where an updater keeps its own state,
    e.g. host master params, so that it is checkpointed and never outlives the state it belongs to).
    `overlapped(tx, state)` is a context entered around the whole step (the delayed update of `af.offload` runs
    during the forward and backward, and completes into `state` if the step fails or skips).
    """

    def __call__(
        self,
        tx: GradientTransformation,
        grads: dict[str, torch.Tensor],
        opt_state: Any,
        params: dict[str, torch.Tensor],
        extra: dict[str, Any],
    ) -> tuple[Any, dict[str, Any]]:
        raise NotImplementedError

    def overlapped(
        self, tx: GradientTransformation, state: TrainState
    ) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()
