"""Aim tracker: a local Aim repository, ``<run_dir>/.aim`` by default (no server).

Needs ``pip install 'accelfn[aim]'`` (Aim 3; Aim 4 is another API). Browse with ``aim up --repo <run_dir>``,
or give several runs one repository with ``options={"aim": {"repo": "runs"}}``. The run hash is kept in
``<run_dir>/aim_run_hash``: reopening the folder continues the same Aim run.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Any

from .base import TrackerError, missing_package, to_plain, writing

__all__ = ["AimTracker"]


class AimTracker:
    """``aim.Run(repo=..., experiment=...)``; ``run.track(metrics, step=step)``; the config as ``run["hparams"]``.

    As Accelerate's ``AimTracker`` (its ``logging_dir`` is the repository). Aim keeps one value per step of
    a sequence: after a resume from step K the steps K+1.. are overwritten by the new values. Other
    keywords go to ``aim.Run`` (e.g. ``system_tracking_interval=None``, ``capture_terminal_logs=False``).
    """

    name = "aim"

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        repo: str | os.PathLike[str] | None = None,
        experiment: str | None = None,
        name: str | None = None,
        resume_step: int | None = None,
        **run_kwargs: Any,
    ) -> None:
        try:
            from aim import Run
        except ImportError as e:
            raise missing_package(self.name, "aim", "aim", e) from e
        version = importlib.metadata.version("aim")
        if int(version.split(".")[0]) >= 4:
            raise TrackerError(self.name, f"needs Aim 3 (aim<4), found aim {version}: pip install 'aim<4'")
        run_dir = Path(run_dir)
        self.repo = Path(repo) if repo is not None else run_dir
        hash_file = run_dir / "aim_run_hash"
        with writing(self.name, self.repo):
            self.repo.mkdir(parents=True, exist_ok=True)
            run_hash = hash_file.read_text().strip() if hash_file.exists() else None
        try:
            self._run = Run(
                run_hash=run_hash,
                repo=str(self.repo),
                experiment=experiment or "accelfn",
                **run_kwargs,
            )
            if run_hash is None:
                self._run.name = name or run_dir.resolve().name
                hash_file.write_text(self._run.hash + "\n")
        except OSError as e:
            raise TrackerError(self.name, f"cannot write {str(self.repo)!r}: {e}") from e
        except Exception as e:
            raise TrackerError(
                self.name, f"aim.Run failed in {str(self.repo)!r}: {type(e).__name__}: {e}"
            ) from e
        self.run_hash: str = self._run.hash

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.track(metrics, step=step)

    def log_config(self, config: dict[str, Any]) -> None:
        self._run["hparams"] = to_plain(config)

    def close(self) -> None:
        self._run.close()
