"""Shared code for device kinds whose torch module follows `torch.cuda`'s API (cuda, xpu, npu, mlu)."""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import torch

from . import specs
from .base import Platform, import_optional

__all__ = ["TorchAccelerator"]


class TorchAccelerator(Platform):
    """A kind served by `torch.<device_type>` (after importing `package`, when it is an extension)."""

    def module(self) -> ModuleType | None:
        """`torch.<device_type>`, importing the extension package first; None when it is not installed."""
        if self.package is not None and import_optional(self.package) is None:
            return None
        return getattr(torch, self.device_type, None)

    def _mod(self) -> Any:
        mod = self.module()
        if mod is None:
            hint = f" (install {self.package})" if self.package else ""
            raise RuntimeError(f"the {self.kind} platform is not available in this torch build{hint}")
        return mod

    def is_available(self) -> bool:
        mod = self.module()
        try:
            return bool(mod is not None and mod.is_available() and mod.device_count() > 0)
        except (RuntimeError, AssertionError):
            return False

    def device_count(self) -> int:
        mod = self.module()
        try:
            return int(mod.device_count()) if mod is not None and mod.is_available() else 0
        except (RuntimeError, AssertionError):
            return 0

    def set_device(self, device: torch.device) -> None:
        self._mod().set_device(device)

    def supports_pinned_memory(self) -> bool:
        return True

    def supports_bf16(self) -> bool:
        fn = getattr(self._mod(), "is_bf16_supported", None)
        return bool(fn()) if fn is not None else True

    def peak_tflops(self, dtype: torch.dtype, device: torch.device | None = None) -> float | None:
        # the device table's row for `get_device_name()` (cuda: NVIDIA, and AMD under ROCm), if it is of this kind
        if not self.is_available():
            return None
        name = getattr(self.module(), "get_device_name", None)
        try:
            row = specs.find(str(name(device))) if name is not None else None
        except (RuntimeError, AssertionError):
            return None
        return specs.peak_tflops(row, dtype) if row is not None and row.kind == self.kind else None

    def memory_stats(self, device: torch.device | None = None) -> dict[str, int]:
        mod = self._mod()
        stats = {
            "allocated": int(mod.memory_allocated(device)),
            "peak_allocated": int(mod.max_memory_allocated(device)),
            "reserved": int(mod.memory_reserved(device)),
        }
        props = getattr(mod, "get_device_properties", None)
        total = (
            getattr(props(device if device is not None else mod.current_device()), "total_memory", None)
            if props
            else None
        )
        if total is not None:
            stats["total"] = int(total)
        return stats

    def get_rng_state(self, device: torch.device | None = None) -> torch.Tensor:
        return self._mod().get_rng_state(device if device is not None else self.device_type)

    def set_rng_state(self, state: torch.Tensor, device: torch.device | None = None) -> None:
        self._mod().set_rng_state(state, device if device is not None else self.device_type)

    def manual_seed(self, seed: int) -> None:
        self._mod().manual_seed_all(seed)

    def empty_cache(self) -> None:
        mod = self.module()
        if mod is not None and mod.is_available():
            mod.empty_cache()

    def synchronize(self, device: torch.device | None = None) -> None:
        self._mod().synchronize(device)

    def is_initialized(self) -> bool:
        # never imports the extension package: one that is not imported yet has started nothing
        if self.package is not None and self.package not in sys.modules:
            return False
        fn = getattr(getattr(torch, self.device_type, None), "is_initialized", None)
        return bool(fn()) if fn is not None else False
