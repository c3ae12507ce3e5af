"""Worker: two models, two sharded steps used in alternation (a GAN), vs the same on one process."""

import sys

import torch
from torch import nn

import accelfn as af

strategy = sys.argv[1]
mesh = af.Mesh({"dp": -1}, device="cpu")


def models():
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
    disc = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    return gen, disc


def steps(shard):
    gen, disc = models()
    bce = nn.functional.binary_cross_entropy_with_logits

    def d_loss(d, b):  # real -> 1, fake (generator output, no gradient into the generator) -> 0
        with torch.no_grad():
            fake = g_step.model(b["z"])
        return bce(d(b["real"]), torch.ones(len(b["real"]), 1)) + bce(d(fake), torch.zeros(len(fake), 1))

    def g_loss(g, b):  # the discriminator is used, not trained, here
        return bce(d_step.model(g(b["z"])), torch.ones(len(b["z"]), 1))

    g_step = af.train_step(g_loss, af.optim.adam(1e-2))
    d_step = af.train_step(d_loss, af.optim.adam(1e-2))
    if shard:
        kw = {"backend": "deepspeed", "zero_stage": 2} if strategy == "deepspeed" else {"strategy": strategy}
        g_step = af.shard(g_step, mesh, inputs="global", **kw)
        d_step = af.shard(d_step, mesh, inputs="global", **kw)
    return g_step, g_step.init(gen), d_step, d_step.init(disc)


def train(shard):
    g_step, gs, d_step, ds = steps(shard)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(6):
        b = {"z": torch.randn(8, 4, generator=gen), "real": torch.randn(8, 8, generator=gen) + 2}
        ds, dm = d_step(ds, b)
        gs, gm = g_step(gs, b)
        losses.append((dm["loss"].item(), gm["loss"].item()))
    full = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()
        for k, v in {
            **{f"g.{k}": v for k, v in gs.params.items()},
            **{f"d.{k}": v for k, v in ds.params.items()},
        }.items()
    }
    return losses, full


ref_losses, ref = train(shard=False)
losses, got = train(shard=True)
diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
assert diff <= 1e-5, f"rank {mesh.rank}: GAN params differ by {diff}"
assert max(abs(a - b) for x, y in zip(losses, ref_losses) for a, b in zip(x, y)) <= 1e-5, (losses, ref_losses)
print(f"rank {mesh.rank}: OK gan {strategy} max diff {diff:.1e}")
mesh.close()
