"""What one training step allocates, communicates and computes, seen from the dispatcher.

`StepTracker` is a `TorchDispatchMode` that runs on real or fake tensors alike (the dry run and the
validation of the dry run against a real run use the same one):

- memory: every new storage an op returns is an allocation (freed when its storage dies; FSDP's
  `UntypedStorage.resize_` frees and re-allocates are followed too). After the step each allocation gets a
  category (params, buffers, optimizer, grads, comm_buffers, activations, temporary) and one sweep over the
  events gives the peak, the breakdown at the peak and each category's own peak;
- communication: each c10d or functional collective, its group (mapped to mesh axes later) and the bytes
  of its full buffer, as nccl-tests counts them;
- FLOPs: torch's `flop_counter` formulas (and accelfn's for the CPU attention kernel).

DTensor ops are handed back to DTensor (`NotImplemented`), so the tracker sees the local ops and the
collectives DTensor lowers them to, as `CommDebugMode` does.

Example:
    >>> import torch
    >>> from accelfn.dryrun.tracker import StepTracker
    >>> with StepTracker() as t:
    ...     y = torch.ones(256, 256) @ torch.ones(256, 256)
    >>> t.flops, t.peak_bytes
    (33554432, 786432)
"""

from __future__ import annotations

import re
import sys
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import FrameType
from typing import Any, cast

import attrs
import torch
from torch.storage import _StorageBase
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from ..meter import _CPU_ATTENTION
from .timing import FLOP_FORMULAS, OpCost, _math_dtype, _op_io, op_cost
from .wrapped import inner_tensors

__all__ = ["StepTracker", "InitTracker", "Collective", "CATEGORIES", "bus_bytes"]

CATEGORIES = ("params", "buffers", "optimizer", "grads", "comm_buffers", "activations", "temporary")

# af.losses runs in profiler scopes named from here (`accelfn.losses.chunked.scope`); what is allocated inside
# one is the loss's, the row LOSS_ROW of "activations at the peak, by module"
LOSS_SCOPE = "accelfn.losses."
LOSS_ROW = "loss"

# collective kind -> bus-bandwidth factor given the group size n (nccl-tests' PERFORMANCE.md)
_BUS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0 if n > 1 else 0.0,
    "reduce": lambda n: 1.0 if n > 1 else 0.0,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
    "barrier": lambda n: 0.0,
}


def bus_bytes(kind: str, size: int, n: int) -> int:
    """nccl-tests' bus bytes of a collective over `n` ranks whose full buffer is `size` bytes.

    Example:
        >>> bus_bytes("all_reduce", 1000, 4), bus_bytes("all_gather", 1000, 4)
        (1500, 750)
    """
    return round(_BUS[kind](n) * size) if n > 0 else 0


def _nbytes(x: Any) -> int:
    """Bytes a collective moves for `x`: a tensor subclass that wraps others (torchao's float8 tensors, whose dtype
    is the high-precision one they stand for, over 1-byte data) by the tensors it holds, as it communicates them.

    Example:
        >>> _nbytes(torch.ones(4, dtype=torch.bfloat16)), _nbytes([torch.ones(2), torch.ones(2)])
        (8, 16)
    """
    if is_traceable_wrapper_subclass(x):
        return sum(_nbytes(t) for t in inner_tensors(x))
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def _group_of(x: Any) -> tuple[str, int] | None:
    """(group name, size) of a ProcessGroup argument."""
    if isinstance(x, torch.ScriptObject):  # how the dispatcher passes a ProcessGroup
        try:
            x = torch.distributed.ProcessGroup.unbox(x)
        except Exception:  # noqa: BLE001 - another script object (a ReduceOp)
            return None
    name = getattr(x, "group_name", None)
    if name is None or not callable(getattr(x, "size", None)):
        return None
    return str(name), int(x.size())


def _named_group(name: str) -> tuple[str, int]:
    from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

    return name, int(_resolve_process_group(GroupName(name)).size())


