"""Aux-loss-free load balancing (DeepSeek-V3): a per-expert bias added to the router's scores for the top-k
choice only (the routing weights stay the unbiased scores), nudged once per optimizer step towards the experts
that received fewer rows than the mean, from the token counts of the global batch.

The bias and the step's counts are buffers of each router (`expert_bias` fp32, `expert_tokens` int64), so they
live in `state.buffers`, are checkpointed, and move with the state. The forward only counts (not in an eval
step, nor when full remat recomputes the forward during the backward); `update_expert_bias(state, rate, group)`,
called once after each optimizer step, sums the counts over the data-parallel ranks, updates every bias by
`rate * sign(mean - count)`, zeroes the counts and returns the new state and the global counts.

Example (one process, a Qwen3-MoE-style router):
    >>> import torch
    >>> from torch import nn
    >>> router = nn.Linear(4, 3, bias=False)
    >>> register_expert_bias(router, 3)
    >>> _ = router.expert_bias.copy_(torch.tensor([0.0, 0.0, 10.0]))
    >>> values, idx = biased_topk(router, torch.tensor([[0.5, 0.25, 0.125]]), 1)
    >>> idx.tolist(), values.tolist(), router.expert_tokens.tolist()
    ([[2]], [[0.125]], [0, 0, 1])
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..state import TrainState
from .groups import row_group

__all__ = [
    "register_expert_bias",
    "add_expert_bias",
    "biased_topk",
    "update_expert_bias",
    "BIAS",
    "TOKENS",
    "OWN_BIAS",
]

BIAS, TOKENS = "expert_bias", "expert_tokens"


def register_expert_bias(router: nn.Module, num_experts: int) -> None:
    """Give `router` the two buffers: `expert_bias` [E] fp32 zeros and `expert_tokens` [E] int64 zeros."""
    router.register_buffer(BIAS, torch.zeros(num_experts, dtype=torch.float32))
    router.register_buffer(TOKENS, torch.zeros(num_experts, dtype=torch.int64))


def _counting() -> bool:
    """A training forward: gradients on, and not the recomputation that full remat runs inside the backward."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


