"""The planner's first two tiers: legality, then the exact states bound.

Legality here is what the planner itself promises the script (its global batch splits evenly over the
data-parallel ranks); everything the lowering checks (heads and kv heads by tp, layers by pp, sequence by cp,
batch by micro-batches) is left to the lowering itself, which the search runs on fake ranks (`search.py`):
its error is the reason a candidate falls. The states bound is the bytes of parameters, gradients and
optimizer state one rank holds at least, known without running a step: the whole model's (a one-process dry
run measures them) divided by the ways the candidate splits them; a candidate whose bound exceeds the device's
usable memory cannot fit.

Example:
    >>> from accelfn.planner.candidates import Candidate
    >>> totals = States(params=4 * 10**9, grads=4 * 10**9, optimizer=8 * 10**9)
    >>> states_bound(Candidate({"dp": 8}, "fsdp"), totals, script_strategy=None)
    2000000000
    >>> states_bound(Candidate({"dp": 8}, "ddp"), totals, script_strategy=None)
    16000000000
"""

from __future__ import annotations

import attrs

from .candidates import ZERO, Candidate, data_size

__all__ = ["States", "states_bound", "illegal", "shards", "zero_shards", "time_bound"]


@attrs.frozen
class States:
    """The whole model's states in bytes (one process holds them all): params (buffers included), grads,
    optimizer."""

    params: int
    grads: int
    optimizer: int

    @classmethod
    def of(cls, per_rank: dict[str, int]) -> States:
        """From a one-process dry run's `per_rank`."""
        return cls(
            params=per_rank.get("params", 0) + per_rank.get("buffers", 0),
            grads=per_rank.get("grads", 0),
            optimizer=per_rank.get("optimizer", 0),
        )


def shards(strategy: str | None, mesh: dict[str, int]) -> int:
    """Over how many ranks a data-parallel `strategy` splits the states: fsdp over the data axes and cp, hsdp
    over its `fsdp` axis (and `ep`, which it shards over too), ddp none; a strategy the script fixes (None:
    unknown here) as fsdp, so that the bound stays a lower bound."""
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


def states_bound(c: Candidate, totals: States, *, script_strategy: str | None) -> int:
    """The least bytes of params, grads and optimizer state a rank of `c` holds: each is split at most over
    tp x pp (a stage holds at least the average) and the strategy's shards (ZeRO: each state by its stage,
    `zero_shards`), or with an `ep` axis over ep x cp where that is more (the experts' split; the dense layers'
    is no finer); offloaded optimizer state is on the host."""
    strategy = c.strategy or script_strategy
    model = c.mesh.get("tp", 1) * c.mesh.get("pp", 1)
    optimizer = 0 if c.offload == "optimizer" else totals.optimizer
    if strategy in ZERO:
        p, g, o = zero_shards(strategy, c.mesh)
        return totals.params // (model * p) + totals.grads // (model * g) + optimizer // (model * o)
    ways = shards(strategy, c.mesh)
    ep = c.mesh.get("ep", 1)
    if ep > 1:  # the experts are split over ep and the cp ranks it borrows, whatever the strategy
        ways = max(ways, ep * c.mesh.get("cp", 1))
    return (totals.params + totals.grads + optimizer) // (model * ways)


def illegal(c: Candidate) -> str | None:
    """Why the planner cannot give `c` to the script (None: it can): its global batch must split evenly over
    the data-parallel ranks and their micro-batches; fsdp with an `ep` axis needs a data axis beside it to
    shard the experts over (efsdp), as `af.shard` refuses otherwise (a rule of the strategy, not of the mesh:
    the mesh's other candidates are not pruned with it); a ZeRO stage (DeepSpeed) takes no af.offload.

    Example:
        >>> illegal(Candidate({"dp": 1, "ep": 8}, "fsdp"))
        'fsdp with ep=8 shards the experts over the data axes other than ep (efsdp), and dp=1 leaves none'
    """
    gbs, dp = c.global_batch_size, data_size(c.mesh) if c.mesh else 1
    ep = c.mesh.get("ep", 1)
    if ep > 1 and c.strategy == "fsdp" and dp == ep:
        return f"fsdp with ep={ep} shards the experts over the data axes other than ep (efsdp), and dp=1 leaves none"
    if c.strategy in ZERO and c.offload == "optimizer":
        return f"{c.strategy} (DeepSpeed) offloads through its own config, not af.offload"
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
