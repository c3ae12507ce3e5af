"""ZeRO-3 in the dry run: partitioned params fetched and released by DeepSpeed's module hooks and parameter
coordinator, gradients reduce-scattered (see the package docs)."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from ..... import dry_mode

if TYPE_CHECKING:
    pass


from .common import _FAR, ZeroPhases, _Base, _Bucket, _update

__all__ = ["Zero3Sync"]


# ---- ZeRO-3 ---------------------------------------------------------------------------------------------------
@attrs.define(eq=False)
class _P:
    """A ZeRO-3 param: its partition (`ds_tensor`), sizes and DeepSpeed's status."""

    param: nn.Parameter
    name: str
    ds_id: int
    shape: torch.Size
    numel: int
    part: int  # ceil(numel / N): the partition's elements
    persist: bool
    partition: torch.Tensor
    available: bool = False
    active: set[int] = attrs.Factory(set)  # ds_active_sub_modules


def _apply_to_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """DeepSpeed's `apply_to_tensors_only`: `fn` on every tensor of nested tuples, lists and dicts."""
    if isinstance(value, (tuple, list)):
        out = [_apply_to_tensors(fn, v) for v in value]
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return value.__class__(*out)
        return value.__class__(out)
    if isinstance(value, dict):
        for k in list(value):  # in place (a ModelOutput keeps its class)
            value[k] = _apply_to_tensors(fn, value[k])
        return value
    if isinstance(value, torch.Tensor):
        return fn(value)
    return value


class _ZeroParams(dict):  # type: ignore[type-arg]
    """DeepSpeed's `ZeROOrderedDict` (a module's `_parameters`): a param read during the engine's forward
    while partitioned is gathered and becomes an external param of the innermost module running."""

    sync: Any = None

    def __reduce__(self) -> Any:  # a copy of the module holds a plain dict
        return (dict, (dict(self),))

    def __getitem__(self, key: str) -> Any:
        p = super().__getitem__(key)
        if p is not None and self.sync is not None and self.sync.in_forward:
            self.sync.external(p)
        return p


class _PreBackward(torch.autograd.Function):
    """DeepSpeed's `PreBackwardFunctionForModule` on a module's outputs: fetch before its backward."""

    @staticmethod
    def forward(t: torch.Tensor, sync: Any, module: nn.Module) -> torch.Tensor:  # type: ignore[override]
        return t.detach()

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        _, sync, module = inputs
        ctx.sync, ctx.module = sync, module
        sync.pre_bwd_refs[id(module)] += 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.sync.before_backward(ctx.module)
        return grad, None, None


class _PostBackward(torch.autograd.Function):
    """DeepSpeed's `PostBackwardFunctionModule` on a module's positional inputs: release after it."""

    @staticmethod
    def forward(t: torch.Tensor, sync: Any, module: nn.Module) -> torch.Tensor:  # type: ignore[override]
        return t.detach()

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        t, sync, module = inputs
        ctx.sync, ctx.module = sync, module
        if t.requires_grad:
            sync.grads_remaining[id(module)] += 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        sync, key = ctx.sync, id(ctx.module)
        sync.grads_remaining[key] -= 1
        if sync.grads_remaining[key] == 0:
            sync.release(ctx.module, forward=False)
        return grad, None, None


