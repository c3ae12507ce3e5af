"""Learning-rate schedules: callables `count -> lr` on 0-d tensors (no recompiles, no host syncs).

`count` is the number of optimizer updates done: update `k` (from 0) uses `schedule(k)`, as a torch optimizer
stepped with its scheduler after each update. Any callable `step -> lr` works too; these print their settings
and match `torch.optim.lr_scheduler`, and the `warmup_*` family and `inverse_sqrt` match transformers'
`get_*_schedule_with_warmup` / `get_inverse_sqrt_schedule` at every update (`from_lambda` takes any
`LambdaLR` lambda). `warmup` and `total` may be fractions: an Accelerate schedule stepped `n` times per update
is the accelfn one with its step counts divided by `n` (see docs/migration.md).

Example:
    >>> import torch, accelfn as af
    >>> s = af.optim.warmup_cosine(1e-3, warmup=10, total=100)
    >>> [round(float(s(torch.tensor(t))), 6) for t in (0, 5, 10, 100)]
    [0.0, 0.0005, 0.001, 0.0]
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import attrs
import torch

from .. import platforms
from .._typecheck import checked

__all__ = [
    "Schedule",
    "ScheduleLike",
    "WarmupPastTotalWarning",
    "constant",
    "linear",
    "cosine",
    "warmup_cosine",
    "warmup_linear",
    "warmup_constant",
    "warmup_polynomial",
    "warmup_cosine_restarts",
    "inverse_sqrt",
    "from_lambda",
    "as_schedule",
]


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
    warmup: float
    total: float
    end: float
    init: float

    def __call__(self, count: torch.Tensor) -> torch.Tensor:
        t = _t(count)
        warm = self.init + (self.peak - self.init) * t / max(self.warmup, 1)
        frac = torch.clamp((t - self.warmup) / max(self.total - self.warmup, 1), 0.0, 1.0)
        decay = self.end + (self.peak - self.end) * 0.5 * (1 + torch.cos(math.pi * frac))
        return torch.where(t < self.warmup, warm, decay).to(torch.float32)


def _warmup(t: torch.Tensor, warmup: float) -> torch.Tensor:
    """transformers' warm-up factor `t / max(1, warmup)`."""
    return t / max(1.0, warmup)


def _progress(t: torch.Tensor, warmup: float, total: float) -> torch.Tensor:
    """transformers' decay progress `(t - warmup) / max(1, total - warmup)` (not clamped)."""
    return (t - warmup) / max(1.0, total - warmup)


@attrs.frozen
class _WarmupLinear(Schedule):
    peak: float
    warmup: float
    total: float

    def __call__(self, count: torch.Tensor) -> torch.Tensor:
        t = _t(count)
        decay = torch.clamp((self.total - t) / max(1.0, self.total - self.warmup), min=0.0)
        return (self.peak * torch.where(t < self.warmup, _warmup(t, self.warmup), decay)).to(torch.float32)


@attrs.frozen
class _WarmupConstant(Schedule):
    peak: float
    warmup: float

    def __call__(self, count: torch.Tensor) -> torch.Tensor:
        t = _t(count)
        return (self.peak * torch.where(t < self.warmup, _warmup(t, self.warmup), 1.0)).to(torch.float32)


@attrs.frozen
class _WarmupPolynomial(Schedule):
    peak: float
    warmup: float
    total: float
    end: float
    power: float

    def __call__(self, count: torch.Tensor) -> torch.Tensor:
        t = _t(count)
        remaining = torch.clamp(1 - (t - self.warmup) / (self.total - self.warmup), 0.0, 1.0)
        decay = torch.where(
            t > self.total, self.end, (self.peak - self.end) * remaining**self.power + self.end
        )
        lr = torch.where(t < self.warmup, self.peak * _warmup(t, self.warmup), decay)
        return lr.to(torch.float32)


