"""Logging overhead: a training loop with no tracker vs `af.trackers` JSONL vs TensorBoard (CPU).

    python benchmarks/logging_overhead.py [--rounds 9 --steps 50 --log-every 10]

The same MLP step (4x1024, batch 64, AdamW) runs in interleaved rounds of `--steps` steps; each logging
runner calls `run.log({"loss": ..., "lr": ...}, step)` every step (tensor metrics, buffered, flushed every
`--log-every` calls, the default interval). Prints median ms/step and the ratio to the loop without a tracker.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch
from torch import nn

import accelfn as af


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.ReLU())][:-1])
    batches = [(torch.randn(64, 1024), torch.randn(64, 1024)) for _ in range(4)]
    folder = tempfile.mkdtemp(prefix="accelfn-logging-")
    runners = {}
    for name in ("none", "jsonl", "tensorboard"):
        step = af.train_step(lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), af.optim.adamw(1e-3))
        holder = {"state": step.init(copy.deepcopy(model)), "i": 0}
        run = None if name == "none" else af.trackers.open(f"{folder}/{name}", name, log_every=args.log_every)

        def go(batch, step=step, holder=holder, run=run):
            holder["state"], metrics = step(holder["state"], batch)
            holder["i"] += 1
            if run is not None:
                run.log({"loss": metrics["loss"], "lr": metrics["lr"]}, step=holder["i"])

        runners[name] = go
    for go in runners.values():
        for b in batches:
            go(b)
    times: dict[str, list[float]] = {k: [] for k in runners}
    names = list(runners)
    for r in range(args.rounds):
        for name in names[r % 3 :] + names[: r % 3]:
            t0 = time.perf_counter()
            for i in range(args.steps):
                runners[name](batches[i % len(batches)])
            times[name].append((time.perf_counter() - t0) / args.steps)
    base = statistics.median(times["none"])
    print(
        f"# logging_overhead: {torch.get_num_threads()} threads, torch {torch.__version__}, log_every "
        f"{args.log_every}, rounds of {args.steps} steps"
    )
    print("| runner | ms/step | ratio to no tracker |\n|---|---:|---:|")
    for k, v in times.items():
        print(f"| {k} | {statistics.median(v) * 1e3:.2f} | {statistics.median(v) / base:.3f} |")


if __name__ == "__main__":
    main()
