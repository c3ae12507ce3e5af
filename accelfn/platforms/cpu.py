"""The CPU platform: always available; gloo for collectives."""

from __future__ import annotations

import os
import resource

import torch

from .base import Platform

__all__ = ["CpuPlatform"]


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
