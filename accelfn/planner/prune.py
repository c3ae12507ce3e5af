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
from collections.abc import Sequence
from typing import Any

import attrs

from ..dryrun.comm_time import CommAssumptions
from ..platforms.specs import DeviceSpec
from .candidates import ZERO, Candidate, data_size

# how many times the rows' bytes may shrink from one strategy to another: the all-to-alls move hidden states in
# autocast's dtype where it is on (`moe.experts.ep_forward`: ddp and fsdp under af.autocast send the same 16-bit
# rows), else as the residual stream holds them: fp32 where the strategy keeps fp32 params (ddp without autocast),
# 16-bit where it casts them (FSDP's MixedPrecisionPolicy(param_dtype=bf16)); never below 16 bits (the default
# dispatcher sends the rows as they are, no fp8 dispatch). A margin that is tight only in that last case.
DTYPE_RATIO = 2

__all__ = [
    "States",
    "states_bound",
    "illegal",
    "shards",
    "expert_shards",
    "zero_shards",
    "time_bound",
    "lowered_strategy",
    "Exchanges",
    "all_to_all_time",
    "comm_bound",
    "routed_bound",
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


def states_bound(
    c: Candidate, totals: States, *, script_strategy: str | None, script_sync_each: bool = False
) -> int:
    """The least bytes of params, grads and optimizer state a rank of `c` holds: each is split at most over
    tp x pp (a stage holds at least the average) and the strategy's shards (ZeRO: each state by its stage,
    `zero_shards`); with an `ep` axis, the experts' part (`totals.experts`) over their own split
    (`expert_shards`), or without that part known, the whole over the larger of the two splits; offloaded
    optimizer state is on the host; under a pipeline the gradients are held unsharded over the data axes
    (torch's pipeline stage syncs them in the step's last backward only: 4 bytes per param of the stage in
    fp32, which no remat or micro-batch count reduces) unless each micro-batch reduce-scatters them
    (`af.pipeline(..., sync_each_microbatch=True)`: the candidate's knob, else `script_sync_each`, what the
    script fixes). `script_strategy`: the strategy the script fixes (`lowered_strategy` of its probe), for a
    candidate that sets none; None where unknown (then as fsdp, the finest split).

    Example:
        >>> totals = States(params=4 * 10**9, grads=4 * 10**9, optimizer=8 * 10**9)
        >>> states_bound(Candidate({"dp": 8}, "fsdp"), totals, script_strategy=None) // 10**6
        2000
        >>> states_bound(Candidate({"pp": 2, "dp": 4}, "fsdp"), totals, script_strategy=None) // 10**6  # + 2 GB
        3500
        >>> states_bound(Candidate({"pp": 2, "dp": 4}, "fsdp", pipeline_sync_each_microbatch=True), totals,
        ...              script_strategy=None) // 10**6
        2000
    """
    strategy = c.strategy or script_strategy
    model = c.mesh.get("tp", 1) * c.mesh.get("pp", 1)
    optimizer = 0 if c.offload == "optimizer" else totals.optimizer
    if strategy in ZERO:
        p, g, o = zero_shards(strategy, c.mesh)
        return totals.params // (model * p) + totals.grads // (model * g) + optimizer // (model * o)
    ways = shards(strategy, c.mesh)
    # under a pipeline the stage holds its gradients unsharded over the data axes until the step's last
    # backward (torch's stage turns FSDP2's gradient sync off for the others: `backward_maybe_with_nosync`)
    each = c.pipeline_sync_each_microbatch
    pipelined = c.mesh.get("pp", 1) > 1 and not (script_sync_each if each is None else each)
    grad_ways = 1 if pipelined else ways
    kept = totals.params + optimizer
    if c.mesh.get("ep", 1) == 1:
        return kept // (model * ways) + totals.grads // (model * grad_ways)
    experts = expert_shards(strategy, c.mesh)
    expert_grad_ways = c.mesh.get("ep", 1) * c.mesh.get("cp", 1) if pipelined else experts
    if not totals.experts:  # which bytes are experts is not known: the finer split for all
        return kept // (model * max(ways, experts)) + totals.grads // (
            model * max(grad_ways, expert_grad_ways)
        )
    share = min(1.0, totals.experts / totals.params) if totals.params else 0.0
    # the grads and the optimizer state are the trainable params' only: as many of their bytes as the experts'
    # are counted as experts' (the finer split; all of them where only the experts train), so that the bound
    # stays a lower bound
    trained = min(1.0, totals.experts / totals.grads) if totals.grads else share
    expert = int(totals.params * share) + int(optimizer * trained)
    dense = kept - expert
    expert_g = min(totals.grads, totals.experts)
    dense_g = totals.grads - expert_g
    return (
        dense // (model * ways)
        + expert // (model * experts)
        + dense_g // (model * grad_ways)
        + expert_g // (model * expert_grad_ways)
    )


