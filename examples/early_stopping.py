"""Early stopping: every process watches its own training loss, and all processes stop at the first step where
one of them decides to -- Accelerate's `examples/by_feature/early_stopping.py`, ported line by line.

    accelfn launch --nproc-per-node 2 --cpu examples/early_stopping.py
    python examples/early_stopping.py                                       # one process

Accelerate                                            accelfn
    loss = model(**batch).loss                            state, metrics = step(state, batch)
    accelerator.backward(loss); optimizer.step()          # the update is over all processes' rows
    if callback.check_early_stopping(loss.item()):        stop = callback.check_early_stopping(
        accelerator.set_trigger()                             metrics["rank_loss"].item())
    if accelerator.check_trigger():                       if af.dist.any(stop):   # one all-reduce
        break                                                 break

`metrics["loss"]` is the mean over every process's rows (what the update used); `metrics["rank_loss"]` is this
process's loss on its own rows -- what Accelerate's `loss.item()` is on each process. Watching the global loss
instead stops at another step (a port that did stopped one step later). Ends with
`CHECK every process stops at the same step: OK` (else FAILED, exit status 1; raise --lr or lower --patience
if it never stops).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import accelfn as af


class EarlyStoppingCallback:
    """Accelerate's example callback: stop when the loss has not improved by `min_delta` for `patience` checks."""

    def __init__(self, min_delta: float = 0.0, patience: int = 5) -> None:
        self.min_delta, self.patience = min_delta, patience
        self.counter, self.lowest_loss = 0, float("inf")

    def check_early_stopping(self, loss: float) -> bool:
        if self.lowest_loss - loss >= self.min_delta:
            self.lowest_loss, self.counter = loss, 0
            return False
        self.counter += 1
        return self.counter > self.patience


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def make_data(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return {
        "x": x,
        "y": x[:, :1] - 0.5 * x[:, 1:2] + 0.3 * torch.randn(n, 1, generator=g),
    }  # noisy: it plateaus


def loss_fn(model, batch):
    return af.losses.mse(model(batch["x"]), batch["y"])


def build(mesh, *, lr: float, batch_size: int, seed: int):
    """The data-parallel step, its state and this process's loader (`batch_size` rows per process)."""
    step = af.shard(af.train_step(loss_fn, af.optim.adamw(lr, weight_decay=0.0)), mesh)
    loader = af.data.DataLoader(
        make_data(1024, seed), batch_size=batch_size, mesh=mesh, shuffle=True, seed=seed
    )
    return step, step.init(make_model(seed), seed=seed), loader


def train(step, state, batches, callback: EarlyStoppingCallback):
    """Train until a process's callback says stop; return the state, this process's losses, and the stop index
    (None: the batches ran out)."""
    losses = []
    for i, batch in enumerate(batches):
        state, metrics = step(state, batch)
        losses.append(metrics["rank_loss"].item())
        if af.dist.any(callback.check_early_stopping(losses[-1])):
            return state, losses, i
    return state, losses, None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--patience", type=int, default=3)
    p.add_argument("--min-delta", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=16, help="rows per process")
    p.add_argument("--lr", type=float, default=3e-2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    with af.Mesh.from_env() as mesh:
        step, state, loader = build(mesh, lr=args.lr, batch_size=args.batch_size, seed=args.seed)
        callback = EarlyStoppingCallback(args.min_delta, args.patience)
        state, losses, stopped = train(step, state, loader, callback)
        where = f"stopped after step {stopped + 1}" if stopped is not None else "ran to the end of the data"
        print(f"process {mesh.rank}: {where}; own loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
        ok = (
            stopped is not None
            and af.dist.gather_object([stopped], flatten=True) == [stopped] * mesh.world_size
        )
        af.dist.print("CHECK every process stops at the same step:", "OK" if ok else "FAILED")
        if not ok:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
