"""NVIDIA (and ROCm builds of torch, which also use `torch.cuda`): nccl for collectives."""

from __future__ import annotations

import importlib.util

import torch

from . import specs
from ._accelerator import TorchAccelerator

__all__ = ["CudaPlatform", "peak_tflops_of"]


def peak_tflops_of(name: str, dtype: torch.dtype) -> float | None:
    """The dense peak TFLOP/s of the GPU called `name` (`torch.cuda.get_device_name()`: NVIDIA, or AMD under
    ROCm) for `dtype` matmuls, or None when the device table (`accelfn.platforms.specs`) does not know it.

    float32 reads the tf32 figure when torch lets fp32 matmuls use TF32 (`torch.get_float32_matmul_precision()`
    is not "highest"); any float8 dtype reads the fp8 figure.

    Example:
        >>> import torch
        >>> from accelfn.platforms.cuda import peak_tflops_of
        >>> peak_tflops_of("NVIDIA H100 80GB HBM3", torch.bfloat16), peak_tflops_of("NVIDIA H100 PCIe", torch.bfloat16)
        (989.0, 756.0)
        >>> peak_tflops_of("Some Future GPU", torch.bfloat16) is None
        True
    """
    row = specs.find(name)
    return specs.peak_tflops(row, dtype) if row is not None and row.kind == "cuda" else None


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
    # "CUDA out of memory" / "HIP out of memory"; cuDNN and cuBLAS word a failed workspace allocation this way
    oom_messages = ("out of memory", "cudnn_status_not_supported", "cublas_status_alloc_failed")

    def supports_fp8(self) -> bool:
        if not self.is_available() or torch.version.cuda is None:
            return False
        return torch.cuda.get_device_capability() >= (8, 9)

    def grouped_mm_dtypes(self) -> tuple[torch.dtype, ...]:
        if not self.is_available() or torch.version.cuda is None or not hasattr(torch, "_grouped_mm"):
            return ()
        return (torch.bfloat16,) if torch.cuda.get_device_capability() >= (9, 0) else ()

    def fp8_grouped_mm(self) -> str | None:
        if not self.is_available() or torch.version.cuda is None:
            return None
        major = torch.cuda.get_device_capability()[0]
        if major == 10:  # B200/GB200: torchao's mxfp8 kernels
            return "mxfp8"
        if major == 9 and importlib.util.find_spec("triton") is not None:  # H100/H200: quantized by triton
            return "rowwise"
        return None

    def pins_host_copies(self) -> bool:
        return self.is_available()

    def record_memory_history(self, enabled: bool) -> bool:
        if not self.is_available():
            return False
        if enabled:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        else:
            torch.cuda.memory._record_memory_history(enabled=None)
        return True

    def dump_memory_history(self, path: str) -> None:
        # torch's snapshot format is a pickle, written only for torch's viewer (https://pytorch.org/memory_viz);
        # accelfn never reads it back.
        torch.cuda.memory._dump_snapshot(path)