def biased_topk(router: nn.Module, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-`k` experts of each row of `scores` [rows, E] chosen on `scores + router.expert_bias`, with their
    unbiased scores as the values; in a training forward, adds the chosen rows to `router.expert_tokens`."""
    bias: torch.Tensor = getattr(router, BIAS)
    idx = torch.topk(scores.detach().float() + bias, k, dim=-1).indices
    if _counting():
        tokens: torch.Tensor = getattr(router, TOKENS)
        flat = idx.reshape(-1)  # scatter, not bincount: a static shape, so fake tensors (the dry run) take it
        tokens.scatter_add_(0, flat, torch.ones_like(flat, dtype=tokens.dtype))
    return scores.gather(-1, idx), idx


def _topk_router_forward(router: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`transformers`' softmax top-k router (Qwen3-MoE, OLMoE, Mixtral...) with the biased choice."""
    hidden_states = hidden_states.reshape(-1, int(router.hidden_dim))  # type: ignore[arg-type]
    logits = nn.functional.linear(hidden_states, router.weight)  # type: ignore[arg-type]
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    values, idx = biased_topk(router, probs, router.top_k)  # type: ignore[arg-type]
    if getattr(router, "norm_topk_prob", False):
        values = values / values.sum(dim=-1, keepdim=True)
    return logits, values.to(logits.dtype), idx


_ROUTER_ATTRS = ("weight", "top_k", "num_experts", "hidden_dim")


OWN_BIAS = "e_score_correction_bias"  # DeepSeek-V3's (and GLM-4.5's...) own aux-loss-free bias buffer


def _counted_forward(router: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A router with its own bias (DeepSeek-V3's sigmoid, group-limited top-k, which adds
    `e_score_correction_bias` for the choice only): its own forward, the chosen experts counted."""
    out = type(router).forward(router, hidden_states)
    if _counting():
        tokens: torch.Tensor = getattr(router, TOKENS)
        flat = out[-1].reshape(-1)
        tokens.scatter_add_(0, flat, torch.ones_like(flat, dtype=tokens.dtype))
    return out  # type: ignore[no-any-return]


def add_expert_bias(model: nn.Module, routers: Iterable[str] | None = None) -> list[str]:
    """Aux-loss-free balancing for a `transformers` MoE model: every top-k router (a module whose class name ends
    in `TopKRouter` or `TopkRouter`, with `weight`, `top_k`, `num_experts`, `hidden_dim`), or the modules named in
    `routers`. A softmax router gets the buffers and a forward that chooses with the bias; a router with its own
    bias (`e_score_correction_bias`: DeepSeek-V3's sigmoid, group-limited top-k) keeps its forward and that bias,
    and gets `expert_tokens` only (`update_expert_bias` moves its own bias). Call before `step.init(model)`.
    Returns the routers' names. (A user's own router calls `register_expert_bias` and `biased_topk` itself.)"""
    names = (
        list(routers)
        if routers is not None
        else [n for n, m in model.named_modules() if type(m).__name__.lower().endswith("topkrouter")]
    )
    if not names:
        raise ValueError(
            f"add_expert_bias: {type(model).__name__} has no module whose class ends in 'TopKRouter'; pass "
            "routers=[names], or call register_expert_bias and biased_topk in your router"
        )
    for name in names:
        router = model.get_submodule(name)
        if isinstance(getattr(router, OWN_BIAS, None), torch.Tensor) and hasattr(router, "num_experts"):
            router.register_buffer(TOKENS, torch.zeros(int(router.num_experts), dtype=torch.int64))  # type: ignore[arg-type]
            router.forward = _counted_forward.__get__(router)  # type: ignore[method-assign]
            continue
        missing = [a for a in _ROUTER_ATTRS if not hasattr(router, a)]
        if (
            missing
            or getattr(router, "score_function", "softmax") != "softmax"
            or hasattr(router, "num_group")
        ):
            raise ValueError(
                f"add_expert_bias: the router {name!r} ({type(router).__name__}) is not a softmax top-k router "
                f"(missing {missing or 'a softmax score'}); call register_expert_bias and biased_topk in it instead"
            )
        register_expert_bias(router, int(router.num_experts))  # type: ignore[arg-type]
        router.forward = _topk_router_forward.__get__(router)  # type: ignore[method-assign]
    return names


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # type: ignore[no-any-return]


def update_expert_bias(
    state: TrainState, rate: float = 1e-3, group: Any = None
) -> tuple[TrainState, dict[str, torch.Tensor]]:
    """The state with every router's `expert_bias` (or its own `e_score_correction_bias`) moved by `rate * sign(mean - count)` on the step's global
    counts (`expert_tokens` summed over `group`: best `group=mesh`, its data axes and `cp`) and the counts
    zeroed; and `{"moe_tokens": [routers, E]}`, the global counts, to add to the step's metrics. Call once
    after each optimizer step, on every rank (a collective). ValueError on a state without the buffers."""
    routers = sorted(k[: -len(TOKENS) - 1] for k in state.buffers if k.endswith("." + TOKENS))
    if not routers:
        raise ValueError(
            "update_expert_bias: the state has no '*.expert_tokens' buffer; call af.moe.add_expert_bias(model) "
            "(or register_expert_bias in your router) before step.init(model)"
        )
    counts = torch.stack([_full(state.buffers[f"{r}.{TOKENS}"]) for r in routers])
    group = row_group(group)
    if group is not None and dist.get_world_size(group) > 1:
        counts = counts.clone()
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    load = counts.double()
    step = torch.sign(load.mean(-1, keepdim=True) - load).float() * rate
    buffers = dict(state.buffers)
    for i, r in enumerate(routers):
        key = f"{r}.{BIAS}" if f"{r}.{BIAS}" in state.buffers else f"{r}.{OWN_BIAS}"
        bias = state.buffers[key]
        buffers[key] = bias + step[i].to(bias.device, bias.dtype)
        buffers[f"{r}.{TOKENS}"] = torch.zeros_like(state.buffers[f"{r}.{TOKENS}"])
    return state.replace(buffers=buffers), {"moe_tokens": counts}
