"""`af.shard`: data parallelism over the mesh — DDP, FSDP (ZeRO-3-like) and HSDP.

- `"ddp"`: params replicated (broadcast from rank 0 at `init`); gradients are summed in ~`bucket_mb`
  buckets whose all-reduces start during the backward pass (`overlap`, default: where the platform
  gains from it — accelerators yes, CPUs no), and the loss sum and the
  count in one more tiny all-reduce, so the update divides by the *global* count: N ranks give the update
  of one process on the global batch. One sync per call, also under `af.accumulate`.
- `"fsdp"`: torch's FSDP2 (`fully_shard`) on every block and on the root; the state's params and
  optimizer state are the module's own DTensor shards (memory per rank ~1/N). Reduce-scatter sums.
  Under `af.autocast` the matching `MixedPrecisionPolicy` (param dtype, fp32 reduce) is used.
- `"hsdp"`: FSDP2 on a 2-D mesh (`dp` replicate x `fsdp` shard).
- `"local_sgd"`: no gradient sync; each rank updates its own replica and the params are averaged every
  `sync_every` updates (Accelerate's `LocalSGD`); see `accelfn.transforms.shard.local_sgd`.

`backend="deepspeed"` runs the step through a DeepSpeed engine (ZeRO stage `zero_stage`; by default
ZeRO-1 for `strategy="ddp"`, ZeRO-3 for `"fsdp"`), with its config generated from the combinators and
merged with the user's `ds_config`; see `accelfn.transforms.shard.deepspeed`.

Each rank passes its own shard of the global batch (as `af.data.DataLoader(mesh=...)` yields), or, with
`inputs="global"`, every rank passes the same global batch and the step takes its rows. Metrics are
global (except under `"local_sgd"`, whose metrics are each rank's): the loss is the global mean, `aux` values
are averaged over ranks; `rank_loss` is the loss of this rank's own rows.

Example:
    >>> import torch, accelfn as af
    >>> mesh = af.Mesh({"dp": -1}, device="cpu")
    >>> step = af.shard(af.train_step(lambda m, b: af.losses.mse(m(b), b), af.optim.sgd(0.1)), mesh)
    >>> state = step.init(torch.nn.Linear(4, 4))
    >>> state, metrics = step(state, torch.randn(8, 4))
    >>> step
    Step(train_step(<lambda>) -> shard(ddp, dp=1)  [ddp over 1 ranks, 1 bucket(s)])
    >>> mesh.close()
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from ..._typecheck import checked
from ...engine.contract import LOCAL, GradSync
from ...mesh import GRAD_AXES, Mesh
from ...module import move
from ...step import Step
from .._base import TransformBase
from .common import batch_transform

if TYPE_CHECKING:
    from ...engine import Plan

__all__ = ["shard", "STRATEGIES"]

NOT_SPLIT: dict[str, str] = {}  # mesh axes af.shard refuses to split over (none at present)
EP_STRATEGIES = ("ddp", "fsdp", "hsdp")  # what expert parallel combines with in this version
DEEPSPEED_OPTIONS = ("ds_config", "zero_stage", "offload_optimizer")
_LOCAL_SGD_WHOLE = "local SGD averages whole replicas"
NO_PIPELINE = "the step has no af.pipeline"  # (the planner reads it: no candidate with a pp axis can lower)


@attrs.frozen
class Strategy:
    """One way `af.shard` splits a step over the data axes: how it lowers, and what it accepts.

    `lower` names `module:function`, `function(shard, plan) -> GradSync` (the module is imported when a step
    using it is lowered); `needs` the mesh axes it requires; `options` the shard() options that only it takes;
    `tp` / `cp`: whether it combines with tensor / context parallel (else the reason it does not).
    """

    name: str
    backend: str
    lower: str
    needs: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    tp: bool | str = True
    cp: bool | str = True
    note: str = ""  # what the name means under this backend, for messages (e.g. "ZeRO-1")

    def lower_fn(self) -> Callable[[Shard, Plan], GradSync]:
        module, _, function = self.lower.partition(":")
        return getattr(importlib.import_module(f"{__name__}.{module}"), function)  # type: ignore[no-any-return]


_NO_DS_TP = "DeepSpeed runs data-parallel over all processes"
# A new strategy is one module with a `lower` function plus one row here.
TABLE: tuple[Strategy, ...] = (
    Strategy("ddp", "torch", "ddp:lower_ddp"),
    Strategy("fsdp", "torch", "fsdp:lower_fsdp"),
    Strategy("hsdp", "torch", "fsdp:lower_fsdp", needs=("dp", "fsdp")),
    Strategy(
        "local_sgd", "torch", "local_sgd:lower_local_sgd", options=("sync_every",),
        tp=f"{_LOCAL_SGD_WHOLE}: tensor parallel is not combined with it", cp=f"{_LOCAL_SGD_WHOLE}: use strategy='ddp'",
    ),
    Strategy(
        "ddp", "deepspeed", "deepspeed.lowering:lower_deepspeed", options=DEEPSPEED_OPTIONS, tp=_NO_DS_TP,
        cp="DeepSpeed splits no sequence", note="ZeRO-1",
    ),
    Strategy(
        "fsdp", "deepspeed", "deepspeed.lowering:lower_deepspeed", options=DEEPSPEED_OPTIONS, tp=_NO_DS_TP,
        cp="DeepSpeed splits no sequence", note="ZeRO-3",
    ),
)  # fmt: skip
STRATEGIES = tuple(dict.fromkeys(s.name for s in TABLE))
# shorthands for backend="deepspeed" at a ZeRO stage (the strategy knob's values zero1-3): row name, stage
ZERO_STRATEGIES = {"zero1": ("ddp", 1), "zero2": ("ddp", 2), "zero3": ("fsdp", 3)}
BACKENDS = tuple(dict.fromkeys(s.backend for s in TABLE))


def strategy_for(name: str, backend: str) -> Strategy:
    """The row of `TABLE` for `shard(strategy=name, backend=backend)`; a ValueError naming what exists."""
    if name not in STRATEGIES:
        raise ValueError(f"shard: strategy must be one of {(*STRATEGIES, *ZERO_STRATEGIES)}, got {name!r}")
    if backend not in BACKENDS:
        raise ValueError(f"shard: backend must be one of {BACKENDS}, got {backend!r}")
    for row in TABLE:
        if (row.name, row.backend) == (name, backend):
            return row
    have = " or ".join(
        repr(r.name) + (f" ({r.note})" if r.note else "") for r in TABLE if r.backend == backend
    )
    raise ValueError(f"shard(backend={backend!r}) supports strategy {have}, not {name!r}")


@attrs.frozen(eq=False)
class Shard(TransformBase):
    mesh: Mesh
    strategy: str = "ddp"
    backend: str = "torch"
    inputs: str = "local"
    bucket_mb: float = 25.0
    ds_config: Mapping[str, Any] | str | Path | None = None
    zero_stage: int | None = None
    offload_optimizer: bool | None = None
    overlap: bool | None = None
    sync_every: int | None = None
    kind: str = "shard"

    def describe(self) -> str:
        axes = ", ".join(f"{k}={v}" for k, v in self.mesh.shape.items())
        extra = f", backend={self.backend!r}" if self.backend != "torch" else ""
        if self.zero_stage is not None:
            extra += f", zero_stage={self.zero_stage}"
        if self.offload_optimizer:
            extra += ", offload_optimizer=True"
        if self.sync_every is not None:
            extra += f", sync_every={self.sync_every}"
        return f"shard({self.strategy}, {axes}{extra})"

    def lower(self, plan: Plan) -> None:
        """Every strategy: the batch transform (this rank's rows, on the mesh's device) and the rank's RNG stream;
        then the strategy's own lowering, which returns its `GradSync`; tensor parallel wraps that sync."""
        mesh = self.mesh
        plan.batch_transform = batch_transform(mesh, self.inputs)
        plan.rank_key = mesh.grad_rank if mesh.grad_axes else 0  # tp alone: every rank reads the same batch
        sync: GradSync | None = None
        if mesh.grad_axes:
            sync = strategy_for(self.strategy, self.backend).lower_fn()(self, plan)
        else:  # tensor parallel alone (af.Mesh({"tp": 2}))
            move(plan.module, mesh.device)
        if any(t.kind == "tensor_parallel" for t in plan.transforms):
            from .tensor_parallel import TensorParallelSync

            sync = TensorParallelSync(sync if sync is not None else LOCAL)
        ep = next((t for t in plan.transforms if t.kind == "expert_parallel"), None)
        pipeline = next((t for t in plan.transforms if t.kind == "pipeline"), None)
        # under a pipeline: each stage's experts, all-to-alls over its ep group (ep=1: a user plan checked only)
        if ep is not None and ep.size > 1:
            from .expert_parallel import ExpertParallelSync

            inner = sync if sync is not None else LOCAL
            stages = mesh.group("pp") if pipeline is not None else None
            from .expert_parallel import token_group

            # the dispatchers' row counts add up over the ranks that route different rows: data axes, cp and tp
            sync = ExpertParallelSync(inner, list(ep.dispatchers), token_group(mesh), stages)
        if pipeline is not None:  # the pp axis: the pipeline's sync over the data-parallel one
            sync = pipeline.wrap(sync if sync is not None else LOCAL)
        plan.grad_sync = sync

    def check(self, others: Sequence[Any]) -> None:
        if self.strategy == "local_sgd" and any(t.kind == "pipeline" for t in others):
            raise ValueError(
                "shard(strategy='local_sgd') averages whole replicas: it is not combined with af.pipeline "
                "(use strategy='ddp' or 'fsdp' with a pipeline)"
            )
        pp = self.mesh.axis_size("pp") if "pp" in self.mesh.axis_names else 1
        if pp > 1 and not any(t.kind == "pipeline" for t in others):
            raise ValueError(
                f"shard: the mesh has a 'pp' axis of size {pp}, but {NO_PIPELINE}: its ranks would all compute the "
                "same thing. Wrap the step: af.pipeline(step, mesh, microbatches=...)"
            )


