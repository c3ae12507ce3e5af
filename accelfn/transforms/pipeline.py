"""`af.pipeline(step, microbatches, schedule)`: pipeline-parallel training over the mesh's `pp` axis.

The model is cut into stages (`accelfn.stages`: a Hugging Face decoder by its layers, balanced by parameter
count; any model by `split_points`); each rank of the `pp` axis keeps its stage's modules (the others become
param-free stand-ins), so its state holds only its stage's params and optimizer state, under their Hugging
Face names. torch's `torch.distributed.pipelining` runs the schedule (`PipelineStage` and its GPipe, 1F1B,
interleaved, looped-BFS and zero-bubble schedules); each stage runs *your loss function* on the whole model,
entering at its first module (the previous stage's activation replaces that module's input) and leaving at
the next stage's first module, so `loss_fn(model, batch)` is written once, as for one process.

Every rank of a pipeline group reads the same batch (`mesh.data_rank` counts only the data axes); the batch is
split into `microbatches` (times `af.accumulate`'s count) equal micro-batches. Gradients are summed over
micro-batches and divided by the global token count, as everywhere in accelfn: pp x dp gives the update of one
process on the global batch. The loss, the count and the metrics, computed by the last stage, reach every
rank; clipping uses the norm over all stages; a weight tied between stages (GPT-2's head and embedding) has its
gradient summed between them. With an `ep` axis each stage's experts are split over that stage's ep group; an MoE
model asked for its router logits (an aux or z-loss, which the last stage would compute on its own layers only)
is refused.

Example (on 2 processes started by `accelfn launch --nproc-per-node 2`):
    mesh = af.Mesh({"pp": 2})
    step = af.pipeline(af.train_step(loss_fn, af.optim.adamw(3e-4)), mesh, microbatches=4, schedule="1f1b")
    state = step.init(model)            # this rank's stage
    state, metrics = step(state, batch)  # the same batch on every rank
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from .. import dry_mode
from .. import random as _random
from .._typecheck import checked
from ..dtensor import is_dtensor, local_tensor
from ..engine.batches import loss_parts, rows, split_batch
from ..engine.contract import LOCAL, GradSync
from ..engine.phases import StepRun, TrainPhases
from ..mesh import Mesh
from ..module import move
from ..stages import Split, balanced_split, bypass_forward, carve, recording_made_up, split_at
from ..step import Step
from ._base import TransformBase, conflict, find

if TYPE_CHECKING:
    from ..engine import Plan
    from ..lowering import Transform

__all__ = ["pipeline", "pipeline_step", "Pipeline", "PipelineSync", "SCHEDULES", "bubble_fraction"]


@attrs.frozen
class ScheduleInfo:
    torch_name: str
    stages_per_rank: int  # default (and, for the V schedules, required) number of stages per rank
    placement: str  # "single", "loop" (stage s on rank s % pp) or "v" (rank r: stages r and 2pp-1-r)


SCHEDULES: dict[str, ScheduleInfo] = {
    "gpipe": ScheduleInfo("ScheduleGPipe", 1, "single"),
    "1f1b": ScheduleInfo("Schedule1F1B", 1, "single"),
    "interleaved_1f1b": ScheduleInfo("ScheduleInterleaved1F1B", 2, "loop"),
    "looped_bfs": ScheduleInfo("ScheduleLoopedBFS", 2, "loop"),
    "interleaved_zb": ScheduleInfo("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": ScheduleInfo("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ScheduleInfo("ScheduleDualPipeV", 2, "v"),
}


ZERO_BUBBLE = ("interleaved_zb", "zbv", "dualpipev")  # the schedules that split the backward (input / weight)


def bubble_fraction(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The idle fraction of a 1F1B/GPipe-style schedule: (p-1)/(m+p-1) for p stages and m micro-batches,
    the bubble divided by v for v interleaved stages per rank (Narayanan et al. 2021).

    Example:
        >>> round(bubble_fraction(4, 8), 3), round(bubble_fraction(4, 8, 2), 3)
        (0.273, 0.158)
    """
    bubble = (pp - 1) / stages_per_rank
    return bubble / (microbatches + bubble)


class _StageDone(Exception):
    """Raised by the hook on the next stage's first module: this stage's output is that module's input, with
    the generators' states at that point (the next stage continues their streams, as one process would)."""

    def __init__(self, value: torch.Tensor, rng: torch.Tensor) -> None:
        super().__init__("pipeline stage boundary")
        self.value = value
        self.rng = rng


def _hidden(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    if args:
        return args[0]
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]  # type: ignore[no-any-return]
    raise TypeError("af.pipeline: a split point module was called without its hidden state as first argument")


@attrs.define(eq=False)
class _Layout:
    """This rank's part of the pipeline, built at lowering."""

    split: Split
    pp: int
    rank: int
    stages: tuple[int, ...]  # the stage indices this rank runs
    microbatches: int  # per step (times accumulate's count)
    schedule: str
    tied: dict[str, tuple[int, ...]]  # tied weight name -> stages holding it
    units: dict[int, list[str]]  # stage -> outermost modules of that stage on this rank (bypassed when idle)

    @property
    def n_stages(self) -> int:
        return self.split.n_stages

    @property
    def holds_last(self) -> bool:
        return self.n_stages - 1 in self.stages