@attrs.frozen
class _WarmupCosineRestarts(Schedule):
    peak: float
    warmup: float
    total: float
    cycles: int

    def __call__(self, count: torch.Tensor) -> torch.Tensor:
        t = _t(count)
        progress = _progress(t, self.warmup, self.total)
        wave = 0.5 * (1 + torch.cos(math.pi * torch.remainder(self.cycles * progress, 1.0)))
        decay = torch.where(progress >= 1.0, torch.zeros_like(wave), wave)
        return (self.peak * torch.where(t < self.warmup, _warmup(t, self.warmup), decay)).to(torch.float32)


@attrs.frozen
class _InverseSqrt(Schedule):
    peak: float
    warmup: float
    timescale: float

    def __call__(self, count: torch.Tensor) -> torch.Tensor:
        t = _t(count)
        decay = 1 / torch.sqrt(
            torch.clamp(t + (self.timescale - self.warmup), min=self.timescale) / self.timescale
        )
        return (self.peak * torch.where(t < self.warmup, _warmup(t, self.warmup), decay)).to(torch.float32)


@attrs.frozen
class _FromLambda(Schedule):
    lr: float
    fn: Callable[[int], float]
    steps: int | None
    # lr * fn(k) for k in 0..steps, on the host, and its copies on the devices the schedule was called on
    table: torch.Tensor | None = attrs.field(default=None, eq=False, repr=False)
    _copies: dict[torch.device, torch.Tensor] = attrs.field(factory=dict, eq=False, repr=False)

    def __call__(self, count: torch.Tensor) -> torch.Tensor:
        if self.table is None:  # evaluated on the host, as LambdaLR does: one sync per update
            return torch.tensor(
                self.lr * float(self.fn(int(count))), dtype=torch.float32, device=count.device
            )
        table = self._copies.get(count.device)
        if table is None:
            table = self._copies.setdefault(count.device, self.table.to(count.device))
        return torch.take(table, torch.clamp(count, 0, self.steps))


def _check(name: str, **args: float) -> None:
    for arg, value in args.items():
        if not (math.isfinite(value) and value >= 0):  # also NaN
            raise ValueError(f"{name}: {arg} must be a finite number >= 0, got {arg}={value}")


class WarmupPastTotalWarning(UserWarning):
    """A `warmup_*` schedule whose warm-up is longer than its training: the warm-up never ends."""


def _check_warmup(name: str, warmup: float, total: float, transformers_name: str) -> None:
    """Warn when `warmup > total`: the lr still rises at `total` (to `peak * total / warmup`) and drops to the
    decay's end from `warmup` on, as transformers' function computes it (which accepts it without a word)."""
    if warmup > total:
        warnings.warn(
            f"{name}: warmup={warmup} > total={total}: the warm-up never ends, the lr reaches "
            f"{total / max(1.0, warmup):.3g} x peak at total (as transformers' {transformers_name} gives; "
            "often a warm-up counted in another unit than the training, e.g. on small data)",
            WarmupPastTotalWarning,
            stacklevel=3,
        )


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
def warmup_cosine(peak: float, warmup: float, total: float, end: float = 0.0, init: float = 0.0) -> Schedule:
    """Linear warm-up from `init` to `peak` over `warmup` updates, then cosine decay to `end` at `total`.

    With `end=0, init=0` it is transformers' `get_cosine_schedule_with_warmup(opt, warmup, total)` (lr `peak`,
    `num_cycles=0.5`) at every update up to `total`; after `total` it stays at `end`, where transformers' cosine
    climbs back towards `peak` (`from_lambda` gives that curve, or any `num_cycles`, if wanted).

    Example:
        >>> import torch, accelfn as af
        >>> s = af.optim.warmup_cosine(1e-3, warmup=2, total=4)
        >>> [round(float(s(torch.tensor(t))), 6) for t in range(6)]
        [0.0, 0.0005, 0.001, 0.0005, 0.0, 0.0]
    """
    _check("warmup_cosine", peak=peak, warmup=warmup, total=total, end=end, init=init)
    _check_warmup("warmup_cosine", warmup, total, "get_cosine_schedule_with_warmup")
    return _WarmupCosine(float(peak), warmup, total, float(end), float(init))


