"""A step's predicted time from what one rank ran (issue 30 item 2): `predict_step(timeline, ...)` replays the
kernels and collectives the dry run recorded, in their order, on one compute stream and one communication
stream per link (within a node, across nodes: collectives on one link share its bandwidth), each op timed by the per-op model (`timing.cost_time`) and each collective by NCCL's cost model
(`comm_time.collective_time`), with the overlap each strategy really has:

- data-parallel all-gathers in the forward/backward (FSDP's): prefetched one ahead: issued when the previous
  one was needed, so the first is exposed and each later one hides behind the compute of the block before it
  (bounded by it);
- data-parallel reduce-scatters and all-reduces in the forward/backward (FSDP's, DDP's buckets): issued when
  their gradients are ready, on their own stream; the step waits for the last one before the update (so the
  last is exposed);
- everything else (tensor/context-parallel collectives, the clip's and the loss's all-reduces, pipeline
  sends and receives): on the critical path;
- the pipeline's bubble: the idle time of a rank while the schedule fills and drains, from the schedule's own
  order of actions (1F1B, interleaved 1F1B: `makespan`) with this rank's forward and backward times per
  micro-batch and stage; other schedules: `(pp - 1) / (m v)` of the busy time (Narayanan et al. 2021);
- under `af.compile` the forward and backward (what torch.compile compiles: the ops `OpCost.graph` marks; compiled
  per block, as under FSDP and torchtitan, only the blocks' own ops, `OpCost.region`: the loss, the head and the
  embedding stay eager) have no launch floor, and each run of their memory-bound kernels between two matmuls,
  attention kernels or collectives is one fused kernel moving what it reads from outside and writes for later
  (`fused_runs`: a run ends after a whole-tensor reduction such as torchao's amax, and fuses past a matmul that
  does not need it; checked against the kernels inductor's CPU backend makes of a Llama decoder block, bf16
  and fp8, Triton on a GPU may fuse differently: benchmarks/fp8_fusion.py, docs/dry_run.md), at the bandwidth
  torch.compile's reduction kernels were measured to reach where the run reduces (`timing.fused_time`); the rest (the optimizer's update, the
  clip, FSDP2's copies into and out of its collectives, forward and backward, which run in its hooks around the
  compiled blocks) stays eager, one kernel per op, each at least the launch floor, as torch.compile leaves it;
- a step compiled as one graph traces the model's mask: `transformers` (5.17 to 5.23 at least) builds its causal
  mask whenever it is traced (`masking_utils.find_packed_sequence_indices` answers "packed" under torch.compile,
  which turns off the `is_causal` skip), so SDPA gets the explicit mask, computes every block and skips none:
  an attention call the dry run saw with a causal mask (`OpCost.mask`) runs as a full, non-causal one
  (`traced_mask`). Compiled per block, the mask is made outside the blocks, eagerly, and skipped. (What SDPA
  receives is recorded by `benchmarks/sdpa_calls.py`; the GPU time of the masked kernel is not yet measured
  apart: docs/dry_run.md, "Predicted time against published runs", item 9.)

Example:
    >>> from accelfn.platforms.specs import spec
    >>> from accelfn.dryrun.timing import OpCost
    >>> from accelfn.dryrun.tracker import Collective
    >>> mm = OpCost("matmul", 8192, 8192, 8192)
    >>> ag = Collective("all_gather", "g", 8, 2**28, phase="forward_backward")
    >>> t = predict_step([ag, mm, ag, mm], spec("h100-sxm"), groups={"g": ("fsdp",)})
    >>> t.exposed_comm_s < t.comm_s, t.step_s > t.compute_s  # the second all-gather hides behind a matmul
    (True, True)
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ..mesh import GRAD_AXES
from ..platforms.specs import DeviceSpec
from .comm_time import CommAssumptions, collective_time, group_nodes, ranks_in_node
from .layout import _intra_node
from .timing import OpCost, TimingAssumptions, cost_time, fused_time
from .tracker import Collective

__all__ = [
    "StepTime",
    "Pipeline",
    "predict_step",
    "pipeline_of",
    "compile_regions",
    "traced_mask",
    "fused_runs",
    "run_bytes",
    "FusedRun",
]


def traced_mask(cost: OpCost) -> OpCost:
    """The attention kernel a step compiled as one graph runs for `cost`: with the causal mask `transformers`
    builds while torch.compile traces it (`cost.mask`), a full non-causal attention over every block (twice the
    computed half's FLOPs); any other cost as it is.

    Example:
        >>> from accelfn.dryrun.timing import OpCost
        >>> full = traced_mask(OpCost("attention", flops=10**12, seq=2048, causal=True, mask=True))
        >>> full.flops, full.causal
        (2000000000000, False)
        >>> traced_mask(OpCost("attention", flops=10**12, seq=2048, causal=True)).flops  # is_causal: kept
        1000000000000
    """
    if cost.kind == "attention" and cost.mask and cost.causal:
        return attrs.evolve(cost, flops=2 * cost.flops, causal=False)
    return cost


@attrs.frozen
class Pipeline:
    """A pipeline's shape for the bubble: `stages` ranks, `microbatches` per step, `stages_per_rank` (v)."""

    stages: int
    microbatches: int
    stages_per_rank: int = 1
    schedule: str = "1f1b"


@attrs.frozen
class StepTime:
    """A predicted step: `step_s` = compute + exposed communication + bubble. `compute_s` is the compute
    stream's kernel time (by kind in `by_kind`), `comm_s` all collectives' time, `exposed_comm_s` what of it the
    compute stream waited for, `bubble_s` the pipeline's idle time, `kernels` launched and `launch_bound` those
    the eager launch floor set; `assumes` every figure used."""

    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    bubble_s: float
    by_kind: dict[str, float]
    kernels: int
    launch_bound: int
    assumes: dict[str, Any]


def _unit(k: int, backward: bool, r: int, pp: int, v: int) -> tuple[int, int]:
    """(stage, micro-batch) of rank r's k-th forward (or backward): micro-batches in groups of pp, each group
    through the rank's stages in turn (backwards in reverse), as Megatron-LM's interleaved schedule."""
    chunk = (k // pp) % v
    if backward:
        chunk = v - 1 - chunk
    return chunk * pp + r, (k // (pp * v)) * pp + k % pp


def _orders(pp: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """Each rank's actions in order, (F or B, stage, micro-batch), as Megatron-LM's and torch's 1F1B (v = 1)
    and interleaved 1F1B (v > 1, stages placed round-robin: rank r holds stages r, r + pp, ...) order them."""
    out = []
    total = m * v
    for r in range(pp):
        if v == 1:
            warm = min(pp - 1 - r, m)
        else:
            warm = min((pp - r - 1) * 2 + (v - 1) * pp, total)
        acts: list[tuple[str, int, int]] = []
        f = b = 0
        for _ in range(warm):
            acts.append(("F", *_unit(f, False, r, pp, v)))
            f += 1
        while f < total:
            acts.append(("F", *_unit(f, False, r, pp, v)))
            f += 1
            acts.append(("B", *_unit(b, True, r, pp, v)))
            b += 1
        while b < total:
            acts.append(("B", *_unit(b, True, r, pp, v)))
            b += 1
        out.append(acts)
    return out


def makespan(pp: int, m: int, v: int, tf: float, tb: float, p2p: float = 0.0) -> float:
    """The time a pipeline of `pp` ranks takes to run `m` micro-batches through `pp v` stages, each forward
    `tf` and backward `tb` long and each hand-over `p2p`: every rank runs its actions (`_orders`) in order,
    each when its input is there (the stage before's forward, the stage after's backward).

    Example:
        >>> makespan(8, 32, 1, 1.0, 2.0) / (32 * 3.0) - 1  # Narayanan et al.: (pp - 1) / (m v)
        0.21875
        >>> makespan(8, 32, 2, 0.5, 1.0) / (32 * 3.0) - 1
        0.109375
    """
    orders = _orders(pp, m, v)
    n_stages = pp * v
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * pp
    idx = [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            while idx[r] < len(orders[r]):
                kind, s, mb = orders[r][idx[r]]
                if kind == "F":
                    dep = [("F", s - 1, mb)] if s > 0 else []
                else:
                    dep = [("B", s + 1, mb)] if s < n_stages - 1 else [("F", s, mb)]
                if any(d not in done for d in dep):
                    break
                start = max([free[r]] + [done[d] + p2p for d in dep])
                free[r] = start + (tf if kind == "F" else tb)
                done[(kind, s, mb)] = free[r]
                idx[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked")
    return max(free)


def pipeline_of(strategy: str) -> Pipeline | None:
    """The `Pipeline` a step's description names (`af.pipeline`'s `describe()`), or None.

    Example:
        >>> pipeline_of("pipeline(interleaved_1f1b, pp=8, stages [0, 8] of 16, 32 micro-batches) over ...")
        Pipeline(stages=8, microbatches=32, stages_per_rank=2, schedule='interleaved_1f1b')
    """
    m = re.search(r"pipeline\((\w+), pp=(\d+), stages \[[^\]]*\] of (\d+), (\d+) micro-batches", strategy)
    if m is not None:
        pp, n_stages, micro = int(m[2]), int(m[3]), int(m[4])
        return Pipeline(pp, micro, max(1, n_stages // pp), m[1])
    m = re.search(r"pipeline\((\w+), pp=(\d+), microbatches=(\d+)[,)]", strategy)
    if m is not None:
        from ..transforms.pipeline import SCHEDULES

        info = SCHEDULES.get(m[1])
        return Pipeline(int(m[2]), int(m[3]), info.stages_per_rank if info is not None else 1, m[1])
    return None


@attrs.frozen
class FusedRun:
    """One kernel a compiled step runs for a run of memory-bound ops (`ops`) that fuse: `nbytes` what it moves
    (`run_bytes`), `reduce` the rows' length of its reduction that reaches the least bandwidth (0: none)."""

    ops: tuple[OpCost, ...]
    nbytes: int


def run_bytes(ops: Sequence[OpCost], reads: Mapping[int, int]) -> int:
    """What one fused kernel of `ops` moves, as inductor's fused kernels do: each tensor it reads that the run
    did not write (once per view), and each tensor it writes that no later op of the run reads or that other ops
    read too (`reads`: how many ops of the step read each storage). Ops whose tensors were not followed
    (`OpCost.reads` and `writes` empty: a tensor without storage to name) are charged what the largest of them
    moves, on top of the rest. `reads` counts collectives' and eager ops' reads too (a gradient written in the
    run and read by its reduce-scatter is kept).

    Example:
        >>> x, y, z = (1, 0, 100), (2, 0, 200), (3, 0, 100)  # (storage, view, bytes)
        >>> up = OpCost("memory", nbytes=300, reads=(x,), writes=(y,))  # bf16 -> fp32
        >>> down = OpCost("memory", nbytes=300, reads=(y,), writes=(z,))  # fp32 -> bf16
        >>> run_bytes([up, down], {1: 1, 2: 1}), run_bytes([up, down], {1: 1, 2: 2})  # y: in registers or kept
        (200, 400)
    """
    largest = 0
    read: dict[tuple[int, int], int] = {}
    written: dict[tuple[int, int], int] = {}
    inside: dict[int, int] = {}  # storage written in the run -> how many of the run's ops read it
    for op in ops:
        if op.handed_on:  # AccumulateGrad's copy of a compiled backward's gradient: nothing of its own
            continue
        if not op.reads and not op.writes:
            largest = max(largest, op.nbytes)
            continue
        for storage, view, n in op.reads:
            if storage in inside:
                inside[storage] += 1
            else:
                read.setdefault((storage, view), n)
        for storage, view, n in op.writes:
            inside.setdefault(storage, 0)
            written[(storage, view)] = n
    if not written and not read:
        return largest
    kept = (n for (s, _), n in written.items() if not inside[s] or reads.get(s, 0) > inside[s])
    return sum(read.values()) + sum(kept) + largest  # (ops not followed beside followed ones: their largest)


def fused_runs(timeline: Sequence[Any], *, per_block: bool = False) -> list[Any]:
    """The kernels a compiled step runs for `timeline`, as `predict_step` prices them: each run of memory-bound
    ops that fuse, one `FusedRun`, and each other op or collective as it is; `per_block` as `predict_step`'s
    `compiled="blocks"` (only a compiled block's ops fuse). As inductor's scheduler does, ops between two
    matmuls or attention kernels fuse with those of the run before them where they read nothing the kernels in
    between wrote (a SwiGLU's backward beside the products before it), and a run none of whose outputs those
    kernels read waits to fuse with the run after them (SwiGLU's `silu` between the gate and up projections).
    A run ends at a collective, an eager op, between the forward and the backward, and after a reduction of a whole tensor to one value (`OpCost.whole`, torchao's
    tensorwise amax): what reads its value waits for every block of it, so inductor starts a new kernel
    (benchmarks/fp8_fusion.py measures both against inductor's CPU kernels; Triton on a GPU may fuse differently).

    Example:
        >>> mm, add = OpCost("matmul", 64, 64, 64), OpCost("memory", nbytes=100)
        >>> amax = OpCost("memory", nbytes=100, whole=True)
        >>> [type(r).__name__ for r in fused_runs([add, add, mm, add, amax, add])]  # (tensors not followed)
        ['FusedRun', 'OpCost', 'FusedRun', 'FusedRun']
    """
    reads: dict[int, int] = {}  # storage -> how many ops read it
    for ev in timeline:
        for storage, _, _ in getattr(ev, "reads", ()):
            reads[storage] = reads.get(storage, 0) + 1
    out: list[Any] = []
    run: list[OpCost] = []
    made: set[int] = set()  # the storages the run writes
    used: set[int] = set()  # the storages the run reads
    between: list[Any] = []  # the kernels since the run's last op
    wrote: set[int] = set()  # the storages they write
    read: set[int] = set()  # the storages they read
    needed = False  # whether the run must go before them: they read what it writes, or overwrite what it uses
    opaque = False  # whether one of them has tensors not followed: what comes after may need it

    def close() -> None:
        nonlocal needed, opaque
        if run:
            fused = FusedRun(tuple(run), run_bytes(run, reads))
            out.extend([fused, *between] if needed else [*between, fused])
        else:
            out.extend(between)
        run.clear()
        made.clear()
        used.clear()
        between.clear()
        wrote.clear()
        read.clear()
        needed = opaque = False

    for ev in timeline:
        inside = isinstance(ev, OpCost) and ev.graph and (ev.region or not per_block)
        if run and isinstance(ev, OpCost) and ev.backward != run[0].backward:
            close()  # the forward's graph and the backward's are compiled apart
        if inside and ev.kind == "memory":
            reads_, writes_ = _storages(ev.reads), _storages(ev.writes)
            unknown = not reads_ and not writes_  # (tensors not followed: taken to need them)
            # it must run after a kernel in between: it reads what they write, or overwrites what they touch
            if between and (unknown or opaque or reads_ & wrote or writes_ & (wrote | read)):
                if needed:  # which must run after the run: the run goes before them, the op starts a new one
                    close()
                else:  # the run goes after them and takes the op
                    out.extend(between)
                    between.clear()
                    wrote.clear()
                    read.clear()
                    opaque = False
            run.append(ev)  # (or it does not touch what they do: it goes where the run goes)
            made |= writes_
            used |= reads_
            if ev.whole:
                close()
            continue
        if not inside:  # a collective or an eager op: everything before it runs before it
            close()
            out.append(ev)
            continue
        if not run:
            out.append(ev)
            continue
        between.append(ev)
        reads_, writes_ = _storages(ev.reads), _storages(ev.writes)
        # it reads what the run writes, or overwrites what the run touches
        needed = needed or not reads_ or bool(reads_ & made or writes_ & (made | used))
        wrote |= writes_
        read |= reads_
        opaque = opaque or (not reads_ and not writes_)
    close()
    return out


def _storages(tensors: Sequence[tuple[int, int, int]]) -> set[int]:
    """The storages of `OpCost.reads` / `writes` entries."""
    return {storage for storage, _, _ in tensors}


def compile_regions(strategy: str) -> str | None:
    """What a step's description (`repr(step)`'s chain) compiles: None (nothing), `"blocks"` (each block on its
    own: `regions='blocks'`, and always under FSDP, HSDP, ZeRO-3 and a pipeline, as `af.compile` lowers them and
    torchtitan compiles) or `"step"` (the forward, the loss and the backward in one graph).

    Example:
        >>> compile_regions("train_step(f) -> shard(fsdp, dp=8) -> compile()")
        'blocks'
        >>> compile_regions("train_step(f) -> shard(ddp, dp=1) -> compile()"), compile_regions("train_step(f)")
        ('step', None)
    """
    if "compile(" not in strategy:
        return None
    blocks = "regions='blocks'" in strategy or "pipeline(" in strategy
    return "blocks" if blocks or re.search(r"shard\((fsdp|hsdp|zero3)\b", strategy) else "step"


def _where(
    c: Collective, groups: Mapping[str, tuple[str, ...]], shape: Mapping[str, int], nproc_per_node: int
) -> tuple[tuple[str, ...], int, int | None]:
    """The group's axes, the nodes it spans and how many of its ranks share each one's node (None: unknown)."""
    axes = groups.get(c.group, ())
    intra = _intra_node(axes, dict(shape), nproc_per_node) if axes else c.size <= nproc_per_node
    local = ranks_in_node(axes, shape, nproc_per_node) if axes and all(x in shape for x in axes) else None
    return axes, group_nodes(c.size, intra, nproc_per_node), local


def predict_step(
    timeline: Sequence[Any],
    device: DeviceSpec,
    *,
    groups: Mapping[str, tuple[str, ...]] | None = None,
    shape: Mapping[str, int] | None = None,
    nproc_per_node: int = 8,
    compiled: bool | str | None = False,
    pipeline: Pipeline | None = None,
    timing: TimingAssumptions | None = None,
    comm: CommAssumptions | None = None,
) -> StepTime:
    """The predicted time of one step from its `timeline` (the dry run's `Measured.timeline`: `OpCost`s and
    `Collective`s in the order they ran) on `device`; `groups` maps process group names to the mesh axes they
    span (`shape` the mesh, row-major, `nproc_per_node` ranks per node); `compiled` the step runs under
    `af.compile`: `"blocks"` (or `compile_regions`' answer) when each block is compiled on its own, so that only
    the ops the blocks run fuse, `"step"` or True when the forward, loss and backward are one graph. See the
    module docs for the model."""
    per_block = compiled == "blocks"
    compiled = bool(compiled)
    groups = groups or {}
    shape = shape or {}
    ta = attrs.evolve(timing or TimingAssumptions(), eager=not compiled)
    ca = comm or CommAssumptions()
    floor = ta.launch_s if ta.eager else 0.0
    by_kind = {"matmul": 0.0, "attention": 0.0, "memory": 0.0}
    kernels = launch_bound = 0
    now = 0.0  # the compute stream's clock
    waited = 0.0  # time the compute stream spent waiting for communication
    # when each link (within a node, across nodes) is free: collectives on one link share its bandwidth, so
    # they run one after another
    link_free = {True: 0.0, False: 0.0}
    prev_need = 0.0  # when the previous prefetched all-gather was needed
    pending = 0.0  # when the last asynchronous reduction ends
    comm_s = 0.0

    forward_s = backward_s = 0.0

    def compute(seconds: float, kind: str, backward: bool = False, floor: float = floor) -> None:
        nonlocal now, kernels, launch_bound, forward_s, backward_s
        if seconds < floor:
            launch_bound += 1
        seconds = max(seconds, floor)
        if backward:
            backward_s += seconds
        else:
            forward_s += seconds
        by_kind[kind] += seconds
        now += seconds
        kernels += 1

    def slowest(run: FusedRun) -> int:  # the rows' length of the run's reduction reaching the least bandwidth
        reduce = 0
        for op in run.ops:
            if op.reduce and (
                not reduce or fused_time(1, op.reduce, device, ta) > fused_time(1, reduce, device, ta)
            ):
                reduce = op.reduce
        return reduce

    # asynchronous reductions not yet on their link: (issued at, seconds, link); each link serves in the order
    # of issue, so a prefetched all-gather issued earlier goes before them
    queued: list[tuple[float, float, bool]] = []

    def place(before: float) -> None:
        nonlocal pending
        while queued and queued[0][0] <= before:
            issued, seconds, link = queued.pop(0)
            link_free[link] = max(link_free[link], issued) + seconds
            pending = max(pending, link_free[link])

    def wait(until: float) -> None:
        nonlocal now, waited
        if until > now:
            waited += until - now
            now = until

    in_fb = False
    for ev in fused_runs(timeline, per_block=per_block) if compiled else timeline:
        if isinstance(ev, FusedRun):
            if ev.nbytes:  # (a run is of the forward or of the backward, never both: `fused_runs`)
                compute(
                    fused_time(ev.nbytes, slowest(ev), device, ta), "memory", ev.ops[0].backward, floor=0.0
                )
            continue
        if isinstance(ev, OpCost):
            inside = compiled and ev.graph and (ev.region or not per_block)
            if inside and not per_block:
                ev = traced_mask(ev)
            eager = not inside
            compute(cost_time(ev, device, ta), ev.kind, ev.backward, ta.launch_s if eager else 0.0)
            continue
        if not isinstance(ev, Collective):
            continue
        if in_fb and ev.phase != "forward_backward":
            place(float("inf"))
            wait(pending)  # the update needs every gradient
        in_fb = ev.phase == "forward_backward"
        axes, nodes, local = _where(ev, groups, shape, nproc_per_node)
        seconds = collective_time(ev.kind, ev.nbytes, ev.size, nodes, device, ca, local)
        comm_s += seconds
        data = bool(axes) and set(axes) <= set(GRAD_AXES) and in_fb
        link = nodes <= 1
        if data and ev.kind == "all_gather":  # issued when the one before it was needed
            place(prev_need)
            link_free[link] = max(link_free[link], prev_need) + seconds
            prev_need = now
            wait(link_free[link])
        elif data and ev.kind in ("reduce_scatter", "all_reduce"):
            queued.append((now, seconds, link))
        else:
            place(now)
            link_free[link] = max(link_free[link], now) + seconds
            wait(link_free[link])
    place(float("inf"))
    wait(pending)
    compute_s = sum(by_kind.values())
    bubble = 0.0
    if pipeline is not None and pipeline.stages > 1:
        pp, m, v = pipeline.stages, pipeline.microbatches, pipeline.stages_per_rank
        if pipeline.schedule in ("1f1b", "interleaved_1f1b") and forward_s + backward_s > 0:
            tf, tb = forward_s / (m * v), backward_s / (m * v)  # one action of this rank
            idle = makespan(pp, m, v, tf, tb) / (m * v * (tf + tb)) - 1
        else:  # other schedules: Narayanan et al.'s closed form
            idle = (pp - 1) / (m * v)
        bubble = now * idle
    assumes: dict[str, Any] = {
        **{k: v for k, v in attrs.asdict(ta).items() if k != "gemm_efficiency"},
        "gemm_efficiency": ta.gemm(device),
        "attention_backend": ta.backend(device),
        "sm_count": ta.sms(device),
        "memory_gbs": device.memory_gbs,
        **attrs.asdict(ca),
        "intra_node_gbs": device.intra_node_gbs,
        "inter_node_gbs": device.inter_node_gbs,
        "compiled": ("blocks" if per_block else "step") if compiled else False,
        "fusion": "compiled: in the forward and backward"
        + (" of each compiled block" if per_block else "")
        + ", each run of memory-bound kernels between matmuls/attention/collectives is one kernel moving what it "
        "reads from outside and writes for later, ended after a whole-tensor reduction; the update"
        + (", the loss and FSDP's hooks eager" if per_block else " eager")
        if compiled
        else "eager: one kernel per op",
        "traced_mask": "compiled as one graph: transformers' causal mask kept, attention over every block"
        if compiled and not per_block
        else None,
        "overlap": "data-parallel all-gathers prefetched one ahead, reductions async until the update; "
        "other collectives on the critical path",
        "pipeline": attrs.asdict(pipeline) if pipeline is not None else None,
    }
    return StepTime(
        step_s=now + bubble,
        compute_s=compute_s,
        comm_s=comm_s,
        exposed_comm_s=waited,
        bubble_s=bubble,
        by_kind=by_kind,
        kernels=kernels,
        launch_bound=launch_bound,
        assumes=assumes,
    )
