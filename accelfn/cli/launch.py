"""``accelfn launch``: start a script on every process of one or more nodes (torch's elastic agent).

Example:
    $ accelfn launch --nproc-per-node 2 --cpu --mesh dp=2 train.py --lr 1e-3
    $ accelfn launch --nnodes 2 --node-rank 0 --rdzv-endpoint node1:29500 train.py   # on each node
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..launch_env import MIXED_PRECISION


def add_launch_options(p: argparse.ArgumentParser) -> None:
    """The options shared by ``launch`` and ``test`` (all default to None: "not given")."""
    g = p.add_argument_group("processes")
    g.add_argument(
        "--nproc-per-node",
        dest="nproc_per_node",
        metavar="N|auto",
        help="processes on this node (default: the platform's device count; 1 on CPU)",
    )
    g.add_argument(
        "--num-processes",
        dest="num_processes",
        type=int,
        metavar="N",
        help="processes over all nodes, as Accelerate's --num_processes: N / --nnodes on each node",
    )
    g.add_argument(
        "--nnodes",
        "--num-machines",
        dest="nnodes",
        metavar="N|MIN:MAX",
        help="number of nodes, or MIN:MAX for an elastic job (default 1)",
    )
    g.add_argument(
        "--node-rank",
        "--machine-rank",
        dest="node_rank",
        type=int,
        help="this node's rank (used by --rdzv-backend static; c10d assigns ranks itself)",
    )
    g.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous, the same on every node")
    g.add_argument("--rdzv-backend", choices=("c10d", "static"), help="rendezvous backend (default c10d)")
    g.add_argument("--rdzv-id", help="job id shared by all nodes (default: SLURM job id, else 'accelfn')")
    g.add_argument("--max-restarts", type=int, help="restart the whole group up to K times on failure")
    g.add_argument("--monitor-interval", type=float, help="seconds between worker health checks (0.1)")
    g.add_argument("--no-slurm", dest="use_slurm", action="store_false", help="ignore SLURM_* variables")
    s = p.add_argument_group("settings passed to the script (ACCELFN_* variables)")
    s.add_argument("--mesh", help="mesh axes, e.g. dp=2,tp=1 (-1: the rest of the world)")
    s.add_argument("--mixed-precision", choices=MIXED_PRECISION)
    s.add_argument("--cpu", action="store_true", help="run on CPU (ACCELFN_DEVICE=cpu, gloo)")
    s.add_argument(
        "--log-with",
        metavar="TRACKERS",
        help="experiment trackers for accelfn.trackers.open(log_with='auto'): a comma list of jsonl, "
        "tensorboard, wandb, mlflow, trackio, comet_ml, aim, clearml, dvclive, swanlab; all (every "
        "installed one); or none (ACCELFN_LOG_WITH)",
    )
    s.add_argument(
        "--config-file", "--config", help="YAML written by `accelfn config` (default: the cache folder's)"
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--log-dir",
        help="folder for each rank's error file, and its logs with --tee (default: a temp folder)",
    )
    o.add_argument(
        "--tee",
        choices=("none", "stdout", "stderr", "all"),
        default="none",
        help="also write these streams to --log-dir, with a [rankN] prefix on the console",
    )


def options_from_args(args: argparse.Namespace, script: str, script_args: list[str], module: bool) -> Any:
    """Turn parsed arguments into `LaunchOptions`."""
    from ..launch.launcher import LaunchOptions

    return LaunchOptions(
        script=script,
        script_args=tuple(script_args),
        module=module,
        nproc_per_node=args.nproc_per_node,
        num_processes=args.num_processes,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_backend=args.rdzv_backend,
        rdzv_id=args.rdzv_id,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        mesh=args.mesh,
        mixed_precision=args.mixed_precision,
        config_file=args.config_file,
        log_with=args.log_with,
        cpu=args.cpu,
        log_dir=args.log_dir,
        tee=args.tee,
        use_slurm=args.use_slurm,
    )


def launch(opts: Any) -> int:
    """Resolve and run; configuration errors become one line on stderr and exit code 2."""
    from ..launch.config import ConfigError
    from ..launch.launcher import resolve, run

    try:
        plan = resolve(opts)
        if not opts.module and not os.path.isfile(opts.script):
            raise ConfigError(
                f"{opts.script}: no such file (give the training script's path, or -m for a module)"
            )
    except (ConfigError, ValueError) as e:
        print(f"accelfn launch: error: {e}", file=sys.stderr)
        return 2
    return run(plan)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "launch",
        help="run a script on all processes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_launch_options(p)
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name, as `python -m`")
    p.add_argument("script", metavar="SCRIPT", nargs="?", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.script is None:  # argparse's own message also named the optional script arguments as required
        print(
            "accelfn launch: error: SCRIPT is required: the training script's path (or a module with -m)",
            file=sys.stderr,
        )
        return 2
    return launch(options_from_args(args, args.script, args.script_args, args.module))
