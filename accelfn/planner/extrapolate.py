"""The planner's layer-extrapolated tier: a candidate dry-run with a few of its blocks per pipeline stage.

A transformer's blocks repeat, so what a rank holds and spends grows by the same amount with each period of
blocks it runs (one block where they are alike; two where sliding and full attention, or dense and MoE layers,
alternate: `layout`): the dry run of the candidate's model cut to `k1` and to `k2` periods per stage (the same
shapes, the same mesh, stage count and knobs; `keep_blocks`) gives two points, and the figures at the periods
the rank's stages hold in the whole model lie on their line (`extrapolate`). Blocks with no period, or a
period of several blocks under a pipeline (whose balanced split does not follow periods), are not cut. With a
pipeline the cut model is split by the lowering's own balanced split, so a rank's blocks in each run are read
from that split (`rank_blocks`), not assumed. Peak memory, states, compute, exposed communication, the bubble
and the step time are extrapolated; tokens/s and MFU follow from the step time (the tokens per step do not
change, the FLOPs are extrapolated); the dry run's own wall time is estimated from the cut runs' (an upper-ish
bound, not their line: `dry_run_seconds`), what confirming the row by a full dry run will cost. The planner ranks on these figures and confirms the best with full dry runs.

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
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import attrs
from torch import nn

__all__ = [
    "BLOCKS",
    "keep_blocks",
    "Layout",
    "signatures",
    "period",
    "layout",
    "remat_every",
    "stage_blocks",
    "rank_blocks",
    "extrapolate",
    "dry_run_seconds",
    "LINEAR_PER_RANK",
    "LINEAR_PREDICTED",
]

BLOCKS = (2, 3)  # the blocks the tier dry-runs: two points of the line (one block is its own first and last)
LINEAR_PER_RANK = ("peak", "params", "buffers", "grads", "optimizer", "activations")
LINEAR_PREDICTED = ("step_time_s", "compute_s", "comm_s", "exposed_comm_s", "bubble_s")


def keep_blocks(
    n: int | None, seen: dict[str, Any], stages: tuple[int, ...] = (), every: int = 1
) -> Callable[[nn.Module], None]:
    """A `dry_run(on_model=...)` hook that cuts the model's blocks (its largest `nn.ModuleList`, as
    `af.compile(regions="blocks")` finds them) to its leading unlike blocks, `n` periods of the blocks after
    them (one block each where they are alike; `stages[0]` times as many with a pipeline of that many stages)
    and the remainder of a last, partial period: its `Layout`, `Layout.keep`. It records how many blocks
    the model had in `seen["blocks"]`, the leading ones in `seen["lead"]` where there are any (DeepSeek-V3's
    dense layers before its MoE ones), the period in `seen["period"]` (None: none), the blocks kept in
    `seen["kept"]`; a model with that many blocks or fewer (or `n` None) is left whole, and so is one the
    layout cannot cut (no period, or a period of several blocks under a pipeline), the reason in
    `seen["whole"]`. `every`: the blocks `af.remat(every=n)` checkpoints (the n-th, 2n-th, ...: a period of its
    own, `layout`). For each stage count `s` of `stages`, the blocks of each stage of the whole model and of
    the cut one, as the pipeline's balanced split cuts them, go to `seen["full"][s]` and `seen["cut"][s]`.

    Example:
        >>> seen = {}
        >>> model = nn.ModuleDict({"embed": nn.Embedding(8, 4), "blocks": nn.ModuleList(nn.Linear(4, 4) for _ in range(6))})
        >>> keep_blocks(2, seen)(model)
        >>> len(model["blocks"]), seen
        (2, {'blocks': 6, 'period': 1, 'kept': 2})
    """
    from ..transforms.compile import find_blocks

    def hook(model: nn.Module) -> None:
        try:
            name, blocks = find_blocks(model)
        except ValueError:
            seen.setdefault("blocks", 0)  # no repeated blocks: nothing to extrapolate over
            return
        seen.setdefault("blocks", len(blocks))
        shape = layout(blocks, _config_of(model, name), every)
        if shape.lead:
            seen.setdefault("lead", shape.lead)
        seen.setdefault("period", shape.period)
        counts = [s for s in stages if 1 < s <= len(blocks)]
        if counts:
            seen.setdefault("full", {s: stage_blocks(model, s) for s in counts})
        if n is None:
            return
        why = shape.uncuttable(stages[0] if stages else 1)
        if why is not None:
            seen["whole"] = why
            return
        keep = shape.keep(n, stages[0] if stages else 1)
        if len(blocks) > keep:
            del blocks[keep:]
        seen["kept"] = len(blocks)
        if counts:
            seen["cut"] = {s: stage_blocks(model, s) for s in counts if s <= len(blocks)}

    return hook


@attrs.frozen
class Layout:
    """How a model's `blocks` repeat: `lead` leading blocks unlike the rest, then blocks that repeat every
    `period` blocks (None: no period of at most a quarter of the blocks after the lead), the last period
    perhaps partial (`remainder` blocks). Alike blocks: period 1; Llama-4 with MoE every 2nd layer, gpt-oss's
    sliding and full attention: 2; Qwen3-Next's 3 linear-attention layers then a full one: 4.

    Example:
        >>> shape = Layout(blocks=26, lead=0, period=6)  # Gemma-3 1B: 5 sliding, 1 full, ...; 26 = 4 x 6 + 2
        >>> shape.remainder, shape.keep(2), shape.keep(3)
        (2, 14, 20)
    """

    blocks: int
    lead: int = 0
    period: int | None = 1

    @property
    def remainder(self) -> int:
        """The blocks of the last, partial period (the first blocks of a period: they follow the whole ones)."""
        return (self.blocks - self.lead) % self.period if self.period else 0

    def keep(self, k: int, stages: int = 1) -> int:
        """The blocks a cut to `k` periods per stage keeps: the lead, `k` x `stages` periods, the remainder
        (kept in the cut, so that the cut model ends as the whole one does; the line in periods then gives the
        whole model's figures exactly where each period adds the same)."""
        return self.lead + k * stages * (self.period or 1) + self.remainder

    def uncuttable(self, stages: int = 1) -> str | None:
        """Why the blocks cannot be cut and extrapolated over `stages` pipeline stages (None: they can)."""
        if self.period is None:
            return (f"the {self.blocks} blocks have no period of at most a quarter of the {self.blocks - self.lead} "
                    f"after the {self.lead} leading unlike ones")  # fmt: skip
        if self.period > 1 and stages > 1:
            return (f"the blocks alternate with a period of {self.period} and the pipeline's balanced split of "
                    f"{stages} stages does not follow periods")  # fmt: skip
        return None


INDEX_NAMES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx", "idx"})
# the attribute types that may change what a block computes (not floats: values, as a scale or a RoPE base)
PLAIN = (bool, int, str, type(None))


def signatures(blocks: nn.ModuleList, config: Any = None) -> list[Hashable]:
    """What makes each block of `blocks` alike or unlike another: its parameters' names and shapes; the plain
    attributes (bool, int, str, None, or tuples of them; not its index, `INDEX_NAMES`) of its modules, where
    `transformers` keeps what a layer computes differently (`sliding_window`, `is_sliding`, `layer_type`,
    `attention_type`, `use_rope`, `is_moe_layer`); and its entry in each list of `config` with one entry per
    block (`layer_types`, `layers_block_type`, `no_rope_layers`: the model's forward picks a layer's mask by
    `config.layer_types[i]`), except a list of floats (values, not compute) or of the block indices.

    Example:
        >>> a, b = nn.Linear(4, 4), nn.Linear(4, 4)
        >>> b.sliding_window = 128
        >>> s = signatures(nn.ModuleList([a, b, nn.Linear(4, 4)]))
        >>> s[0] == s[2], s[0] == s[1]
        (True, False)
    """
    n = len(blocks)
    rows: list[tuple[tuple[str, Hashable], ...]] = [() for _ in range(n)]
    if config is not None:
        fields = config.items() if isinstance(config, Mapping) else getattr(config, "__dict__", {}).items()
        lists = sorted((k, v) for k, v in fields if isinstance(v, (list, tuple)) and len(v) == n)
        for k, v in lists:
            if any(isinstance(x, float) for x in v) or list(v) == list(range(n)):
                continue
            for i, x in enumerate(v):
                rows[i] = (*rows[i], (k, repr(x)))

    def plain(v: Any) -> bool:
        return isinstance(v, PLAIN) or (isinstance(v, tuple) and all(isinstance(x, PLAIN) for x in v))

    def own(block: nn.Module) -> tuple[Hashable, ...]:
        params = tuple((name, tuple(p.shape)) for name, p in block.named_parameters())
        values = tuple(
            (f"{name}.{k}", v)
            for name, m in block.named_modules()
            for k, v in sorted(vars(m).items())
            if not k.startswith("_") and k not in INDEX_NAMES and plain(v)
        )
        return params, values

    return [(own(b), row) for b, row in zip(blocks, rows, strict=True)]


def period(sigs: Sequence[Hashable]) -> tuple[int, int | None]:
    """`(lead, p)`: the blocks with signatures `sigs` repeat every `p` blocks after the first `lead`, with at
    least 4 periods after the lead (a cut to 3 leaves one out); of the pairs that do, the cheapest to
    extrapolate from (the fewest blocks in its cuts to 2 and 3 periods: alike blocks after DeepSeek-V3's 3
    dense ones are `(3, 1)`, not a period of 2), the smaller period of equals. `(0, None)`: no such period.

    Example:
        >>> period("aaaaaaaa"), period("dddmmmmmmm"), period("sfsfsfsfs"), period("lllflllflllflllf"), period("abcab")
        ((0, 1), (3, 1), (0, 2), (0, 4), (0, None))
    """
    n = len(sigs)
    best: tuple[int, int, int | None] = (0, 0, None)  # (cost, lead, p)
    for p in range(1, n // 4 + 1):
        lead = max((j + 1 for j in range(n - p) if sigs[j] != sigs[j + p]), default=0)
        if n - lead < 4 * p:
            continue
        cost = 2 * (lead + (n - lead) % p) + 5 * p
        if best[2] is None or cost < best[0]:
            best = (cost, lead, p)
    return best[1], best[2]


def layout(blocks: nn.ModuleList, config: Any = None, every: int = 1) -> Layout:
    """The `Layout` of `blocks` (with `config`, the model's: its per-layer lists), by `period` of their
    `signatures`; with `every` > 1, of the signatures and whether `af.remat(every=every)` checkpoints the block
    (the `every`-th, 2 x `every`-th, ... counted from 1): alike blocks of which every 2nd recomputes its
    activations repeat every 2 blocks, not every one.

    Example:
        >>> layout(nn.ModuleList([nn.Linear(4, 8), *(nn.Linear(4, 4) for _ in range(5))]))
        Layout(blocks=6, lead=1, period=1)
        >>> layout(nn.ModuleList(nn.Linear(4, 4) for _ in range(8)), every=2)
        Layout(blocks=8, lead=0, period=2)
    """
    sigs = signatures(blocks, config)
    if every > 1:
        sigs = [(sig, (i + 1) % every == 0) for i, sig in enumerate(sigs)]
    lead, p = period(sigs)
    return Layout(len(blocks), lead, p)


def remat_every(strategy: str) -> int:
    """The `every` of the `af.remat` in a dry run's report's `strategy` (its step's repr): 1 without one.

    Example:
        >>> remat_every("Step(train_step(f) -> remat('selective', every=3) -> shard(fsdp, dp=8))")
        3
        >>> remat_every("Step(train_step(f) -> remat('full') -> shard(ddp, dp=8))")
        1
    """
    m = re.search(r"-> remat\((?:[^()]|\([^()]*\))*?\bevery=(\d+)", strategy)
    return int(m[1]) if m else 1


def _config_of(model: nn.Module, name: str) -> Any:
    """The config of the module holding the blocks `name` of `model`, or of a module above it (a
    `transformers` model's text config, whose per-layer lists index its blocks); None without one."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        config = getattr(model.get_submodule(".".join(parts[:i])), "config", None)
        if config is not None:
            return config
    return None


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


def _kernels(report: dict[str, Any]) -> int | None:
    return ((report.get("predicted") or {}).get("assumes") or {}).get("kernels")


def dry_run_seconds(r1: dict[str, Any], r2: dict[str, Any], k1: int, k2: int, k: float) -> float | None:
    """The wall time of the dry run at `k` blocks, from the cut runs' at `k1` and `k2` (their `elapsed_s`,
    warm: `search.run_job` runs a cold one again): an upper-ish estimate, halfway between their time per block
    (the runs' time spread over their blocks, an upper bound: it charges each block with a share of the
    fixed work too; measured 1.0-2.3x the full dry run's) and per kernel (spread over the step's kernels,
    `predicted.assumes.kernels`, a line in the blocks: 0.75-1.4x, low where a block's lowering and collectives
    cost more than its kernels' share, as at 8B), never below the larger run's. Not the line through the two
    times: they differ by one block's worth, less than a loaded machine's noise (the line at 32 blocks was
    -0.6x to 2.3x the full dry run's). None without both times.

    Example:
        >>> r1 = {"elapsed_s": 1.0, "predicted": {"assumes": {"kernels": 300}}}
        >>> r2 = {"elapsed_s": 1.2, "predicted": {"assumes": {"kernels": 400}}}
        >>> round(dry_run_seconds(r1, r2, 2, 3, 10), 2)  # per block 4.4 s, per kernel 3.46 s (1,100 kernels)
        3.93
    """
    e1, e2 = r1.get("elapsed_s"), r2.get("elapsed_s")
    if e1 is None or e2 is None:
        return None
    per_block = (e1 + e2) * k / (k1 + k2)
    n1, n2 = _kernels(r1), _kernels(r2)
    if not n1 or not n2:
        return max(per_block, e2)
    per_kernel = (e1 + e2) * _line(n1, n2, k1, k2, k) / (n1 + n2)
    return max((per_block + per_kernel) / 2, e2)


def extrapolate(r1: dict[str, Any], r2: dict[str, Any], k1: int, k2: int, k: float) -> dict[str, Any]:
    """The report (as `Report.to_dict()`) at `k` blocks per stage from those at `k1` and `k2`: the figures
    linear in the blocks on the line through the two (the collectives' calls and bytes per group too); headroom
    and the verdict from the extrapolated peak; tokens/s (tokens per step fixed) and MFU (FLOPs extrapolated)
    from the extrapolated step time.

    Example:
        >>> def cut(k):
        ...     return {"per_rank": {"peak": 100 * k}, "predicted": {},
        ...             "comm": {"all_to_all": {"ep": {"count": 4 * k, "bytes": 1000 * k, "group_size": 8}}}}
        >>> out = extrapolate(cut(2), cut(3), 2, 3, 48)
        >>> out["per_rank"]["peak"], out["comm"]["all_to_all"]["ep"]["count"], out["comm"]["all_to_all"]["ep"]["bytes"]
        (4800, 192, 48000)
    """
    out = copy.deepcopy(r2)
    pr1, pr2 = r1["per_rank"], r2["per_rank"]
    for name in LINEAR_PER_RANK:
        if name in pr1 and name in pr2:
            out["per_rank"][name] = round(_line(pr1[name], pr2[name], k1, k2, k))
    peak = out["per_rank"]["peak"]
    if r2.get("capacity_bytes") is not None:
        out["headroom_bytes"] = r2["capacity_bytes"] - peak
        out["fits"] = peak <= r2["capacity_bytes"]
    # each collective's calls and bytes per process group: a block's are the same in every block (the planner's
    # all-to-all bounds read them, `prune.all_to_all_time`); a group only the larger run has keeps its figures
    c1 = r1.get("comm") or {}
    for kind, groups in (out.get("comm") or {}).items():
        for axis, row in groups.items():
            before = (c1.get(kind) or {}).get(axis)
            if before is not None:
                for name in ("count", "bytes", "bus_bytes"):
                    if name in row and name in before:
                        row[name] = max(0, round(_line(before[name], row[name], k1, k2, k)))
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
    wall = dry_run_seconds(r1, r2, k1, k2, k)
    if wall is not None:
        out["elapsed_s"] = wall
    out["extrapolated"] = {"blocks_per_stage": k, "from": [k1, k2]}
    return out
