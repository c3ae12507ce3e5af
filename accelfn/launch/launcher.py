"""Resolve the launch settings (flags > SLURM > config file > defaults) and run torch's elastic agent.

Example:
    >>> plan = resolve(LaunchOptions(script="train.py", nproc_per_node=2, cpu=True), environ={})
    >>> plan.nproc_per_node, plan.min_nodes, plan.env["ACCELFN_DEVICE"]
    (2, 1, 'cpu')
"""

from __future__ import annotations

import math
import os
import re
import signal
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from .. import launch_env as contract
from .config import Config, ConfigError, default_config_path, load, parse_nnodes
from .slurm import from_env as slurm_from_env

BOOTSTRAP = str(Path(__file__).with_name("_bootstrap.py"))
TEE_CHOICES = ("none", "stdout", "stderr", "all")


@attrs.frozen
class LaunchOptions:
    """What the user asked for; ``None`` means "not given" (the config file or a default decides)."""

    script: str
    script_args: Sequence[str] = ()
    module: bool = False
    nproc_per_node: int | str | None = None
    num_processes: int | None = None  # over all nodes (Accelerate's meaning): nproc_per_node = this / nnodes
    nnodes: int | str | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None
    max_restarts: int | None = None
    monitor_interval: float | None = None
    mesh: str | None = None
    mixed_precision: str | None = None
    config_file: str | None = None
    log_with: str | None = None
    cpu: bool = False
    device: str | None = None  # a device kind (auto, cpu, cuda, ...); `cpu=True` wins
    log_dir: str | None = None
    tee: str = "none"
    use_slurm: bool = True


@attrs.frozen
class LaunchPlan:
    """Everything resolved: what the elastic agent gets, and the env contract for the workers."""

    nproc_per_node: int
    min_nodes: int
    max_nodes: int
    node_rank: int
    rdzv_backend: str
    rdzv_endpoint: str
    rdzv_id: str
    max_restarts: int
    monitor_interval: float
    entrypoint: str
    args: tuple[str, ...]
    env: dict[str, str]
    log_dir: str | None
    tee: str
    source: dict[str, str]  # where each setting came from: flag, slurm, config, default


def _device_count(kind: str) -> int:
    """Processes per node for ``auto``: the platform's device count (1 on CPU)."""
    from .. import platforms

    platform = platforms.detect() if kind == "auto" else platforms.get(kind)
    return max(int(platform.device_count()), 1)


def _read_config(opts: LaunchOptions, environ: Mapping[str, str]) -> tuple[Config, str | None]:
    if opts.config_file:
        return load(opts.config_file), os.path.abspath(opts.config_file)
    path = default_config_path(environ)
    if path.is_file():
        return load(path), str(path)
    return Config(), None


