"""FP8 training of a tiny Llama with `af.autocast_fp8` (torchao), in the settings of Accelerate's fp8
examples: one device, DDP, FSDP, and DeepSpeed ZeRO 1-3.

    python examples/fp8_training.py --setting single
    accelfn launch --nproc-per-node 2 --cpu examples/fp8_training.py --setting ddp
    accelfn launch --nproc-per-node 2 --cpu examples/fp8_training.py --setting fsdp
    accelfn launch --nproc-per-node 2 --cpu examples/fp8_training.py --setting deepspeed-zero2   # or zero1, zero3

(drop `--cpu` on GPUs). FP8 matmuls need an NVIDIA GPU of compute capability 8.9+ (Ada, Hopper,
Blackwell); where `mesh.platform.supports_fp8()` is false (the CPU) the FP8 numerics are emulated
(`emulate=True`: same scaling and casts, high-precision matmuls; slow, for tests). The model is trained
in bf16 autocast with its eligible Linear layers in FP8 (tensorwise scaling); with `--emulate` every
eligible layer is converted, on FP8 hardware only those large enough to gain (see docs/combinators.md).
DeepSpeed compiles native ops on first use: point TORCH_EXTENSIONS_DIR at a cached folder.
Exits non-zero unless the training loss falls.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import accelfn as af

DATA = Path(__file__).parent / "data" / "kjv_genesis_ecclesiastes.txt"
SETTINGS = ["single", "ddp", "fsdp", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"]


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg)  # every Linear is 64/128 wide: divisible by 16, so FP8-eligible


def loss_fn(model, batch):
    logits = model(input_ids=batch["ids"][:, :-1]).logits
    return af.losses.cross_entropy(logits.float(), batch["ids"][:, 1:])


def build_step(setting: str, mesh: af.Mesh, lr: float, steps: int, emulate: bool) -> af.Step:
    opt = af.optim.adamw(af.optim.warmup_cosine(lr, warmup=steps // 10, total=steps), weight_decay=0.1)
    step = af.train_step(loss_fn, opt, clip_grad_norm=1.0)
    step = af.autocast_fp8(
        af.autocast(step, torch.bfloat16), backend="torchao", recipe="tensorwise", emulate=emulate
    )
    if setting == "single":
        if mesh.world_size != 1:
            raise SystemExit("--setting single runs on one process (run it with plain python)")
        return step  # the model stays where it is built; `af.shard` over a 1-process mesh would place it
    if setting in ("ddp", "fsdp"):
        return af.shard(step, mesh, strategy=setting)
    return af.shard(step, mesh, backend="deepspeed", zero_stage=int(setting[-1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", choices=SETTINGS, default="single")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8, help="per process")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--emulate", action="store_true", help="emulate FP8 (automatic where it is not native)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    mesh = af.Mesh.from_env()
    emulate = args.emulate or not mesh.platform.supports_fp8()
    step = build_step(args.setting, mesh, args.lr, args.steps, emulate)
    if args.setting == "single":
        model = tiny_llama(args.seed).to(mesh.device)
    else:
        model = tiny_llama(args.seed)  # built on the host; af.shard moves it to the mesh's device
    state = step.init(model, seed=args.seed)
    af.dist.print(
        f"setting {args.setting}, {mesh.world_size} process(es) on {mesh.device_type}, "
        f"fp8 {'emulated' if emulate else 'native'}"
    )
    af.dist.print(step)

    data = torch.frombuffer(bytearray(DATA.read_bytes()), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(args.seed * 1000 + mesh.data_rank)  # each rank its own windows
    losses = []
    for i in range(args.steps):
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch_size,), generator=gen).tolist()
        batch = {"ids": torch.stack([data[s : s + args.seq_len + 1] for s in starts]).long()}
        state, metrics = step(state, batch)
        losses.append(metrics["loss"].item())
        if i == 0 or (i + 1) % 10 == 0:
            af.dist.print(f"step {i + 1:4d}  loss {losses[-1]:.4f}")
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    ok = last < first - 0.5 and all(x == x for x in losses)  # no NaN
    af.dist.print(f"loss (mean of 5 steps) {first:.3f} -> {last:.3f}")
    af.dist.print(f"CHECK fp8 {args.setting} loss falls:", "OK" if ok else "FAILED")
    mesh.close()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
