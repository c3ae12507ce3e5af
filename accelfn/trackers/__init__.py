"""Experiment trackers: log metrics to JSONL (default), TensorBoard, W&B, MLflow, Trackio, Comet, Aim,
ClearML, DVCLive or SwanLab (``"all"``: every one installed), or your own.

`open` returns a `Run`; ``run.log(metrics, step)`` takes the step's metrics as they come (tensors are
read in one go every ``log_every`` calls, not once per step). Only the main process writes.

Example:
    >>> import json, pathlib, tempfile, torch
    >>> run_dir = pathlib.Path(tempfile.mkdtemp())
    >>> with open(run_dir, config={"lr": 1e-3}) as run:
    ...     for step in range(1, 4):
    ...         run.log({"loss": torch.tensor(1.0 / step)}, step=step)
    >>> [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    [1, 2, 3]
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import dry_mode
from ..launch_env import ACCELFN_LOG_WITH as LOG_WITH_ENV
from ..launch_env import parse_log_with as parse_names
from .base import Tracker, TrackerError, flatten_config, to_plain
from .run import Run

if TYPE_CHECKING:
    from ..mesh import Mesh

__all__ = ["open", "Run", "Tracker", "TrackerError", "flatten_config", "to_plain", "BACKENDS", "LOG_WITH_ENV"]

# name -> (module, class, the package it needs or None); the extra that installs it has the backend's name
BACKENDS: dict[str, tuple[str, str, str | None]] = {
    "jsonl": ("accelfn.trackers.jsonl", "JSONLTracker", None),
    "tensorboard": ("accelfn.trackers.tensorboard", "TensorBoardTracker", "tensorboard"),
    "wandb": ("accelfn.trackers.wandb", "WandbTracker", "wandb"),
    "mlflow": ("accelfn.trackers.mlflow", "MLflowTracker", "mlflow"),
    "trackio": ("accelfn.trackers.trackio", "TrackioTracker", "trackio"),
    "comet_ml": ("accelfn.trackers.comet", "CometTracker", "comet_ml"),
    "aim": ("accelfn.trackers.aim", "AimTracker", "aim"),
    "clearml": ("accelfn.trackers.clearml", "ClearMLTracker", "clearml"),
    "dvclive": ("accelfn.trackers.dvclive", "DVCLiveTracker", "dvclive"),
    "swanlab": ("accelfn.trackers.swanlab", "SwanLabTracker", "swanlab"),
}
ALL = "all"  # every backend whose package is installed (Accelerate's log_with="all"), jsonl included


def parse_log_with(spec: str | Tracker | Sequence[str | Tracker], *, source: str = "log_with") -> list[Any]:
    """Backend names (a comma list; ``"auto"``: ``$ACCELFN_LOG_WITH`` else jsonl; ``"all"``: every installed
    backend; ``"none"``) and tracker objects, in order, without repeats.

    ``"all"`` is what Accelerate's ``log_with="all"`` picks — every tracker whose package can be imported here
    (Aim only below 4.0, as in Accelerate) — plus ``jsonl``; it can be combined with tracker objects.

    Example:
        >>> parse_log_with("tensorboard, jsonl")
        ['tensorboard', 'jsonl']
        >>> parse_log_with("all")[0]
        'jsonl'
    """
    if isinstance(spec, str):
        if spec.strip().lower() == "auto":
            env = os.environ.get(LOG_WITH_ENV, "").strip()
            return parse_log_with(list(parse_names(env, source=LOG_WITH_ENV)) if env else ["jsonl"])
        items: list[Any] = [
            p for name in parse_names(spec, source=source) for p in (_available() if name == ALL else [name])
        ]
    elif isinstance(spec, Sequence):
        items = [p for s in spec for p in (parse_log_with(s, source=source) if isinstance(s, str) else [s])]
    else:
        items = [spec]
    seen: list[Any] = []
    for item in items:
        if not any(item is s or (isinstance(item, str) and item == s) for s in seen):
            seen.append(item)
    return seen


def _available() -> list[str]:
    """The backends whose package is installed, in `BACKENDS` order: what ``"all"`` opens."""
    return [name for name, (_, _, package) in BACKENDS.items() if _installed(package) and _supported(name)]


def _installed(package: str | None) -> bool:
    if package is None:
        return True
    if package in sys.modules:
        return sys.modules[package] is not None
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _supported(name: str) -> bool:
    """Accelerate's ``is_aim_available``: Aim 4 is another API, left out of ``"all"``."""
    if name != "aim":
        return True
    try:
        return int(importlib.metadata.version("aim").split(".")[0]) < 4
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return True


