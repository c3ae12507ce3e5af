"""The run-time of a lowered step: a training step as named phases over a frozen `Plan`.

    check -> split -> forward_backward -> reduce -> clip -> update -> metrics

- `plan`: `Plan`, what the combinators' lowering decided (who sets which field is written there);
- `contract`: `GradSync` (what a sharding strategy may do at each phase) and `Updater` (`af.offload`);
- `phases`: `TrainPhases`, the phases themselves, and `run_train`;
- `evaluate`: `run_eval`;
- `batches`: checking, placing and splitting batches, and reading what a loss function returned.

docs/architecture.md follows a batch through these phases.
"""

from .batches import check_batch, loss_parts, place_batch, plain_batch, split_batch
from .contract import GradSync, Updater
from .evaluate import run_eval
from .phases import StepRun, TrainPhases, run_train
from .plan import LossScaleConfig, Plan, exclusive, init_loss_scale

__all__ = [
    "Plan",
    "GradSync",
    "Updater",
    "TrainPhases",
    "StepRun",
    "LossScaleConfig",
    "init_loss_scale",
    "exclusive",
    "run_train",
    "run_eval",
    "check_batch",
    "plain_batch",
    "place_batch",
    "split_batch",
    "loss_parts",
]
