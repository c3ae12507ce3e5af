"""Weights & Biases tracker; offline (files under ``<run_dir>/wandb``) unless you are logged in.

Needs ``pip install 'accelfn[wandb]'``. The mode is ``WANDB_MODE`` when set; otherwise ``online`` with an
API key (``WANDB_API_KEY`` or a netrc entry from ``wandb login``) and ``offline`` without one, so a run never
stops to ask for a key (upload an offline run later with ``wandb sync <run_dir>/wandb/offline-run-*``).
The run id is kept in ``<run_dir>/wandb_run_id``: reopening the folder continues the same W&B run.
"""

from __future__ import annotations

import netrc
import os
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from .base import TrackerError, missing_package, to_plain, writing

__all__ = ["WandbTracker", "has_api_key"]


def has_api_key(environ: dict[str, str] | None = None) -> bool:
    """Whether W&B credentials exist: ``WANDB_API_KEY``, or a netrc entry for the W&B host.

    Example:
        >>> has_api_key({"WANDB_API_KEY": "x" * 40})
        True
    """
    env = dict(os.environ) if environ is None else environ
    if env.get("WANDB_API_KEY"):
        return True
    host = urlparse(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    try:
        return netrc.netrc(env.get("NETRC") or None).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbTracker:
    """``wandb.init(id=<stored id>, resume="allow", dir=<run_dir>)``; ``run.log(metrics, step=step)``.

    W&B ignores values for steps at or below the last step it recorded, so after a resume from step K the
    steps K+1.. that a crashed attempt had logged keep their first values.
    """

    name = "wandb"

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
            import wandb
        except ImportError as e:
            raise missing_package(self.name, "wandb", "wandb", e) from e
        run_dir = Path(run_dir)
        id_file = run_dir / "wandb_run_id"
        with writing(self.name, run_dir):
            (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
            if id_file.exists():
                run_id = id_file.read_text().strip()
            else:
                run_id = secrets.token_hex(4)
                id_file.write_text(run_id + "\n")
        if mode is None:
            mode = os.environ.get("WANDB_MODE") or ("online" if has_api_key() else "offline")
        self.mode = mode
        self.run_id = run_id
        try:
            self._run = wandb.init(
                project=project or os.environ.get("WANDB_PROJECT") or "accelfn",
                name=name or run_dir.resolve().name,
                id=run_id,
                resume="allow",
                dir=str(run_dir),
                mode=mode,  # type: ignore[arg-type]  # checked by wandb
                **init_kwargs,
            )
        except Exception as e:
            raise TrackerError(
                self.name, f"wandb.init failed in mode {mode!r}: {type(e).__name__}: {e}"
            ) from e

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def log_config(self, config: dict[str, Any]) -> None:
        self._run.config.update(to_plain(config), allow_val_change=True)

    def close(self) -> None:
        self._run.finish()
