"""The hooks a dry run (`accelfn dry-run`, `af.dry_run`) uses to watch a script from outside.

In a normal run no watcher is installed and every hook is one `None` check. During a dry run the engine
reports its phases, training calls go through the watcher (which measures them and stops the script after
the steps asked for), checkpoint saves and tracker writes are skipped and listed, `af.compile` runs eagerly,
and every device kind executes as fake CPU tensors.

Example:
    >>> from accelfn import dry_mode
    >>> dry_mode.active() is None, dry_mode.skip("a checkpoint save")
    (True, False)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "Watcher",
    "active",
    "watching",
    "skip",
    "note",
    "phase",
    "device_kind",
    "real_tensors",
    "on_host",
    "models_a_device",
    "keeps_process_group",
    "comm_buffer",
    "gradients",
    "fp8_support",
    "grouped_mm_dtypes",
    "modelled_device",
]


class Watcher:
    """What a dry run observes; the defaults do what a normal run does."""

    def __init__(self) -> None:
        self.skipped: list[str] = []
        self.notes: list[str] = []
        self.requested_kinds: list[str] = []
        self.moe_layers: list[Any] = []  # MoE dispatchers in the order they first dispatched (`moe_layer`)

    def train_call(self, step: Any, state: Any, batch: Any, call: Callable[[], Any]) -> Any:
        """One call of a training step: `call()` runs it."""
        return call()

    def init_call(self, step: Any, model: Any, call: Callable[[], Any]) -> Any:
        """`step.init(model)`: `call()` lowers the step and returns the initial state."""
        return call()

    def phase(self, name: str, run: Any) -> None:
        """The engine starts phase `name` of a training step (`run` is its `StepRun`)."""

    def device_kind(self, kind: str) -> str:
        """The device kind that executes when the script asks for `kind`."""
        return kind

    def real_tensors(self) -> contextlib.AbstractContextManager[Any]:
        """A block whose tensors must be real (small host-side bookkeeping, e.g. a DeviceMesh's rank map)."""
        return contextlib.nullcontext()

    def on_host(self) -> contextlib.AbstractContextManager[Any]:
        """A block whose allocations are host memory in the real run (a model's init on the host inside
        `step.init`, af.offload's update)."""
        return contextlib.nullcontext()

    def models_a_device(self) -> bool:
        """Whether the real run computes on a device apart from the host (the dry run executes it on the host)."""
        return False

    def comm_buffer(self, tensor: Any) -> None:
        """`tensor` is a communication buffer (a gradient bucket), whatever module's backward allocated it."""

    def gradients(self, tensors: Any) -> None:
        """`tensors` are gradients held between micro-batches (FSDP2's unsharded ones under `no_sync`), not the
        activations of the modules whose backward made them."""

    def keeps_process_group(self) -> bool:
        """Whether closing a `Mesh` keeps the process group (it closes the meshes only): a dry run's fake group
        outlives the script's `with af.Mesh(...)` block, for the micro-batch search that runs after a script
        ended (the dry run destroys the group itself)."""
        return False

    def fp8_support(self, kind: str) -> bool | None:
        """Whether the device of `kind` the run models has FP8 matmuls (its table row has an fp8 figure); None
        where the host answers (no device of that kind is modelled)."""
        return None

    def grouped_mm_dtypes(self) -> tuple[Any, ...] | None:
        """The dtypes in which the modelled device runs `torch._grouped_mm` (MoE experts); None where the host
        answers (no device is modelled)."""
        return None

    def modelled_device(self) -> str | None:
        """The name of the device the run models (its table row's), for messages; None where the host is it."""
        return None

    def untracked(self) -> contextlib.AbstractContextManager[Any]:
        """A block of real tensors the dry run does not measure (its own bookkeeping, which the real run does not
        do: a routing model's sampling)."""
        return contextlib.nullcontext()

    def moe_routing(self) -> str | float:
        """How MoE dispatchers route their rows, which fake tensors do not hold (`accelfn.moe.routing_model`:
        "uniform", "even" or a max/mean factor; a dry run's `Assumptions.moe_routing`)."""
        return "uniform"

    def moe_layer(self, dispatcher: Any) -> int:
        """The MoE layer `dispatcher` routes: its place in the order the dispatchers first dispatched in this run
        (the routing model's seed)."""
        for i, d in enumerate(self.moe_layers):
            if d is dispatcher:
                return i
        self.moe_layers.append(dispatcher)
        return len(self.moe_layers) - 1

    def moe_routed(self, layer: int, counts: Any, rank: int) -> None:
        """MoE layer `layer` routed `counts` ([ep ranks, experts]: each source rank's rows per expert) and the rank
        simulated received the rows of ep rank `rank`'s experts."""


_watcher: Watcher | None = None


def active() -> Watcher | None:
    """The installed watcher, or None outside a dry run."""
    return _watcher


@contextlib.contextmanager
def watching(watcher: Watcher) -> Iterator[Watcher]:
    """Install `watcher` for the duration of the block (one at a time)."""
    global _watcher
    if _watcher is not None:
        raise RuntimeError("a dry run is already running in this process (they do not nest)")
    _watcher = watcher
    try:
        yield watcher
    finally:
        _watcher = None


def skip(what: str) -> bool:
    """True (and `what` listed) in a dry run: the caller skips the side effect, e.g. a checkpoint save."""
    if _watcher is None:
        return False
    if what not in _watcher.skipped:
        _watcher.skipped.append(what)
    return True


def note(text: str) -> None:
    """Record how the dry run differs from the real run here (no-op outside one)."""
    if _watcher is not None and text not in _watcher.notes:
        _watcher.notes.append(text)


def phase(name: str, run: Any) -> None:
    """The engine's phase marker (no-op outside a dry run)."""
    if _watcher is not None:
        _watcher.phase(name, run)


def real_tensors() -> contextlib.AbstractContextManager[Any]:
    """A block that computes with real tensors even in a dry run (whose tensors are otherwise fake)."""
    return contextlib.nullcontext() if _watcher is None else _watcher.real_tensors()


def on_host() -> contextlib.AbstractContextManager[Any]:
    """A block whose allocations are host memory even inside `step.init` (e.g. a model's init on the host)."""
    return contextlib.nullcontext() if _watcher is None else _watcher.on_host()


def models_a_device() -> bool:
    """In a dry run of a job on an accelerator (which executes on the host): True, so that code with a host-only
    shortcut (af.offload's update in place) takes the path the real run takes."""
    return _watcher is not None and _watcher.models_a_device()


def comm_buffer(tensor: Any) -> None:
    """Count `tensor` as a communication buffer in a dry run's memory (no-op outside one): DeepSpeed's gradient
    bucket, allocated by the first gradient's hook, is not the activation of the module whose backward ran."""
    if _watcher is not None:
        _watcher.comm_buffer(tensor)


def gradients(tensors: Any) -> None:
    """Count `tensors` as gradients in a dry run's memory (no-op outside one): FSDP2's unsharded gradients, held
    from one micro-batch to the next under `af.accumulate(..., sync_each_microbatch=False)`."""
    if _watcher is not None:
        _watcher.gradients(tensors)


def keeps_process_group() -> bool:
    """In a dry run: True, so that a `Mesh` closed by the script keeps the fake process group its step's
    collectives hold (the dry run may run the step again after the script ends)."""
    return _watcher is not None and _watcher.keeps_process_group()


def fp8_support(kind: str) -> bool | None:
    """In a dry run modelling a device of `kind` (`accelfn dry-run --device cuda --gpu h100`): whether that device
    has FP8 matmuls, not the host the dry run executes on; None outside a dry run or where none is modelled."""
    return None if _watcher is None else _watcher.fp8_support(kind)


def grouped_mm_dtypes() -> tuple[Any, ...] | None:
    """In a dry run modelling an accelerator: the dtypes its `torch._grouped_mm` takes (`(torch.bfloat16,)` on an
    H100), so that the experts lower as on that device rather than as on the host; None outside a dry run or
    where the host is the device."""
    return None if _watcher is None else _watcher.grouped_mm_dtypes()


def modelled_device() -> str | None:
    """In a dry run modelling an accelerator: its name (`"NVIDIA A100 80GB SXM"`), which messages about the device
    name instead of the host the dry run executes on; None outside a dry run or where the host is the device."""
    return None if _watcher is None else _watcher.modelled_device()


def device_kind(kind: str) -> str:
    """The device kind to execute for a requested `kind` (itself outside a dry run)."""
    return kind if _watcher is None else _watcher.device_kind(kind)
