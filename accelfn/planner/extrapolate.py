"""The planner's layer-extrapolated tier: a candidate dry-run with a few of its blocks per pipeline stage.

A transformer's blocks are identical, so what a rank holds and spends grows by the same amount with each block
it runs: the dry run of the candidate's model cut to `k1` and to `k2` blocks per stage (the same shapes, the
same mesh, stage count and knobs; `keep_blocks`) gives two points, and the figures at the blocks the rank's
stages hold in the whole model lie on their line (`extrapolate`). With a pipeline the cut model is split by the
lowering's own balanced split, so a rank's blocks in each run are read from that split (`rank_blocks`), not
assumed. Peak memory, states, compute, exposed communication, the bubble and the step time are extrapolated;
tokens/s and MFU follow from the step time (the tokens per step do not change, the FLOPs are extrapolated);
so is the dry run's own wall time (`full_run_s`: what confirming the row by a full dry run will cost). The
planner ranks on these figures and confirms the best with full dry runs.

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
import re
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = [
    "BLOCKS",
    "keep_blocks",
    "lead_blocks",
    "stage_blocks",
    "rank_blocks",
    "extrapolate",
    "LINEAR_PER_RANK",
    "LINEAR_PREDICTED",
]

BLOCKS = (2, 3)  # the blocks the tier dry-runs: two points of the line (one block is its own first and last)
LINEAR_PER_RANK = ("peak", "params", "buffers", "grads", "optimizer", "activations")
LINEAR_PREDICTED = ("step_time_s", "compute_s", "comm_s", "exposed_comm_s", "bubble_s")


def keep_blocks(
    n: int | None, seen: dict[str, Any], stages: tuple[int, ...] = ()
) -> Callable[[nn.Module], None]:
    """A `dry_run(on_model=...)` hook that cuts the model's blocks (its largest `nn.ModuleList`, as
    `af.compile(regions="blocks")` finds them) to the first `n` (times `stages[0]`, the pipeline stage
    count the run is expected to split it into: `n` blocks per stage) after its leading blocks unlike the
    last (`lead_blocks`, kept whole and recorded in `seen["lead"]` where there are any: DeepSeek-V3's dense
    layers before its MoE ones), and records how many it had in `seen["blocks"]`; a model with
    that many blocks or fewer (or `n` None) is left whole. For each stage count `s` of `stages`, the blocks of
    each stage of the whole model and of the cut one, as the pipeline's balanced split cuts them, go to
    `seen["full"][s]` and `seen["cut"][s]`.

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
        lead = lead_blocks(blocks)
        if lead:
            seen.setdefault("lead", lead)
        counts = [s for s in stages if 1 < s <= len(blocks)]
        if counts:
            seen.setdefault("full", {s: stage_blocks(model, s) for s in counts})
        keep = None if n is None else lead + n * (stages[0] if stages else 1)
        if keep is not None and len(blocks) > keep:
            del blocks[keep:]
        if counts:
            seen["cut"] = {s: stage_blocks(model, s) for s in counts if s <= len(blocks)}

    return hook


def lead_blocks(blocks: nn.ModuleList) -> int:
    """How many leading blocks to keep whole when cutting `blocks`: up to the last one whose parameters (names
    and shapes) differ from the last block's, so that the blocks cut away, and those a line is drawn through,
    are all alike. 0 for identical blocks; DeepSeek-V3's 3 dense layers before its MoE ones: 3 (cut to its
    first 2, a dense model: no experts for `ep`, the line through dense blocks).

    Example:
        >>> lead_blocks(nn.ModuleList([nn.Linear(4, 8), nn.Linear(4, 4), nn.Linear(4, 4)]))
        1
    """

    def shapes(block: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
        return tuple((name, tuple(p.shape)) for name, p in block.named_parameters())

    last = shapes(blocks[-1])
    return max((i + 1 for i, b in enumerate(blocks) if shapes(b) != last), default=0)


def stage_blocks(model: nn.Module, n_stages: int) -> list[int]:
    """The blocks of each of `n_stages` pipeline stages, as `af.pipeline`'s balanced split cuts `model`.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> cfg = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
        ...                   num_attention_heads=4, num_key_value_heads=2)
        >>> stage_blocks(LlamaForCausalLM(cfg), 2)  # the embeddings and the head weigh a block each and more
        [4, 4]
    """
    from ..stages import balanced_split, decoder_layers

    layers = decoder_layers(model)
    index = {name: i for i, name in enumerate(layers)}
    bounds = [0, *(index[p] for p in balanced_split(model, n_stages).points), len(layers)]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def rank_blocks(report: dict[str, Any], counts: dict[int, list[int]]) -> int | None:
    """The blocks the reporting rank runs: the sum over its pipeline stages (read from the report's strategy,
    `pipeline(1f1b, pp=4, stages [0] of 4, ...)`) of `counts[n_stages]`; None without a pipeline or where the
    stage count was not split in `counts`.

    Example:
        >>> rank_blocks({"strategy": "pipeline(1f1b, pp=2, stages [1] of 2, 4 micro-batches)"}, {2: [3, 5]})
        5
    """
    m = re.search(r"stages \[([\d, ]*)\] of (\d+)", report.get("strategy") or "")
    if m is None or int(m[2]) not in counts:
        return None
    mine = counts[int(m[2])]
    return sum(mine[int(s)] for s in m[1].split(",") if s.strip())


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
    e1, e2 = r1.get("elapsed_s"), r2.get("elapsed_s")
    if e1 is not None and e2 is not None:
        out["elapsed_s"] = max(_line(e1, e2, k1, k2, k), e2)  # the dry run's own wall time
    out["extrapolated"] = {"blocks_per_stage": k, "from": [k1, k2]}
    return out
