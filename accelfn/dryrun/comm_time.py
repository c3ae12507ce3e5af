"""The time of one collective, as NCCL's own cost model has it (NVIDIA/nccl, src/graph/tuning.cc): a latency
term per algorithm step plus the bus bytes over the bandwidth of the slowest link the group crosses.

- ring (all-gather, reduce-scatter, all-reduce, all-to-all, broadcast): `n - 1` steps (`2 (n - 1)` for
  all-reduce), each paying the link's per-hop latency (NVLink within a node, the network between nodes), plus a
  base latency; bytes: nccl-tests' bus bytes (`tracker.bus_bytes`) over the bandwidth of the slowest link the
  ring crosses: NVLink when the group stays in a node, else one device's share of the node's network (every
  GPU of a ring over nodes sends through its own NIC).
- tree (all-reduce over several nodes): NCCL's double binary tree: `2 log2(nodes)` network hops plus the
  chain inside each node; its bytes cost `2 S / bw` (each byte up and down the tree once), about the ring's for
  large groups. NCCL picks the faster of the two; so does this model.
- all-to-all over several nodes (expert parallel's dispatch and combine): each rank sends `1 / n` of its buffer
  to every other rank: the part for the ranks of its own node over NVLink and the rest over its NIC, at once, so
  the bytes cost the slower of the two (not all the bus bytes over the network: a group with 8 ranks on each of
  8 nodes sends 56 of its 63 parts across nodes, a strided one with one rank per node all 63).
- point-to-point (pipeline sends and receives): one hop plus the bytes over the link.

The latencies are NCCL's tuning table's (Simple protocol, which large messages use: base 8.4 us; per hop 3.4 us
over NVLink, 14 us over the network), in `CommAssumptions` with the link efficiencies: printed, overridable.
NCCL times every (algorithm, protocol) pair and runs the fastest (`ncclTopoGetAlgoTime`), so a small message
takes a low-latency protocol: LL (8-byte lines of 4 data bytes and a flag: half the bandwidth, 0.6 us a hop on
NVLink) or LL128 (120 of 128 bytes: 0.92 of it, 1.9 us a hop), `NCCL_PROTOCOLS` (NCCL 2.27.3's figures; on every
GPU kind, without NCCL's per-architecture caps on their bandwidth). A ring all-reduce of a few bytes over 8 GPUs
of a node, as tensorwise fp8 under tensor parallel runs for each scale (the amax), costs 15 us, not Simple's
56 us. `CommAssumptions(protocols=False)` keeps Simple for every size.
Not modelled: NVLink SHARP (NVLS) and CollNet, NCCL's channel count for small messages, contention between
concurrent collectives, and the SMs NCCL's kernels take from the compute they overlap.

Example:
    >>> from accelfn.platforms.specs import spec
    >>> a = CommAssumptions(intra_efficiency=1.0, ring_base_us=0.0, nvlink_hop_us=0.0)
    >>> collective_time("all_gather", 8 * 450_000_000, 8, 1, spec("h100-sxm"), a)  # 7/8 of it over 450 GB/s
    0.007
    >>> round(collective_time("all_reduce", 4, 8, 1, spec("h100-sxm"), CommAssumptions()) * 1e6, 1)  # LL
    15.0
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from ..platforms.specs import DeviceSpec
from .tracker import bus_bytes

__all__ = ["CommAssumptions", "NCCL_PROTOCOLS", "collective_time", "group_nodes", "ranks_in_node"]

# NCCL 2.27.3 (the release of torch 2.8's nightlies), src/graph/tuning.cc: for each low-latency protocol and
# algorithm, the base latency `baseLat`, the latency per hop over NVLink and over the network `hwLat` (us), and the
# fraction of the Simple protocol's bus bandwidth it reaches (ring LL `busBw * .5`, ring LL128 `busBw * 0.92`, tree LL
# `busBw * 1.0/3.8`, tree LL128 over nodes `busBw * 120.0/128.0`)
NCCL_PROTOCOLS: dict[tuple[str, str], tuple[float, float, float, float]] = {
    ("ring", "LL"): (6.6, 0.6, 2.7, 0.5),
    ("ring", "LL128"): (14.0, 1.9, 4.0, 0.92),
    ("tree", "LL"): (6.8, 0.6, 5.0, 1 / 3.8),
    ("tree", "LL128"): (14.0, 1.25, 8.5, 120 / 128),
}


@attrs.frozen
class CommAssumptions:
    """Figures of the communication model (each printed in the report; override any).

    `intra_efficiency` / `inter_efficiency`: the fraction of the link bandwidth a large collective's bus
    bandwidth reaches (nccl-tests on NVLink 4 and 400 Gb/s InfiniBand reach about 80%); the latencies are
    NCCL's tuning table's (Simple protocol): `ring_base_us` (baseLat, ring), `tree_base_us`, per-hop
    `nvlink_hop_us` and `net_hop_us` (hwLat: NVLink, network); `protocols`: let a collective take NCCL's LL or
    LL128 protocol (`NCCL_PROTOCOLS`) where it is faster than Simple, as NCCL does (small messages).
    """

    intra_efficiency: float = 0.8
    inter_efficiency: float = 0.8
    ring_base_us: float = 8.4
    tree_base_us: float = 8.4
    nvlink_hop_us: float = 3.4
    net_hop_us: float = 14.0
    tree: bool = True  # let all-reduce over several nodes take NCCL's tree when it is faster
    protocols: bool = True  # let small messages take NCCL's LL / LL128 protocols when they are faster


def group_nodes(group_size: int, intra_node: bool, nproc_per_node: int) -> int:
    """Nodes a group spans: 1 when it stays in a node, else its size over the ranks per node (at least 2)."""
    if intra_node or group_size <= 1:
        return 1
    return max(2, math.ceil(group_size / max(1, nproc_per_node)))


def ranks_in_node(axes: tuple[str, ...], shape: Mapping[str, int], nproc_per_node: int) -> int:
    """How many ranks of a group over `axes` of a row-major mesh `shape` share a node with each of them (the
    first group's node: nodes hold `nproc_per_node` consecutive ranks).

    Example:
        >>> ranks_in_node(("ep",), {"fsdp": 16, "ep": 64}, 8), ranks_in_node(("ep",), {"ep": 8, "fsdp": 8}, 8)
        (8, 1)
    """
    names = list(shape)
    offsets = [0]
    for a in axes:
        stride = math.prod(shape[b] for b in names[names.index(a) + 1 :])
        offsets = [o + i * stride for o in offsets for i in range(shape[a])]
    return max(1, sum(o < nproc_per_node for o in offsets))


def collective_time(
    kind: str,
    nbytes: int,
    n: int,
    nodes: int,
    device: DeviceSpec,
    a: CommAssumptions,
    local: int | None = None,
) -> float:
    """Seconds of one collective of `kind` whose full buffer is `nbytes`, over `n` ranks on `nodes` nodes
    (`local` of them in each rank's node, for an all-to-all: default `n / nodes`).

    Example:
        >>> from accelfn.platforms.specs import spec
        >>> h100, a = spec("h100-sxm"), CommAssumptions()
        >>> inside = collective_time("reduce_scatter", 2**30, 8, 1, h100, a)
        >>> across = collective_time("reduce_scatter", 2**30, 16, 2, h100, a)
        >>> round(across / inside, 1)  # the network's 50 GB/s against NVLink's 450 GB/s
        9.6
    """
    if n <= 1 or kind == "barrier" and nbytes == 0:
        return 0.0 if n <= 1 else a.ring_base_us * 1e-6
    intra_bw = device.intra_node_gbs * 1e9 * a.intra_efficiency
    inter_bw = device.inter_node_gbs * 1e9 * a.inter_efficiency
    bw = intra_bw if nodes <= 1 else inter_bw
    if kind == "send_recv":
        hop = a.nvlink_hop_us if nodes <= 1 else a.net_hop_us
        return hop * 1e-6 + nbytes / bw
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    inter_steps = (2 if kind == "all_reduce" else 1) * (nodes - 1)

    def ring_latency(base: float, nvlink: float, net: float) -> float:
        return base + (steps - inter_steps) * nvlink + inter_steps * net

    latency = ring_latency(a.ring_base_us, a.nvlink_hop_us, a.net_hop_us)
    if kind == "all_to_all" and nodes > 1:
        local = max(1, min(n, local if local is not None else math.ceil(n / nodes)))
        over = max(nbytes * (n - local) / n / inter_bw, nbytes * (local - 1) / n / intra_bw)
        return latency * 1e-6 + over
    bus = bus_bytes(kind, nbytes, n)
    low_latency = a.protocols and kind != "all_to_all"  # (NCCL's all-to-all is point-to-point sends)
    ring = latency * 1e-6 + bus / bw
    if low_latency:
        for proto in ("LL", "LL128"):
            base, nvlink, net, share = NCCL_PROTOCOLS["ring", proto]
            ring = min(ring, ring_latency(base, nvlink, net) * 1e-6 + bus / (bw * share))
    if kind != "all_reduce" or nodes <= 1 or not a.tree:
        return ring
    per_node = max(1, n // nodes)

    def tree_latency(base: float, nvlink: float, net: float) -> float:
        return base + 2 * ((per_node - 1) * nvlink + math.log2(nodes) * net)

    tree = tree_latency(a.tree_base_us, a.nvlink_hop_us, a.net_hop_us) * 1e-6 + 2 * nbytes / bw
    if low_latency:
        for proto in ("LL", "LL128"):
            base, nvlink, net, share = NCCL_PROTOCOLS["tree", proto]
            tree = min(tree, tree_latency(base, nvlink, net) * 1e-6 + 2 * nbytes / (bw * share))
    return min(ring, tree)