@attrs.define(eq=False)
class Zero3Sync(_Base):
    """ZeRO-3's per-rank tensors, module hooks and collectives over `group` (see the module docs)."""

    group: Any
    world: int
    rank: int
    dtype: torch.dtype
    comm_dtype: torch.dtype
    ps: list[_P]  # every param of the module, in its order (ds_id)
    sub_groups: list[list[str]]  # the trainable params of each sub-group
    overflow_check: bool
    clip: float  # gradient_clipping (0: none)
    fp16_scale: float | None
    moments: int
    offload: bool
    reduce_bucket: int
    lr: Any
    prefetch_bucket: int
    max_live: int
    max_reuse: int
    sequential: bool  # allgather_sequential
    stage: int = 3
    phases: Any = attrs.field(factory=lambda: ZeroPhases())
    by_name: dict[str, _P] = attrs.Factory(dict)
    by_param: dict[int, _P] = attrs.Factory(dict)
    direct: dict[int, list[_P]] = attrs.Factory(dict)  # id(module) -> its direct params
    pre_bwd_refs: collections.Counter = attrs.Factory(collections.Counter)
    grads_remaining: collections.Counter = attrs.Factory(collections.Counter)
    # the coordinator (PartitionedParameterCoordinator)
    mode: str = "invalid"  # invalid -> record -> complete
    order: list[nn.Module] = attrs.Factory(list)  # the trace: modules in the order of their fetches
    param_order: list[tuple[_P, int]] = attrs.Factory(list)
    fetched_for: dict[int, collections.deque] = attrs.Factory(
        lambda: collections.defaultdict(collections.deque)
    )
    recent: dict[int, int] = attrs.Factory(lambda: collections.defaultdict(lambda: _FAR))
    queue: collections.deque = attrs.Factory(collections.deque)
    step_id: int = 0
    n_available: int = 0
    release_cache: dict[tuple[int, int], set[int]] = attrs.Factory(dict)
    active_bwd: dict[int, nn.Module] = attrs.Factory(dict)
    inflight: dict[int, _P] = attrs.Factory(dict)  # prefetched, not yet fetched by their module
    stack: list[nn.Module] = attrs.Factory(list)  # FWD_MODULE_STACK: the modules whose forward runs
    in_forward: bool = False  # the engine's forward runs (external params are discovered)
    # the gradients
    bucket: _Bucket = attrs.Factory(_Bucket)
    grad_flat: torch.Tensor | None = None  # grad_partitions_flat_buffer
    grad_offsets: dict[str, int] = attrs.Factory(dict)
    trainable_part: int = 0
    names: dict[int, str] = attrs.Factory(dict)
    params: dict[str, torch.Tensor] = attrs.Factory(dict)
    loss_has_count: bool | None = None
    divides: bool = True

    def forget_release_decisions(self) -> None:
        self.release_cache.clear()

    def __attrs_post_init__(self) -> None:
        self.by_name = {p.name: p for p in self.ps}
        self.by_param = {id(p.param): p for p in self.ps}
        at = 0
        for group in self.sub_groups:
            for name in group:
                self.grad_offsets[name] = at
                at += self.by_name[name].part
        self.trainable_part = at

    # ---- hooks on the module (DeepSpeedZeRoOffload.setup_zero_stage3_hooks) -----------------------------------
    def register(self, root: nn.Module) -> None:
        def start(module: nn.Module, args: Any) -> None:  # the engine's forward, then the trace's step
            self.in_forward = True
            self.reset_step()

        root.register_forward_pre_hook(start)
        self.stack = [root]

        def visit(module: nn.Module) -> None:  # _register_deepspeed_module: the children first
            self.direct[id(module)] = [self.by_param[id(p)] for p in module.parameters(recurse=False)]
            for child in module.children():
                visit(child)
            module.register_forward_pre_hook(lambda m, args: self.fetch(m, forward=True))
            module.register_forward_hook(lambda m, args, out: self.release(m, forward=True))
            module.register_forward_hook(
                lambda m, args, out: _apply_to_tensors(lambda t: _PreBackward.apply(t, self, m), out)
            )
            module.register_forward_pre_hook(self._post_backward_inputs)
            params = _ZeroParams(module._parameters)
            params.sync = self
            module._parameters = params

        visit(root)
        root.register_forward_hook(lambda m, args, out: setattr(self, "in_forward", False))

    @torch.no_grad()
    def external(self, param: torch.Tensor) -> None:
        """A param read outside its module's forward: gathered, and fetched and released with the module
        running from now on (`register_external_parameter`)."""
        p = self.by_param.get(id(param))
        if p is None or p.available:
            return
        owner = self.direct[id(self.stack[-1])]
        if all(q is not p for q in owner):
            owner.append(p)
        self._gather([p])

    def _post_backward_inputs(self, module: nn.Module, args: Any) -> Any:
        self.grads_remaining[id(module)] = 0
        return _apply_to_tensors(lambda t: _PostBackward.apply(t, self, module), args)

    def before_backward(self, module: nn.Module) -> None:
        if self.pre_bwd_refs[id(module)] > 0:
            self.fetch(module, forward=False)
            self.pre_bwd_refs[id(module)] -= 1

    # ---- the coordinator ---------------------------------------------------------------------------------------
    def _assert_same(self, n: int) -> None:
        """`assert_ints_same_as_other_ranks` of a list of `n` ints: its length, then the list, broadcast."""
        device = self.ps[0].partition.device
        dist.broadcast(torch.zeros((), dtype=torch.int64, device=device), src=0)
        dist.broadcast(torch.zeros(n, dtype=torch.int64, device=device), src=0)

    def _clean_inflight(self) -> None:
        """`_clean_inflight_param_registry`: the prefetched params no module fetched, released."""
        for p in self.inflight.values():
            self._release_param(p)
        self.inflight = {}

    @torch.no_grad()
    def reset_step(self) -> None:
        self._clean_inflight()
        if self.mode != "complete":
            self._assert_same(len(self.order))
            if self.mode == "record":
                for module in self.order:
                    step = self.fetched_for[id(module)].popleft()
                    for p in sorted(self.direct[id(module)], key=lambda p: p.ds_id):
                        self.param_order.append((p, step))
                self._assert_same(len(self.param_order))
                self._assert_same(len(self.param_order))
                self.mode = "complete"
            else:
                self.mode = "record"
        self.queue = collections.deque(self.param_order)
        self.recent = collections.defaultdict(lambda: _FAR)
        self.fetched_for = collections.defaultdict(collections.deque)
        self.step_id = 0
        self.n_available = 0

    def _invalidate(self) -> None:
        self.mode = "invalid"
        self._clean_inflight()
        self.order, self.param_order, self.queue = [], [], collections.deque()
        self.recent = collections.defaultdict(lambda: _FAR)
        self.fetched_for = collections.defaultdict(collections.deque)
        dry_mode.note("DeepSpeed ZeRO-3 (modelled): the modules ran in another order than the recorded trace")

    @torch.no_grad()
    def fetch(self, module: nn.Module, *, forward: bool) -> None:
        """`pre_sub_module_forward_function` / `..._backward_function`: the trace, then `fetch_sub_module`."""
        if self.mode == "complete" and (
            len(self.order) <= self.step_id or self.order[self.step_id] is not module
        ):
            self._invalidate()
        if self.mode == "record":
            self.order.append(module)
            self.fetched_for[id(module)].append(self.step_id)
        if forward:
            self.stack.append(module)
        else:
            self.active_bwd[id(module)] = module
        params = self.direct[id(module)]
        missing = [p for p in params if not p.available]
        if missing:
            self._gather(missing)
            self.n_available += sum(p.numel for p in missing)
        for p in params:
            p.active.add(id(module))
            self.inflight.pop(id(p), None)  # waited for
        if self.mode == "complete":
            wanted = {id(p) for p in params if self.recent[id(p)] < self.step_id}
            popped: set[int] = set()
            while self.queue and len(popped) < len(wanted):
                p, step = self.queue.popleft()
                self.recent[id(p)] = step
                popped.add(id(p))
            if popped != wanted:
                self._invalidate()
            elif self.prefetch_bucket > 0:
                limit = min(self.max_live - self.n_available, self.prefetch_bucket)
                chosen: list[_P] = []
                numel = 0
                while self.queue and numel < limit:
                    p, step = self.queue.popleft()
                    if not p.available and all(p is not c for c in chosen):
                        chosen.append(p)
                        numel += p.numel
                    self.recent[id(p)] = max(self.recent[id(p)], step)
                if chosen:
                    self._gather(chosen)
                    self.n_available += numel
                    self.inflight.update((id(p), p) for p in chosen)
        self.step_id += 1

    def _gather(self, params: list[_P]) -> None:
        """`all_gather_coalesced`: one all-gather of the params' partitions (each its own when one, or with
        `allgather_sequential`); each param's `.data` its full tensor."""
        params = sorted(params, key=lambda p: p.ds_id)
        if len(params) == 1 or self.sequential:
            for p in params:
                out = torch.empty(p.part * self.world, dtype=self.dtype, device=p.partition.device)
                dist.all_gather_into_tensor(out, p.partition, group=self.group)
                p.param.data = out[: p.numel].view(p.shape)
                p.available = True
            return
        size = sum(p.part for p in params)
        flat = torch.empty(size * self.world, dtype=self.dtype, device=params[0].partition.device)
        dist.all_gather_into_tensor(flat, flat[self.rank * size : (self.rank + 1) * size], group=self.group)
        for p in params:  # each param's partitions concatenated into its own tensor
            p.param.data = torch.empty(p.shape, dtype=self.dtype, device=flat.device)
            p.available = True

    def _release_param(self, p: _P) -> None:
        if p.available and not p.active:
            p.param.data = p.partition
            p.available = False
            self.n_available -= p.numel

    def _to_release(self, module: nn.Module) -> set[int]:
        """`__params_to_release` (cached per module and step id, as DeepSpeed's lru_cache)."""
        key = (id(module), self.step_id)
        if key in self.release_cache:
            return self.release_cache[key]
        out = {id(p) for p in self.direct[id(module)] if not p.persist}
        out -= {id(p) for p in self.direct[id(module)] if self.recent[id(p)] > self.step_id}
        traversed = 0
        for later in self.order[self.step_id :]:
            if traversed >= self.max_reuse:
                break
            for p in self.direct[id(later)]:
                out.discard(id(p))
                traversed += p.numel
        self.release_cache[key] = out
        return out

    @torch.no_grad()
    def release(self, module: nn.Module, *, forward: bool) -> None:
        """`release_sub_module` (after the forward, the module leaves the stack first)."""
        if forward and self.stack and self.stack[-1] is module:
            self.stack.pop()
        params = self.direct[id(module)]
        chosen = self._to_release(module) if self.mode == "complete" else {id(p) for p in params}
        if not forward:
            self.active_bwd.pop(id(module), None)
        for p in params:
            p.active.discard(id(module))
            if id(p) in chosen:
                self._release_param(p)

    # ---- the step ----------------------------------------------------------------------------------------------
    def init_opt_state(self, trainable: dict[str, torch.Tensor]) -> Any:
        device = torch.device("cpu") if self.offload else self.ps[0].partition.device
        masters = [
            torch.zeros(sum(self.by_name[n].part for n in g), dtype=torch.float32, device=device)
            for g in self.sub_groups
        ]
        return {
            "master": masters,
            "moments": [[torch.zeros_like(m) for _ in range(self.moments)] for m in masters],
        }

    def prepare(self, params: dict[str, torch.Tensor]) -> None:
        device = self.ps[0].partition.device
        self.params = params
        self.grad_flat = torch.zeros(self.trainable_part, dtype=self.dtype, device=device)
        self.bucket = _Bucket(buffers=[torch.empty(self.reduce_bucket, dtype=self.comm_dtype, device=device)])
        self.hook_gradients(params, list(self.grad_offsets))

    def _ready(self, p: torch.Tensor) -> None:
        """`reduce_independent_p_g_buckets_and_remove_grads`: flush the bucket if the gradient does not fit,
        then copy it into the bucket (its own storage freed) unless larger than the bucket."""
        name = self.names.get(id(p))
        if name is None or p.grad is None:
            return
        n = self.by_name[name].numel
        if self.bucket.elements + n > self.reduce_bucket and self.bucket.elements > 0:
            self._flush()
        b = self.bucket
        if b.elements + n <= self.reduce_bucket:
            p.grad = None
        else:
            b.extra = name
        b.names.append(name)
        b.elements += n

    def _flush(self) -> None:
        """`__reduce_and_partition_ipg_grads`: one reduce-scatter of the bucket's gradients, each padded to a
        multiple of N and interleaved by rank (`reduce_scatter_coalesced`), into the gradient partitions."""
        b = self.bucket
        if not b.names:
            return
        ps = sorted((self.by_name[n] for n in b.names), key=lambda p: p.ds_id)
        total = sum(p.part for p in ps) * self.world
        device = ps[0].partition.device
        send = torch.empty(total, dtype=self.comm_dtype, device=device)
        out = send[self.rank * (total // self.world) : (self.rank + 1) * (total // self.world)]
        dist.reduce_scatter_tensor(out, send, group=self.group)
        del send, out
        if b.extra is not None:
            self.params[b.extra].grad = None
        self.bucket = _Bucket(buffers=b.buffers)

    def after_backward(self) -> None:
        self._flush()  # independent_gradient_partition_epilogue
        for module in list(self.active_bwd.values()):  # release_backward_leftovers: non-persistent params
            for p in self.direct[id(module)]:
                p.active.discard(id(module))
                if not p.persist:
                    self._release_param(p)
        self.active_bwd.clear()

    def partition_grads(self) -> dict[str, torch.Tensor]:
        assert self.grad_flat is not None
        return {"partition": self.grad_flat}

    def step_norm(self) -> torch.Tensor:
        device = self.ps[0].partition.device
        self.inflight = {}
        for p in self.ps:  # _partition_all_parameters: release_and_reset_all
            p.active.clear()
            self._release_param(p)
        if self.overflow_check:
            dist.all_reduce(torch.zeros(1, dtype=torch.uint8, device=device), group=self.group)
        total = torch.zeros((), dtype=torch.float64, device=device)
        for _ in self.sub_groups:  # get_grad_norm_direct, per sub-group (in float64)
            sq = torch.zeros((), dtype=torch.float64, device=device)
            dist.all_reduce(sq, group=self.group)
            total = total + sq
        return total.sqrt()

    def step(self, opt_state: Any, scale: torch.Tensor) -> None:
        for group, master, moments in zip(self.sub_groups, opt_state["master"], opt_state["moments"]):
            # the sub-group's fp32 gradients (its master's `.grad`)
            grad = torch.empty(master.numel(), dtype=torch.float32, device=master.device)
            grad.mul_(scale.to(grad.device))
            _update(master, moments, grad)
            del grad
            at = 0
            for name in group:  # the master copied into the partitions
                p = self.by_name[name]
                p.partition.copy_(master[at : at + p.part].to(p.partition.device, p.partition.dtype))
                at += p.part
        self.bucket, self.grad_flat = _Bucket(), None
        self._gather_persistent()

    @torch.no_grad()
    def _gather_persistent(self) -> None:
        """`_post_step`: the persistent params gathered one by one (each into a buffer of ceil(numel / N) x N
        elements), kept until the next step. Modelled as views of one buffer beside the partitions (their
        storage extended once), so that the params a step starts with count both, gathered or not."""
        persistent = [p for p in self.ps if p.persist]
        if not persistent:
            return
        flat = self.ps[0].partition
        size = sum(p.part for p in self.ps)
        if flat.untyped_storage().nbytes() == size * flat.element_size():  # the first step: extend
            new = torch.empty(
                size + sum(p.part * self.world for p in persistent), dtype=flat.dtype, device=flat.device
            )
            at = 0
            for p in self.ps:
                new[at : at + p.part].copy_(p.partition)
                p.partition = new[at : at + p.part]
                if not p.available:
                    p.param.data = p.partition
                at += p.part
            flat = new
        at = size
        for p in persistent:
            out = flat.as_strided((p.part * self.world,), (1,), flat.storage_offset() + at)
            at += p.part * self.world
            if not p.available:
                dist.all_gather_into_tensor(out, p.partition, group=self.group)
                p.param.data = out[: p.numel].view(p.shape)
                p.available = True

    def describe(self) -> str:
        what = "params, gradients and optimizer state"
        return f"DeepSpeed ZeRO-3 (modelled for the dry run): {what} partitioned over {self.world} ranks"


def _zero3(
    module: nn.Module, config: dict[str, Any], param_groups: list[list[torch.Tensor]], world: int
) -> tuple[list[_P], list[list[str]]]:
    """Every param partitioned (`ds_tensor`, this rank's ceil(numel / N) elements of one flat buffer), the
    persistent ones marked, the trainable ones' sub-groups."""
    zero = config["zero_optimization"]
    threshold = int(
        zero.get("stage3_param_persistence_threshold", zero.get("param_persistence_threshold", 1e5))
    )
    model_threshold = int(
        zero.get("stage3_model_persistence_threshold", zero.get("model_persistence_threshold", 2**63 - 1))
    )
    named = list(module.named_parameters())
    parts = [math.ceil(p.numel() / world) for _, p in named]
    first = named[0][1]
    flat = torch.empty(sum(parts), dtype=first.dtype, device=first.device)
    ps, at, persistent = [], 0, 0
    with torch.no_grad():
        for ds_id, ((name, p), part) in enumerate(zip(named, parts)):
            persist = False
            if p.numel() + persistent <= model_threshold and p.numel() <= threshold:
                persist, persistent = True, persistent + p.numel()
            ps.append(_P(p, name, ds_id, p.shape, p.numel(), part, persist, flat[at : at + part]))
            p.data = flat[at : at + part]
            at += part
    names = {id(p): n for n, p in named}
    sub_size = int(zero.get("sub_group_size", 1e9))
    sub_groups: list[list[str]] = []
    for params in param_groups:
        total = sum(math.ceil(t.numel() / world) for t in params)
        if sub_size >= total:
            sub_groups.append([names[id(t)] for t in params])
            continue
        current, size = [], 0
        for t in params:  # _create_fp16_sub_groups
            current.append(names[id(t)])
            size += math.ceil(t.numel() / world)
            if size >= sub_size or t is params[-1]:
                sub_groups.append(current)
                current, size = [], 0
    return ps, sub_groups
