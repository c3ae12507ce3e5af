"""The default tracker, with no dependency: ``metrics.jsonl`` (one JSON object per line) and ``config.json``.

Example:
    >>> import json, pathlib, tempfile
    >>> run = pathlib.Path(tempfile.mkdtemp())
    >>> t = JSONLTracker(run)
    >>> t.log({"loss": 0.5}, step=1, wall_time=0.0)
    >>> t.close()
    >>> json.loads((run / "metrics.jsonl").read_text())
    {'step': 1, 'time': 0.0, 'loss': 0.5}

NaN and infinities are written as ``NaN``, ``Infinity`` and ``-Infinity``, the tokens Python's ``json``
(``json.dumps``'s default), pandas and jq read back as numbers (docs/trackers.md says why not ``null``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import IO, Any

from .base import TrackerError, to_plain, writing

__all__ = ["JSONLTracker", "truncate_after"]


def truncate_after(path: str | os.PathLike[str], step: int) -> int:
    """Drop the lines of ``path`` whose ``step`` is > ``step`` (and a torn last line), atomically.

    Returns the number of lines kept. Written to a temporary file then ``os.replace``d, so a crash leaves
    either the old file or the new one.

    Example:
        >>> import pathlib, tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "m.jsonl"
        >>> _ = p.write_text('{"step": 1}\\n{"step": 2}\\n{"step": 3')
        >>> truncate_after(p, 1), p.read_text()
        (1, '{"step": 1}\\n')
    """
    path = Path(path)
    if not path.exists():
        return 0
    kept: list[str] = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a crash
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(kept)


def _keep_earlier_run(path: Path) -> Path:
    """A new run (no ``resume_step``) in a folder whose ``metrics.jsonl`` holds an earlier run's lines: move it
    to ``metrics.<n>.jsonl`` (the first free n; its ``config.json`` to ``config.<n>.json``) and say so, so that
    this run's steps start a file of their own (appended, they would follow the earlier run's last step, and a
    plot would draw back to step 1)."""
    import warnings

    n = 1
    while (kept := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    os.replace(path, kept)
    config = path.with_name("config.json")  # that run's config (log_config), before this run's replaces it
    if config.exists() and not (old_config := config.with_name(f"config.{n}.json")).exists():
        os.replace(config, old_config)
    warnings.warn(
        f"accelfn.trackers: {str(path.parent)!r} held an earlier run's {path.name}: kept as {kept.name} (its "
        f"config.json as config.{n}.json), and this run writes a new {path.name} (to continue that run from a "
        "checkpoint of step K, open the trackers with resume_step=K)",
        UserWarning,
        stacklevel=4,
    )
    return kept


class JSONLTracker:
    """Append ``{"step": N, "time": t, **metrics}`` lines to ``<run_dir>/metrics.jsonl``.

    The file is line-buffered: each line reaches the OS as it is written, so a crashed process loses no
    line it logged (a power loss may lose the last ones). ``resume_step=K`` first drops lines with step > K;
    without it, an earlier run's ``metrics.jsonl`` in ``run_dir`` is kept as ``metrics.1.jsonl`` (``.2``, ...)
    and this run starts a new one, with a warning.
    Non-finite values are written as ``NaN``, ``Infinity``, ``-Infinity`` (read back as floats by ``json.loads``).
    """

    name = "jsonl"

    def __init__(self, run_dir: str | os.PathLike[str], *, resume_step: int | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.config_path = Path(run_dir) / "config.json"
        with writing(self.name, self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None:
                truncate_after(self.path, resume_step)
            elif self.path.exists() and self.path.stat().st_size > 0:
                _keep_earlier_run(self.path)
            self._file: IO[str] | None = open(self.path, "a", buffering=1)  # noqa: SIM115 - open until close()

    def log(self, metrics: dict[str, float], step: int, *, wall_time: float | None = None) -> None:
        if self._file is None:
            raise TrackerError(self.name, f"{str(self.path)!r} is closed")
        record = {"step": step, "time": time.time() if wall_time is None else wall_time}
        record.update(metrics)
        self._file.write(json.dumps(record, allow_nan=True) + "\n")

    def log_config(self, config: dict[str, Any]) -> None:
        tmp = self.config_path.with_name(self.config_path.name + ".tmp")
        tmp.write_text(json.dumps(to_plain(config), indent=2) + "\n")
        os.replace(tmp, self.config_path)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
