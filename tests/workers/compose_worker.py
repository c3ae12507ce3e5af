"""Worker: every pair and triple of combinators that includes shard(ddp), in both orders, on N ranks."""

import itertools

import torch
from torch import nn

import accelfn as af

mesh = af.Mesh({"dp": -1}, device="cpu")
OTHERS = {
    "accumulate": lambda s: af.accumulate(s, 2),
    "autocast": lambda s: af.autocast(s, torch.bfloat16),
    "compile": lambda s: af.compile(s),
    "offload": lambda s: af.offload(s),
}
ALL = {**OTHERS, "shard": lambda s: af.shard(s, mesh, inputs="global")}


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 6, 8, generator=g), torch.randint(0, 5, (8, 6), generator=g)
    for r in range(8):
        y[r, (r % 6) + 1 :] = -100
    return {"x": x, "y": y}


def loss_fn(model, b):
    return af.losses.cross_entropy(model(b["x"]), b["y"])


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5))


def result(names):
    torch._dynamo.reset()
    step = af.train_step(loss_fn, af.optim.adamw(1e-2))
    for n in names:
        step = ALL[n](step)
    state = step.init(model())
    losses = []
    for s in range(3):
        state, m = step(state, batch(s))
        losses.append(m["loss"].item())
    return repr(step), state.params, losses


plain_state = af.train_step(loss_fn, af.optim.adamw(1e-2)).init(model())
plain_step = af.train_step(loss_fn, af.optim.adamw(1e-2))
plain_state = plain_step.init(model())
plain_losses = []
for s in range(3):
    plain_state, m = plain_step(plain_state, batch(s))
    plain_losses.append(m["loss"].item())

combos = [("shard", *c) for k in (1, 2) for c in itertools.combinations(OTHERS, k)]
for combo in combos:
    r1, p1, l1 = result(combo)
    r2, p2, l2 = result(tuple(reversed(combo)))
    assert r1 == r2, (r1, r2)
    diff = max((p1[k] - p2[k]).abs().max().item() for k in p1)
    assert diff <= 1e-6 and max(abs(a - b) for a, b in zip(l1, l2)) <= 1e-6, (combo, diff, l1, l2)
    tol = 3e-2 if "autocast" in combo else 1e-5
    ref = max(abs(a - b) for a, b in zip(l1, plain_losses))
    assert ref <= tol, (combo, l1, plain_losses)
    print(f"rank {mesh.rank}: OK {'+'.join(combo)} (both orders equal; vs 1-process plain {ref:.1e})")
mesh.close()
