"""Local SGD: each process trains its own replica with no gradient communication, and the replicas' params are
averaged every few updates -- Accelerate's `examples/by_feature/local_sgd.py`, ported line by line.

    accelfn launch --nproc-per-node 2 --cpu examples/local_sgd.py --local-sgd-steps 8 --accumulation 2
    python examples/local_sgd.py                                            # one process: plain training

Accelerate                                            accelfn
    accelerator = Accelerator(                            mesh = af.Mesh.from_env()
        gradient_accumulation_steps=ga)
    with LocalSGD(accelerator, model,                     step = af.shard(af.accumulate(step, ga), mesh,
                  local_sgd_steps=k) as local_sgd:            strategy="local_sgd", sync_every=k // ga)
        for batch in loader:                              for batch in loader:   # ga micro-batches per batch
            with accelerator.accumulate(model):               state, metrics = step(state, batch)
                ... backward, optimizer.step() ...
                local_sgd.step()
    # leaving the block averages the replicas             state = af.average_params(state, mesh)

Accelerate's `local_sgd.step()` runs once per *micro-batch* (every batch inside `accumulate`), so its
`local_sgd_steps` counts micro-batches; `sync_every` counts updates: `sync_every = local_sgd_steps // ga`.
Each process's `metrics["loss"]` is its own (the point of local SGD is to not communicate every step).
Ends with `CHECK loss falls and the replicas end equal: OK` (else FAILED, exit status 1).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import accelfn as af


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def make_data(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return {"x": x, "y": x[:, :1] - 0.5 * x[:, 1:2] + x[:, 2:3].sin() + 0.05 * torch.randn(n, 1, generator=g)}


def loss_fn(model, batch):
    return af.losses.mse(model(batch["x"]), batch["y"])


def build(mesh, *, lr: float, accumulation: int, local_sgd_steps: int, batch_size: int, seed: int):
    """The step, its state and this process's loader (`batch_size` rows per process per update)."""
    if local_sgd_steps % accumulation:
        raise SystemExit(
            f"--local-sgd-steps ({local_sgd_steps}) must be a multiple of --accumulation ({accumulation})"
        )
    step = af.train_step(loss_fn, af.optim.adamw(lr, weight_decay=0.0))
    if accumulation > 1:
        step = af.accumulate(step, accumulation)
    step = af.shard(step, mesh, strategy="local_sgd", sync_every=local_sgd_steps // accumulation)
    loader = af.data.DataLoader(
        make_data(512, seed), batch_size=batch_size, mesh=mesh, shuffle=True, seed=seed
    )
    return step, step.init(make_model(seed), seed=seed), loader


def train(step, state, batches):
    """Train on `batches`; return the state and this process's loss at each update."""
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"].item())
    return state, losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--local-sgd-steps", type=int, default=8, help="micro-batches between averagings (Accelerate's)"
    )
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per update")
    p.add_argument("--batch-size", type=int, default=16, help="rows per process per update")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    with af.Mesh.from_env() as mesh:
        step, state, loader = build(
            mesh,
            lr=args.lr,
            accumulation=args.accumulation,
            local_sgd_steps=args.local_sgd_steps,
            batch_size=args.batch_size,
            seed=args.seed,
        )
        losses = []
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            state, epoch_losses = train(step, state, loader)
            losses += epoch_losses
        state = af.average_params(state, mesh)  # as leaving Accelerate's `with LocalSGD(...)` block
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        af.dist.print(f"{len(losses)} updates, loss {first:.4f} -> {last:.4f} (process 0's)")
        # every process now holds the same params: compare a fingerprint over the processes
        fingerprint = torch.stack([p.double().sum() for p in state.params.values()])
        spread = af.dist.all_reduce(fingerprint, op="max") - af.dist.all_reduce(fingerprint, op="min")
        ok = last < 0.5 * first and float(spread.abs().max()) <= 1e-6
        af.dist.print(f"replica spread after the final averaging: {float(spread.abs().max()):.1e}")
        af.dist.print("CHECK loss falls and the replicas end equal:", "OK" if ok else "FAILED")
        if not ok:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
