"""``accelfn plot``: loss, learning rate, tokens/s and memory of one or more runs against the step, as a PNG.

Reads each run folder's ``metrics.jsonl`` (one JSON object per line, ``{"step": N, "time": t, ...}``, as
``af.trackers`` writes it); several runs are overlaid, labelled with their folder names. Needs matplotlib
(``pip install 'accelfn[plot]'``).

Example:
    $ accelfn plot runs/bf16 runs/fp8 -o compare.png --metrics loss,tokens_per_s
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["PlotError", "read_metrics", "plot_runs", "add_parser", "DEFAULT_METRICS"]

DEFAULT_METRICS = ("loss", "lr", "tokens_per_s", "memory")
# A panel name -> (the keys it draws, in order, with a line style each; a divisor for the values; the axis label)
PANELS: dict[str, tuple[tuple[tuple[str, str], ...], float, str]] = {
    "loss": ((("loss", "-"),), 1.0, "loss"),
    "lr": ((("lr", "-"),), 1.0, "learning rate"),
    "tokens_per_s": ((("tokens_per_s", "-"),), 1.0, "tokens/s"),
    "memory": ((("memory_peak", "-"), ("memory_reserved", ":"), ("host_rss", "--")), 2.0**30, "memory (GiB)"),
}


class PlotError(ValueError):
    """A run folder that cannot be plotted (the message names it)."""


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of `run_dir/metrics.jsonl` (or of that file itself), in order; a truncated last line
    (a run still writing, or killed mid-write) is skipped. A file holding several runs appended one after another
    (the step goes back to the first one or below) gives the last run's records, with a warning; a resumed run that
    logged again from its checkpoint's step replaces the records from that step on.

    Example:
        >>> import json, tempfile
        >>> from pathlib import Path
        >>> from accelfn.cli.plot import read_metrics
        >>> run = Path(tempfile.mkdtemp())
        >>> _ = (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.5}) + '\\n{"step": 2, "lo')
        >>> read_metrics(run)
        [{'step': 1, 'loss': 2.5}]
    """
    path = Path(run_dir)
    file = path if path.is_file() else path / "metrics.jsonl"
    if not path.exists():
        raise PlotError(f"{run_dir}: no such run folder")
    if not file.is_file():
        raise PlotError(
            f"{run_dir}: no metrics.jsonl in this folder (is it a run folder written by af.trackers?)"
        )
    lines = file.read_text(encoding="utf-8", errors="replace").splitlines()
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):
                break  # the last line was being written
            raise PlotError(f"{file}:{number}: not a JSON object ({e.msg})") from None
        if isinstance(record, dict) and _number(record.get("step")) is not None:
            records.append(record)
    if not records:
        raise PlotError(f"{file}: no records with a 'step'")
    # the step going back: to the first step or below, a new run appended to the file (before the JSONL tracker
    # kept an earlier run's file apart): the last run is drawn; above it, a resumed run that logged again from
    # its checkpoint's step: it replaces the lines from that step on, as `trackers.jsonl.truncate_after` does
    numbered = [(_number(r["step"]) or 0.0, r) for r in records]
    first, runs, went_back = numbered[0][0], 1, ""
    kept: list[tuple[float, dict[str, Any]]] = []
    for step, record in numbered:
        if kept and step < kept[-1][0]:
            if step <= first:
                runs, went_back = runs + 1, f"{kept[-1][0]:g} to {step:g}"
                kept = []
            else:
                kept = [(s, r) for s, r in kept if s < step]
        kept.append((step, record))
    if runs > 1:
        import warnings

        warnings.warn(
            f"accelfn plot: {file} holds {runs} runs (the step goes back from {went_back}): drawing the last one",
            UserWarning,
            stacklevel=2,
        )
    return [record for _, record in kept]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _labels(runs: Sequence[Path]) -> list[str]:
    """Folder names; the parent is added where two runs share a name."""
    names = [(p if p.is_dir() else p.parent).resolve().name for p in runs]
    return [
        f"{(p if p.is_dir() else p.parent).resolve().parent.name}/{n}" if names.count(n) > 1 else n
        for p, n in zip(runs, names)
    ]


def plot_runs(
    run_dirs: Sequence[str | Path], out: str | Path | None = None, metrics: Sequence[str] = DEFAULT_METRICS
) -> Path:
    """Draw `metrics` of every run against the step into the PNG `out` (default: `RUN_DIR/plot.png` for one
    run, `./plot.png` for several); returns its path. `memory` draws `memory_peak`, `memory_reserved` and
    `host_rss` in GiB; any other name is read as a key of the records.

    Example:
        >>> import json, tempfile
        >>> from pathlib import Path
        >>> from accelfn.cli.plot import plot_runs
        >>> run = Path(tempfile.mkdtemp())
        >>> _ = (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": 1 / i}) + "\\n" for i in range(1, 9)))
        >>> plot_runs([run], metrics=["loss"]).name  # doctest: +SKIP
        'plot.png'
    """
    if not run_dirs:
        raise PlotError("accelfn plot: give at least one run folder")
    if not metrics:
        raise PlotError("accelfn plot: give at least one metric")
    runs = [Path(r) for r in run_dirs]
    data = [read_metrics(r) for r in runs]  # every folder is checked before anything is drawn
    Figure = _matplotlib_figure()
    if out is None:
        out = (
            (runs[0] if runs[0].is_dir() else runs[0].parent) / "plot.png"
            if len(runs) == 1
            else Path("plot.png")
        )
    out = Path(out)

    columns = 1 if len(metrics) == 1 else 2
    rows = math.ceil(len(metrics) / columns)
    figure = Figure(figsize=(6.4 * columns, 3.6 * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for ax, metric in zip(axes, metrics):
        keys, scale, ylabel = PANELS.get(metric, (((metric, "-"),), 1.0, metric))
        drawn = False
        for records, label, color in zip(data, _labels(runs), colors):
            for key, style in keys:
                points = [(_number(r["step"]), _number(r.get(key))) for r in records]
                xs = [x for x, y in points if x is not None and y is not None]
                ys = [y / scale for x, y in points if x is not None and y is not None]
                if not xs:
                    continue
                name = label if len(keys) == 1 else f"{label} {key}"
                ax.plot(
                    xs,
                    ys,
                    style,
                    color=color,
                    label=name,
                    linewidth=1.4,
                    marker="." if len(xs) < 30 else None,
                )
                drawn = True
        ax.set_title(ylabel)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend(fontsize="small")
        else:
            ax.text(
                0.5, 0.5, f"no '{metric}' in these runs", ha="center", va="center", transform=ax.transAxes
            )
    for ax in axes[len(metrics) :]:
        ax.set_visible(False)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    return out


def _matplotlib_figure() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError("accelfn plot needs matplotlib: pip install 'accelfn[plot]'") from None
    return Figure


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plot",
        help="draw loss, lr, tokens/s and memory of runs (their metrics.jsonl) as a PNG",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs", metavar="RUN_DIR", nargs="+", help="run folders holding metrics.jsonl")
    p.add_argument(
        "-o", "--output", default=None, help="the PNG to write (default: RUN_DIR/plot.png, or ./plot.png)"
    )
    p.add_argument(
        "--metrics", default=",".join(DEFAULT_METRICS),
        help=f"comma-separated panels (default: {','.join(DEFAULT_METRICS)}); any key of the records works",
    )  # fmt: skip
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    try:
        out = plot_runs(args.runs, args.output, metrics)
    except PlotError as e:
        print(f"accelfn plot: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