def illegal(c: Candidate, script_strategy: str | None = None) -> str | None:
    """Why the planner cannot give `c` to the script (None: it can): its global batch must split evenly over
    the data-parallel ranks and their micro-batches; fsdp with an `ep` axis needs a data axis beside it to
    shard the experts over (efsdp), as `af.shard` refuses otherwise (a rule of the strategy, not of the mesh:
    the mesh's other candidates are not pruned with it), and the experts split over ep, cp and tp at once (3 mesh
    axes, more than FSDP2 shards); a ZeRO stage (DeepSpeed) takes no af.offload, nor
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
    if ep > 1 and c.mesh.get("cp", 1) > 1 and c.mesh.get("tp", 1) > 1 and strategy in ("fsdp", "hsdp"):
        # the experts split over ep x cp x tp: a 3-D DTensor, which FSDP2 does not shard (`lower_fsdp` refuses)
        return f"{named} with ep, cp and tp: FSDP2 shards experts split over at most 2 of them"
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
    per stage (1F1B and GPipe alike); no communication (`comm_bound` adds the all-to-alls).

    Example:
        >>> time_bound(Candidate({"pp": 4, "dp": 2}, pipeline_microbatches=8), 8.0, 8)
        1.375
    """
    pp, micro = c.mesh.get("pp", 1), c.pipeline_microbatches
    bubble = (pp - 1) / micro if pp > 1 and micro else 0.0
    return compute_s / world * (1 + bubble)


_SHARD = re.compile(r"\bshard\((\w+), ([^)]*)\)")
_REMAT = re.compile(r"\bremat\('(\w+)'(?:, every=(\d+))?\)")


def lowered_remat(description: str) -> str | None:
    """The remat knob's value (`none`, `selective`, `full`, `POLICY:N`) of the `af.remat` a dry run lowered, read
    from its step's description (a report's `strategy`); None without one, or for one of chosen blocks
    (`remat('full', blocks=...)`: counted as no remat, which only loosens a lower bound).

    Example:
        >>> lowered_remat("Step(train_step(loss) -> remat('full') -> shard(fsdp, dp=1)  [fsdp over 1 ranks])")
        'full'
        >>> lowered_remat("Step(... -> remat('selective', every=2))"), lowered_remat("Step(train_step(loss))")
        ('selective:2', None)
    """
    m = _REMAT.search(description or "")
    if m is None:
        return None
    return m[1] if m[2] in (None, "1") else f"{m[1]}:{m[2]}"


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


@attrs.frozen
class Exchanges:
    """The all-to-alls a measured `candidate` ran in a step, as the dry run times them (`all_to_all_time`):
    `latency_s` (each one's latency, summed) and `bytes_s` (their bytes over the link)."""

    candidate: Candidate
    latency_s: float
    bytes_s: float


