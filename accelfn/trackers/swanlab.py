"""SwanLab tracker; offline (files under ``<run_dir>/swanlog``) unless you are logged in.

Needs ``pip install 'accelfn[swanlab]'``. The mode is ``mode=`` when given, else ``SWANLAB_MODE`` when set,
else SwanLab's cloud mode with an API key (``SWANLAB_API_KEY`` or ``swanlab login``) and ``offline`` without
one, so a run never stops to ask for a key (upload an offline run later with
``swanlab sync <run_dir>/swanlog/run-*``; ``mode="local"`` needs ``swanlab[dashboard]``). Each open starts a
new SwanLab experiment named after the run folder (an offline run cannot be continued).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .base import TrackerError, missing_package, to_plain, writing

__all__ = ["SwanLabTracker"]


class SwanLabTracker:
    """``swanlab.init(project, experiment_name, logdir, mode)``; ``run.log(metrics, step=step)``.

    As Accelerate's ``SwanLabTracker``: the config with ``config.update``. SwanLab ignores a value for a step
    it already has. Other keywords go to ``swanlab.init``.
    """

    name = "swanlab"

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        project: str | None = None,
        name: str | None = None,
        mode: str | None = None,
        resume_step: int | None = None,
        **init_kwargs: Any,
    ) -> None:
        try:
            import swanlab
        except ImportError as e:
            raise missing_package(self.name, "swanlab", "swanlab", e) from e
        run_dir = Path(run_dir)
        self.logdir = run_dir / "swanlog"
        with writing(self.name, self.logdir):
            self.logdir.mkdir(parents=True, exist_ok=True)
        if mode is None and not os.environ.get("SWANLAB_MODE") and not _has_api_key():
            mode = "offline"
        self.mode = mode or os.environ.get("SWANLAB_MODE") or "cloud"
        # swanlab.init exports SWANLAB_LOG_DIR / SWANLAB_MODE: put them back at close
        self._environ = {k: v for k, v in os.environ.items() if k.startswith("SWANLAB_")}
        try:
            self._run = swanlab.init(
                project=project or os.environ.get("SWANLAB_PROJ_NAME") or "accelfn",
                experiment_name=name or run_dir.resolve().name,
                logdir=str(self.logdir),
                mode=mode,
                **init_kwargs,
            )
        except Exception as e:
            self._restore_environ()
            raise TrackerError(
                self.name, f"swanlab.init failed in mode {self.mode!r}: {type(e).__name__}: {e}"
            ) from e

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def log_config(self, config: dict[str, Any]) -> None:
        self._run.config.update(to_plain(config))

    def close(self) -> None:
        try:
            self._run.finish()
        finally:
            self._restore_environ()

    def _restore_environ(self) -> None:
        for key in [k for k in os.environ if k.startswith("SWANLAB_") and k not in self._environ]:
            del os.environ[key]
        os.environ.update(self._environ)


def _has_api_key() -> bool:
    """Whether SwanLab has a key: ``SWANLAB_API_KEY`` or the netrc file ``swanlab login`` writes."""
    if os.environ.get("SWANLAB_API_KEY"):
        return True
    try:
        from swanlab.package import get_key  # swanlab 0.6 to 0.7

        get_key()
        return True
    except ImportError:
        folder = os.environ.get("SWANLAB_SAVE_DIR") or os.path.join(os.path.expanduser("~"), ".swanlab")
        return os.path.isfile(os.path.join(folder, ".netrc"))
    except Exception:  # no key file, or no entry for the host
        return False
