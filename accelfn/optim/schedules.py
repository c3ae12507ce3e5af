"""Learning-rate schedules: callables `count -> lr` on 0-d tensors (no recompiles, no host syncs).

Any callable `step -> lr` works too; these print their settings and match `torch.optim.lr_scheduler`.

Example:
    >>> import torch, accelfn as af
    >>> s = af.optim.warmup_cosine(1e-3, warmup=10, total=100)
    >>> [round(float(s(torch.tensor(t))), 6) for t in (0, 5, 10, 100)]
    [0.0, 0.0005, 0.001, 0.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import torch

from .. import platforms
from .._typecheck import checked

__all__ = ["Schedule", "ScheduleLike", "constant", "linear", "cosine", "warmup_cosine", "as_schedule"]


class Schedule:
    """Base class of the built-in schedules: `schedule(count_tensor) -> lr_tensor`."""

    def __call__(self, count: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


ScheduleLike = float | int | Schedule | Callable[[torch.Tensor], "torch.Tensor | float"]


def _t(count: torch.Tensor) -> torch.Tensor:
    return count.to(platforms.count_dtype(count.device))


@attrs.frozen
class _Constant(Schedule):
    value: float

    def __call__(self, count: torch.Tensor) -> torch.Tensor:
        return torch.full((), self.value, dtype=torch.float32, device=count.device)


@attrs.frozen
class _Linear(Schedule):
    init: float
    end: float
    steps: int

    def __call__(self, count: torch.Tensor) -> torch.Tensor:
        frac = torch.clamp(_t(count) / max(self.steps, 1), 0.0, 1.0)
        return (self.init + (self.end - self.init) * frac).to(torch.float32)


@attrs.frozen
class _Cosine(Schedule):
    init: float
    steps: int
    end: float

    def __call__(self, count: torch.Tensor) -> torch.Tensor:
        frac = torch.clamp(_t(count) / max(self.steps, 1), 0.0, 1.0)
        return (self.end + (self.init - self.end) * 0.5 * (1 + torch.cos(math.pi * frac))).to(torch.float32)


@attrs.frozen
class _WarmupCosine(Schedule):
    peak: float
    warmup: int
    total: int
    end: float
    init: float

    def __call__(self, count: torch.Tensor) -> torch.Tensor:
        t = _t(count)
        warm = self.init + (self.peak - self.init) * t / max(self.warmup, 1)
        frac = torch.clamp((t - self.warmup) / max(self.total - self.warmup, 1), 0.0, 1.0)
        decay = self.end + (self.peak - self.end) * 0.5 * (1 + torch.cos(math.pi * frac))
        return torch.where(t < self.warmup, warm, decay).to(torch.float32)


@checked
def constant(value: float) -> Schedule:
    """The same learning rate at every step."""
    return _Constant(float(value))


@checked
def linear(init: float, end: float, steps: int) -> Schedule:
    """From `init` to `end` linearly over `steps` updates, then `end` (like `LinearLR`)."""
    return _Linear(float(init), float(end), steps)


@checked
def cosine(init: float, steps: int, end: float = 0.0) -> Schedule:
    """Cosine decay from `init` to `end` over `steps` updates (like `CosineAnnealingLR(T_max=steps)`)."""
    return _Cosine(float(init), steps, float(end))


@checked
def warmup_cosine(peak: float, warmup: int, total: int, end: float = 0.0, init: float = 0.0) -> Schedule:
    """Linear warm-up from `init` to `peak` over `warmup` updates, then cosine decay to `end` at `total`."""
    if not 0 <= warmup <= total:
        raise ValueError(f"warmup_cosine: need 0 <= warmup <= total, got warmup={warmup}, total={total}")
    return _WarmupCosine(float(peak), warmup, total, float(end), float(init))


def as_schedule(lr: ScheduleLike) -> Callable[[torch.Tensor], torch.Tensor]:
    """A float becomes `constant(lr)`; a callable is wrapped so it always returns a float32 0-d tensor."""
    if isinstance(lr, bool):
        raise TypeError("learning rate must be a float or a schedule, got bool")
    if isinstance(lr, (int, float)):
        if not lr >= 0:  # also NaN
            raise ValueError(
                f"learning rate must be >= 0, got {lr} (the update already subtracts lr * direction)"
            )
        return constant(float(lr))
    if isinstance(lr, Schedule):
        return lr
    if callable(lr):
        fn = lr

        def wrapped(count: torch.Tensor) -> torch.Tensor:
            return torch.as_tensor(fn(count), dtype=torch.float32, device=count.device)

        wrapped.__qualname__ = getattr(fn, "__qualname__", "schedule")
        return wrapped
    raise TypeError(f"learning rate must be a float or a callable step -> lr, got {type(lr).__name__}")
