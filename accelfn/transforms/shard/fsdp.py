"""FSDP / HSDP strategies of `af.shard`, on torch's FSDP2 (`fully_shard`).

The state's params are the module's own DTensor parameters (measured while designing accelfn:
passing other tensors through an FSDP2 module makes it compute and communicate twice), so binding is in
place and free. FSDP2 reads a module's parameters once, so a state whose params are other tensors (a copy,
another model's state, `donate=False`) is refused rather than silently ignored. A parameter a rank leaves
without a gradient (an expert only some ranks route to) is reduce-scattered as zeros
(`set_reduce_scatter_unused_params`), so ranks may use different parameters of a unit. A whole FSDP2 unit (a
block, a module list's item) whose forward runs on some ranks only is refused, naming it: FSDP2 reduce-scatters
an unused unit's gradients after the backward, out of the other ranks' order. So is a unit whose forward runs
everywhere but whose backward reaches it on some ranks only (its output reaches the loss on some ranks only, an
auxiliary head added where a rank has labels for it): FSDP2 reduce-scatters a unit when the backward reaches its
inputs, else from the backward's final callback, after the others. Both are found from hooks (a forward
pre-hook per unit; gradient hooks on its inputs) whose per-unit flags ride in the one all-reduce that sums the
loss, before the update: every rank raises, nothing is applied (best effort: where FSDP2's own all-gathers of
the unit still pair up and the backward finishes). Fix: make its output reach the loss on every rank
(`+ 0 * out.sum()`), or use ddp. Buffers are broadcast from the first rank before each step, as with ddp.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from ... import dry_mode
from ...dtensor import local_tensor
from ...engine.contract import GradSync
from ...materialize import has_meta, materialize
from ...module import move
from ..compile import model_blocks
from .common import (
    NOT_SUMMED,
    broadcast_buffers,
    broadcast_from_first,
    check_same_model,
    group_size,
    max_over,
    mean_metrics,
    split_groups,
    split_units,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard as TorchShard

    from ...engine import Plan
    from ...mesh import Mesh
    from . import Shard


@attrs.define(eq=False)
class FSDPSync(GradSync):
    """FSDP2 has already summed (reduce-scattered) the gradients; only the scalars remain to meet."""

    root: nn.Module
    data_group: dist.ProcessGroup | None
    shard_group: dist.ProcessGroup | None
    # reduce-scatter each micro-batch's gradients (2-D units all-reduce only in the last): `af.accumulate`
    sync_each_microbatch: bool = True
    own: dict[str, torch.Tensor] = attrs.Factory(dict)  # the sharded parameters FSDP2 works with
    forwards: _UnitForwards | None = None  # which FSDP2 units ran forward (or backward) since last read
    ran: list[list[bool]] = attrs.Factory(list)  # this step, per reducing micro-batch: units that ran
    reached: list[list[bool]] = attrs.Factory(list)  # ... units whose inputs the backward reached
    unused: list[bool] = attrs.Factory(list)  # this step: which trainable params got no gradient
    names: tuple[str, ...] = ()  # the trainable params, as `unused` lists them

    def __attrs_post_init__(self) -> None:
        self.own = dict(self.root.named_parameters())
        self.forwards = _UnitForwards.of(self.root)

    def prepare(self, params: dict[str, torch.Tensor]) -> None:
        foreign = [n for n, p in params.items() if self.own.get(n) is not p]
        if foreign:
            raise ValueError(
                f"shard(strategy='fsdp'): params {foreign[:3]} are not the FSDP module's own parameters. FSDP2 "
                "gathers and updates its own sharded parameters, so a different state (a copy, donate=False, "
                "another model's state, an EMA) would be silently ignored: pass the state returned by this step's "
                "init() or its last call (af.checkpoint.load(path, like=that state) loads into it)"
            )
        broadcast_buffers(self.root, self.data_group)
        assert self.forwards is not None
        self.forwards.read()  # forwards before this step (an eval step's) are not this step's
        self.forwards.read_reached()
        self.ran, self.reached, self.unused, self.names = [], [], [], ()

    def record_unused(self, names: tuple[str, ...], missing: set[str]) -> None:
        """Note which params got no gradient; `reduce` compares the ranks in its one collective. (FSDP2 gives
        every param of a unit that ran a gradient, zeros where unused, except in a torch without
        `set_reduce_scatter_unused_params`.)"""
        self.unused = [n in missing for n in names]
        self.names = names

    def _check_units(self, counts: torch.Tensor) -> None:
        """Refuse a step in which an FSDP2 unit ran its forward on some ranks only, or the backward reached it on
        some ranks only (in a micro-batch whose backward reduce-scatters): FSDP2 reduce-scatters such a unit's
        gradients from the backward's final callback on the ranks the backward did not reach it on, after the
        others, so the ranks' reduce-scatters would pair up wrongly. (A parameter a rank leaves without a
        gradient inside a unit that the backward reached is reduce-scattered as zeros, in order.)"""
        assert self.forwards is not None
        ranks = dist.get_world_size(self.data_group)
        units = self.forwards.names
        n_ran = sum(len(micro) for micro in self.ran)
        ran = _some_ranks(counts[len(self.unused) : len(self.unused) + n_ran].tolist(), units, ranks)
        if ran is not None:
            unit, where, _ = ran
            raise ValueError(
                f"shard(strategy='fsdp'): the FSDP2 unit {unit!r} ran its forward on "
                f"some ranks and not on others{where} (e.g. an expert module only some ranks route to). "
                "FSDP2 reduce-scatters a unit the backward did not reach after the others, so the ranks' "
                "sums would pair up wrongly: call the module on every rank (on zero rows where none route "
                "to it; params a rank leaves unused inside a unit that ran are reduce-scattered as zeros), "
                "or use strategy='ddp'"
            )
        reached = _some_ranks(counts[len(self.unused) + n_ran :].tolist(), units, ranks)
        if reached is not None:
            unit, where, c = reached
            raise ValueError(
                f"shard(strategy='fsdp'): the backward reached the FSDP2 unit {unit!r} on "
                f"{c} of {ranks} ranks{where}: it ran its forward on every rank, but its output reaches the "
                "loss on some only (e.g. an auxiliary head added to the loss where a rank has labels for it). "
                "FSDP2 reduce-scatters a unit the backward did not reach after the others, so the ranks' sums "
                "would pair up wrongly: make its output reach the loss on every rank (add `0 * out.sum()` "
                "where it is not used), or use strategy='ddp'"
            )
        differ = [n for n, c in zip(self.names, counts[: len(self.unused)].tolist()) if 0 < c < ranks]
        if differ:
            raise ValueError(
                f"shard(strategy='fsdp'): params {differ[:3]} got a gradient on some ranks and none on others "
                "(e.g. an expert only some ranks route to). Where gradients are held across backwards "
                "(af.accumulate(..., sync_each_microbatch=False), a pipeline) or in a torch without "
                "set_reduce_scatter_unused_params, FSDP2 reduce-scatters only the gradients a rank produced, so "
                "the sums would pair up wrongly: sync each micro-batch (the default), use strategy='ddp', or make "
                "every rank use them"
            )

    @contextlib.contextmanager
    def microbatch(self, last: bool) -> Iterator[None]:
        """Each micro-batch reduce-scatters its gradients (units sharded over a 2-D mesh, hsdp's and experts' over
        efsdp: their all-reduce over the replicas only in the last), or with `sync_each_microbatch=False` only
        the last does (FSDP2 keeps the unsharded gradients until then)."""
        assert self.forwards is not None
        ran = self.forwards.read()  # the units this micro-batch's forward ran (before its backward)
        if last or self.sync_each_microbatch:  # this backward reduce-scatters
            self.ran.append([n in ran for n in self.forwards.names])
        if not last and self.sync_each_microbatch:  # reduce-scatter now, all-reduce the shards in the last
            self.root.set_requires_all_reduce(False)  # type: ignore[operator]  # an FSDPModule (1-D units: no-op)
        elif not last:
            self.root.set_requires_gradient_sync(False)  # type: ignore[operator]
        self.forwards.read_reached()
        try:
            yield
            reached = self.forwards.read_reached()  # the units whose inputs this backward reached
            if last or self.sync_each_microbatch:
                self.reached.append([n in reached for n in self.forwards.names])
            if not last and not self.sync_each_microbatch:  # held until the last: gradients in a dry run
                dry_mode.gradients(_unsharded_grads(self.root))
        finally:
            self.forwards.read()  # forwards the backward ran again (activation checkpointing): not the next one's
            self.forwards.read_reached()
            if not last and self.sync_each_microbatch:
                self.root.set_requires_all_reduce(True)  # type: ignore[operator]
            elif not last:
                self.root.set_requires_gradient_sync(True)  # type: ignore[operator]

    def abandon(self) -> None:
        """The step raised in a micro-batch (the loss, a forward, a backward): reset FSDP2's per-iteration state
        (`reset_iter_state`: waits for collectives in flight, reshards, forgets the unit states of a forward
        cut short and hsdp's partial sums awaiting the replicas' all-reduce), then drop the gradients the
        finished backwards left, which it keeps: no_sync's unsharded gradients and the sharded partial sums."""
        state = self.root._get_fsdp_state()  # type: ignore[operator]  # an FSDPModule
        if getattr(state, "_is_root", None):  # (None before the first forward initialises FSDP2)
            if hasattr(self.root, "reset_iter_state"):
                self.root.reset_iter_state()  # type: ignore[operator]
            else:  # (a torch without it: the partial sums at least)
                for group in _param_groups(self.root):
                    group._partial_reduce_output = None
        for group in _param_groups(self.root):
            for p in getattr(group, "fsdp_params", ()):
                p.unsharded_accumulated_grad = None
                if getattr(p, "_unsharded_param", None) is not None:
                    p._unsharded_param.grad = None
        for p in self.own.values():
            p.grad = None
        assert self.forwards is not None
        self.forwards.read()
        self.forwards.read_reached()

    def reduce(
        self, grads: list[torch.Tensor], loss_sum: torch.Tensor, count: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.forwards is not None
        if not self.ran:  # no micro-batch contexts (a pipeline's schedule ran the backwards): its forwards
            ran = self.forwards.read()
            self.ran.append([n in ran for n in self.forwards.names])
            # (not whether its backwards reached each unit: torch's stage reduce-scatters every unit after them)
            self.forwards.read_reached()
        # summed: on how many ranks each param got no gradient, each unit ran, and the backward reached each
        # unit (per reducing micro-batch)
        flags = torch.tensor(
            [float(u) for u in self.unused]
            + [float(r) for micro in (*self.ran, *self.reached) for r in micro]
        )
        flat = torch.cat([torch.stack([loss_sum.detach().float().reshape(()), count.detach().float().reshape(())]),
                          flags.to(loss_sum.device)])  # fmt: skip
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.data_group)
        self._check_units(flat[2:])
        return flat[0].to(loss_sum.dtype), flat[1].to(count.dtype)  # counts stay exact (fp32+)

    def norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        local = [local_tensor(g) for g in grads]
        sq = (
            torch.stack([torch.linalg.vector_norm(g.float()) ** 2 for g in local]).sum()
            if local
            else torch.zeros(())
        )
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=self.shard_group)
        return sq.sqrt()

    def reduce_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return mean_metrics(values, self.data_group)

    def describe(self) -> str:
        shard, data = group_size(self.shard_group), group_size(self.data_group)
        replicas = (
            f", {data // shard} replicas"
            if isinstance(data, int) and isinstance(shard, int) and data != shard
            else ""
        )
        return f"FSDP2: params and gradients sharded over {shard} ranks{replicas}"

    def any_rank(self, flag: torch.Tensor) -> torch.Tensor:
        return max_over(flag, self.data_group)

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        return max_over(x, self.data_group)


