"""SLURM front-end: derive the launcher's node count, node rank, rendezvous id and host from ``SLURM_*``.

Run ``accelfn launch`` once per node (``srun --ntasks-per-node=1 accelfn launch train.py``); it starts
the node's processes itself.

Example:
    >>> expand_nodelist("node[01-03],gpu7")
    ['node01', 'node02', 'node03', 'gpu7']
    >>> s = from_env({"SLURM_JOB_ID": "42", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
    ...               "SLURM_JOB_NODELIST": "n[3-4]"})
    >>> s.nnodes, s.node_rank, s.rdzv_id, s.rdzv_endpoint
    (2, 1, '42', 'n3:29500')
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import attrs

DEFAULT_PORT = 29500


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise ValueError(f"SLURM nodelist {text!r} has unbalanced brackets")
    parts.append("".join(cur))
    return [p for p in parts if p]


def _expand_range(spec: str, nodelist: str) -> list[str]:
    out: list[str] = []
    for item in spec.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"SLURM nodelist {nodelist!r}: bad range {item!r} in [{spec}]")
        if not sep:
            out.append(lo)
            continue
        width = len(lo)
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist (``node[01-04,07],login1``) like ``scontrol show hostnames`` does."""
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        names = [""]
        for m in re.finditer(r"([^\[\]]+)|\[([^\]]*)\]", part):
            literal, brackets = m.group(1), m.group(2)
            pieces = [literal] if literal is not None else _expand_range(brackets, nodelist)
            names = [n + p for n in names for p in pieces]
        hosts.extend(names)
    return hosts


def _first_int(value: str) -> int:
    """``"4(x2),2"`` (SLURM's tasks-per-node syntax) -> 4."""
    m = re.match(r"\s*(\d+)", value)
    if not m:
        raise ValueError(f"cannot read a count from {value!r}")
    return int(m.group(1))


@attrs.frozen
class SlurmInfo:
    """What the launcher takes from a SLURM allocation."""

    job_id: str
    nnodes: int
    node_rank: int
    rdzv_id: str
    rdzv_endpoint: str
    hosts: list[str]
    nproc_per_node: int | None  # from SLURM_GPUS_ON_NODE; None: the platform decides


def from_env(environ: Mapping[str, str], *, port: int | None = None) -> SlurmInfo | None:
    """Derive `SlurmInfo` from ``SLURM_*`` variables, or None outside a SLURM job.

    The rendezvous host is the first node of the step's (else the job's) nodelist; the port is
    ``port``, else ``MASTER_PORT``, else 29500. A one-node job gets no endpoint: the launcher then uses a
    private store on a free port, so jobs sharing a node do not meet at one port.
    """
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job_id:
        return None

    def get_int(*names: str) -> int | None:
        for name in names:
            raw = environ.get(name)
            if raw:
                try:
                    return _first_int(raw)
                except ValueError:
                    raise ValueError(f"{name}={raw!r} is not a count") from None
        return None

    local_id = get_int("SLURM_LOCALID")
    if local_id not in (None, 0):
        raise ValueError(
            f"SLURM_LOCALID={local_id}: more than one `accelfn launch` runs on this node; start one per node "
            "(srun --ntasks-per-node=1) and choose the processes per node with --nproc-per-node"
        )
    nodelist = (
        environ.get("SLURM_STEP_NODELIST")
        or environ.get("SLURM_JOB_NODELIST")
        or environ.get("SLURM_NODELIST")
    )
    hosts = expand_nodelist(nodelist) if nodelist else []
    nnodes = get_int("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or max(len(hosts), 1)
    node_rank = get_int("SLURM_NODEID") or 0
    if node_rank >= nnodes:
        raise ValueError(f"SLURM_NODEID={node_rank} is not below the node count {nnodes}")
    if port is None:
        raw_port = environ.get("MASTER_PORT") or str(DEFAULT_PORT)
        if not raw_port.isdigit() or not 0 < int(raw_port) < 65536:
            raise ValueError(f"MASTER_PORT={raw_port!r} is not a port number")
        port = int(raw_port)
    host = hosts[0] if hosts else "127.0.0.1"
    return SlurmInfo(
        job_id=job_id,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_id=job_id,
        rdzv_endpoint=f"{host}:{port}" if nnodes > 1 else "",
        hosts=hosts,
        nproc_per_node=get_int("SLURM_GPUS_ON_NODE"),
    )
