"""NVIDIA (and ROCm builds of torch, which also use `torch.cuda`): nccl for collectives."""

from __future__ import annotations

import re

import torch

from ._accelerator import TorchAccelerator

__all__ = ["CudaPlatform", "PEAK_TFLOPS", "peak_tflops_of"]

# Dense (no 2:4 sparsity) peak TFLOP/s per GPU from NVIDIA's data sheets, by the first pattern that matches
# `torch.cuda.get_device_name()`: bf16/fp16 tensor cores, fp8 tensor cores, tf32 tensor cores (fp32 matmuls
# under `torch.set_float32_matmul_precision("high")`) and plain fp32. A missing entry means "not known".
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"H200 NVL", {"bf16": 835.0, "fp8": 1670.0, "tf32": 417.5, "fp32": 60.0}),
    (r"H200", {"bf16": 989.0, "fp8": 1979.0, "tf32": 494.7, "fp32": 67.0}),
    (r"H100 NVL", {"bf16": 835.0, "fp8": 1670.0, "tf32": 417.5, "fp32": 60.0}),
    (r"H100 PCIe", {"bf16": 756.0, "fp8": 1513.0, "tf32": 378.0, "fp32": 51.0}),
    (r"H100", {"bf16": 989.0, "fp8": 1979.0, "tf32": 494.7, "fp32": 67.0}),  # SXM ("H100 80GB HBM3")
    (r"A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", {"bf16": 362.0, "fp8": 733.0, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL4\b", {"bf16": 121.0, "fp8": 242.0, "tf32": 60.0, "fp32": 30.3}),
    (r"A10G", {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2}),
)

_DTYPE_KEYS = {torch.bfloat16: "bf16", torch.float16: "bf16"}


def peak_tflops_of(name: str, dtype: torch.dtype) -> float | None:
    """The dense peak TFLOP/s of the GPU called `name` for `dtype` matmuls, or None when not in the table.

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
    if dtype == torch.float32:
        key = "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    elif dtype.is_floating_point and dtype.itemsize == 1:
        key = "fp8"
    else:
        key = _DTYPE_KEYS.get(dtype, "")
    for pattern, table in PEAK_TFLOPS:
        if re.search(pattern, name):
            return table.get(key)
    return None


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

    def peak_tflops(self, dtype: torch.dtype, device: torch.device | None = None) -> float | None:
        if not self.is_available() or torch.version.cuda is None:  # ROCm GPUs are not in the table
            return None
        return peak_tflops_of(torch.cuda.get_device_name(device), dtype)

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
