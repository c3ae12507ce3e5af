"""Worker: a shard of the newest checkpoint is damaged on one rank's side; the usual "newest readable
checkpoint" loop must resume every rank from the same (older) checkpoint, not rank 0 from the newest."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import accelfn as af

root = Path(sys.argv[1])
mesh = af.Mesh.from_env()
step = af.shard(af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.adamw(1e-2)), mesh, strategy="fsdp")
state = step.init(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)))
for i in range(1, 5):
    state, _ = step(state, torch.randn(4, 8, generator=torch.Generator().manual_seed(i)))
    if i in (2, 4):
        af.checkpoint.save(root / f"step-{i}", state)
dist.barrier()
if mesh.rank == 0:  # damage the file only rank 1 reads its shard from
    victim = sorted((root / "step-4").glob("model-rank00001*.safetensors"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[:-10])
dist.barrier()
errors = []
for path in reversed(af.checkpoint.checkpoints(root)):
    try:
        state = af.checkpoint.load(path, like=state)
        break
    except af.checkpoint.CorruptCheckpointError as e:
        errors.append(str(e))
assert int(state.step) == 2, f"rank {mesh.rank} resumed from step {int(state.step)}"
if mesh.rank == 0:
    assert len(errors) == 1 and "failed on rank 1" in errors[0], errors
print(f"rank {mesh.rank}: OK every rank fell back to step 2", flush=True)
mesh.close()
