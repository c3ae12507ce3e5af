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
Not modelled: NVLink SHARP (NVLS) and CollNet, NCCL's channel count for small messages, contention between
concurrent collectives, and the SMs NCCL's kernels take from the compute they overlap.

Example:
    >>> from accelfn.platforms.specs import spec
    >>> a = CommAssumptions(intra_efficiency=1.0, ring_base_us=0.0, nvlink_hop_us=0.0)
    >>> collective_time("all_gather", 8 * 450_000_000, 8, 1, spec("h100-sxm"), a)  # 7/8 of it over 450 GB/s
    0.007
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from ..platforms.specs import DeviceSpec
from .tracker import bus_bytes

__all__ = ["CommAssumptions", "collective_time", "group_nodes", "ranks_in_node"]


@attrs.frozen
class CommAssumptions:
    """Figures of the communication model (each printed in the report; override any).

    `intra_efficiency` / `inter_efficiency`: the fraction of the link bandwidth a large collective's bus
    bandwidth reaches (nccl-tests on NVLink 4 and 400 Gb/s InfiniBand reach about 80%); the latencies are
    NCCL's tuning table's (Simple protocol): `ring_base_us` (baseLat, ring), `tree_base_us`, per-hop
    `nvlink_hop_us` and `net_hop_us` (hwLat: NVLink, network).
    """

    intra_efficiency: float = 0.8
    inter_efficiency: float = 0.8
    ring_base_us: float = 8.4
    tree_base_us: float = 8.4
    nvlink_hop_us: float = 3.4
    net_hop_us: float = 14.0
    tree: bool = True  # let all-reduce over several nodes take NCCL's tree when it is faster


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
    latency = a.ring_base_us + (steps - inter_steps) * a.nvlink_hop_us + inter_steps * a.net_hop_us
    if kind == "all_to_all" and nodes > 1:
        local = max(1, min(n, local if local is not None else math.ceil(n / nodes)))
        over = max(nbytes * (n - local) / n / inter_bw, nbytes * (local - 1) / n / intra_bw)
        return latency * 1e-6 + over
    ring = latency * 1e-6 + bus_bytes(kind, nbytes, n) / bw
    if kind != "all_reduce" or nodes <= 1 or not a.tree:
        return ring
    per_node = max(1, n // nodes)
    tree_latency = a.tree_base_us + 2 * ((per_node - 1) * a.nvlink_hop_us + math.log2(nodes) * a.net_hop_us)
    tree = tree_latency * 1e-6 + 2 * nbytes / bw
    return min(ring, tree)