def all_to_all_time(report: dict[str, Any], device: DeviceSpec, nproc_per_node: int) -> tuple[float, float]:
    """(latency, bytes) seconds of the all-to-alls of a dry run's `report` (`Report.to_dict()`: its `comm`, one
    row per process group, summed over the step; the link figures its prediction assumed), with the functions
    the dry run times each one with (`comm_time.collective_time`, `step_time._where`): an all-to-all's time is
    its latency plus a term linear in its bytes within a node (and, across nodes, the larger of two linear
    terms: at least that of the sum), so the row's sum is at least its count x the latency plus the time of its
    summed bytes less one latency. (0, 0) without all-to-alls (a dense model).

    Example:
        >>> from accelfn.platforms.specs import spec
        >>> row = {"count": 8, "bytes": 4 * 450_000_000, "group_size": 4, "intra_node": True}
        >>> lat, by = all_to_all_time({"mesh": {"dp": 2, "ep": 4}, "comm": {"all_to_all": {"ep": row}}},
        ...                           spec("h100-sxm"), 8)
        >>> round(lat * 1e6, 1), round(by * 1e3, 2)  # 8 x (8.4 + 3 x 3.4) us; ms: 3/4 of 1.8 GB at 0.8 x 450 GB/s
        (148.8, 3.75)
    """
    from ..dryrun.comm_time import collective_time, group_nodes, ranks_in_node

    assumes = (report.get("predicted") or {}).get("assumes") or {}
    comm = CommAssumptions(
        **{f.name: assumes[f.name] for f in attrs.fields(CommAssumptions) if f.name in assumes}
    )
    links = {k: assumes[k] for k in ("intra_node_gbs", "inter_node_gbs") if assumes.get(k)}
    device = attrs.evolve(device, **links)
    mesh = report.get("mesh") or {}
    latency = seconds = 0.0
    for axis, row in ((report.get("comm") or {}).get("all_to_all") or {}).items():
        axes, n, count = tuple(axis.split("x")), int(row["group_size"]), int(row["count"])
        known = all(a in mesh for a in axes)  # as `step_time._where`: a group of unknown axes by its size
        intra = row["intra_node"] if known else n <= nproc_per_node
        nodes = group_nodes(n, intra, nproc_per_node)
        local = ranks_in_node(axes, mesh, nproc_per_node) if known else None
        one = collective_time("all_to_all", 0, n, nodes, device, comm, local)
        latency += count * one
        seconds += collective_time("all_to_all", int(row["bytes"]), n, nodes, device, comm, local) - one
    return latency, seconds


def comm_bound(c: Candidate, measured: Sequence[Exchanges]) -> tuple[float, Candidate | None]:
    """A lower bound of the time `c`'s step waits for its all-to-alls (expert parallel's dispatch and combine,
    context parallel's), learned from the candidates of its mesh already dry-run (`measured`), and the one it
    came from (None: none applies, 0 s).

    Why it is one: the dry run puts every all-to-all on the critical path (`step_time.predict_step`: the
    compute stream waits for each one's whole time), so a step lasts at least its compute plus its all-to-alls'
    time. Those depend on the mesh (the ep group, its placement, the tokens per rank) and on what the step runs
    per micro-batch, not on where the states live: a candidate `m` of the same mesh and the same knobs but
    strategy, offload and remat runs the same all-to-alls, except that remat recomputes the forward's (more,
    never fewer: `m` counts only with `c`'s remat or none), a strategy may change the rows' dtype (at most
    `DTYPE_RATIO` times fewer bytes: `m`'s bytes count / 2 under another strategy), and accumulation splits each
    micro-batch's rows (each layer's all-to-alls run once per micro-batch: `m`'s latency counts x at most
    acc_c / acc_m, its bytes, which the modelled routing's imbalance changes with the micro-batch, not at all).
    No bound under a pipeline (its reported rank, the larger peak of its first and last stage, may hold fewer
    MoE layers than `m`'s).

    Example:
        >>> c = Candidate({"dp": 2, "ep": 4}, "ddp", "none", accumulate=2)
        >>> m = Exchanges(c, latency_s=0.2, bytes_s=1.0)
        >>> comm_bound(attrs.evolve(c, offload="optimizer"), [m])[0]  # the same all-to-alls
        1.2
        >>> comm_bound(attrs.evolve(c, remat="full"), [m])[0]  # and the forward's again
        1.2
        >>> comm_bound(attrs.evolve(c, strategy="fsdp"), [m])[0]  # its rows bf16, maybe
        0.7
        >>> comm_bound(attrs.evolve(c, accumulate=1), [m])[0]  # half the micro-batches
        0.1
        >>> comm_bound(attrs.evolve(c, mesh={"dp": 4, "ep": 2}), [m])  # another mesh
        (0.0, None)
    """
    if c.mesh.get("pp", 1) > 1:
        return 0.0, None
    fixed = {k: v for k, v in c.knobs().items() if k not in ("strategy", "offload", "remat", "accumulate")}
    best, source = 0.0, None
    for e in measured:
        m = e.candidate
        if m.mesh_spec != c.mesh_spec or m.mesh.get("pp", 1) > 1:
            continue
        if {
            k: v for k, v in m.knobs().items() if k not in ("strategy", "offload", "remat", "accumulate")
        } != fixed:
            continue
        if m.remat != c.remat and m.remat != "none":
            continue
        acc_m, acc_c = m.accumulate or 1, c.accumulate or 1
        if m.accumulate != c.accumulate:
            if m.accumulate is None or c.accumulate is None:
                continue  # the script's own accumulation: unknown
            seconds = e.latency_s * min(1.0, acc_c / acc_m)
        else:
            seconds = e.latency_s + e.bytes_s / (1 if m.strategy == c.strategy else DTYPE_RATIO)
        if seconds > best:
            best, source = seconds, m
    return best, source


