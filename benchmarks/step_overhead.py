"""Per-step time of af.train_step vs a plain PyTorch loop vs accelerate's Accelerator loop (CPU).

    python benchmarks/step_overhead.py [--rounds 7 --steps 10]

Workloads: (a) a 4x1024 MLP, batch 64; (b) a tiny GPT-2 (2 layers, d=256, seq 128, batch 8).
All runners train copies of the same model on the same batches with AdamW (lr 1e-3, wd 0.01); rounds are
interleaved, in a rotating order, so that machine noise hits every runner alike. accelfn runs with several
batch forms (tuple, dict, list) and loss forms (a mean tensor, `af.Loss(total, count)`, `(loss, aux)`), and
every table is measured twice: rounds of 1 step (median step time) and rounds of `--round` steps (median
round time / steps), so no harness choice favours a runner. Prints ms/step and the ratio to the plain loop
with `torch.optim.AdamW(fused=True)`.

The first accelfn `init` on a CPU tunes glibc's malloc for the whole process (`tune_host_allocator`): the
plain loops below run with it too. `ACCELFN_HOST_ALLOCATOR=system` leaves glibc as it is (all runners are
then slower and the ratios depend on their interleaving: see docs/benchmarks.md).
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


def batch_forms(batches: list) -> dict[str, tuple[Callable, Callable]]:
    """accelfn variants for the MLP: (loss_fn, batch converter) per batch form and loss form."""
    mse = nn.functional.mse_loss
    return {
        "tuple, mean loss": (lambda m, b: mse(m(b[0]), b[1]), lambda b: b),
        "dict, af.Loss": (
            lambda m, b: af.Loss(mse(m(b["x"]), b["y"], reduction="sum"), b["x"].numel()),
            lambda b: {"x": b[0], "y": b[1]},
        ),
        "list, (loss, aux)": (lambda m, b: (mse(m(b[0]), b[1]), {"x_mean": b[0].mean()}), lambda b: list(b)),
    }


def gpt2_workload() -> tuple[nn.Module, list, Callable, Callable]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=1024,
        n_positions=128,
        n_embd=256,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    model = GPT2LMHeadModel(cfg)
    batches = [torch.randint(0, 1024, (8, 128)) for _ in range(4)]

    def plain_loss(m, ids):
        logits = m(input_ids=ids).logits
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 1024), ids[:, 1:].reshape(-1))

    def af_loss(m, ids):
        return af.losses.cross_entropy(m(input_ids=ids).logits[:, :-1], ids[:, 1:])

    return model, batches, plain_loss, af_loss


def make_runners(
    model: nn.Module,
    plain_loss: Callable,
    af_loss: Callable,
    forms: dict[str, tuple[Callable, Callable]] | None = None,
) -> dict[str, Callable]:
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

    runners["plain (AdamW fused)"] = plain(True)
    runners["plain (AdamW foreach)"] = plain(False)

    def accelfn(loss: Callable, convert: Callable) -> Callable:
        step = af.train_step(loss, af.optim.adamw(1e-3, weight_decay=0.01))
        holder = {"state": step.init(copy.deepcopy(model))}

        def run_af(batch):
            holder["state"], _ = step(holder["state"], convert(batch))

        return run_af

    if forms:
        for name, (loss, convert) in forms.items():
            runners[f"accelfn train_step ({name})"] = accelfn(loss, convert)
    else:
        runners["accelfn train_step"] = accelfn(af_loss, lambda b: b)

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


def measure(
    runners: dict[str, Callable], batches: list, rounds: int, steps: int, round_len: int
) -> dict[str, float]:
    """Median ms/step; `round_len` 1: each step timed alone, else rounds of `round_len` steps timed whole."""
    times: dict[str, list[float]] = {k: [] for k in runners}
    names = list(runners)
    for run in runners.values():  # warm-up
        for b in batches:
            run(b)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate who goes first
            run = runners[name]
            for i in range(max(steps // round_len, 1)):
                t0 = time.perf_counter()
                for j in range(round_len):
                    run(batches[(i * round_len + j) % len(batches)])
                times[name].append((time.perf_counter() - t0) / round_len)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--round", type=int, default=20, help="steps per timed round in the second table")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from accelfn.platforms.cpu import tune_host_allocator

    tuned = tune_host_allocator()  # what accelfn's first CPU step.init does; set now so every runner has it
    print(
        f"# step_overhead: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, accelfn {af.__version__}, glibc malloc tuned: {tuned}"
    )
    for name, make in [
        ("MLP 4x1024, batch 64", mlp_workload),
        ("tiny GPT-2 (2L, d256, seq128, b8)", gpt2_workload),
    ]:
        model, batches, plain_loss, af_loss = make()
        forms = batch_forms(batches) if make is mlp_workload else None
        runners = make_runners(model, plain_loss, af_loss, forms)
        single = measure(runners, batches, args.rounds, args.steps, 1)
        rounds = measure(runners, batches, args.rounds, args.steps, args.round)
        print(f"\n{name}")
        print(f"| runner | ms/step, steps timed alone | ratio | ms/step, rounds of {args.round} | ratio |")
        print("|---|---:|---:|---:|---:|")
        b1, b2 = single["plain (AdamW fused)"], rounds["plain (AdamW fused)"]
        for k in runners:
            print(
                f"| {k} | {single[k]:.2f} | {single[k] / b1:.3f} | {rounds[k]:.2f} | {rounds[k] / b2:.3f} |"
            )


if __name__ == "__main__":
    main()
