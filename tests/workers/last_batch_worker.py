"""DataLoader(last_batch="short") on 2 CPU processes: the short last batch of each epoch is split over the ranks
as evenly as possible (a rank may get 0 rows), and `af.shard(af.accumulate(step, 2, uneven=True))` over such
epochs makes exactly the updates of a plain one-process PyTorch loop on the same global batches."""

import torch
from torch import nn

import accelfn as af

mesh = af.Mesh({"dp": -1}, device="cpu")
r, n = mesh.rank, mesh.world_size
assert n == 2, n
DL = af.data.DataLoader
PER_RANK, SEED, EPOCHS = 8, 5, 2  # a global batch of 16


def columns(total):
    g = torch.Generator().manual_seed(total)
    x = torch.randn(total, 4, generator=g)
    return {
        "x": x,
        "y": torch.cat([x[:, :1] * x[:, 1:2], x[:, 2:3].sin()], 1) + 0.1 * torch.randn(total, 2, generator=g),
    }


def new_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))


def global_batches(total, epoch):
    """docs/data.md: the epoch's order is randperm(total) from seed + epoch, cut into global batches of 16;
    with last_batch="short" the last one keeps what is left."""
    order = torch.randperm(total, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
    return [order[k : k + 2 * PER_RANK] for k in range(0, total, 2 * PER_RANK)]


def plain_pytorch(data, total):
    """One process, no accelfn: one SGD update per global batch, on the mean squared error of its rows."""
    model = new_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for epoch in range(EPOCHS):
        for idx in global_batches(total, epoch):
            x, y = data["x"][idx], data["y"][idx]
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).sum() / y.numel()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return {k: v.detach() for k, v in model.state_dict().items()}, losses


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# total 45: last global batch of 13 -> 7 + 6 rows; total 33: 1 row -> rank 0 gets 1 row, rank 1 gets 0 rows
for total, sizes in ((45, {0: 7, 1: 6}), (33, {0: 1, 1: 0})):
    data = columns(total)
    want_params, want_losses = plain_pytorch(data, total)
    for strategy in ("ddp", "fsdp"):
        loader = DL(data, PER_RANK, mesh=mesh, shuffle=True, seed=SEED, last_batch="short")
        inner = af.train_step(lambda m, b: af.losses.mse(m(b["x"]), b["y"]), af.optim.sgd(0.1, momentum=0.9))
        step = af.shard(af.accumulate(inner, 2, uneven=True), mesh, strategy=strategy)
        state = step.init(new_model(), seed=0)
        losses, rows = [], []
        for _epoch in range(EPOCHS):
            for batch in loader:
                rows.append(len(batch["y"]))
                state, metrics = step(state, batch)
                losses.append(metrics["loss"].item())
        per_epoch = len(global_batches(total, 0))
        assert len(loader) == per_epoch and rows == ([PER_RANK] * (per_epoch - 1) + [sizes[r]]) * EPOCHS, rows
        assert len(losses) == len(want_losses) == EPOCHS * per_epoch
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
        got = {k: full(v).detach() for k, v in state.params.items()}
        assert sorted(got) == sorted(want_params), (sorted(got), sorted(want_params))
        for k in want_params:
            torch.testing.assert_close(got[k], want_params[k], rtol=1e-5, atol=1e-6)
        print(f"rank {r}: short {total} {strategy} equals one process over {len(losses)} updates", flush=True)

    # every sample once per epoch, in the documented global batches; gather_for_metrics puts them back in order
    loader = DL(data, PER_RANK, mesh=mesh, shuffle=True, seed=SEED, last_batch="short")
    for epoch in range(EPOCHS):
        seen = [af.data.gather_for_metrics(b["x"], loader) for b in loader]
        want = [data["x"][idx] for idx in global_batches(total, epoch)]
        assert [len(s) for s in seen] == [len(w) for w in want], ([len(s) for s in seen], epoch)
        for s, w in zip(seen, want):
            torch.testing.assert_close(s, w, rtol=0, atol=0)  # the same samples, moved, not computed
        assert loader.padding == 0 and loader.last_batch.sizes == (sizes[0], sizes[1]), loader.last_batch

    # the same batches from an iterable (every rank reads it, or rank 0 dispatches), with workers, and resumed
    plain = [b.tolist() for b in DL(range(total), PER_RANK, mesh=mesh, last_batch="short")]
    assert [len(b) for b in plain][-1] == sizes[r], plain

    class Stream(torch.utils.data.IterableDataset):
        def __init__(self, total):
            self.total = total

        def __iter__(self):
            return iter(range(self.total))

    for kw in ({}, {"dispatch": True}):
        assert [
            b.tolist() for b in DL(Stream(total), PER_RANK, mesh=mesh, last_batch="short", **kw)
        ] == plain, kw
    assert [
        b.tolist() for b in DL(range(total), PER_RANK, mesh=mesh, last_batch="short", num_workers=2)
    ] == plain
    first = DL(range(total), PER_RANK, mesh=mesh, last_batch="short")
    it = iter(first)
    head = [next(it).tolist() for _ in range(2)]
    state = first.state_dict()
    assert state["last_batch"] == "short" and af.dist.gather_object([state], flatten=True) == [state, state]
    resumed = DL(range(total), PER_RANK, mesh=mesh, last_batch="short")
    resumed.load_state_dict(state)
    assert head + [b.tolist() for b in resumed] == plain
    print(
        f"rank {r}: short {total} batches, gather_for_metrics, iterable, dispatch, workers, resume OK",
        flush=True,
    )

print(f"rank {r}/{n}: all last-batch checks passed", flush=True)
mesh.close()
