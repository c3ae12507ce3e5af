"""The CPU platform: always available; gloo for collectives."""

from __future__ import annotations

import os
import resource

import torch

from .base import Platform

__all__ = ["CpuPlatform", "tune_host_allocator", "HOST_ALLOCATOR_ENV"]

HOST_ALLOCATOR_ENV = "ACCELFN_HOST_ALLOCATOR"  # "system": leave glibc's malloc settings as they are
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_TUNED: list[bool] = []


def tune_host_allocator() -> bool:
    """Keep glibc's malloc from returning training-size tensor memory to the OS after every step.

    A CPU training step allocates and frees the same large tensors (activations, gradients) each step. glibc
    serves blocks over its dynamic mmap threshold with `mmap` and gives them back with `munmap`, and trims the
    heap's free top: each step then page-faults its memory in again. Measured on this project's CI machine
    (2 cores, MLP 4x1024, batch 64): 16 MB of fresh tensors cost 1.9 ms to allocate and 0.7 ms to free vs
    0.14 ms reused; a plain PyTorch loop took 19.4 ms/step instead of 13.7 ms, and which of two loops in one
    process paid it depended on their interleaving (the 1.1-1.25x "overhead" a harness saw). This sets a fixed
    32 MB mmap threshold and a 256 MB trim threshold (what `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_`
    would), once per process, for the whole process. Returns whether it did (glibc only; `ACCELFN_HOST_ALLOCATOR
    =system` opts out).

    Example:
        >>> from accelfn.platforms.cpu import tune_host_allocator
        >>> isinstance(tune_host_allocator(), bool)
        True
    """
    if _TUNED:
        return _TUNED[0]
    ok = False
    if os.environ.get(HOST_ALLOCATOR_ENV, "").strip().lower() != "system":
        try:
            import ctypes
            import ctypes.util

            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = getattr(libc, "mallopt", None)
            if mallopt is not None:  # glibc (musl and macOS have no mallopt)
                ok = bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(
                    mallopt(_M_TRIM_THRESHOLD, 256 << 20)
                )
        except OSError:
            ok = False
    _TUNED.append(ok)
    return ok


class CpuPlatform(Platform):
    """Host CPU. `device_count()` is 1: the processes of a node share the host.

    Example:
        >>> import accelfn as af
        >>> p = af.platforms.get("cpu")
        >>> p.device_count(), p.autocast_device_type, p.supports_fp8()
        (1, 'cpu', False)
    """

    kind = "cpu"
    device_type = "cpu"
    backend = "gloo"
    visible_devices_env = None
    oom_messages = (
        "defaultcpuallocator: can't allocate memory",
        "defaultcpuallocator: not enough memory",
        "out of memory",
    )

    def is_out_of_memory(self, exc: BaseException) -> bool:
        """Also Python's own `MemoryError` (a host allocation outside torch)."""
        return isinstance(exc, MemoryError) or super().is_out_of_memory(exc)

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def overlaps_communication(self) -> bool:
        # Measured (benchmarks/ddp_scaling.py, 2 processes on 2 cores): all-reducing after the backward pass
        # is 1-7% faster than overlapping (two runs), since gloo's threads compete with the backward for the cores.
        return False

    def tune_allocator(self) -> bool:
        return tune_host_allocator()

    def memory_stats(self, device: torch.device | None = None) -> dict[str, int]:
        stats: dict[str, int] = {"peak_allocated": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            stats["total"] = page * os.sysconf("SC_PHYS_PAGES")
            with open("/proc/self/statm") as f:
                stats["allocated"] = int(f.read().split()[1]) * page
        except (OSError, ValueError, AttributeError):  # not Linux
            pass
        return stats

    def get_rng_state(self, device: torch.device | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device: torch.device | None = None) -> None:
        torch.set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
