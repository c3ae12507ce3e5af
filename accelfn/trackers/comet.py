"""Comet tracker (``comet_ml``); offline (a zip under ``<run_dir>/comet``) unless an API key is configured.

Needs ``pip install 'accelfn[comet_ml]'``. The mode is ``online=`` when given, else Comet's own
``COMET_START_ONLINE`` when set, else online with an API key (``COMET_API_KEY`` or ``comet login``'s config
file) and offline without one, so a run never stops to ask for a key (upload an offline run later with
``comet upload <run_dir>/comet/*.zip``). The experiment key is kept in ``<run_dir>/comet_experiment_key``:
reopening the folder continues the same Comet experiment.

Comet's framework auto-logging (it patches torch to log losses itself) is turned off unless
``COMET_DISABLE_AUTO_LOGGING`` is set: accelfn logs the metrics. Offline, Comet's environment details
(hostname, IP, packages, CPU/GPU) are not collected unless ``log_env_details=True``: they resolve Comet's
server address.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from .base import TrackerError, missing_package, to_plain, writing

__all__ = ["CometTracker"]


class CometTracker:
    """``comet_ml.start(project_name=..., experiment_key=<stored key>)``; ``log_metrics(metrics, step=step)``.

    As Accelerate's ``CometMLTracker``: the config as (nested) parameters with ``log_parameters``. Other
    keywords go to ``comet_ml.ExperimentConfig`` (e.g. ``log_code=False``, ``auto_output_logging=False``).
    """

    name = "comet_ml"

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        project: str | None = None,
        workspace: str | None = None,
        name: str | None = None,
        online: bool | None = None,
        resume_step: int | None = None,
        **experiment_config: Any,
    ) -> None:
        # read by comet_ml when first imported: no patching of torch (accelfn logs the metrics itself)
        os.environ.setdefault("COMET_DISABLE_AUTO_LOGGING", "1")
        try:
            import comet_ml
        except ImportError as e:
            raise missing_package(self.name, "comet_ml", "comet_ml", e) from e
        run_dir = Path(run_dir)
        key_file = run_dir / "comet_experiment_key"
        offline_dir = run_dir / "comet"
        with writing(self.name, run_dir):
            offline_dir.mkdir(parents=True, exist_ok=True)
            if key_file.exists():
                key = key_file.read_text().strip()
            else:
                key = secrets.token_hex(16)  # Comet keys: 32 to 50 alphanumeric characters
                key_file.write_text(key + "\n")
        if online is None and not os.environ.get("COMET_START_ONLINE"):
            online = _has_api_key()
        if online is False:  # Comet's environment details look up its server's address: not offline
            experiment_config.setdefault("log_env_details", False)
        experiment_config.setdefault("name", run_dir.resolve().name)
        experiment_config.setdefault("offline_directory", str(offline_dir))
        try:
            self._experiment = comet_ml.start(
                project_name=project or os.environ.get("COMET_PROJECT_NAME") or "accelfn",
                workspace=workspace,
                experiment_key=key,
                online=online,
                experiment_config=comet_ml.ExperimentConfig(**experiment_config),
            )
        except Exception as e:
            mode = {True: "online", False: "offline", None: "$COMET_START_ONLINE"}[online]
            raise TrackerError(self.name, f"comet_ml.start failed ({mode}): {type(e).__name__}: {e}") from e
        self.experiment_key = key
        self.online = not isinstance(self._experiment, comet_ml.OfflineExperiment)
        self.offline_directory = None if self.online else offline_dir

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._experiment.log_metrics(metrics, step=step)

    def log_config(self, config: dict[str, Any]) -> None:
        self._experiment.log_parameters(to_plain(config))

    def close(self) -> None:
        self._experiment.end()


def _has_api_key() -> bool:
    """Whether Comet finds an API key (``COMET_API_KEY``, or its config file written by ``comet login``)."""
    try:
        from comet_ml import config

        return bool(config.get_api_key(None, config.get_config()))
    except Exception:  # an older or newer comet_ml: its environment variable only
        return bool(os.environ.get("COMET_API_KEY"))
