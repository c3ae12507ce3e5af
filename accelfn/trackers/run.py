"""`Run`: buffers logged metrics (tensors without a device sync) and fans them out to trackers.

Example:
    >>> import torch
    >>> class Printer:
    ...     def log(self, metrics, step): print(step, metrics)
    ...     def log_config(self, config): pass
    ...     def close(self): pass
    >>> with Run([Printer()], log_every=2) as run:
    ...     run.log({"loss": torch.tensor(0.5)}, step=1)   # buffered: no sync, nothing printed yet
    ...     run.log({"loss": torch.tensor(0.25), "epoch": 0}, step=2)
    1 {'loss': 0.5}
    2 {'loss': 0.25, 'epoch': 0}
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from .. import platforms
from .base import Tracker, TrackerError

__all__ = ["Run", "RESERVED"]

RESERVED = ("step", "time")  # JSONL line keys; not allowed as metric names
_STEP = "\0step"  # the step, when given as a tensor, travels with the tensor metrics


def tracker_name(tracker: Any) -> str:
    """A tracker's ``name`` attribute, else its class name."""
    return str(getattr(tracker, "name", None) or type(tracker).__name__)


def _takes_wall_time(tracker: Any) -> bool:
    try:
        return "wall_time" in inspect.signature(tracker.log).parameters
    except (TypeError, ValueError):
        return False


def _wide(device: torch.device) -> torch.dtype:
    """One dtype all scalar metrics of a device are stacked in (exact for ints below 2**53)."""
    return torch.float64 if platforms.supports_float64(device) else torch.float32


@attrs.define
class _Line:
    """One `Run.log` call, waiting to be written."""

    step: int | None
    wall_time: float
    keys: list[str]
    numbers: dict[str, Any]
    # per device: (names, integral?, 1-d snapshot of the values, stacked at log time; no sync)
    tensors: list[tuple[torch.device, list[str], list[bool], torch.Tensor]]


