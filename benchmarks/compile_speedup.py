"""af.compile on CPU: a tiny GPT-2 train step, eager vs compiled (whole step and per-block regions).

    python benchmarks/compile_speedup.py [--steps 20]

Reports the first-step (compile) time and the median steady-state step time of: eager `af.train_step`,
`af.compile(step)`, `af.compile(step, regions="blocks")`, and — as the baseline the design measured —
`torch.compile(model)` by hand with a fused AdamW outside. It also prints the ceiling any compiler has
here: the step's matmul FLOPs (counted with `torch.utils.flop_counter`) at this CPU's measured fp32 GEMM
rate give the time the matmuls alone take, which compilation cannot shorten.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import accelfn as af


def model_and_batches():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
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
    return GPT2LMHeadModel(cfg), [torch.randint(0, 1024, (8, 128)) for _ in range(4)]


def af_loss(m, ids):
    return af.losses.cross_entropy(m(input_ids=ids).logits[:, :-1], ids[:, 1:])


def time_af(step, model, batches, steps):
    torch._dynamo.reset()
    state = step.init(copy.deepcopy(model))
    t0 = time.perf_counter()
    state, m = step(state, batches[0])
    first = time.perf_counter() - t0
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, batches[i % len(batches)])
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times), m["loss"].item()


def time_hand_compiled(model, batches, steps):
    torch._dynamo.reset()
    m = copy.deepcopy(model)
    cm = torch.compile(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)

    def one(ids):
        logits = cm(input_ids=ids).logits
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 1024), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    t0 = time.perf_counter()
    one(batches[0])
    first = time.perf_counter() - t0
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        loss = one(batches[i % len(batches)])
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times), loss.item()


def matmul_floor(model, batches) -> tuple[float, float]:
    """(matmul GFLOP per step, this CPU's fp32 GEMM rate in GFLOP/s on the step's shapes)."""
    from torch.utils.flop_counter import FlopCounterMode

    step = af.train_step(af_loss, af.optim.adamw(1e-3))
    state = step.init(copy.deepcopy(model))
    with FlopCounterMode(display=False) as counter:
        step(state, batches[0])
    gflop = counter.get_total_flops() / 1e9
    rates = []
    for n, k, m in [(1024, 256, 768), (1024, 256, 1024), (1024, 1024, 256), (256, 1024, 1024)]:
        a, b = torch.randn(n, k), torch.randn(k, m)
        for _ in range(3):
            a @ b
        t0 = time.perf_counter()
        for _ in range(20):
            a @ b
        rates.append(2 * n * k * m * 20 / (time.perf_counter() - t0) / 1e9)
    return gflop, max(rates)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    model, batches = model_and_batches()
    make = lambda: af.train_step(af_loss, af.optim.adamw(1e-3))  # noqa: E731
    rows = {
        "af.train_step (eager)": time_af(make(), model, batches, args.steps),
        "af.compile(step)": time_af(af.compile(make()), model, batches, args.steps),
        "af.compile(step, regions='blocks')": time_af(
            af.compile(make(), regions="blocks"), model, batches, args.steps
        ),
        "torch.compile(model) by hand": time_hand_compiled(model, batches, args.steps),
    }
    base = rows["af.train_step (eager)"][1]
    print(
        f"# compile_speedup: tiny GPT-2 (2L, d256, seq128, b8), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    print("| runner | first step (compile) s | ms/step (median) | speed-up vs eager |\n|---|---:|---:|---:|")
    for k, (first, med, _) in rows.items():
        print(f"| {k} | {first:.1f} | {med * 1e3:.1f} | {base / med:.2f}x |")
    gflop, rate = matmul_floor(model, batches)
    floor = gflop / rate
    print(
        f"\nmatmuls: {gflop:.2f} GFLOP per step (attention not counted); best fp32 GEMM rate here on these "
        f"shapes {rate:.0f} GFLOP/s -> {floor * 1e3:.1f} ms of matmul per step, so no compiler can beat "
        f"{base / floor:.2f}x eager on this machine (and only if everything else took no time)"
    )


if __name__ == "__main__":
    main()
