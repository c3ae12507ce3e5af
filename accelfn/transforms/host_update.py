"""The host side of `af.offload`: the optimizer update run in host memory (ZeRO-Offload's data path).

`HostUpdater` runs each step's update right after its backward. `DelayedHostUpdater` runs it one step late, on
a host thread while the device computes the next step's forward and backward (ZeRO-Offload's delayed parameter
update): the host update and the device step overlap instead of taking turns.

Example:
    >>> import torch
    >>> from accelfn.transforms.host_update import to_host
    >>> to_host(torch.ones(2), copy=True).device.type
    'cpu'
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import attrs
import torch

from .. import dry_mode, platforms
from .. import tree as _tree
from ..dtensor import is_dtensor
from ..engine.contract import Updater
from ..optim import GradientTransformation, apply_gradients
from ..optim.base import apply_gradients_on_shards

if TYPE_CHECKING:
    from ..state import TrainState

__all__ = [
    "to_host",
    "share_of_cores",
    "host_threads",
    "HostUpdater",
    "DelayedHostUpdater",
    "MASTER_KEY",
    "PENDING_KEY",
]

MASTER_KEY = "offload_master"
PENDING_KEY = "offload_pending"


def to_host(t: torch.Tensor, *, copy: bool = False, pin: bool = False) -> torch.Tensor:
    """A host copy of `t` (`copy`: even when it is on the host already), in pinned memory with `pin`."""
    if pin:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True).copy_(t.detach())
    # (a dry run of a device job: `t` stands for a device tensor, so it is copied as the real run copies it)
    return t.detach().to("cpu", copy=copy or not platforms.is_host(t.device) or dry_mode.models_a_device())


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (expert parallel's experts), a plain tensor as it is."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined,no-any-return]


def _apply(tx: GradientTransformation, grads: Any, opt_state: Any, params: dict[str, torch.Tensor]) -> Any:
    """`apply_gradients`, on each rank's local pieces where DTensors are among the params or the state (the state
    keeps its DTensors)."""
    sharded = any(is_dtensor(x) for x in [*params.values(), *_tree.leaves(opt_state)])
    return (apply_gradients_on_shards if sharded else apply_gradients)(tx, grads, opt_state, params)


@attrs.define(eq=False)
class HostUpdater(Updater):
    """Runs the optimizer update in host memory and writes the result back into the device params.

    ZeRO-Offload's data path, with buffers allocated once: each step, the gradients are copied (asynchronously)
    into persistent host buffers — pinned where the platform pins (`pin`), so the copies run on the copy engine —
    one synchronisation, the update by torch's fused multi-threaded CPU kernel on fp32 host params and state, and
    the new params copied back asynchronously (ordered before the next forward on the device's stream). The update
    uses this process's share of the host cores (`share_of_cores`), also when the launcher set
    `OMP_NUM_THREADS=1` for several processes per node.

    The host params are either fp32 master params kept in `state.extra["offload_master"]` (`keep_master`: they
    are checkpointed, and a loaded or replaced state brings its own), or a host mirror of the device params,
    refreshed only when a device param changed outside the update (tracked by tensor version counters, e.g. a
    checkpoint loaded into the state): no parameter copy to the host per step. The mirror holds exactly what the
    device holds (low-precision params are rounded on the host), so results do not depend on its lifetime. On a
    host whose params are already in host memory and without master params, the update runs in place as usual;
    `always_stream` forces the copying path there too (tests).
    """

    keep_master: bool
    pin: bool = False
    always_stream: bool = False
    threads: int | None = None  # host threads for the update (None: this process's share of the cores)
    grad_buffers: dict[str, torch.Tensor] = attrs.Factory(dict)
    mirror: dict[str, torch.Tensor] = attrs.Factory(dict)
    # name -> (id, version) of the device param mirrored
    synced: dict[str, tuple[int, int]] = attrs.Factory(dict)

    def __call__(
        self,
        tx: GradientTransformation,
        grads: dict[str, torch.Tensor],
        opt_state: Any,
        params: dict[str, torch.Tensor],
        extra: dict[str, Any],
    ) -> tuple[Any, dict[str, Any]]:
        device = next(iter(params.values())).device
        fp32 = all(p.dtype == torch.float32 for p in params.values())  # the host state is fp32
        host_only = platforms.is_host(device) and not dry_mode.models_a_device()
        if host_only and fp32 and not self.always_stream and not self.keep_master:
            return _apply(tx, grads, opt_state, params), extra
        with torch.no_grad(), dry_mode.on_host():  # (what it allocates is host memory)
            host_grads = self._grads_to_host(grads)
            host_params, _ = self._host_params(params, extra)
            if not platforms.is_host(
                device
            ):  # the copies into host memory must have landed before the update
                platforms.synchronize(device)
            new_state = self._update(tx, host_grads, opt_state, host_params)
            self._upload(params, host_params)
        return new_state, extra

    def _buffer(self, store: dict[str, torch.Tensor], name: str, like: torch.Tensor) -> torch.Tensor:
        buf = store.get(name)
        if buf is None or buf.shape != like.shape:
            buf = torch.empty(like.shape, dtype=torch.float32, device="cpu", pin_memory=self.pin)
            store[name] = buf
        return buf

    def _grads_to_host(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Start copying `grads` into the persistent fp32 host buffers (asynchronous from a device)."""
        host = {}
        for k, g in grads.items():
            g = _local(g)  # an expert's piece (a DTensor over ep): this rank's experts
            buf = self._buffer(self.grad_buffers, k, g)
            buf.copy_(g.detach(), non_blocking=True)
            host[k] = buf
        return host

    def _host_params(
        self, params: dict[str, torch.Tensor], extra: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], bool]:
        """The host params the update runs on, and whether a copy from the device was started to refresh them."""
        if self.keep_master:
            return extra[MASTER_KEY], False
        host, copied = {}, False
        for k, p in params.items():
            buf = self._buffer(self.mirror, k, _local(p))
            if self.synced.get(k) != (id(p), p._version):  # changed outside the update: read it again
                buf.copy_(_local(p).detach(), non_blocking=True)
                copied = True
            host[k] = buf
        return host, copied

    def _update(
        self,
        tx: GradientTransformation,
        grads: dict[str, torch.Tensor],
        opt_state: Any,
        params: dict[str, torch.Tensor],
    ) -> Any:
        with torch.no_grad(), host_threads(self.threads or share_of_cores()):
            return _apply(tx, grads, opt_state, params)

    def _upload(self, params: dict[str, torch.Tensor], host_params: dict[str, torch.Tensor]) -> None:
        """Start copying the updated host params into the device params (ordered on the device's stream)."""
        with torch.no_grad():
            if not self.keep_master:  # the mirror holds what the device holds: low-precision params rounded
                for k, p in params.items():
                    if p.dtype != torch.float32:
                        host_params[k].copy_(host_params[k].to(p.dtype))
            targets = [_local(p) for p in params.values()]  # DTensors (experts): their local pieces
            torch._foreach_copy_(targets, [_local(host_params[k]) for k in params], non_blocking=True)
            if not self.keep_master:
                self.synced = {k: (id(p), p._version) for k, p in params.items()}


