"""GPU training throughput: a ~1B-parameter Llama-style model, bf16 vs torchao fp8, eager vs compiled.

    python benchmarks/gpu_throughput.py [--steps 30 --loss-steps 200]

Needs an NVIDIA GPU (H100/H200 for fp8); exits with a message elsewhere. For each configuration it reports
tokens/s, MFU (6 * params * tokens/s over the GPU's dense bf16 peak) and peak memory; with
`--loss-steps N` it also trains bf16 and fp8 for N steps on the same data and compares the final losses.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import accelfn as af

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def build(seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=seq, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).cuda()


def loss_fn(m, ids):
    return af.losses.cross_entropy(m(input_ids=ids).logits[:, :-1], ids[:, 1:])


def make_step(kind: str, compiled: bool):
    step = af.autocast(af.train_step(loss_fn, af.optim.adamw(3e-4, weight_decay=0.1), clip_grad_norm=1.0),
                       torch.bfloat16)
    if kind != "bf16":
        step = af.autocast_fp8(step, backend="torchao", recipe=kind.split("-")[1])
    if compiled:
        step = af.compile(step)
    return step


def run(kind: str, compiled: bool, batches, steps: int):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step = make_step(kind, compiled)
    state = step.init(build(batches[0].shape[1]))
    n_params = sum(p.numel() for p in state.params.values())
    for b in batches[:3]:  # warm-up / compile
        state, m = step(state, b)
    torch.cuda.synchronize()
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, batches[i % len(batches)])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    tokens = batches[0].numel() / med
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), float("nan"))
    mfu = 6 * n_params * tokens / (peak * 1e12)
    del state, step
    return tokens, mfu, torch.cuda.max_memory_allocated() / 2**30, n_params


def loss_curve(kind: str, batches, n: int) -> float:
    step = make_step(kind, compiled=True)
    state = step.init(build(batches[0].shape[1]))
    losses = []
    for i in range(n):
        state, m = step(state, batches[i % len(batches)])
        losses.append(m["loss"].item())
    return statistics.mean(losses[-10:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--loss-steps", type=int, default=200)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_throughput: no CUDA GPU here; nothing to measure")
        sys.exit(0)
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randint(0, 32000, (args.batch, args.seq), device="cuda", generator=g) for _ in range(8)]
    print(f"# gpu_throughput: {torch.cuda.get_device_name()}, torch {torch.__version__}, batch {args.batch} x "
          f"seq {args.seq}")
    print("| config | tokens/s | MFU | peak memory GiB |\n|---|---:|---:|---:|")
    base = None
    for kind in ("bf16", "fp8-tensorwise", "fp8-rowwise"):
        for compiled in (False, True):
            try:
                tok, mfu, mem, n = run(kind, compiled, batches, args.steps)
            except Exception as e:  # report and go on (e.g. fp8 on a GPU without it)
                print(f"| {kind} {'compiled' if compiled else 'eager'} | failed: {type(e).__name__}: {e} | | |")
                continue
            base = base or tok
            print(f"| {kind} {'compiled' if compiled else 'eager'} ({n / 1e9:.2f}B params) | {tok:,.0f} "
                  f"({tok / base:.2f}x) | {mfu:.1%} | {mem:.1f} |")
    if args.loss_steps:
        bf16, fp8 = loss_curve("bf16", batches, args.loss_steps), loss_curve("fp8-tensorwise", batches, args.loss_steps)
        print(f"\nloss after {args.loss_steps} steps (mean of last 10): bf16 {bf16:.4f}, fp8 {fp8:.4f} "
              f"({(fp8 - bf16) / bf16:+.2%})")


if __name__ == "__main__":
    main()
