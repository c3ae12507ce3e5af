"""The planner's memory order: which candidate needs at least another's memory, and the most frugal first.

Two candidates of the same mesh, strategy, compile choice, global batch and pipeline micro-batches differ in
memory only by knobs whose order is known: a smaller accumulation (a larger micro-batch), less remat
(`remat_needs_more`: none > selective > full on every block; a policy on every n-th block between none and that
policy on every block), no offload rather than the optimizer's, GPipe rather than 1F1B (all micro-batches in
flight) each need at least as much. A candidate needing at least the memory of one measured not to fit cannot
fit (`needs_more_memory`); the most frugal candidate of each such group, run first (`frugal_first`), prunes its
whole group when it does not fit.

Example:
    >>> from accelfn.planner.candidates import Candidate
    >>> frugal = Candidate({"dp": 4}, "fsdp", "full", 4)
    >>> needs_more_memory(Candidate({"dp": 4}, "fsdp", "none", 2), frugal)
    True
    >>> needs_more_memory(Candidate({"dp": 4}, "fsdp", "none", 8), frugal)
    False
"""

from __future__ import annotations

from collections.abc import Callable

from .candidates import Candidate, data_size

__all__ = [
    "group",
    "frugality",
    "needs_more_memory",
    "remat_needs_more",
    "activation_share",
    "frugal_candidates",
    "frugal_first",
]

# each knob's values, the most memory first (a value not listed, or None, compares only to itself)
REMAT = ("none", "selective", "full")  # on every block; POLICY:N on every n-th (`remat_needs_more`)
OFFLOAD = ("none", "optimizer")
SCHEDULE = ("gpipe", "1f1b")
BINDS = 0.5  # memory may bind in a group whose hungriest estimate is above this fraction of the capacity


def group(c: Candidate) -> tuple[object, ...]:
    """What two candidates share when only their memory knobs (accumulate, remat, offload, pipeline schedule)
    differ."""
    return (c.mesh_spec, c.strategy, c.compile, c.global_batch_size, c.pipeline_microbatches)


def _rank(order: tuple[str, ...], value: str | None) -> int | None:
    return order.index(value) if value in order else None


def _at_most(a: int | None, b: int | None) -> bool:
    """`a` needs at least `b`'s memory on this knob (a rank no higher; None only equals None)."""
    if a is None or b is None:
        return a is b
    return a <= b


def _remat(value: str | None) -> tuple[int, int] | None:
    """A remat knob value as (its policy's rank in `REMAT`, the block interval n); None where unknown."""
    if value is None:
        return None
    policy, _, every = value.partition(":")
    rank = _rank(REMAT, policy)
    if rank is None or not (every or "1").isdigit() or int(every or 1) < 1:
        return None
    return rank, int(every or 1)


def remat_needs_more(a: str | None, b: str | None) -> bool:
    """Whether remat `a` keeps at least the activations of remat `b`, block by block (`af.remat`'s `every=n`
    checkpoints blocks n, 2n, ...; the others keep everything, as under "none"): "none" does; else `b` must
    checkpoint every block `a` does (its interval divides `a`'s) with a policy keeping no more (full <
    selective). So full:2 is between none and full, selective:2 between none and selective and above full:2,
    and selective and full:2 are not ordered (either may need more). Unknown values equal only themselves.

    Example:
        >>> remat_needs_more("full:2", "full"), remat_needs_more("none", "full:2"), remat_needs_more("full", "full:2")
        (True, True, False)
        >>> remat_needs_more("selective", "full:2"), remat_needs_more("full:2", "selective")
        (False, False)
    """
    if a == b:
        return True
    ra, rb = _remat(a), _remat(b)
    if ra is None or rb is None:
        return False
    (pa, na), (pb, nb) = ra, rb
    if pa == 0:  # none keeps everything
        return True
    return pb != 0 and na % nb == 0 and pa <= pb


def _remat_frugality(value: str | None) -> float:
    """A number that grows as remat keeps less (compatible with `remat_needs_more`): the policy's rank over
    its block interval (none 0, selective 1, full 2; full:2 1, selective:2 0.5); -1 for None or unknown."""
    r = _remat(value)
    return -1.0 if r is None else r[0] / r[1]


def frugality(c: Candidate) -> tuple[int, float, int, int]:
    """How little memory `c` needs within its group, larger for less: accumulation, remat, offload, schedule."""
    offload, schedule = _rank(OFFLOAD, c.offload), _rank(SCHEDULE, c.pipeline_schedule)
    return (c.accumulate or 0, _remat_frugality(c.remat), -1 if offload is None else offload,
            -1 if schedule is None else schedule)  # fmt: skip


