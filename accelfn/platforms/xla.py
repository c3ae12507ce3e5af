"""TPUs (and other PJRT devices) through `torch_xla`: the `xla` collective backend."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from . import specs
from .base import Platform, import_optional

__all__ = ["XlaPlatform"]


class XlaPlatform(Platform):
    """XLA devices via torch_xla's PJRT runtime, imported only when this kind is asked about.

    Available when `torch_xla` imports and its runtime reports a device type (`PJRT_DEVICE`, e.g. `TPU`).

    Example:
        >>> import accelfn as af
        >>> p = af.platforms.get("xla")
        >>> p.backend, p.visible_devices_env
        ('xla', 'TPU_VISIBLE_CHIPS')
    """

    kind = "xla"
    device_type = "xla"
    backend = "xla"
    visible_devices_env = "TPU_VISIBLE_CHIPS"
    package = "torch_xla"
    # PJRT: "RESOURCE_EXHAUSTED: Out of memory while trying to allocate ..." / "... Attempting to reserve ..."
    oom_messages = ("out of memory", "resource_exhausted")

    def _runtime(self) -> Any:
        if import_optional("torch_xla") is None:
            return None
        return importlib.import_module("torch_xla.runtime")

    def _xm(self) -> Any:
        if import_optional("torch_xla") is None:
            raise RuntimeError("the xla platform needs torch_xla (pip install torch_xla)")
        return importlib.import_module("torch_xla.core.xla_model")

    def is_available(self) -> bool:
        xr = self._runtime()
        try:
            return bool(xr is not None and xr.device_type())
        except RuntimeError:
            return False

    def device_count(self) -> int:
        if not self.is_available():
            return 0
        xr = self._runtime()
        count = getattr(xr, "addressable_runtime_device_count", None)
        return int(count()) if count is not None else len(self._xm().get_xla_supported_devices())

    def peak_tflops(self, dtype: torch.dtype, device: torch.device | None = None) -> float | None:
        # the device table's row for PJRT's device kind ("TPU v5 lite", "TPU v5")
        if not self.is_available():
            return None
        kind = getattr(self._xm(), "xla_device_kind", None)
        try:
            row = specs.find(str(kind(device))) if kind is not None else None
        except RuntimeError:
            return None
        return specs.peak_tflops(row, dtype) if row is not None and row.kind == self.kind else None

    def process_group_kwargs(self) -> dict[str, Any]:
        importlib.import_module("torch_xla.distributed.xla_backend")  # registers the "xla" backend
        return {"backend": self.backend, "init_method": "xla://"}

    def memory_stats(self, device: torch.device | None = None) -> dict[str, int]:
        info = self._xm().get_memory_info(device if device is not None else self.device())
        if "bytes_used" in info:
            out = {"allocated": int(info["bytes_used"]), "total": int(info["bytes_limit"])}
            if "peak_bytes_used" in info:
                out["peak_allocated"] = int(info["peak_bytes_used"])
            return out
        return {
            "allocated": int(info["kb_total"] - info["kb_free"]) * 1024,
            "total": int(info["kb_total"]) * 1024,
        }

    def get_rng_state(self, device: torch.device | None = None) -> torch.Tensor:
        return torch.tensor(int(self._xm().get_rng_state(device)), dtype=torch.int64)

    def set_rng_state(self, state: torch.Tensor, device: torch.device | None = None) -> None:
        self._xm().set_rng_state(int(state), device)

    def manual_seed(self, seed: int) -> None:
        self._xm().set_rng_state(seed)

    def synchronize(self, device: torch.device | None = None) -> None:
        xm = self._xm()
        xm.mark_step()
        xm.wait_device_ops()
