"""Cambricon MLUs through the `torch_mlu` extension: cncl for collectives."""

from __future__ import annotations

from ._accelerator import TorchAccelerator

__all__ = ["MluPlatform"]


class MluPlatform(TorchAccelerator):
    """Cambricon MLUs; `import torch_mlu` registers `torch.mlu`, imported only when this kind is asked about.

    Example:
        >>> import accelfn as af
        >>> p = af.platforms.get("mlu")
        >>> p.backend, p.visible_devices_env
        ('cncl', 'MLU_VISIBLE_DEVICES')
    """

    kind = "mlu"
    device_type = "mlu"
    backend = "cncl"
    visible_devices_env = "MLU_VISIBLE_DEVICES"
    package = "torch_mlu"
    # torch_mlu: "MLU out of memory. Tried to allocate ..."; CNRT: "cnrtErrorNoMem"
    oom_messages = ("out of memory", "cnrterrornomem")
