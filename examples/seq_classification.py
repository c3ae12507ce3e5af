"""Fine-tune a small BERT (transformers BertForSequenceClassification, built from a tiny config: no download)
on a generated text-classification task, data parallel, and evaluate accuracy over all processes.

    accelfn launch --nproc-per-node 2 --cpu examples/seq_classification.py
    python examples/seq_classification.py                                   # one process

The task: strings of 16 lowercase letters, byte-level tokens after a [CLS] token; the label says whether the
letter "z" occurs in the string (half the samples contain it). The model must find one token anywhere in the
sequence, which attention learns in a few dozen steps. Evaluation runs `af.eval_step` on each process's
shard of the validation set and `af.dist.gather_for_metrics` puts the predictions back together (each sample
once, the loader's wrap-around padding dropped). Exits non-zero unless accuracy rises from chance to >= 90%.
"""

from __future__ import annotations

import argparse

import torch
from transformers import BertConfig, BertForSequenceClassification

import accelfn as af

CLS = 256  # token ids 0-255 are bytes


def make_data(n: int, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    letters = torch.randint(ord("a"), ord("y") + 1, (n, seq_len), generator=g)  # a..y: no "z"
    labels = torch.randint(0, 2, (n,), generator=g)
    where = torch.randint(0, seq_len, (n,), generator=g)
    # a "z" at position `where` of the rows labelled 1: a mask, not `labels.nonzero()`, so that the data's
    # shapes do not depend on its values (`accelfn dry-run` builds it from fake tensors)
    hit = labels.bool().unsqueeze(1) & (torch.arange(seq_len) == where.unsqueeze(1))
    letters = letters.masked_fill(hit, ord("z"))
    ids = torch.cat([torch.full((n, 1), CLS), letters], dim=1)
    return {"input_ids": ids, "labels": labels}


def loss_fn(model, batch):
    logits = model(input_ids=batch["input_ids"]).logits
    accuracy = (logits.argmax(-1) == batch["labels"]).float().mean()
    return af.losses.cross_entropy(logits, batch["labels"]), {"accuracy": accuracy}


def accuracy(evaluate, state, loader) -> float:
    correct = total = 0
    for batch in loader:
        pred = evaluate(state, batch)
        got = af.dist.gather_for_metrics({"pred": pred.cpu(), "label": batch["labels"].cpu()}, loader)
        correct += int((got["pred"] == got["label"]).sum())
        total += len(got["label"])
    return correct / total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=16, help="per process")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    mesh = af.Mesh.from_env()
    torch.manual_seed(args.seed)
    config = BertConfig(
        vocab_size=257,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=args.seq_len + 1,
        num_labels=2,
    )
    model = BertForSequenceClassification(config)

    train = make_data(2048, args.seq_len, seed=1)
    valid = make_data(301, args.seq_len, seed=2)  # 301: not a multiple of the global batch (padding dropped)
    loader = af.data.DataLoader(train, batch_size=args.batch_size, mesh=mesh, shuffle=True, seed=args.seed)
    eval_loader = af.data.DataLoader(
        valid, batch_size=32, mesh=mesh
    )  # even_batches=True: all ranks step together

    opt = af.optim.adamw(af.optim.warmup_cosine(args.lr, warmup=10, total=args.steps), weight_decay=0.01)
    step = af.shard(af.train_step(loss_fn, opt, clip_grad_norm=1.0), mesh)
    state = step.init(model, seed=args.seed)
    evaluate = af.eval_step(lambda m, b: m(input_ids=b["input_ids"]).logits.argmax(-1))
    evaluate.init(step.model)

    before = accuracy(evaluate, state, eval_loader)
    af.dist.print(
        f"BERT with {sum(v.numel() for v in state.params.values()):,} parameters, {mesh.world_size} "
        f"process(es); validation accuracy before training: {before:.3f}"
    )
    i = 0
    while i < args.steps:
        for batch in loader:
            state, metrics = step(state, batch)
            i += 1
            if i % 20 == 0 or i == 1:
                af.dist.print(
                    f"step {i:4d}  loss {metrics['loss'].item():.4f}  batch accuracy {metrics['accuracy'].item():.3f}"
                )
            if i == args.steps:
                break
    after = accuracy(evaluate, state, eval_loader)
    af.dist.print(
        f"validation accuracy: {before:.3f} -> {after:.3f} ({len(valid['labels'])} samples, gathered "
        f"from {mesh.data_size} process(es))"
    )
    ok = after >= 0.9 and after > before + 0.2
    af.dist.print("CHECK accuracy rises:", "OK" if ok else "FAILED")
    mesh.close()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
