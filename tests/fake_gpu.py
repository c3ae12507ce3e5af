"""A fake GPU for device-placement tests on machines without one.

`fake_gpu()` gives a device kind `fakegpu` (torch's PrivateUse1 backend, renamed, with Python device guards)
whose tensors are `FakeTensor`s: they have shapes, dtypes and a device but no data, so a whole training step
runs in milliseconds, and mixing them with host tensors raises the same "Expected all tensors to be on the same
device" error a CUDA GPU raises (`FakeTensorDeviceMismatchError`). The platform `FAKE_GPU` is an
`af.platforms.Platform` that says what an H100 says (available, FP8 matmuls, pinned memory, overlapped
collectives), registered with `af.platforms.register`, so `af.Mesh(..., device=FAKE_GPU)` lowers steps exactly
as on a GPU. The mesh's process group is torch's fake process group (one rank; collectives do nothing).

Why not a faked `cuda`: on a CPU-only torch build, autograd needs a device guard for the tensors' device, and
the `cuda` one is missing (the backward aborts the process); PrivateUse1 takes a device guard from Python.

Limits: values are unknown, so nothing may read them (`.item()`, `bool(t)`); a module's `.to(device)` under the
fake mode creates new `nn.Parameter` objects (torch's own `_apply` cannot swap fake tensors).

Example:
    with fake_gpu() as gpu:
        model = gpu.module(lambda: torch.nn.Linear(4, 4))     # built on the host, as users do
        batch = gpu.host(torch.randn(2, 4))                  # a host tensor (fake, on "cpu")
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from accelfn import platforms
from accelfn.platforms.base import Platform

DEVICE_TYPE = "fakegpu"
_SET_UP: list[bool] = []
_LIBS: list[Any] = []


class _Stream:
    """A device stream that orders nothing (fake tensors run no kernels): what FSDP2 asks of one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _Event:
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        return None


class _Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None


_CURRENT = _Stream()


class _BackendModule:
    """`torch.fakegpu`: what torch asks of a device module (autocast's dtypes, availability; FSDP2's streams and
    events, which order nothing here)."""

    Stream = _Stream
    Event = _Event

    @staticmethod
    def current_stream(device: Any = None) -> _Stream:
        return _CURRENT

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        return None

    # torch.accelerator reports this backend available once it is registered (for the rest of the process):
    # code that saves and restores the accelerator's RNG state (LocalTensorMode does) asks for these
    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.zeros(16, dtype=torch.uint8)

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        return None


def _setup_backend() -> None:
    if _SET_UP:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    if torch._C._get_privateuse1_backend_name() == "privateuseone":
        _setup_privateuseone_for_python_backend(DEVICE_TYPE, backend_module=_BackendModule())
        # autocast on it is accepted and changes nothing (torch has no autocast kernels for PrivateUse1)
        _LIBS.append(torch.library.Library("_", "IMPL"))
        _LIBS[-1].fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    elif (
        torch._C._get_privateuse1_backend_name() != DEVICE_TYPE
    ):  # pragma: no cover - another backend took it
        raise RuntimeError("the PrivateUse1 backend is already taken by another device kind")
    _SET_UP.append(True)


_setup_backend()  # at import: tests name the device type (`torch.device("fakegpu", 0)`) at module level


class FakeGpuPlatform(Platform):
    """A device kind that claims what an H100 has (used with fake tensors only)."""

    kind = DEVICE_TYPE
    device_type = DEVICE_TYPE
    backend = "fake"

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def supports_fp8(self) -> bool:
        return True

    def supports_pinned_memory(self) -> bool:
        return True

    def overlaps_communication(self) -> bool:
        return True

    def has_fused_optimizer(self) -> bool:
        return False  # torch's fused kernels know cuda/xpu/mps/cpu only

    def memory_stats(self, device: torch.device | None = None) -> dict[str, int]:
        return {}

    def manual_seed(self, seed: int) -> None:
        return None

    def get_rng_state(self, device: torch.device | None = None) -> torch.Tensor:
        return torch.zeros(16, dtype=torch.uint8)

    def set_rng_state(self, state: torch.Tensor, device: torch.device | None = None) -> None:
        return None

    def synchronize(self, device: torch.device | None = None) -> None:
        return None

    def process_group_kwargs(self) -> dict[str, Any]:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        return {"backend": "fake", "store": FakeStore(), "rank": 0, "world_size": 1}


FAKE_GPU = FakeGpuPlatform()


def _fake_apply(
    self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
) -> nn.Module:
    """`nn.Module._apply` for fake tensors: new Parameter objects instead of swapping (ties are kept)."""
    done: dict[int, Any] = {}
    for module in self.modules() if recurse else [self]:
        for key, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                with torch.no_grad():
                    new = nn.Parameter(fn(p), requires_grad=p.requires_grad)
                done[id(p)] = new
            module._parameters[key] = done[id(p)]
        for key, b in list(module._buffers.items()):
            if b is not None:
                if id(b) not in done:
                    done[id(b)] = fn(b)
                module._buffers[key] = done[id(b)]
    return self


def _real(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run outside the fake mode: accelfn's random keys are host integers that a step reads each call."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    return wrapper


class FakeGpu:
    """What `fake_gpu()` yields: the fake mode, the platform, and helpers to make host inputs."""

    def __init__(self, mode: Any) -> None:
        self.mode = mode
        self.platform = FAKE_GPU
        self.device = torch.device(DEVICE_TYPE, 0)

    def host(self, tree: Any) -> Any:
        """Host (cpu) fake copies of the tensors of `tree` (a batch as a data loader yields it)."""
        return torch.utils._pytree.tree_map(
            lambda t: self.mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, tree
        )

    def module(self, build: Callable[[], nn.Module]) -> nn.Module:
        """Build a module on the host inside the fake mode (its tensors are fake, on "cpu")."""
        with self.mode:
            return build()

    def mesh(self, shape: dict[str, int] | None = None) -> Any:
        """A one-rank `af.Mesh` on the fake GPU (torch's fake process group)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        import accelfn as af

        with unset_fake_temporarily():  # the device mesh holds real rank tensors
            return af.Mesh(shape or {"dp": -1}, device=FAKE_GPU)


@contextlib.contextmanager
def fake_gpu() -> Iterator[FakeGpu]:
    """Fake GPU tensors and platform for the duration of the block (see the module docs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401  (registers "fake")

    import accelfn.random as keys

    _setup_backend()
    platforms.register(FAKE_GPU)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context(_patched())
        patch(nn.Module, "_apply", _fake_apply)
        for name in ("key", "split", "split_list", "fold_in", "seed_of"):
            patch(keys, name, _real(getattr(keys, name)))
        stack.callback(platforms.unregister, FAKE_GPU.kind)
        with mode:
            yield FakeGpu(mode)


@contextlib.contextmanager
def _patched() -> Iterator[Callable[[Any, str, Any], None]]:
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    try:
        yield patch
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