def _some_ranks(counts: list[float], units: list[str], ranks: int) -> tuple[str, str, int] | None:
    """The first unit whose flag (summed over the `ranks`, one per unit per reducing micro-batch) is set on some
    ranks only: `(its name, " in micro-batch k" where there are several, on how many ranks)`; None if none."""
    for i, c in enumerate(counts):
        if 0 < c < ranks:
            micro, unit = divmod(i, len(units))
            where = f" in micro-batch {micro + 1}" if len(counts) > len(units) else ""
            return units[unit] or "(the root)", where, int(c)
    return None


class _UnitForwards:
    """Which FSDP2 units (the sharded modules holding params) ran their forward since `read` last asked, and
    which ones a backward reached since `read_reached` did: a forward pre-hook on each, registered once per
    sharded model and shared by its steps' `FSDPSync`s.

    "Reached" is what makes FSDP2 reduce-scatter a unit during the backward rather than from its final callback:
    a gradient arriving at one of the unit's inputs that require one, as FSDP2's pre-forward returns them (its
    post-backward hook's outputs; the pre-hook runs after FSDP2's, which is prepended). A unit whose inputs
    require no gradient (the root, on token ids) is reduce-scattered from the final callback on every rank, and
    never counts as reached. Forwards run again inside a backward (activation checkpointing) hook nothing.
    """

    def __init__(self, root: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.names = [
            n
            for n, m in root.named_modules()
            if isinstance(m, FSDPModule) and next(_unit_params(m), None)  # type: ignore[arg-type]
        ]
        self.ran: set[str] = set()
        self.reached: set[str] = set()
        modules = dict(root.named_modules())
        for name in self.names:
            modules[name].register_forward_pre_hook(self._hook(name), with_kwargs=True)

    def _hook(self, name: str) -> Callable[..., None]:
        def reached(grad: torch.Tensor) -> None:
            self.reached.add(name)

        @torch._dynamo.disable  # type: ignore[untyped-decorator]  # a compiled block's hooks: not traced
        def ran(module: nn.Module, args: object, kwargs: object) -> None:
            self.ran.add(name)
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:  # (a recomputation)
                return
            # (not on a leaf: its hook would outlive the step)
            for t in pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    t.register_hook(reached)

        return ran

    def read(self) -> set[str]:
        """The units that ran since the last call."""
        out, self.ran = self.ran, set()
        return out

    def read_reached(self) -> set[str]:
        """The units a backward reached since the last call."""
        out, self.reached = self.reached, set()
        return out

    @classmethod
    def of(cls, root: nn.Module) -> _UnitForwards:
        found = getattr(root, "_accelfn_unit_forwards", None)
        if not isinstance(found, cls):
            found = cls(root)
            root._accelfn_unit_forwards = found  # type: ignore[assignment]
        return found


def _unit_params(unit: nn.Module) -> Iterator[tuple[nn.Module, nn.Parameter]]:
    """(owner, param) for the params one `fully_shard(unit)` would manage (not those of sharded submodules)."""
    from torch.distributed.fsdp import FSDPModule

    stack = [unit]
    while stack:
        m = stack.pop()
        yield from ((m, p) for p in m._parameters.values() if p is not None)
        stack.extend(c for c in m.children() if not isinstance(c, FSDPModule))


def uniform_dtype_parts(unit: nn.Module, root: nn.Module | None = None) -> list[nn.Module]:
    """Submodules of `unit` to shard as units of their own so that each unit's trainable params share a dtype
    (an error names a module by its place in `root`, the whole model, where given).

    FSDP2 all-gathers params of any dtypes together, frozen ones included, but reduce-scatters the gradients
    of one unit in one dtype and refuses a unit whose trainable params differ ("FSDP expects uniform
    original parameter dtype"): e.g. a bf16 base whose PEFT adapter has fp32 LoRA weights and trainable bf16
    copies of its norms (`modules_to_save`) in the same block. The frozen base keeps its dtype (we never
    upcast it, unlike Accelerate's FSDP2 path, its issue #3844). The trainable params of the dtype holding the
    most elements stay in `unit`; the smallest modules owning the others (the LoRA `Linear`s) become units
    of their own, as torchtitan shards per module. The common case (one trainable dtype) changes nothing.
    """
    trainable = [(m, p) for m, p in _unit_params(unit) if p.requires_grad]
    sizes: dict[torch.dtype, int] = {}
    for _, p in trainable:
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    if len(sizes) < 2:
        return []
    main = max(sizes, key=lambda d: sizes[d])
    parts: list[nn.Module] = []
    for owner, p in trainable:
        if p.dtype == main or any(owner is q for q in parts):
            continue
        mixed = {q.dtype for _, q in _unit_params(owner) if q.requires_grad}
        if len(mixed) > 1:
            # named in the whole model (`root`), where the error is read
            name = next((n for n, m in (root or unit).named_modules() if m is owner), type(owner).__name__)
            raise ValueError(
                f"shard(strategy='fsdp'): module {name!r} has trainable params of dtypes {sorted(map(str, mixed))}; "
                "FSDP2 reduces one unit's gradients in one dtype: give its trainable params one dtype"
            )
        parts.append(owner)
    return parts


def expert_placement(efsdp: int) -> Callable[[nn.Parameter], TorchShard]:
    """FSDP2's placement over the `efsdp` ranks for a param stacked over experts: `Shard(1)` where this rank's
    local experts (dim 0 of its piece) do not divide by `efsdp` and dim 1 does, else `Shard(0)`.

    FSDP2 pads dim 0 to a multiple of the ranks: 4 local experts over efsdp=16 would be 16 rows, 4x the experts'
    memory on the first ranks and 4x their all-gather and reduce-scatter bytes. torchtitan shards on dim 1 when
    `efsdp x ep > experts` (efsdp above the local experts); this rule also takes a local count efsdp does not
    divide (3 over 2). FSDP2 refuses uneven shards on dim 1: where dim 1 does not divide, dim 0 stays (padded).

    Example:
        >>> import torch
        >>> place = expert_placement(4)
        >>> place(nn.Parameter(torch.zeros(2, 16, 8))), place(nn.Parameter(torch.zeros(8, 16, 8)))
        (Shard(dim=1), Shard(dim=0))
    """
    from torch.distributed.tensor import Shard

    def place(p: nn.Parameter) -> TorchShard:
        local = local_tensor(p).shape
        if len(local) > 1 and local[0] % efsdp and local[1] % efsdp == 0:
            return Shard(1)
        return Shard(0)

    return place


def hsdp_mesh(mesh: Mesh) -> DeviceMesh:
    """The 2-D mesh HSDP puts the dense params on: replicated over `dp`, sharded over the other gradient axes
    (`fsdp`, and `ep`, whose ranks are data-parallel ranks for the dense layers, flattened into one shard dim), as
    strategy "fsdp" shards them over every gradient axis and torchtitan carves ep from the shard axis.

    Example (a dp=2 x fsdp=2 x ep=2 mesh): `hsdp_mesh(mesh).mesh_dim_names == ("dp", "fsdp_ep")`, of shape (2, 4).
    """
    axes = tuple(a for a in mesh.grad_axes if a != "dp")
    if axes == ("fsdp",):
        return mesh.submesh("dp", "fsdp")
    if mesh.grad_axes[0] != "dp":
        raise ValueError(
            f"shard(strategy='hsdp') with {axes}: name 'dp' before them in the mesh (it replicates, outermost), "
            f"e.g. af.Mesh({{'dp': 2, 'fsdp': 2, 'ep': 2}}); got {mesh.shape}"
        )
    name = mesh._flattened(axes).mesh_dim_names  # the shard dim, flattened once and kept by the mesh
    assert name is not None
    # sliced from the root mesh, it reuses the mesh's process groups (an _unflatten would create new ones)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Slicing a flattened dim", UserWarning)
        return mesh.torch_mesh["dp", name[0]]


def lower_fsdp(shard: Shard, plan: Plan) -> FSDPSync:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = shard.mesh
    # the gradient group: the data axes, and the context-parallel axis (its ranks hold parts of each gradient)
    data_group = mesh.grad_group()
    hsdp = hsdp_mesh(mesh) if shard.strategy == "hsdp" else None
    shard_group = hsdp.get_group(1) if hsdp is not None else data_group
    if isinstance(plan.module, FSDPModule):  # initialised again (e.g. after changing requires_grad): reuse it
        plan.notes.append(f"{shard.strategy} over {mesh.grad_size} ranks (already sharded)")
        return FSDPSync(plan.module, data_group, shard_group, _sync_each(plan))
    on_meta = has_meta(plan.module)  # built on the meta device: shard first, then allocate the shards only
    if not on_meta:
        move(plan.module, mesh.device)
    check_same_model(plan.module, data_group)  # (the ranks agree on what is on the meta device from here)
    if on_meta:  # every rank gets the same values: see accelfn.materialize
        real = next((n for n, p in plan.module.named_parameters() if not local_tensor(p).is_meta), None)
        if real is not None:
            raise ValueError(
                f"shard(strategy={shard.strategy!r}): the model has parameters on the meta device and others on "
                f"the host ({real!r}); each rank would shard its own host values. Build every parameter on the "
                "meta device (af.init_empty()) and load weights after step.init, or build the model on the host"
            )
    else:  # experts split over ep: among the ranks that hold the same ones
        broadcast_from_first(plan.module, data_group, split_groups(mesh, plan.module), NOT_SUMMED)
    if hsdp is not None:
        fsdp_mesh = hsdp
    else:
        grad_mesh = mesh.grad_mesh()
        assert (
            grad_mesh is not None
        )  # a mesh without data or cp axes is tensor parallel alone: not lowered here
        fsdp_mesh = grad_mesh
    mp = MixedPrecisionPolicy()
    if plan.autocast_dtype is not None:
        mp = MixedPrecisionPolicy(param_dtype=plan.autocast_dtype, reduce_dtype=torch.float32)

    # under a pipeline each block runs forward once per micro-batch before its backwards: its params stay
    # gathered from the first forward to the last backward (torchtitan's choice for pp: no all-gather per
    # micro-batch; torch's schedule keeps them gathered after each backward already)
    reshard = not any(t.kind == "pipeline" for t in plan.transforms)

    def shard_unit(module: nn.Module) -> None:
        for part in uniform_dtype_parts(module, plan.module):
            fully_shard(part, mesh=fsdp_mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(module, mesh=fsdp_mesh, mp_policy=mp, reshard_after_forward=reshard)

    _check_param_meshes(plan.module, shard.strategy)
    on_dim1: set[tuple[int, int]] = set()  # (efsdp, local experts) of the experts sharded on dim 1
    for unit, axes in split_units(mesh, plan.module):  # experts: over the data axes but ep (efsdp)
        efsdp = mesh.submesh(*axes)
        ranks = efsdp.size(efsdp.ndim - 1)  # the shard dim (a 2-d mesh replicates over its first, as hsdp)
        place = expert_placement(ranks)
        on_dim1 |= {(ranks, local_tensor(p).shape[0]) for p in unit.parameters() if place(p).dim == 1}
        fully_shard(unit, mesh=efsdp, mp_policy=mp, reshard_after_forward=reshard, shard_placement_fn=place)
    for ranks, local in sorted(on_dim1):
        plan.notes.append(
            f"experts FSDP-sharded on dim 1 over efsdp={ranks} ({local} local experts: no padding)"
        )
    try:
        _, blocks = model_blocks(plan.module)
    except ValueError:  # no repeated blocks: the root alone
        blocks = []
    for block in blocks:
        shard_unit(block)
    shard_unit(plan.module)
    if on_meta:
        materialize(plan.module, mesh.device)
    plan.module._accelfn_fsdp = True  # type: ignore[assignment]  # eval steps on it check their state
    for m in plan.module.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    n_blocks = len(blocks)
    plan.notes.append(f"{shard.strategy} over {mesh.grad_size} ranks ({n_blocks} blocks + root sharded)")
    return FSDPSync(plan.module, data_group, shard_group, _sync_each(plan))


def _param_groups(root: nn.Module) -> Iterator[Any]:
    """FSDP2's parameter groups (torch internals: one per unit holding params; none where they differ)."""
    for m in root.modules():
        yield from _groups_of(m)


def _groups_of(m: nn.Module) -> list[Any]:
    """The FSDP2 parameter groups of module `m` itself (none where it is not a unit)."""
    get = getattr(m, "_get_fsdp_state", None)
    state = get() if callable(get) else None
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def _unreduced_units(root: nn.Module) -> list[str]:
    """The FSDP2 units (by name in `root`, "" the root) holding a partial sum of reduce-scattered gradients that
    awaits hsdp's all-reduce over the replicas (`set_requires_all_reduce(False)`'s backwards, none since)."""
    return [
        name or "(the root)"
        for name, m in root.named_modules()
        if any(getattr(g, "_partial_reduce_output", None) is not None for g in _groups_of(m))
    ]


def _unsharded_grads(root: nn.Module) -> list[torch.Tensor]:
    """The unsharded gradients FSDP2 holds between micro-batches without gradient sync (each unsharded
    parameter's `.grad`, or its accumulated copy in the reduce dtype); none where torch's internals differ."""
    out: list[torch.Tensor] = []
    for group in _param_groups(root):
        for p in getattr(group, "fsdp_params", ()):
            param = getattr(p, "_unsharded_param", None)  # its .grad: set only while unsharded
            for grad in (getattr(p, "unsharded_accumulated_grad", None), getattr(param, "grad", None)):
                if isinstance(grad, torch.Tensor):
                    out.append(grad)
    return out


def _check_param_meshes(module: nn.Module, strategy: str) -> None:
    """FSDP2 shards a DTensor parameter whose own mesh has at most 2 dims (tp, ep, or ep x tp): experts split
    over ep and both the cp and tp axes it borrows are refused here, naming the axes, rather than deep inside
    `fully_shard` (NotImplementedError "FSDP only supports 1D TP/EP or 2D EP+TP")."""
    for name, p in module.named_parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and mesh.ndim > 2:
            axes = " x ".join(f"{a}={mesh.size(i)}" for i, a in enumerate(mesh.mesh_dim_names or ()))
            raise ValueError(
                f"shard(strategy={strategy!r}): {name} is split over {axes} (ep and the cp and tp axes it "
                "borrows); FSDP2 shards parameters split over at most 2 mesh axes (ep x tp, ep x cp). Use cp or "
                "tp with ep, not both, under fsdp/hsdp (ddp takes all three)"
            )


def _sync_each(plan: Plan) -> bool:
    """`FSDPSync.sync_each_microbatch`: `af.accumulate`'s choice, by default each micro-batch.

    A param a rank leaves without a gradient in a backward (an expert none of its rows routed to, with or
    without accumulation, unless gradients are held across backwards: `sync_each_microbatch=False` with several
    micro-batches, or a pipeline) is reduce-scattered as zeros (`set_reduce_scatter_unused_params`), so that every rank's
    reduce-scatters pair up, as DDP's `find_unused_parameters` (the engine reads a missing gradient as zeros
    anyway). It costs nothing while every param gets a gradient; an unused one costs a zero tensor of its
    unsharded size while its unit reduces, and its bytes in the unit's reduce-scatter (which the ranks that used
    it send anyway; where no rank used it, bytes FSDP2 would have skipped)."""
    each = plan.sync_each_microbatch is not False
    root = plan.module
    # not where gradients are held across backwards (no_sync's micro-batches, a pipeline's schedule): FSDP2 fills
    # an unused param's gradient with zeros of its unsharded (bf16 under af.autocast) dtype beside the others'
    # fp32 accumulations, and its reduce-scatter asserts a uniform gradient dtype; there ranks must use the same
    # params (`reduce` refuses them by name otherwise), and a param no rank uses is skipped as before. (A pipeline
    # reducing each micro-batch, `af.pipeline(..., sync_each_microbatch=True)`, turns it on for the running stage's
    # units during each of its backwards only: on the root, FSDP2 would reduce-scatter zeros for every unit a
    # backward did not reach, the rank's other stage's, and again in the step's REDUCE_GRAD)
    held = (not each and plan.microbatches > 1) or any(t.kind == "pipeline" for t in plan.transforms)
    if not held and hasattr(root, "set_reduce_scatter_unused_params"):
        root.set_reduce_scatter_unused_params(True)  # type: ignore[operator]  # an FSDPModule
    return each
