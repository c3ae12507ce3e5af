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
]

ENV_VAR = ACCELFN_DEVICE
"""Environment variable that forces a device kind (read by `detect`)."""

_PLATFORMS: dict[str, Platform] = {
    p.kind: p for p in (CpuPlatform(), CudaPlatform(), XlaPlatform(), XpuPlatform(), NpuPlatform(), MluPlatform())
}
KINDS: tuple[str, ...] = tuple(_PLATFORMS)
DETECTION_ORDER: tuple[str, ...] = ("xla", "cuda", "xpu", "npu", "mlu", "cpu")


def get(kind: str) -> Platform:
    """The platform for a device kind, e.g. `get("cuda")`; it need not be available on this machine."""
    if not isinstance(kind, str):
        raise TypeError(f"af.platforms.get(): argument 'kind' must be a str, got {type(kind).__name__}")
    try:
        return _PLATFORMS[kind.strip().lower()]
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
    kind = torch.device(device).type
    for platform in _PLATFORMS.values():
        if platform.device_type == kind:
            return platform
    raise ValueError(f"no accelfn platform for device type {kind!r}; the kinds are: {', '.join(_PLATFORMS)}")


def available() -> list[Platform]:
    """The platforms available in this process, in detection order."""
    return [_PLATFORMS[k] for k in DETECTION_ORDER if _PLATFORMS[k].is_available()]


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device`: its platform's `synchronize`, or torch's generic accelerator API
    for a kind accelfn has no adapter for."""
    try:
        platform = for_device(device)
    except ValueError:
        torch.accelerator.synchronize(device)
        return
    platform.synchronize(device)


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