def needs_more_memory(c: Candidate, other: Candidate) -> bool:
    """Whether `c` needs at least the memory of `other`: the same group, and on every memory knob the same
    value or one that needs more (a smaller accumulation, less remat as `remat_needs_more`, no offload, GPipe)."""
    if group(c) != group(other):
        return False
    acc = _at_most(c.accumulate, other.accumulate)
    return (
        acc
        and remat_needs_more(c.remat, other.remat)
        and _at_most(_rank(OFFLOAD, c.offload), _rank(OFFLOAD, other.offload))
        and _at_most(_rank(SCHEDULE, c.pipeline_schedule), _rank(SCHEDULE, other.pipeline_schedule))
    )


def activation_share(c: Candidate) -> float:
    """The fraction of the whole global batch's activations (the probe's) a rank of `c` holds at most, as the
    shapes go: its micro-batch (the data ranks', the accumulation's and the pipeline's split of the global
    batch, one sample at least) times the micro-batches in flight (GPipe: all; 1F1B: up to pp), over its
    stage's share of the blocks, tp and cp.

    Example:
        >>> activation_share(Candidate({"pp": 4, "dp": 2, "tp": 2}, accumulate=2, pipeline_microbatches=8))
        0.015625
        >>> activation_share(Candidate({"pp": 4, "dp": 2}, accumulate=4, global_batch_size=16))  # 1 sample
        0.0625
    """
    pp = c.mesh.get("pp", 1)
    micro = c.pipeline_microbatches or pp
    flight = micro if c.pipeline_schedule == "gpipe" else min(pp, micro)
    split = (data_size(c.mesh) if c.mesh else 1) * (c.accumulate or 1) * micro
    samples = max(1.0, c.global_batch_size / split) if c.global_batch_size else 1.0
    whole = c.global_batch_size or split
    return samples * flight / (whole * _split(c))


def _split(c: Candidate) -> int:
    """Over how many ranks the model itself is split (pp x tp x cp)."""
    return c.mesh.get("pp", 1) * c.mesh.get("tp", 1) * c.mesh.get("cp", 1)


def frugal_candidates(
    order: list[Candidate], estimate: Callable[[Candidate], float], capacity: float
) -> list[Candidate]:
    """The most frugal candidate of each group of `order` where memory may bind (its hungriest candidate's
    `estimate` above half of `capacity`): the least `estimate` (to 3 digits) first; among equals, each
    mesh's first before any mesh's second, the model split over the most ranks (pp x tp x cp: the less of
    what the estimate does not count, a gathered block, the logits, a rank holds), then `order`'s.

    Example:
        >>> cs = [Candidate({"dp": 2}, accumulate=1), Candidate({"dp": 2}, accumulate=2)]
        >>> [c.label for c in frugal_candidates(cs, lambda c: 10 / c.accumulate, 8)]
        ['dp=2 acc=2']
    """
    groups: dict[tuple[object, ...], list[Candidate]] = {}
    for c in order:
        groups.setdefault(group(c), []).append(c)
    first = [
        max(cs, key=frugality)
        for cs in groups.values()
        if len(cs) > 1 and max(estimate(c) for c in cs) > capacity * BINDS
    ]
    position = {id(c): i for i, c in enumerate(order)}
    rounded = {id(c): float(f"{estimate(c):.3g}") for c in first}
    nth: dict[int, int] = {}  # each candidate's rank among its mesh's equal ones (the order's)
    seen: dict[tuple[float, str], int] = {}
    for c in sorted(first, key=lambda c: position[id(c)]):
        key = (rounded[id(c)], c.mesh_spec)
        nth[id(c)] = seen[key] = seen.get(key, -1) + 1
    return sorted(first, key=lambda c: (rounded[id(c)], nth[id(c)], -_split(c), position[id(c)]))


def frugal_first(
    order: list[Candidate], estimate: Callable[[Candidate], float], capacity: float
) -> list[Candidate]:
    """`order` with `frugal_candidates` moved to the front, so that a group that cannot fit at all is pruned
    by one dry run and the meshes likeliest to fit are reached first; the rest keep their order.

    Example:
        >>> cs = [Candidate({"dp": 2}, accumulate=1), Candidate({"dp": 2}, accumulate=2)]
        >>> [c.accumulate for c in frugal_first(cs, lambda c: 10 / c.accumulate, 8)]
        [2, 1]
    """
    first = frugal_candidates(order, estimate, capacity)
    chosen = {id(c) for c in first}
    return first + [c for c in order if id(c) not in chosen]