class Run:
    """Fans `log` calls out to trackers; build with `accelfn.trackers.open`.

    Tensor metrics are not read when logged: each call stacks (copies) its 0-d tensors per device, and
    every ``log_every`` calls, on `flush`, on `close`, at interpreter exit and when a ``with`` block ends
    (also by an exception) all buffered values are read with one ``tolist()`` per device. An inactive run
    (not the main process) accepts the same calls and writes nothing.

    A tracker that raises while writing is dropped from the run (the others still get every line) and a
    `TrackerError` naming it is raised once (``on_error="warn"``: a warning instead). Checkpoints and the
    training state are never touched by trackers.
    """

    def __init__(
        self,
        trackers: Sequence[Tracker] = (),
        *,
        log_every: int = 10,
        active: bool = True,
        on_error: str = "raise",
    ) -> None:
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise ValueError(f"log_every must be an integer >= 1, got {log_every!r}")
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
        for t in trackers:
            missing = [m for m in ("log", "log_config", "close") if not callable(getattr(t, m, None))]
            if missing:
                raise TypeError(
                    f"{tracker_name(t)!r} is not a tracker: it has no method(s) {', '.join(missing)} "
                    "(see accelfn.trackers.Tracker)"
                )
        self.active = active
        self.log_every = log_every
        self.on_error = on_error
        self._trackers: list[Any] = list(trackers) if active else []
        self._wall_time = {id(t): _takes_wall_time(t) for t in self._trackers}
        self._buffer: list[_Line] = []
        self._closed = False
        if self._trackers:
            atexit.register(self._close_at_exit)

    @property
    def trackers(self) -> tuple[Tracker, ...]:
        """The trackers still written to (one that failed is dropped)."""
        return tuple(self._trackers)

    # ---- logging ----------------------------------------------------------------------------------------------
    def log(self, metrics: Mapping[str, Any], step: int | torch.Tensor) -> None:
        """Buffer ``metrics`` (numbers or one-element tensors) for ``step`` (an int or an integer tensor). Nested
        dicts are logged under "/"-joined names (``{"eval": {"loss": x}}`` -> ``eval/loss``), the grouping
        TensorBoard and W&B show as sections."""
        if self._closed:
            raise RuntimeError("this run is closed; open another with accelfn.trackers.open(...)")
        if isinstance(step, torch.Tensor):
            if step.numel() != 1 or step.is_floating_point() or step.is_complex():
                raise TypeError(f"step must be an int or a one-element integer tensor, got {step!r}")
        elif isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int or a one-element integer tensor, got {type(step).__name__}")
        metrics = _flat_metrics(metrics)
        groups: dict[torch.device, tuple[list[str], list[bool], list[torch.Tensor]]] = {}
        numbers: dict[str, Any] = {}
        for key, value in metrics.items():
            if not isinstance(key, str) or key in RESERVED:
                raise ValueError(f"metric name {key!r}: names are strings other than {', '.join(RESERVED)}")
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(
                        f"metric {key!r} is a tensor of shape {tuple(value.shape)}: log one value (a 0-d tensor "
                        "or a number), e.g. its mean"
                    )
                names, integral, values = groups.setdefault(value.device, ([], [], []))
                names.append(key)
                integral.append(not (value.is_floating_point() or value.is_complex()))
                values.append(value)
            elif isinstance(value, (int, float)):
                numbers[key] = value
            elif callable(getattr(value, "item", None)) and getattr(value, "ndim", None) == 0:
                numbers[key] = value.item()  # a numpy scalar: on the host already
            else:
                raise TypeError(f"metric {key!r} is a {type(value).__name__}: log numbers or 0-d tensors")
        if not self.active:
            return
        if isinstance(step, torch.Tensor):
            names, integral, values = groups.setdefault(step.device, ([], [], []))
            names.append(_STEP)
            integral.append(True)
            values.append(step)
        tensors = []
        for device, (names, integral, values) in groups.items():
            wide = _wide(device)
            # torch.stack copies: later in-place updates (the donated state, the lr) do not change the line
            snapshot = torch.stack([v.detach().reshape(()).to(wide) for v in values])
            tensors.append((device, names, integral, snapshot))
        self._buffer.append(
            _Line(
                step=None if isinstance(step, torch.Tensor) else step,
                wall_time=time.time(),
                keys=list(metrics),
                numbers=numbers,
                tensors=tensors,
            )
        )
        if len(self._buffer) >= self.log_every:
            self.flush()

    def log_config(self, config: Any) -> None:
        """Give ``config`` (any nesting of dicts, dataclasses, attrs classes, Namespaces...) to every tracker."""
        if self._closed:
            raise RuntimeError("this run is closed")
        if config is None or not self._trackers:
            return
        self._call_all("log_config", lambda t: t.log_config(config), when="logging the config")

    def flush(self) -> None:
        """Read the buffered tensors (one ``tolist()`` per device) and write every buffered line."""
        if not self._buffer:
            return
        lines, self._buffer = self._buffer, []
        stacks: dict[torch.device, list[torch.Tensor]] = {}
        for line in lines:
            for device, _, _, snapshot in line.tensors:
                stacks.setdefault(device, []).append(snapshot)
        read = {device: iter(torch.cat(s).tolist()) for device, s in stacks.items()}  # the only device syncs
        resolved: list[tuple[int, float, dict[str, Any]]] = []
        for line in lines:
            values = dict(line.numbers)
            step = line.step
            for device, names, integral, _ in line.tensors:
                it = read[device]
                for name, is_int in zip(names, integral):
                    v = next(it)
                    if name == _STEP:
                        step = int(v)
                    else:
                        values[name] = int(v) if is_int else v
            assert step is not None
            resolved.append((step, line.wall_time, {k: values[k] for k in line.keys}))

        def write(t: Any) -> None:
            timed = self._wall_time.get(id(t), False)
            for step, wall_time, metrics in resolved:
                if timed:
                    t.log(metrics, step, wall_time=wall_time)
                else:
                    t.log(metrics, step)
            flush = getattr(t, "flush", None)
            if callable(flush):
                flush()

        self._call_all("log", write, when=f"writing steps {resolved[0][0]}..{resolved[-1][0]}")

    def close(self) -> None:
        """Flush, then close every tracker, the last opened first (idempotent)."""
        if self._closed:
            return
        flush_error: TrackerError | None = None
        try:
            self.flush()
        except TrackerError as e:  # close the others first, then report it
            flush_error = e
        self._closed = True
        atexit.unregister(self._close_at_exit)
        trackers, self._trackers = self._trackers, []
        try:  # last opened, first closed: trackers that wrap sys.stdout (Comet, Aim, SwanLab) unwrap in order
            self._call_all("close", lambda t: t.close(), when="closing", trackers=trackers[::-1])
        except TrackerError:
            if flush_error is None:
                raise
        if flush_error is not None:
            raise flush_error

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except Exception as e:  # nothing can catch it any more: say it
            print(f"accelfn.trackers: at exit: {e}", file=sys.stderr)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # the training error is the one to see; a tracker's error becomes a warning
            self.close()
        except Exception as e:
            warnings.warn(f"accelfn.trackers: while closing after {exc_type.__name__}: {e}", stacklevel=2)

    def __repr__(self) -> str:
        names = ", ".join(tracker_name(t) for t in self._trackers)
        state = "closed" if self._closed else ("active" if self.active else "inactive (not the main process)")
        return f"Run([{names}], log_every={self.log_every}, {state})"

    # ---- errors -------------------------------------------------------------------------------------------------
    def _call_all(self, what: str, fn: Any, *, when: str, trackers: list[Any] | None = None) -> None:
        """``fn(tracker)`` for each tracker; one that raises is dropped and reported once (after the others ran)."""
        failed: list[tuple[Any, BaseException]] = []
        for t in list(self._trackers if trackers is None else trackers):
            try:
                fn(t)
            except Exception as e:
                failed.append((t, e))
        if not failed:
            return
        if trackers is None:
            self._trackers = [t for t in self._trackers if all(t is not f for f, _ in failed)]
            for f, _ in failed:  # release what it holds; its first error is the one to report
                with contextlib.suppress(Exception):
                    f.close()
        t, first = failed[0]
        cause = first.detail if isinstance(first, TrackerError) else f"{type(first).__name__}: {first}"
        others = "; ".join(f"{tracker_name(f)!r}: {type(x).__name__}: {x}" for f, x in failed[1:])
        rest = ", ".join(repr(tracker_name(x)) for x in self._trackers) or "none"
        message = (
            f"failed while {when}: {cause}"
            + (f" (also failed: {others})" if others else "")
            + (f"; it is no longer written to (still written to: {rest})" if what != "close" else "")
        )
        error = TrackerError(tracker_name(t), message)
        if self.on_error == "warn":
            warnings.warn(str(error), stacklevel=3)
            return
        raise error from first


def _flat_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``metrics`` with nested mappings flattened to "/"-joined names."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}" if isinstance(key, str) else key
        if isinstance(value, Mapping) and isinstance(key, str):
            out.update(_flat_metrics(value, f"{name}/"))
        else:
            out[name] = value
    return out
