"""The planner's estimate of a candidate's data-parallel traffic before it runs: what its strategy's gathers and
reductions of the states take per step, on the links its mesh puts them on.

The dry run measures every collective; before a candidate's dry run, the planner knows the states a rank holds
(`prune.States`, from the one-process probe) and how the strategy moves them, as the lowering does:

- fsdp: each micro-batch all-gathers a rank's params twice (forward, and again in the backward:
  `reshard_after_forward`; once per step under a pipeline, which keeps a stage's params gathered) and
  reduce-scatters its gradients (each micro-batch: `af.accumulate`'s `sync_each_microbatch`, fsdp's default);
  the dense params over the data axes and cp, the experts over the data axes but ep (efsdp);
- hsdp: the same over its shard axes (fsdp, ep, cp), and the replicas (dp) all-reduce their shard once a step;
- ddp: one all-reduce of the gradients a step (`no_sync` holds them over the micro-batches), the experts' among
  the ranks that hold the same ones;
- ZeRO (DeepSpeed, as its dry run lowers it): stage 1 all-reduces the gradients once a step, stage 2 each
  micro-batch (its backward hooks), each all-gathering the updated params once a step; stage 3 reduce-scatters
  as fsdp and gathers as DeepSpeed's parameter coordinator does once the first step has recorded its trace
  (the planner's dry run of a ZeRO-3 candidate measures its second step, `tiers._job`): the persistent params
  (at most 1e5 elements each) once a step, after the update; the others each micro-batch for the forward and
  again for the backward, but those kept from one to the other (used again within
  `stage3_max_reuse_distance`, 1e9 elements: all of a model under 5e8); under fp16 an af.Loss over several
  micro-batches also for each one's count forward (elsewhere DeepSpeed's update divides by the count:
  `_zero3_gathers`). The first step gathers each param for its forward and its backward (the dense tiny Llama
  of tests/test_plan_traffic.py, all of it persistent, at 2 micro-batches of an af.Loss: 3.85x its params in
  the first step, 1x in the second).

Each collective is timed as the dry run times it (`comm_time.collective_time`, its group placed as the mesh
places it); params are gathered as the step casts them (`gather_ratio`: the probe's bytes over 2 under
af.autocast, FSDP's bf16 copy of fp32 params; as held otherwise), grads reduced as the probe holds them (fp32
under af.autocast: FSDP's reduce_dtype; DDP and DeepSpeed reduce them as they are). Padding is not counted (FSDP
pads each param's first dim to the shard count: the tiny test models' 4 experts over 8 ranks move twice their
bytes), nor what ZeRO-3's fp16 count forward prefetches for a backward that does not follow (released
unused: 181M elements a count forward of an 866M-parameter Llama), nor the params it keeps gathered because it
prefetched their next use (at 1 micro-batch that Llama keeps 79% of its params from forward to backward, the
reuse distance 58%: 0.85x the estimate).
The step waits for a link's collectives at least as long as they take together (the dry run
serves each link's collectives one after another), so `step_floor` is the larger of the compute with tp's and
cp's collectives on the critical path (`critical`) and the busiest link's traffic. The planner orders its dry runs by it: a mesh that
splits the experts over few ranks gathers most of them every micro-batch (DeepSeek-V3 on 256: `dp=16,ep=2,tp=8`
moves ~2x the bytes of `dp=8,ep=32`), which its compute alone does not show. An estimate for the order, not a
bound the planner prunes by (a script's own sync choice or wrapping may move less).

Example:
    >>> from accelfn.planner.candidates import Candidate
    >>> from accelfn.planner.prune import States
    >>> from accelfn.platforms.specs import spec
    >>> totals = States(params=32 * 10**9, grads=32 * 10**9, optimizer=64 * 10**9)  # 8B in fp32
    >>> inside = states_traffic(Candidate({"dp": 8}, "fsdp"), totals, spec("h100-sxm"), 8)
    >>> across = states_traffic(Candidate({"dp": 64}, "fsdp"), totals, spec("h100-sxm"), 8)
    >>> round(across / inside, 1)  # the network's bandwidth against NVLink's
    10.1
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from ..dryrun.comm_time import CommAssumptions, collective_time, group_nodes
from ..dryrun.layout import _intra_node
from ..mesh import DATA_AXES, GRAD_AXES
from ..platforms.specs import DeviceSpec
from .candidates import ZERO, Candidate
from .prune import DTYPE_RATIO, States
from .zero3 import Zero3Shape

__all__ = ["Traffic", "states_traffic", "traffic_of", "step_floor"]


@attrs.define
class Traffic:
    """Collectives' seconds by link (intra- and inter-node), added up, and their bytes (full buffers) by kind
    and group (`moved`: `("all_gather", ("dp", "ep"))`, the axes in mesh order)."""

    intra: float = 0.0
    inter: float = 0.0
    moved: dict[tuple[str, tuple[str, ...]], float] = attrs.Factory(dict)

    def add(
        self,
        kind: str,
        nbytes: float,
        axes: tuple[str, ...],
        mesh: dict[str, int],
        device: DeviceSpec,
        nproc_per_node: int,
        times: int = 1,
    ) -> None:
        """`times` collectives of `kind` over the mesh's `axes` (those of size > 1), each of a full buffer of
        `nbytes`."""
        axes = tuple(a for a in mesh if a in axes and mesh[a] > 1)
        n = 1
        for a in axes:
            n *= mesh[a]
        if n <= 1 or nbytes <= 0 or times <= 0:
            return
        nodes = group_nodes(n, _intra_node(axes, mesh, nproc_per_node), nproc_per_node)
        seconds = times * collective_time(kind, int(nbytes), n, nodes, device, CommAssumptions())
        self.moved[kind, axes] = self.moved.get((kind, axes), 0.0) + times * nbytes
        if nodes <= 1:
            self.intra += seconds
        else:
            self.inter += seconds

    @property
    def busiest(self) -> float:
        """The busier link's seconds (the links serve their collectives side by side)."""
        return max(self.intra, self.inter)


