"""The largest batch that fits with `af.remat("full")`, `("selective")` and without remat, and its tokens/s.

    python benchmarks/remat_batch.py                                   # 0.9B model, seq 2048, on the GPU (~5-8 min)
    python benchmarks/remat_batch.py --markdown runs/remat_batch.md    # the table in a file too
    python benchmarks/remat_batch.py --device cpu --model tiny --max-batch 16   # smoke test (no memory limit)

The model is `benchmarks/gpu_throughput.py`'s Llama-style one (0.9B: hidden 2048, 16 layers, vocab 32k), trained
eagerly in bf16 autocast with AdamW and clipping at 1.0 by `af.train_step`, with `af.remat(step, policy)` or
without. For each policy the batch (rows of `seq` tokens) doubles from `--start` until a step runs out of
device memory (or `--max-batch` is reached), then bisects between the last batch that fit and the first that
did not, to a multiple of `--granularity`. Every trial runs in a fresh process (this script with `--one`), so an
out-of-memory error cannot leave the allocator fragmented for the next one; a trial runs 2 warm-up and
`--steps` timed steps and reports tokens/s (median step) and peak memory (`torch.cuda.max_memory_allocated`).
`--memory-gib` caps the memory a trial may use (`torch.cuda.set_per_process_memory_fraction`), to compare at a
smaller device's size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from gpu_throughput import CLIP, LR, MODELS, WEIGHT_DECAY, build  # noqa: E402

RESULT = "REMAT-RESULT "
POLICIES = ("none", "selective", "full")


def trial(policy: str, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import accelfn as af

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    spec = {**MODELS[args.model]}
    seq = args.seq or spec["seq"]
    spec["seq"] = seq
    if cuda:
        torch.cuda.set_device(0)
        if args.memory_gib:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * 2**30 / total))
    model = build(spec, device)
    n_params = sum(p.numel() for p in model.parameters())

    def loss_fn(m: Any, ids: Any) -> Any:
        return af.losses.cross_entropy(m(input_ids=ids).logits[:, :-1], ids[:, 1:])

    step = af.train_step(loss_fn, af.optim.adamw(LR, weight_decay=WEIGHT_DECAY), clip_grad_norm=CLIP)
    if policy != "none":
        step = af.remat(step, policy)
    step = af.autocast(step, torch.bfloat16)
    state = step.init(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec["vocab"], (batch, seq), generator=g).to(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for i in range(2 + args.steps):
        if cuda and i == 2:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        state, m = step(state, ids)
        loss = float(m["loss"])
        sync()
        times.append(time.perf_counter() - t0)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss {loss} at step {i + 1}")
    med = statistics.median(times[2:])
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    return {"policy": policy, "batch": batch, "fits": True, "tokens_s": batch * seq / med, "step_s": med,
            "peak_gib": peak, "n_params": n_params, "seq": seq, "desc": repr(step),
            "device_name": torch.cuda.get_device_name() if cuda else "CPU", "torch": torch.__version__}  # fmt: skip


def child(args: argparse.Namespace) -> None:
    policy, batch = args.one.split(":")
    try:
        result = trial(policy, int(batch), args)
    except Exception as e:  # noqa: BLE001 - an out-of-memory error is an answer, anything else is reported
        oom = "out of memory" in str(e).lower() or type(e).__name__ == "OutOfMemoryError"
        if not oom:
            traceback.print_exc()
        result = {"policy": policy, "batch": int(batch), "fits": False, "oom": oom,
                  "error": " ".join(f"{type(e).__name__}: {e}".split())[:300]}  # fmt: skip
    print(RESULT + json.dumps(result), flush=True)


def run_trial(policy: str, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", f"{policy}:{batch}", "--model", args.model,
           "--device", args.device, "--steps", str(args.steps), "--seq", str(args.seq),
           "--memory-gib", str(args.memory_gib)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {
            "policy": policy,
            "batch": batch,
            "fits": False,
            "oom": False,
            "error": f"timeout {args.timeout}s",
        }
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])  # type: ignore[no-any-return]
    tail = " ".join((proc.stderr or proc.stdout).split()[-40:])
    oom = "out of memory" in (proc.stderr or "").lower()
    return {
        "policy": policy,
        "batch": batch,
        "fits": False,
        "oom": oom,
        "error": f"exit {proc.returncode}: {tail}",
    }


def largest(policy: str, args: argparse.Namespace, log: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The largest batch that fits for `policy` (its trial's figures), or None if not even `--start` fits."""

    def attempt(batch: int) -> dict[str, Any]:
        r = run_trial(policy, batch, args)
        log.append(r)
        status = "fits" if r["fits"] else ("out of memory" if r.get("oom") else r.get("error", "failed"))
        print(
            f"  {policy:9s} batch {batch:4d}: {status}"
            + (f", {r['tokens_s']:,.0f} tokens/s, peak {r['peak_gib']:.1f} GiB" if r["fits"] else ""),
            flush=True,
        )
        if not r["fits"] and not r.get("oom"):
            raise RuntimeError(
                f"{policy} batch {batch} failed otherwise than out of memory: {r.get('error')}"
            )
        return r

    best, batch = None, args.start
    fail: int | None = None
    while batch <= args.max_batch:
        r = attempt(batch)
        if not r["fits"]:
            fail = batch
            break
        best, batch = r, batch * 2
    if best is None:
        return None
    lo = best["batch"]
    hi = fail if fail is not None else lo  # reached --max-batch: no bisection
    while hi - lo > args.granularity:
        mid = (lo + hi) // 2 // args.granularity * args.granularity
        if mid <= lo:
            break
        r = attempt(mid)
        if r["fits"]:
            best, lo = r, mid
        else:
            hi = mid
    best["capped"] = fail is None
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="0.9b")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--seq", type=int, default=0, help="tokens per row (default: the model's, 2048 for 0.9b)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--start", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=512)
    p.add_argument("--granularity", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--memory-gib", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--markdown")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        child(args)
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("remat_batch: no CUDA device (use --device cpu --model tiny for a smoke test)")
            return 0
    log: list[dict[str, Any]] = []
    rows = {}
    for policy in args.policies.split(","):
        print(f"{policy}:", flush=True)
        rows[policy] = largest(policy, args, log)
    first = next((r for r in rows.values() if r), None)
    lines = [
        "| remat | largest batch (rows × seq) | tokens/s at that batch | peak GiB |",
        "|---|---:|---:|---:|",
    ]
    for policy, r in rows.items():
        if r is None:
            lines.append(f"| {policy} | not even {args.start} | | |")
        else:
            more = "+ (the cap)" if r.get("capped") else ""
            lines.append(
                f"| {policy} | {r['batch']}{more} × {r['seq']} | {r['tokens_s']:,.0f} | {r['peak_gib']:.1f} |"
            )
    head = (f"{first['device_name']}, torch {first['torch']}, {args.model} model ({first['n_params'] / 1e9:.2f}B "
            f"params), eager bf16 autocast, AdamW + clip; {args.steps} timed steps per trial, each in a fresh "
            f"process; `python benchmarks/remat_batch.py {' '.join(sys.argv[1:])}`") if first else "no trial fit"  # fmt: skip
    table = "\n".join([head, "", *lines])
    print(table)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
