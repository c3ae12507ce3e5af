"""Huawei Ascend NPUs through the `torch_npu` extension: hccl for collectives."""

from __future__ import annotations

from ._accelerator import TorchAccelerator

__all__ = ["NpuPlatform"]


class NpuPlatform(TorchAccelerator):
    """Ascend NPUs; `import torch_npu` registers `torch.npu`, imported only when this kind is asked about.

    Example:
        >>> import accelfn as af
        >>> p = af.platforms.get("npu")
        >>> p.backend, p.visible_devices_env
        ('hccl', 'ASCEND_RT_VISIBLE_DEVICES')
    """

    kind = "npu"
    device_type = "npu"
    backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    package = "torch_npu"
    # torch_npu: "NPU out of memory. Tried to allocate ..."; CANN's allocator: error code 207018 / "EL0004"
    oom_messages = ("out of memory", "el0004", "207018")
