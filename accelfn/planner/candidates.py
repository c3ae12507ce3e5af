"""The planner's candidates: every configuration of the knobs a script leaves open, for one world.

A `Candidate` is a mesh (pp, dp replicate/shard, ep, cp, tp; tp and cp inside a node, ep inside it or across
whole nodes) with the knobs of `accelfn.launch_env.knob` (strategy, remat, accumulate, pipeline schedule and
micro-batches, offload); `None`
leaves a knob to the script. `enumerate_candidates` lists them for a `Space`. An `ep` axis (expert parallel,
a data axis whose ranks also split the experts, with the tp and cp ranks it borrows) is enumerated only for a
model with experts (`Space.experts`, counted by the planner's probe).

Example:
    >>> space = Space(world=8, nproc_per_node=8, open=frozenset({"mesh", "strategy"}), axes=("dp", "tp"))
    >>> [c.label for c in enumerate_candidates(space)][:3]
    ['dp=8 ddp', 'dp=8 fsdp', 'dp=4,fsdp=2 hsdp']
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator, Sequence

import attrs

from ..launch_env import format_mesh

__all__ = [
    "Candidate",
    "Space",
    "enumerate_candidates",
    "ep_sizes",
    "divisors",
    "data_size",
    "ZERO",
    "REMATS",
    "parse_remats",
]

SCHEDULES = ("1f1b", "gpipe")
# DeepSpeed's ZeRO stages, values of the strategy knob (af.shard(strategy="zero2") = backend="deepspeed", stage 2)
ZERO = ("zero1", "zero2", "zero3")
MAX_ACCUMULATE = 16
# the remat values searched: each policy on every block, and selective on every 2nd block (blocks 2, 4, ...), between
# none and selective in memory and in recomputation. Not searched, to keep a mesh's candidates at 4/3 of the three
# policies' rather than 5/3 or more: full:2 (torchtitan's layer-selective AC, `selective_ac_option="2"`) and every
# 3rd block or more; at Llama 3 8B's shapes the dry run's time model puts full:2 at selective's step time with 22%
# more memory, and full:4 at selective:2's with 8% more (docs/plan.md, "Per-block remat"). The knob takes them all,
# and `af.plan(remats=...)` / `accelfn plan --remats` searches those the user names (`parse_remats`).
REMATS = ("none", "selective:2", "selective", "full")


def parse_remats(values: Sequence[object], *, source: str) -> tuple[str, ...]:
    """The remat values to search, each checked and made canonical by the knob's own parser
    (`launch_env.parse_remat`: ``FULL:1`` is ``full``), duplicates removed, the order kept; a ValueError naming
    `source` and the bad value (or an empty list).

    Example:
        >>> parse_remats(["none", "FULL:1", "full:3", "full", "selective:4"], source="--remats")
        ('none', 'full', 'full:3', 'selective:4')
        >>> parse_remats(["none", "full:0"], source="--remats")
        Traceback (most recent call last):
        ...
        ValueError: --remats='full:0': the block interval '0' must be an integer >= 1 (e.g. full:2 checkpoints blocks 2, 4, 6, ...)
    """
    from ..launch_env import parse_remat

    if isinstance(values, str):
        raise ValueError(
            f"{source} must be a list of remat values, e.g. ['none', 'full:2'], not the text {values!r}"
        )
    out = tuple(dict.fromkeys(parse_remat(str(v), source=source, raw=v) for v in values))
    if not out:
        raise ValueError(
            f"{source} is empty: name at least one remat value (searched by default: {', '.join(REMATS)})"
        )
    return out


def deepspeed_installed() -> bool:
    """Whether DeepSpeed can be imported here (a ZeRO plan launches only where it is)."""
    return importlib.util.find_spec("deepspeed") is not None


def default_strategies() -> tuple[str, ...]:
    """The strategies searched: ddp, fsdp, hsdp, and ZeRO 1-3 where DeepSpeed is installed (the written plan
    must launch where it was made)."""
    return ("ddp", "fsdp", "hsdp", *(ZERO if deepspeed_installed() else ()))


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending.

    Example:
        >>> divisors(12)
        [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, n + 1) if n % d == 0]


def data_size(mesh: dict[str, int]) -> int:
    """How many shards the global batch is split into (the data axes' product, as `af.Mesh.data_size`)."""
    from ..mesh import DATA_AXES

    return math.prod(v for k, v in mesh.items() if k in DATA_AXES)


@attrs.frozen
class Candidate:
    """One configuration: the mesh and the knobs set (None: the script's own choice)."""

    mesh: dict[str, int] = attrs.field(hash=False)
    strategy: str | None = None
    remat: str | None = None
    accumulate: int | None = None
    global_batch_size: int | None = None
    pipeline_schedule: str | None = None
    pipeline_microbatches: int | None = None
    offload: str | None = None
    compile: str | None = None
    pipeline_sync_each_microbatch: bool | None = None  # not searched: kept where a candidate sets it

    @property
    def mesh_spec(self) -> str:
        """The mesh as `accelfn launch --mesh` takes it."""
        return format_mesh(self.mesh)

    def knobs(self) -> dict[str, str | int]:
        """The knobs this candidate sets (the config's `plan:` section)."""
        names = ("strategy", "remat", "accumulate", "global_batch_size", "pipeline_schedule")
        more = ("pipeline_microbatches", "offload", "compile", "pipeline_sync_each_microbatch")
        out = {k: getattr(self, k) for k in (*names, *more)}
        return {k: v for k, v in out.items() if v is not None}

    @property
    def label(self) -> str:
        """A short name: the mesh then the knobs, e.g. `dp=4,tp=2 fsdp remat=full acc=2`."""
        short = {"accumulate": "acc", "pipeline_schedule": "pp", "pipeline_microbatches": "mb"}
        parts = [self.mesh_spec]
        for k, v in self.knobs().items():
            if k == "global_batch_size":
                continue
            parts.append(str(v) if k == "strategy" else f"{short.get(k, k)}={v}")
        return " ".join(parts)

    @property
    def key(self) -> tuple[object, ...]:
        """What identifies the candidate (dicts are not hashable)."""
        return (self.mesh_spec, *self.knobs().items())


@attrs.frozen
class Space:
    """What to enumerate: the world, which knobs are open ("mesh" among them), the global batch, the mesh
    axes the script supports (`axes`: of dp, tp, pp, cp, ep; pp only where the script reads the pipeline
    knobs), the experts of each MoE layer of its model (`experts`: 0 for a dense model, which gets no ep), and
    the strategy the script fixes where it does (`fixed_strategy`, `prune.lowered_strategy`: hsdp's meshes split
    the data ranks into dp x fsdp)."""

    world: int
    nproc_per_node: int
    open: frozenset[str]
    axes: tuple[str, ...] = ("dp", "tp", "pp", "cp", "ep")
    global_batch_size: int | None = None
    strategies: tuple[str, ...] = attrs.field(factory=default_strategies)
    remats: tuple[str, ...] = REMATS
    offloads: tuple[str, ...] = ("none", "optimizer")
    compiles: tuple[str, ...] = ("none", "blocks")  # af.compile per block, as torchtitan compiles
    schedules: tuple[str, ...] = SCHEDULES
    max_accumulate: int = MAX_ACCUMULATE
    experts: int = 0
    fixed_strategy: str | None = None


def ep_sizes(data: int, inner: int, node: int, experts: int) -> list[int]:
    """The `ep` sizes searched for a mesh with `data` data-parallel ranks and tp x cp = `inner` (`node` processes
    per node, `experts` per MoE layer): every one inside a node (ep x tp x cp divides the node), and across nodes
    where tp x cp fill the node or the experts outnumber it: those whose expert group (ep x tp x cp, the ranks that
    split the experts) spans whole nodes and divides the experts, so that each rank holds a whole share of them.

    Example:
        >>> ep_sizes(data=8, inner=1, node=8, experts=4)  # inside a node only
        [1, 2, 4, 8]
        >>> ep_sizes(data=8, inner=8, node=8, experts=64)  # tp x cp fill the node: ep spans 2, 4 or 8 nodes
        [1, 2, 4, 8]
        >>> ep_sizes(data=32, inner=1, node=8, experts=64)  # 64 experts outnumber the node's 8
        [1, 2, 4, 8, 16, 32]
    """
    inside = divisors(math.gcd(data, node // inner)) if node % inner == 0 else [1]
    if inner < node and experts <= node:
        return inside
    across = [ep for ep in divisors(data) if (ep * inner) % node == 0 and experts % (ep * inner) == 0]
    return sorted({*inside, *across})


def _meshes(space: Space) -> Iterator[dict[str, int]]:
    """pp, dp, ep, cp, tp with tp and cp inside a node (their product divides the node's processes), and ep
    inside it too or across whole nodes (`ep_sizes`); ep only for a model with experts, its ranks taken from the
    data-parallel ones (dp x ep is the data size)."""
    if "mesh" not in space.open:
        yield {}
        return
    node, world = space.nproc_per_node, space.world
    expert = "ep" in space.axes and space.experts > 1
    for tp in divisors(math.gcd(node, world)) if "tp" in space.axes else [1]:
        for cp in divisors(node // tp) if "cp" in space.axes else [1]:
            if world % (tp * cp):
                continue
            for pp in divisors(world // (tp * cp)) if "pp" in space.axes else [1]:
                data = world // (tp * cp * pp)
                for ep in ep_sizes(data, tp * cp, node, space.experts) if expert else [1]:
                    mesh = {"pp": pp, "dp": data // ep, "ep": ep, "cp": cp, "tp": tp}
                    yield {k: v for k, v in mesh.items() if v > 1 or k == "dp"}


def _strategies(space: Space, mesh: dict[str, int]) -> Iterator[tuple[dict[str, int], str | None]]:
    """(mesh, strategy): ddp and fsdp over dp; hsdp as dp (replicas) x fsdp (shards inside a node); ZeRO 1-3
    on a mesh of dp alone (DeepSpeed runs data-parallel over all the processes: af.shard refuses it with tp, cp,
    pp or ep)."""
    if "strategy" not in space.open:  # the script's own: hsdp's on dp x fsdp, each split (1 and dp too)
        if space.fixed_strategy == "hsdp" and mesh:
            yield from ((m, None) for m in _hsdp(space, mesh, ends=True))
        else:
            yield mesh, None
        return
    for s in space.strategies:
        if s != "hsdp":
            if s not in ZERO or set(mesh) <= {"dp"}:
                yield mesh, s
            continue
        yield from ((m, "hsdp") for m in _hsdp(space, mesh, ends=False))


def _hsdp(space: Space, mesh: dict[str, int], ends: bool) -> Iterator[dict[str, int]]:
    """`mesh` with its dp ranks split into dp (replicas) x fsdp (shards inside a node); `ends`: with fsdp 1 and
    dp too (hsdp as ddp and as fsdp: where the script fixes hsdp, the plan's only way to those)."""
    inner = space.nproc_per_node // (mesh.get("tp", 1) * mesh.get("cp", 1) * mesh.get("ep", 1))
    if inner < 1:  # ep spans nodes: no fsdp axis inside a node beside it
        return
    dp = mesh.get("dp", 1)
    rest = {k: v for k, v in mesh.items() if k != "dp"}
    for shard in divisors(dp):
        if (ends or 1 < shard < dp) and inner % shard == 0:
            yield {"dp": dp // shard, "fsdp": shard, **rest}


def _batches(space: Space, mesh: dict[str, int]) -> Iterator[tuple[int | None, int | None]]:
    """(global batch, accumulate): the micro-batches that divide each data-parallel rank's share."""
    gbs = space.global_batch_size if "global_batch_size" in space.open else None
    if "accumulate" not in space.open:
        yield gbs, None
        return
    share = gbs // data_size(mesh) if gbs and mesh else None
    for a in divisors(space.max_accumulate):
        if share is None or (share % a == 0 and a <= share):
            yield gbs, a


def _pipelines(
    space: Space, mesh: dict[str, int], share: int | None
) -> Iterator[tuple[str | None, int | None]]:
    pp = mesh.get("pp", 1)
    if pp == 1:
        yield None, None
        return
    schedules = space.schedules if "pipeline_schedule" in space.open else (None,)
    counts: list[int | None] = [None]
    if "pipeline_microbatches" in space.open:
        counts = [m for m in (pp, 2 * pp, 4 * pp) if share is None or share % m == 0] or [None]
    for s in schedules:
        for m in counts:
            yield s, m


def enumerate_candidates(space: Space) -> list[Candidate]:
    """Every candidate of `space`, cheapest-to-check first (the mesh varies slowest)."""
    out: list[Candidate] = []
    remats = space.remats if "remat" in space.open else (None,)
    offloads = space.offloads if "offload" in space.open else (None,)
    compiles = space.compiles if "compile" in space.open else (None,)
    for base in _meshes(space):
        for mesh, strategy in _strategies(space, base):
            for gbs, acc in _batches(space, mesh):
                share = gbs // data_size(mesh) // (acc or 1) if gbs and mesh else None
                for schedule, micro in _pipelines(space, mesh, share):
                    for remat in remats:
                        for offload in offloads:
                            for comp in compiles:
                                out.append(
                                    Candidate(mesh, strategy, remat, acc, gbs, schedule, micro, offload, comp)
                                )
    return out