def _check_log_dir(log_dir: str | None) -> str | None:
    """`--log-dir`: a folder that exists or can be made (torch's agent would fail with a traceback)."""
    if log_dir is None:
        return None
    if os.path.exists(log_dir) and not os.path.isdir(log_dir):
        raise ConfigError(f"--log-dir={log_dir!r} is a file; give a folder (made if missing)")
    try:
        os.makedirs(log_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--log-dir={log_dir!r} cannot be made: {e.strerror or e}") from None
    if not os.access(log_dir, os.W_OK):
        raise ConfigError(f"--log-dir={log_dir!r} is not writable")
    return log_dir


def _per_node(total: int, nproc_per_node: Any, min_nodes: int, max_nodes: int) -> int:
    """`--num-processes` (processes over all nodes, as Accelerate counts them) as processes per node."""
    if nproc_per_node is not None:
        raise ConfigError(
            f"--num-processes={total} and --nproc-per-node={nproc_per_node}: give one (--num-processes counts "
            "the processes of all nodes, --nproc-per-node those of each)"
        )
    if total < 1:
        raise ConfigError(f"--num-processes={total}: expected a positive integer")
    if min_nodes != max_nodes:
        raise ConfigError(
            f"--num-processes={total} with an elastic --nnodes={min_nodes}:{max_nodes}: the processes per node "
            "are not fixed; give --nproc-per-node"
        )
    if total % max_nodes:
        raise ConfigError(
            f"--num-processes={total} (over all nodes) does not split evenly over --nnodes={max_nodes}; give a "
            f"multiple of {max_nodes}, or --nproc-per-node"
        )
    return total // max_nodes


def resolve(opts: LaunchOptions, environ: Mapping[str, str] | None = None) -> LaunchPlan:
    """Merge flags, SLURM variables, the config file and defaults into a `LaunchPlan` (makes `--log-dir` if
    missing, so that a path that cannot be a folder is an error here, not in the agent)."""
    environ = os.environ if environ is None else environ
    cfg, cfg_path = _read_config(opts, environ)
    slurm = slurm_from_env(environ) if opts.use_slurm else None
    source: dict[str, str] = {}

    def pick(name: str, flag: Any, slurm_value: Any, cfg_value: Any, default: Any) -> Any:
        for origin, value in (("flag", flag), ("slurm", slurm_value)):
            if value is not None:
                source[name] = origin
                return value
        source[name] = "config" if cfg_path and cfg_value != default else "default"
        return cfg_value

    device = "cpu" if opts.cpu else opts.device or cfg.device
    if device not in contract.DEVICE_KINDS:
        raise ConfigError(f"device={device!r} is not one of {', '.join(contract.DEVICE_KINDS)}")
    nnodes = pick("nnodes", opts.nnodes, slurm and slurm.nnodes, cfg.num_machines, 1)
    min_nodes, max_nodes = parse_nnodes(nnodes, key="--nnodes")
    nproc = pick(
        "nproc_per_node", opts.nproc_per_node, slurm and slurm.nproc_per_node, cfg.num_processes, "auto"
    )
    if opts.num_processes is not None:
        nproc = _per_node(opts.num_processes, opts.nproc_per_node, min_nodes, max_nodes)
        source["nproc_per_node"] = "flag"
    if nproc == "auto":
        nproc = _device_count(device)
    try:
        nproc = int(nproc)
    except ValueError:
        raise ConfigError(f"--nproc-per-node={nproc!r}: expected a positive integer or 'auto'") from None
    if nproc < 1:
        raise ConfigError(f"--nproc-per-node={nproc}: expected a positive integer or 'auto'")
    node_rank = int(pick("node_rank", opts.node_rank, slurm and slurm.node_rank, cfg.machine_rank, 0))
    backend = pick("rdzv_backend", opts.rdzv_backend, None, cfg.rdzv_backend, "c10d")
    if backend not in ("c10d", "static"):
        raise ConfigError(f"--rdzv-backend={backend!r} is not one of c10d, static")
    # an endpoint written in the config beats the one SLURM implies (its host with a default port)
    derived = None if cfg.rdzv_endpoint else slurm and slurm.rdzv_endpoint
    endpoint = pick("rdzv_endpoint", opts.rdzv_endpoint, derived, cfg.rdzv_endpoint, "")
    rdzv_id = pick("rdzv_id", opts.rdzv_id, slurm and slurm.rdzv_id, cfg.rdzv_id, "")
    if max_nodes == 1 and not endpoint:
        # One node, no endpoint: a private c10d store on a free port (like `torchrun --standalone`).
        backend, endpoint, rdzv_id = "c10d", "localhost:0", rdzv_id or uuid.uuid4().hex
    elif not endpoint:
        raise ConfigError(
            f"--nnodes={nnodes}: more than one node needs --rdzv-endpoint HOST:PORT "
            "(the same on every node), or run under SLURM"
        )
    if backend == "static" and min_nodes != max_nodes:
        raise ConfigError(f"--nnodes={nnodes}: the static rendezvous needs a fixed node count; use c10d")
    if not 0 <= node_rank < max_nodes:
        raise ConfigError(f"--node-rank={node_rank} must be in [0, --nnodes={max_nodes})")
    max_restarts = int(pick("max_restarts", opts.max_restarts, None, cfg.max_restarts, 0))
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts={max_restarts}: expected an integer >= 0")
    interval = float(pick("monitor_interval", opts.monitor_interval, None, cfg.monitor_interval, 0.1))
    if not 0 < interval < float("inf"):
        raise ConfigError(f"--monitor-interval={interval}: expected a positive number of seconds")
    mesh = pick("mesh", opts.mesh, None, cfg.mesh, "")
    if mesh:
        # where it came from: the flag, or the config file's key (a plan.yaml written for another world)
        where = (
            "--mesh"
            if opts.mesh
            else "config key 'mesh'" + (f" in {opts.config_file}" if opts.config_file else "")
        )
        axes = contract.parse_mesh(mesh, source=where)
        mesh = contract.format_mesh(axes)
        if min_nodes == max_nodes:  # a fixed world: check the sizes now, not in every worker
            world = nproc * max_nodes
            fixed = math.prod(v for v in axes.values() if v != -1)
            rest = -1 in axes.values()
            if (world % fixed != 0) if rest else (fixed != world):
                raise ConfigError(
                    f"{where} {mesh}: the axis sizes multiply to {fixed}{' times the -1 axis' if rest else ''}, but the "
                    f"job has {world} processes (--nproc-per-node {nproc} x --nnodes {max_nodes}); make them match, or "
                    "set one axis to -1"
                )
    precision = pick("mixed_precision", opts.mixed_precision, None, cfg.mixed_precision, "no")
    precision_env = cfg.precision_env(precision)  # ConfigError for a precision that is not one
    log_with = pick("log_with", opts.log_with, None, cfg.log_with, "")
    if log_with:
        log_with = ",".join(contract.parse_log_with(log_with, source="--log-with")) or "none"
    if opts.tee not in TEE_CHOICES:
        raise ConfigError(f"--tee={opts.tee!r} is not one of {', '.join(TEE_CHOICES)}")

    env = {
        contract.ACCELFN_LAUNCHED: "1",
        contract.ACCELFN_DEVICE: device,
        **precision_env,
    }
    if mesh:
        env[contract.ACCELFN_MESH] = mesh
    env.update(cfg.plan.env())  # the planner's knobs (`accelfn plan --write`)
    if log_with:
        env[contract.ACCELFN_LOG_WITH] = log_with
    if cfg_path:
        env[contract.ACCELFN_CONFIG_FILE] = cfg_path
    if max_restarts > 0 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in environ:
        # With the agent's shared TCPStore, a restarted group can read the previous attempt's keys
        # and connect to dead peers (pytorch#135712, #167288): give each attempt its own store.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if nproc > 1 and "OMP_NUM_THREADS" not in environ:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun: N processes must not each take every core

    target = ["-m", opts.script] if opts.module else [opts.script]
    return LaunchPlan(
        nproc_per_node=nproc,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        node_rank=node_rank,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_id=rdzv_id or "accelfn",
        max_restarts=max_restarts,
        monitor_interval=interval,
        entrypoint=sys.executable,
        args=("-u", BOOTSTRAP, *target, *opts.script_args),
        env=env,
        log_dir=_check_log_dir(opts.log_dir),
        tee=opts.tee,
        source=source,
    )


# Messages a rank raises because another rank died first (gloo, NCCL, the store): never the root cause
# when some other rank failed too.
_PEER_FAILURE = re.compile(
    r"Connection closed by peer|Connection reset by peer|remote worker crashing|Broken pipe"
    r"|remote process exited|NCCL communicator was aborted|failed to recv, got 0 bytes"
)


def _first_failure(err: Any) -> int:
    """The rank that failed first. torch's `get_first_failure` compares whole-second timestamps and breaks
    ties by rank, so a rank that died of its peer's crash in the same second was named instead of the peer.
    Here consequences come after causes: a rank's own error or exit code first, then a rank killed by a
    signal (SIGKILL of the OOM killer, SIGSEGV), last a rank stopped by SIGTERM (the agent stops the others
    that way once one failed) or by a dead peer's connection error; then the error file's write time (ns)."""

    def key(item: tuple[int, Any]) -> tuple[int, float, int]:
        rank, failure = item
        try:
            when = os.stat(failure.error_file).st_mtime_ns / 1e9
        except (OSError, TypeError):
            when = float(failure.timestamp)
        message = failure.message
        message = message.get("message", "") if isinstance(message, dict) else str(message)
        if _PEER_FAILURE.search(message) or failure.exitcode == -signal.SIGTERM:
            order = 2
        elif failure.exitcode < 0:
            order = 1
        else:
            order = 0
        return (order, when, rank)

    return min(err.failures.items(), key=key)[0]


def _failure_report(err: Any, prog: str = "accelfn launch") -> str:
    """A short line for each later failure, then the first failed rank's summary line and its traceback: the
    root cause is the last thing printed, where the terminal shows it."""
    lines = []
    first = _first_failure(err)
    for rank, failure in sorted(err.failures.items(), key=lambda kv: (kv[0] == first, kv[0])):
        data = failure.error_file_data or {}
        message = data.get("message") if isinstance(data, dict) else None
        callstack = ""
        if isinstance(message, dict):
            callstack = message.get("extraInfo", {}).get("py_callstack", "")
            summary = message.get("message", "")
        elif (
            isinstance(message, str) and message != "<NONE>"
        ):  # torch's placeholder when no error file exists
            summary = message
        elif failure.exitcode < 0:
            summary = f"killed by signal {failure.signal_name()}"
        else:
            summary = f"exited with code {failure.exitcode}"
        if rank != first:
            summary = summary if len(summary) < 160 else summary[:157] + "..."
            lines.append(f"{prog}: rank {rank} also failed (after rank {first}, below): {summary}")
            continue
        lines.append(
            f"{prog}: rank {rank} failed: {summary} "
            f"(local rank {failure.local_rank}, pid {failure.pid}, exit code {failure.exitcode})"
        )
        if callstack:
            lines.append("  " + callstack.rstrip().replace("\n", "\n  "))
    return "\n".join(lines)


def launch_config(plan: LaunchPlan, *, start_method: str = "spawn") -> Any:
    """The `torch.distributed.launcher.api.LaunchConfig` of `plan` (shared by `run` and `notebook_launch`).
    The workers' ``ACCELFN_*`` variables (``plan.env``) are not in it: the agent passes its own process's
    environment on, so the caller puts them there while the agent runs."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    tee = Std.from_str({"none": "0", "stdout": "1", "stderr": "2", "all": "3"}[plan.tee])
    return LaunchConfig(
        min_nodes=plan.min_nodes,
        max_nodes=plan.max_nodes,
        nproc_per_node=plan.nproc_per_node,
        run_id=plan.rdzv_id,
        role="accelfn",
        rdzv_endpoint=plan.rdzv_endpoint,
        rdzv_backend=plan.rdzv_backend,
        rdzv_configs={"rank": plan.node_rank} if plan.rdzv_backend == "static" else {},
        max_restarts=plan.max_restarts,
        monitor_interval=plan.monitor_interval,
        start_method=start_method,
        logs_specs=DefaultLogsSpecs(log_dir=plan.log_dir, tee=tee),
        log_line_prefix_template="[rank${rank}]: " if plan.tee != "none" else None,
    )


def run(plan: LaunchPlan) -> int:
    """Run the plan on torch's elastic agent in this process; return the exit code (0: all ranks ok)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    os.environ.update(plan.env)  # the agent passes its environment on to every worker
    config = launch_config(plan)
    try:
        elastic_launch(config=config, entrypoint=plan.entrypoint)(*plan.args)
    except ChildFailedError as err:
        print(_failure_report(err), file=sys.stderr, flush=True)
        return 1
    except Exception as err:  # rendezvous timeouts, closed stores, ...
        if type(err).__name__ == "SignalException":
            print(f"accelfn launch: stopped by signal {getattr(err, 'sigval', '?')}", file=sys.stderr)
            return 128 + int(getattr(err, "sigval", 15))
        print(f"accelfn launch: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1
    return 0
