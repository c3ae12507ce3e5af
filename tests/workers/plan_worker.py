"""A small Llama training script that leaves its configuration to the launch config (what `accelfn plan`
chooses): the mesh from `af.Mesh.from_env()`, strategy / remat / accumulate / global batch / offload as
"auto" knobs unless a flag fixes them. Prints the configuration it ran and each step's loss (tests/test_plan.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import accelfn as af

sys.path.insert(0, str(Path(__file__).resolve().parent))  # plan_knobs, beside this script
import plan_knobs  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    plan_knobs.add_flags(p)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--autocast", action="store_true", help="af.autocast(step): the launch's mixed precision")
    args = p.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    mesh = af.Mesh.from_env()
    knobs = plan_knobs.read(args, strategy="ddp", global_batch=8)
    global_batch = knobs.global_batch
    batch = global_batch // mesh.data_size

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2 or 1,
        max_position_embeddings=args.seq_len,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)

    def loss_fn(m: torch.nn.Module, ids: torch.Tensor) -> af.Loss:
        return af.losses.cross_entropy(m(input_ids=ids).logits[:, :-1], ids[:, 1:])

    step = af.train_step(loss_fn, af.optim.adamw(1e-3, weight_decay=0.0))
    if args.autocast:
        step = af.autocast(step)  # dtype "auto": accelfn launch --mixed-precision
    step = plan_knobs.apply(step, knobs, mesh)
    state = step.init(model)
    k = knobs
    af.dist.print(f"config mesh={dict(mesh.shape)} strategy={k.strategy} remat={k.remat} accumulate={k.accumulate} "
                  f"global_batch={k.global_batch} offload={k.offload} compile={k.compiled}")  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    for i in range(args.steps):
        ids = torch.randint(0, args.vocab, (global_batch, args.seq_len + 1), generator=gen)
        mine = ids[mesh.data_rank * batch : (mesh.data_rank + 1) * batch]
        state, metrics = step(state, mine)
        af.dist.print(f"step {i + 1} loss {metrics['loss'].item():.8f}")


if __name__ == "__main__":
    main()
