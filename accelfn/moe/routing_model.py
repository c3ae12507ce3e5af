"""How a dry run routes its rows (fake tensors: no expert ids to read): the rows each rank of an `ep` group sends
to each expert, under an assumed router, so that the simulated rank can be given the busiest rank's load.

- `"uniform"` (the default): each token picks its k experts uniformly at random without replacement, the null
  model of a balanced router (equal expected load per expert, the multinomial-like spread around it); sampled
  with a fixed seed per (MoE layer, source rank), so two dry runs route alike.
- `"even"`: every expert exactly `rows / E` rows (the remainder to the first experts), every rank alike.
- a number `f` >= 1 (a measured `moe_imbalance`, the max/mean of `accelfn.moe.step_metrics`): the first expert
  gets `f` times its even share of every rank's rows, the others share the rest evenly.

Example:
    >>> from accelfn.moe.routing_model import routed_counts
    >>> routed_counts("even", tokens=5, k=2, num_experts=4, sources=2).tolist()
    [[3, 3, 2, 2], [3, 3, 2, 2]]
    >>> c = routed_counts("uniform", tokens=1000, k=2, num_experts=4, sources=2, layer=0)
    >>> c.sum(1).tolist(), bool((c <= 1000).all())
    ([2000, 2000], True)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ROUTINGS", "check_routing", "uniform_choices", "routed_counts", "imbalance"]

ROUTINGS = ("uniform", "even")
SEED = 20_260_032  # the routing model's base seed (issue 32)


def check_routing(routing: Any) -> str | float:
    """`routing` if it names a routing model (`ROUTINGS`, or a max/mean factor >= 1), else a ValueError naming it."""
    if isinstance(routing, str) and routing in ROUTINGS:
        return routing
    if isinstance(routing, (int, float)) and not isinstance(routing, bool) and routing >= 1:
        return float(routing)
    raise ValueError(
        f"moe_routing must be one of {', '.join(map(repr, ROUTINGS))} or a measured max/mean rows per expert "
        f"(a number >= 1, e.g. a real run's metrics['moe_imbalance']), got {routing!r}"
    )


def uniform_choices(tokens: int, k: int, num_experts: int, generator: torch.Generator) -> torch.Tensor:
    """[tokens, k] expert ids: each token's k distinct experts, a uniformly random k-subset of the `num_experts`
    (Floyd's algorithm, vectorised over the tokens: k draws per token, whatever the number of experts)."""
    if not 1 <= k <= num_experts:
        raise ValueError(f"top-k routing needs 1 <= k <= experts, got k={k} of {num_experts} experts")
    chosen = torch.empty(tokens, k, dtype=torch.int64)
    for i, j in enumerate(range(num_experts - k, num_experts)):
        t = torch.randint(j + 1, (tokens,), generator=generator)
        taken = (chosen[:, :i] == t[:, None]).any(1)
        chosen[:, i] = torch.where(taken, j, t)
    return chosen


def routed_counts(
    routing: str | float, *, tokens: int, k: int, num_experts: int, sources: int, layer: int = 0
) -> torch.Tensor:
    """[sources, num_experts] int64: the rows each of `sources` ranks (each with `tokens` tokens, top-`k`) routes
    to each expert under `routing` (see the module's docstring); `layer` seeds the uniform model (with the
    source rank), so every layer routes differently and every run alike."""
    routing = check_routing(routing)
    rows = tokens * k
    if routing == "uniform":
        out = torch.empty(sources, num_experts, dtype=torch.int64)
        for s in range(sources):
            g = torch.Generator().manual_seed(SEED + 1_000_003 * layer + s)
            out[s] = torch.bincount(
                uniform_choices(tokens, k, num_experts, g).flatten(), minlength=num_experts
            )
        return out
    if routing == "even":
        return _spread(rows, num_experts).expand(sources, -1).clone()
    first = min(rows, round(float(routing) * rows / num_experts)) if num_experts > 1 else rows
    row = torch.cat([torch.tensor([first]), _spread(rows - first, num_experts - 1)])
    return row.expand(sources, -1).clone()


def _spread(rows: int, n: int) -> torch.Tensor:
    """`rows` over `n` bins as evenly as can be, the remainder to the first: [n] int64."""
    return torch.tensor([rows // n + (e < rows % n) for e in range(n)], dtype=torch.int64)


def imbalance(counts: torch.Tensor) -> float:
    """The max/mean of the rows per expert of `counts` [..., E] summed over its leading dims (1.0: balanced), as
    `accelfn.moe.step_metrics` defines it for one layer.

    Example:
        >>> imbalance(torch.tensor([[4, 0], [2, 2]]))
        1.5
    """
    load = counts.reshape(-1, counts.shape[-1]).sum(0).double()
    return float(load.max() / load.mean().clamp_min(1e-12))
