"""Per-step time of af.train_step vs a plain PyTorch loop vs accelerate's Accelerator loop (CPU).

    python benchmarks/step_overhead.py [--rounds 7 --steps 10]

Workloads: (a) a 4x1024 MLP, batch 64; (b) a tiny GPT-2 (2 layers, d=256, seq 128, batch 8).
All runners train copies of the same model on the same batches with AdamW (lr 1e-3, wd 0.01); rounds are
interleaved so that machine noise hits every runner alike. Prints median ms/step and the ratio to the
plain loop with `torch.optim.AdamW(foreach=True)`.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import accelfn as af


def mlp_workload() -> tuple[nn.Module, list, Callable, Callable]:
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.ReLU())][:-1])
    batches = [(torch.randn(64, 1024), torch.randn(64, 1024)) for _ in range(4)]

    def plain_loss(m, b):
        return nn.functional.mse_loss(m(b[0]), b[1])

    return model, batches, plain_loss, plain_loss


def gpt2_workload() -> tuple[nn.Module, list, Callable, Callable]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=1024, n_positions=128, n_embd=256, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model = GPT2LMHeadModel(cfg)
    batches = [torch.randint(0, 1024, (8, 128)) for _ in range(4)]

    def plain_loss(m, ids):
        logits = m(input_ids=ids).logits
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 1024), ids[:, 1:].reshape(-1))

    def af_loss(m, ids):
        return af.losses.cross_entropy(m(input_ids=ids).logits[:, :-1], ids[:, 1:])

    return model, batches, plain_loss, af_loss


def make_runners(model: nn.Module, plain_loss: Callable, af_loss: Callable) -> dict[str, Callable]:
    runners: dict[str, Callable] = {}

    def plain(fused: bool) -> Callable:
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01, foreach=not fused, fused=fused)

        def run(batch):
            loss = plain_loss(m, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()

        return run

    runners["plain (AdamW foreach)"] = plain(False)
    runners["plain (AdamW fused)"] = plain(True)

    step = af.train_step(af_loss, af.optim.adamw(1e-3, weight_decay=0.01))
    holder = {"state": step.init(copy.deepcopy(model))}

    def run_af(batch):
        holder["state"], _ = step(holder["state"], batch)

    runners["accelfn train_step"] = run_af

    try:
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)
        m, opt = acc.prepare(m, opt)

        def run_acc(batch):
            loss = plain_loss(m, batch)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()

        runners["accelerate Accelerator"] = run_acc
    except ImportError:
        print("accelerate not installed: skipping its column")
    return runners


def measure(runners: dict[str, Callable], batches: list, rounds: int, steps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in runners}
    for run in runners.values():  # warm-up
        for b in batches[:2]:
            run(b)
    for _ in range(rounds):
        for name, run in runners.items():
            for i in range(steps):
                t0 = time.perf_counter()
                run(batches[i % len(batches)])
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"# step_overhead: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, accelfn {af.__version__}")
    for name, make in [("MLP 4x1024, batch 64", mlp_workload), ("tiny GPT-2 (2L, d256, seq128, b8)", gpt2_workload)]:
        model, batches, plain_loss, af_loss = make()
        res = measure(make_runners(model, plain_loss, af_loss), batches, args.rounds, args.steps)
        base = res["plain (AdamW foreach)"]
        print(f"\n{name}")
        print("| runner | ms/step (median) | ratio to plain foreach |\n|---|---:|---:|")
        for k, v in res.items():
            print(f"| {k} | {v:.2f} | {v / base:.3f} |")


if __name__ == "__main__":
    main()