@attrs.define
class _Job:
    """A delayed update running on the host thread, and where its result goes."""

    future: Future[Any]
    params: dict[str, torch.Tensor]  # the device params the result is copied into
    host_params: dict[str, torch.Tensor]
    step: int


@attrs.define
class DelayedHostUpdater(HostUpdater):
    """`HostUpdater` with ZeRO-Offload's delayed parameter update from step `start` on.

    Step t computes its gradients on the params of step t-1's update, while a host thread applies the pending
    gradients of step t-1 (kept in `state.extra["offload_pending"]`, so that a checkpoint resumes exactly); after
    the backward the thread is joined, its params are copied to the device and step t's gradients become the
    pending ones. The gradients are one step stale; steps before `start` update exactly as `HostUpdater`. The host
    thread does not synchronise the device: it waits on an event recorded after the previous step's copies
    (the gradients it reads, the params it overwrites), while the device runs the new step's forward.

    `overlapped(tx, state)` is entered around the whole step by the engine: it starts the pending update, and if
    the step fails or skips its update (fp16 overflow) it completes that update into `state` in place, so the
    state stays valid: the params, optimizer state and (now empty) pending gradients agree. The joined update is
    committed into the state passed in as soon as it is joined, and the new pending gradients are written into
    that state's buffers (a state cloned by `donate=False` keeps its own).
    """

    start: int = 0
    _job: _Job | None = None
    _copied: Any = None  # an event on the device's stream after the last upload and gradient copies
    _pool: ThreadPoolExecutor | None = None
    _delaying: bool = False

    def init_pending(self, trainable: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The empty pending-update entry of a fresh state: fp32 host buffers shaped like the trainable params."""
        grads = {k: self._buffer(self.grad_buffers, k, p).zero_() for k, p in trainable.items()}
        return {"full": torch.zeros((), dtype=torch.int64), "grads": grads}

    @contextlib.contextmanager
    def overlapped(self, tx: GradientTransformation, state: TrainState) -> Iterator[None]:
        self._begin(tx, state)
        try:
            yield
        except BaseException as e:
            try:
                self._settle(state)
            except Exception as failed:  # report the step's own error, with this one attached
                e.add_note(
                    f"af.offload: completing the pending host update failed too; the state is not usable: {failed}"
                )
            raise
        self._settle(state)

    def _begin(self, tx: GradientTransformation, state: TrainState) -> None:
        pending = state.extra.get(PENDING_KEY)
        if not isinstance(pending, dict) or "full" not in pending or "grads" not in pending:
            raise ValueError(
                f"state.extra[{PENDING_KEY!r}] is missing: af.offload(..., delayed_update_from=...) keeps the "
                "gradients of its pending update there. Pass the state returned by this step's init() or its last "
                "call (or a checkpoint of one)"
            )
        step = int(state.step)
        self._delaying = step >= self.start
        if not int(pending["full"]):
            return
        params = {k: state.params[k] for k in pending["grads"]}
        with torch.no_grad():
            host_params, refreshed = self._host_params(params, state.extra)
        device = next(iter(params.values())).device
        if refreshed and not platforms.is_host(
            device
        ):  # a first step, a loaded state, donate=False: wait for the mirror
            platforms.synchronize(device)
        copied, grads, opt_state = self._copied, pending["grads"], state.opt_state

        def work() -> Any:
            if copied is not None:  # the last upload read the host params, and the pending gradients landed
                copied.synchronize()
            return self._update(tx, grads, opt_state, host_params)

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="accelfn-host-update")
        self._job = _Job(self._pool.submit(work), params, host_params, step - 1)

    def _join(self) -> Any:
        """Wait for the pending update, start copying its params to the device; its new optimizer state."""
        job, self._job = self._job, None
        assert job is not None
        try:
            new_state = job.future.result()
        except Exception as e:
            raise RuntimeError(
                f"af.offload: the delayed host update of step {job.step}'s gradients failed: {e}"
            ) from e
        self._upload(job.params, job.host_params)
        return new_state

    def _commit(self, opt_state: Any, extra: dict[str, Any]) -> None:
        """Join the pending update and commit it into the state it started from, in place: the optimizer state's
        leaves take the new values and nothing is pending any more, so that state is valid whatever happens next."""
        new_state = self._join()
        with torch.no_grad():
            for old, new in zip(_tree.leaves(opt_state), _tree.leaves(new_state), strict=True):
                if old is not new:
                    old.copy_(new)
            extra[PENDING_KEY]["full"].zero_()

    def _settle(self, state: TrainState) -> None:
        if self._job is None:  # the step joined it
            return
        self._commit(state.opt_state, state.extra)  # the step failed or skipped its update
        self._copied = _record(next(iter(state.params.values())).device)

    def flush(self, tx: GradientTransformation, state: TrainState) -> None:
        """Apply the pending gradients of `state` now, in place (nothing is pending after)."""
        self._begin(tx, state)
        self._settle(state)

    def __call__(
        self,
        tx: GradientTransformation,
        grads: dict[str, torch.Tensor],
        opt_state: Any,
        params: dict[str, torch.Tensor],
        extra: dict[str, Any],
    ) -> tuple[Any, dict[str, Any]]:
        if self._job is not None:
            self._commit(opt_state, extra)
        device = next(iter(params.values())).device
        buffers = extra[PENDING_KEY]["grads"]
        if not self._delaying:
            opt_state, extra = super().__call__(tx, grads, opt_state, params, extra)
            pending = {"full": torch.zeros((), dtype=torch.int64), "grads": buffers}
        else:
            with torch.no_grad():
                for k, g in grads.items():
                    buffers[k].copy_(g.detach(), non_blocking=True)
            pending = {"full": torch.ones((), dtype=torch.int64), "grads": buffers}
        self._copied = _record(device)
        return opt_state, {**extra, PENDING_KEY: pending}


def _record(device: torch.device) -> Any:
    """An event after the work queued so far on `device`'s current stream (None on the host: copies there are
    synchronous). Where events are not available, waits for the device instead."""
    if platforms.is_host(device):
        return None
    try:
        event = torch.Event(device=device)
        event.record(torch.accelerator.current_stream(device))
        return event
    except (RuntimeError, TypeError, ValueError, AttributeError):
        platforms.synchronize(device)
        return None


def share_of_cores() -> int:
    """This process's share of the host cores it may run on: the cores over the processes of this node
    (`LOCAL_WORLD_SIZE`, set by `accelfn launch`). The launcher sets `OMP_NUM_THREADS=1` for N processes per
    node; the host update, ZeRO-Offload's CPU Adam, is memory-bound work that needs more than one core.

    Example:
        >>> share_of_cores() >= 1
        True
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return max(1, cores // max(1, int(local) if local.isdigit() else 1))


@contextlib.contextmanager
def host_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to at least `n` inside the block (restored after)."""
    before = torch.get_num_threads()
    if n > before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
