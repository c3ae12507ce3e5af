"""Worker: train with checkpoints and JSONL logging; `--die-at N` SIGKILLs rank 0 right after logging step N.

Run twice by test_trackers_resume.py: the second run resumes from the latest checkpoint and its trackers
continue the numbering (`resume_step`), so metrics.jsonl holds every step once.
"""

import os
import signal
import sys

import torch
from torch import nn

import accelfn as af

run_dir, total = sys.argv[1], int(sys.argv[2])
die_at = int(sys.argv[sys.argv.index("--die-at") + 1]) if "--die-at" in sys.argv else None
mesh = af.Mesh.from_env()
step = af.shard(af.train_step(lambda m, b: af.losses.mse(m(b["x"]), b["y"]), af.optim.adamw(1e-2)), mesh)
torch.manual_seed(0)
state = step.init(nn.Linear(4, 1))
ckpts = os.path.join(run_dir, "checkpoints")
latest = af.checkpoint.latest(ckpts) if os.path.isdir(ckpts) else None
if latest is not None:
    state = af.checkpoint.load(latest, like=state)
start = int(state.step)
run = af.trackers.open(run_dir, "jsonl", mesh=mesh, resume_step=start if latest is not None else None)
for i in range(start, total):
    g = torch.Generator().manual_seed(i * 10 + mesh.data_rank)
    batch = {"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 1, generator=g)}
    state, metrics = step(state, batch)
    run.log({"loss": metrics["loss"]}, step=state.step)
    if int(state.step) % 5 == 0:
        af.checkpoint.save(os.path.join(ckpts, f"step-{int(state.step)}"), state)
    if die_at is not None and int(state.step) == die_at and mesh.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # no flush, no atexit: what the OOM killer does
run.close()
print(f"rank {mesh.rank}: done at step {int(state.step)} (started at {start})", flush=True)
mesh.close()
