"""Train a small Llama on long byte sequences with the parallelism the mesh names: context parallel splits each
sequence over a `cp` axis, tensor parallel the layers over a `tp` axis, data parallel the rows over `dp`.

    accelfn launch --nproc-per-node 2 --cpu --mesh cp=2 examples/long_context.py        # each sequence in 2 parts
    accelfn launch --nproc-per-node 4 --cpu --mesh dp=2,cp=2 examples/long_context.py   # + 2 data-parallel groups
    accelfn launch --nproc-per-node 2 --cpu --mesh tp=2 examples/long_context.py        # the layers split instead
    accelfn launch --nproc-per-node 4 --cpu --mesh cp=2,tp=2 examples/long_context.py   # both: sequences and layers
    python examples/long_context.py                                                     # one process

The model is `transformers`' Llama built from a config; `af.remat` recomputes each decoder layer in the backward.
Under context parallel the inputs and labels are aligned position by position (labels[:, i] is the byte after
input_ids[:, i]), and the ranks of one `cp` group read the same rows: each draws its windows from the seed of
its data rank. The script checks that the loss falls.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import accelfn as af

DATA = Path(__file__).parent / "data" / "kjv_genesis_ecclesiastes.txt"


def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> af.Loss:
    logits = model(input_ids=batch["input_ids"]).logits
    return af.losses.cross_entropy(logits, batch["labels"])


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=2, help="rows per data-parallel rank")
    p.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp"))
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()

    mesh = af.Mesh.from_env()  # from `accelfn launch --mesh ...`; {"dp": world size} otherwise
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    step = af.train_step(loss_fn, af.optim.adamw(args.lr, weight_decay=0.1), clip_grad_norm=1.0)
    step = af.shard(af.remat(step, "full"), mesh, strategy=args.strategy if mesh.data_axes else "ddp")
    state = step.init(model, seed=0)
    af.dist.print(f"mesh {dict(mesh.shape)}: {step}")

    data = torch.frombuffer(bytearray(DATA.read_bytes()), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(mesh.data_rank)  # the ranks of one cp or tp group: the same rows
    losses = []
    for _ in af.progress(range(args.steps), desc="train"):
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch_size,), generator=gen)
        rows = torch.stack([data[s : s + args.seq_len + 1] for s in starts.tolist()])
        state, metrics = step(state, {"input_ids": rows[:, :-1], "labels": rows[:, 1:]})
        losses.append(metrics["loss"].item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    af.dist.print(f"loss {first:.3f} -> {last:.3f} over {args.steps} steps of {args.seq_len} tokens")
    if last < first - 1.0:
        af.dist.print("CHECK loss falls: OK")
    mesh.close()


if __name__ == "__main__":
    main()
