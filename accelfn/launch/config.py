"""The launcher's configuration: an attrs class, read from and written to YAML (`accelfn config`).

Precedence when launching: command-line flag > SLURM variables > config file > defaults.

Example:
    >>> cfg = Config.from_dict({"num_processes": 2, "mixed_precision": "bf16"})
    >>> cfg.num_processes, cfg.mixed_precision, Config.from_dict(cfg.to_dict()) == cfg
    (2, 'bf16', True)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from ..launch_env import (
    ACCELFN_FP8_BACKEND,
    ACCELFN_FP8_RECIPE,
    ACCELFN_MIXED_PRECISION,
    DEVICE_KINDS,
    FP8_BACKENDS,
    KNOBS,
    MIXED_PRECISION,
    format_mesh,
    parse_knob,
    parse_log_with,
    parse_mesh,
)

RDZV_BACKENDS = ("c10d", "static")


class ConfigError(ValueError):
    """A config file or value is invalid; the message names the key and what is allowed."""


def default_config_path(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/accelfn/default_config.yaml`` (``~/.cache/accelfn/...`` when unset)."""
    env = os.environ if environ is None else environ
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "accelfn" / "default_config.yaml"


def parse_nnodes(value: int | str, *, key: str = "num_machines") -> tuple[int, int]:
    """``2`` -> (2, 2); ``"1:4"`` -> (1, 4) (elastic). Errors name ``key``."""
    text = str(value).strip()
    lo, sep, hi = text.partition(":")
    try:
        pair = (int(lo), int(hi) if sep else int(lo))
    except ValueError:
        raise ConfigError(f"{key}={value!r}: expected N or MIN:MAX with integers, e.g. 2 or 1:4") from None
    if not 0 < pair[0] <= pair[1]:
        raise ConfigError(f"{key}={value!r}: need 0 < MIN <= MAX")
    return pair


def _check_choice(key: str, allowed: tuple[str, ...]):
    def check(_inst: Any, _attr: Any, value: Any) -> None:
        if value not in allowed:
            raise ConfigError(f"config key {key!r}: {value!r} is not one of {', '.join(allowed)}")

    return check


def _check_int(key: str, *, minimum: int, allow: tuple[str, ...] = ()):
    def check(_inst: Any, _attr: Any, value: Any) -> None:
        if value in allow:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            extra = f" or one of {', '.join(allow)}" if allow else ""
            raise ConfigError(f"config key {key!r}: {value!r} must be an integer >= {minimum}{extra}")

    return check


def _check_nnodes(_inst: Any, _attr: Any, value: Any) -> None:
    parse_nnodes(value, key="config key 'num_machines'")


def _check_mesh(_inst: Any, _attr: Any, value: Any) -> None:
    if value and not isinstance(value, str):
        raise ConfigError(f"config key 'mesh': expected a string like 'dp=2,tp=4', got {value!r}")
    if value:
        try:
            parse_mesh(value, source="config key 'mesh'")
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _mesh_in(value: Any) -> Any:
    return format_mesh(value) if isinstance(value, Mapping) else value


