"""ACCELFN_DEBUG=1: collectives with mismatched shapes (or mismatched calls) raise on every rank."""

import os

import torch

import accelfn as af

assert os.environ.get("ACCELFN_DEBUG") == "1"
mesh = af.Mesh.from_env()
r = mesh.rank

try:
    af.dist.gather(torch.zeros(3 - r, 4))
except af.dist.CollectiveMismatchError as e:
    print(f"rank {r} caught shape mismatch: {e}", flush=True)
else:
    raise AssertionError("gather with different shapes did not raise")

try:
    if r == 0:
        af.dist.all_reduce(torch.zeros(2), op="sum")
    else:
        af.dist.broadcast(torch.zeros(2))
except af.dist.CollectiveMismatchError as e:
    print(f"rank {r} caught call mismatch: {e}", flush=True)
else:
    raise AssertionError("different collectives did not raise")

# A rank that stops training early (fewer batches) and calls a collective while the other trains: the step's
# own check pairs with the collective's and both ranks raise, instead of mixing it with the gradient reduction.
step = af.shard(af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)), mesh)
state = step.init(torch.nn.Linear(4, 1))
state, _ = step(state, torch.randn(4, 4))  # the same step on both ranks: passes
try:
    if r == 0:
        state, _ = step(state, torch.randn(4, 4))
    else:
        af.dist.all_reduce(torch.ones(()), op="sum")
except af.dist.CollectiveMismatchError as e:
    print(f"rank {r} caught step mismatch: {e}", flush=True)
else:
    raise AssertionError("a step against a collective did not raise")

# Matching calls still work in debug mode, and pad_across_processes may differ along its dim.
assert torch.equal(af.dist.gather(torch.tensor([r])), torch.arange(mesh.world_size))
assert af.dist.pad_across_processes(torch.ones(r + 1), pad_index=0).shape == (mesh.world_size,)
print(f"rank {r}: debug checks passed", flush=True)
mesh.close()
