"""Fine-tune a tiny Llama with LoRA (PEFT) on the King James text in examples/data, save the adapter, reload it.

    python examples/lora_finetune.py                                       # one process, ~20 s on CPU
    accelfn launch --nproc-per-node 2 --cpu examples/lora_finetune.py --strategy fsdp

The model is a byte-level Llama built from a config (no download), first trained in full for a few steps
so that it is a "pretrained" base, then frozen: `get_peft_model` adds LoRA weights to the attention and MLP
projections, and only those train (the optimizer holds moments for them alone). The adapter is written in
PEFT's own layout (`adapter_model.safetensors` + `adapter_config.json`) by `af.checkpoint.save_adapter`,
loaded back with `PeftModel.from_pretrained`, and checked to give the same logits; `merge=True` writes the
merged model that `transformers` loads.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import accelfn as af

DATA = Path(__file__).parent / "data" / "kjv_genesis_ecclesiastes.txt"


def make_base(seq_len: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=seq_len, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> af.Loss:
    logits = model(input_ids=batch["ids"][:, :-1]).logits
    return af.losses.cross_entropy(logits, batch["ids"][:, 1:])


def windows(
    data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
    return {"ids": torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pretrain-steps", type=int, default=30)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"])
    p.add_argument("--out", default="runs/lora_finetune")
    args = p.parse_args()

    mesh = af.Mesh.from_env()  # {"dp": world size}: 1 without `accelfn launch`
    data = torch.frombuffer(bytearray(DATA.read_bytes()), dtype=torch.uint8)
    half = len(data) // 2  # the base learns from the first half; LoRA adapts it to the second
    gen = torch.Generator().manual_seed(mesh.data_rank)
    t0 = time.perf_counter()

    # 1. a small "pretrained" base (full training, plain step)
    torch.manual_seed(0)
    base = make_base(args.seq_len)
    pretrain = af.train_step(loss_fn, af.optim.adamw(3e-3))
    state = pretrain.init(base)
    for _ in range(args.pretrain_steps):
        state, metrics = pretrain(state, windows(data[:half], args.batch_size, args.seq_len, gen))
    base_state = {k: v.detach().clone() for k, v in base.state_dict().items()}

    # 2. LoRA on top: the base is frozen, only the adapter trains (and only it has optimizer state)
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])  # fmt: skip
    model = get_peft_model(base, lora)
    step = af.shard(
        af.train_step(loss_fn, af.optim.adamw(1e-2), clip_grad_norm=1.0), mesh, strategy=args.strategy
    )
    state = step.init(model)
    trainable = [n for n, p in state.params.items() if p.requires_grad]
    moments = {
        path.split(".", 1)[1]
        for path, _ in af.tree.flatten_with_path(state.opt_state)
        if path.startswith("mu.")
    }
    assert moments == set(trainable) and all("lora_" in n for n in trainable)
    n_train = sum(state.params[n].numel() for n in trainable)
    n_all = sum(p.numel() for p in state.params.values())
    af.dist.print(f"LoRA r={args.rank}: {n_train:,} of {n_all:,} parameters train; {step}")

    losses = []
    for _ in range(args.steps):
        state, metrics = step(state, windows(data[half:], args.batch_size, args.seq_len, gen))
        losses.append(metrics["loss"].item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    af.dist.print(
        f"LoRA loss {first:.3f} -> {last:.3f} in {args.steps} steps ({time.perf_counter() - t0:.1f} s in all)"
    )

    # 3. save the adapter in PEFT's layout (and the merged model), reload with PEFT / transformers
    af.checkpoint.save_adapter(f"{args.out}/adapter", state, step.model)
    af.checkpoint.save_adapter(f"{args.out}/merged", state, step.model, merge=True)
    trained = {
        n: v.full_tensor() if hasattr(v, "full_tensor") else v
        for n, v in state.params.items()
        if n in trainable
    }
    if mesh.rank == 0:
        fresh = make_base(args.seq_len)
        fresh.load_state_dict(base_state)
        reloaded = PeftModel.from_pretrained(fresh, f"{args.out}/adapter").eval()
        merged = AutoModelForCausalLM.from_pretrained(f"{args.out}/merged").eval()
        check = windows(data[half:], 2, args.seq_len, torch.Generator().manual_seed(7))["ids"]
        with torch.no_grad():
            for n, t in dict(reloaded.named_parameters()).items():
                if n in trained:
                    assert torch.equal(t, trained[n]), n
            a = reloaded(input_ids=check).logits
            b = merged(input_ids=check).logits
        same = (a - b).abs().max().item()
        print(f"adapter: {sorted(p.name for p in Path(args.out, 'adapter').iterdir())}; "
              f"PEFT-loaded vs merged logits differ by {same:.1e}")  # fmt: skip
        ok = last < first - 0.1 and same < 1e-4
        print(f"CHECK LoRA loss falls and the saved adapter reloads: {'OK' if ok else 'FAILED'}")
        if not ok:
            raise SystemExit(1)
    mesh.close()


if __name__ == "__main__":
    main()
