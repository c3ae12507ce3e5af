"""The published runs of accelfn/dryrun/published_runs.json and their dry runs, each row dry-run once per test
session: tests/test_published_runs.py reads its predicted time, tests/test_torchtitan_configs.py its peak (the
same 8B dry runs at 8 and 128 ranks, 10-25 s each on 2 cores, were run once per file)."""

from __future__ import annotations

import functools
import json
import shlex
from pathlib import Path
from typing import Any

import attrs

import accelfn as af
from accelfn.dryrun import Assumptions
from accelfn.dryrun.timing import TimingAssumptions

ROOT = Path(__file__).resolve().parents[1]
ROWS: dict[str, dict[str, Any]] = {
    r["id"]: r
    for r in json.loads((Path(af.__file__).parent / "dryrun" / "published_runs.json").read_text())["rows"]
}


def dry_run_kwargs(command: str) -> tuple[str, list[str], dict[str, Any]]:
    """(script, script args, af.dry_run's keyword arguments) of an `accelfn dry-run ...` command line.

    Example:
        >>> dry_run_kwargs("accelfn dry-run --nproc-per-node 8 --gpu h100-96gb examples/train_llama.py --model 8b")
        ('examples/train_llama.py', ['--model', '8b'], {'nproc_per_node': 8, 'gpu': 'h100-96gb'})
    """
    words = shlex.split(command)
    if words[:2] != ["accelfn", "dry-run"]:
        raise ValueError(f"not an accelfn dry-run command: {command!r}")
    at = next(i for i, w in enumerate(words) if w.endswith(".py"))
    opts = words[2:at]
    kwargs: dict[str, Any] = {}
    for key, value in zip(opts[::2], opts[1::2], strict=True):
        if key == "--torch-version":  # the torch the run declares: what the CLI makes of it
            kwargs["assumptions"] = Assumptions(timing=TimingAssumptions(torch_version=value))
            continue
        kwargs[key.lstrip("-").replace("-", "_")] = int(value) if value.isdigit() else value
    return words[at], words[at + 1 :], kwargs


@attrs.frozen
class Outcome:
    """What the tests read of a row's dry run (the report itself holds the step's whole timeline)."""

    world_size: int
    fits: bool
    peak_bytes: int
    tokens_per_s_per_gpu: float
    reserved_bytes: int  # the simulated caching allocator's peak reserved memory


@functools.cache
def outcome(row_id: str) -> Outcome:
    """The dry run of row `row_id`'s own command (on the modelled GPU, no micro-batch search), once a session."""
    script, args, kwargs = dry_run_kwargs(ROWS[row_id]["command"])
    report = af.dry_run(str(ROOT / script), args=args, search=False, **kwargs)
    assert report.predicted is not None and report.predicted.tokens_per_s is not None
    return Outcome(
        world_size=report.world_size,
        fits=bool(report.fits),
        peak_bytes=int(report.per_rank["peak"]),
        tokens_per_s_per_gpu=report.predicted.tokens_per_s / report.world_size,
        reserved_bytes=int(report.per_rank["reserved"]),
    )