def states_traffic(
    c: Candidate,
    totals: States,
    device: DeviceSpec,
    nproc_per_node: int,
    script_strategy: str | None = None,
    gather_ratio: float = DTYPE_RATIO,
    zero3: Zero3Shape | None = None,
) -> float:
    """Seconds the busiest link of a rank of `c` spends a step on its strategy's gathers and reductions of the
    states (module docstring, `traffic_of`); 0 for a strategy that is not known (`script_strategy` None, for a
    candidate that sets none) or a mesh without data-parallel ranks. `gather_ratio`: the probe's param bytes over
    those a gather moves (2 under af.autocast of fp32 params, `DTYPE_RATIO`; 1 where the step gathers them as held).
    `zero3`: what ZeRO-3 holds gathered of the model (`zero3.Zero3Shape.of_probe`; None: nothing).

    Example:
        >>> from accelfn.platforms.specs import spec
        >>> totals = States(params=4 * 10**9, grads=4 * 10**9, optimizer=8 * 10**9)
        >>> fsdp = states_traffic(Candidate({"dp": 8}, "fsdp", accumulate=2), totals, spec("h100-sxm"), 8)
        >>> ddp = states_traffic(Candidate({"dp": 8}, "ddp", accumulate=2), totals, spec("h100-sxm"), 8)
        >>> round(fsdp / ddp, 1)  # 2 x (2 gathers of bf16 params, a reduce-scatter of fp32 grads) : 1 all-reduce
        2.0
    """
    return traffic_of(c, totals, device, nproc_per_node, script_strategy, gather_ratio, zero3).busiest


