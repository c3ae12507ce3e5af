"""Tokens/s of a tiny GPT-2 on 2 CPU processes: accelfn shard(ddp|fsdp) vs torch DDP, FSDP2 and accelerate.

    python benchmarks/ddp_scaling.py [--steps 20 --rounds 3]

Launches itself on 2 processes with `accelfn launch --cpu`; inside, every runner trains its own copy of
the same model on the same per-rank batches, in interleaved rounds, and rank 0 prints a table of median
tokens/s (global) and the ratio to torch DDP.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import accelfn as af

SEQ, BATCH, VOCAB = 128, 8, 1024


def make_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=256,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    return GPT2LMHeadModel(cfg)


def plain_loss(m, ids):
    logits = m(input_ids=ids).logits
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def af_loss(m, ids):
    return af.losses.cross_entropy(m(input_ids=ids).logits[:, :-1], ids[:, 1:])


def runners(model, mesh):
    out = {}

    def af_runner(strategy, **kw):
        step = af.shard(af.train_step(af_loss, af.optim.adamw(1e-3)), mesh, strategy=strategy, **kw)
        box = {"s": step.init(copy.deepcopy(model))}

        def run(ids):
            box["s"], _ = step(box["s"], ids)

        return run

    out["accelfn shard(ddp)"] = af_runner("ddp")
    out["accelfn shard(ddp, overlap=True)"] = af_runner("ddp", overlap=True)
    out["accelfn shard(fsdp)"] = af_runner("fsdp")

    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, fused=True)

    def run_ddp(ids):
        plain_loss(ddp, ids).backward()
        opt.step()
        opt.zero_grad()

    out["torch DDP (fused AdamW)"] = run_ddp

    from torch.distributed.fsdp import fully_shard

    fm = copy.deepcopy(model)
    for block in fm.transformer.h:
        fully_shard(block)
    fully_shard(fm)
    fopt = torch.optim.AdamW(fm.parameters(), lr=1e-3, fused=True)

    def run_fsdp(ids):
        plain_loss(fm, ids).backward()
        fopt.step()
        fopt.zero_grad()

    out["torch FSDP2 (fused AdamW)"] = run_fsdp

    try:
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
        am = copy.deepcopy(model)
        aopt = torch.optim.AdamW(am.parameters(), lr=1e-3)
        am, aopt = acc.prepare(am, aopt)

        def run_acc(ids):
            acc.backward(plain_loss(am, ids))
            aopt.step()
            aopt.zero_grad()

        out["accelerate DDP"] = run_acc
    except ImportError:
        pass
    return out


def worker(steps: int, rounds: int) -> None:
    mesh = af.Mesh.from_env()
    g = torch.Generator().manual_seed(100 + mesh.rank)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(4)]
    rs = runners(make_model(), mesh)
    times: dict[str, list[float]] = {k: [] for k in rs}
    for run in rs.values():
        run(batches[0])
    for _ in range(rounds):
        for name, run in rs.items():
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(steps):
                run(batches[i % 4])
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / steps)
    if mesh.is_main:
        tokens = BATCH * SEQ * mesh.world_size
        base = statistics.median(times["torch DDP (fused AdamW)"])
        print(
            f"# ddp_scaling: tiny GPT-2 (2L, d256, seq{SEQ}, batch {BATCH}/rank), {mesh.world_size} CPU "
            f"processes (gloo), torch {torch.__version__}"
        )
        print("| runner | ms/step | tokens/s (global) | ratio to torch DDP |\n|---|---:|---:|---:|")
        for k, v in times.items():
            med = statistics.median(v)
            print(f"| {k} | {med * 1e3:.1f} | {tokens / med:,.0f} | {base / med:.3f} |")
    mesh.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", action="store_true")
    args = p.parse_args()
    if args.worker:
        worker(args.steps, args.rounds)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "accelfn.cli.main",
        "launch",
        "--nproc-per-node",
        "2",
        "--cpu",
        __file__,
        "--worker",
        "--steps",
        str(args.steps),
        "--rounds",
        str(args.rounds),
    ]
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
