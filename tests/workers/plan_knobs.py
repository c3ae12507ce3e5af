"""The planner's knobs as the plan_* worker scripts read them (tests/workers/plan_worker.py, plan_alternating.py,
plan_architectures.py): each a flag that defaults to "auto", so the launch configuration (`accelfn plan --write`)
decides unless the flag fixes it, and the transforms they choose applied to a train step in the one order.

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser()
    >>> add_flags(p)
    >>> p.parse_args([]).strategy
    'auto'
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import accelfn as af
from accelfn.launch_env import knob, remat_args

FLAGS = ("strategy", "remat", "accumulate", "global-batch-size", "offload", "compile")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """`--strategy`, `--remat`, `--accumulate`, `--global-batch-size`, `--offload`, `--compile`, each "auto"."""
    for name in FLAGS:
        parser.add_argument(f"--{name}", default="auto")


@dataclass(frozen=True)
class Knobs:
    strategy: str
    remat: str
    accumulate: int
    global_batch: int
    offload: str
    compiled: str


def read(args: argparse.Namespace, *, strategy: str, global_batch: int) -> Knobs:
    """The knobs: a flag's value, else (flag "auto") the launch configuration's, else the default (`strategy`,
    `global_batch`; no remat, accumulation 1, no offload, eager)."""
    return Knobs(
        strategy=knob("strategy", args.strategy, strategy),
        remat=knob("remat", args.remat, "none"),
        accumulate=int(knob("accumulate", args.accumulate, 1)),
        global_batch=int(knob("global_batch_size", args.global_batch_size, global_batch)),
        offload=knob("offload", args.offload, "none"),
        compiled=knob("compile", args.compile, "none"),
    )


def apply(step: Any, knobs: Knobs, mesh: af.Mesh, *, pipeline: Any = None) -> Any:
    """`step` under the knobs' transforms: remat, accumulate, offload, then `pipeline(step)` if given (a
    pipeline-parallel mesh), shard, compile."""
    if knobs.remat != "none":
        step = af.remat(step, **remat_args(knobs.remat))
    if knobs.accumulate > 1:
        step = af.accumulate(step, knobs.accumulate)
    if knobs.offload == "optimizer":
        step = af.offload(step)
    if pipeline is not None:
        step = pipeline(step)
    step = af.shard(step, mesh, strategy=knobs.strategy)
    if knobs.compiled != "none":
        step = af.compile(step, regions="blocks" if knobs.compiled == "blocks" else None)
    return step