@checked
def warmup_linear(peak: float, warmup: float, total: float) -> Schedule:
    """Linear warm-up from 0 to `peak` over `warmup` updates, then linear decay to 0 at `total` (and 0 after).

    transformers' `get_linear_schedule_with_warmup(opt, warmup, total)` on an optimizer whose lr is `peak`, also
    with `warmup > total` (with a `WarmupPastTotalWarning`): the warm-up never ends, the lr rises to
    `peak * total / warmup` at `total`, on to `warmup`, and is 0 from `warmup` on.

    Example:
        >>> import torch, accelfn as af
        >>> s = af.optim.warmup_linear(1e-3, warmup=2, total=6)
        >>> [round(float(s(torch.tensor(t))), 6) for t in range(8)]
        [0.0, 0.0005, 0.001, 0.00075, 0.0005, 0.00025, 0.0, 0.0]
    """
    _check("warmup_linear", peak=peak, warmup=warmup, total=total)
    _check_warmup("warmup_linear", warmup, total, "get_linear_schedule_with_warmup")
    return _WarmupLinear(float(peak), warmup, total)


@checked
def warmup_constant(peak: float, warmup: float) -> Schedule:
    """Linear warm-up from 0 to `peak` over `warmup` updates, then `peak`.

    transformers' `get_constant_schedule_with_warmup(opt, warmup)` on an optimizer whose lr is `peak`.

    Example:
        >>> import torch, accelfn as af
        >>> s = af.optim.warmup_constant(1e-3, warmup=4)
        >>> [round(float(s(torch.tensor(t))), 6) for t in range(6)]
        [0.0, 0.00025, 0.0005, 0.00075, 0.001, 0.001]
    """
    _check("warmup_constant", peak=peak, warmup=warmup)
    return _WarmupConstant(float(peak), warmup)


@checked
def warmup_polynomial(
    peak: float, warmup: float, total: float, end: float = 1e-7, power: float = 1.0
) -> Schedule:
    """Linear warm-up from 0 to `peak` over `warmup` updates, then `(peak - end) * remaining**power + end`
    down to `end` at `total` (and `end` after); `remaining` goes from 1 at `warmup` to 0 at `total`.

    transformers' `get_polynomial_decay_schedule_with_warmup(opt, warmup, total, lr_end=end, power=power)` on
    an optimizer whose lr is `peak` (`end` is a learning rate, not a factor).

    Example:
        >>> import torch, accelfn as af
        >>> s = af.optim.warmup_polynomial(1e-3, warmup=1, total=5, end=1e-4, power=2.0)
        >>> [round(float(s(torch.tensor(t))), 6) for t in range(7)]
        [0.0, 0.001, 0.000606, 0.000325, 0.000156, 0.0001, 0.0001]
    """
    _check("warmup_polynomial", peak=peak, warmup=warmup, total=total, end=end, power=power)
    if warmup == total:
        raise ValueError(
            f"warmup_polynomial: warmup must differ from total (the decay divides by total - warmup, and "
            f"transformers' function raises ZeroDivisionError at that step), got warmup={warmup}, total={total}"
        )
    _check_warmup("warmup_polynomial", warmup, total, "get_polynomial_decay_schedule_with_warmup")
    if not end < peak:
        raise ValueError(f"warmup_polynomial: end must be < peak, got end={end}, peak={peak}")
    return _WarmupPolynomial(float(peak), warmup, total, float(end), float(power))


