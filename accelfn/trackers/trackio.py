"""Trackio tracker: Hugging Face's local-first tracker (a SQLite file per project in ``TRACKIO_DIR``).

Needs ``pip install 'accelfn[trackio]'``. Trackio keeps its data where ``TRACKIO_DIR`` points (default
``$HF_HOME/trackio``), read when trackio is first imported; view it with ``trackio show --project accelfn``.
The run is named after the run folder and resumed by that name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .base import TrackerError, missing_package, to_plain

__all__ = ["TrackioTracker"]


class TrackioTracker:
    """``trackio.init(project, name=<run folder name>, resume="allow")``; ``run.log(metrics, step=step)``."""

    name = "trackio"

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        project: str | None = None,
        name: str | None = None,
        resume_step: int | None = None,
        **init_kwargs: Any,
    ) -> None:
        try:
            import trackio
        except ImportError as e:
            raise missing_package(self.name, "trackio", "trackio", e) from e
        try:
            self._run = trackio.init(
                project=project or os.environ.get("TRACKIO_PROJECT") or "accelfn",
                name=name or Path(run_dir).resolve().name,
                resume="allow",
                embed=False,
                auto_log_cpu=False,
                auto_log_gpu=False,
                **init_kwargs,
            )
        except Exception as e:
            raise TrackerError(self.name, f"trackio.init failed: {type(e).__name__}: {e}") from e

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def log_config(self, config: dict[str, Any]) -> None:
        # trackio stores the run's config with the first metrics logged after this
        self._run.config.update(to_plain(config))

    def close(self) -> None:
        self._run.finish()
