"""ClearML tracker: a ClearML task, offline (a session folder, copied to ``<run_dir>/clearml``) without a server.

Needs ``pip install 'accelfn[clearml]'``. The mode is ``offline=`` when given, else ``CLEARML_OFFLINE_MODE``
when set, else online when ClearML has credentials (``CLEARML_API_ACCESS_KEY`` or ``clearml-init``'s
``clearml.conf``) and offline without, so a run never stops on a missing configuration. An offline session
is stored by ClearML under its cache folder and its zip copied to ``<run_dir>/clearml/`` at close; upload it
later with ``Task.import_offline_session("<run_dir>/clearml/<task id>.zip")``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

from .base import TrackerError, missing_package, to_plain, writing

__all__ = ["ClearMLTracker"]


class ClearMLTracker:
    """``Task.init(project_name, task_name)``; ``report_scalar`` per metric; the config with
    ``connect_configuration``.

    As Accelerate's ``ClearMLTracker``: a task already started by ``Task.init`` in this process is used (and
    left open); a metric named ``eval_*``/``test_*``/``train_*`` (or ``eval/...``) is the series
    ``eval``/``test``/``train`` of the plot named by the rest, any other the series ``train``. ClearML
    reports NaN as 0 (``Logger.set_reporting_nan_value``). Other keywords go to ``Task.init``; by default
    ClearML's TensorBoard binding is off (it would log the ``tensorboard`` tracker's scalars a second time)
    and, offline, so is its repository scan (it contacts ClearML's update server).
    """

    name = "clearml"

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        project: str | None = None,
        name: str | None = None,
        offline: bool | None = None,
        resume_step: int | None = None,
        **init_kwargs: Any,
    ) -> None:
        try:
            from clearml import Task
        except ImportError as e:
            raise missing_package(self.name, "clearml", "clearml", e) from e
        self.run_dir = Path(run_dir)
        with writing(self.name, self.run_dir):
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self._external = Task.current_task() is not None
        self._was_offline = bool(Task.is_offline())
        if self._external:
            self._task: Any = Task.current_task()
            self.offline = self._was_offline
            return
        if offline is None:
            offline = _offline_from_env()
            if offline is None:
                offline = not _has_credentials()
        self.offline = offline
        frameworks = init_kwargs.pop("auto_connect_frameworks", None)
        if frameworks is None:
            frameworks = {"tensorboard": False, "detect_repository": not offline}
        try:
            if offline and not self._was_offline:
                Task.set_offline(True)
            self._task = Task.init(
                project_name=project or os.environ.get("CLEARML_PROJECT") or "accelfn",
                task_name=name or os.environ.get("CLEARML_TASK") or self.run_dir.resolve().name,
                reuse_last_task_id=init_kwargs.pop("reuse_last_task_id", False),
                auto_connect_frameworks=frameworks,
                **init_kwargs,
            )
        except Exception as e:
            self._restore_mode(Task)
            mode = "offline" if offline else "online"
            raise TrackerError(self.name, f"Task.init failed ({mode}): {type(e).__name__}: {e}") from e
        self.task_id: str = self._task.id

    def log(self, metrics: dict[str, float], step: int) -> None:
        logger = self._task.get_logger()
        for key, value in metrics.items():
            title, series = _title_series(key)
            logger.report_scalar(title=title, series=series, value=value, iteration=step)

    def log_config(self, config: dict[str, Any]) -> None:
        self._task.connect_configuration(to_plain(config))

    def flush(self) -> None:
        self._task.get_logger().flush()

    def close(self) -> None:
        if self._external:
            self._task.get_logger().flush()
            return
        from clearml import Task

        folder = Path(self._task.get_offline_mode_folder() or "") if self.offline else None
        try:
            self._task.close()
        finally:
            self._restore_mode(Task)
        if folder is not None and folder.with_suffix(".zip").is_file():
            (self.run_dir / "clearml").mkdir(exist_ok=True)
            shutil.copy2(folder.with_suffix(".zip"), self.run_dir / "clearml" / f"{self.task_id}.zip")

    def _restore_mode(self, task_cls: Any) -> None:
        if self.offline and not self._was_offline:
            with contextlib.suppress(Exception):
                task_cls.set_offline(False)


def _title_series(name: str) -> tuple[str, str]:
    """Accelerate's ClearML naming: ``eval_loss`` (or ``eval/loss``) -> plot ``loss``, series ``eval``."""
    for prefix in ("eval", "test", "train"):
        for sep in ("_", "/"):
            if name.startswith(prefix + sep) and len(name) > len(prefix) + 1:
                return name[len(prefix) + 1 :], prefix
    return name, "train"


def _offline_from_env() -> bool | None:
    value = os.environ.get("CLEARML_OFFLINE_MODE", os.environ.get("TRAINS_OFFLINE_MODE", "")).strip().lower()
    if not value:
        return None
    return value in ("1", "true", "yes", "on", "y")


def _has_credentials() -> bool:
    """Whether ClearML has a server to talk to: API keys in the environment or in ``clearml.conf``."""
    if os.environ.get("CLEARML_API_ACCESS_KEY") or os.environ.get("TRAINS_API_ACCESS_KEY"):
        return True
    try:
        from clearml.config import config_obj

        return bool(config_obj.get("api.credentials.access_key", None))
    except Exception:
        return False
