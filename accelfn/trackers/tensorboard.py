"""TensorBoard tracker: torch's ``SummaryWriter`` writing event files to ``<run_dir>/tensorboard``.

Needs ``pip install 'accelfn[tensorboard]'``. On resume from step K the writer is opened with
``purge_step=K+1``, so TensorBoard discards the events a crashed attempt wrote after the checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .base import flatten_config, missing_package, to_plain, writing

__all__ = ["TensorBoardTracker"]


class TensorBoardTracker:
    """Scalars with ``add_scalar``; the config as hparams (flattened scalars) and as JSON text."""

    name = "tensorboard"

    def __init__(
        self, run_dir: str | os.PathLike[str], *, resume_step: int | None = None, subdir: str = "tensorboard"
    ) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise missing_package(self.name, "tensorboard", "tensorboard", e) from e
        self.log_dir = Path(run_dir) / subdir
        with writing(self.name, self.log_dir):
            self.log_dir.mkdir(parents=True, exist_ok=True)
            purge = None if resume_step is None else resume_step + 1
            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge)

    def log(self, metrics: dict[str, float], step: int, *, wall_time: float | None = None) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step, walltime=wall_time)

    def log_config(self, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        # Written into this run's own event file (SummaryWriter.add_hparams would start another run).
        file_writer = self._writer._get_file_writer()
        for summary in hparams(flatten_config(config), {}):
            file_writer.add_summary(summary)
        self._writer.add_text("config", "```json\n" + json.dumps(to_plain(config), indent=2) + "\n```")

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
