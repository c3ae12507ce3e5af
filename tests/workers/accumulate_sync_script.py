"""A 4-block MLP under fsdp with 4 micro-batches; argv[1]: sync_each_microbatch (none: default, false)."""

import sys

import torch

import accelfn as af

sync = {"none": None, "false": False}[sys.argv[1]]
with af.Mesh.from_env(device="cpu") as mesh:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(4)]
    )
    step = af.accumulate(
        af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.adamw(1e-3)), 4, sync_each_microbatch=sync
    )
    step = af.shard(step, mesh, strategy="fsdp")
    state = step.init(net)
    for _ in range(2):
        state, _ = step(state, torch.randn(16, 256))
