"""The evaluation step: `fn(model, batch)` in eval mode, without gradients, under the step's autocast and RNG."""

from __future__ import annotations

from typing import Any

import torch

from .. import random as _random
from ..module import bind
from ..state import TrainState
from .batches import place_batch
from .plan import Plan

__all__ = ["run_eval"]


def run_eval(plan: Plan, state: TrainState, batch: Any) -> Any:
    assert plan.loss_call is not None
    module = plan.module
    if plan.batch_transform is not None:
        batch = plan.batch_transform(batch)
    batch = place_batch(batch, plan.input_device)
    if getattr(module, "_accelfn_fsdp", False):  # FSDP2 computes with its own params: others would be ignored
        own = dict(module.named_parameters())
        foreign = [n for n, p in state.params.items() if own.get(n) is not p]
        if foreign:
            raise ValueError(
                f"eval_step: params {foreign[:3]} are not the FSDP-sharded model's own parameters; FSDP2 would "
                "silently evaluate its own instead. Evaluate the training state, or load the other weights into it "
                "(af.checkpoint.load(path, like=state))"
            )
    bind(module, state.params, state.buffers, plan.slots)
    was_training = module.training
    if was_training:
        module.eval()
    try:
        with torch.no_grad(), _random.seeded(state.rng, plan.devices), plan.forward_context():
            return plan.loss_call(module, batch)
    finally:
        if was_training:
            module.train()
