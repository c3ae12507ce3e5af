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
    # "XPU out of memory. Tried to allocate ..."; Level Zero: "UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY"
    oom_messages = ("out of memory", "out_of_device_memory", "out_of_host_memory")
