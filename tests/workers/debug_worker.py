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

# Matching calls still work in debug mode, and pad_across_processes may differ along its dim.
assert torch.equal(af.dist.gather(torch.tensor([r])), torch.arange(mesh.world_size))
assert af.dist.pad_across_processes(torch.ones(r + 1), pad_index=0).shape == (mesh.world_size,)
print(f"rank {r}: debug checks passed", flush=True)
mesh.close()
