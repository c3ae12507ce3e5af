"""The planner's first two tiers: legality, then the exact states bound.

Legality here is what the planner itself promises the script (its global batch splits evenly over the
data-parallel ranks); everything the lowering checks (heads and kv heads by tp, layers by pp, sequence by cp,
batch by micro-batches) is left to the lowering itself, which the search runs on fake ranks (`search.py`):
its error is the reason a candidate falls. The states bound is the bytes of parameters, gradients and
optimizer state one rank holds at least, known without running a step: the whole model's (a one-process dry
run measures them) divided by the ways the candidate splits them, the experts' params (and their grads and
optimizer state) by the ways expert parallel splits them; a candidate whose bound exceeds the device's usable
memory cannot fit.

Example:
    >>> from accelfn.planner.candidates import Candidate
    >>> totals = States(params=4 * 10**9, grads=4 * 10**9, optimizer=8 * 10**9)
    >>> states_bound(Candidate({"dp": 8}, "fsdp"), totals, script_strategy=None)
    2000000000
    >>> states_bound(Candidate({"dp": 8}, "ddp"), totals, script_strategy=None)
    16000000000
    >>> moe = attrs.evolve(totals, experts=3 * 10**9)  # 3/4 of the params are experts
    >>> states_bound(Candidate({"dp": 2, "ep": 4}, "ddp"), moe, script_strategy=None)  # 4 GB dense + 12 GB / 4
    7000000000
"""

from __future__ import annotations

import re

import attrs

from .candidates import ZERO, Candidate, data_size

__all__ = [
    "States",
    "states_bound",
    "illegal",
    "shards",
    "expert_shards",
    "zero_shards",
    "time_bound",
    "lowered_strategy",
]


@attrs.frozen
class States:
    """The whole model's states in bytes (one process holds them all): params (buffers included), grads,
    optimizer."""

    params: int
    grads: int
    optimizer: int
    experts: int = 0  # of `params`, the bytes of the params stacked over experts (`experts.expert_bytes`)

    @classmethod
    def of(cls, per_rank: dict[str, int], experts: int = 0) -> States:
        """From a one-process dry run's `per_rank` and the bytes of its model's expert params."""
        return cls(
            params=per_rank.get("params", 0) + per_rank.get("buffers", 0),
            grads=per_rank.get("grads", 0),
            optimizer=per_rank.get("optimizer", 0),
            experts=experts,
        )

    def split(self, optimizer: int) -> tuple[int, int]:
        """(dense, experts): the bytes of params, grads and `optimizer` (the state counted) of the dense layers
        and of the experts, each state split as the params are (grads and optimizer state follow their param)."""
        whole = self.params + self.grads + optimizer
        share = min(1.0, self.experts / self.params) if self.params else 0.0
        experts = int(whole * share)
        return whole - experts, experts


def shards(strategy: str | None, mesh: dict[str, int]) -> int:
    """Over how many ranks a data-parallel `strategy` splits the states: fsdp over the data axes and cp, hsdp
    over its `fsdp` axis (and `ep`, which it shards over too), ddp none; an unknown strategy (None: one the
    script fixes that the probe could not name, `lowered_strategy`) as fsdp, so that the bound stays a lower
    bound."""
    if strategy in ("fsdp", None):
        return data_size(mesh) * mesh.get("cp", 1)
    if strategy == "hsdp":
        return mesh.get("fsdp", 1) * mesh.get("ep", 1) * mesh.get("cp", 1)
    return 1


def zero_shards(strategy: str, mesh: dict[str, int]) -> tuple[int, int, int]:
    """Over how many ranks DeepSpeed's ZeRO stage `strategy` (zero1-3) splits (params, grads, optimizer): the
    optimizer state from stage 1, the gradients from 2, the params at 3, each over all the data-parallel ranks.

    Example:
        >>> zero_shards("zero2", {"dp": 8})
        (1, 8, 8)
    """
    stage, data = int(strategy[-1]), data_size(mesh)
    return (data if stage >= 3 else 1, data if stage >= 2 else 1, data)


def expert_shards(strategy: str | None, mesh: dict[str, int]) -> int:
    """Over how many ranks beside tp x pp the experts are split under `strategy` with an `ep` axis, as the
    lowering splits them: over ep and the cp ranks it borrows (the tp ranks it borrows are tp's own split), then
    fsdp (efsdp) over the data axes other than ep, hsdp over its `fsdp` axis, ddp over none; an unknown
    strategy (None) as fsdp.

    Example:
        >>> expert_shards("ddp", {"dp": 2, "ep": 4}), expert_shards("fsdp", {"dp": 2, "ep": 4})
        (4, 8)
    """
    ep, cp = mesh.get("ep", 1), mesh.get("cp", 1)
    if strategy in ("fsdp", None):
        return data_size(mesh) * cp  # ep x cp x the other data axes
    if strategy == "hsdp":
        return ep * cp * mesh.get("fsdp", 1)
    return ep * cp