@checked
def shard(
    step: Step,
    mesh: Mesh,
    *,
    strategy: str = "ddp",
    backend: str = "torch",
    inputs: str = "local",
    bucket_mb: float = 25.0,
    ds_config: dict[str, Any] | str | Path | None = None,
    zero_stage: int | None = None,
    offload_optimizer: bool | None = None,
    overlap: bool | None = None,
    sync_every: int | None = None,
    tp_plan: Mapping[str, Any] | None = None,
    loss_parallel: bool | None = None,
    sequence_parallel: bool | None = None,
    ep_plan: Mapping[str, str] | None = None,
    ep_dispatcher: Callable[..., Any] | None = None,
) -> Step:
    """Run `step` data-parallel over `mesh`'s data axes (`dp`, `fsdp`), context-parallel over its `cp` axis and
    tensor-parallel over its `tp` axis; see the module docs.

    DeepSpeed only: `ds_config` (a dict or a JSON path) is merged into the generated config and must agree
    with the combinators; `zero_stage` (0-3) overrides the stage of `ds_config` and of `strategy`
    ("ddp" -> 1, "fsdp" -> 3); `offload_optimizer=True` keeps the optimizer state and update on the CPU
    (ZeRO-Offload, with DeepSpeedCPUAdam).
    `strategy="zero1"|"zero2"|"zero3"` is short for `backend="deepspeed", zero_stage=1|2|3` (the values of a launch
    config's strategy knob, `accelfn.launch_env.knob("strategy")`, that `accelfn plan` searches).

    `strategy="local_sgd"` only: `sync_every` (default 1), the number of updates between two averagings of the
    replicas' params.

    Tensor parallel (a `tp` axis of size > 1): a Hugging Face model uses its own plan; `tp_plan` (module-name
    patterns -> style names or torch `ParallelStyle`s) overrides it; see `accelfn.transforms.shard.tensor_parallel`.
    `loss_parallel=True` leaves the logits split over the vocabulary and runs the loss on the shards (torch's
    `loss_parallel`): no rank holds the whole logits (the loss function then receives a DTensor).
    `sequence_parallel=True` (Hugging Face decoders) keeps the residual stream split over the sequence between
    the tensor-parallel regions, so norms and dropout run on `seq / tp` tokens per rank. Both default to None:
    on for the `transformers` decoders they are tested on (Llama, Mistral, Qwen2, Starcoder2 causal LMs under
    their own plan, not cut into pipeline stages; torchtitan's defaults), off otherwise; `False` turns them off.

    Expert parallel (an `ep` axis of size > 1, strategy "ddp" or "fsdp"): the ep ranks read their own rows
    (data-parallel for the dense layers) and each holds `E / ep` experts of every MoE layer, tokens moving to their
    experts by all-to-all. A `transformers` MoE model uses its own plan (`config.base_model_ep_plan`); `ep_plan`
    (name patterns -> "grouped_gemm" / "ep_dispatch_experts") overrides it (on a mesh without ep it is kept for
    `accelfn plan`, which reads it to search ep, and checked against the model at `init` as with ep, the same
    error naming an entry that matches nothing; the experts stay whole); see
    `accelfn.transforms.shard.expert_parallel`. With a `tp` or `cp` axis, or under `af.pipeline`, the dense layers
    see `ep` as a data axis beside them (each of its ranks a tp group, cp group or stage rank as without ep), and
    the experts are split over `ep` and the `tp` and `cp` axes it borrows; the tp plan's entries for the experts
    give way to the ep plan. `ep_dispatcher` swaps how the rows move (default: `accelfn.moe.AllToAllDispatcher`):
    a factory called per experts module as `ep_dispatcher(group=, num_experts=, size=, capacity_factor=,
    data_group=)` that returns an `accelfn.moe.Dispatcher`; `print(step)` names it.

    Context parallel (a `cp` axis of size > 1): the cp ranks read the same rows and each computes on a part of
    every sequence (dim 1 of each batch tensor), attention all-gathering keys and values; labels must be aligned
    with the inputs (not shifted inside the loss). See `accelfn.transforms.shard.context_parallel`.

    Example:
        >>> import torch, accelfn as af
        >>> with af.Mesh({"dp": -1}, device="cpu") as mesh:  # 1 process here; N under `accelfn launch`
        ...     step = af.shard(af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)), mesh)
        ...     state, metrics = step(step.init(torch.nn.Linear(3, 1)), torch.randn(4, 3))
        >>> int(state.step)
        1
    """
    strategy, backend, zero_stage = _zero_shorthand(strategy, backend, zero_stage)
    row = strategy_for(strategy, backend)
    given = {
        "ds_config": ds_config,
        "zero_stage": zero_stage,
        "offload_optimizer": offload_optimizer,
        "sync_every": sync_every,
    }
    foreign = [k for k, v in given.items() if v is not None and k not in row.options]
    if foreign:
        owner = next(r for r in TABLE if foreign[0] in r.options)
        if owner.backend != "torch":
            raise ValueError(
                f"shard: ds_config, zero_stage and offload_optimizer apply to backend={owner.backend!r} only"
            )
        raise ValueError(f"shard: {foreign[0]} applies to strategy={owner.name!r} only, not {strategy!r}")
    if sync_every is not None and (isinstance(sync_every, bool) or sync_every < 1):
        raise ValueError(f"shard: sync_every must be a number of updates >= 1, got {sync_every}")
    if zero_stage is not None and zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"shard: zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if inputs not in ("local", "global"):
        raise ValueError(
            f"shard: inputs must be 'local' (each rank passes its shard) or 'global', got {inputs!r}"
        )
    _check_axes(mesh)
    tp = mesh.axis_size("tp") if "tp" in mesh.axis_names else 1
    cp = mesh.axis_size("cp") if "cp" in mesh.axis_names else 1
    if not mesh.grad_axes and tp == 1:
        raise ValueError(
            f"shard: the mesh has no data axis (dp or fsdp), no cp and no tp axis; its axes are {mesh.axis_names}"
        )
    if cp > 1:
        why = row.cp if isinstance(row.cp, str) else None
        if why:
            raise ValueError(f"shard: context parallel (cp={cp} in mesh {mesh.shape}): {why}")
    for flag, value in (("sequence_parallel", sequence_parallel), ("loss_parallel", loss_parallel)):
        if value is True and tp == 1:
            raise ValueError(f"shard: {flag}=True needs a tp axis of size > 1 (shape {mesh.shape})")
    if tp_plan is not None and tp == 1:
        raise ValueError(
            f"shard: tp_plan given, but the mesh has no tp axis of size > 1 (shape {mesh.shape})"
        )
    ep = mesh.axis_size("ep") if "ep" in mesh.axis_names else 1
    if ep_plan is not None:  # kept on a mesh without ep (the experts stay whole): a script runs on any mesh
        from .expert_parallel import GIVEN

        GIVEN[:] = [dict(ep_plan)]
    if ep_dispatcher is not None and ep == 1:
        raise ValueError(
            f"shard: ep_dispatcher given, but the mesh has no ep axis of size > 1 (shape {mesh.shape})"
        )
    if ep > 1 and sequence_parallel:
        raise ValueError(
            f"shard: sequence_parallel=True with expert parallel (ep={ep}, tp={tp}): the MoE layers would receive the "
            "residual stream split over the sequence, which their router and dispatch do not take in this version; "
            "leave it off (each tp rank then dispatches its share of the tokens)"
        )
    if ep > 1 and (strategy, backend) not in [(s, "torch") for s in EP_STRATEGIES]:
        raise ValueError(
            f"shard: expert parallel (ep={ep} in mesh {mesh.shape}) combines with strategy 'ddp', 'fsdp' or "
            f"'hsdp' (backend 'torch') in this version, not strategy={strategy!r}, backend={backend!r}"
        )
    others = [a for a in mesh.data_axes if a != "ep" and mesh.axis_size(a) > 1]
    if ep > 1 and strategy == "fsdp" and not others:
        raise ValueError(
            f"shard(strategy='fsdp') with expert parallel (mesh {mesh.shape}): the experts are FSDP-sharded over the "
            "data axes other than ep (efsdp), and this mesh has none; use strategy='ddp', or add one, e.g. "
            "af.Mesh({'fsdp': 2, 'ep': 2})"
        )
    if tp > 1 and isinstance(row.tp, str) and row.backend == "torch":
        raise ValueError(f"shard(strategy={strategy!r}) on a tp axis of size {tp}: {row.tp}")
    if tp > 1 and isinstance(row.tp, str):
        raise ValueError(
            f"af.shard(backend={backend!r}) runs data-parallel over all {mesh.world_size} processes and does not "
            f"combine with tensor parallel (tp={tp}): use a mesh like af.Mesh({{'dp': -1}}), or backend='torch' "
            "for tensor parallel"
        )
    if not mesh.grad_axes and strategy != "ddp":
        raise ValueError(
            f"shard(strategy={strategy!r}) shards over a data axis (dp or fsdp), but the mesh has only {mesh.axis_names}: "
            "with tensor parallel alone, leave strategy as it is"
        )
    if row.needs and not set(row.needs) <= set(mesh.axis_names):
        axes = " and ".join(repr(a) for a in row.needs)
        raise ValueError(
            f"shard(strategy={strategy!r}) needs a {len(row.needs)}-D mesh with axes {axes}; got {mesh.axis_names}"
        )
    step = step.with_transform(
        Shard(
            mesh,
            strategy,
            backend,
            inputs,
            bucket_mb,
            ds_config,
            zero_stage,
            offload_optimizer,
            overlap,
            sync_every,
        )
    )
    if cp > 1:
        from .context_parallel import ContextParallel

        step = step.with_transform(ContextParallel(mesh))
    if tp > 1:
        from .tensor_parallel import TensorParallel

        plan_items = tuple(tp_plan.items()) if tp_plan is not None else None
        step = step.with_transform(TensorParallel(mesh, plan_items, loss_parallel, sequence_parallel))
    if ep > 1 or ep_plan is not None:  # at ep=1 it checks the plan against the model, as at ep > 1
        from .expert_parallel import ExpertParallel

        plan_items = tuple(ep_plan.items()) if ep_plan is not None else None
        step = step.with_transform(ExpertParallel(mesh, plan_items, dispatcher=ep_dispatcher))
    return step


