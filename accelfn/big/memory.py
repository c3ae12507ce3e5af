"""Memory sizes: parse `"10GiB"`-style sizes and `max_memory` dicts; byte sizes of modules, bottom-up."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .. import platforms

__all__ = [
    "parse_size",
    "format_size",
    "parse_max_memory",
    "default_max_memory",
    "tensor_bytes",
    "as_dtype",
    "HOST",
    "DISK",
]

HOST = "cpu"
"""The device name of host memory in device maps and `max_memory`."""
DISK = "disk"
"""The device name of weights left on disk (memory-mapped safetensors) in device maps."""

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(size: int | str, what: str = "size") -> int:
    """Bytes in `size`: an int (bytes) or a string with KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB
    (powers of 1024).

    Example:
        >>> parse_size("1.5GB"), parse_size("2 MiB"), parse_size(10)
        (1500000000, 2097152, 10)
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(f"{what} must be an int (bytes) or a string like '10GiB', got {type(size).__name__}")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"{what} = {size} is negative")
        return size
    m = _SIZE.match(size)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"{what} = {size!r} is not a size; write an int (bytes) or a number with a unit: "
            "KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '10GiB'"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: float) -> str:
    """`n` bytes in the largest binary unit that keeps it >= 1, e.g. `format_size(3 * 2**30) == '3.00 GiB'`."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


def _device_name(key: int | str) -> str:
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise TypeError(f"max_memory key {key!r} must be a device name ('cuda:0', 'cpu', 'disk') or an index")
    if isinstance(key, int):
        platform = platforms.detect()
        if platform.device_type == HOST or not 0 <= key < platform.device_count():
            raise ValueError(
                f"max_memory key {key} names accelerator {key}, but this process sees "
                f"{0 if platform.device_type == HOST else platform.device_count()} accelerator(s); name devices as "
                "strings (e.g. 'cuda:0') to plan for another machine"
            )
        return str(platform.device(key))
    if key in (HOST, DISK):
        return key
    try:
        device = torch.device(key)
    except RuntimeError:
        raise ValueError(
            f"max_memory key {key!r} is not a device name; expected e.g. 'cuda:0', 'cpu' or 'disk'"
        ) from None
    if device.index is None:
        raise ValueError(f"max_memory key {key!r} needs a device index, e.g. '{device.type}:0'")
    return str(device)


def parse_max_memory(max_memory: Mapping[Any, int | str]) -> dict[str, int]:
    """`{device name: bytes}` from a user's `max_memory`, accelerators first (in the order given), then
    `"cpu"`, then `"disk"` (unlimited unless given).

    Example:
        >>> parse_max_memory({"cpu": "1GiB", "cuda:1": "2GB", "cuda:0": 10})
        {'cuda:1': 2000000000, 'cuda:0': 10, 'cpu': 1073741824}
    """
    out: dict[str, int] = {}
    for key, size in max_memory.items():
        name = _device_name(key)
        if name in out:
            raise ValueError(f"max_memory names device {name!r} twice")
        out[name] = parse_size(size, f"max_memory[{key!r}]")
    order = {HOST: 1, DISK: 2}
    return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], 0)))


def default_max_memory() -> dict[str, int]:
    """90% of what each of the platform's accelerators has free, and 90% of the host's free memory."""
    out: dict[str, int] = {}
    platform = platforms.detect()
    if platform.device_type != HOST:
        for i in range(platform.device_count()):
            device = platform.device(i)
            stats = platform.memory_stats(device)
            out[str(device)] = int(
                0.9 * (stats.get("total", 0) - stats.get("reserved", stats.get("allocated", 0)))
            )
    out[HOST] = int(0.9 * _host_available())
    return out


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    stats = platforms.get(HOST).memory_stats()
    return max(stats.get("total", 0) - stats.get("allocated", 0), 0)


def tensor_bytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """Bytes `t` takes, or would take cast to `dtype` (only floating-point tensors are cast)."""
    if dtype is not None and t.is_floating_point():
        return t.numel() * dtype.itemsize
    return t.numel() * t.element_size()


def module_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's own (not its children's) parameters and buffers, by local name."""
    out: list[tuple[str, torch.Tensor]] = [(n, p) for n, p in module._parameters.items() if p is not None]
    out += [(n, b) for n, b in module._buffers.items() if b is not None]
    return out


_DTYPE_NAMES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
}


def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """`dtype` as a `torch.dtype`: also its name (`"bfloat16"`, `"torch.float16"`, `"bf16"`), as transformers'
    `torch_dtype` and Accelerate take it.

    Example:
        >>> as_dtype("bfloat16"), as_dtype("torch.float16"), as_dtype(None)
        (torch.bfloat16, torch.float16, None)
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.removeprefix("torch.")
    found = getattr(torch, _DTYPE_NAMES.get(name, name), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"dtype={dtype!r} is not a torch dtype name (e.g. 'bfloat16', 'float16', 'float32')")
    return found
