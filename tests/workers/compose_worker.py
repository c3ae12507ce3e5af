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
    step = af.train_step(loss_fn, af.optim.sgd(0.5, momentum=0.9))
    for n in names:
        step = ALL[n](step)
    state = step.init(model())
    losses = []
    for s in range(3):
        state, m = step(state, batch(s))
        losses.append(m["loss"].item())
    return repr(step), state.params, losses


# the independent reference: a plain loop with torch.optim.SGD on the global batch, in one process
ref = model()
init = {k: p.detach().clone() for k, p in ref.named_parameters()}
opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
plain_losses = []
for s in range(3):
    b = batch(s)
    loss = nn.functional.cross_entropy(ref(b["x"]).reshape(-1, 5), b["y"].reshape(-1), ignore_index=-100)
    loss.backward()
    opt.step()
    opt.zero_grad()
    plain_losses.append(loss.item())
plain = {k: p.detach() for k, p in ref.named_parameters()}
moved = max((plain[k] - init[k]).abs().max().item() for k in plain)
assert moved > 0.05, moved

combos = [("shard", *c) for k in (1, 2) for c in itertools.combinations(OTHERS, k)]
for combo in combos:
    r1, p1, l1 = result(combo)
    r2, p2, l2 = result(tuple(reversed(combo)))
    assert r1 == r2, (r1, r2)
    diff = max((p1[k] - p2[k]).abs().max().item() for k in p1)
    assert diff <= 1e-6 and max(abs(a - b) for a, b in zip(l1, l2)) <= 1e-6, (combo, diff, l1, l2)
    # not a no-op: the updates match the 1-process plain loop (to bf16 precision where bf16 is on)
    bf16 = "autocast" in combo
    err = max((p1[k] - plain[k]).abs().max().item() for k in plain) / moved
    assert err <= (0.015 if bf16 else 1e-5), (combo, err)
    loss_err = max(abs(a - b) for a, b in zip(l1, plain_losses))
    assert loss_err <= (2e-2 if bf16 else 1e-5), (combo, l1, plain_losses)
    print(f"rank {mesh.rank}: OK {'+'.join(combo)} (both orders equal; update vs 1-process plain {err:.1e})")
mesh.close()
