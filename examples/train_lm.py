"""Train a small byte-level GPT on the King James text in examples/data with accelfn.

    accelfn launch --nproc-per-node 2 --cpu examples/train_lm.py     # 2 processes, data parallel
    python examples/train_lm.py                                       # the same script, one process

The loss goes from ~5.5 (uniform over 256 bytes) to ~2.0 in a few hundred steps on 2 CPU cores. Each
process draws its own windows of text (its shard of the global batch of `--batch-size` x processes);
`af.shard` averages the gradients over the processes, so every process holds the same model. Metrics (loss,
learning rate, tokens/s, step time, memory) go to `--run-dir`/metrics.jsonl through `af.trackers` (add
`accelfn launch --log-with jsonl,tensorboard` for more), measured by `af.Meter`; `accelfn plot RUN_DIR` draws them.
At the end it prints a sample continuing "And God said", drawn at `--temperature` 0.8 from the `--top-k` 10
likeliest bytes (seeded: the same text each run), e.g. 'And God said, and hunto shall the theream, and
the ...': words, commas and the text's cadence, learned from raw bytes in 400 steps (greedy decoding,
`--temperature 0`, repeats the likeliest word: 'And God said the the the ...').
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from torch import nn

import accelfn as af

DATA = Path(__file__).parent / "data" / "kjv_genesis_ecclesiastes.txt"


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        attn = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.drop(self.proj(attn.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    """A GPT-style decoder over bytes (vocabulary 256), with tied input/output embeddings."""

    def __init__(
        self, d: int = 128, layers: int = 2, heads: int = 4, seq_len: int = 64, dropout: float = 0.1
    ):
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Parameter(torch.zeros(seq_len, d))
        self.blocks = nn.Sequential(*[Block(d, heads, dropout) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256, bias=False)
        self.head.weight = self.tok.weight  # tied: stored once in the state, kept tied by accelfn
        nn.init.normal_(self.pos, std=0.02)
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        return self.head(self.ln(self.blocks(x)))


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> af.Loss:
    logits = model(batch["ids"][:, :-1])
    return af.losses.cross_entropy(logits, batch["ids"][:, 1:])


def windows(
    data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
    return {"ids": torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()}


@torch.no_grad()
def sample_tokens(
    model: nn.Module,
    ids: torch.Tensor,
    n: int,
    seq_len: int,
    *,
    temperature: float = 0.8,
    top_k: int = 10,
    seed: int = 0,
) -> torch.Tensor:
    """Continuation of `ids` (host tensor, shape 1 x t) by `n` tokens, the model run where it is. Each token is
    drawn from the `top_k` likeliest, their probabilities sharpened by `temperature` (< 1), with a generator
    seeded by `seed` on the host: the same text on every run, rank and device. `temperature=0` is greedy
    decoding, which a small model turns into loops ('the the the ...')."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    out = ids.cpu()
    for _ in range(n):
        logits = model(out[:, -seq_len:].to(device))[:, -1].float().cpu()
        if temperature <= 0:
            token = logits.argmax(-1, keepdim=True)
        else:
            top, index = logits.topk(min(top_k, logits.shape[-1]) if top_k > 0 else logits.shape[-1], dim=-1)
            choice = torch.multinomial(torch.softmax(top / temperature, dim=-1), 1, generator=gen)
            token = index.gather(-1, choice)
        out = torch.cat([out, token], dim=1)
    return out


def generate(
    model: nn.Module,
    prompt: str,
    n: int,
    seq_len: int,
    temperature: float = 0.8,
    top_k: int = 10,
    seed: int = 0,
) -> str:
    prompt_ids = torch.tensor([list(prompt.encode())])
    ids = sample_tokens(model, prompt_ids, n, seq_len, temperature=temperature, top_k=top_k, seed=seed)
    return bytes(ids[0].tolist()).decode(errors="replace")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--run-dir", default="runs/train_lm", help="where metrics.jsonl (and other trackers) write"
    )
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--temperature", type=float, default=0.8, help="of the sample (0: greedy)")
    p.add_argument("--top-k", type=int, default=10, help="the sample draws from the k likeliest bytes")
    args = p.parse_args()

    torch.manual_seed(args.seed)
    mesh = af.Mesh.from_env()  # {"dp": world size}: 1 without `accelfn launch`
    data = torch.frombuffer(bytearray(DATA.read_bytes()), dtype=torch.uint8)
    split = int(0.95 * len(data))
    train, valid = data[:split], data[split:]

    model = TinyGPT(args.d_model, args.layers, seq_len=args.seq_len)
    schedule = af.optim.warmup_cosine(args.lr, warmup=args.steps // 10, total=args.steps, end=args.lr / 10)
    no_decay_on_vectors = lambda params: {k: v.ndim >= 2 for k, v in params.items()}  # noqa: E731
    optimizer = af.optim.adamw(schedule, b2=0.99, weight_decay=0.1, mask=no_decay_on_vectors)
    step = af.shard(af.train_step(loss_fn, optimizer, clip_grad_norm=1.0), mesh)
    evaluate = af.eval_step(loss_fn)
    state = step.init(model, seed=args.seed)
    evaluate.init(model)
    n_params = sum(v.numel() for v in state.params.values())
    af.dist.print(f"model: {n_params:,} parameters; data: {len(train):,} training bytes; {step}")

    gen = torch.Generator().manual_seed(args.seed * 1000 + mesh.data_rank)  # each rank its own windows
    meter = af.Meter(step)  # tokens/s, step time, data wait, TFLOP/s (and MFU on known GPUs), memory
    run = af.trackers.open(args.run_dir, "auto", config=vars(args), mesh=mesh)  # jsonl unless --log-with says
    t0 = time.perf_counter()
    first = None
    bar = af.progress(range(args.steps), desc="train", dynamic_ncols=True, mininterval=1.0)
    for i in bar:
        state, metrics = meter(state, windows(train, args.batch_size, args.seq_len, gen))
        logged = {"loss": metrics["loss"], "lr": metrics["lr"]}  # tensors: buffered, no device sync per step
        if (i + 1) % args.log_every == 0 or i == args.steps - 1:
            figures = meter.figures()  # global over the ranks (a collective: every rank calls it)
            logged.update({k: v for k, v in figures.items() if k != "steps"})
        run.log(logged, step=i + 1)
        if i == 0 or (i + 1) % args.log_every == 0 or i == args.steps - 1:
            loss = metrics["loss"].item()
            first = loss if first is None else first
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{metrics['lr'].item():.2e}", **meter.postfix())
    run.close()
    elapsed = time.perf_counter() - t0

    val_gen = torch.Generator().manual_seed(1234)
    val = [evaluate(state, windows(valid, 32, args.seq_len, val_gen)) for _ in range(8)]
    val_loss = sum(v.total.item() for v in val) / sum(v.count.item() for v in val)
    af.dist.print(
        f"train loss {first:.3f} -> {metrics['loss'].item():.3f} in {args.steps} steps ({elapsed:.1f} s, "
        f"{mesh.world_size} process(es), global batch {args.batch_size * mesh.data_size})"
    )
    af.dist.print(f"validation loss {val_loss:.3f} (perplexity {math.exp(val_loss):.2f} per byte)")
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "seed": args.seed}
    af.dist.print("sample:", repr(generate(model.eval(), "And God said", 60, args.seq_len, **sampling)))
    af.dist.print(f"metrics: {args.run_dir}/metrics.jsonl; plot them with: accelfn plot {args.run_dir}")
    mesh.close()


if __name__ == "__main__":
    main()