@checked
def warmup_cosine_restarts(peak: float, warmup: float, total: float, cycles: int = 1) -> Schedule:
    """Linear warm-up from 0 to `peak` over `warmup` updates, then `cycles` cosine decays from `peak` to 0, each
    restarting at `peak` (a hard restart), the last ending at `total`; 0 from `total` on.

    transformers' `get_cosine_with_hard_restarts_schedule_with_warmup(opt, warmup, total, num_cycles=cycles)`
    on an optimizer whose lr is `peak`.

    Example:
        >>> import torch, accelfn as af
        >>> s = af.optim.warmup_cosine_restarts(1e-3, warmup=0, total=8, cycles=2)
        >>> [round(float(s(torch.tensor(t))), 6) for t in range(9)]
        [0.001, 0.000854, 0.0005, 0.000146, 0.001, 0.000854, 0.0005, 0.000146, 0.0]
    """
    _check("warmup_cosine_restarts", peak=peak, warmup=warmup, total=total)
    _check_warmup(
        "warmup_cosine_restarts", warmup, total, "get_cosine_with_hard_restarts_schedule_with_warmup"
    )
    if isinstance(cycles, bool) or cycles < 1:
        raise ValueError(f"warmup_cosine_restarts: cycles must be an int >= 1, got cycles={cycles!r}")
    return _WarmupCosineRestarts(float(peak), warmup, total, cycles)


@checked
def inverse_sqrt(peak: float, warmup: float, timescale: float | None = None) -> Schedule:
    """Linear warm-up from 0 to `peak` over `warmup` updates, then `peak / sqrt((t + timescale - warmup) /
    timescale)`: `peak` at `warmup`, halved `3 * timescale` updates later. `timescale` defaults to `warmup`
    (10_000 when `warmup` is 0).

    transformers' `get_inverse_sqrt_schedule(opt, warmup, timescale)` on an optimizer whose lr is `peak`.

    Example:
        >>> import torch, accelfn as af
        >>> s = af.optim.inverse_sqrt(1e-3, warmup=2)
        >>> [round(float(s(torch.tensor(t))), 6) for t in (0, 1, 2, 8, 32)]
        [0.0, 0.0005, 0.001, 0.0005, 0.00025]
    """
    _check("inverse_sqrt", peak=peak, warmup=warmup)
    if timescale is None:
        timescale = warmup or 10_000
    elif not (math.isfinite(timescale) and timescale > 0):
        raise ValueError(f"inverse_sqrt: timescale must be a finite number > 0, got timescale={timescale}")
    return _InverseSqrt(float(peak), warmup, timescale)


@checked
def from_lambda(lr: float, fn: Callable[[int], float], steps: int | None = None) -> Schedule:
    """`lr * fn(count)`: `torch.optim.lr_scheduler.LambdaLR(optimizer, fn)` on an optimizer whose lr is `lr`.

    `fn` takes the update count as a Python `int`, as LambdaLR's lambda does (e.g. `sched.lr_lambdas[0]` of a
    transformers schedule). With `steps`, `fn` is evaluated once, at counts `0..steps`, into a table that the
    schedule looks up on the count's device (no host syncs); counts past `steps` keep the value at `steps`.
    Without `steps`, `fn` runs at every update on the host (one device-to-host sync per update).

    Example:
        >>> import torch, accelfn as af
        >>> s = af.optim.from_lambda(1e-3, lambda k: 0.5**k, steps=3)
        >>> [round(float(s(torch.tensor(t))), 7) for t in range(5)]
        [0.001, 0.0005, 0.00025, 0.000125, 0.000125]
    """
    _check("from_lambda", lr=lr)
    if steps is None:
        return _FromLambda(float(lr), fn, None)
    if steps < 0:
        raise ValueError(f"from_lambda: steps must be >= 0, got steps={steps}")
    values = [float(lr) * float(fn(k)) for k in range(steps + 1)]
    bad = next((k for k, v in enumerate(values) if not (math.isfinite(v) and v >= 0)), None)
    if bad is not None:
        raise ValueError(f"from_lambda: lr * fn({bad}) must be a finite number >= 0, got {values[bad]}")
    return _FromLambda(float(lr), fn, steps, torch.tensor(values, dtype=torch.float32))


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
