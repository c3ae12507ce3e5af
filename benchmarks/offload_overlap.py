"""Does `af.offload(..., delayed_update_from=0)` overlap the host update with the forward and backward? (CPU)

    python benchmarks/offload_overlap.py [--batch 8 --rounds 7 --steps 5]

A CPU stand-in for a GPU run: the "device" work (forward and backward) runs on the calling thread with one
intra-op thread, the host update (torch's fused CPU AdamW) on one other thread, so on a 2-core machine the two can
run at the same time as they would on a GPU and its host. Model: 12 x Linear(1024, 1024) (12.6M params), MSE
loss, AdamW. Runners, in interleaved rounds in a rotating order: the plain step (update in place), `af.offload`
with its streaming update (copies out, host update, copies back: what runs on a GPU), and the delayed update.
Also times the forward+backward and the fused AdamW update alone. The delayed step is worth its one-step-stale
gradients when its time approaches max(forward+backward, update) instead of their sum.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import accelfn as af


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(12)])


def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(m(b[0]), b[1])


def runner(kind: str) -> Callable[[Any], None]:
    step = af.train_step(loss_fn, af.optim.adamw(1e-3, weight_decay=0.01))
    if kind != "plain":
        step = af.offload(step, delayed_update_from=0 if kind == "delayed" else None)
    state = [step.init(model())]
    if kind != "plain":
        step.plan.updater.always_stream = True  # the GPU's data path: host copies, host update, copies back
        step.plan.updater.threads = 1

    def one(batch: Any) -> None:
        state[0], _ = step(state[0], batch)

    return one


def parts(batch: Any) -> tuple[float, float]:
    """ms of the forward+backward alone and of the fused AdamW host update alone (medians of 10)."""
    m = model()
    params = [p.detach().clone() for p in m.parameters()]
    grads = [torch.randn_like(p) for p in params]
    mu, nu = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    count = torch.tensor(1.0)

    def update() -> None:
        torch._fused_adamw_(params, grads, mu, nu, [], [count] * len(params), lr=1e-3, beta1=0.9, beta2=0.999,
                            weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)  # fmt: skip

    def fwd_bwd() -> None:
        loss_fn(m, batch).backward()

    out = []
    for f in (fwd_bwd, update):
        f()
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times) * 1e3)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--steps", type=int, default=5, help="steps per round (the round's time / steps is one sample)"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    batches = [(torch.randn(args.batch, 1024), torch.randn(args.batch, 1024)) for _ in range(4)]
    names = {"plain": "plain step (update in place)", "streaming": "`af.offload`, streaming update",
             "delayed": "`af.offload(delayed_update_from=0)`"}  # fmt: skip
    runners = {k: runner(k) for k in names}
    for one in runners.values():  # warm up (allocations, first-step copies)
        for b in batches[:2]:
            one(b)
    samples: dict[str, list[float]] = {k: [] for k in names}
    order = list(names)
    for r in range(args.rounds):
        for k in order[r % len(order) :] + order[: r % len(order)]:
            t0 = time.perf_counter()
            for i in range(args.steps):
                runners[k](batches[i % len(batches)])
            samples[k].append((time.perf_counter() - t0) / args.steps * 1e3)
    fb, upd = parts(batches[0])
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"# {platform.machine()}, {len(__import__('os').sched_getaffinity(0))} cores, torch {torch.__version__}; "
          f"batch {args.batch}, {args.rounds} rounds of {args.steps} steps")  # fmt: skip
    print(f"forward+backward alone {fb:.2f} ms, fused AdamW host update alone {upd:.2f} ms "
          f"(sum {fb + upd:.2f}, max {max(fb, upd):.2f})\n")  # fmt: skip
    print("| runner | ms/step | ratio to the streaming update |\n|---|---:|---:|")
    for k, label in names.items():
        print(f"| {label} | {med[k]:.2f} | {med[k] / med['streaming']:.3f} |")


if __name__ == "__main__":
    main()
