"""Pretrain a Llama-architecture model (a `transformers` config, no weights downloaded) on random tokens, with
any mix of fsdp / hsdp / ddp, tensor parallel, remat and bf16 autocast: the script `accelfn dry-run` checks at
full scale before the job is queued.

    accelfn launch --nproc-per-node 2 --cpu examples/train_llama.py --model tiny --steps 5
    accelfn dry-run --nproc-per-node 8 --nnodes 8 examples/train_llama.py --model 8b --strategy fsdp
    accelfn dry-run --nproc-per-node 8 --nnodes 8 --mesh dp=8,tp=8 examples/train_llama.py --model 70b --remat
    accelfn dry-run --nproc-per-node 8 --nnodes 16 --mesh pp=4,dp=4,tp=8 examples/train_llama.py --model 405b

`--mesh` (or `accelfn launch --mesh`) names the axes: `dp=-1` (default), `dp=8,tp=8`, `dp=2,fsdp=-1` (hsdp).
The sizes of `--model` are Llama 3's (8b, 70b, 405b), the 0.89B model of docs/benchmarks.md (`0.9b`) and a
tiny one for CPU runs.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

import accelfn as af

MODELS = {  # hidden, intermediate, layers, heads, kv heads, vocabulary
    "tiny": (128, 344, 2, 4, 2, 1024),
    "0.9b": (2048, 5632, 16, 16, 8, 32000),
    "8b": (4096, 14336, 32, 32, 8, 128256),
    "70b": (8192, 28672, 80, 64, 8, 128256),
    "405b": (16384, 53248, 126, 128, 8, 128256),
}


def build(name: str, seq_len: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, intermediate, layers, heads, kv_heads, vocab = MODELS[name]
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq_len,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def loss_fn(model: torch.nn.Module, ids: torch.Tensor) -> af.Loss:
    return af.losses.cross_entropy(model(input_ids=ids).logits[:, :-1], ids[:, 1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=2, help="sequences per data-parallel rank and step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--strategy", choices=("ddp", "fsdp", "hsdp"), default="fsdp")
    p.add_argument("--remat", action="store_true", help="recompute each decoder layer in the backward pass")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 master weights)")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule, with a pp axis in --mesh")
    p.add_argument("--microbatches", type=int, default=8, help="pipeline micro-batches per step (pp axis)")
    p.add_argument(
        "--init",
        choices=("host", "meta"),
        default="host",
        help="where the model is built: on the host (every rank holds it whole until step.init), or on the meta "
        "device (no memory: step.init shards it, then allocates and initialises this rank's shards only)",
    )
    args = p.parse_args()

    torch.manual_seed(0)
    mesh = af.Mesh.from_env()  # `--mesh` of accelfn launch / dry-run; {"dp": world size} by default
    with af.init_empty() if args.init == "meta" else contextlib.nullcontext():
        model = build(args.model, args.seq_len)
    step = af.train_step(loss_fn, af.optim.adamw(args.lr, weight_decay=0.1), clip_grad_norm=1.0)
    if args.bf16:
        step = af.autocast(step, torch.bfloat16)
    if args.remat:
        step = af.remat(step)
    if args.accumulate > 1:
        step = af.accumulate(step, args.accumulate)
    if "pp" in mesh.axis_names:  # pipeline parallel: every rank of a pipeline reads the same batch
        step = af.pipeline(step, mesh, microbatches=args.microbatches, schedule=args.schedule)
    step = af.shard(step, mesh, strategy=args.strategy)
    state = step.init(model)
    af.dist.print(step)

    vocab = MODELS[args.model][5]
    gen = torch.Generator().manual_seed(mesh.data_rank)
    for i in af.progress(range(args.steps), desc="train"):
        ids = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=gen)
        state, metrics = step(state, ids)
        af.dist.print(f"step {i + 1}: loss {metrics['loss'].item():.3f}")


if __name__ == "__main__":
    main()
