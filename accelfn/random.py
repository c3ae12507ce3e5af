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
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "key",
    "split",
    "split_list",
    "fold_in",
    "seed_of",
    "generator",
    "seeded",
    "generator_states",
    "set_generator_states",
]

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
# Keeps fold_in's data hash apart from `key`'s seed hash: with the same hash, fold_in(key(a), b) would equal
# fold_in(key(b), a), and fold_in(key(0), 0) would be key(0) itself.
_FOLD_SALT = 0x5851F42D4C957F2D


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
    if _simulated(k, data):
        return _rankwise(fold_in, k, data)  # type: ignore[no-any-return]
    return _from_int(_mix64(_words(k) ^ _mix64((int(data) & _MASK64) ^ _FOLD_SALT)))


# ---- N ranks in one process (torch's LocalTensorMode): a key per simulated rank ----------------------------
def _per_rank_ints(x: Any) -> dict[int, int] | None:
    ints = getattr(getattr(x, "node", None), "_local_ints", None)
    return ints if isinstance(x, torch.SymInt) and isinstance(ints, dict) else None


def _simulated(k: Any, *args: Any) -> bool:
    """Whether `k` is a key of simulated ranks (a LocalTensor) or an argument a per-rank integer."""
    return hasattr(k, "_local_tensors") or any(_per_rank_ints(a) is not None for a in args)


def _rankwise(fn: Callable[..., Any], k: Any, *args: Any) -> Any:
    """`fn(k, *args)` under torch's LocalTensorMode, where the key (a LocalTensor) or an argument (a rank: a
    SymInt over per-rank integers) differs by simulated rank: `fn` for each rank's part, the results put back
    together (tensors as a LocalTensor, ints as a per-rank SymInt, lists item by item)."""
    from torch.distributed._local_tensor import LocalIntNode, LocalTensor, local_tensor_mode

    mode = local_tensor_mode()
    if mode is None:
        raise RuntimeError("af.random: a key or integer of simulated ranks outside LocalTensorMode")
    parts = getattr(k, "_local_tensors", None)
    with mode.disable():
        out = {
            r: fn(parts[r] if parts is not None else k, *[(_per_rank_ints(a) or {r: a})[r] for a in args])
            for r in sorted(mode.ranks)
        }

    def together(values: dict[int, Any]) -> Any:
        first = next(iter(values.values()))
        if isinstance(first, torch.Tensor):
            return LocalTensor(values)
        if isinstance(first, list):
            return [together({r: v[i] for r, v in values.items()}) for i in range(len(first))]
        return torch.SymInt(LocalIntNode(values)) if len(set(values.values())) > 1 else first

    return together(out)


def split(k: torch.Tensor, num: int = 2) -> torch.Tensor:
    """`num` independent keys derived from `k`, stacked: shape `(num, 2)`."""
    return torch.stack(split_list(k, num))


def split_list(k: torch.Tensor, num: int = 2) -> list[torch.Tensor]:
    """The keys of `split(k, num)` as a list (no stacking or indexing: what a step uses each call)."""
    if _simulated(k):
        return _rankwise(split_list, k, num)  # type: ignore[no-any-return]
    base = _words(k)
    return [_from_int(_mix64(base ^ _mix64((i + 1) * 0xD1B54A32D192ED03 & _MASK64))) for i in range(num)]


def seed_of(k: torch.Tensor) -> int:
    """A 63-bit integer seed for torch generators, derived from the key (a per-rank integer under torch's
    LocalTensorMode when the key differs by simulated rank)."""
    if _simulated(k):
        return _rankwise(seed_of, k)  # type: ignore[no-any-return]
    return _mix64(_words(k)) >> 1


def generator(k: torch.Tensor, device: str | torch.device = "cpu") -> torch.Generator:
    """A `torch.Generator` on `device` seeded from the key, for explicit sampling inside a loss."""
    g = torch.Generator(device=device)
    g.manual_seed(seed_of(k))
    return g


# How `seeded` reaches an accelerator's generators: `accelfn.platforms` registers its `for_device` here when it
# is imported (it is the only place that knows device kinds; this module stays below it in the layers).
_accelerator_rng: Callable[[torch.device], Any] | None = None


