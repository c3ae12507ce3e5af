"""The load-balancing (aux) loss of an MoE model on the *global* batch: what one process on the whole batch
computes, split between the data-parallel ranks so that their sum is it, value and gradient.

The Switch/Qwen/Mixtral loss is `E * sum_e f_e * P_e` (f: the fraction of routed rows per expert, P: the mean
router probability per expert). It is not a sum over rows, so each rank's own loss (what `transformers` returns
as `aux_loss`) averaged over ranks is not the global one. Here the counts and row numbers are summed over the
ranks first (no gradient flows through them), and each rank returns its rows' share: `E * sum_e f_e * p_e / N`
with `p_e` its own probability sums and `f`, `N` global. `add_aux_loss` adds it to a `Loss(total, count)`.

Example (one process: the same value as transformers' `load_balancing_loss_func`):
    >>> import torch
    >>> from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    >>> logits = (torch.randn(6, 4), torch.randn(6, 4))
    >>> torch.allclose(load_balancing_loss(logits, 4, 2), load_balancing_loss_func(logits, 4, 2))
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..losses import Loss
from .groups import row_group

__all__ = ["load_balancing_loss", "add_aux_loss", "router_z_loss"]


def _sum_over(t: torch.Tensor, group: Any) -> torch.Tensor:
    t = t.detach().clone()
    group = row_group(group)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    group: Any = None,
) -> torch.Tensor:
    """This rank's share of the load-balancing loss of the global batch (`group`: the ranks whose rows add up to
    it, best given as the mesh, `group=mesh`, which takes its data axes and `cp`; None: this process's rows are
    the batch). `router_logits`: one [rows, E] per MoE
    layer; `attention_mask` [rows] (1 for real tokens) leaves padding out, as in `transformers`."""
    device = router_logits[0].device
    tokens = torch.zeros(num_experts, device=device)
    probs = torch.zeros(num_experts, device=device)
    rows = torch.zeros((), device=device)
    mask = attention_mask.reshape(-1).to(device, torch.float32) if attention_mask is not None else None
    for logits in router_logits:
        weights = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
        w = (
            mask.repeat_interleave(top_k)
            if mask is not None
            else torch.ones_like(chosen, dtype=torch.float32)
        )
        tokens = tokens + torch.zeros_like(tokens).scatter_add_(0, chosen, w)
        probs = probs + (weights * mask.unsqueeze(-1) if mask is not None else weights).sum(0)
        rows = rows + (mask.sum() if mask is not None else weights.shape[0])
    stats = _sum_over(torch.cat([tokens, rows.reshape(1)]), group)
    total = stats[-1].clamp_min(1)
    return num_experts * (stats[:-1] / total * probs).sum() / total


def add_aux_loss(loss: Loss, aux: torch.Tensor, coef: float, group: Any = None) -> Loss:
    """`loss` plus `coef` times the global aux loss whose share `aux` this rank holds (`load_balancing_loss`):
    the step divides the total by the global count, so the share is weighted by that count. Under
    `af.accumulate` each micro-batch's aux loss is its own (global over the ranks), weighted by its tokens."""
    count = _sum_over(loss.count.float().reshape(()), group)
    return Loss(loss.total + coef * count * aux, loss.count)


def router_z_loss(
    router_logits: Sequence[torch.Tensor], attention_mask: torch.Tensor | None = None, group: Any = None
) -> torch.Tensor:
    """This rank's share of the router z-loss of the global batch (ST-MoE): over the MoE layers, the sum of the
    mean over the batch's rows of `logsumexp(logits)**2`, the mean taken over the rows of every rank in `group`
    (the row count summed first, no gradient through it), so the ranks' shares add up to one process's value.
    Add it with `add_aux_loss(loss, share, coef, group)`.

    Example (one process):
        >>> import torch
        >>> logits = [torch.randn(6, 4)]
        >>> torch.allclose(router_z_loss(logits), torch.logsumexp(logits[0], -1).pow(2).mean())
        True
    """
    device = router_logits[0].device
    mask = attention_mask.reshape(-1).to(device, torch.float32) if attention_mask is not None else None
    total = torch.zeros((), device=device)
    for logits in router_logits:
        z = torch.logsumexp(logits.float(), dim=-1).pow(2)
        total = total + (z * mask).sum() if mask is not None else total + z.sum()
    rows = mask.sum() if mask is not None else torch.tensor(float(router_logits[0].shape[0]), device=device)
    return total / _sum_over(rows.reshape(()), group).clamp_min(1)
