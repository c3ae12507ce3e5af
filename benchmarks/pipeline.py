"""Pipeline parallel: `af.pipeline` against the same model trained with torch's pipelining API by hand (the
torchtitan way: a stage module per rank, `PipelineStage`, a schedule, `torch.optim.AdamW`), side by side in one
job; and the measured bubble against (p-1)/(m+p-1).

    accelfn launch --nproc-per-node 2 --cpu benchmarks/pipeline.py [--steps 10] [--microbatches 8]
    accelfn launch --nproc-per-node 2 --cpu benchmarks/pipeline.py --hidden 256 --seq 128   # compute-bound
    accelfn launch --nproc-per-node 4 --cpu benchmarks/pipeline.py

Prints, on rank 0, one line per schedule: tokens/s of both (median step), the median of the per-pair ratios
(the two alternate step by step; goal >= 0.98), and the bubble.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import accelfn as af
from accelfn.transforms.pipeline import bubble_fraction

VOCAB, ROWS = 512, 16
SEQ, HIDDEN = 64, 128  # --seq, --hidden


def build(layers: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=HIDDEN * 43 // 16, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      tie_word_embeddings=False, use_cache=False)  # fmt: skip
    return LlamaForCausalLM(cfg)


def loss_fn(model: nn.Module, ids: torch.Tensor) -> af.Loss:
    return af.losses.cross_entropy(model(input_ids=ids).logits[:, :-1], ids[:, 1:])


class HandStage(nn.Module):
    """torchtitan's way: the stage's own layers, embeddings on the first, norm and head on the last."""

    def __init__(self, model: nn.Module, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        base = model.model
        self.embed = base.embed_tokens if first else None
        self.layers = nn.ModuleList(base.layers[lo:hi])
        self.rotary = base.rotary_emb
        self.norm = base.norm if last else None
        self.head = model.lm_head if last else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            h = self.embed(h)
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        emb = self.rotary(h, position_ids=pos)
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_embeddings=emb, position_ids=pos)
        if self.head is not None:
            h = self.head(self.norm(h))
        return h


def hand_written(schedule: str, layers: int, m: int, pp: int, rank: int) -> Callable[[], None]:
    """One training step of the torchtitan way, as a function."""
    from torch.distributed import pipelining

    per = layers // pp
    stage = HandStage(copy.deepcopy(build(layers)), rank * per, (rank + 1) * per, rank == 0, rank == pp - 1)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-4, weight_decay=0.1)

    def loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum"
        )

    st = pipelining.PipelineStage(stage, rank, pp, torch.device("cpu"))
    cls = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[schedule]
    sched = cls(st, n_microbatches=m, loss_fn=loss, scale_grads=False)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))

    def one() -> None:
        if rank == 0:
            sched.step(ids, target=ids)
        else:
            sched.step(target=ids)
        torch.nn.utils.clip_grad_norm_(stage.parameters(), 1.0)  # (local norm: the hand loop is simpler)
        opt.step()
        opt.zero_grad()

    return one


def ours(schedule: str, layers: int, m: int, mesh: af.Mesh) -> Callable[[], None]:
    """One training step of `af.pipeline`, as a function."""
    step = af.pipeline(af.train_step(loss_fn, af.optim.adamw(1e-4, weight_decay=0.1), clip_grad_norm=1.0), mesh,
                       microbatches=m, schedule=schedule)  # fmt: skip
    box = [step.init(build(layers))]
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))

    def one() -> None:
        box[0], metrics = step(box[0], ids)
        metrics["loss"].item()

    return one


def timed(one: Callable[[], None]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    one()
    return time.perf_counter() - t0


def one_stage_time(layers: int, pp: int, m: int) -> float:
    """Forward + backward of one stage on one micro-batch, alone (no pipeline): the busy time per micro-batch."""
    stage = HandStage(build(layers), 0, layers // pp, True, False)
    ids = torch.randint(0, VOCAB, (ROWS // m, SEQ))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        stage(ids).float().pow(2).mean().backward()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    global SEQ, HIDDEN
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--hidden", type=int, default=HIDDEN, help="model width (4 heads, MLP 2.7x)")
    p.add_argument("--seq", type=int, default=SEQ, help="tokens per row (16 rows per step)")
    args = p.parse_args()
    SEQ, HIDDEN = args.seq, args.hidden
    with af.Mesh({"pp": -1}, device="cpu") as mesh:
        pp, rank, m = mesh.world_size, mesh.rank, args.microbatches
        layers = 2 * pp
        busy = one_stage_time(layers, pp, m) * m
        for schedule in ("gpipe", "1f1b"):
            hand, mine = hand_written(schedule, layers, m, pp, rank), ours(schedule, layers, m, mesh)
            hand(), mine()  # warm-up
            # the two alternate step by step (which goes first alternates too), so that a slower minute of a
            # shared machine slows both
            pairs = []
            for i in range(args.steps):
                if i % 2:
                    t_mine = timed(mine)
                    pairs.append((timed(hand), t_mine))
                else:
                    pairs.append((timed(hand), timed(mine)))
            t_hand = statistics.median(h for h, _ in pairs)
            t_mine = statistics.median(o for _, o in pairs)
            ratio = statistics.median(h / o for h, o in pairs)
            tokens = ROWS * SEQ
            if rank == 0:
                print(
                    f"pp={pp} {schedule:6s} m={m} hidden={HIDDEN} seq={SEQ}: accelfn {tokens / t_mine:8.0f} tok/s, hand-written "
                    f"{tokens / t_hand:8.0f} tok/s, ratio {ratio:.3f} (median of {args.steps} pairs); bubble "
                    f"measured {max(0.0, 1 - busy / t_mine):.2f}, (p-1)/(m+p-1) = {bubble_fraction(pp, m):.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