def _log_with_in(value: Any) -> Any:
    """A YAML list ``[tensorboard, jsonl]`` is the comma list ``"tensorboard,jsonl"``; None is unset."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return ",".join(value) or "none"
    return value


def _check_log_with(_inst: Any, _attr: Any, value: Any) -> None:
    if not isinstance(value, str):
        raise ConfigError(f"config key 'log_with': expected a list or comma list of trackers, got {value!r}")
    if value:
        try:
            parse_log_with(value, source="config key 'log_with'")
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _to_float(value: Any) -> Any:
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _check_positive_float(key: str):
    def check(_inst: Any, _attr: Any, value: Any) -> None:
        if not isinstance(value, float) or value <= 0:
            raise ConfigError(f"config key {key!r}: {value!r} must be a number > 0")

    return check


def _check_str(key: str):
    def check(_inst: Any, _attr: Any, value: Any) -> None:
        if not isinstance(value, str):
            raise ConfigError(f"config key {key!r}: {value!r} must be a string")

    return check


@attrs.frozen
class Fp8Config:
    """``fp8:`` section: which FP8 backend and recipe `af.autocast_fp8` uses under ``mixed_precision: fp8``."""

    backend: str = attrs.field(default="auto", validator=_check_choice("fp8.backend", FP8_BACKENDS))
    recipe: str | None = attrs.field(default=None)


def _fp8_in(value: Any) -> Any:
    if isinstance(value, Fp8Config):
        return value
    if value is None:
        return Fp8Config()
    if not isinstance(value, Mapping):
        raise ConfigError(f"config key 'fp8': expected a mapping with keys backend, recipe, got {value!r}")
    _reject_unknown(value, Fp8Config, prefix="fp8.")
    return Fp8Config(**value)


def _check_knob(_inst: Any, attr: Any, value: Any) -> None:
    if value is not None:
        try:
            parse_knob(attr.name, value, source=f"config key 'plan.{attr.name}'")
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _knob() -> Any:
    return attrs.field(default=None, validator=_check_knob)


@attrs.frozen
class PlanConfig:
    """``plan:`` section: the knobs a script leaves to the launch configuration (`accelfn.launch_env.knob` with
    "auto"), as `accelfn plan --write` chose them; None leaves the script's default.

    Example:
        >>> PlanConfig(strategy="fsdp", accumulate=2).env()
        {'ACCELFN_STRATEGY': 'fsdp', 'ACCELFN_ACCUMULATE': '2'}
    """

    strategy: str | None = _knob()
    remat: str | None = _knob()
    accumulate: int | None = _knob()
    global_batch_size: int | None = _knob()
    pipeline_schedule: str | None = _knob()
    pipeline_microbatches: int | None = _knob()
    pipeline_sync_each_microbatch: bool | None = _knob()
    offload: str | None = _knob()
    compile: str | None = _knob()

    def env(self) -> dict[str, str]:
        """The knobs that are set, as the launcher passes them to the script (`accelfn.launch_env`)."""
        return {KNOBS[k][0]: str(v) for k, v in attrs.asdict(self).items() if v is not None}


def _plan_in(value: Any) -> Any:
    if isinstance(value, PlanConfig):
        return value
    if value is None:
        return PlanConfig()
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"config key 'plan': expected a mapping with keys {', '.join(KNOBS)}, got {value!r}"
        )
    _reject_unknown(value, PlanConfig, prefix="plan.")
    return PlanConfig(**value)


def _reject_unknown(data: Mapping[str, Any], cls: type, *, prefix: str = "") -> None:
    known = [f.name for f in attrs.fields(cls)]
    for key in data:
        if key not in known:
            raise ConfigError(
                f"unknown config key {prefix + str(key)!r}; known keys: {', '.join(prefix + k for k in known)}"
            )


@attrs.frozen
class Config:
    """Settings of `accelfn launch`; every field has a matching command-line flag."""

    num_processes: int | str = attrs.field(
        default="auto", validator=_check_int("num_processes", minimum=1, allow=("auto",))
    )
    num_machines: int | str = attrs.field(default=1, validator=_check_nnodes)
    machine_rank: int = attrs.field(default=0, validator=_check_int("machine_rank", minimum=0))
    rdzv_endpoint: str = attrs.field(default="", validator=_check_str("rdzv_endpoint"))
    rdzv_backend: str = attrs.field(default="c10d", validator=_check_choice("rdzv_backend", RDZV_BACKENDS))
    rdzv_id: str = attrs.field(default="", converter=lambda v: "" if v is None else str(v))
    mixed_precision: str = attrs.field(
        default="no",
        converter=lambda v: "no" if v is False else v,  # YAML 1.1 reads an unquoted `no` as false
        validator=_check_choice("mixed_precision", MIXED_PRECISION),
    )
    mesh: str = attrs.field(default="", converter=_mesh_in, validator=_check_mesh)
    device: str = attrs.field(default="auto", validator=_check_choice("device", DEVICE_KINDS))
    max_restarts: int = attrs.field(default=0, validator=_check_int("max_restarts", minimum=0))
    monitor_interval: float = attrs.field(
        default=0.1, converter=_to_float, validator=_check_positive_float("monitor_interval")
    )
    fp8: Fp8Config = attrs.field(factory=Fp8Config, converter=_fp8_in)
    log_with: str = attrs.field(default="", converter=_log_with_in, validator=_check_log_with)
    plan: PlanConfig = attrs.field(factory=PlanConfig, converter=_plan_in)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Config:
        """Build from a mapping (e.g. parsed YAML); unknown keys and bad values raise `ConfigError`."""
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ConfigError(f"a config must be a mapping of keys to values, got {type(data).__name__}")
        _reject_unknown(data, cls)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for YAML, in field order (the `plan` section only with the knobs that are set)."""
        out = attrs.asdict(self)
        plan = {k: v for k, v in out.pop("plan").items() if v is not None}
        return {**out, "plan": plan} if plan else out

    def precision_env(self, mixed_precision: str | None = None) -> dict[str, str]:
        """The env a script reads its mixed precision from, as `accelfn launch` sets it:
        `ACCELFN_MIXED_PRECISION` (`mixed_precision`, a flag that wins over the config's, else this config's)
        and, under fp8, the ``fp8:`` section's backend and recipe.

        Example:
            >>> Config(mixed_precision="fp8", fp8={"recipe": "rowwise"}).precision_env()
            {'ACCELFN_MIXED_PRECISION': 'fp8', 'ACCELFN_FP8_BACKEND': 'auto', 'ACCELFN_FP8_RECIPE': 'rowwise'}
            >>> Config(mixed_precision="fp8").precision_env("bf16")
            {'ACCELFN_MIXED_PRECISION': 'bf16'}
        """
        precision = self.mixed_precision if mixed_precision is None else mixed_precision
        if precision not in MIXED_PRECISION:
            raise ConfigError(f"--mixed-precision={precision!r} is not one of {', '.join(MIXED_PRECISION)}")
        env = {ACCELFN_MIXED_PRECISION: precision}
        if precision == "fp8":
            env[ACCELFN_FP8_BACKEND] = self.fp8.backend
            if self.fp8.recipe:
                env[ACCELFN_FP8_RECIPE] = self.fp8.recipe
        return env

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` (validated)."""
        return attrs.evolve(self, **changes)


def _safe_loader() -> type:
    """``yaml.SafeLoader`` without YAML 1.1's base-60 integers, so ``num_machines: 1:4`` stays "1:4"."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:int"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:int",
        re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
        list("-+0123456789"),
    )
    return Loader


def load(path: str | os.PathLike[str]) -> Config:
    """Read a YAML config (a ``yaml.SafeLoader``); errors name the file and the key.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "c.yaml"
        >>> _ = p.write_text("num_processes: 2\\n")
        >>> load(p).num_processes
        2
    """
    import yaml

    path = Path(path)
    try:
        data = yaml.load(path.read_text(), Loader=_safe_loader())
    except FileNotFoundError:
        raise ConfigError(
            f"config file {str(path)!r} does not exist; write one with `accelfn config`"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"config file {str(path)!r} is a folder; give the YAML file's path") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    try:
        return Config.from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except TypeError as e:  # attrs: missing/extra arguments not caught above
        raise ConfigError(f"{path}: {e}") from None


def save(config: Config, path: str | os.PathLike[str]) -> Path:
    """Write ``config`` as YAML (atomically) and return the path."""
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    os.replace(tmp, path)
    return path
