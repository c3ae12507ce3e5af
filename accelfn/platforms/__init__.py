"""Device kinds: one small adapter per kind (`cpu`, `cuda`, `xla`, `xpu`, `npu`, `mlu`), and picking one.

`detect()` returns the first available kind in `DETECTION_ORDER` (xla, cuda, xpu, npu, mlu, cpu), unless the
environment variable `ACCELFN_DEVICE` names one (`auto` or unset: detect) (`accelfn launch --cpu` sets `ACCELFN_DEVICE=cpu`).

Example:
    >>> import accelfn as af
    >>> af.platforms.get("cuda").backend, af.platforms.get("cpu").device_type
    ('nccl', 'cpu')
    >>> af.platforms.detect().kind in af.platforms.KINDS
    True
"""

from __future__ import annotations

import os

import torch

from .. import dry_mode
from .. import random as _random
from ..launch_env import ACCELFN_DEVICE
from .base import Platform
from .cpu import CpuPlatform
from .cuda import CudaPlatform
from .mlu import MluPlatform
from .npu import NpuPlatform
from .xla import XlaPlatform
from .xpu import XpuPlatform

__all__ = [
    "Platform",
    "host",
    "synchronize",
    "KINDS",
    "DETECTION_ORDER",
    "ENV_VAR",
    "get",
    "detect",
    "available",
    "from_backend",
    "register",
    "unregister",
    "for_device",
    "is_host",
    "count_dtype",
    "supports_float64",
    "pins_host_copies",
    "tune_allocator",
    "initialized",
]

ENV_VAR = ACCELFN_DEVICE
"""Environment variable that forces a device kind (read by `detect`)."""

_PLATFORMS: dict[str, Platform] = {
    p.kind: p
    for p in (CpuPlatform(), CudaPlatform(), XlaPlatform(), XpuPlatform(), NpuPlatform(), MluPlatform())
}
KINDS: tuple[str, ...] = tuple(_PLATFORMS)
DETECTION_ORDER: tuple[str, ...] = ("xla", "cuda", "xpu", "npu", "mlu", "cpu")


def get(kind: str) -> Platform:
    """The platform for a device kind, e.g. `get("cuda")`; it need not be available on this machine."""
    if not isinstance(kind, str):
        raise TypeError(f"af.platforms.get(): argument 'kind' must be a str, got {type(kind).__name__}")
    try:
        return _PLATFORMS[dry_mode.device_kind(kind.strip().lower())]
    except KeyError:
        raise ValueError(f"unknown device kind {kind!r}; the kinds are: {', '.join(KINDS)}") from None


def register(platform: Platform) -> None:
    """Add a device kind (an out-of-tree accelerator, or a fake one for tests); `get`/`for_device` then know it.

    Example:
        >>> import accelfn as af
        >>> class Mine(af.platforms.Platform):
        ...     kind, device_type, backend = "mine", "mine", "gloo"
        >>> af.platforms.register(Mine()); af.platforms.get("mine").kind
        'mine'
        >>> af.platforms.unregister("mine")
    """
    if not isinstance(platform, Platform):
        raise TypeError(f"af.platforms.register(): expected a Platform, got {type(platform).__name__}")
    if platform.kind in KINDS:
        raise ValueError(f"af.platforms.register(): {platform.kind!r} is a built-in device kind")
    _PLATFORMS[platform.kind] = platform


def unregister(kind: str) -> None:
    """Remove a kind added with `register` (built-in kinds stay)."""
    if kind not in KINDS:
        _PLATFORMS.pop(kind, None)


def for_device(device: torch.device | str) -> Platform:
    """The platform whose tensors live on `device` (e.g. `torch.device("cuda", 0)` -> the cuda platform).

    Example:
        >>> import torch, accelfn as af
        >>> af.platforms.for_device(torch.device("cuda", 1)).kind, af.platforms.for_device("cpu").kind
        ('cuda', 'cpu')
    """
    platform = _find(device)
    if platform is None:
        kind = torch.device(device).type
        raise ValueError(
            f"no accelfn platform for device type {kind!r}; the kinds are: {', '.join(_PLATFORMS)}"
        )
    return platform


def _find(device: torch.device | str) -> Platform | None:
    """`for_device`, or None for a device type no platform serves (`mps`, `meta`)."""
    kind = torch.device(device).type
    for platform in _PLATFORMS.values():
        if platform.device_type == kind:
            return platform
    return None


