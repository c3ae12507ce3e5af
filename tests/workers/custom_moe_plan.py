"""A user's own MoE module (not transformers') under `af.shard(..., ep_plan=plan)`, mesh, strategy and global batch
left to the launch configuration: what `accelfn plan` must find ep candidates for (tests/test_plan_ep.py).

    accelfn plan --nproc-per-node 8 --global-batch-size 16 --axes dp,ep tests/workers/custom_moe_plan.py
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import accelfn as af
from accelfn.launch_env import knob
from accelfn.moe import local_part

EXPERTS, TOPK, VOCAB, D, F = 8, 2, 32, 16, 64

# --bad-plan: a plan whose entry matches nothing of the model (the planner's probe names it)
BAD_PLAN = {"moe.experts.w_up": "grouped_gemm", "moe.experts": "ep_dispatch_experts"}
USER_PLAN = {
    "moe.experts.w_in": "grouped_gemm",
    "moe.experts.w_out": "grouped_gemm",
    "moe.experts": "ep_dispatch_experts",
}


class UserExperts(nn.Module):
    """w_in [E, F, D], w_out [E, D, F], GELU; transformers' experts interface and `ep_local_forward` under ep."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(EXPERTS, F, D) * 0.3)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, D, F) * 0.3)

    def one(self, x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(x @ w_in.T) @ w_out.T

    def forward(self, hidden: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # every expert on every row, weighted by the router's (0 where not chosen): shapes fixed (a dry run's)
        out = torch.zeros_like(hidden)
        for e in range(EXPERTS):
            gate = (weights * (idx == e)).sum(-1, keepdim=True)
            out = out + self.one(hidden, self.w_in[e], self.w_out[e]) * gate
        return out

    def ep_local_forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w_in, w_out = local_part(self.w_in), local_part(self.w_out)
        parts = rows.split(counts.tolist())
        return torch.cat([self.one(x, w_in[e], w_out[e]) for e, x in enumerate(parts)])


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, EXPERTS, bias=False)
        self.experts = UserExperts()


class UserModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.moe = MoE()
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        flat = h.reshape(-1, D)
        w, idx = self.moe.router(flat).softmax(-1).topk(TOPK, dim=-1)
        return self.head(h + self.moe.experts(flat, idx, w).view_as(h))


def loss_fn(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return af.losses.cross_entropy(model(ids[:, :-1]), ids[:, 1:])


def main() -> None:
    plan = BAD_PLAN if "--bad-plan" in sys.argv[1:] else USER_PLAN
    with af.Mesh.from_env(device="cpu") as mesh:
        strategy = knob("strategy", "auto", "ddp")
        rows = int(knob("global_batch_size", "auto", 8)) // mesh.data_size
        step = af.shard(af.train_step(loss_fn, af.optim.adamw(1e-2)), mesh, strategy=strategy, ep_plan=plan)
        torch.manual_seed(0)
        state = step.init(UserModel())
        for i in range(2):
            ids = torch.randint(0, VOCAB, (rows, 9), generator=torch.Generator().manual_seed(i))
            state, metrics = step(state, ids)
        print(f"loss {float(metrics['loss']):.4f}")


if __name__ == "__main__":
    main()
