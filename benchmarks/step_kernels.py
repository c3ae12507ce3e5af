"""Where a training step's GPU time goes, by kind of kernel, eager against torch.compile (issue 30: the dry run's
time model splits a step the same way: GEMMs, attention, memory-bound kernels, the optimizer's update).

    python benchmarks/step_kernels.py --out runs/step_kernels.json     # 0.89B Llama, batch 8 x 2048, one GPU

The step is benchmarks/gpu_throughput.py's plain loop (transformers' Llama built from a config, bf16 autocast,
fused AdamW, clip 1.0, F.cross_entropy on the fp32 logits), eager and with `torch.compile(model)`. Each mode: 3
warm-up steps, the median of 10 timed steps (CUDA events), then 3 steps under torch.profiler, whose CUDA kernels
are summed by kind (by name: cuBLAS/CUTLASS GEMMs, flash attention, inductor's Triton kernels split into
pointwise and reductions, the fused AdamW, ATen's other kernels) per step; `idle` is the step's time less its
kernels' (the GPU waiting for the host).

What SDPA gets is set by `--modes` (benchmarks/sdpa_calls.py's `MODES`, which records each mode's SDPA calls;
docs/dry_run.md, "Predicted time against published runs", item 9). Under torch.compile transformers (5.17-5.23)
always passes an explicit (batch, 1, seq, seq) mask: its packed-sequence detection cannot skip while tracing
(`masking_utils.find_packed_sequence_indices`), and then never asks `_ignore_causal_mask_sdpa`. So:

    eager                    is_causal=True, enable_gqa (no mask), as published
    eager-mask               the mask compile passes, eagerly (k/v repeated to 16 heads, no enable_gqa)
    compile                  as published: the mask
    compile-skipmask-ignore  the 2026-11-27 experiment: `_ignore_causal_mask_sdpa` answers True; still the mask
    compile-skipmask         that and no packed-sequence detection: is_causal=True, enable_gqa, as eager
    compile-causal           attn_implementation "sdpa_causal" (transformers' SDPA function with no mask function)

    python benchmarks/step_kernels.py --modes eager,eager-mask,compile,compile-skipmask --steps 5
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from sdpa_calls import MODES, llama_config, transformers_mode  # noqa: E402


def kind(name: str) -> str:
    n = name.lower()
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if n.startswith("triton_poi"):
        return "triton pointwise"
    if n.startswith(("triton_red", "triton_per")):
        return "triton reduction"
    if n.startswith("triton"):
        return "triton other"
    if "adam" in n:
        return "optimizer (fused adamw)"
    if "gemm" in n or "xmma" in n or "nvjet" in n or "cutlass" in n or "cublas" in n or "splitk" in n:
        return "gemm"
    if "multi_tensor" in n or "foreach" in n:
        return "foreach (clip)"
    if "memcpy" in n or "memset" in n:
        return "memcpy/memset"
    if "reduce" in n or "softmax" in n or "norm" in n or "cross_entropy" in n or "nll" in n:
        return "aten reduction"
    return "aten elementwise/other"


def run(mode: str, steps: int) -> dict:
    torch._dynamo.reset()
    with transformers_mode(mode) as patched:
        result = _run(mode, steps, patched["attn_implementation"])
        result["patched_calls"] = dict(patched["calls"])  # 0 calls: the patch was never reached
    return result


def _run(mode: str, steps: int, attn_implementation: str) -> dict:
    from transformers import LlamaForCausalLM

    cfg = llama_config("cuda", attn_implementation=attn_implementation)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    forward = torch.compile(model) if mode.startswith("compile") else model
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 32000, (8, 2048), generator=g).cuda() for _ in range(4)]

    def step(ids: torch.Tensor) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = forward(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, 32000).float(), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(3):
        step(batches[i % 4])
    torch.cuda.synchronize()
    times = []
    for i in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step(batches[i % 4])
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    prof_steps = 3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(prof_steps):
            step(batches[i % 4])
        torch.cuda.synchronize()
    by_kind: dict[str, float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    kernels: dict[str, float] = collections.Counter()
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", None)
        if t is None:
            t = getattr(evt, "self_cuda_time_total", 0)
        if not t:
            continue
        k = kind(evt.key)
        by_kind[k] += t / 1e3 / prof_steps  # ms per step
        count[k] += evt.count // prof_steps
        kernels[evt.key] += t / 1e3 / prof_steps
    step_ms = statistics.median(times)
    busy = sum(by_kind.values())
    return {
        "mode": mode,
        "attn_implementation": attn_implementation,
        "step_ms": step_ms,
        "tokens_per_s": 8 * 2048 / step_ms * 1e3,
        "kernels_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "kernel_counts": dict(count),
        "busy_ms": busy,
        "idle_ms": step_ms - busy,
        "top": sorted(((round(v, 3), k[:140]) for k, v in kernels.items()), reverse=True)[:40],
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="step_kernels.json")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--modes", default="eager,compile", help=f"comma-separated, of: {', '.join(MODES)}")
    args = p.parse_args()
    for mode in args.modes.split(","):
        if mode not in MODES:
            p.error(f"--modes: {mode!r} is not one of {', '.join(MODES)}")
    results = []
    for mode in args.modes.split(","):
        r = run(mode, args.steps)
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "top"}, indent=1), flush=True)
        for v, k in r["top"][:25]:
            print(f"  {v:9.3f} ms  {k}", flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