def routed_bound(
    c: Candidate,
    moe: dict[str, int],
    tokens: int,
    device: DeviceSpec,
    nproc_per_node: int,
    script_remat: str | None = None,
) -> float:
    """A lower bound of the time `c`'s step waits for expert parallel's all-to-alls, from the model alone (the
    probe's `moe`: MoE `layers`, a routed row's `hidden` width and the `top_k` experts per token,
    `experts.moe_shape`; `tokens`: the global batch's tokens per step), before any candidate of its mesh runs.

    Why it is one: the dry run puts every all-to-all on the critical path (`step_time.predict_step`), and each
    MoE layer runs four per micro-batch on each rank of the ep group (ep and the tp and cp ranks it borrows,
    `expert_parallel.expert_axes`): the dispatch of its rows (its tokens x top_k, `moe.experts.ep_forward`),
    the combine of the rows it received, and their two reverses in the backward; full remat (`c.remat`
    "full", or `script_remat`, the one a script that fixes its remat lowered: `lowered_remat`) runs the forward's
    two again in the backward (other remat values are counted as none). A rank's tokens per micro-batch are the global batch's over the data axes, cp and the
    accumulation, of which each tp rank dispatches its share (the least: the floor); the rank the dry run
    reports (the busiest, under the modelled routing) receives at least the mean, which is at least that
    share. A row is at least 16-bit (hidden states or their autocast copy). Each all-to-all is timed as the
    dry run does (`comm_time.collective_time`, its group placed as the mesh places it, or by its size alone where
    that is less, as the dry run places a group whose axes it cannot name). 0 without an ep axis, under a
    pipeline (a rank holds a stage's MoE layers), where the model's shape is unknown, or where the script fixes
    its accumulation under tp.

    Example:
        >>> from accelfn.platforms.specs import spec
        >>> moe = {"layers": 48, "hidden": 2048, "top_k": 8}  # Qwen3-30B-A3B
        >>> c = Candidate({"dp": 4, "ep": 16}, "ddp", accumulate=4)
        >>> round(routed_bound(c, moe, 256 * 4096, spec("h100-sxm"), 8), 2)  # 2 nodes: half the rows cross
        1.34
    """
    from ..dryrun.comm_time import collective_time, group_nodes, ranks_in_node
    from ..dryrun.layout import _intra_node

    mesh, ep, tp = c.mesh, c.mesh.get("ep", 1), c.mesh.get("tp", 1)
    # the script's own accumulation (None): as 1 without tp (each all-to-all's time is its latency plus a term
    # linear in its bytes, so more micro-batches of fewer rows take at least as long); unknown with tp (each
    # micro-batch's tp share is a floor)
    acc = c.accumulate if c.accumulate is not None else 1 if tp == 1 else None
    layers, hidden, top_k = moe.get("layers", 0), moe.get("hidden", 0), moe.get("top_k", 0)
    if ep == 1 or mesh.get("pp", 1) > 1 or acc is None or not (layers and hidden and top_k and tokens):
        return 0.0
    axes = tuple(a for a in mesh if a == "ep" or (a in ("tp", "cp") and mesh[a] > 1))
    n = 1
    for a in axes:
        n *= mesh[a]
    per_rank = tokens // (data_size(mesh) * mesh.get("cp", 1)) // acc  # a micro-batch's tokens
    rows = per_rank // tp * top_k
    nbytes, comm = rows * hidden * 2, CommAssumptions()
    intra = _intra_node(axes, dict(mesh), nproc_per_node)
    nodes = group_nodes(n, intra, nproc_per_node)
    placed = collective_time(
        "all_to_all", nbytes, n, nodes, device, comm, ranks_in_node(axes, mesh, nproc_per_node)
    )
    # a group whose axes the dry run could not name is placed by its size alone (`step_time._where`)
    unnamed = collective_time(
        "all_to_all", nbytes, n, group_nodes(n, n <= nproc_per_node, nproc_per_node), device, comm
    )
    remat = c.remat if c.remat is not None else script_remat
    per_layer = 6 if remat == "full" else 4  # full remat dispatches and combines the forward's rows again
    return per_layer * layers * acc * min(placed, unnamed)
