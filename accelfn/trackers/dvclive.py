"""DVCLive tracker: DVCLive's files in ``<run_dir>/dvclive`` (``metrics.json``, ``plots/metrics/*.tsv``,
``params.yaml``) and ``<run_dir>/dvc.yaml``.

Needs ``pip install 'accelfn[dvclive]'``. DVCLive works on files, with no server; inside a Git repository it
also does what it always does — initialises DVC there (``dvc init``) and saves a DVC experiment at close
(``options={"dvclive": {"save_dvc_exp": False}}`` keeps the experiment out). Its ``dvc.yaml`` is written next
to the run's folder, not in the working directory. Show the plots with ``dvc plots show`` (in a DVC repository)
or read the ``.tsv`` files with any TSV reader.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .base import TrackerError, missing_package, to_plain, writing

__all__ = ["DVCLiveTracker"]


class DVCLiveTracker:
    """``dvclive.Live(dir)``; per line ``live.step = step``, ``log_metric`` per value, ``next_step()``.

    As Accelerate's ``DVCLiveTracker``: the config with ``log_params``. On resume from step K, DVCLive
    continues its files (``resume=True``) and the rows after K that a crashed attempt wrote are dropped
    from the ``.tsv`` histories first. Other keywords go to ``dvclive.Live``.
    """

    name = "dvclive"

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        dir: str | os.PathLike[str] | None = None,
        resume_step: int | None = None,
        **live_kwargs: Any,
    ) -> None:
        try:
            from dvclive import Live
        except ImportError as e:
            raise missing_package(self.name, "dvclive", "dvclive", e) from e
        self.dir = Path(dir) if dir is not None else Path(run_dir) / "dvclive"
        resume = resume_step is not None and (self.dir / "metrics.json").exists()
        with writing(self.name, self.dir):
            self.dir.mkdir(parents=True, exist_ok=True)
            if resume:
                assert resume_step is not None
                for tsv in (self.dir / "plots" / "metrics").rglob("*.tsv"):
                    _truncate_tsv(tsv, resume_step)
        # next to the folder, not in it (inside, DVCLive 3 repeats its entries at each step)
        live_kwargs.setdefault("dvcyaml", str(self.dir.parent / "dvc.yaml"))
        try:
            self._live = Live(dir=str(self.dir), resume=resume, **live_kwargs)
        except Exception as e:
            raise TrackerError(
                self.name, f"dvclive.Live failed in {str(self.dir)!r}: {type(e).__name__}: {e}"
            ) from e

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._live.step = step
        for key, value in metrics.items():
            self._live.log_metric(key, value)
        self._live.next_step()

    def log_config(self, config: dict[str, Any]) -> None:
        self._live.log_params(to_plain(config))

    def close(self) -> None:
        self._live.end()


def _truncate_tsv(path: Path, step: int) -> None:
    """Keep the header and the rows of a DVCLive ``.tsv`` history whose ``step`` column is <= ``step``."""
    lines = path.read_text().splitlines(keepends=True)
    if not lines:
        return
    header = lines[0].rstrip("\n").split("\t")
    if "step" not in header:
        return
    column = header.index("step")
    kept = [lines[0]]
    for line in lines[1:]:
        fields = line.rstrip("\n").split("\t")
        try:
            if int(fields[column]) <= step:
                kept.append(line)
        except (IndexError, ValueError):
            continue  # a row torn by a crash
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