def _is_main(mesh: Mesh | None) -> bool:
    if mesh is not None:
        return bool(mesh.is_main)
    return os.environ.get("RANK") in (None, "", "0")


def open(
    run_dir: str | os.PathLike[str],
    log_with: str | Tracker | Sequence[str | Tracker] = ("jsonl",),
    config: Any = None,
    *,
    mesh: Mesh | None = None,
    resume_step: int | None = None,
    log_every: int = 10,
    main_only: bool = True,
    on_error: str = "raise",
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> Run:
    """Open the trackers of one training run in ``run_dir`` and log ``config``; returns a `Run`.

    ``log_with``: backend names (``"jsonl"``, ``"tensorboard"``, ``"wandb"``, ``"mlflow"``, ``"trackio"``,
    ``"comet_ml"``, ``"aim"``, ``"clearml"``, ``"dvclive"``, ``"swanlab"``, a comma list, ``"auto"`` for
    ``$ACCELFN_LOG_WITH`` else jsonl, ``"all"`` for every installed one) and/or objects with the `Tracker`
    methods. ``resume_step=K``: the run continues from a checkpoint of step K (JSONL drops lines after K,
    TensorBoard purges events after K, DVCLive drops rows after K, W&B, MLflow, Aim and Comet continue the
    run whose id is stored in ``run_dir``).
    Only the main process (``mesh.is_main``, else ``$RANK`` unset or 0) writes; with ``main_only=False``
    every rank writes to ``run_dir/rank<R>``. ``options``: keyword arguments per backend, e.g.
    ``{"wandb": {"project": "lm"}}``. Errors opening a backend (package missing, folder unwritable)
    raise one `TrackerError` naming it, before anything is logged.

    Example:
        >>> import tempfile
        >>> run = open(tempfile.mkdtemp(), "jsonl", log_every=1)
        >>> run.log({"loss": 0.5}, step=1); run.close()
    """
    names = parse_log_with(log_with)
    options = dict(options or {})
    unknown = [k for k in options if k not in BACKENDS]
    if unknown:
        raise ValueError(f"options: unknown tracker(s) {unknown}; known: {', '.join(BACKENDS)}")
    if resume_step is not None and (isinstance(resume_step, bool) or not isinstance(resume_step, int)):
        raise TypeError(f"resume_step must be an int (the checkpoint's step) or None, got {resume_step!r}")
    is_main = _is_main(mesh)
    if dry_mode.skip(f"af.trackers.open({str(run_dir)!r}): no tracker writes"):
        return Run([], log_every=log_every, active=False, on_error=on_error)
    if not (is_main or not main_only):
        return Run([], log_every=log_every, active=False, on_error=on_error)
    run_path = Path(run_dir)
    if not main_only:
        rank = mesh.rank if mesh is not None else int(os.environ.get("RANK") or 0)
        run_path = run_path / f"rank{rank}"

    wanted = [n for n in names if isinstance(n, str)]
    missing = [n for n in wanted if not _installed(BACKENDS[n][2])]
    if missing:
        raise TrackerError(
            ", ".join(missing),
            f"not installed (no module {', '.join(repr(BACKENDS[n][2]) for n in missing)}); install with "
            f"pip install 'accelfn[{','.join(missing)}]'",
        )
    trackers: list[Any] = []
    try:
        for item in names:
            if not isinstance(item, str):
                trackers.append(item)
                continue
            module, cls_name, _ = BACKENDS[item]
            cls = getattr(importlib.import_module(module), cls_name)
            try:
                trackers.append(cls(run_path, resume_step=resume_step, **options.get(item, {})))
            except TrackerError:
                raise
            except Exception as e:
                raise TrackerError(
                    item, f"could not open in {str(run_path)!r}: {type(e).__name__}: {e}"
                ) from e
        run = Run(trackers, log_every=log_every, active=True, on_error=on_error)
    except BaseException:
        for t in reversed(trackers):
            with contextlib.suppress(Exception):  # the error opening is the one to report
                t.close()
        raise
    if config is not None:
        try:
            run.log_config(config)
        except TrackerError:
            run.close()
            raise
    return run


def __getattr__(name: str) -> Any:
    """The backend classes, imported on first use (``accelfn.trackers.TensorBoardTracker``)."""
    for module, cls_name, _ in BACKENDS.values():
        if cls_name == name:
            return getattr(importlib.import_module(module), cls_name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
