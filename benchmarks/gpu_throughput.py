"""GPU training throughput of a Llama-style model: a plain PyTorch loop, accelerate and accelfn side by side.

    python benchmarks/gpu_throughput.py                          # 0.9B model, batch 8 x 2048 (~15-25 min on an H100)
    python benchmarks/gpu_throughput.py --model 0.4b --steps 20 --loss-steps 100 --budget 300 \
        --markdown runs/gpu_throughput.md                        # what benchmarks/verify_gpu.sh runs
    python benchmarks/gpu_throughput.py --device cpu --model tiny --steps 2 --loss-steps 0   # smoke test

Every configuration runs in a fresh process (this script again, with `--one CONFIG`, printing one JSON line),
so compile caches in memory, allocator state and peak-memory counters do not leak from one row to the next.
All rows train the same model (built from a config with `torch.manual_seed(0)`, directly on the device,
except the row that builds it on the CPU and lets `af.shard` move it) on the same 8 batches of random tokens,
cycled, with AdamW (lr 3e-4, weight decay 0.1) and gradient clipping at 1.0, in bf16 autocast (fp32 master
weights). Each row reports tokens/s (median step time over `--steps` steps after `--warmup` warm-up steps,
which include compilation), the ratio to the plain compiled loop, MFU (6 * N params * tokens/s over the
device's dense bf16 peak: H100/H200 989, A100 312 TFLOP/s) and peak memory (`torch.cuda.max_memory_allocated`;
peak RSS on the CPU). The rows marked in LOSS_ROWS go on training to `--loss-steps` steps and report the mean
loss of the first and of the last 10 steps: bf16 against fp8, plain loop against accelfn.

A configuration that fails (or runs past `--timeout`, or produces a non-finite loss) prints its error in its
row and the run goes on; with `--budget SECONDS`, configurations that would start after the budget is spent
are listed as not run (a configuration the budget cuts short is listed as stopped, not failed). The exit
status is 1 if any row failed, else 0. Without CUDA the script exits 0 with a
message, unless `--device cpu` is given (fp8 rows are then skipped: FP8 matmuls need an NVIDIA GPU of
compute capability 8.9+).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
LR, WEIGHT_DECAY, CLIP = 3e-4, 0.1, 1.0

MODELS: dict[str, dict[str, int]] = {
    # ~0.89B parameters (untied embeddings)
    "0.9b": dict(
        hidden=2048, layers=16, heads=16, kv_heads=8, intermediate=5632, vocab=32000, batch=8, seq=2048
    ),
    # ~0.16B parameters (the same shape, halved: compiles in a fraction of the time)
    "0.4b": dict(
        hidden=1024, layers=8, heads=16, kv_heads=8, intermediate=2816, vocab=32000, batch=8, seq=1024
    ),
    # for a smoke test on the CPU
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256, batch=4, seq=32),
}

# name -> label; the table lists the rows in this order
CONFIGS: dict[str, str] = {
    "plain-compile": "plain loop: bf16 autocast, fused AdamW, `torch.compile(model)`",
    "plain-eager": "plain loop: bf16 autocast, fused AdamW, eager",
    "plain-fp8": "plain loop + torchao `convert_to_float8_training` (tensorwise), compiled",
    "plain-accum4": "plain loop, 4 micro-batches, compiled",
    "accelerate-inductor": 'accelerate (`mixed_precision="bf16"`, `dynamo_backend="inductor"`)',
    "accelerate-eager": 'accelerate (`mixed_precision="bf16"`), eager',
    "af-compile": "`af.compile(af.autocast(train_step, bf16))`",
    "af-eager": "`af.autocast(train_step, bf16)`, eager",
    "af-fp8": '`af.compile(af.autocast_fp8(..., recipe="tensorwise"))`, model built on the GPU',
    "af-fp8-cpu-built": "`af.compile(af.shard(af.autocast_fp8(...)))`, model built on the CPU under shard",
    "af-accum4": "`af.compile(af.accumulate(..., 4))`",
    "af-fsdp-compile": '`af.compile(af.shard(..., strategy="fsdp"))`, 1-process mesh',
    "af-fsdp-eager": '`af.shard(..., strategy="fsdp")`, eager, 1-process mesh',
    "af-offload": "`af.offload(...)`, eager",
    "af-offload-delayed": "`af.offload(..., delayed_update_from=0)`, eager (update overlapped, one step late)",
}
# the order the configurations run in: the baseline first, then what matters most if the budget runs out
RUN_ORDER = [
    "plain-compile", "af-compile", "af-fp8", "af-fp8-cpu-built", "plain-eager", "af-eager", "plain-fp8",
    "accelerate-inductor", "af-accum4", "af-fsdp-compile", "af-offload", "af-offload-delayed", "af-fsdp-eager",
    "accelerate-eager", "plain-accum4",
]  # fmt: skip
assert sorted(RUN_ORDER) == sorted(CONFIGS)
FP8_ROWS = {"plain-fp8", "af-fp8", "af-fp8-cpu-built"}
LOSS_ROWS = {"plain-compile", "plain-fp8", "af-compile", "af-fp8", "af-fp8-cpu-built", "af-fsdp-compile"}
BASELINE = "plain-compile"
RESULT = "RESULT "


# ---------------------------------------------------------------- one configuration (the child process)


def build(spec: dict[str, int], device: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
        max_position_embeddings=spec["seq"], use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(cfg)


def make_batches(spec: dict[str, int], device: Any, n: int = 8) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(0)  # on the CPU: the same tokens on every device
    return [
        torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=g).to(device)
        for _ in range(n)
    ]


def plain_fp8_filter() -> Callable[[Any, str], bool]:
    """What torchtitan does: torchao's auto filter (dims divisible by 16, and only shapes that gain from FP8 on
    an H100), with the output layer kept in bf16. accelfn's default on FP8 hardware is the same rule, with the
    first Linear kept in bf16 too."""
    from torch import nn

    try:
        from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

        return _auto_filter_for_recipe("tensorwise", filter_fqns=["lm_head"])  # type: ignore[no-any-return]
    except ImportError:  # a torchao without it: every eligible Linear but the output layer
        return lambda m, fqn: (
            isinstance(m, nn.Linear)
            and m.in_features % 16 == 0
            and m.out_features % 16 == 0
            and fqn != "lm_head"
        )


def count_fp8(model: Any) -> int:
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


def ce(logits: Any, ids: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


Runner = tuple[Callable[[Any], Any], int, dict[str, Any]]  # one step, parameter count, notes


def plain_runner(name: str, spec: dict[str, int], device: Any) -> Runner:
    import torch

    model = build(spec, device)
    n_params = sum(p.numel() for p in model.parameters())
    if name == "plain-fp8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                   module_filter_fn=plain_fp8_filter())  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    forward = model if name == "plain-eager" else torch.compile(model)
    micro = 4 if name == "plain-accum4" else 1

    def one(ids: Any) -> Any:
        total = torch.zeros((), device=ids.device)
        parts = ids.chunk(micro)
        for part in parts:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = forward(input_ids=part).logits
            loss = ce(logits, part) / len(parts)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return one, n_params, {"fp8_linears": count_fp8(model)}


def accelerate_runner(name: str, spec: dict[str, int], device: Any) -> Runner:
    import torch
    from accelerate import Accelerator

    kwargs: dict[str, Any] = {"dynamo_backend": "inductor"} if name == "accelerate-inductor" else {}
    acc = Accelerator(mixed_precision="bf16", cpu=device.type == "cpu", **kwargs)
    model = build(spec, device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    model, opt = acc.prepare(model, opt)

    def one(ids: Any) -> Any:
        loss = ce(model(input_ids=ids).logits, ids)
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return one, n_params, {}


def accelfn_runner(name: str, spec: dict[str, int], device: Any) -> Runner:
    import torch

    import accelfn as af

    def loss_fn(m: Any, ids: Any) -> Any:
        return af.losses.cross_entropy(m(input_ids=ids).logits[:, :-1], ids[:, 1:])

    step = af.autocast(af.train_step(loss_fn, af.optim.adamw(LR, weight_decay=WEIGHT_DECAY), clip_grad_norm=CLIP),
                       torch.bfloat16)  # fmt: skip
    if name in ("af-fp8", "af-fp8-cpu-built"):
        step = af.autocast_fp8(step, backend="torchao", recipe="tensorwise")
    if name == "af-accum4":
        step = af.accumulate(step, 4)
    if name in ("af-fsdp-compile", "af-fsdp-eager", "af-fp8-cpu-built"):
        mesh = af.Mesh({"dp": -1}, device=device.type)  # a world of one process (in-memory store)
        step = af.shard(step, mesh, strategy="ddp" if name == "af-fp8-cpu-built" else "fsdp")
    if name == "af-offload":
        step = af.offload(step)
    if name == "af-offload-delayed":
        step = af.offload(step, delayed_update_from=0)
    if name not in ("af-eager", "af-fsdp-eager", "af-offload", "af-offload-delayed"):
        step = af.compile(step)
    model = build(spec, "cpu" if name == "af-fp8-cpu-built" else device)
    n_params = sum(p.numel() for p in model.parameters())
    state = [step.init(model)]

    def one(ids: Any) -> Any:
        state[0], metrics = step(state[0], ids)
        return metrics["loss"]

    return one, n_params, {"desc": repr(step), "fp8_linears": count_fp8(step.model)}


def run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    out: dict[str, Any] = {"config": name, "torch": torch.__version__}
    if cuda:
        torch.cuda.set_device(0)
        out["device_name"] = torch.cuda.get_device_name()
        if name in FP8_ROWS and torch.cuda.get_device_capability() < (8, 9):
            return {**out, "skipped": "FP8 needs compute capability 8.9+"}
        torch.cuda.reset_peak_memory_stats()
    else:
        out["device_name"] = "CPU"
    spec = MODELS[args.model]
    batches = make_batches(spec, device)
    runner = (
        plain_runner
        if name.startswith("plain")
        else accelerate_runner
        if name.startswith("accel")
        else accelfn_runner
    )
    one, n_params, notes = runner(name, spec, device)
    steps, warmup = args.steps, args.warmup
    if name.startswith("af-offload"):  # seconds per step at 0.9B: fewer steps
        steps, warmup = max(3, steps // 4), 1
    total = max(warmup + steps, args.loss_steps if name in LOSS_ROWS else 0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times, losses = [], []
    sync()
    for i in range(total):
        t0 = time.perf_counter()
        loss = one(batches[i % len(batches)])
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"loss is {losses[-1]} at step {i + 1}")
    med = statistics.median(times[warmup : warmup + steps])
    if cuda:
        peak, mem = torch.cuda.max_memory_allocated() / 2**30, "allocated"
    else:
        import resource

        peak, mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "RSS"
    out.update(n_params=n_params, tokens=spec["batch"] * spec["seq"], step_s=med, peak_gib=peak, memory=mem,
               steps=steps, first_step_s=times[0], total_steps=total, **notes,
               loss_first10=statistics.mean(losses[:10]), loss_last10=statistics.mean(losses[-10:]))  # fmt: skip
    out["tokens_s"] = out["tokens"] / med
    return out


def child(args: argparse.Namespace) -> None:
    try:
        result = run_one(args.one, args)
    except BaseException as e:  # noqa: BLE001 - report everything, including KeyboardInterrupt from a kill
        traceback.print_exc()
        msg = " ".join(f"{type(e).__name__}: {e}".split())
        result = {"config": args.one, "error": msg[:400]}
    sys.stdout.flush()
    print(RESULT + json.dumps(result), flush=True)


# ---------------------------------------------------------------- the driver (the parent process)


class Terminated(Exception):
    pass


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated(f"signal {signum}")


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def spawn(
    name: str, args: argparse.Namespace, timeout: float, budget_bound: bool
) -> tuple[dict[str, Any], str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", name, "--model", args.model, "--device", args.device,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--loss-steps", str(args.loss_steps)]  # fmt: skip
    # a world of one process: not the launcher's rendezvous, if this script itself runs under one
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                             "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")}  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # fmt: skip  # its own group: a timeout kills its workers too
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        output, _ = proc.communicate()
        if budget_bound:  # stopped by the budget, not by --timeout: not a failure
            return {
                "config": name,
                "skipped": f"stopped after {timeout:.0f} s: the time budget ran out",
            }, output
        return {"config": name, "error": f"timed out after {timeout:.0f} s (--timeout)"}, output
    except BaseException:
        _kill_group(proc)
        proc.communicate()
        raise
    lines = [ln for ln in output.splitlines() if ln.startswith(RESULT)]
    if lines:
        return json.loads(lines[-1][len(RESULT) :]), output
    tail = [ln.strip() for ln in output.splitlines() if ln.strip()][-1:] or ["no output"]
    return {"config": name, "error": f"exit code {proc.returncode}: {tail[0][:300]}"}, output


def _peak_tflops(device_name: str) -> tuple[str, float] | None:
    return next(((k, v) for k, v in PEAK_BF16_TFLOPS.items() if k in device_name), None)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def render(
    args: argparse.Namespace,
    results: dict[str, dict[str, Any]],
    names: list[str],
    not_run: str = "time budget spent",
) -> str:
    spec = MODELS[args.model]
    done = [r for r in results.values() if "tokens_s" in r]
    n = next((r["n_params"] for r in done), None)
    dev = next((r["device_name"] for r in results.values() if "device_name" in r), args.device)
    torch_v = next((r["torch"] for r in results.values() if "torch" in r), _version("torch"))
    peak = _peak_tflops(dev) if args.device == "cuda" else None
    size = (f"{n / 1e9:.2f}B params, " if n >= 1e8 else f"{n / 1e6:.2f}M params, ") if n else ""
    lines = [
        f"# Training throughput: {dev}, model {args.model} ({size}hidden {spec['hidden']}, {spec['layers']} layers, "
        f"{spec['heads']}/{spec['kv_heads']} heads, vocab {spec['vocab']}), batch {spec['batch']} x {spec['seq']}",
        "",
        f"torch {torch_v}, torchao {_version('torchao')}, transformers {_version('transformers')}, accelerate "
        f"{_version('accelerate')}. AdamW + clip {CLIP}, bf16 autocast, median of {args.steps} steps after "
        f"{args.warmup} warm-up steps (af.offload: {max(3, args.steps // 4)} after 1), each configuration in a "
        "fresh process. MFU: 6 * params * tokens/s over "
        + (
            f"{peak[1]:g} TFLOP/s (dense bf16 peak of the {peak[0]})."
            if peak
            else "the device's peak (unknown here: -)."
        ),
        "",
        f"| configuration | tokens/s | vs plain compiled | MFU | peak {'GiB' if args.device == 'cuda' else 'RSS GiB'} "
        "| ms/step | first step s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = results.get(BASELINE, {}).get("tokens_s")
    for name in [c for c in CONFIGS if c in names]:
        r, label = results.get(name), CONFIGS[name]
        if r is None:
            lines.append(f"| {label} | not run ({not_run}) | | | | | |")
        elif "skipped" in r:
            lines.append(f"| {label} | skipped: {r['skipped']} | | | | | |")
        elif "error" in r:
            lines.append(f"| {label} | **failed**: {r['error'].replace('|', '/')} | | | | | |")
        else:
            tok = r["tokens_s"]
            ratio = f"{tok / base:.3f}" if base else "-"
            mfu = f"{6 * r['n_params'] * tok / (peak[1] * 1e12):.1%}" if peak else "-"
            lines.append(f"| {label} | {tok:,.0f} | {ratio} | {mfu} | {r['peak_gib']:.1f} | {r['step_s'] * 1e3:.1f} "
                         f"| {r['first_step_s']:.1f} |")  # fmt: skip
    fp8 = [f"{name} {r['fp8_linears']}" for name, r in results.items() if r.get("fp8_linears")]
    if fp8:
        lines += ["", f"Linear layers in FP8: {', '.join(fp8)}."]
    loss_rows = [
        (name, results[name])
        for name in CONFIGS
        if name in LOSS_ROWS and "loss_last10" in results.get(name, {})
    ]
    if loss_rows and args.loss_steps:
        lines += ["", f"Loss after {args.loss_steps} steps on the same 8 batches of random tokens, cycled "
                  "(bf16 vs fp8, compiled):", "",
                  "| configuration | steps | mean loss, first 10 steps | mean loss, last 10 steps |",
                  "|---|---:|---:|---:|"]  # fmt: skip
        for name, r in loss_rows:
            lines.append(
                f"| {CONFIGS[name]} | {r['total_steps']} | {r['loss_first10']:.4f} | {r['loss_last10']:.4f} |"
            )
        bf16, fp8 = results.get("af-compile", {}), results.get("af-fp8", {})
        if "loss_last10" in bf16 and "loss_last10" in fp8:
            lines += [
                "",
                f"accelfn fp8 - bf16, last 10 steps: {fp8['loss_last10'] - bf16['loss_last10']:+.4f}",
            ]
    return "\n".join(lines) + "\n"


def parent(args: argparse.Namespace) -> int:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_throughput: no CUDA GPU here; nothing to measure (pass --device cpu --model tiny for a smoke test)"
        )
        return 0
    names = [c.strip() for c in args.configs.split(",") if c.strip()] if args.configs else RUN_ORDER
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        print(
            f"gpu_throughput: unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}",
            file=sys.stderr,
        )
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    start = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    logs = Path(args.logs) if args.logs else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)

    def write(not_run: str = "time budget spent") -> None:
        if args.markdown:
            Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
            Path(args.markdown).write_text(render(args, results, names, not_run))

    print(
        f"# gpu_throughput: model {args.model} on {args.device}; configurations: {', '.join(names)}",
        flush=True,
    )
    current = None
    try:
        for name in names:
            if args.device == "cpu" and name in FP8_ROWS:
                results[name] = {
                    "config": name,
                    "skipped": "fp8 needs an NVIDIA GPU (compute capability 8.9+)",
                }
            else:
                left = args.budget - (time.monotonic() - start) if args.budget else float("inf")
                if left < args.min_left:
                    print(f"{name}: not run ({left:.0f} s of the budget left)", flush=True)
                    continue
                t0, current = time.monotonic(), name
                results[name], output = spawn(name, args, min(args.timeout, left), left < args.timeout)
                current = None
                results[name]["wall_s"] = time.monotonic() - t0
                if logs:
                    (logs / f"{name}.log").write_text(output)
                elif "error" in results[name]:
                    print(output[-4000:], file=sys.stderr)
            r = results[name]
            brief = (f"{r['tokens_s']:,.0f} tokens/s, {r['step_s'] * 1e3:.1f} ms/step, peak {r['peak_gib']:.1f} GiB, "
                     f"loss {r['loss_first10']:.3f} -> {r['loss_last10']:.3f}" if "tokens_s" in r
                     else f"skipped: {r['skipped']}" if "skipped" in r else f"FAILED: {r['error']}")  # fmt: skip
            wall = f" ({r['wall_s']:.0f} s)" if "wall_s" in r else ""
            print(f"{name}: {brief}{wall}", flush=True)
            write()
    except (Terminated, KeyboardInterrupt) as e:
        print(f"gpu_throughput: stopped ({e or 'interrupted'}); writing what was measured", flush=True)
        if current:
            results[current] = {"config": current, "error": f"stopped ({e or 'interrupted'}) while running"}
        write("the run was stopped")
        print(render(args, results, names, "the run was stopped"))
        return 1
    write()
    print()
    print(render(args, results, names))
    failed = [n for n, r in results.items() if "error" in r]
    ran = [n for n, r in results.items() if "tokens_s" in r]
    skipped = [n for n in names if n not in ran and n not in failed]
    print(f"gpu_throughput: {len(ran)} of {len(names)} configurations measured; failed: {', '.join(failed) or 'none'}; "
          f"skipped or not run: {', '.join(skipped) or 'none'} ({time.monotonic() - start:.0f} s)")  # fmt: skip
    return 1 if failed else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="0.9b")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (they include compilation)")
    p.add_argument(
        "--loss-steps", type=int, default=200, help="steps the loss rows train for (0: as many as timed)"
    )
    p.add_argument("--configs", help=f"comma-separated subset, run in the order given: {', '.join(CONFIGS)}")
    p.add_argument("--markdown", help="write the table to this file (rewritten after every configuration)")
    p.add_argument("--logs", help="folder for each configuration's full output (default: failures to stderr)")
    p.add_argument("--budget", type=float, default=0, help="seconds for the whole run; 0: no limit")
    p.add_argument("--timeout", type=float, default=900, help="seconds for one configuration")
    p.add_argument(
        "--min-left", type=float, default=25, help="with --budget: start no configuration with less left"
    )
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        child(args)
        return
    sys.exit(parent(args))


if __name__ == "__main__":
    main()
