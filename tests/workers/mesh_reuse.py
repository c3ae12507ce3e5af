"""Worker: a new af.Mesh after close(), three times in one launched job (run by tests/test_launch.py)."""

import torch

import accelfn as af

for _ in range(3):
    with af.Mesh.from_env(device="cpu") as mesh:
        t = torch.ones(1) * (mesh.rank + 1)
        af.dist.barrier()
        out = af.dist.all_reduce(t, op="sum")
        assert out.item() == 3.0, out
print("REUSE OK", flush=True)
