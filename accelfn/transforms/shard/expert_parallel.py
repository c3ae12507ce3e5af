"""Expert parallel over the mesh's `ep` axis — lowered after tensor parallel and before FSDP/DDP.

The `ep` ranks are data-parallel ranks for the dense layers (they read their own rows; `ep` is one of the mesh's
data axes), and split the experts: each holds `E / ep` consecutive experts of every MoE layer. The plan maps
names (`*` = one name part) to styles, as `transformers` writes them (`config.base_model_ep_plan`, under the
base model's prefix), or as the user passes it, `af.shard(step, mesh, ep_plan={...})`:

  grouped_gemm          a parameter stacked over experts on dim 0 (`gate_up_proj [E, 2F, D]`,
                        `down_proj [E, D, F]`): becomes a DTensor `Shard(0)` over `ep` (its global shape stays)
  ep_dispatch_experts   an experts module (`experts(hidden, top_k_index, top_k_weights)`): its forward
                        dispatches rows to the experts' ranks and back (`accelfn.moe`)

Dispatch: `AllToAllDispatcher` (`accelfn.moe.dispatch`) by default; `af.shard(..., ep_dispatcher=factory)` swaps it
(a DeepEP-style one on GPUs, say): `factory(group=, num_experts=, size=, capacity_factor=, data_group=)` is called
once per experts module at lowering and returns an `accelfn.moe.Dispatcher` (`AllToAllDispatcher` is such a
factory); the step counts its tokens for the metrics (`CountedDispatcher`) and `print(step)` names it.

Gradients: a dense param is summed over every data axis, ep included; an expert only over the data axes it is
not split over (`contract.summed_axes`); the global norm counts each expert once (`ExpertParallelSync`).

With other axes: the experts are split over `ep` and the `tp` and `cp` axes it borrows (`expert_axes`:
torchtitan's ep over dp_shard x cp x tp). Under `tp` the attention is split by the tp plan (whose entries for the
experts give way to the ep plan: `ExpertParallel.without_experts`), and the ranks of a tp group, holding the same
tokens, each dispatch their share of them (`tp_shared_forward`); under `cp` each rank dispatches its part of every
sequence; under `af.pipeline` each stage's experts are split over its own ep group (the metrics over every
stage: `over_stages`).

Example (one process: ep=1 keeps all experts on the rank):
    >>> import torch, accelfn as af
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
    ...                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
    ...                      num_experts_per_tok=2)
    >>> model = Qwen3MoeForCausalLM(cfg)
    >>> sorted(expert_params(model, model_ep_plan(model)))
    ['model.layers.0.mlp.experts.down_proj', 'model.layers.0.mlp.experts.gate_up_proj']
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from ... import dry_mode
from ...materialize import has_meta
from ...mesh import Mesh
from ...module import move
from .._base import TransformBase
from .tensor_parallel import TensorParallelSync

if TYPE_CHECKING:
    from ...engine import Plan

__all__ = [
    "ExpertParallel",
    "ExpertParallelSync",
    "CountedDispatcher",
    "make_dispatcher",
    "model_ep_plan",
    "expert_params",
    "STYLES",
]

STYLES = ("grouped_gemm", "ep_dispatch_experts")
# The last ep plan given to af.shard in this process, on any mesh (what `accelfn plan`'s one-process probe reads to count
# a model's experts: `accelfn.planner.experts`), as `launch_env.ASKED` records the knobs a script asks for.
GIVEN: list[dict[str, str]] = []


def model_ep_plan(module: nn.Module) -> dict[str, str] | None:
    """A Hugging Face model's own expert-parallel plan (full names), or None (see the module's example)."""
    base = getattr(getattr(module, "config", None), "base_model_ep_plan", None)
    if not base:
        return None
    prefix = getattr(module, "base_model_prefix", "")
    nested = prefix and hasattr(module, prefix)
    return {(f"{prefix}.{k}" if nested else k): v for k, v in base.items()}


def _match(key: str, names: list[str]) -> list[str]:
    regex = re.compile("^" + re.escape(key).replace(r"\*", r"[^.]+") + "$")
    return [n for n in names if regex.match(n)]


def _inside(key: str, outer: list[str]) -> bool:
    """Whether the pattern `key` could name something inside one of the modules `outer` (e.g. another pipeline
    stage's layer, `model.layers.1`, for `model.layers.*.mlp.experts`)."""
    parts = key.split(".")
    for name in outer:
        head = name.split(".")
        if len(head) < len(parts) and all(k in ("*", h) for k, h in zip(parts, head)):
            return True
    return False


def _matched(module: nn.Module, plan: Mapping[str, str], style: str) -> list[str]:
    """The names (params for grouped_gemm, modules for ep_dispatch_experts) the plan's `style` entries match;
    ValueError naming an entry that matches nothing (on a pipeline stage: nothing of this stage's modules nor of
    the other stages' stand-ins), or a style that is not known."""
    from ...stages import Skip

    skipped = [n for n, m in module.named_modules() if isinstance(m, Skip)]
    params = [n for n, _ in module.named_parameters()]
    modules = [n for n, _ in module.named_modules() if n]
    out: list[str] = []
    for key, value in plan.items():
        if value not in STYLES:
            raise ValueError(
                f"ep_plan[{key!r}] = {value!r} is not a style accelfn knows; use one of {list(STYLES)}"
            )
        if value != style:
            continue
        names = params if style == "grouped_gemm" else modules
        hits = _match(key, names)
        if not hits and _inside(key, skipped):
            continue  # the layers it names are another pipeline stage's
        if not hits:
            last = key.rsplit(".", 1)[-1]
            near = [n for n in names if n.rsplit(".", 1)[-1] == last][:3]
            what = "parameter" if style == "grouped_gemm" else "module"
            hint = f"; {what}s with that last name: {near}" if near else f"; some {what} names: {names[:6]}"
            raise ValueError(f"ep_plan entry {key!r} ({value}) matches no {what} of the model{hint}")
        out += hits
    return out


def expert_params(module: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """`{param name: name of its experts module}` for the params the plan stacks over experts; checked: every
    entry matches, every such param lies in an `ep_dispatch_experts` module and vice versa."""
    params = _matched(module, plan, "grouped_gemm")
    owners = _matched(module, plan, "ep_dispatch_experts")
    out: dict[str, str] = {}
    for p in params:
        owner = next((m for m in owners if p.startswith(m + ".") and "." not in p[len(m) + 1 :]), None)
        if owner is None:
            raise ValueError(
                f"ep_plan: the parameter {p!r} is stacked over experts (grouped_gemm) but its module is not an "
                "'ep_dispatch_experts' entry of the plan"
            )
        out[p] = owner
    empty = [m for m in owners if m not in out.values()]
    if empty:
        raise ValueError(f"ep_plan: the experts module {empty[0]!r} has no parameter marked 'grouped_gemm'")
    return out


class CountedDispatcher:
    """A user's `Dispatcher` with the statistics the step's MoE metrics read (`take_tokens`, `take_dropped`,
    `capacity_factor`), counted here from the expert ids it is given (a training forward only, as
    `AllToAllDispatcher` counts); `dispatch` and `combine` are the user's."""

    def __init__(self, inner: Any, num_experts: int) -> None:
        self.inner, self.num_experts = inner, num_experts
        self.capacity_factor = getattr(inner, "capacity_factor", None)
        self.tokens: torch.Tensor | None = None

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        from ...moe.dispatch import _counting

        if _counting() and dry_mode.active() is None:  # fake tensors hold no expert ids
            counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts).cpu()
            self.tokens = counts if self.tokens is None else self.tokens + counts
        return self.inner.dispatch(x, experts)  # type: ignore[no-any-return]

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor:
        return self.inner.combine(y, handle)  # type: ignore[no-any-return]

    def take_tokens(self) -> torch.Tensor:
        tokens = self.tokens if self.tokens is not None else torch.zeros(self.num_experts, dtype=torch.int64)
        self.tokens = None
        return tokens

    def take_dropped(self) -> torch.Tensor:
        take = getattr(self.inner, "take_dropped", None)
        return take() if take is not None else torch.zeros((), dtype=torch.int64)  # type: ignore[no-any-return]


def dispatcher_name(factory: Any) -> str:
    """How `print(step)` names a dispatcher factory: its (qualified) name."""
    return str(getattr(factory, "__qualname__", None) or type(factory).__name__)


def make_dispatcher(factory: Any, owner: str, **kw: Any) -> Any:
    """The dispatcher `factory(group=, num_experts=, size=, capacity_factor=, data_group=)` makes for the experts
    module `owner`, checked (a `dispatch` and a `combine` method; TypeError naming the factory otherwise), with
    the step's statistics (`CountedDispatcher`) unless it keeps its own (`take_tokens`)."""
    made = factory(**kw)
    missing = [m for m in ("dispatch", "combine") if not callable(getattr(made, m, None))]
    if missing:
        raise TypeError(
            f"shard(ep_dispatcher={dispatcher_name(factory)}) returned {type(made).__name__} for {owner!r}, which has no "
            f"{' and no '.join(missing)} method: an ep_dispatcher is called as factory(group=, num_experts=, size=, "
            "capacity_factor=, data_group=) and returns an accelfn.moe.Dispatcher (dispatch(x, experts) -> (rows, "
            "counts, handle); combine(y, handle) -> rows)"
        )
    if all(callable(getattr(made, m, None)) for m in ("take_tokens", "take_dropped")) and hasattr(
        made, "capacity_factor"
    ):
        return made  # keeps its own statistics (AllToAllDispatcher and its subclasses)
    return CountedDispatcher(made, kw["num_experts"])


@attrs.frozen(eq=False)
class ExpertParallel(TransformBase):
    mesh: Mesh
    plan: tuple[tuple[str, str], ...] | None = None
    kind: str = "expert_parallel"
    # the lowered experts modules' dispatchers (filled by `lower`; the sync reads their token counts)
    dispatchers: list[Any] = attrs.field(factory=list, eq=False)
    # makes each experts module's Dispatcher (None: AllToAllDispatcher); `af.shard(ep_dispatcher=...)`
    dispatcher: Any = None

    @property
    def size(self) -> int:
        """The ep axis' size; 1 on a mesh without one (a user plan then is checked, and the experts stay whole)."""
        return self.mesh.axis_size("ep") if "ep" in self.mesh.axis_names else 1

    def describe(self) -> str:
        given = f", dispatcher={dispatcher_name(self.dispatcher)}" if self.dispatcher is not None else ""
        return f"expert_parallel(ep={self.size}{', user plan' if self.plan is not None else ''}{given})"

    def without_experts(
        self, module: nn.Module, tp_plan: Mapping[str, Any], notes: list[str]
    ) -> dict[str, Any]:
        """`tp_plan` without its entries for the experts (an `ep_dispatch_experts` module of the ep plan, or what is
        in it), said in `notes`: with an `ep` axis the experts are split over `ep`, not `tp` (transformers' MoE tp
        plans split them too). Called by tensor parallel's lowering, which runs first. At ep=1 the experts are not
        split over ep: the tp plan stays whole."""
        if self.size == 1:
            return dict(tp_plan)
        raw = dict(self.plan) if self.plan is not None else model_ep_plan(module)
        if raw is None:
            return dict(tp_plan)  # (this lowering names the missing plan)
        owners = _matched(module, raw, "ep_dispatch_experts")
        names = [n for n, _ in module.named_modules() if n] + [n for n, _ in module.named_parameters()]

        def experts(key: str) -> bool:
            hits = _match(key, names)
            return bool(hits) and all(any(n == o or n.startswith(o + ".") for o in owners) for n in hits)

        dropped = [k for k in tp_plan if experts(k)]
        if dropped:
            notes.append(f"the experts follow the ep plan, not these tp plan entries: {dropped}")
        return {k: v for k, v in tp_plan.items() if k not in dropped}

    def lower(self, plan: Plan) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor

        from ...moe import AllToAllDispatcher, ep_forward
        from ...moe.capacity import CAPACITY

        module = plan.module
        raw = dict(self.plan) if self.plan is not None else model_ep_plan(module)
        if raw is None:
            raise ValueError(
                f"shard: the mesh has an ep axis (ep={self.size}) but {type(module).__name__} brings no expert-"
                "parallel plan (transformers MoE models do: config.base_model_ep_plan); pass ep_plan={'layers.*."
                "experts.w': 'grouped_gemm', 'layers.*.experts': 'ep_dispatch_experts'}"
            )
        stacked = expert_params(module, raw)  # the plan checked against the model, on every mesh
        if self.size == 1:  # no ep axis (af.shard keeps a user's plan there): checked, the experts stay whole
            plan.notes.append(
                f"ep=1: the ep plan's {len(set(stacked.values()))} experts module(s) stay whole on each rank"
            )
            return
        if any(getattr(module.get_parameter(n), "placements", None) is not None for n in stacked):
            plan.notes.append(f"ep={self.size} (already sharded)")
            return  # initialised again, or an eval step on the training step's module
        if not has_meta(module):  # built on the meta device: the strategy allocates the shards (fsdp)
            move(module, self.mesh.device)
        axes = expert_axes(self.mesh)  # ep, and the tp and cp axes it borrows
        split = math.prod(self.mesh.axis_size(a) for a in axes)
        over = " x ".join(f"{a}={self.mesh.axis_size(a)}" for a in axes)
        ep_mesh = self.mesh.submesh(*axes)
        group = self.mesh.axes_group(axes)
        owners: dict[str, int] = {}
        for name, owner in stacked.items():
            p = module.get_parameter(name)
            experts = p.shape[0]
            if owners.setdefault(owner, experts) != experts:
                raise ValueError(
                    f"ep_plan: the params of {owner!r} stack different numbers of experts on dim 0"
                )
            if experts % split:
                borrowed = f" x the tp and cp axes it borrows: {over}, {split} ranks" if len(axes) > 1 else ""
                raise ValueError(
                    f"expert parallel: {name} stacks {experts} experts on dim 0, which ep={self.size}{borrowed} does "
                    f"not divide (use sizes whose product divides {experts})"
                )
            sub, _, leaf = name.rpartition(".")
            # scattered from the first rank of the experts' group: every group holds one consistent set of experts
            shard = distribute_tensor(p.detach(), ep_mesh, [Shard(0)] * len(axes))
            setattr(module.get_submodule(sub), leaf, nn.Parameter(shard, requires_grad=p.requires_grad))
        modelled = dry_mode.grouped_mm_dtypes()  # a dry run of a GPU job: as on that device, not the host
        grouped = modelled if modelled is not None else self.mesh.platform.grouped_mm_dtypes()
        self.dispatchers.clear()
        factors: set[float] = set()
        for owner, experts in owners.items():
            m = module.get_submodule(owner)
            factor = getattr(m, CAPACITY, None)  # accelfn.moe.set_capacity
            if factor is not None and len(axes) > 1:
                raise ValueError(
                    f"expert parallel: {owner} has a capacity factor ({factor}), which drops rows first come first "
                    "served in the global batch's order; under context or tensor parallel each rank dispatches "
                    "parts of every sequence (cp) or of its rows (tp), not a run of that order: leave the capacity "
                    f"factor out (dropless) with cp or tp (mesh {dict(self.mesh.shape)})"
                )
            factors |= {factor} if factor is not None else set()
            data = self.mesh.data_group()
            made = make_dispatcher(self.dispatcher or AllToAllDispatcher, owner, group=group, num_experts=experts,
                                   size=split, capacity_factor=factor, data_group=data)  # fmt: skip
            self.dispatchers.append(made)
            if "tp" in axes:  # the tp ranks hold the same tokens: each dispatches its share of them
                m.forward = functools.partial(
                    tp_shared_forward, m, self.dispatchers[-1], self.mesh.group("tp"), grouped=grouped
                )
            else:
                m.forward = functools.partial(ep_forward, m, self.dispatchers[-1], grouped=grouped)
        per = ", ".join(sorted({f"{e // split} of {e}" for e in owners.values()}))
        plan.notes.append(
            f"{len(owners)} experts module(s), {per} experts per rank"
            + (f" (split over {over})" if len(axes) > 1 else "")
            + (
                f", {dispatcher_name(self.dispatcher)} dispatch, "
                if self.dispatcher
                else ", all-to-all dispatch, "
            )
            + (f"grouped GEMMs in {', '.join(str(d)[6:] for d in grouped)}, else " if grouped else "")
            + "per-expert loop"
            + "".join(f", capacity factor {f} (tokens over it dropped)" for f in sorted(factors))
        )


def expert_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the experts are split over, in mesh order: `ep`, and the `tp` and `cp` axes (of size > 1) it
    borrows, whose ranks then hold other experts too (torchtitan's ep over dp_shard x cp x tp)."""
    return tuple(a for a in mesh.axis_names if a == "ep" or (a in ("tp", "cp") and mesh.axis_size(a) > 1))


def token_group(mesh: Mesh) -> Any:
    """The ranks whose dispatchers route different rows (their counts add up): the data axes, `cp` and `tp` (whose
    ranks share out their tokens)."""
    axes = tuple(a for a in mesh.axis_names if a in mesh.grad_axes or (a == "tp" and mesh.axis_size(a) > 1))
    return mesh.axes_group(axes) if axes else None


def _gather_rows(x: torch.Tensor, bounds: list[int], group: Any) -> torch.Tensor:
    """Every rank's rows (rank i: `bounds[i+1] - bounds[i]` of them) concatenated, on every rank of `group`."""
    n = len(bounds) - 1
    most = max(bounds[i + 1] - bounds[i] for i in range(n))
    padded = x.new_zeros((most, *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = x.new_empty((n * most, *x.shape[1:]))
    dist.all_gather_into_tensor(out, padded, group=group)
    return torch.cat([out[i * most : i * most + bounds[i + 1] - bounds[i]] for i in range(n)])


class _Share(torch.autograd.Function):
    """This tp rank's rows of a tensor every tp rank holds whole; the backward gathers every rank's rows' gradient,
    so that each holds the whole gradient, as for any activation the tp ranks replicate."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bounds: list[int], group: Any) -> torch.Tensor:
        ctx.bounds, ctx.group = bounds, group
        r = dist.get_rank(group)
        return x[bounds[r] : bounds[r + 1]].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _gather_rows(grad.contiguous(), ctx.bounds, ctx.group), None, None


class _Whole(torch.autograd.Function):
    """Every tp rank's rows, whole on each; the backward keeps this rank's rows of the gradient (which every tp
    rank holds whole and alike)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, bounds: list[int], group: Any) -> torch.Tensor:
        ctx.bounds, ctx.group = bounds, group
        return _gather_rows(y.contiguous(), bounds, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        r = dist.get_rank(ctx.group)
        return grad[ctx.bounds[r] : ctx.bounds[r + 1]].contiguous(), None, None


def tp_shared_forward(
    module: nn.Module,
    dispatcher: Any,
    group: Any,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    grouped: tuple[torch.dtype, ...] = (),
    **_: Any,
) -> torch.Tensor:
    """The experts' forward when ep borrows the `tp` axis (`group`): the tp ranks hold the same tokens, so each
    dispatches its share of them (`accelfn.moe.ep_forward`) and the outputs are gathered back over `tp`."""
    from ...moe import ep_forward

    n, r = dist.get_world_size(group), dist.get_rank(group)
    bounds = [hidden.shape[0] * i // n for i in range(n + 1)]
    mine = top_k_index[bounds[r] : bounds[r + 1]]
    out = ep_forward(module, dispatcher, _Share.apply(hidden, bounds, group), mine,
                     _Share.apply(top_k_weights, bounds, group), grouped=grouped)  # fmt: skip
    return _Whole.apply(out, bounds, group)  # type: ignore[no-any-return]


@attrs.define(eq=False)
class ExpertParallelSync(TensorParallelSync):
    """The gradient sync under expert parallel: the data-parallel one (`inner`, which sums each expert only over
    the data axes it is not split over) for the sums; the norm and the overflow check over every rank, as under
    tensor parallel, since the ep ranks hold different experts (each counted once: Megatron #5916). Adds the
    step's MoE metrics of the global batch (`accelfn.moe.step_metrics`): `moe_tokens` [MoE layers, E],
    `moe_imbalance` (over the layers, the largest ratio of the most loaded expert's rows to the mean) and, with a
    capacity factor, `moe_dropped`."""

    dispatchers: list[Any] = attrs.Factory(list)
    data_group: Any = None  # the ranks that route different rows (their counts add up): `token_group`
    stages: Any = None  # under af.pipeline, its pp group: the metrics cover every stage's MoE layers

    def prepare(self, params: dict[str, torch.Tensor]) -> None:
        for d in self.dispatchers:  # count this step's rows only (not an eval step's, nor a failed step's)
            d.take_tokens()
        self.inner.prepare(params)

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.max_over_ranks(x)

    def reduce_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from ...moe import step_metrics

        moe = step_metrics(self.dispatchers, self.data_group)
        if self.stages is not None:
            moe = over_stages(moe, self.stages)
        return {**self.inner.reduce_metrics(values), **moe}

    def describe(self) -> str:
        return f"expert parallel (norm and overflow over all ranks); {self.inner.describe()}"


def over_stages(moe: dict[str, torch.Tensor], group: Any) -> dict[str, torch.Tensor]:
    """The MoE metrics of a pipeline's stages (`group`: its pp group), from each stage's own (`step_metrics`, of
    its layers): `moe_tokens` of every stage's layers in stage order, `moe_imbalance` their largest, `moe_dropped`
    the fraction of all stages' rows. Collective over `group`; a stage without MoE layers passes `{}`."""
    tokens = moe.get("moe_tokens")
    size = dist.get_world_size(group)
    shape = torch.tensor(list(tokens.shape) if tokens is not None else [0, 0])
    shapes = [torch.empty_like(shape) for _ in range(size)]
    dist.all_gather(shapes, shape, group=group)
    layers, experts = (max(int(s[i]) for s in shapes) for i in (0, 1))
    mine = torch.zeros(layers, experts, dtype=torch.int64)
    if tokens is not None:
        mine[: tokens.shape[0]] = tokens
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    tokens = torch.cat([t[: int(s[0])] for t, s in zip(every, shapes)])
    load = tokens.double()
    out = {
        "moe_tokens": tokens,
        "moe_imbalance": (load.max(1).values / load.mean(1).clamp_min(1e-12)).max().float(),
    }
    rows = float(mine.sum())
    dropped = torch.tensor([float(moe["moe_dropped"]) * rows if "moe_dropped" in moe else 0.0, rows, "moe_dropped" in moe],
                           dtype=torch.float64)  # fmt: skip
    dist.all_reduce(dropped, group=group)
    if dropped[2] > 0:
        out["moe_dropped"] = (dropped[0] / dropped[1].clamp_min(1)).float()
    return out
