"""The `Tracker` protocol every backend implements, the error they raise, and config flattening.

Example:
    >>> import dataclasses
    >>> @dataclasses.dataclass
    ... class Opt:
    ...     lr: float = 1e-3
    ...     betas: tuple = (0.9, 0.95)
    >>> flatten_config({"opt": Opt(), "seed": None})
    {'opt.lr': 0.001, 'opt.betas.0': 0.9, 'opt.betas.1': 0.95, 'seed': 'None'}
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import os
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import attrs

__all__ = ["Tracker", "TrackerError", "to_plain", "flatten_config", "missing_package", "writing"]

Scalar = str | int | float | bool


@runtime_checkable
class Tracker(Protocol):
    """What `accelfn.trackers.open` fans out to: any object with these three methods.

    ``log`` receives plain Python numbers (tensors were converted in one go by the run), in increasing
    ``step`` order within one run. Optional extras the run uses when present: ``flush()`` (called after
    each batch of buffered lines) and a keyword ``wall_time`` on ``log`` (seconds since the epoch at which
    the values were logged, rather than written).
    """

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def log_config(self, config: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class TrackerError(RuntimeError):
    """A tracker backend failed; the message names the backend, the cause and, where known, the fix."""

    def __init__(self, backend: str, message: str) -> None:
        super().__init__(f"tracker {backend!r}: {message}")
        self.backend = backend
        self.detail = message


def missing_package(backend: str, package: str, extra: str, cause: BaseException) -> TrackerError:
    """The one error for a backend whose package is not installed."""
    return TrackerError(
        backend,
        f"the package {package!r} is not installed ({cause}); install it with pip install 'accelfn[{extra}]'",
    )


@contextlib.contextmanager
def writing(backend: str, path: str | os.PathLike[str]) -> Iterator[None]:
    """A backend's files under `path`: an OSError inside becomes the TrackerError naming backend and path."""
    try:
        yield
    except OSError as e:
        raise TrackerError(backend, f"cannot write {str(path)!r}: {e}") from e


def to_plain(obj: Any) -> Any:
    """``obj`` as JSON-able nested dicts/lists of str, int, float, bool and None.

    Dataclasses, attrs classes, ``argparse.Namespace`` and mappings become dicts; tuples, lists and sets
    lists; paths, enums, torch dtypes/devices and anything else their ``str`` (enums: their value if plain).

    Example:
        >>> import pathlib, torch
        >>> to_plain({"dir": pathlib.Path("/tmp/x"), "dtype": torch.bfloat16, "ids": (1, 2)})
        {'dir': '/tmp/x', 'dtype': 'torch.bfloat16', 'ids': [1, 2]}
    """
    if obj is None or isinstance(obj, (bool, int, float, str)) and not isinstance(obj, enum.Enum):
        return obj
    if isinstance(obj, enum.Enum):
        value = obj.value
        return value if isinstance(value, (bool, int, float, str)) else obj.name
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if attrs.has(type(obj)):
        return {f.name: to_plain(getattr(obj, f.name)) for f in attrs.fields(type(obj))}
    if isinstance(obj, argparse.Namespace):
        return {k: to_plain(v) for k, v in vars(obj).items()}
    if isinstance(obj, Mapping):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((to_plain(v) for v in obj), key=repr)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    item = getattr(obj, "item", None)  # numpy scalars, 0-d tensors
    if callable(item) and getattr(obj, "ndim", None) == 0:
        return item()
    return str(obj)


def flatten_config(obj: Any, *, sep: str = ".") -> dict[str, Scalar]:
    """Flatten a nested config to ``{"a.b.0": scalar}`` with str/int/float/bool values (None -> "None").

    For backends that only take scalar hyper-parameters (TensorBoard's hparams, MLflow params). An empty
    dict or list becomes the string ``"{}"`` / ``"[]"`` so its key is not lost.

    Example:
        >>> import argparse
        >>> flatten_config(argparse.Namespace(model={"dims": [64, 128]}, resume=None, fp16=False))
        {'model.dims.0': 64, 'model.dims.1': 128, 'resume': 'None', 'fp16': False}
    """
    out: dict[str, Scalar] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            if not value and prefix:
                out[prefix] = "{}"
            for k, v in value.items():
                walk(f"{prefix}{sep}{k}" if prefix else str(k), v)
        elif isinstance(value, list):
            if not value and prefix:
                out[prefix] = "[]"
            for i, v in enumerate(value):
                walk(f"{prefix}{sep}{i}" if prefix else str(i), v)
        elif value is None:
            out[prefix] = "None"
        else:
            out[prefix] = value

    plain = to_plain(obj)
    walk("", plain if isinstance(plain, (dict, list)) else {"value": plain})
    return out
