"""A tiny training step, sharded (`--shard`) or not, for the warning `accelfn launch` gives a step that trains
one copy per process (tests/test_step_launch_warning.py)."""

from __future__ import annotations

import sys

import torch

import accelfn as af

step = af.train_step(lambda m, b: af.losses.mse(m(b), b), af.optim.sgd(0.1))
if "--shard" in sys.argv:
    step = af.shard(step, af.Mesh.from_env())
torch.manual_seed(0)
state = step.init(torch.nn.Linear(4, 4))
state, _ = step(state, torch.randn(2, 4))
print("trained")