def available() -> list[Platform]:
    """The platforms available in this process, in detection order."""
    return [_PLATFORMS[k] for k in DETECTION_ORDER if _PLATFORMS[k].is_available()]


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device`: its platform's `synchronize`, or torch's generic accelerator API
    for a kind accelfn has no adapter for."""
    platform = _find(device)
    if platform is None:
        torch.accelerator.synchronize(device)
        return
    platform.synchronize(device)


# af.random.seeded reaches an accelerator's generators through its platform (late-bound: fakes in tests apply)
_random.register_accelerator_rng(lambda device: for_device(device))


def is_host(device: torch.device | str) -> bool:
    """Whether `device` is host memory (the CPU's device type), where copies are synchronous.

    Example:
        >>> import torch, accelfn as af
        >>> af.platforms.is_host(torch.device("cpu")), af.platforms.is_host("cuda:0")
        (True, False)
    """
    return (
        device if isinstance(device, torch.device) else torch.device(device)
    ).type == CpuPlatform.device_type


def count_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype an optimizer's step count is computed in on `device` (bias corrections, schedules): float64 on
    the host, float32 on accelerators (where float64 is slow or missing).

    Example:
        >>> import torch, accelfn as af
        >>> af.platforms.count_dtype(torch.device("cpu")), af.platforms.count_dtype("cuda:0")
        (torch.float64, torch.float32)
    """
    return torch.float64 if is_host(device) else torch.float32


_NO_FLOAT64: frozenset[str] = frozenset({"mps"})
"""torch device types without an accelfn platform that have no float64 (Apple's Metal)."""


def supports_float64(device: torch.device | str) -> bool:
    """Whether tensors on `device` can be float64: its platform's `supports_float64`, or for a device type with
    no platform (`mps`, `meta`), true unless torch has no float64 there.

    Example:
        >>> import accelfn as af
        >>> af.platforms.supports_float64("cpu"), af.platforms.supports_float64("mps")
        (True, False)
    """
    platform = _find(device)
    if platform is not None:
        return platform.supports_float64()
    return torch.device(device).type not in _NO_FLOAT64


def pins_host_copies(device: torch.device | str) -> bool:
    """Whether host copies of tensors on `device` go into pinned memory (its platform's `pins_host_copies`;
    false for a device type with no platform).

    Example:
        >>> import accelfn as af
        >>> af.platforms.pins_host_copies("cpu"), af.platforms.pins_host_copies("meta")
        (False, False)
    """
    platform = _find(device)
    return platform is not None and platform.pins_host_copies()


def tune_allocator(device: torch.device | str) -> bool:
    """Tune the memory allocator that training on `device` uses, once per process (its platform's
    `tune_allocator`: glibc's malloc for the CPU, nothing elsewhere); returns whether it changed anything.

    Example:
        >>> import accelfn as af
        >>> af.platforms.tune_allocator("meta")
        False
    """
    platform = _find(device)
    return platform is not None and platform.tune_allocator()


def initialized() -> list[Platform]:
    """The platforms whose runtime this process has already started (forking after that breaks the children).

    Example:
        >>> import accelfn as af
        >>> af.platforms.get("cpu") in af.platforms.initialized()
        False
    """
    return [p for p in _PLATFORMS.values() if p.is_initialized()]


def host() -> Platform:
    """The platform of host memory and host-side coordination (the CPU's; its backend is gloo).

    Example:
        >>> import accelfn as af
        >>> af.platforms.host().backend
        'gloo'
    """
    return _PLATFORMS["cpu"]


def detect() -> Platform:
    """The platform this process should use: `$ACCELFN_DEVICE` if set (and not `auto`), else the first available in
    `DETECTION_ORDER` (cpu always is)."""
    forced = os.environ.get(ENV_VAR, "").strip()
    if forced and forced.lower() != "auto":
        try:
            platform = get(forced)
        except ValueError as e:
            raise ValueError(f"{ENV_VAR}={forced!r}: {e}") from None
        if not platform.is_available():
            raise RuntimeError(
                f"{ENV_VAR}={forced!r} but no {platform.kind} device is available in this process; "
                f"available: {', '.join(p.kind for p in available())}. Unset {ENV_VAR} or choose one of those."
            )
        return platform
    return available()[0]


def from_backend(backend: str) -> Platform:
    """The platform whose collective backend is `backend` (e.g. `"gloo"` -> cpu, `"nccl"` -> cuda)."""
    for p in _PLATFORMS.values():
        if p.backend == backend.lower():
            return p
    raise ValueError(
        f"no accelfn platform uses the torch.distributed backend {backend!r}; known: "
        + ", ".join(f"{p.backend} ({p.kind})" for p in _PLATFORMS.values())
    )
