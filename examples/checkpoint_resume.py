"""Checkpoint, crash, resume -- and check that the resumed run equals an uninterrupted one, bit for bit.

    accelfn launch --nproc-per-node 2 --cpu examples/checkpoint_resume.py --stop-at 7     # "crashes" after step 7
    accelfn launch --nproc-per-node 2 --cpu examples/checkpoint_resume.py                 # resumes, then checks
    (python examples/checkpoint_resume.py ... for one process)

The run trains an MLP with dropout (random: it draws from the state's key) on a shuffled dataset through
`af.data.DataLoader`, over 2 epochs, and saves a checkpoint every `--save-every` steps with
`af.checkpoint.save(..., loader=loader)` (the loader's position is saved with the state; the last
`--keep` checkpoints are kept). `--stop-at K` makes the process stop after step K -- a simulated crash:
the steps after the last checkpoint are lost. The next run resumes from `af.checkpoint.latest(run_dir)`
(params, optimizer state, RNG key, step counter, and the loader mid-epoch), finishes the run, then trains
the same model uninterrupted from scratch in the same process and compares: every leaf of the final
state (params, optimizer moments, step, key) and every loss after the resume point must be *equal*.
Exits non-zero if they are not. `--fresh` deletes `--run-dir` first.
"""

from __future__ import annotations

import argparse
import shutil

import torch
from torch import nn

import accelfn as af


def make_run(mesh, seed: int, batch_size: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(200, 8, generator=g)
    data = {"x": x, "y": (x[:, :1] * x[:, 1:2] + x[:, 2:3]).sin()}
    loader = af.data.DataLoader(data, batch_size=batch_size, mesh=mesh, shuffle=True, seed=seed)
    opt = af.optim.adamw(af.optim.warmup_cosine(1e-2, warmup=5, total=2 * len(loader)), weight_decay=0.01)
    step = af.shard(
        af.train_step(lambda m, b: af.losses.mse(m(b["x"]), b["y"]), opt, clip_grad_norm=1.0), mesh
    )
    return step, step.init(model, seed=seed), loader


def train(step, state, loader, epochs: int, *, on_step=None):
    """Train until `epochs` epochs are done, from wherever `loader` is; return the state and the losses by step."""
    losses = {}
    while loader.state_dict()["epoch"] < epochs:
        epoch = loader.state_dict()["epoch"]
        for batch in loader:
            state, metrics = step(state, batch)
            losses[int(state.step)] = metrics["loss"].item()
            if on_step is not None and on_step(state, loader) == "stop":
                return state, losses, True
        if loader.state_dict()["epoch"] == epoch:  # the loader starts the next epoch at the next loop
            loader.set_epoch(epoch + 1)
    return state, losses, False


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default="runs/checkpoint_resume")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16, help="per process")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step: a simulated crash")
    p.add_argument("--fresh", action="store_true", help="delete --run-dir first")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    mesh = af.Mesh.from_env()
    if args.fresh and mesh.is_main:
        shutil.rmtree(args.run_dir, ignore_errors=True)
    af.dist.barrier()

    step, state, loader = make_run(mesh, args.seed, args.batch_size)
    path = af.checkpoint.latest(args.run_dir)
    if path is not None:
        state = af.checkpoint.load(path, like=state, loader=loader)
        resumed_at = int(state.step)
        af.dist.print(f"resumed from {path} (step {resumed_at}, loader at {loader.state_dict()})")
    else:
        resumed_at = 0
        af.dist.print(f"no checkpoint in {args.run_dir}: starting from scratch")

    def on_step(state, loader):
        n = int(state.step)
        if n % args.save_every == 0:
            af.checkpoint.save(f"{args.run_dir}/step-{n}", state, loader=loader, keep_last=args.keep)
            af.dist.print(f"step {n}: saved {args.run_dir}/step-{n}")
        if args.stop_at is not None and n >= args.stop_at:
            return "stop"
        return None

    state, losses, stopped = train(step, state, loader, args.epochs, on_step=on_step)
    if stopped:
        af.dist.print(
            f"step {int(state.step)}: simulated crash (--stop-at {args.stop_at}); steps after the last "
            f"checkpoint are lost. Run again without --stop-at to resume."
        )
        mesh.close()
        return

    # The reference: the same run, uninterrupted, in this process.
    ref_step, ref_state, ref_loader = make_run(mesh, args.seed, args.batch_size)
    ref_state, ref_losses, _ = train(ref_step, ref_state, ref_loader, args.epochs)
    mine, ref = af.tree.flatten_with_path(state), af.tree.flatten_with_path(ref_state)
    differ = [path for (path, a), (_, b) in zip(mine, ref) if not torch.equal(full(a), full(b))]
    loss_differ = [k for k in losses if losses[k] != ref_losses[k]]
    af.dist.print(
        f"final step {int(state.step)}, loss {losses[max(losses)]:.6f}; uninterrupted run: step "
        f"{int(ref_state.step)}, loss {ref_losses[max(ref_losses)]:.6f}"
    )
    af.dist.print(
        f"compared {len(mine)} state leaves and the losses of steps {min(losses)}-{max(losses)} "
        f"(resumed at step {resumed_at}): {len(differ)} leaves and {len(loss_differ)} losses differ"
    )
    ok = len(mine) == len(ref) and not differ and not loss_differ and int(state.step) == int(ref_state.step)
    af.dist.print(
        "CHECK resumed run equals the uninterrupted run bit for bit:", "OK" if ok else f"FAILED {differ[:5]}"
    )
    mesh.close()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
