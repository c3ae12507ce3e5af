"""Intel GPUs through `torch.xpu` (built into torch): xccl for collectives."""

from __future__ import annotations

from ._accelerator import TorchAccelerator

__all__ = ["XpuPlatform"]


class XpuPlatform(TorchAccelerator):
    """Intel GPUs. `ZE_AFFINITY_MASK` selects the visible devices.

    Example:
        >>> import accelfn as af
        >>> af.platforms.get("xpu").backend
        'xccl'
    """

    kind = "xpu"
    device_type = "xpu"
    backend = "xccl"
    visible_devices_env = "ZE_AFFINITY_MASK"
