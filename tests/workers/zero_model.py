"""The training step that tests/workers/zero_bytes_worker.py runs on a real DeepSpeed engine and
tests/test_dry_run_zero.py dry-runs: the same model, loss, optimizer and combinators in both.

- `"model": "llama"` (default): examples/train_llama.py's tiny Llama, AdamW, a (2, 129) batch per rank;
- `"model": "net"`: `ZeroNet`, what the Llama does not have, with AdamW without weight decay on vectors (two
  param groups, so two flat buffers in ZeRO-1/2), a (2, 33) batch per rank.

Both with bf16 autocast, clip 1.0, `accumulate` micro-batches (default 1), `compile` (`"blocks"`: af.compile per
block; default none) with `compile_backend` (torch.compile's; default Inductor) and `ds_config` from the options."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import accelfn as af

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


class ZeroNet(nn.Module):
    """An embedding tied to the head (one param in two modules), a param of the root, modules with several
    params (Linear + bias, LayerNorm), a frozen layer, and a param read outside its module's forward (the
    root reads `out.weight`: DeepSpeed's external params)."""

    def __init__(self, vocab: int = 256, d: int = 64, seq: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.body = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.LayerNorm(d))
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(d, d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.frozen(self.body(self.emb(ids) + self.pos[: ids.shape[1]]))
        return self.head(h + F.linear(h, self.out.weight))


def _net_loss(model: nn.Module, ids: torch.Tensor) -> af.Loss:
    return af.losses.cross_entropy(model(ids[:, :-1]), ids[:, 1:])


def model_and_loss(options: dict[str, Any]) -> tuple[nn.Module, Any, Any]:
    """(the model, loss_fn, the optimizer) of `options`."""
    if options.get("model", "llama") == "net":
        matrices = lambda params: {k: v.ndim >= 2 for k, v in params.items()}  # noqa: E731
        return ZeroNet(), _net_loss, af.optim.adamw(1e-3, weight_decay=0.1, mask=matrices)
    from train_llama import build, loss_fn

    return build("tiny", 128), loss_fn, af.optim.adamw(1e-3)


def batch_shape(options: dict[str, Any]) -> tuple[int, int]:
    return (2, 33) if options.get("model", "llama") == "net" else (2, 129)


def zero_step(mesh: af.Mesh, stage: int, options: dict[str, Any], optimizer: Any = None) -> tuple[Any, Any]:
    """(the sharded step, the state `step.init` returns) of `options` (`optimizer` replaces the default)."""
    model, loss_fn, tx = model_and_loss(options)
    step = af.autocast(af.train_step(loss_fn, optimizer or tx, clip_grad_norm=1.0), "bf16")
    if options.get("compile"):
        backend = {"backend": options["compile_backend"]} if "compile_backend" in options else {}
        step = af.compile(step, regions=options["compile"], **backend)
    if options.get("accumulate", 1) > 1:
        step = af.accumulate(step, options["accumulate"])
    step = af.shard(step, mesh, backend="deepspeed", zero_stage=stage, ds_config=options.get("ds_config"))
    return step, step.init(model)
