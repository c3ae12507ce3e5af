"""``accelfn plan``: the fastest configuration of your unmodified training script that fits, chosen on this
machine's CPU with dry runs: the mesh (dp, fsdp, tp, pp, cp) and the knobs the script leaves to the launch
configuration ("auto": strategy, remat, accumulate, pipeline, offload), ranked by predicted tokens/s per GPU.

Exit codes: 0 a configuration fits, 3 none fits, 1 the script fails as one process, 2 bad arguments.

Example:
    $ accelfn plan --nproc-per-node 8 --nnodes 8 --global-batch-size 256 --write plan.yaml train.py
    $ accelfn plan --remats none,full,full:2,selective:3 --write plan.yaml train.py   # these remat values
    $ accelfn plan --torch-version 2.6.0 train.py   # timed as torch 2.6 runs it (FlashAttention-2's SDPA)
    $ accelfn plan --mixed-precision bf16 --write plan.yaml train.py   # as `accelfn launch --mixed-precision bf16`
    $ accelfn launch --config plan.yaml train.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..launch_env import MIXED_PRECISION

NONE_FITS = 3


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="choose the fastest configuration of a training script that fits, by dry runs on this CPU",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--nproc-per-node", type=int, default=None, help="processes (devices) per node (default 8)"
    )
    p.add_argument("--nnodes", type=int, default=None, help="nodes (default 1)")
    p.add_argument("--device", default="cuda", help="device kind the job runs on (default cuda)")
    p.add_argument("--gpu", default=None, help="row of the device table (default h100-sxm for cuda)")
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        metavar="B",
        help="the global batch the plan holds fixed (needed when the script leaves it 'auto')",
    )
    p.add_argument(
        "--budget-minutes", type=float, default=15.0, metavar="T", help="time for the dry runs (default 15)"
    )
    p.add_argument("--top", type=int, default=10, metavar="K", help="rows of the table (default 10)")
    p.add_argument(
        "--json", dest="json_path", default=None, metavar="FILE", help="also write the plan as JSON"
    )
    p.add_argument(
        "--write", default=None, metavar="PLAN.YAML", help="write the chosen configuration as a launch config"
    )
    p.add_argument("--png", default=None, metavar="FILE", help="draw peak memory against tokens/s per GPU")
    p.add_argument(
        "--axes",
        default="dp,tp,pp,cp,ep",
        help="mesh axes to search, of dp,tp,pp,cp,ep (default all; ep only for a model with experts)",
    )
    p.add_argument(
        "--strategies",
        default=None,
        help="strategies to search where the script leaves its own 'auto', of ddp,fsdp,hsdp,zero1,zero2,zero3 "
        "(default: all, the ZeRO stages where DeepSpeed is installed)",
    )
    p.add_argument(
        "--remats",
        default=None,
        help="remat values to search where the script leaves its own 'auto': none, selective, full, or POLICY:N "
        "(that policy on every n-th block), e.g. none,full,full:2,selective:3 (default: none,selective:2,selective,"
        "full); ignored, with a note, where the script fixes remat",
    )
    p.add_argument(
        "--memory-gib",
        type=float,
        default=None,
        help="usable memory per device (default: the row's less 2 GiB)",
    )
    p.add_argument(
        "--mixed-precision",
        default=None,
        choices=MIXED_PRECISION,
        help="the mixed precision the job launches with (`accelfn launch --mixed-precision`; default no): every "
        "dry run sets it, and --write keeps it; with --calibrate, the run's (default: its --config's)",
    )
    p.add_argument("--workers", type=int, default=2, help="dry runs at a time (default 2)")
    p.add_argument(
        "--torch-version",
        default=None,
        metavar="VERSION",
        help="the torch the job runs (default: the installed one), e.g. 2.11.0 or 2.6.0.dev20241223: every dry run "
        "times attention as the SDPA kernel it picks (as accelfn dry-run --torch-version)",
    )
    p.add_argument(
        "--calibrate",
        default=None,
        metavar="RUN_DIR",
        help="instead of planning: fit the compute model to a real run's step times (af.Meter's step_time in "
        "RUN_DIR/metrics.jsonl), the run's configuration given by --config; later plans on that device use it",
    )
    p.add_argument(
        "--config", default=None, metavar="FILE", help="with --calibrate: the launch config of the run"
    )
    p.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="the calibrations' file (default ~/.cache/accelfn/calibration.json); 'none': plan uncalibrated",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(func=_run)


def _remats(text: str | None) -> tuple[str, ...] | None:
    """`--remats a,b,...` as `af.plan(remats=...)` takes it: each value checked by the remat knob's parser, the
    error naming the option and the value (None: the default search)."""
    from ..planner.candidates import parse_remats

    if text is None:
        return None
    return parse_remats([v.strip() for v in text.split(",") if v.strip()], source="--remats")


def _torch_version(text: str | None) -> str | None:
    """`--torch-version`, checked as `accelfn dry-run` checks it (ValueError naming the option)."""
    from ..dryrun.attention_speeds import sdpa_backend

    if text is not None:
        try:
            sdpa_backend(text, "")
        except ValueError as e:
            raise ValueError(f"--torch-version: {e}") from None
    return text


def _calibrate(args: argparse.Namespace) -> int:
    from ..planner.calibrate import calibrate

    try:
        cal = calibrate(
            args.calibrate,
            args.script,
            args.script_args,
            config=args.config,
            nproc_per_node=args.nproc_per_node if args.nproc_given else None,
            nnodes=args.nnodes if args.nnodes_given else None,
            gpu=args.gpu,
            device=args.device,
            store=args.calibration,
            torch_version=_torch_version(args.torch_version),
            mixed_precision=args.mixed_precision,
        )
    except ValueError as e:
        print(f"accelfn plan --calibrate: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"accelfn plan --calibrate: {e}", file=sys.stderr)
        return 1
    last = cal.points[-1]
    after = last.compute_s / cal.scale + last.other_s
    print(
        f"calibrated {cal.gpu} from {len(cal.points)} run(s): compute model x {cal.scale:.3f}, residual "
        f"{cal.residual:.1%}\n  {last.run} ({last.label}): measured {last.measured_s * 1e3:,.1f} ms/step, predicted "
        f"{(last.compute_s + last.other_s) * 1e3:,.1f} ms before, {after * 1e3:,.1f} ms after"
    )
    return 0


def _run(args: argparse.Namespace) -> int:
    from ..planner import plan
    from ..planner.calibrate import load

    args.nproc_given, args.nnodes_given = args.nproc_per_node is not None, args.nnodes is not None
    args.nproc_per_node = 8 if args.nproc_per_node is None else args.nproc_per_node
    args.nnodes = 1 if args.nnodes is None else args.nnodes
    if args.calibrate:
        return _calibrate(args)
    if args.top < 1:
        print(f"accelfn plan: --top must be >= 1, got {args.top}", file=sys.stderr)
        return 2
    gpu = args.gpu or ("cpu" if args.device == "cpu" else "h100-sxm")
    try:
        remats = _remats(args.remats)
        torch_version = _torch_version(args.torch_version)
    except ValueError as e:
        print(f"accelfn plan: {e}", file=sys.stderr)
        return 2
    try:
        result = plan(
            args.script,
            args.script_args,
            nproc_per_node=args.nproc_per_node,
            nnodes=args.nnodes,
            gpu=args.gpu,
            device=args.device,
            global_batch_size=args.global_batch_size,
            budget_minutes=args.budget_minutes,
            axes=tuple(a.strip() for a in args.axes.split(",") if a.strip()),
            strategies=tuple(s.strip() for s in args.strategies.split(",") if s.strip())
            if args.strategies
            else None,
            remats=remats,
            workers=args.workers,
            progress=not args.no_progress,
            memory_gib=args.memory_gib,
            calibration=None if args.calibration == "none" else load(gpu, args.calibration),
            torch_version=torch_version,
            mixed_precision=args.mixed_precision or "no",
        )
    except ValueError as e:
        print(f"accelfn plan: {str(e).removeprefix('af.plan: ')}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"accelfn plan: {str(e).removeprefix('af.plan: ')}", file=sys.stderr)
        return 1
    print(result.table(args.top))
    if args.json_path:
        Path(args.json_path).write_text(result.to_json() + "\n")
    if args.png:
        result.plot(args.png)
    if result.best is None:
        return NONE_FITS
    if args.write:
        path = result.write_config(args.write)
        print(
            f"\nwrote {path}: accelfn launch --config {path} {args.script} {' '.join(args.script_args)}".rstrip()
        )
        # the dry run of the written config on the plan's device (and torch: attention's kernel) gives its figures
        flags = f"--gpu {gpu}" + ("" if args.device == "cuda" else f" --device {args.device}")
        if torch_version is not None:
            flags += f" --torch-version {torch_version}"
        print(
            f"  its figures: accelfn dry-run --config {path} {flags} {args.script} {' '.join(args.script_args)}".rstrip()
        )
    return 0