def states_bound(c: Candidate, totals: States, *, script_strategy: str | None) -> int:
    """The least bytes of params, grads and optimizer state a rank of `c` holds: each is split at most over
    tp x pp (a stage holds at least the average) and the strategy's shards (ZeRO: each state by its stage,
    `zero_shards`); with an `ep` axis, the experts' part (`totals.experts`) over their own split
    (`expert_shards`), or without that part known, the whole over the larger of the two splits; offloaded
    optimizer state is on the host. `script_strategy`: the strategy the script fixes (`lowered_strategy` of its
    probe), for a candidate that sets none; None where unknown (then as fsdp, the finest split)."""
    strategy = c.strategy or script_strategy
    model = c.mesh.get("tp", 1) * c.mesh.get("pp", 1)
    optimizer = 0 if c.offload == "optimizer" else totals.optimizer
    if strategy in ZERO:
        p, g, o = zero_shards(strategy, c.mesh)
        return totals.params // (model * p) + totals.grads // (model * g) + optimizer // (model * o)
    ways = shards(strategy, c.mesh)
    if c.mesh.get("ep", 1) == 1:
        return (totals.params + totals.grads + optimizer) // (model * ways)
    experts = expert_shards(strategy, c.mesh)
    if not totals.experts:  # which bytes are experts is not known: the finer split for all
        return (totals.params + totals.grads + optimizer) // (model * max(ways, experts))
    dense, expert = totals.split(optimizer)
    return dense // (model * ways) + expert // (model * experts)


def illegal(c: Candidate, script_strategy: str | None = None) -> str | None:
    """Why the planner cannot give `c` to the script (None: it can): its global batch must split evenly over
    the data-parallel ranks and their micro-batches; fsdp with an `ep` axis needs a data axis beside it to
    shard the experts over (efsdp), as `af.shard` refuses otherwise (a rule of the strategy, not of the mesh:
    the mesh's other candidates are not pruned with it); a ZeRO stage (DeepSpeed) takes no af.offload, nor
    does fsdp or hsdp (`af.offload` refuses FSDP-sharded state). The strategy is `c`'s, else
    `script_strategy`, the one the script fixes (`lowered_strategy`; None: unknown).

    Example:
        >>> illegal(Candidate({"dp": 1, "ep": 8}, "fsdp"))
        'fsdp with ep=8 shards the experts over the data axes other than ep (efsdp), and dp=1 leaves none'
        >>> illegal(Candidate({"dp": 8}, offload="optimizer"), script_strategy="fsdp")
        'fsdp (the script fixes it) with af.offload: offloading FSDP-sharded state is not supported yet'
    """
    gbs, dp = c.global_batch_size, data_size(c.mesh) if c.mesh else 1
    ep = c.mesh.get("ep", 1)
    strategy = c.strategy or script_strategy
    named = c.strategy or f"{script_strategy} (the script fixes it)"
    if ep > 1 and strategy == "fsdp" and dp == ep:
        return f"{named} with ep={ep} shards the experts over the data axes other than ep (efsdp), and dp=1 leaves none"
    if strategy in ZERO and c.offload == "optimizer":
        return f"{named} (DeepSpeed) offloads through its own config, not af.offload"
    if strategy in ("fsdp", "hsdp") and c.offload == "optimizer":
        # af.offload refuses it at lowering: checked here, a dry run of the first candidate of a mesh that
        # failed so would prune the mesh's candidates without offload with it
        return f"{named} with af.offload: offloading FSDP-sharded state is not supported yet"
    if gbs is None:
        return None
    if gbs % dp:
        return f"global batch {gbs} is not divisible by the {dp} data-parallel ranks"
    if c.accumulate and (gbs // dp) % c.accumulate:
        return f"each rank's {gbs // dp} samples do not split into {c.accumulate} micro-batches"
    return None


def time_bound(c: Candidate, compute_s: float, world: int) -> float:
    """A lower bound of `c`'s step time: `compute_s` (the compute of the whole global batch at the probe's
    efficiency: one process, the largest matmuls, no recomputation beyond the script's own) shared by the
    `world` ranks, plus a pipeline's bubble, at least (pp - 1) micro-batch slots of its `pipeline_microbatches`
    per stage (1F1B and GPipe alike); no communication.

    Example:
        >>> time_bound(Candidate({"pp": 4, "dp": 2}, pipeline_microbatches=8), 8.0, 8)
        1.375
    """
    pp, micro = c.mesh.get("pp", 1), c.pipeline_microbatches
    bubble = (pp - 1) / micro if pp > 1 and micro else 0.0
    return compute_s / world * (1 + bubble)


_SHARD = re.compile(r"\bshard\((\w+), ([^)]*)\)")


def lowered_strategy(description: str) -> str | None:
    """The strategy knob's value (ddp, fsdp, hsdp, zero1-3) of the `af.shard` a dry run lowered, read from its
    step's description (a report's `strategy`: `Shard.describe`, e.g. `shard(fsdp, dp=1)`,
    `shard(ddp, dp=1, backend='deepspeed', zero_stage=2)`); None without one, or for one the knob does not name
    (local SGD, a DeepSpeed config without a stage).

    Example:
        >>> lowered_strategy("Step(train_step(loss) -> shard(fsdp, dp=1)  [fsdp over 1 ranks])")
        'fsdp'
        >>> lowered_strategy("Step(... -> shard(ddp, dp=1, backend='deepspeed', zero_stage=2)  [...])")
        'zero2'
    """
    m = _SHARD.search(description or "")
    if m is None:
        return None
    name, options = m[1], m[2]
    if "backend='deepspeed'" in options:
        stage = re.search(r"zero_stage=(\d)", options)
        return f"zero{stage[1]}" if stage is not None and stage[1] in "123" else None
    if "backend=" in options:
        return None
    return name if name in ("ddp", "fsdp", "hsdp") else None