@attrs.define(eq=False)
class PipelineSync(GradSync):
    """The pipeline's sync: the data-parallel strategy's (`inner`) over the data axes, then the sums over the
    `pp` group that make loss, count, metrics and the gradient norm global."""

    inner: GradSync
    mesh: Mesh
    layout: _Layout
    plan: Plan
    group: Any = None  # the pp process group
    tied_groups: dict[str, Any] = attrs.Factory(dict)
    aux_keys: tuple[str, ...] | None = None
    cache: dict[Any, Any] = attrs.Factory(dict)  # micro-batch shapes -> (stages, schedule)
    run: StepRun | None = None
    results: dict[int, tuple[torch.Tensor, torch.Tensor, dict[str, Any]]] = attrs.Factory(dict)
    active: int | None = None  # the stage running now on this rank
    received: torch.Tensor | None = None
    received_rng: torch.Tensor | None = None
    hooks_on: Any = None
    own_hooks: set[int] = attrs.Factory(set)
    next_micro: dict[int, int] = attrs.Factory(dict)  # stage -> the micro-batch its next forward runs
    checked: set[int] = attrs.Factory(set)  # stages whose first output was checked for a stand-in's NaN
    phases: Any = attrs.field(factory=lambda: PipelinePhases())
    rank_loss: bool = False  # only the last stage computes the loss
    # `sync_each_microbatch=True`: the FSDP2 sync whose `microbatch` context each backward runs in (else None)
    each: Any = None
    entry_shapes: dict[tuple[int, ...], torch.Size] = attrs.Factory(dict)  # boundary: local shape -> global
    units_of: dict[int, list[Any]] | None = None  # stage -> its FSDP2 units (`stage_units`, found once)

    def __attrs_post_init__(self) -> None:
        # torch's pipelining allocates a module-level tensor when imported (`sum_reducer`'s 0.0): import it now,
        # when the step is lowered, not inside the first step, where a real run and a dry run would count those
        # 4 bytes as an activation only in the first step of the process
        import torch.distributed.pipelining  # noqa: F401

    # ---- the engine's protocol ----------------------------------------------------------------------------
    def prepare(self, params: dict[str, torch.Tensor]) -> None:
        self.inner.prepare(params)

    def after_update(self, params: dict[str, torch.Tensor], step: torch.Tensor) -> None:
        self.inner.after_update(params, step)

    def abandon(self) -> None:
        self.inner.abandon()

    def reduce(
        self, grads: list[torch.Tensor], loss_sum: torch.Tensor, count: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss_sum, count = self.inner.reduce(grads, loss_sum, count)
        both = torch.stack([loss_sum.detach().double().reshape(()), count.detach().double().reshape(())])
        dist.all_reduce(both, group=self.group)  # only the last stage has them
        assert self.plan.slots is not None
        names = self.plan.slots.trainable
        for name, group in self.tied_groups.items():
            g = local_tensor(grads[names.index(name)])
            dist.all_reduce(g, group=group)  # the stages that use a tied weight sum their gradients
        return both[0].to(torch.float32), both[1].to(count.dtype)

    def any_rank(self, flag: torch.Tensor) -> torch.Tensor:
        flag = self.inner.any_rank(flag).clone()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return flag

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inner.max_over_ranks(x).clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def norm_of(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        """The L2 norm over every stage's gradients (a tied weight counted once, on its first stage)."""
        layout = self.layout
        mine = [g for n, g in grads.items() if n not in layout.tied or layout.tied[n][0] in layout.stages]
        local = self.inner.norm(mine) if mine else torch.zeros((), device=self.mesh.device)
        sq = local.detach().double().pow(2).reshape(1)
        dist.all_reduce(sq, group=self.group)
        return sq.sqrt().to(torch.float32).reshape(())

    def reduce_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.aux_keys is None:  # which metrics the last stage's loss returns (once)
            last = dist.get_global_rank(self.group, self._rank_of(self.layout.n_stages - 1))
            box = [tuple(sorted(values)) if self.layout.holds_last else None]
            if dry_mode.active() is not None:
                box = [tuple(sorted(values))]
            else:
                dist.broadcast_object_list(box, src=last, group=self.group)
            self.aux_keys = box[0]
        if not self.aux_keys:
            return self.inner.reduce_metrics({})  # (the strategy's own metrics: expert parallel's)
        device = self.mesh.device
        flat = torch.stack(
            [
                values[k].detach().double().reshape(()).to(device)
                if self.layout.holds_last
                else torch.zeros((), dtype=torch.float64, device=device)
                for k in self.aux_keys
            ]
        )
        dist.all_reduce(flat, group=self.group)
        out = {k: v.to(torch.float32) for k, v in zip(self.aux_keys, flat.unbind(0))}
        return self.inner.reduce_metrics(out)

    def init_opt_state(self, trainable: dict[str, torch.Tensor]) -> Any:
        return self.inner.init_opt_state(trainable)

    def describe(self) -> str:
        lo = self.layout
        return (
            f"pipeline({lo.schedule}, pp={lo.pp}, stages {list(lo.stages)} of {lo.n_stages}, "
            f"{lo.microbatches} micro-batches{', gradients reduce-scattered each' if self.each is not None else ''}) "
            f"over {self.inner.describe()}"
        )

    # ---- running the schedule ---------------------------------------------------------------------------------
    def stage_units(self, stage: int) -> list[Any]:
        """The FSDP2 units (sharded modules) holding params of this rank's `stage` (a unit holding params of
        several of its stages is in each's list; one whose owner the split does not name, in every one)."""
        if self.units_of is None:
            from torch.distributed.fsdp import FSDPModule

            from .shard.fsdp import _unit_params

            root = self.plan.module
            names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
            owner, mine = self.layout.split.owner, set(self.layout.stages)
            self.units_of = {s: [] for s in self.layout.stages}
            for unit in root.modules():
                if not isinstance(unit, FSDPModule) or not hasattr(unit, "set_reduce_scatter_unused_params"):
                    continue  # (a torch without it: a unit left unreduced is refused after the schedule)
                stages = {owner.get(names.get(id(m), ""), -1) for m, _ in _unit_params(unit)}  # type: ignore[arg-type]
                for s in mine if -1 in stages else stages & mine:
                    self.units_of[s].append(unit)
        return self.units_of.get(stage, [])

    def _rank_of(self, stage: int) -> int:
        return _place(self.layout, stage)

    def install_hooks(self) -> None:
        """Hooks on every split point: entering a stage replaces its first module's input by the received
        activation; reaching the next stage's first module ends the stage (found on the module as lowered, so
        that remat's recomputation sees the injected input)."""
        if self.hooks_on is self.plan.module:
            return
        points = self.layout.split.points
        for k, name in enumerate(points):
            module = self.plan.module.get_submodule(name)

            def enter(mod: nn.Module, args: Any, kwargs: Any, stage: int = k + 1) -> Any:
                if self.active == stage and self.received is not None:
                    if self.received_rng is not None and dry_mode.active() is None:
                        # dropout from here on draws what one process draws after the earlier stages
                        _random.set_generator_states(self.received_rng, self.plan.devices)
                    received = _entering(self.plan.module, self.received, self.entry_shapes)
                    if args:
                        return (received, *args[1:]), kwargs
                    return args, {**kwargs, "hidden_states": received}
                if self.active == stage - 1:  # the end of the running stage
                    raise _StageDone(_hidden(args, kwargs), _random.generator_states(self.plan.devices))
                return None

            handle = module.register_forward_pre_hook(enter, with_kwargs=True)
            self.own_hooks.add(handle.id)
        self.hooks_on = self.plan.module

    @contextlib.contextmanager
    def _only(self, stages: Sequence[int]) -> Iterator[None]:
        """While one of this rank's stages runs, its other stages' modules compute nothing."""
        patched = []
        for s, names in self.layout.units.items():
            if s in stages:
                continue
            for name in names:
                m = self.plan.module.get_submodule(name)
                hooks = (dict(m._forward_pre_hooks), dict(m._forward_hooks))
                patched.append((m, m.__dict__.get("forward"), hooks))
                object.__setattr__(m, "forward", bypass_forward(m))
                # other combinators' hooks (tensor parallel's layouts, FSDP's all-gathers) expect the real
                # forward: off while bypassed; the pipeline's own boundary hooks stay
                for table in (m._forward_pre_hooks, m._forward_hooks):
                    for key in [k for k in table if k not in self.own_hooks]:
                        del table[key]
        try:
            yield
        finally:
            for m, fwd, (pre, post) in patched:
                if fwd is None:
                    del m.__dict__["forward"]
                else:
                    object.__setattr__(m, "forward", fwd)
                m._forward_pre_hooks.clear()
                m._forward_pre_hooks.update(pre)
                m._forward_hooks.clear()
                m._forward_hooks.update(post)

    def run_stage(self, stage: int, *args: Any) -> Any:
        """One micro-batch through one stage: the user's loss function on the whole model, entered at the
        stage's first module and left at the next stage's (the last stage returns the loss sum). Every torch
        schedule runs a stage's forwards in micro-batch order, so a counter per stage says which one.

        A stage's input and output are (activation, generator states): every stage seeds the generators from
        the micro-batch's key, and a later stage then takes the states the previous one had at the split
        point, so dropout draws the numbers of one process running the same micro-batches."""
        run, plan = self.run, self.plan
        assert run is not None and run.step_key is not None and plan.loss_call is not None
        i = self.next_micro.get(stage, 0)
        self.next_micro[stage] = i + 1
        mb = run.micro[i]
        key = run.step_key if len(run.micro) == 1 else _random.fold_in(run.step_key, i)
        self.active, self.received = stage, (args[0] if stage > 0 else None)
        self.received_rng = args[1] if stage > 0 else None
        first = stage not in self.checked  # its first micro-batch: what its stand-ins make up is recorded
        recording = recording_made_up() if first else contextlib.nullcontext(set[str]())
        try:
            with (
                recording as made_up,
                self._only([stage]),
                _random.seeded(key, plan.devices),
                _inside_backward(plan),
            ):
                out = plan.loss_call(plan.module, mb)
        except _StageDone as done:
            if first:
                self._check_stand_ins(stage, done.value, made_up)
            return _leaving(done.value), done.rng.to(self.mesh.device)
        finally:
            self.active, self.received, self.received_rng = None, None, None
        if stage != self.layout.n_stages - 1:
            raise RuntimeError(
                f"af.pipeline: stage {stage} ran to the end of the loss without reaching split point "
                f"{self.layout.split.points[stage]!r}: the loss function must run the model's modules in order"
            )
        total, count, aux = loss_parts(out)
        if first:
            self._check_stand_ins(stage, total, made_up)
        if count is None:  # a mean over the micro-batch: weight it by its rows
            count = torch.tensor(float(rows(mb)), device=total.device)
            total = total * count
        self.results[i] = (
            local_tensor(total.detach()),
            count.detach(),
            {k: v.detach() for k, v in aux.items() if isinstance(v, torch.Tensor)},
        )
        return total.float().reshape(1)  # 1-d: the schedule concatenates the last stage's outputs

    def _check_stand_ins(self, stage: int, value: torch.Tensor, made_up: set[str]) -> None:
        """On a stage's first micro-batch: where its stand-ins for other stages' modules made up NaN (which the
        stage's received input replaces) and its output is NaN, the model most likely read one by another path
        (Gemma3n's per-layer inputs, T5's position bias): a warning naming them, beside the NaN loss (a warning, not
        an error: a NaN of the model's own, an fp16 overflow, would look the same). One host sync, once per
        stage."""
        self.checked.add(stage)
        if (
            not made_up
            or dry_mode.active() is not None
            or not torch.isnan(local_tensor(value).detach()).any()
        ):
            return
        where = ", ".join(repr(p) for p in self.layout.split.points)
        warnings.warn(
            f"af.pipeline: stage {stage}'s output is NaN on its first micro-batch, and it called stand-ins for "
            f"modules other stages own ({', '.join(sorted(made_up))}), whose made-up NaN outputs only the stage's "
            "received input replaces: the model most likely reads one of them by another path than the hidden state "
            "(per-layer inputs from the embedding, a position bias from the first block), so it cannot be split at "
            f"{where}. Split it where no later module reads an earlier one's output except through the hidden "
            "state, or not at all",
            RuntimeWarning,
            stacklevel=2,
        )

    def _probe(self, mb: Any, stage: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What enters `stage` (the activation's shape and dtype, and the generator states), found by running
        the loss function with every module of this rank bypassed, up to the stage's first module: no
        computation, no communication."""
        plan = self.plan
        assert plan.loss_call is not None
        self.active = stage - 1
        try:
            with torch.no_grad(), self._only([]), plan.forward_context():
                plan.loss_call(plan.module, mb)
        except _StageDone as done:
            value = _local_shape(plan.module, done.value.detach())
            self.entry_shapes[tuple(value.shape)] = done.value.shape
            return value.clone().requires_grad_(True), done.rng.to(self.mesh.device)
        finally:
            self.active = None
        raise RuntimeError(
            f"af.pipeline: the loss function never reached split point {self.layout.split.points[stage - 1]!r}"
        )

    def schedule_for(self, micro: list[Any]) -> Any:
        """torch's schedule over this rank's stages, built for these micro-batch shapes (and kept)."""
        import optree

        from .. import tree as _tree

        leaves = optree.tree_leaves(micro[0], namespace=_tree.NAMESPACE)
        key = tuple((tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor))
        if key in self.cache:
            return self.cache[key]
        from torch.distributed import pipelining

        lo = self.layout
        device = self.mesh.device
        self.install_hooks()
        stages = []
        for s in lo.stages:
            first = s == 0
            inputs = torch.zeros(1, dtype=torch.int64, device=device) if first else self._probe(micro[0], s)
            outputs = (
                torch.zeros(1, dtype=torch.float32, device=device)
                if s == lo.n_stages - 1
                else self._probe(micro[0], s + 1)
            )
            stages.append(
                _Stage(self, self.plan.module, s, lo.n_stages, device, inputs, outputs, group=self.group)
            )
        cls = getattr(pipelining, SCHEDULES[lo.schedule].torch_name)
        target = stages[0] if SCHEDULES[lo.schedule].placement == "single" else stages
        schedule = cls(target, n_microbatches=lo.microbatches, loss_fn=_loss_is_output, scale_grads=False)
        self.cache[key] = schedule
        return schedule


@contextlib.contextmanager
def _inside_backward(plan: Plan) -> Iterator[None]:
    """The forward's contexts for a stage's forward, which the schedule runs inside the backward's contexts: those
    open already (tensor parallel's `loss_parallel`, which does not nest) are not entered again."""
    with contextlib.ExitStack() as stack:
        if plan.autocast_dtype is not None:
            stack.enter_context(torch.autocast(plan.autocast_device_type, dtype=plan.autocast_dtype))
        for make in plan.forward_contexts:
            if make not in plan.backward_contexts:
                stack.enter_context(make())
        yield


def _entering(
    module: nn.Module, received: torch.Tensor, shapes: dict[tuple[int, ...], torch.Size]
) -> torch.Tensor:
    """The activation a stage receives, as its first module takes it: under sequence parallel this rank's part
    of the sequence, a DTensor again (`Shard(1)` over `tp`, recorded by tensor parallel's lowering), of the
    global shape the probe found (a sequence `tp` does not divide is split unevenly)."""
    layout = getattr(module, "_accelfn_residual_layout", None)
    if layout is None or is_dtensor(received):
        return received
    from torch.distributed.tensor import DTensor

    mesh, placements = layout
    shape = shapes.get(tuple(received.shape))
    stride = torch.empty(shape, device="meta").stride() if shape is not None else None
    return DTensor.from_local(received, mesh, placements, run_check=False, shape=shape, stride=stride)


def _leaving(value: torch.Tensor) -> torch.Tensor:
    """What a stage sends: a DTensor's local part (differentiably: its gradient comes back as one)."""
    return value.to_local() if is_dtensor(value) else value  # type: ignore[attr-defined]


def _local_shape(module: nn.Module, probed: torch.Tensor) -> torch.Tensor:
    """A probed boundary activation (the whole sequence: the probe bypasses every module) as this rank holds it."""
    layout = getattr(module, "_accelfn_residual_layout", None)
    if is_dtensor(probed):
        return probed.to_local()  # type: ignore[attr-defined]
    if layout is None:
        return probed
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = layout
    shape, _ = compute_local_shape_and_global_offset(probed.shape, mesh, placements)
    return probed.new_zeros(shape)


class _Static:
    """The outcome of torch's warm-up vote when every stage's shapes are given: static (`.item() == 1`), known
    on every rank without a message (and without a tensor, which a dry run's fake mode could not read)."""

    def item(self) -> int:
        return 1


_STATIC = _Static()


def _loss_is_output(output: torch.Tensor, target: Any = None) -> torch.Tensor:
    return output.sum()  # the last stage's forward already returns the loss sum (as a 1-element tensor)


def _make_stage_class() -> type:
    from torch.distributed.pipelining import PipelineStage

    class Stage(PipelineStage):  # type: ignore[misc]
        """torch's `PipelineStage` whose forward is the pipeline's `run_stage`; its shapes are given, so the
        warm-up vote (a round of point-to-point messages deciding whether to infer shapes) is not needed."""

        def __init__(self, sync: PipelineSync, module: nn.Module, index: int, n: int, device: Any, *meta: Any,
                     group: Any) -> None:  # fmt: skip
            inputs, outputs = meta
            super().__init__(module, index, n, device, input_args=inputs, output_args=outputs, group=group)
            self._sync = sync

        def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
            return self._sync.run_stage(self.stage_index, *args, **kwargs)

        def backward_maybe_with_nosync(
            self, backward_type: str, bwd_kwargs: dict[str, Any], last_backward: bool = False
        ) -> Any:
            each = self._sync.each
            if each is not None:  # sync_each_microbatch=True: this backward reduce-scatters (fsdp / hsdp)
                if backward_type != "full":  # (the zero-bubble schedules are refused under fsdp)
                    raise RuntimeError(
                        f"af.pipeline(sync_each_microbatch=True): a {backward_type!r} backward"
                    )
                from torch.distributed.pipelining._backward import stage_backward

                # torch's stage with the gradient sync on: the params stay gathered until the step's last
                # reduce (as torch keeps them), each backward reduce-scatters its gradients as `af.accumulate`'s
                # micro-batches do (hsdp's replicas all-reduce in the stage's last); the step's REDUCE_GRAD
                # then finds no unsharded gradient left, and only reshards
                self.submod.set_is_last_backward(False)  # type: ignore[operator]  # an FSDPModule
                self.submod.set_reshard_after_backward(False)  # type: ignore[operator]  # an FSDPModule
                self.submod.set_requires_gradient_sync(True)  # type: ignore[operator]  # an FSDPModule
                # this stage's units reduce-scatter every param, zeros where this backward left none (a unit or a
                # param the micro-batch did not use, data-dependent): hsdp's partial sums then always cover the
                # same params, and the stage's last backward all-reduces every unit that holds one (FSDP2 skips a
                # unit without gradients: its earlier micro-batches' sum would never reach the replicas). Only
                # while this stage's backward runs: not the rank's other stages' units, nor in the final REDUCE_GRAD
                units = self._sync.stage_units(self.stage_index)
                for unit in units:
                    unit.set_reduce_scatter_unused_params(True, recurse=False)
                try:
                    with each.microbatch(last_backward):
                        grads = stage_backward(
                            bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]
                        )
                finally:
                    for unit in units:
                        unit.set_reduce_scatter_unused_params(False, recurse=False)
                return grads, None
            out = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            if dry_mode.active() is not None:
                # torch's stage turns FSDP2's gradient sync and reshard off for every backward but the step's
                # last: the stage's unsharded gradients (in the reduce dtype) are held from the first backward
                # to the end of the step, gradients in a dry run's memory, not the activations of the modules
                # whose backward made them
                from .shard.fsdp import _unsharded_grads

                dry_mode.gradients(_unsharded_grads(self.submod))
            return out

        def _warmup_forward_vote(self, has_backward: bool, received_acc: Any = None) -> Any:
            return _STATIC

        def _warmup_backward_result(self, received_result: Any = None) -> Any:
            return _STATIC

    return Stage


def _Stage(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - built on first use (pipelining imports late)
    global _STAGE_CLASS
    if _STAGE_CLASS is None:
        _STAGE_CLASS = _make_stage_class()
    return _STAGE_CLASS(*args, **kwargs)


_STAGE_CLASS: type | None = None


class PipelinePhases(TrainPhases):
    """The engine's phases with the forward and backward run by torch's pipeline schedule."""

    def split(self, run: StepRun) -> None:
        sync = run.plan.sync
        assert isinstance(sync, PipelineSync)
        m = sync.layout.microbatches
        import optree

        from .. import tree as _tree

        for path, leaf in zip(*optree.tree_flatten_with_path(run.batch, namespace=_tree.NAMESPACE)[:2]):
            n = leaf.shape[0] if isinstance(leaf, torch.Tensor) and leaf.dim() else None
            if n is None or n % m:
                where = "batch" + "".join(f"[{p!r}]" for p in path)
                raise ValueError(
                    f"af.pipeline: {where} has {n} rows, which do not split into {m} equal micro-batches "
                    f"(microbatches x accumulate): use a batch size divisible by {m}"
                )
        run.micro = split_batch(run.batch, m)

    def forward_backward(self, run: StepRun) -> None:
        plan, params = run.plan, run.params
        sync = plan.sync
        assert isinstance(sync, PipelineSync) and plan.slots is not None
        for n in plan.slots.trainable:
            params[n].grad = None
        if plan.loss_scale is not None:
            raise ValueError("af.pipeline: fp16 loss scaling is not supported; use af.autocast(step, 'bf16')")
        run.exact = False
        schedule = sync.schedule_for(run.micro)
        sync.run, sync.results, sync.next_micro = run, {}, {}
        idx = torch.arange(
            len(run.micro), device=sync.mesh.device
        )  # the first stage's input: one per micro-batch
        try:
            with contextlib.ExitStack() as stack:
                for make in plan.backward_contexts:
                    stack.enter_context(make())
                schedule.step(idx, target=idx)  # target: unused (the last stage returns its loss)
        finally:
            sync.run = None
        if sync.each is not None:
            from .shard.fsdp import _unreduced_units

            left = _unreduced_units(plan.module)
            if left:
                raise RuntimeError(
                    f"af.pipeline(sync_each_microbatch=True): the FSDP2 units {left[:3]} hold a partial sum of this "
                    "step's gradients that was never all-reduced over the hsdp replicas (their stage's last backward "
                    "did not reduce them): the step is not applied. Leave sync_each_microbatch False"
                )
        device = sync.mesh.device
        if sync.layout.holds_last:
            got = [sync.results[i] for i in range(len(run.micro))]
            run.loss_sum = torch.stack([t.float().reshape(()) for t, _, _ in got]).sum()
            run.count_sum = torch.stack([c.float().reshape(()) for _, c, _ in got]).sum()
            for _, _, aux in got:
                for k, v in aux.items():
                    run.aux_sum[k] = v if k not in run.aux_sum else run.aux_sum[k] + v
        else:
            run.loss_sum = torch.zeros((), device=device)
            run.count_sum = torch.zeros((), device=device)
        sync.results = {}
        self.collect(run)

    def clip(self, run: StepRun) -> None:
        limit = run.plan.clip_grad_norm
        if limit is None or run.skipped:
            return
        from ..optim.clip import clip_

        sync = run.plan.sync
        assert isinstance(sync, PipelineSync)
        norm = sync.norm_of(run.grads)
        clip_([local_tensor(g) for g in run.grads.values()], norm, limit)
        run.metrics["grad_norm"] = norm


@attrs.frozen(eq=False)
class Pipeline(TransformBase):
    mesh: Mesh | None
    microbatches: int
    schedule: str = "1f1b"
    split_points: tuple[str, ...] | None = None
    stages_per_rank: int | None = None
    sync_each_microbatch: bool = False
    kind: str = "pipeline"
    _built: dict[str, Any] = attrs.field(factory=dict, init=False, eq=False, repr=False)

    def describe(self) -> str:
        pp = f", pp={self.mesh.axis_size('pp')}" if self.mesh is not None else ""
        each = ", sync_each_microbatch=True" if self.sync_each_microbatch else ""
        return f"pipeline({self.schedule}{pp}, microbatches={self.microbatches}{each})"

    def mesh_of(self, others: Sequence[Any]) -> Mesh:
        mesh = self.mesh
        if mesh is None:
            shard = find(others, "shard")
            mesh = getattr(shard, "mesh", None)
        if mesh is None:
            raise ValueError(
                "af.pipeline needs a mesh with a 'pp' axis: pass it, af.pipeline(step, mesh, ...), or compose with "
                "af.shard(step, mesh)"
            )
        if "pp" not in mesh.axis_names:
            raise ValueError(f"af.pipeline: the mesh has no 'pp' axis; its axes are {mesh.axis_names}")
        return mesh

    @property
    def v(self) -> int:
        return self.stages_per_rank or SCHEDULES[self.schedule].stages_per_rank

    def check(self, others: Sequence[Transform]) -> None:
        self.mesh_of(others)
        shard = find(others, "shard")
        if shard is not None and getattr(shard, "backend", "torch") != "torch":
            raise conflict(
                self, shard, "DeepSpeed runs its own engine; pipeline parallel needs backend='torch'"
            )
        if self.schedule in ZERO_BUBBLE and getattr(shard, "strategy", "") in ("fsdp", "hsdp"):
            raise conflict(
                self, shard, f"the zero-bubble schedule {self.schedule!r} splits each backward into input and "
                "weight gradients, which FSDP's deferred reduce-scatter does not follow when one rank holds two "
                "stages of the same model (a wrong update or a KeyError, measured on torch 2.13): use "
                "'interleaved_1f1b' or 'looped_bfs' with fsdp, or strategy='ddp' with the zero-bubble schedules",
            )  # fmt: skip
        _check_sync_each(self, shard, find(others, "accumulate"))

    def lower(self, plan: Plan) -> None:
        if plan.kind != "train":
            raise ValueError("af.pipeline(step, ...) applies to training steps")
        mesh = self.mesh_of(plan.transforms)
        pp, rank, v = mesh.axis_size("pp"), mesh.axis_rank("pp"), self.v
        n_stages = pp * v
        if self.split_points is not None:
            if len(self.split_points) + 1 != n_stages:
                raise ValueError(
                    f"af.pipeline: {len(self.split_points)} split points make {len(self.split_points) + 1} stages, "
                    f"but pp={pp} x {v} stages per rank needs {n_stages}: give {n_stages - 1} split points"
                )
            split = split_at(plan.module, self.split_points)
        else:
            split = balanced_split(plan.module, n_stages)
        info = SCHEDULES[self.schedule]
        if info.placement == "v":
            stages: tuple[int, ...] = (rank, 2 * pp - 1 - rank)
        else:
            stages = tuple(rank + k * pp for k in range(v))
        m = self.microbatches * plan.microbatches
        _check_microbatches(self.schedule, m, pp, n_stages)
        units = _units(plan.module, split, stages)
        tied = carve(plan.module, split, stages)
        _refuse_router_logits(plan.module)
        layout = _Layout(split, pp, rank, stages, m, self.schedule, tied, units)
        plan.microbatches = 1  # the schedule splits the batch
        plan.notes.append(
            f"pipeline {self.schedule} over pp={pp}: stages {list(stages)} of {n_stages} on this rank, "
            f"{m} micro-batches, bubble {bubble_fraction(pp, m, v):.0%}"
        )
        plan.notes.extend(split.describe().splitlines())
        sync = PipelineSync(LOCAL, mesh, layout, plan, group=mesh.group("pp"))
        sync.tied_groups = _tied_groups(mesh, layout, tied)
        self._built["sync"] = sync
        if not any(t.kind == "shard" for t in plan.transforms):  # pipeline alone: place and feed it here
            from .shard.common import batch_transform

            move(plan.module, mesh.device)
            plan.batch_transform = batch_transform(mesh, "local")
            # no data axes: every stage draws from the step's key itself, as one process does
            plan.rank_key = mesh.grad_rank if mesh.grad_axes else None
            plan.grad_sync = sync

    def wrap(self, inner: GradSync) -> PipelineSync:
        """The pipeline's sync over the data-parallel strategy's (called by `af.shard`'s lowering)."""
        sync: PipelineSync = self._built["sync"]
        sync.inner = inner
        if self.sync_each_microbatch:
            from .shard.fsdp import FSDPSync

            fsdp = inner
            while not isinstance(fsdp, FSDPSync) and hasattr(fsdp, "inner"):  # under tp's / ep's sync
                fsdp = fsdp.inner
            if not isinstance(fsdp, FSDPSync):  # (a mesh without data axes: tensor parallel alone)
                raise ValueError(
                    f"af.pipeline(sync_each_microbatch=True) reduce-scatters each micro-batch's gradients under "
                    f"af.shard(strategy='fsdp' or 'hsdp') over a data axis; this step syncs with "
                    f"{inner.describe()}: leave sync_each_microbatch False"
                )
            fsdp.sync_each_microbatch = True
            sync.each = fsdp
        return sync


def _check_sync_each(pipe: Pipeline, shard: Any, acc: Any) -> None:
    """`sync_each_microbatch=True` needs fsdp or hsdp (DDP's and a lone pipeline's gradients are whole on every
    rank either way); `af.accumulate(..., sync_each_microbatch=...)` beneath a pipeline, whose schedule runs its
    micro-batches, must say the same or nothing."""
    each = pipe.sync_each_microbatch
    strategy = getattr(shard, "strategy", None)
    if each and strategy not in ("fsdp", "hsdp"):
        why = (
            "the step has no af.shard, so no data-parallel sharding"
            if shard is None
            else f"strategy={strategy!r} keeps whole gradients on every rank and reduces them once, after the "
            "last backward, either way"
        )
        raise ValueError(
            f"af.pipeline(sync_each_microbatch=True) reduce-scatters each micro-batch's gradients into their "
            f"shards, under af.shard(strategy='fsdp' or 'hsdp') only: {why}. Leave sync_each_microbatch False, "
            "or shard with strategy='fsdp'"
        )
    told = getattr(acc, "sync_each_microbatch", None)
    if told is not None and told != each:
        raise conflict(
            pipe, acc, f"under af.pipeline the schedule runs the micro-batches, accumulate's among them, so when "
            f"the gradients are reduced is the pipeline's choice (sync_each_microbatch={each}); accumulate's "
            f"sync_each_microbatch={told} says otherwise: pass af.pipeline(..., sync_each_microbatch={told}) and "
            "leave accumulate's out",
        )  # fmt: skip


_ROUTER_LOGITS = (
    "af.pipeline: {what}, for a load-balancing or router z-loss: the loss runs on the last stage, where the router "
    "logits are those of its own layers only, so the loss (accelfn.moe.load_balancing_loss, router_z_loss, "
    "transformers' aux_loss) would leave out the other stages' routers. Balance MoE layers under a pipeline with "
    "the expert bias (accelfn.moe.add_expert_bias, update_expert_bias: counted on every stage), or leave out "
    "af.pipeline"
)


def _refuse_router_logits(model: nn.Module) -> None:
    """An MoE model asked for its router logits is refused (config at lowering; a call's keyword in the step's
    first forward, the shape probe every rank runs before any message)."""
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False) is True:
        raise ValueError(_ROUTER_LOGITS.format(what="the model's config.output_router_logits is True"))
    if not hasattr(config, "output_router_logits"):
        return

    def refuse(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if kwargs.get("output_router_logits"):
            raise ValueError(
                _ROUTER_LOGITS.format(what="the loss function asks for output_router_logits=True")
            )

    model.register_forward_pre_hook(refuse, with_kwargs=True)


def _check_microbatches(schedule: str, m: int, pp: int, n_stages: int) -> None:
    if schedule == "1f1b" and m < pp:
        raise ValueError(
            f"af.pipeline(schedule='1f1b'): {m} micro-batches are fewer than the {pp} stages; 1F1B needs at least "
            f"one per stage (and many more for a small bubble): use microbatches >= {pp}"
        )
    if schedule in ("interleaved_1f1b", "interleaved_zb") and m % pp:
        raise ValueError(
            f"af.pipeline(schedule={schedule!r}): {m} micro-batches must be a multiple of pp={pp}"
        )
    if schedule in ("zbv", "dualpipev") and m < n_stages:
        raise ValueError(
            f"af.pipeline(schedule={schedule!r}): {m} micro-batches are fewer than its {n_stages} stages"
        )


def _units(model: nn.Module, split: Split, stages: Sequence[int]) -> dict[int, list[str]]:
    """For each stage of this rank, the outermost modules wholly of that stage (bypassed while another runs)."""
    out: dict[int, list[str]] = {s: [] for s in stages}

    def visit(prefix: str, module: nn.Module) -> None:
        for child, sub in module.named_children():
            name = f"{prefix}.{child}" if prefix else child
            owners = split.stages_under(name)
            if len(owners) == 1:
                (s,) = owners
                if s in out:
                    out[s].append(name)
            elif owners:
                visit(name, sub)

    visit("", model)
    return out


def _tied_groups(mesh: Mesh, layout: _Layout, tied: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """A process group per tied weight: the ranks of this pipeline group holding a stage that uses it (every
    process creates every such group, in the same order, as `new_group` requires)."""
    if not tied:
        return {}
    import numpy as np

    names = mesh.axis_names
    grid = np.asarray(mesh.torch_mesh.mesh.tolist())
    axis = names.index("pp")
    moved = np.moveaxis(grid, axis, -1).reshape(-1, layout.pp)  # one row per pipeline group
    me = dist.get_rank()
    groups: dict[str, Any] = {}
    for name, stages in sorted(tied.items()):
        ranks_in_row = sorted({_place(layout, s) for s in stages})
        for row in moved:
            members = [int(row[r]) for r in ranks_in_row]
            group = dist.new_group(members) if len(members) > 1 else None
            if me in members and group is not None:
                groups[name] = group
    return groups


def _place(layout: _Layout, stage: int) -> int:
    if SCHEDULES[layout.schedule].placement == "v":
        return stage if stage < layout.pp else 2 * layout.pp - 1 - stage
    return stage % layout.pp


@checked
def pipeline_step(
    step: Step,
    mesh: Mesh | None = None,
    *,
    microbatches: int,
    schedule: str = "1f1b",
    split_points: Sequence[str] | None = None,
    stages_per_rank: int | None = None,
    sync_each_microbatch: bool = False,
) -> Step:
    """Train `step` pipeline-parallel over `mesh`'s `pp` axis (see the module docs); `af.pipeline(step, ...)`.

    `microbatches` per step (times `af.accumulate`'s count); `schedule` one of `SCHEDULES` ("gpipe", "1f1b",
    "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"); `split_points` the first module of
    each stage but the first (default: a Hugging Face decoder's layers, balanced by parameters);
    `stages_per_rank` (v) for the interleaved schedules (default 2; the V schedules need 2). `mesh` may be left
    out when the step is also `af.shard`-ed over a mesh with the `pp` axis.

    `sync_each_microbatch` (fsdp / hsdp only): False, torch's way, reduce-scatters once, after the stage's last
    backward, holding the stage's unsharded gradients (fp32: 4 bytes a parameter) from its first backward to
    the end of the step; True reduce-scatters each micro-batch's gradients into the shards as its backward runs
    (hsdp's replicas all-reduce in the last), as `af.accumulate` does: m times the reduce-scatters, none of
    that memory.

    Example (2 processes: `accelfn launch --nproc-per-node 2 train.py`):
        mesh = af.Mesh({"pp": 2})
        step = af.pipeline(af.train_step(loss_fn, af.optim.adamw(1e-3)), mesh, microbatches=4)
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"af.pipeline: schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    if microbatches < 1:
        raise ValueError(f"af.pipeline: microbatches must be >= 1, got {microbatches}")
    info = SCHEDULES[schedule]
    if stages_per_rank is not None:
        if stages_per_rank < 1:
            raise ValueError(f"af.pipeline: stages_per_rank must be >= 1, got {stages_per_rank}")
        if info.placement == "single" and stages_per_rank != 1:
            raise ValueError(
                f"af.pipeline(schedule={schedule!r}) runs one stage per rank; for {stages_per_rank} use "
                "schedule='interleaved_1f1b' (or 'looped_bfs', 'interleaved_zb')"
            )
        if info.placement == "v" and stages_per_rank != 2:
            raise ValueError(f"af.pipeline(schedule={schedule!r}) runs exactly 2 stages per rank (a V)")
    if mesh is not None and "pp" not in mesh.axis_names:
        raise ValueError(
            f"af.pipeline: the mesh has no 'pp' axis; its axes are {mesh.axis_names} (e.g. af.Mesh({{'pp': 2, 'dp': -1}}))"
        )
    points = tuple(split_points) if split_points is not None else None
    return step.with_transform(
        Pipeline(mesh, microbatches, schedule, points, stages_per_rank, sync_each_microbatch)
    )


def pipeline(target: Step | nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Pipeline parallelism over a mesh's `pp` axis, for training or inference, by what it is given:

    - `af.pipeline(step, mesh, microbatches=m, schedule="1f1b")`: a training `Step` (`pipeline_step`);
    - `af.pipeline(model, split_points, mesh, example_args=...)`: inference, `run(*inputs) -> output`
      (`accelfn.big.pipeline.pipeline`).

    Both cut the model with `accelfn.stages` (the same split points, the same automatic split).

    Example:
        >>> import torch, accelfn as af
        >>> try:
        ...     af.pipeline(af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1)), microbatches=2, schedule="x")
        ... except ValueError as e:
        ...     print(str(e)[:40])
        af.pipeline: schedule must be one of ['g
    """
    if isinstance(target, Step):
        return pipeline_step(target, *args, **kwargs)
    if isinstance(target, nn.Module):
        from ..big.pipeline import pipeline as inference

        return inference(target, *args, **kwargs)
    raise TypeError(f"af.pipeline: expected a training Step or an nn.Module, got {type(target).__name__}")
