"""Explicit random keys, JAX-style: a key is a small int64 CPU tensor; `split` and `fold_in` derive new ones.

A step draws its dropout masks from the state's key, so `step(state, batch)` is deterministic.

Example:
    >>> import accelfn as af
    >>> k = af.random.key(0)
    >>> a, b = af.random.split(k)
    >>> bool((a != b).any()), af.random.fold_in(k, 3).shape
    (True, torch.Size([2]))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["key", "split", "fold_in", "seed_of", "generator", "seeded"]

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a bijective, well-mixed 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _words(k: torch.Tensor) -> int:
    if not isinstance(k, torch.Tensor) or k.shape != (2,) or k.dtype != torch.int64:
        raise TypeError(
            f"expected an accelfn random key (int64 tensor of shape (2,), from af.random.key), got "
            f"{type(k).__name__}{tuple(k.shape) if isinstance(k, torch.Tensor) else ''}"
        )
    hi, lo = k.tolist()
    return ((hi & _MASK32) << 32) | (lo & _MASK32)


def _from_int(x: int) -> torch.Tensor:
    return torch.tensor([(x >> 32) & _MASK32, x & _MASK32], dtype=torch.int64)


def key(seed: int) -> torch.Tensor:
    """A new key from an integer seed."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"af.random.key(seed): seed must be an int, got {type(seed).__name__}")
    return _from_int(_mix64(seed & _MASK64))


def fold_in(k: torch.Tensor, data: int) -> torch.Tensor:
    """A key derived from `k` and an integer (a step number, a rank)."""
    return _from_int(_mix64(_words(k) ^ _mix64(int(data) & _MASK64)))


def split(k: torch.Tensor, num: int = 2) -> torch.Tensor:
    """`num` independent keys derived from `k`, stacked: shape `(num, 2)`."""
    base = _words(k)
    return torch.stack([_from_int(_mix64(base ^ _mix64((i + 1) * 0xD1B54A32D192ED03 & _MASK64))) for i in range(num)])


def seed_of(k: torch.Tensor) -> int:
    """A 63-bit integer seed for torch generators, derived from the key."""
    return _mix64(_words(k)) >> 1


def generator(k: torch.Tensor, device: str | torch.device = "cpu") -> torch.Generator:
    """A `torch.Generator` on `device` seeded from the key, for explicit sampling inside a loss."""
    g = torch.Generator(device=device)
    g.manual_seed(seed_of(k))
    return g


@contextlib.contextmanager
def seeded(k: torch.Tensor, devices: list[torch.device] | None = None) -> Iterator[None]:
    """Seed torch's global generators from `k` inside the block, restoring them afterwards.

    This is how dropout inside a step draws from the state's key without disturbing the caller's RNG.
    """
    kinds = {d.type for d in devices or []} - {"cpu", "meta"}
    device_type = kinds.pop() if len(kinds) == 1 else "cuda"
    dev_idx = [d.index or 0 for d in devices or [] if d.type == device_type]
    with torch.random.fork_rng(devices=dev_idx, device_type=device_type):
        seed = seed_of(k)
        torch.random.default_generator.manual_seed(seed)
        if dev_idx:
            mod = getattr(torch, device_type)
            for i in dev_idx:
                with mod.device(i):
                    mod.manual_seed(seed)
        yield
