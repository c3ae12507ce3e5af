"""Tokens/s (and, on a GPU, peak memory) of accelfn's data and tensor parallelism, with and without remat,
side by side with the same parallelism written by hand in plain torch (torchtitan style) in the same processes.

    python benchmarks/parallelism.py [--nproc 4] [--steps 6] [--rounds 5] [--hidden 256] [--layers 4] [--seq 256]

For each configuration one job of `--nproc` processes is started with `accelfn launch` (CPU, gloo); in it both
runners train copies of the same Llama-style model (transformers' LlamaForCausalLM from a config) on the same
batches with AdamW and gradient clipping, in interleaved rounds (alternating which goes first) so that machine
noise hits both alike; the median round time per step is reported.

    configuration   accelfn                                            plain torch by hand
    ddp             af.shard(step, mesh)                               DistributedDataParallel
    fsdp            af.shard(step, mesh, strategy="fsdp")              fully_shard(block) per layer + root
    dp x tp         af.shard(step, Mesh({"dp": N/2, "tp": 2}), "fsdp") parallelize_module(HF plan) + fully_shard
    + remat         af.remat(step, "full")                             checkpoint_wrapper per decoder layer

Plain torch uses `torch.optim.AdamW(foreach=True)` and gradient clipping by the global norm (a norm per
DTensor mesh, combined: torch's `clip_grad_norm_` cannot mix FSDP x TP's meshes), loss = mean cross
entropy, the same model config and the same data.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ["ddp", "ddp+remat", "fsdp", "fsdp+remat", "dpxtp", "dpxtp+remat"]


def model_config(args: argparse.Namespace):  # noqa: ANN201
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=2048, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                       num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=args.seq, tie_word_embeddings=False, use_cache=False)  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import accelfn as af

    config = args.worker
    remat = config.endswith("+remat")
    kind = config.split("+")[0]
    world = int(os.environ["WORLD_SIZE"])
    shape = {"dp": world // 2, "tp": 2} if kind == "dpxtp" else {"dp": world}
    mesh = af.Mesh(shape, device="cpu")
    torch.manual_seed(0)
    cfg = model_config(args)
    rows = args.batch  # per data-parallel rank
    g = torch.Generator().manual_seed(1 + mesh.data_rank)
    batches = [torch.randint(0, cfg.vocab_size, (rows, args.seq), generator=g) for _ in range(2)]

    # ---- accelfn
    def loss_fn(model, ids):
        return af.losses.cross_entropy(model(input_ids=ids).logits[:, :-1], ids[:, 1:])

    step = af.train_step(loss_fn, af.optim.adamw(1e-4, weight_decay=0.1), clip_grad_norm=1.0)
    if remat:
        step = af.remat(step, "full")
    step = af.shard(step, mesh, strategy="ddp" if kind == "ddp" else "fsdp")
    torch.manual_seed(0)
    box = {"state": step.init(LlamaForCausalLM(cfg))}

    def run_accelfn(b: torch.Tensor) -> None:
        box["state"], _ = step(box["state"], b)

    # ---- plain torch, by hand
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    layers = list(model.model.layers)
    if kind == "dpxtp":
        from torch.distributed.tensor.parallel import parallelize_module

        from accelfn.transforms.shard.tensor_parallel import expand_plan, model_tp_plan

        parallelize_module(model, mesh.submesh("tp"), expand_plan(model, model_tp_plan(model), 2))
    if remat:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(layers):
            model.model.layers[i] = checkpoint_wrapper(layer)
    if kind == "ddp":
        plain = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        dp_mesh = mesh.submesh("dp")
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp_mesh)
        plain = fully_shard(model, mesh=dp_mesh)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)

    def run_plain(b: torch.Tensor) -> None:
        logits = plain(input_ids=b).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))
        loss.backward()
        clip_by_mesh(list(plain.parameters()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def clip_by_mesh(params: list, max_norm: float) -> None:
        # torch's clip_grad_norm_ cannot stack norms of DTensors on different meshes (FSDP x TP: norms on
        # (dp, tp) and on dp only); torchtitan's way: a norm per mesh, made whole, then combined
        grads = [p.grad for p in params if p.grad is not None]
        groups: dict = {}
        for g_ in grads:
            groups.setdefault(getattr(g_, "device_mesh", None), []).append(g_)
        total = torch.zeros(())
        for gs in groups.values():
            n = torch.nn.utils.get_total_norm(gs)
            total = total + (n.full_tensor() if hasattr(n, "full_tensor") else n) ** 2
        coef = min(1.0, max_norm / (float(total.sqrt()) + 1e-6))
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)

    runners = {"accelfn": run_accelfn, "plain torch": run_plain}
    for fn in runners.values():  # warm up
        for b in batches:
            fn(b)
    times: dict[str, list[float]] = {k: [] for k in runners}
    for r in range(args.rounds):
        order = list(runners) if r % 2 == 0 else list(reversed(runners))
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(args.steps):
                runners[name](batches[i % 2])
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / args.steps)
    if mesh.is_main:
        tokens = rows * args.seq * mesh.data_size
        out = {name: {"ms": 1e3 * statistics.median(t), "tokens_per_s": tokens / statistics.median(t)}
               for name, t in times.items()}  # fmt: skip
        print("RESULT " + json.dumps({"config": config, "mesh": shape, **out}), flush=True)
    mesh.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="rows per data-parallel rank")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(
        "| config | mesh | accelfn ms/step | plain torch ms/step | accelfn tokens/s | ratio (plain/accelfn time) |"
    )
    print("|---|---|---:|---:|---:|---:|")
    passthrough = [
        f"--{k}={getattr(args, k)}" for k in ("steps", "rounds", "hidden", "layers", "seq", "batch")
    ]
    for config in args.configs.split(","):
        cmd = [sys.executable, "-m", "accelfn.cli.main", "launch", "--nproc-per-node", str(args.nproc), "--cpu",
               __file__, f"--worker={config}", *passthrough]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"| {config} | failed: exit {proc.returncode} | {proc.stderr[-500:]!r} |")
            continue
        r = json.loads(lines[0][7:])
        a, p = r["accelfn"], r["plain torch"]
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items())
        print(f"| {config} | {mesh} | {a['ms']:.1f} | {p['ms']:.1f} | {a['tokens_per_s']:.0f} | "
              f"{p['ms'] / a['ms']:.3f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