# c10d op name -> (kind, where its full buffer is: the bytes of the first or second argument (a tensor or a list
# of them), "_times_n" that times the group size (a per-rank piece), "none" no bytes)
_C10D = {
    "allreduce_": ("all_reduce", "first"),
    "allreduce_coalesced_": ("all_reduce", "first"),
    "_allgather_base_": ("all_gather", "first"),
    "allgather_": ("all_gather", "second_times_n"),
    "allgather_coalesced_": ("all_gather", "second_times_n"),
    "allgather_into_tensor_coalesced_": ("all_gather", "first"),
    "_reduce_scatter_base_": ("reduce_scatter", "second"),
    "reduce_scatter_": ("reduce_scatter", "first_times_n"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "second"),
    "alltoall_base_": ("all_to_all", "second"),
    "alltoall_": ("all_to_all", "second"),
    "broadcast_": ("broadcast", "first"),
    "reduce_": ("reduce", "first"),
    "gather_": ("gather", "second_times_n"),
    "scatter_": ("scatter", "first_times_n"),
    "send": ("send_recv", "first"),
    "recv_": ("send_recv", "first"),
    "barrier": ("barrier", "none"),
}
_FUNCTIONAL = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}


@attrs.define
class Collective:
    """One collective call: its kind, process group (name, size) and full buffer in bytes."""

    kind: str
    group: str
    size: int
    nbytes: int
    phase: str = ""  # the engine phase it ran in (the tracker's `phase`)
    backward: bool = False  # whether autograd's backward ran it
    # its inputs, as `OpCost.reads`: a fused run's write that it reads is kept
    reads: tuple[tuple[int, int, int], ...] = ()

    @property
    def bus_bytes(self) -> int:
        return bus_bytes(self.kind, self.nbytes, self.size)


def _collective(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any) -> Collective | None:
    ns = func.namespace
    name = func._overloadpacket.__name__
    if ns == "c10d" and name in _C10D:
        kind, rule = _C10D[name]
        group = next((g for g in map(_group_of, args) if g is not None), None)
        if group is None:
            return None
        n = group[1]
        first = _nbytes(args[0]) if args else 0
        second = _nbytes(args[1]) if len(args) > 1 else 0
        size = {
            "first": first,
            "second": second,
            "first_times_n": first * n,
            "second_times_n": second * n,
            "none": 0,
        }[rule]
        return Collective(kind, group[0], n, size, reads=_op_io(func, args, kwargs, None)[0])
    if ns == "_c10d_functional" and name in _FUNCTIONAL:
        kind = _FUNCTIONAL[name]
        group_name = next((a for a in reversed(args) if isinstance(a, str)), kwargs.get("group_name"))
        if group_name is None:
            return None
        resolved, n = _named_group(group_name)
        size = _nbytes(args[0])  # all-reduce, reduce-scatter, all-to-all: the input
        if kind == "all_gather":  # the output
            size = _nbytes(kwargs["out"]) if "out" in kwargs else _nbytes(out) or _nbytes(args[0]) * n
        return Collective(kind, resolved, n, size, reads=_op_io(func, args, kwargs, None)[0])
    return None


def _functional_collective(func: Any) -> bool:
    """Whether `func` is a functional collective that makes its output (not one writing into its arguments)."""
    return (
        func.namespace == "_c10d_functional"
        and func._overloadpacket.__name__ in _FUNCTIONAL
        and not func._schema.is_mutable
    )


