"""`Platform`: what accelfn needs to know about one kind of device (the only place that knows device kinds)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any, ClassVar

import torch

__all__ = ["Platform", "import_optional"]


def import_optional(name: str) -> ModuleType | None:
    """Import `name` if it is installed, else None (without importing it when it is absent)."""
    if name in sys.modules:
        return sys.modules[name]
    try:
        if importlib.util.find_spec(name) is None:
            return None
        return importlib.import_module(name)
    except (ImportError, ValueError):
        return None


class Platform:
    """One device kind. Subclasses set the class attributes and override the hardware methods.

    Example:
        >>> import accelfn as af
        >>> cpu = af.platforms.get("cpu")
        >>> cpu.kind, cpu.backend, str(cpu.device(0)), cpu.is_available()
        ('cpu', 'gloo', 'cpu', True)
    """

    kind: ClassVar[str]
    """Name used by `ACCELFN_DEVICE`, `af.platforms.get` and `af.Mesh(device=...)`."""
    device_type: ClassVar[str]
    """torch's device type string (`torch.device(device_type, i)`), also used for `init_device_mesh`."""
    backend: ClassVar[str]
    """torch.distributed backend for this kind."""
    visible_devices_env: ClassVar[str | None] = None
    """Environment variable that restricts the devices a process sees (None: no such variable)."""
    package: ClassVar[str | None] = None
    """The extension package that registers this kind with torch (None: built into torch)."""
    oom_messages: ClassVar[tuple[str, ...]] = ("out of memory",)
    """Lower-case pieces of a `RuntimeError`'s message by which this kind reports an allocation failure
    (for backends that raise a plain `RuntimeError` rather than `torch.OutOfMemoryError`)."""

    def __repr__(self) -> str:
        return f"<accelfn platform {self.kind!r}: backend={self.backend}>"

    # ---- discovery ---------------------------------------------------------------------------------------
    def is_available(self) -> bool:
        """Whether this process can use at least one device of this kind."""
        raise NotImplementedError

    def device_count(self) -> int:
        """Number of devices of this kind visible to this process."""
        raise NotImplementedError

    def device(self, local_rank: int = 0) -> torch.device:
        """The device a process with this local rank uses (local ranks wrap around the visible devices)."""
        n = self.device_count()
        if n < 1:
            raise RuntimeError(
                f"no {self.kind} device is visible to this process"
                + (f" (check {self.visible_devices_env})" if self.visible_devices_env else "")
                + "; pick another kind with ACCELFN_DEVICE=cpu or `accelfn launch --cpu`"
            )
        return torch.device(self.device_type, local_rank % n)

    def set_device(self, device: torch.device) -> None:
        """Make `device` this process's current device (before the process group starts)."""

    def process_group_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `torch.distributed.init_process_group` in a launched process."""
        return {"backend": self.backend, "init_method": "env://"}

    # ---- numerics ----------------------------------------------------------------------------------------
    @property
    def autocast_device_type(self) -> str:
        """The `device_type` to pass to `torch.autocast`."""
        return self.device_type

    def supports_bf16(self) -> bool:
        """Whether bfloat16 compute is supported (natively, not emulated)."""
        return True

    def supports_fp8(self) -> bool:
        """Whether FP8 matmuls run natively (otherwise FP8 training works only emulated, for tests)."""
        return False

    def grouped_mm_dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes in which `torch._grouped_mm` runs natively here (MoE experts use it, else a per-expert loop)."""
        return ()

    def fp8_grouped_mm(self) -> str | None:
        """The torchao recipe whose fp8 grouped GEMMs run natively here (MoE experts under `af.autocast_fp8`):
        "rowwise" (`torch._scaled_grouped_mm`, CUDA sm90 with triton), "mxfp8" (CUDA sm100), or None."""
        return None

    def supports_float64(self) -> bool:
        """Whether tensors of this kind can be float64 (e.g. metrics stacked in one wide dtype)."""
        return True

    def supports_pinned_memory(self) -> bool:
        """Whether host memory can be pinned for fast, asynchronous copies to and from this kind's devices."""
        return False

    def pins_host_copies(self) -> bool:
        """Whether host copies of this kind's tensors (async checkpoint staging buffers) are pinned, so the
        device-to-host copies run without blocking (`synchronize` before reading them)."""
        return False

    def overlaps_communication(self) -> bool:
        """Whether starting gradient all-reduces during the backward pass pays off (it does when the
        collectives run on their own engine, as NCCL's do; on CPUs compute and gloo share the cores)."""
        return True

    def peak_tflops(self, dtype: torch.dtype, device: torch.device | None = None) -> float | None:
        """The dense peak TFLOP/s of one device for matmuls in `dtype` (None when not known: `af.Meter` then
        reports no MFU rather than a wrong one)."""
        return None

    def has_fused_optimizer(self) -> bool:
        """Whether torch's fused optimizer kernels (`torch._fused_adamw_`) run on this kind."""
        try:
            from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

            supported = _get_fused_kernels_supported_devices()
        except ImportError:  # pragma: no cover - very old torch
            supported = ["cuda"]
        if "privateuseone" in supported:
            supported.append(torch._C._get_privateuse1_backend_name())
        return self.device_type in supported

    # ---- state -------------------------------------------------------------------------------------------
    def memory_stats(self, device: torch.device | None = None) -> dict[str, int]:
        """Memory figures in bytes, with whichever of these keys the kind reports:
        `allocated`, `peak_allocated`, `reserved`, `total`."""
        raise NotImplementedError

    def get_rng_state(self, device: torch.device | None = None) -> torch.Tensor:
        """This kind's RNG state on `device` (default: the current device), as a CPU tensor."""
        raise NotImplementedError

    def set_rng_state(self, state: torch.Tensor, device: torch.device | None = None) -> None:
        """Restore an RNG state returned by `get_rng_state`."""
        raise NotImplementedError

    def manual_seed(self, seed: int) -> None:
        """Seed this kind's generators on every visible device."""
        raise NotImplementedError

    def record_memory_history(self, enabled: bool) -> bool:
        """Start (or stop) recording every allocation with its stack, for a memory snapshot; returns whether
        this kind can (see `dump_memory_history`)."""
        return False

    def dump_memory_history(self, path: str) -> None:
        """Write the recorded allocation history to `path`, in the format of the kind's own memory viewer."""
        raise NotImplementedError(f"the {self.kind} platform records no memory history")

    def is_out_of_memory(self, exc: BaseException) -> bool:
        """Whether `exc` says that a device of this kind ran out of memory (`af.find_executable_batch_size`
        retries with a smaller batch on these): `torch.OutOfMemoryError` (and `torch.cuda.OutOfMemoryError`,
        the same class), or a `RuntimeError` whose message holds one of `oom_messages`.

        Example:
            >>> import accelfn as af, torch
            >>> cuda = af.platforms.get("cuda")
            >>> cuda.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory.")), cuda.is_out_of_memory(ValueError())
            (True, False)
        """
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        if not isinstance(exc, RuntimeError) or not exc.args:
            return False
        message = str(exc.args[0]).lower()
        return any(piece in message for piece in self.oom_messages)

    def empty_cache(self) -> None:
        """Give the memory that torch's caching allocator holds but does not use back to the device (no-op
        where there is no such cache)."""

    def synchronize(self, device: torch.device | None = None) -> None:
        """Wait until queued work on `device` has finished."""

    def is_initialized(self) -> bool:
        """Whether this process has already started this kind's runtime (a forked child then cannot use it)."""
        return False

    def tune_allocator(self) -> bool:
        """Tune this kind's memory allocator for training, once per process; returns whether it changed
        anything (the CPU's: glibc malloc thresholds, see `accelfn.platforms.cpu.tune_host_allocator`)."""
        return False