def register_accelerator_rng(resolve: Callable[[torch.device], Any]) -> None:
    """Set how `seeded` finds the generator owner (`get_rng_state`, `set_rng_state`, `manual_seed`) of a device."""
    global _accelerator_rng
    _accelerator_rng = resolve


def _accelerators(devices: list[torch.device] | None) -> tuple[list[torch.device], Any]:
    accel = sorted({d for d in devices or [] if d.type not in ("cpu", "meta")}, key=str)
    if not accel:
        return [], None
    if _accelerator_rng is None:
        raise RuntimeError(f"af.random: no platform adapters are loaded for {accel[0]} (import accelfn)")
    return accel, _accelerator_rng(accel[0])


def generator_states(devices: list[torch.device] | None = None) -> torch.Tensor:
    """The states of torch's global generators (CPU, then the accelerators among `devices`) as one uint8
    tensor: what a pipeline stage hands the next one, so that dropout there continues the same stream as in
    one process. `set_generator_states` puts them back.

    Example:
        >>> s = generator_states(); a = torch.rand(2); set_generator_states(s); torch.equal(a, torch.rand(2))
        True
    """
    accel, platform = _accelerators(devices)
    parts = [torch.random.default_generator.get_state()]
    parts += [platform.get_rng_state(d).cpu() for d in accel]
    return torch.cat(parts)


def set_generator_states(states: torch.Tensor, devices: list[torch.device] | None = None) -> None:
    """Set torch's global generators from `generator_states(devices)` (the same `devices`)."""
    states = states.cpu()
    accel, platform = _accelerators(devices)
    sizes = [torch.random.default_generator.get_state().numel()]
    sizes += [platform.get_rng_state(d).numel() for d in accel]
    if states.numel() != sum(sizes) or states.dtype != torch.uint8:
        raise ValueError(
            f"af.random.set_generator_states: {states.numel()} {states.dtype} values for generators of "
            f"{sizes} bytes (devices {accel or ['cpu']})"
        )
    parts = states.split(sizes)
    torch.random.default_generator.set_state(parts[0].clone())
    for d, part in zip(accel, parts[1:]):
        platform.set_rng_state(part.clone(), d)


@contextlib.contextmanager
def seeded(k: torch.Tensor, devices: list[torch.device] | None = None) -> Iterator[None]:
    """Seed torch's global generators (CPU, and the accelerators among `devices`) from `k` inside the
    block, restoring their states afterwards.

    This is how dropout inside a step draws from the state's key without disturbing the caller's RNG.
    The accelerator's generators are reached through its platform adapter (`af.platforms`).
    """
    accel, platform = _accelerators(devices)
    seed = seed_of(k)
    if _per_rank_ints(seed) is not None or _simulating():  # simulated ranks (LocalTensorMode): per rank
        with _seeded_per_rank(seed):
            yield
        return
    cpu_state = torch.random.default_generator.get_state()
    saved = [(d, platform.get_rng_state(d)) for d in accel] if platform is not None else []
    torch.random.default_generator.manual_seed(seed)
    if platform is not None:
        platform.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.default_generator.set_state(cpu_state)
        for d, state in saved:
            assert platform is not None
            platform.set_rng_state(state, d)


def _simulating() -> bool:
    """Whether torch's LocalTensorMode is running (it keeps a generator state per simulated rank)."""
    import sys

    local = sys.modules.get("torch.distributed._local_tensor")
    return local is not None and local.enabled_local_tensor_mode() is not None


@contextlib.contextmanager
def _seeded_per_rank(seed: Any) -> Iterator[None]:
    """`seeded` under torch's LocalTensorMode (a seed per simulated rank, or one for all): its
    `torch.manual_seed` seeds each rank's generator state; the states (the mode's and the real generator's)
    are put back afterwards."""
    from torch.distributed._local_tensor import local_tensor_mode

    mode = local_tensor_mode()
    states = getattr(mode, "_per_rank_rng_states", None)
    saved = dict(states) if isinstance(states, dict) else None
    cpu_state = torch.random.default_generator.get_state()
    torch.manual_seed(seed)  # the mode's own, per rank
    try:
        yield
    finally:
        torch.random.default_generator.set_state(cpu_state)
        if saved is not None and isinstance(states, dict):
            states.clear()
            states.update(saved)
