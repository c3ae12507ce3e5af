"""MLflow tracker: a local SQLite store ``<run_dir>/mlflow.db`` unless ``MLFLOW_TRACKING_URI`` is set.

Needs ``pip install 'accelfn[mlflow]'``. Uses ``MlflowClient`` (no global "active run"). The run id is
kept in ``<run_dir>/mlflow_run_id``: reopening the folder continues the same MLflow run. Browse with
``mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from .base import TrackerError, flatten_config, missing_package

__all__ = ["MLflowTracker"]

_BATCH = 100  # params per log_batch call (MLflow's limit); metrics are limited to 1000


class MLflowTracker:
    """Metrics with ``log_batch`` (one call per flush); the config as flattened params.

    MLflow appends metric history: after a resume from step K, steps K+1.. that a crashed attempt logged
    appear twice (once per attempt). Params cannot change within a run: on resume, keys already recorded
    keep their first value.
    """

    name = "mlflow"

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        run_name: str | None = None,
        resume_step: int | None = None,
    ) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise missing_package(self.name, "mlflow", "mlflow", e) from e
        run_dir = Path(run_dir).resolve()
        id_file = run_dir / "mlflow_run_id"
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir / 'mlflow.db'}"
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            client = MlflowClient(tracking_uri=uri)
            if id_file.exists():
                run_id = id_file.read_text().strip()
                client.update_run(run_id, status="RUNNING")
            else:
                exp_name = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "accelfn"
                exp = client.get_experiment_by_name(exp_name)
                exp_id = (
                    exp.experiment_id
                    if exp is not None
                    else client.create_experiment(
                        exp_name, artifact_location=(run_dir / "mlartifacts").as_uri()
                    )
                )
                run_id = client.create_run(exp_id, run_name=run_name or run_dir.name).info.run_id
                id_file.write_text(run_id + "\n")
        except OSError as e:
            raise TrackerError(self.name, f"cannot write {str(run_dir)!r}: {e}") from e
        except Exception as e:
            raise TrackerError(self.name, f"cannot open a run at {uri!r}: {type(e).__name__}: {e}") from e
        self.client, self.run_id, self.tracking_uri = client, run_id, uri
        self._pending: list[Any] = []

    def log(self, metrics: dict[str, float], step: int, *, wall_time: float | None = None) -> None:
        from mlflow.entities import Metric

        ms = int(1000 * (time.time() if wall_time is None else wall_time))
        self._pending.extend(Metric(k, float(v), ms, step) for k, v in metrics.items())
        if len(self._pending) >= 1000:
            self.flush()

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), 1000):
            self.client.log_batch(self.run_id, metrics=pending[i : i + 1000])

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        known = self.client.get_run(self.run_id).data.params
        params = [Param(k, str(v)) for k, v in flatten_config(config).items() if k not in known]
        for i in range(0, len(params), _BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + _BATCH])

    def close(self) -> None:
        self.flush()
        self.client.set_terminated(self.run_id)
