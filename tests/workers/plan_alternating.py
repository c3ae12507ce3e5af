"""tests/workers/plan_worker.py's script with a model whose blocks alternate (the planner's layer extrapolation in
periods, tests/test_plan_extrapolate.py): `--model sliding`, a tiny Qwen3 whose layers follow `--pattern` (s:
sliding-window attention over 8 tokens, f: full; "sf": gpt-oss / Gemma-2's alternation, "sssf": Qwen3-Next's
3-then-1), or `--model moe`, a tiny Qwen3-MoE with an MoE MLP every `--sparse-step`-th layer (Llama-4's
`interleave_moe_layer_step`) and dense ones at `--mlp-only` (comma-separated indices).

    python tests/workers/plan_alternating.py --model sliding --pattern sssf --layers 18
    accelfn dry-run --nproc-per-node 8 --nnodes 8 --mesh dp=64 tests/workers/plan_alternating.py --size 8b \\
        --layers 36 --seq-len 8192 --strategy fsdp --global-batch-size 128 --remat full
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

import accelfn as af

sys.path.insert(0, str(Path(__file__).resolve().parent))  # plan_knobs, beside this script
import plan_knobs  # noqa: E402


def build(args: argparse.Namespace) -> torch.nn.Module:
    """The model the flags ask for (4 heads of 8, hidden 32; `--layers` blocks)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=args.layers,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=args.seq_len,
                 use_cache=False, attn_implementation="sdpa", tie_word_embeddings=False)  # fmt: skip
    if args.size == "8b":  # Qwen3-8B's widths (config.json on the hub), for measuring the tier at scale
        shape.update(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128)  # fmt: skip
    if args.model == "sliding":
        types = {"s": "sliding_attention", "f": "full_attention"}
        layer_types = [types[args.pattern[i % len(args.pattern)]] for i in range(args.layers)]
        window = 8 if args.size == "tiny" else 4096
        cfg = Qwen3Config(**shape, use_sliding_window=True, sliding_window=window, layer_types=layer_types)
        return Qwen3ForCausalLM(cfg)
    only = [int(i) for i in args.mlp_only.split(",") if i]
    cfg_moe = Qwen3MoeConfig(**shape, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                             decoder_sparse_step=args.sparse_step, mlp_only_layers=only)  # fmt: skip
    model = Qwen3MoeForCausalLM(cfg_moe)
    model.set_experts_implementation("batched_mm")  # fp32 experts (a modelled GPU's grouped GEMM takes bf16)
    with torch.no_grad():  # transformers zero-initialises the routers
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate") and not layer.mlp.gate.weight.is_meta:
                layer.mlp.gate.weight.normal_(0, 0.02)
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=("sliding", "moe"), default="sliding")
    p.add_argument("--pattern", default="sf", help="sliding: each layer's attention, repeated (s or f)")
    p.add_argument("--sparse-step", type=int, default=2, help="moe: an MoE MLP every n-th layer")
    p.add_argument("--mlp-only", default="", help="moe: the layers kept dense, comma-separated")
    p.add_argument("--layers", type=int, default=10)
    p.add_argument(
        "--size", choices=("tiny", "8b"), default="tiny", help="8b: Qwen3-8B's widths, on the meta device"
    )
    p.add_argument("--seq-len", type=int, default=32)
    plan_knobs.add_flags(p)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()

    mesh = af.Mesh.from_env()
    knobs = plan_knobs.read(args, strategy="ddp", global_batch=8)
    global_batch = knobs.global_batch
    batch = global_batch // mesh.data_size

    torch.manual_seed(0)
    with af.init_empty() if args.size != "tiny" else contextlib.nullcontext():
        model = build(args)

    def loss_fn(m: torch.nn.Module, ids: torch.Tensor) -> af.Loss:
        return af.losses.cross_entropy(m(input_ids=ids).logits[:, :-1], ids[:, 1:])

    step = af.train_step(loss_fn, af.optim.adamw(1e-3, weight_decay=0.0))
    step = plan_knobs.apply(step, knobs, mesh)
    state = step.init(model)
    gen = torch.Generator().manual_seed(1)
    for i in range(args.steps):
        ids = torch.randint(0, 256, (global_batch, args.seq_len + 1), generator=gen)
        mine = ids[mesh.data_rank * batch : (mesh.data_rank + 1) * batch]
        state, metrics = step(state, mine)
        af.dist.print(f"step {i + 1} loss {metrics['loss'].item():.8f}")


if __name__ == "__main__":
    main()
