"""The planner's layer-extrapolated tier: a candidate dry-run with a few of its blocks per pipeline stage.

A transformer's blocks are identical, so what a rank holds and spends grows by the same amount with each block
it runs: the dry run of the candidate's model cut to `k1` and to `k2` blocks per stage (the same shapes, the
same mesh and knobs; `keep_blocks`) gives two points, and the figures at the model's own `L` blocks per stage
lie on their line (`extrapolate`). Peak memory, states, compute, exposed communication, the bubble and the step
time are extrapolated; tokens/s and MFU follow from the step time (the tokens per step do not change, the
FLOPs are extrapolated). The planner ranks on these figures and confirms the best with full dry runs.

Example:
    >>> r1 = {"per_rank": {"peak": 30, "params": 10}, "predicted": {"step_time_s": 3.0, "tokens_per_s": 8.0},
    ...       "flops_per_step": 100, "capacity_bytes": 100, "headroom_bytes": 70, "fits": True}
    >>> r2 = {"per_rank": {"peak": 40, "params": 15}, "predicted": {"step_time_s": 4.0, "tokens_per_s": 6.0},
    ...       "flops_per_step": 150, "capacity_bytes": 100, "headroom_bytes": 60, "fits": True}
    >>> r = extrapolate(r1, r2, 1, 2, 8)
    >>> r["per_rank"]["peak"], r["predicted"]["step_time_s"], r["predicted"]["tokens_per_s"], r["fits"]
    (100, 10.0, 2.4, True)
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["BLOCKS", "keep_blocks", "extrapolate", "LINEAR_PER_RANK", "LINEAR_PREDICTED"]

BLOCKS = (2, 3)  # the blocks the tier dry-runs: two points of the line (one block is its own first and last)
LINEAR_PER_RANK = ("peak", "params", "buffers", "grads", "optimizer", "activations")
LINEAR_PREDICTED = ("step_time_s", "compute_s", "comm_s", "exposed_comm_s", "bubble_s")


def keep_blocks(n: int | None, seen: dict[str, int]) -> Callable[[nn.Module], None]:
    """A `dry_run(on_model=...)` hook that cuts the model's blocks (its largest `nn.ModuleList`, as
    `af.compile(regions="blocks")` finds them) to the first `n`, and records how many it had in
    `seen["blocks"]`; a model with `n` blocks or fewer (or `n` None) is left whole.

    Example:
        >>> seen = {}
        >>> model = nn.ModuleDict({"embed": nn.Embedding(8, 4), "blocks": nn.ModuleList(nn.Linear(4, 4) for _ in range(6))})
        >>> keep_blocks(2, seen)(model)
        >>> len(model["blocks"]), seen
        (2, {'blocks': 6})
    """
    from ..transforms.compile import find_blocks

    def hook(model: nn.Module) -> None:
        try:
            _, blocks = find_blocks(model)
        except ValueError:
            seen.setdefault("blocks", 0)  # no repeated blocks: nothing to extrapolate over
            return
        seen.setdefault("blocks", len(blocks))
        if n is not None and len(blocks) > n:
            del blocks[n:]

    return hook


def _line(v1: float, v2: float, k1: int, k2: int, k: float) -> float:
    return v1 + (v2 - v1) * (k - k1) / (k2 - k1)


def extrapolate(r1: dict[str, Any], r2: dict[str, Any], k1: int, k2: int, k: float) -> dict[str, Any]:
    """The report (as `Report.to_dict()`) at `k` blocks per stage from those at `k1` and `k2`: the figures
    linear in the blocks on the line through the two; headroom and the verdict from the extrapolated peak;
    tokens/s (tokens per step fixed) and MFU (FLOPs extrapolated) from the extrapolated step time."""
    out = copy.deepcopy(r2)
    pr1, pr2 = r1["per_rank"], r2["per_rank"]
    for name in LINEAR_PER_RANK:
        if name in pr1 and name in pr2:
            out["per_rank"][name] = round(_line(pr1[name], pr2[name], k1, k2, k))
    peak = out["per_rank"]["peak"]
    if r2.get("capacity_bytes") is not None:
        out["headroom_bytes"] = r2["capacity_bytes"] - peak
        out["fits"] = peak <= r2["capacity_bytes"]
    f1, f2 = r1.get("flops_per_step"), r2.get("flops_per_step")
    if f1 is not None and f2 is not None:
        out["flops_per_step"] = _line(f1, f2, k1, k2, k)
    p1, p2 = r1.get("predicted") or {}, r2.get("predicted") or {}
    if p2:
        p = out["predicted"]
        for name in LINEAR_PREDICTED:
            if p1.get(name) is not None and p2.get(name) is not None:
                p[name] = _line(p1[name], p2[name], k1, k2, k)
        t2, t = p2.get("step_time_s"), p.get("step_time_s")
        if t2 and t:
            if p2.get("tokens_per_s") is not None:
                p["tokens_per_s"] = p2["tokens_per_s"] * t2 / t
            if p2.get("mfu") is not None and f2:
                p["mfu"] = p2["mfu"] * (out["flops_per_step"] / f2) * (t2 / t)
    out["extrapolated"] = {"blocks_per_stage": k, "from": [k1, k2]}
    return out
