"""Worker: train N steps straight vs k steps, save, new processes, load, N-k steps (exact resume).

    resume_worker.py STRATEGY MODE CKPT_DIR     MODE in full | first | rest

Prints one JSON line on rank 0: {"losses": [...], "params": sha256 of all params}.
"""

import hashlib
import json
import sys

import torch
from torch import nn

import accelfn as af

strategy, mode, ckpt = sys.argv[1], sys.argv[2], sys.argv[3]
N, K = 6, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 32), nn.Dropout(0.3), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


def loss_fn(model, b):
    return af.losses.cross_entropy(model(b["x"]), b["y"])


mesh = af.Mesh({"dp": -1}, device="cpu")
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
data = {"x": torch.randn(200, 8, generator=g), "y": torch.randint(0, 4, (200,), generator=g)}
loader = af.data.DataLoader(data, batch_size=4, mesh=mesh, shuffle=True, seed=7)
step = af.shard(
    af.accumulate(af.train_step(loss_fn, af.optim.adamw(1e-2), clip_grad_norm=1.0), 2),
    mesh,
    strategy=strategy,
)
state = step.init(Net(), seed=3)
if mode == "rest":
    state = af.checkpoint.load(ckpt, like=state, loader=loader)

losses = []
batches = iter(loader)
todo = {"full": N, "first": K, "rest": N - K}[mode]
for _ in range(todo):
    state, metrics = step(state, next(batches))
    losses.append(metrics["loss"].item())
if mode == "first":
    af.checkpoint.save(ckpt, state, loader=loader)

full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in state.params.items()}
digest = hashlib.sha256(b"".join(full[k].numpy().tobytes() for k in sorted(full))).hexdigest()
if mesh.is_main:
    print(json.dumps({"losses": [float(x).hex() for x in losses], "params": digest, "step": int(state.step)}))
mesh.close()