def _zero_shorthand(strategy: str, backend: str, zero_stage: int | None) -> tuple[str, str, int | None]:
    """`strategy="zero1"|"zero2"|"zero3"` (a launch config's strategy knob) as `backend="deepspeed"` with that ZeRO
    stage: stages 1 and 2 on the "ddp" row, 3 on the "fsdp" row.

    Example:
        >>> _zero_shorthand("zero2", "torch", None), _zero_shorthand("fsdp", "torch", None)
        (('ddp', 'deepspeed', 2), ('fsdp', 'torch', None))
    """
    if strategy not in ZERO_STRATEGIES:
        return strategy, backend, zero_stage
    name, stage = ZERO_STRATEGIES[strategy]
    if zero_stage is not None and zero_stage != stage:
        raise ValueError(
            f"shard: strategy={strategy!r} is ZeRO stage {stage}, but zero_stage={zero_stage} was given"
        )
    if backend not in ("torch", "deepspeed"):  # "torch": the default, left as it is
        raise ValueError(f"shard: strategy={strategy!r} runs on backend='deepspeed', not backend={backend!r}")
    return name, "deepspeed", stage


def _check_axes(mesh: Mesh) -> None:
    """Refuse a mesh axis of size > 1 that af.shard does not split over (its ranks would duplicate the work)."""
    for axis, what in NOT_SPLIT.items():
        if axis in mesh.axis_names and mesh.axis_size(axis) > 1:
            raise ValueError(
                f"shard: the mesh has a {axis!r} axis of size {mesh.axis_size(axis)}, but af.shard does not split over "
                f"it ({what} is not implemented in this version): its ranks would all compute the same thing"
            )
    known = (*GRAD_AXES, "tp")
    for axis in mesh.axis_names:
        if axis in NOT_SPLIT or axis in known or axis == "pp" or mesh.axis_size(axis) == 1:  # pp: af.pipeline
            continue
        close = difflib.get_close_matches(axis, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        if axis == "sp":
            hint = " Sequence parallel is shard(..., sequence_parallel=True) over the 'tp' axis; context parallel is 'cp'."
        raise ValueError(
            f"shard: the mesh axis {axis!r} (size {mesh.axis_size(axis)}, mesh {mesh.shape}) is not one af.shard "
            f"splits over ({', '.join(known)}): its ranks would all compute the same thing.{hint}"
        )
