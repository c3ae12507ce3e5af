"""Worker: profile 3 data-parallel steps into the run folder given as argv[1]."""

import sys

import torch

import accelfn as af
from accelfn.profile import profile

mesh = af.Mesh.from_env()
step = af.shard(af.train_step(lambda m, b: af.losses.mse(m(b["x"]), b["y"]), af.optim.sgd(0.1)), mesh)
state = step.init(torch.nn.Linear(8, 1), seed=0)
with profile(sys.argv[1], wait=0, warmup=1, active=2) as prof:
    for _ in range(3):
        state, _ = step(state, {"x": torch.randn(4, 8), "y": torch.randn(4, 1)})
        prof.step()
mesh.close()