def _collective_on_copies(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """A functional collective of a real run, on copies of its tensor arguments, waited for, its output copied.

    The backend keeps the tensors it was given: gloo's worker thread drops its references some time after the
    wait has returned, so a storage the program dropped first would be freed on that thread at a point of the
    step that varies from run to run (a rank of a context-parallel step measured a key's all-gather, 48 KiB,
    live at the peak in 2 runs of 12). The copies go to the backend untracked (made while the tracker is not
    on the stack), so the tracked input and output live as long as the program holds them, which is what the
    dry run counts. The collective is waited for at once: a real run measured this way does not overlap it.
    """
    from torch.utils._pytree import tree_map_only

    wait = torch.ops._c10d_functional.wait_tensor.default
    held = func(
        *tree_map_only(torch.Tensor, torch.clone, args), **tree_map_only(torch.Tensor, torch.clone, kwargs)
    )
    return tree_map_only(torch.Tensor, lambda t: torch.clone(wait(t)), held)


# c10d collectives whose Work gloo runs on its worker thread (every one but point to point: `send` and `recv_`
# complete on the caller's Work, held by the program); each writes its result into its first argument
_C10D_QUEUED = frozenset(_C10D) - {"send", "recv_"}


def _queued_c10d_collective(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether `func` is a c10d collective the backend's worker thread runs, on dense tensors."""
    return (
        func.namespace == "c10d"
        and func._overloadpacket.__name__ in _C10D_QUEUED
        and not any(
            isinstance(t, torch.Tensor) and t.layout != torch.strided for t in tree_flatten((args, kwargs))[0]
        )
    )


def _c10d_on_copies(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """A c10d collective of a real run (DDP's reducer, FSDP2, DeepSpeed, `torch.distributed`'s calls), on
    copies of its tensor arguments, waited for at once; the result is copied into the caller's first argument
    (where every one of them writes it) and a completed Work comes back, whose future holds the caller's tensors
    where the backend's held the copies (DDP's reducer views its gradients from that value).

    As for `_collective_on_copies`: gloo's worker thread drops the tensors of a collective some time after its
    wait has returned, so a storage the program dropped first was freed on that thread at a point of the step
    that varied from run to run. The copies are untracked; the caller's tensors live as long as the program
    holds them."""
    from torch.distributed.distributed_c10d import Work
    from torch.utils._pytree import tree_map, tree_map_only

    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a copy's storage -> (the copy, the caller's)

    def copy(t: torch.Tensor) -> torch.Tensor:
        c = torch.clone(t)
        copies[c.untyped_storage().data_ptr()] = (c, t)
        return c

    # a copy, or a view of one (gloo's all-gather chunks), as the caller's tensor
    def caller_s(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.untyped_storage().data_ptr() not in copies:
            return x
        c, t = copies[x.untyped_storage().data_ptr()]
        if x is c:
            return t
        if c.stride() != t.stride():  # (the copy of a tensor not dense laid out anew)
            return x
        return t.as_strided(x.size(), x.stride(), x.storage_offset() + t.storage_offset())

    c_args, c_kwargs = tree_map_only(torch.Tensor, copy, (args, kwargs))
    out = func(*c_args, **c_kwargs)
    work = Work.unbox(out[-1] if isinstance(out, tuple) else out)
    work.wait()
    if func._overloadpacket.__name__ != "barrier":  # (its tensor is a placeholder)
        for mine, theirs in zip(tree_flatten(args[0])[0], tree_flatten(c_args[0])[0], strict=True):
            if isinstance(mine, torch.Tensor):
                mine.copy_(theirs)
    try:
        value = tree_map(caller_s, work.get_future().value())
    except RuntimeError:  # a Work without a future (gloo's reduce-scatter): the result's tensors
        value = [t for t in tree_flatten(args[0])[0] if isinstance(t, torch.Tensor)]
    done: torch.futures.Future[Any] = torch.futures.Future()
    done.set_result(value)
    boxed = torch._C._distributed_c10d._create_work_from_future(done).boxed()  # type: ignore[attr-defined]
    return (args[0], boxed) if isinstance(out, tuple) else boxed


def fake_scalar(x: torch.Tensor) -> bool | int | float | None:
    """What a host read (`.item()`, `.tolist()`, `float()`) of a fake tensor gives in a dry run: zero of its
    type (None for a real tensor: read it)."""
    if getattr(x, "fake_mode", None) is None and x.device.type != "meta":
        return None
    if x.dtype == torch.bool:
        return False
    return 0.0 if x.dtype.is_floating_point or x.dtype.is_complex else 0


# the most elements a real tensor argument may have for an op on real tensors only to run for real (dry run)
REAL_NUMEL_LIMIT = 1 << 16


def _small_real_args(args: Any, kwargs: Mapping[str, Any]) -> bool:
    """Whether the op's tensor arguments are all real host tensors of at most REAL_NUMEL_LIMIT elements (and
    there is one)."""
    from torch._subclasses.fake_tensor import FakeTensor

    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(
        type(t) is torch.Tensor  # not fake, not a subclass (Parameter, DTensor)
        and not isinstance(t, FakeTensor)
        and t.device.type == "cpu"
        and t.numel() <= REAL_NUMEL_LIMIT
        for t in tensors
    )


# ops whose CPU and CUDA kernels refuse floating inputs of different dtypes but whose meta kernels (so fake
# tensors) do not check (torch 2.13): a dtype mismatch the real first step raises would pass silently
_aten = torch.ops.aten
_DTYPE_CHECKED = frozenset(
    getattr(_aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "addbmm",
        "mv",
        "addmv",
        "dot",
        "vdot",
        "_addmm_activation",
        "convolution",
        "native_layer_norm",
    )  # fmt: skip
    if hasattr(_aten, name)
)


def check_dtypes(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """Raise the error the real kernel raises when `func` (one of the ops above) gets floating tensors of
    different dtypes: the op is run on real one-element tensors of the same dtypes, whose error (that
    kernel's own message) is raised when it is about the dtypes."""
    if func not in _DTYPE_CHECKED:
        return
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    flat, spec = tree_flatten((args, kwargs))
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    if any(
        not isinstance(t, FakeTensor) and type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors
    ):
        return  # a tensor subclass (DTensor, torchao's Float8Tensor) dispatches the op its own way
    if len({t.dtype for t in tensors if t.is_floating_point()}) < 2:
        return
    from torch.utils._pytree import tree_unflatten

    with unset_fake_temporarily():
        tiny = [torch.zeros((1,) * x.ndim, dtype=x.dtype) if isinstance(x, torch.Tensor) else x for x in flat]
        a, kw = tree_unflatten(tiny, spec)
        a = list(a)
        if func is _aten.native_layer_norm.default:
            a[1] = [1] * len(a[1])  # normalized_shape
        elif func is _aten.convolution.default and len(a) == 9:
            a[7], a[8] = [0] * len(a[7]), 1  # output_padding, groups
        try:
            func(*a, **kw)
        except RuntimeError as e:
            text = str(e)
            if "dtype" in text or "scalar type" in text:
                raise RuntimeError(text) from None


class HostReads(TorchDispatchMode):
    """Host reads of fake tensors return zero (counted) instead of failing: a script's `loss.item()`,
    `starts.tolist()` or `if found_inf:` runs on in a dry run.

    With `real_bookkeeping`, an op whose tensor arguments are all small real host tensors runs for real
    instead of under the fake mode: the host bookkeeping on tensors that are real in a dry run (a DeviceMesh's
    rank map, which `af.data` reads to lay out the shards) keeps its values. Tensors the script creates are
    fake (the fake mode makes them), so its data and model stay fake.

    Matrix products, convolutions and layer norms on floating inputs of different dtypes raise the real
    kernel's error (`check_dtypes`): their fake kernels do not check."""

    def __init__(self, *, real_bookkeeping: bool = False) -> None:
        super().__init__()
        self.count = 0
        self.real_bookkeeping = real_bookkeeping

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            value = fake_scalar(args[0])
            if value is not None:
                self.count += 1
                return value
        check_dtypes(func, args, kwargs)
        if self.real_bookkeeping and _small_real_args(args, kwargs):
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


# DTensor's sharding propagation builds example tensors of the global shape from its metadata, under the fake
# mode that is running (and keeps them in its cache): shapes, not memory the step holds
_SHAPE_ONLY = frozenset(
    {"_rebuild_tensor_from_dtensor_meta", "gen_fake_args", "_propagate_tensor_meta_non_cached"}
)


def _in_shape_propagation() -> bool:
    frame: FrameType | None = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return False
        if frame.f_code.co_name in _SHAPE_ONLY:
            return True
        frame = frame.f_back
    return False


_FP8 = frozenset(d for d in vars(torch).values() if isinstance(d, torch.dtype) and "float8" in str(d))


def _fp8_operands(args: tuple[Any, ...]) -> bool:
    """Whether an op multiplies fp8 operands (its FLOPs run at the device's fp8 peak): torchao's float8 training
    tensors (their `mm` runs `_scaled_mm` inside the subclass) or plain fp8 tensors (`timing._math_dtype`)."""
    return any(isinstance(a, torch.Tensor) and _math_dtype(a) in _FP8 for a in args)


def module_pattern(name: str) -> str:
    """A module path without its root's class name and with block numbers folded, for the report.

    Example:
        >>> module_pattern("FSDPLlamaForCausalLM.model.layers.3.mlp")
        'model.layers.*.mlp'
    """
    if not name:
        return "(outside modules)"
    if name == LOSS_ROW:
        return name
    _, _, rest = name.partition(".")
    return re.sub(r"\.\d+(?=\.|$)", ".*", rest or name)


def _memory_tensors(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    """The plain tensors whose storages hold `values`' memory: a wrapper tensor subclass (torchao's float8
    tensors) by its inner tensors (its own storage is a placeholder of its reported dtype's size: a float8
    training tensor of bf16 would count 2 bytes an element on top of its 1-byte data), others as they are."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    for t in values:
        if not isinstance(t, torch.Tensor):
            continue
        # DTensor's local tensor is seen where it is made; an AsyncCollectiveTensor's `elem` is its collective's
        # output, which the tracker already holds as a communication buffer (descending into it counted a tp
        # run's sequence-parallel outputs again: 264,192 B more than the real run on the dp=2 x tp=2 case)
        if is_traceable_wrapper_subclass(t) and type(t).__name__ not in ("DTensor", "AsyncCollectiveTensor"):
            yield from _memory_tensors(inner_tensors(t))
        else:
            yield t


def _held_storage(t: torch.Tensor, fake_mode: Any) -> torch.UntypedStorage | None:
    """The storage `t` holds memory in, for a tracker of the run whose fake mode is `fake_mode`: None for meta
    tensors, another fake mode's (torch's own shape propagation) and storage-less tensors."""
    mode = getattr(t, "fake_mode", None)
    if t.device.type == "meta" or (mode is not None and mode is not fake_mode):
        return None
    try:
        return t.untyped_storage()
    except Exception:  # noqa: BLE001 - sparse or other storage-less tensors
        return None


def _on_free(free: Callable[[int], None], key: int) -> Callable[[Any], None]:
    """A weak reference's callback: `free(key)` when the storage dies."""

    def callback(_ref: Any) -> None:
        free(key)

    return callback


@attrs.define(eq=False)
class _Alloc:
    nbytes: int
    phase: str
    module: str
    comm: bool = False
    resized: bool = False
    ref: Any = None
    category: str | None = None
    host: bool = False  # host memory in the real run (af.offload's state and buffers): not the device's
    stream: str = ""  # the CUDA stream FSDP2 allocates it on where not the default (see _fsdp_function)


# FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) allocates its all-gather inputs and outputs
# under `all_gather_copy_in_stream` (in `foreach_all_gather`) and its reduce-scatter output under
# `reduce_scatter_stream` (in `foreach_reduce`; the input is allocated on the default stream): the caching
# allocator keeps a pool per stream (accelfn/dryrun/allocator.py)
FSDP_ALL_GATHER_STREAM = "fsdp_all_gather"
FSDP_REDUCE_SCATTER_STREAM = "fsdp_reduce_scatter"


_FSDP_FUNCTIONS = frozenset({"foreach_all_gather", "foreach_reduce"})


def _fsdp_function(depth: int = 24) -> str:
    """The name of FSDP2's collective function (`foreach_all_gather`, `foreach_reduce`) the caller runs inside,
    or ""."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return ""
        code = frame.f_code
        if code.co_name in _FSDP_FUNCTIONS and code.co_filename.endswith("_fsdp_collectives.py"):
            return code.co_name
        frame = frame.f_back
    return ""


_SCOPE_ENTER = torch.ops.profiler._record_function_enter_new.default
_SCOPE_EXIT = torch.ops.profiler._record_function_exit._RecordFunction

_SKIP_OPS = {
    torch.ops.aten.size.default,
    torch.ops.aten.stride.default,
    torch.ops.aten.numel.default,
    torch.ops.aten.dim.default,
    torch.ops.prim.layout.default,
    torch.ops.prim.device.default,
}


class StepTracker(TorchDispatchMode):
    """Memory, collectives and FLOPs of the ops run inside it (one training step; see the module docs).

    `phase` is the engine phase allocations are tagged with (set by the dry run's watcher); `module_name` a
    callable naming the module running now (or None); `fake_mode` the run's own FakeTensorMode.
    """

    def __init__(self, *, module_name: Any = None, fake_mode: Any = None) -> None:
        super().__init__()
        self._fake_mode = fake_mode  # the run's own FakeTensorMode (others, e.g. DTensor's shape propagation's, hold no memory)
        self.phase = "start"
        self._module_name = module_name
        self.flops = 0
        self.fp8_flops = 0  # of them, those of fp8 matmuls (the fp8 peak)
        self.collectives: list[Collective] = []
        # the kernels and collectives in the order they ran, for the time model (accelfn/dryrun/step_time.py)
        self.timeline: list[OpCost | Collective] = []
        self.events: list[tuple[int, int, _Alloc]] = []  # (seq, delta bytes, allocation)
        self._live: dict[int, _Alloc] = {}
        self._live_bytes = 0
        self.peak_bytes = 0
        self.where = "device"  # "host" while the real run allocates host memory (af.offload's update)
        self._host_bytes = 0
        self.host_peak_bytes = 0
        self._seq = 0
        self._registry = {
            **flop_counter.flop_registry,
            **{k: flop_counter.shape_wrapper(f) for k, f in _CPU_ATTENTION.items()},
            **FLOP_FORMULAS,  # the experts' grouped GEMMs (torch counts none)
        }
        self._orig_resize: Any = None
        # the profiler scopes open now (record_function's handles), each with whether it is the loss's
        self._scopes: list[tuple[Any, bool]] = []  # (they close in reverse order: context managers)
        self._in_loss = 0
        # for the caching allocator's replay (accelfn/dryrun/allocator.py): where the step starts in `events`
        # (before: the state it was given) and the records of its state before and after, in the same order
        self.step_start = 0
        self.state_in: list[_Alloc] = []
        self.state_out: list[_Alloc] = []

    # ---- allocations -------------------------------------------------------------------------------------------
    def _event(self, delta: int, rec: _Alloc) -> None:
        if rec.host:
            self._host_bytes += delta
            self.host_peak_bytes = max(self.host_peak_bytes, self._host_bytes)
            return
        self._seq += 1
        self.events.append((self._seq, delta, rec))
        self._live_bytes += delta
        if self._live_bytes > self.peak_bytes:
            self.peak_bytes = self._live_bytes

    def _freed(self, key: int) -> None:
        rec = self._live.pop(key, None)
        if rec is not None and rec.nbytes:
            self._event(-rec.nbytes, rec)

    def _see(self, t: torch.Tensor, *, comm: bool = False) -> _Alloc | None:
        st = _held_storage(t, self._fake_mode)
        if st is None:
            return None
        key = st._cdata
        rec = self._live.get(key)
        if rec is not None:
            rec.comm = rec.comm or comm
            return rec
        if self._in_loss:
            module = LOSS_ROW
        else:
            module = self._module_name() if self._module_name is not None else ""
        rec = _Alloc(st.nbytes(), self.phase, module, comm, host=self.where == "host")
        if _fsdp_function() == "foreach_all_gather":
            rec.stream = FSDP_ALL_GATHER_STREAM
        try:
            rec.ref = weakref.ref(st, _on_free(self._freed, key))
        except TypeError:  # pragma: no cover - storages without weak references
            return None
        self._live[key] = rec
        if rec.nbytes:
            self._event(rec.nbytes, rec)
        return rec

    def _resize(self, st: _StorageBase, size: int) -> Any:
        key = st._cdata
        rec = self._live.get(key)
        before = st.nbytes()
        out = self._orig_resize(st, size)
        after = st.nbytes()
        if rec is None:
            rec = _Alloc(0, self.phase, "", resized=True)
            try:
                rec.ref = weakref.ref(st, _on_free(self._freed, key))
            except TypeError:  # pragma: no cover
                return out
            self._live[key] = rec
            before = 0
        rec.resized = True
        if after != before:
            rec.nbytes = after
            self._event(after - before, rec)
        return out

    def __enter__(self) -> StepTracker:
        self._orig_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st: _StorageBase, size: int) -> Any:
            return tracker._resize(st, size)

        # (torch's stub types resize_ with `self` twice, which no function matches)
        torch.UntypedStorage.resize_ = cast(Any, resize_)  # type: ignore[method-assign]
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    # ---- dispatch ----------------------------------------------------------------------------------------------
    def _scope(self, func: Any, args: Any, kwargs: Any) -> Any:
        """A profiler scope's entry (its name, a handle back) or exit (the handle): the stack of open scopes."""
        out = func(*args, **kwargs)
        if func is _SCOPE_ENTER:
            loss = str(args[0]).startswith(LOSS_SCOPE)
            self._scopes.append((out, loss))
            self._in_loss += loss
            return out
        if self._scopes:  # the innermost (a handle comes back as another object, and has no __eq__)
            self._in_loss -= self._scopes.pop()[1]
        return out

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _SCOPE_ENTER or func is _SCOPE_EXIT:
            return self._scope(func, args, kwargs)
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(t.__name__ == "DTensor" for t in types):
            return NotImplemented  # DTensor lowers it to local ops and collectives, which come back here
        if func in _SKIP_OPS:
            return func(*args, **kwargs)
        if self._fake_mode is None and _functional_collective(func):
            out = _collective_on_copies(func, args, kwargs)
        elif self._fake_mode is None and _queued_c10d_collective(func, args, kwargs):
            out = _c10d_on_copies(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        coll = _collective(func, args, kwargs, out)
        if coll is not None:
            coll.phase, coll.backward = self.phase, torch._C._current_graph_task_id() != -1
            self.collectives.append(coll)
            self.timeline.append(coll)
            for t in _memory_tensors(tree_flatten((args, out))[0]):
                self._see(t, comm=True)
            if coll.kind == "reduce_scatter" and args and _fsdp_function() == "foreach_reduce":
                for t in _memory_tensors(tree_flatten(args[0])[0]):  # the output
                    rec = self._see(t)
                    if rec is not None:
                        rec.stream = FSDP_REDUCE_SCATTER_STREAM
            return out
        if _in_shape_propagation():  # DTensor's propagation runs the op on global-shape examples: no memory,
            return (
                out  # no work (it counted a tp-split embedding's grad whole: 4 + 2 x 8 GiB on a 405B stage)
            )
        packet = func._overloadpacket
        formula = self._registry.get(packet)
        if formula is not None:
            flops = int(formula(*args, **kwargs, out_val=out))
            self.flops += flops
            if _fp8_operands(args):
                self.fp8_flops += flops
        cost = op_cost(func, args, kwargs, out)
        if cost is not None:
            self.timeline.append(cost)
        for t in _memory_tensors(tree_flatten(out)[0]):
            self._see(t)
        return out

    # ---- after the step ----------------------------------------------------------------------------------------
    def label(self, tensors: Iterable[Any], category: str, known_only: bool = False) -> int:
        """Give the storages of `tensors` (live now) `category`; returns their bytes, each storage once.
        `known_only`: only storages the tracker has seen allocated (a relabelling: one it has not seen is not
        counted as allocated now)."""
        seen: set[int] = set()
        total = 0
        for t in _memory_tensors(tensors):
            if known_only:
                st = _held_storage(t, self._fake_mode)
                rec = self._live.get(st._cdata) if st is not None else None
            else:
                rec = self._see(t)
            if rec is None or id(rec) in seen:
                continue
            seen.add(id(rec))
            total += rec.nbytes
            if rec.category is None or category in ("params", "buffers", "optimizer"):
                rec.category = category
        return total

    def mark_comm(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage as a communication buffer (`comm_buffers`), as a collective's operand is."""
        for t in _memory_tensors([tensor]):
            self._see(t, comm=True)

    def records(self, tensors: Iterable[Any]) -> list[_Alloc]:
        """The allocation records of the storages of `tensors`, in order (each storage once)."""
        out: dict[int, _Alloc] = {}
        for t in _memory_tensors(tensors):
            rec = self._see(t)
            if rec is not None:
                out.setdefault(id(rec), rec)
        return list(out.values())

    def _category(self, rec: _Alloc) -> str:
        if rec.category is not None:
            return rec.category
        if rec.comm or rec.resized:
            return "comm_buffers"
        return "activations" if rec.phase == "forward_backward" else "temporary"

    def breakdown(self) -> tuple[int, dict[str, int], dict[str, int], dict[str, int]]:
        """(peak bytes, bytes by category at the peak, each category's own peak, activation bytes live at the
        peak by module, numbers folded: `layers.3.mlp` -> `layers.*.mlp`)."""
        live: dict[str, int] = defaultdict(int)
        own_peak: dict[str, int] = defaultdict(int)
        total = peak = peak_seq = 0
        at_peak: dict[str, int] = {}
        for seq, delta, rec in self.events:
            c = self._category(rec)
            live[c] += delta
            total += delta
            own_peak[c] = max(own_peak[c], live[c])
            if total > peak:
                peak, peak_seq = total, seq
                at_peak = dict(live)
        alive: dict[int, tuple[_Alloc, int]] = {}
        for seq, delta, rec in self.events:
            if seq > peak_seq:
                break
            if self._category(rec) == "activations":
                alive[id(rec)] = (rec, alive.get(id(rec), (rec, 0))[1] + delta)
        by_module: dict[str, int] = defaultdict(int)
        for rec, size in alive.values():
            if size > 0:
                by_module[module_pattern(rec.module)] += size
        return (
            peak,
            {c: max(0, at_peak.get(c, 0)) for c in CATEGORIES},
            {c: own_peak.get(c, 0) for c in CATEGORIES},
            dict(by_module),
        )

    def collectives_by_group(self) -> dict[tuple[str, str], dict[str, int]]:
        """{(kind, group name): {"count", "bytes", "bus_bytes", "size"}} over the step."""
        out: dict[tuple[str, str], dict[str, int]] = {}
        for c in self.collectives:
            row = out.setdefault((c.kind, c.group), {"count": 0, "bytes": 0, "bus_bytes": 0, "size": c.size})
            row["count"] += 1
            row["bytes"] += c.nbytes
            row["bus_bytes"] += c.bus_bytes
        return out


class InitTracker(TorchDispatchMode):
    """The memory a script holds before its first training step (model construction, loading, data,
    `step.init`), split into host and device bytes, each with its peak.

    Allocations are host memory unless made while `where` is `"device"` (the dry run sets it inside
    `step.init`, whose lowering places the model on the mesh's device); `to_device(tensors)` counts the
    storages of tensors built on the host as moved to the device, as the lowering's move does (the host copy
    is freed). `stop()` ends the counting: from then on ops pass through.

    Example:
        >>> import torch
        >>> from accelfn.dryrun.tracker import InitTracker
        >>> with InitTracker() as t:
        ...     w = torch.zeros(1024, 1024)
        ...     t.to_device([w])
        ...     t.where = "device"
        ...     shard = torch.zeros(512, 1024)
        ...     del w
        >>> t.peak
        {'host': 4194304, 'device': 6291456}
    """

    def __init__(self, *, fake_mode: Any = None) -> None:
        super().__init__()
        self._fake_mode = fake_mode
        self.where = "host"
        self.active = True
        self._live: dict[int, list[Any]] = {}  # storage key -> [bytes, where, weakref]
        self.now = {"host": 0, "device": 0}
        self.peak = {"host": 0, "device": 0}

    def _add(self, where: str, delta: int) -> None:
        self.now[where] += delta
        self.peak[where] = max(self.peak[where], self.now[where])

    def _freed(self, key: int) -> None:
        rec = self._live.pop(key, None)
        if rec is not None and self.active:
            self._add(rec[1], -rec[0])

    def _see(self, t: torch.Tensor) -> list[Any] | None:
        st = _held_storage(t, self._fake_mode)
        if st is None:
            return None
        key = st._cdata
        rec = self._live.get(key)
        if rec is not None:
            return rec
        try:
            ref = weakref.ref(st, _on_free(self._freed, key))
        except TypeError:  # pragma: no cover - storages without weak references
            return None
        rec = [st.nbytes(), self.where, ref]
        self._live[key] = rec
        self._add(self.where, rec[0])
        return rec

    def to_device(self, tensors: Iterable[Any]) -> None:
        """Count the storages of `tensors` (those the tracker saw allocated on the host) as on the device now."""
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            key = None
            with _suppress():
                key = t.untyped_storage()._cdata
            rec = self._live.get(key) if key is not None else None
            if rec is not None and rec[1] == "host":
                self._add("host", -rec[0])
                rec[1] = "device"
                self._add("device", rec[0])

    def stop(self) -> None:
        """End the counting (the first training step starts); `peak` keeps its values."""
        self.active = False
        self._live.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.active or isinstance(func, torch._ops.HigherOrderOperator) or func in _SKIP_OPS:
            return func(*args, **kwargs)
        if any(t.__name__ == "DTensor" for t in types):
            return NotImplemented  # its local ops come back here
        out = func(*args, **kwargs)
        if _in_shape_propagation():  # DTensor's propagation of shapes (global-size examples): no memory
            return out
        for t in _memory_tensors(tree_flatten(out)[0]):
            self._see(t)
        return out


def _suppress() -> Any:
    import contextlib

    return contextlib.suppress(Exception)
