"""Worker: af.Meter over 2 data-parallel ranks with a fake clock; prints each rank's global figures as JSON."""

import json
import os

import torch
import torch.distributed as dist

import accelfn as af
from accelfn.meter import Meter

mesh = af.Mesh.from_env()
rank = mesh.rank


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


clock = Clock()


def loss_fn(model, batch):
    clock.t += 0.1 * (rank + 1)  # rank r's step takes 0.1 * (r + 1) s
    logits = model(batch["ids"])
    return af.losses.cross_entropy(logits, batch["ids"])


model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32))
meter = Meter(af.shard(af.train_step(loss_fn, af.optim.sgd(0.1)), mesh), clock=clock)
state = meter.step.init(model, seed=0)
for _ in range(4):
    state, metrics = meter(state, {"ids": torch.randint(0, 32, (4, 16))})

calls = {"n": 0}
for name in (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "broadcast",
    "reduce",
    "gather",
):
    if not hasattr(dist, name):
        continue
    original = getattr(dist, name)

    def counted(*args, _original=original, **kwargs):
        calls["n"] += 1
        return _original(*args, **kwargs)

    setattr(dist, name, counted)
figures = meter.figures()
figures["collectives"] = calls["n"]
os.write(1, f"FIGURES {json.dumps(figures)}\n".encode())  # one write: the ranks' lines do not interleave
mesh.close()
