"""Where a training step's GPU time goes, by kind of kernel, eager against torch.compile (issue 30: the dry run's
time model splits a step the same way: GEMMs, attention, memory-bound kernels, the optimizer's update).

    python benchmarks/step_kernels.py --out runs/step_kernels.json     # 0.89B Llama, batch 8 x 2048, one GPU

The step is benchmarks/gpu_throughput.py's plain loop (transformers' Llama built from a config, bf16 autocast,
fused AdamW, clip 1.0, F.cross_entropy on the fp32 logits), eager and with `torch.compile(model)`. Each mode: 3
warm-up steps, the median of 10 timed steps (CUDA events), then 3 steps under torch.profiler, whose CUDA kernels
are summed by kind (by name: cuBLAS/CUTLASS GEMMs, flash attention, inductor's Triton kernels split into
pointwise and reductions, the fused AdamW, ATen's other kernels) per step; `idle` is the step's time less its
kernels' (the GPU waiting for the host). `--modes compile-skipmask` compiles with transformers' causal mask
skipped as it is outside torch.compile (`masking_utils._ignore_causal_mask_sdpa` made to answer True): SDPA gets
`is_causal` in place of the mask (docs/dry_run.md, "Predicted time against published runs", item 9).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics

import torch
import torch.nn.functional as F


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
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    if mode == "compile-skipmask":
        import transformers.masking_utils as masking

        masking._ignore_causal_mask_sdpa = lambda *args, **kwargs: True
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
    p.add_argument("--modes", default="eager,compile")
    args = p.parse_args()
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
