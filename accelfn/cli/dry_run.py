"""``accelfn dry-run``: your training script as one rank of the full job (64-1024 ranks) on this machine's
CPU, over torch's fake process group with every tensor fake; prints memory per rank, communication per mesh
axis, FLOPs, a predicted step time, and whether it fits.

Exit codes: 0 it fits, 3 it does not fit (the breakdown says why), 1 the script failed as its first real step
would (the same error), 2 bad arguments.

Example:
    $ accelfn dry-run --nproc-per-node 8 --nnodes 8 --gpu h100 examples/train_llama.py --model 8b
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
from pathlib import Path
from typing import Any

from ..dryrun.report import error_summary
from ..launch_env import MIXED_PRECISION

NOT_FITTING = 3


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "dry-run",
        help="run a training script as one rank of a large job on fake tensors: memory, communication, time",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="processes (devices) per node (default 8, or the config's)",
    )
    p.add_argument("--nnodes", type=int, default=None, help="nodes (default 1, or the config's)")
    p.add_argument(
        "--config",
        "--config-file",
        dest="config_file",
        default=None,
        metavar="FILE",
        help="a launch config (e.g. `accelfn plan --write plan.yaml`): its processes, mesh, mixed precision and "
        "plan knobs apply as `accelfn launch --config` applies them (flags given here win)",
    )
    p.add_argument(
        "--mixed-precision",
        default=None,
        choices=MIXED_PRECISION,
        help="the mixed precision the job launches with (`accelfn launch --mixed-precision`; default no, or the "
        "config's): a step under af.autocast / af.autocast_fp8 reads it",
    )
    p.add_argument("--device", default="cuda", help="device kind the job runs on (default cuda)")
    p.add_argument(
        "--gpu", default=None, help="row of the device table (default h100-sxm for cuda); see docs/devices.md"
    )
    p.add_argument(
        "--steps", type=int, default=1, help="training calls of each step object to measure (default 1)"
    )
    p.add_argument(
        "--step",
        type=int,
        default=None,
        metavar="N",
        help="go on to the N-th step object the script trains (a later phase): the calls of the ones before "
        "it are skipped after their first --steps",
    )
    p.add_argument(
        "--rank",
        default="0",
        help="the rank to run as, or 'worst' (ranks 0, middle, last, each pipeline stage, both ends of "
        "unevenly sharded axes)",
    )
    p.add_argument(
        "--mesh", default=None, help="the mesh as `accelfn launch --mesh` takes it, e.g. dp=8,tp=8"
    )
    p.add_argument(
        "--json", dest="json_path", default=None, metavar="FILE", help="also write the report as JSON"
    )
    p.add_argument("--no-search", action="store_true", help="skip the search for the largest micro-batch")
    p.add_argument(
        "--host-memory-gib",
        type=float,
        default=2048.0,
        help="host memory of a node in GiB, for the memory before the first step (default 2048: a DGX H100)",
    )
    p.add_argument(
        "--moe-routing",
        default="uniform",
        help="how MoE layers route their rows (fake tensors hold no expert ids): uniform (default: each token's "
        "k experts at random; the rank is given the busiest ep rank's rows), even (every expert rows / E), or "
        "a measured max/mean rows per expert (a number, a real run's metrics['moe_imbalance'])",
    )
    p.add_argument(
        "--torch-version",
        default=None,
        metavar="VERSION",
        help="the torch the job runs (default: the installed one), e.g. 2.11.0 or 2.6.0.dev20241223: it decides "
        "which SDPA kernel attention is timed as (cuDNN's or FlashAttention-2's, accelfn/dryrun/attention_speeds.py)",
    )
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(func=_run)


def _apply_config(args: argparse.Namespace) -> dict[str, str]:
    """Fill the flags not given from `--config` (as `accelfn launch` does); return the env the script reads
    (mixed precision, as `accelfn launch` sets it, and the plan's knobs). Raises ConfigError naming the file and
    key."""
    from ..launch import config as launch_config

    cfg = launch_config.load(args.config_file) if args.config_file else launch_config.Config()
    if args.nproc_per_node is None:
        n = cfg.num_processes if args.config_file else "auto"
        args.nproc_per_node = 8 if n == "auto" else int(n)
    if args.nnodes is None:
        args.nnodes = launch_config.parse_nnodes(cfg.num_machines)[1]
    if args.mesh is None and cfg.mesh:
        args.mesh = cfg.mesh
    return {**cfg.plan.env(), **cfg.precision_env(args.mixed_precision)}


def _run(args: argparse.Namespace) -> int:
    from ..dryrun import Assumptions, dry_run
    from ..launch.config import ConfigError
    from ..launch_env import environ_set

    try:
        env = _apply_config(args)
    except ConfigError as e:
        print(f"accelfn dry-run: --config: {e}", file=sys.stderr)
        return 2
    with environ_set(env):
        return _dry_run(args, dry_run, Assumptions)


def _dry_run(args: argparse.Namespace, dry_run: Any, Assumptions: Any) -> int:  # noqa: N803
    rank: int | str = args.rank
    if rank != "worst":
        try:
            rank = int(rank)
        except ValueError:
            print(
                f"accelfn dry-run: --rank must be an integer or 'worst', got {args.rank!r}", file=sys.stderr
            )
            return 2
    if args.gpu is not None:
        from ..platforms import specs

        try:
            specs.spec(args.gpu)
        except ValueError as e:
            print(f"accelfn dry-run: --gpu: {e}", file=sys.stderr)
            return 2
    routing: str | float = args.moe_routing
    with contextlib.suppress(ValueError):
        routing = float(routing)
    try:
        assumptions = Assumptions(host_memory_bytes=int(args.host_memory_gib * 2**30), moe_routing=routing)
    except ValueError as e:
        print(f"accelfn dry-run: --moe-routing: {e}", file=sys.stderr)
        return 2
    if args.torch_version is not None:
        import attrs

        from ..dryrun.attention_speeds import sdpa_backend

        try:
            sdpa_backend(args.torch_version, "")
        except ValueError as e:
            print(f"accelfn dry-run: --torch-version: {e}", file=sys.stderr)
            return 2
        timing = attrs.evolve(assumptions.timing, torch_version=args.torch_version)
        assumptions = attrs.evolve(assumptions, timing=timing)
    if not Path(args.script).is_file():
        print(f"accelfn dry-run: no such script: {args.script}", file=sys.stderr)
        return 2
    try:
        report = dry_run(
            args.script,
            args.script_args,
            nproc_per_node=args.nproc_per_node,
            nnodes=args.nnodes,
            device=args.device,
            gpu=args.gpu,
            steps=args.steps,
            step=args.step,
            rank=rank,
            mesh=args.mesh,
            search=not args.no_search,
            assumptions=assumptions,
        )
    except ValueError as e:
        if "af.dry_run:" in str(e):
            print(f"accelfn dry-run: {e}", file=sys.stderr)
            return 2
        return _failed(e, args)
    except Exception as e:  # noqa: BLE001 - the script's own error, reported as its first step would raise it
        return _failed(e, args)
    print(report)
    if args.json_path:
        Path(args.json_path).write_text(report.to_json() + "\n")
    return NOT_FITTING if report.fits is False else 0


def _failed(e: BaseException, args: argparse.Namespace) -> int:
    world = args.nproc_per_node * args.nnodes
    traceback.print_exception(e, file=sys.stderr)
    print(
        f"\naccelfn dry-run: the script fails as rank {args.rank} of {world} "
        f"({args.nproc_per_node} x {args.nnodes}): {error_summary(e)}",
        *getattr(e, "__notes__", ()),
        sep="\n",
        file=sys.stderr,
    )
    if args.json_path:
        import json

        Path(args.json_path).write_text(
            json.dumps({"world_size": world, "errors": [error_summary(e)], "fits": None}, indent=2) + "\n"
        )
    return 1