def traffic_of(
    c: Candidate,
    totals: States,
    device: DeviceSpec,
    nproc_per_node: int,
    script_strategy: str | None = None,
    gather_ratio: float = DTYPE_RATIO,
    zero3: Zero3Shape | None = None,
    script_sync_each: bool = False,
) -> Traffic:
    """The `Traffic` of `states_traffic`: its seconds by link and its bytes by collective (`script_sync_each`:
    the script's pipeline reduce-scatters each micro-batch, where the candidate does not say)."""
    t = Traffic()
    strategy = c.strategy or script_strategy
    if strategy is None:
        return t
    mesh = dict(c.mesh)
    model = mesh.get("tp", 1) * mesh.get("pp", 1)
    micro = c.accumulate or 1
    pipeline = mesh.get("pp", 1) > 1
    # a rank's part of the model, whole (before the data-parallel split): params gathered as the step casts them,
    # grads reduced as the probe holds them (FSDP's reduce_dtype is fp32 under af.autocast, DDP reduces them as
    # they are); the experts' part split further over ep and the cp ranks it borrows
    experts = min(totals.experts / totals.params, 1.0) if mesh.get("ep", 1) > 1 and totals.params else 0.0
    ep = mesh.get("ep", 1) * mesh.get("cp", 1)
    dense_p = totals.params * (1 - experts) / (model * gather_ratio)
    expert_p = totals.params * experts / (model * gather_ratio * ep)
    dense_g = totals.grads * (1 - experts) / model
    expert_g = totals.grads * experts / (model * ep)
    grads = dense_g + expert_g

    def add(kind: str, nbytes: float, axes: tuple[str, ...], times: int = 1) -> None:
        t.add(kind, nbytes, axes, mesh, device, nproc_per_node, times)

    others = tuple(a for a in DATA_AXES if a != "ep")  # the experts' data-parallel ranks
    # FSDP2 (and ZeRO-3) per micro-batch: two gathers and a reduce-scatter; once a step under a pipeline, which
    # keeps a stage's params gathered, its gradients reduce-scattered each micro-batch where it is told to
    each = (
        c.pipeline_sync_each_microbatch if c.pipeline_sync_each_microbatch is not None else script_sync_each
    )
    stage_micro = micro * (c.pipeline_microbatches or mesh.get("pp", 1))
    gathers, reduces = (1, stage_micro if each else 1) if pipeline else (2 * micro, micro)
    if strategy in ("fsdp", "zero3", "hsdp"):
        hsdp = strategy == "hsdp"
        dense_axes, expert_axes = (("fsdp", "ep", "cp"), ("fsdp",)) if hsdp else (GRAD_AXES, others)
        for params, axes in ((dense_p, dense_axes), (expert_p, expert_axes)):
            if strategy == "zero3":
                _zero3_gathers(add, params, axes, zero3 or Zero3Shape(), micro)
            else:
                add("all_gather", params, axes, gathers)
        add("reduce_scatter", dense_g, dense_axes, reduces)
        add("reduce_scatter", expert_g, expert_axes, reduces)
        if hsdp:  # the replicas all-reduce their shards once a step
            shard = mesh.get("fsdp", 1) * mesh.get("ep", 1) * mesh.get("cp", 1)
            add("all_reduce", dense_g / shard + expert_g / mesh.get("fsdp", 1), ("dp", "dp_replicate"))
    elif strategy == "ddp":
        add("all_reduce", dense_g, GRAD_AXES)
        add("all_reduce", expert_g, others)
    elif strategy in ZERO:  # zero1 / zero2: all-reduced (stage 2: each micro-batch), the update all-gathered
        add("all_reduce", grads, GRAD_AXES, micro if strategy == "zero2" else 1)
        add("all_gather", dense_p + expert_p, GRAD_AXES)
    return t


def _zero3_gathers(
    add: Callable[..., None], params: float, axes: tuple[str, ...], shape: Zero3Shape, micro: int
) -> None:
    """ZeRO-3's all-gathers of `params` bytes in a step after the first (the first records DeepSpeed's trace;
    `shape` has what DeepSpeed holds gathered): the persistent params once, after the update; the others per
    micro-batch for the forward, and again for the backward but those kept from their forward to their backward
    (`reused`). Under fp16 an af.Loss over several micro-batches (`deepspeed.phases.counted_forwards`) gathers
    them for each micro-batch's count forward too (elsewhere DeepSpeed's update divides by the count: no count
    forwards); the release decisions those forwards cache are cleared after them, so the training forwards keep
    the reused params for their backward as without them."""
    persistent = params * shape.persistent
    others = params - persistent
    counted = shape.count_forwards and micro > 1
    again = max(others - params * shape.reused, 0.0)
    add("all_gather", others, axes, micro * (2 if counted else 1))
    add("all_gather", again, axes, micro)
    add("all_gather", persistent, axes, 1)


def step_floor(compute_s: float, states: Traffic, critical: Traffic | None = None) -> float:
    """What a step takes at least as the dry run replays it: the compute (and bubble) plus tp's and cp's
    collectives on the critical path (`critical`, `critical.critical_traffic`), or the busier link's traffic
    (the states' gathers and reductions, which overlap the compute, and the critical collectives on the same
    link), whichever is longer. (Not the routed all-to-alls, also on the critical path: the planner's order
    leaves them out, `tiers.plan`'s `promise`.)

    Example:
        >>> step_floor(2.0, Traffic(intra=3.0)), step_floor(2.0, Traffic(intra=1.5), Traffic(intra=0.5))
        (3.0, 2.5)
    """
    crit = critical if critical is not None else Traffic()
    return max(compute_s + crit.intra + crit.inter, states.intra + crit.intra, states.inter + crit.inter)
