"""``accelfn env``: versions, platform, devices and the config in use (paste it into bug reports).

Example:
    $ accelfn env
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform as pyplatform
import sys
from typing import Any

BUILT_ON = ("optree", "attrs", "safetensors", "typeguard")
OPTIONAL = (
    "deepspeed",
    "torchao",
    "transformer_engine",
    "transformers",
    "peft",
    "accelerate",
    "huggingface_hub",
    "matplotlib",
    "rich",
)
"""Packages accelfn uses when installed (each its own line); the trackers' packages are one line, `trackers`."""


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _trackers() -> str:
    """Each tracker backend of `af.trackers` with its package's version; those not installed last."""
    import importlib.util

    from ..trackers import BACKENDS

    found, missing = [], []
    for name, spec in BACKENDS.items():
        package = spec[2] if len(spec) > 2 else None
        if package is None:
            found.append(f"{name} (built in)")
        elif importlib.util.find_spec(package) is None:
            missing.append(name)
        else:
            version = _version(package)
            found.append(f"{name} {version if version != 'not installed' else '(version unknown)'}")
    return ", ".join(found) + (f"; not installed: {', '.join(missing)}" if missing else "")


def report(config_file: str | None = None) -> dict[str, Any]:
    """The facts ``accelfn env`` prints, as a dict (optional packages are not imported, only looked up)."""
    import torch

    import accelfn

    from ..launch.config import ConfigError, default_config_path, load

    info: dict[str, Any] = {
        "accelfn": accelfn.__version__,
        "python": f"{pyplatform.python_version()} ({sys.executable})",
        "os": pyplatform.platform(),
        "torch": torch.__version__,
    }
    for name in (*BUILT_ON, *OPTIONAL):
        info[name] = _version(name)
    info["trackers"] = _trackers()
    from .. import platforms

    try:
        plat = platforms.detect()
    except (RuntimeError, ValueError) as e:  # e.g. ACCELFN_DEVICE=cuda on a machine without CUDA
        info["platform"] = f"none ({e})"
    else:
        info["platform"] = (
            f"{plat.kind} (backend {plat.backend}; visible-devices variable: {plat.visible_devices_env})"
        )
        info["devices"] = plat.device_count()
        memory = []
        for i in range(plat.device_count()):
            total = plat.memory_stats(plat.device(i)).get("total")
            memory.append(
                f"{plat.device(i)}: {total / 2**30:.1f} GiB" if total else f"{plat.device(i)}: unknown"
            )
        info["device memory"] = ", ".join(memory)
    info["available kinds"] = ", ".join(p.kind for p in platforms.available())
    info["cpu cores"] = _cpu_count()
    path = config_file or default_config_path()
    try:
        info["config"] = f"{path}: {load(path).to_dict()}"
    except ConfigError as e:
        info["config"] = f"none ({e})" if not config_file else f"INVALID: {e}"
    return info


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "env",
        help="print versions, platform and config",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config-file", help="config to show (default: the cache folder's)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    for key, value in report(args.config_file).items():
        print(f"- {key}: {value}")
    return 0
