"""NVIDIA (and ROCm builds of torch, which also use `torch.cuda`): nccl for collectives."""

from __future__ import annotations

import torch

from ._accelerator import TorchAccelerator

__all__ = ["CudaPlatform"]


class CudaPlatform(TorchAccelerator):
    """CUDA GPUs through `torch.cuda`. FP8 is native on compute capability 8.9 (Ada) and newer.

    Example:
        >>> import accelfn as af
        >>> p = af.platforms.get("cuda")
        >>> p.backend, p.visible_devices_env, str(p.device_type)
        ('nccl', 'CUDA_VISIBLE_DEVICES', 'cuda')
    """

    kind = "cuda"
    device_type = "cuda"
    backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"

    def supports_fp8(self) -> bool:
        if not self.is_available() or torch.version.cuda is None:
            return False
        return torch.cuda.get_device_capability() >= (8, 9)
