"""The step's MoE metrics from its dispatchers: tokens per expert of the global batch, the imbalance, the dropped
fraction (with a capacity factor), summed over the data-parallel ranks in one all-reduce.

`metrics["moe_tokens"]` ([MoE layers, E], int64: the rows each expert was routed, a token counting once per
chosen expert), `metrics["moe_imbalance"]` (over the layers, the largest ratio of the most loaded expert's rows to
the mean; 1.0 is balanced) and, when a dispatcher has a capacity factor, `metrics["moe_dropped"]` (the fraction
of all routed rows, every layer, dropped over capacity).

Example (one process, one MoE layer, 4 experts):
    >>> import torch
    >>> from accelfn.moe.dispatch import AllToAllDispatcher
    >>> from accelfn.moe.metrics import step_metrics
    >>> d = AllToAllDispatcher(None, 4, 1, capacity_factor=1.0)
    >>> _ = d.dispatch(torch.randn(8, 2, requires_grad=True), torch.tensor([0, 0, 0, 0, 1, 1, 2, 3]))
    >>> m = step_metrics([d])
    >>> m["moe_tokens"].tolist(), m["moe_imbalance"].item(), m["moe_dropped"].item()
    ([[4, 2, 1, 1]], 2.0, 0.25)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .dispatch import AllToAllDispatcher

__all__ = ["step_metrics"]


def step_metrics(dispatchers: Sequence[AllToAllDispatcher], group: Any = None) -> dict[str, torch.Tensor]:
    """The MoE metrics of the rows the `dispatchers` (one per MoE layer) counted since the last call, summed over
    `group` (the data-parallel ranks: `mesh.data_group()`; None: this process saw the whole batch); takes (resets)
    their counts. Collective over `group`: call on every rank."""
    if not dispatchers:
        return {}
    counts = torch.stack([torch.cat([d.take_tokens(), d.take_dropped().reshape(1)]) for d in dispatchers])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    tokens, dropped = counts[:, :-1], counts[:, -1]
    load = tokens.double()
    out = {
        "moe_tokens": tokens,
        "moe_imbalance": (load.max(1).values / load.mean(1).clamp_min(1e-12)).max().float(),
    }
    if any(d.capacity_factor is not None for d in dispatchers):
        out["moe_dropped"] = (dropped.sum().double() / load.sum().clamp_min(1)).float()
    return out
