"""`af.compile`: compile the step with `torch.compile` — forward, loss and backward in one graph.

The forward and the loss are traced by Dynamo; AOTAutograd compiles the matching backward; the optimizer
update is one fused kernel already. Learning rate and step count are tensors, so steps never recompile.
`regions="blocks"` compiles each repeated block (the largest `nn.ModuleList`, e.g. GPT-2's `h`, or a Hugging
Face model's `_no_split_modules` blocks where they hold more: both of T5's stacks; `model_blocks`) on its own
instead: identical blocks share one compiled graph, which cuts compile time on deep models.
Modules that Dynamo cannot trace (Transformer Engine layers) stay eager, with a note in `repr(step)`.

Under `af.shard(strategy="fsdp"|"hsdp")` the step is always compiled per block, as torchtitan does: each block
is compiled in place (`block.compile()`, so FSDP2's hooks, added afterwards, still run around it: a block
wrapped as `torch.compile(block)` would hide them) before FSDP2 shards the blocks and the root. A whole-step
graph would trace through FSDP2's all-gathers and measured 2.1x the unsharded compiled step on an H100.
Under `af.pipeline` too (a whole-step graph cannot hold a stage's entry and exit), each stage's blocks are compiled
one by one, as torchtitan compiles the blocks of its pipeline stages.
With a `tp` axis too (fsdp x tp, torchtitan's 2-D runs) the blocks hold DTensors and are compiled the same way;
each compiled block is entered with plain tensors where a tensor-parallel style handed it an
`AsyncCollectiveTensor` (torch 2.13 drops the gradient of such an input to a compiled region).
Under DeepSpeed ZeRO-3 (`af.shard(strategy="zero3")`) each block is compiled in place the same way, and
DeepSpeed's hooks on every module inside it (fetch and release of its partitioned params, `torch.compiler.disable`d)
run where they would run eagerly: Dynamo breaks the block's graph at each of them, so each module's own forward is a
graph of its own, and the block fetches, releases and communicates exactly as the eager step does.

Example:
    >>> import torch, accelfn as af
    >>> step = af.compile(af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)), regions="blocks")
    >>> step
    Step(train_step(<lambda>) -> compile(regions='blocks'))
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import nn

from .. import dry_mode
from .._typecheck import checked
from ..blocks import no_split_blocks
from ..step import Step
from ._base import TransformBase

if TYPE_CHECKING:
    from ..engine import Plan

__all__ = ["compile", "find_blocks", "model_blocks"]


def _untraceable(module: nn.Module) -> list[str]:
    return [n for n, m in module.named_modules() if type(m).__module__.startswith("transformer_engine")]


def find_blocks(module: nn.Module) -> tuple[str, nn.ModuleList]:
    """The `nn.ModuleList` holding the most parameters (the transformer blocks), and its name: one of several
    modules, or, where no list holds several, a `nn.ModuleList` below the root holding one (a model built with one
    layer, as `transformers` builds `num_hidden_layers=1`; an `nn.Sequential` of one module is a wrapper, not blocks).

    Example:
        >>> one = nn.ModuleDict({"embed": nn.Embedding(8, 4), "layers": nn.ModuleList([nn.Linear(4, 4)])})
        >>> name, blocks = find_blocks(one)
        >>> name, len(blocks)
        ('layers', 1)
        >>> two = nn.ModuleDict({"heads": nn.ModuleList([nn.Linear(4, 64)]), "layers": nn.ModuleList([nn.Linear(4, 4)] * 2)})
        >>> find_blocks(two)[0]  # the layers, though the one-item list of heads holds more
        'layers'
    """
    best: tuple[str, nn.ModuleList] | None = None
    best_size = 0
    for name, m in module.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1:
            size = sum(p.numel() for p in m.parameters())
            if size > best_size:
                best, best_size = (name, m), size  # type: ignore[assignment]
    if best is None:
        # only where no list holds several: a one-item list beside the layers (an embedding or head kept in a
        # list, MusicGen's one codebook) is not the blocks, however many parameters it holds
        for name, m in module.named_modules():
            if isinstance(m, nn.ModuleList) and name and len(m) == 1:
                size = sum(p.numel() for p in m.parameters())
                if size > best_size:
                    best, best_size = (name, m), size  # type: ignore[assignment]
    if best is None:
        raise ValueError(
            "compile(regions='blocks'): the model has no nn.ModuleList/nn.Sequential of repeated blocks; "
            "use compile() on the whole step instead"
        )
    return best


def model_blocks(module: nn.Module) -> tuple[str, list[nn.Module]]:
    """The blocks FSDP shards and `af.compile(regions="blocks")` compiles one by one, and the names of the lists
    holding them: a Hugging Face model's blocks by its `_no_split_modules` (`accelfn.blocks.no_split_blocks`: both
    of T5's stacks, a vision-language model's vision tower beside its language model, as Accelerate's FSDP wraps
    them) where they hold every block of `find_blocks`' list and more; else that list alone.

    Example:
        >>> from transformers import T5Config, T5ForConditionalGeneration
        >>> t5 = T5ForConditionalGeneration(T5Config(d_model=8, d_kv=4, d_ff=16, num_layers=2, num_heads=2))
        >>> name, blocks = model_blocks(t5)
        >>> name, len(blocks), find_blocks(t5)[0]  # find_blocks: the largest list alone (cross-attention)
        ('encoder.block, decoder.block', 4, 'decoder.block')
    """
    from ..stages import Skip

    name, largest = find_blocks(module)
    found = no_split_blocks(module)
    held = {id(b) for _, b in found}
    own = [b for b in largest if not isinstance(b, Skip)]  # a pipeline stage's stand-ins for others' blocks
    if len(found) > len(own) and all(id(b) in held for b in own):
        stacks = dict.fromkeys(n.rpartition(".")[0] for n, _ in found)  # in order, once each
        return ", ".join(stacks), [b for _, b in found]
    return name, list(largest)


def _plain(x: Any) -> Any:
    """An `AsyncCollectiveTensor` (what `DTensor.to_local()` gives after an async redistribute: tensor-parallel
    styles with `use_local_output=True`, such as the embedding's `RowwiseParallel`) as a plain tensor; other values
    as they are. `clone()` waits for the collective and keeps the autograd edge."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return x.clone() if isinstance(x, AsyncCollectiveTensor) else x


def _holds_dtensors(module: nn.Module) -> bool:
    """Whether tensor parallel split the module's parameters (DTensors; compile lowers before FSDP2 wraps)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def _checkpoint_outside(block: nn.Module) -> bool:
    """Whether the block's compiled region goes inside its `af.remat` checkpoint rather than around it.

    torchtitan compiles the checkpoint-wrapped block; on torch 2.13, with DTensors in the block (tensor
    parallel), AOTAutograd's graph of the checkpoint saves a `DeviceMesh` for the backward and fails ("expected
    all tensors_saved_with_vc_check to be Tensors"): sequence parallel's redistributions at the block's entry
    (measured: without sequence parallel the other order passes). There the block's own forward is compiled and the
    checkpoint stays eager around it: the same recomputation, the compiled forward run again in the backward.
    """
    return getattr(block, "_accelfn_remat_inner", None) is not None and _holds_dtensors(block)


def _compile_block(block: nn.Module, kwargs: dict[str, Any]) -> None:
    """`block.compile(**kwargs)` (in place: hooks added later, FSDP2's, run inside it), entered with plain tensors.

    On torch 2.13 a compiled region whose input is an `AsyncCollectiveTensor` returns no gradient for it:
    autograd then hands zeros as a plain tensor to DTensor's `Redistribute.backward` (an `AttributeError:
    '_local_tensor'` under tensor parallel) or the tensor before it gets no gradient at all (measured in
    tests/test_tensor_parallel.py). Waiting for the collective eagerly, before the compiled call, avoids it.
    A block `af.remat` checkpointed under tensor parallel has its forward compiled inside the checkpoint
    (`_checkpoint_outside`).
    """
    if _checkpoint_outside(block):
        from .remat import compile_inside

        def wrap(forward: Any) -> Any:
            compiled_forward = torch.compile(forward, **kwargs)

            def call(*args: Any, **kw: Any) -> Any:
                return compiled_forward(*[_plain(a) for a in args], **{k: _plain(v) for k, v in kw.items()})

            return call

        compile_inside(block, wrap)
        return
    block.compile(**kwargs)
    compiled = block._compiled_call_impl
    assert compiled is not None

    def call(*args: Any, **kw: Any) -> Any:
        return compiled(*[_plain(a) for a in args], **{k: _plain(v) for k, v in kw.items()})

    block._compiled_call_impl = call


def _under_zero3(plan: Plan) -> bool:
    """Whether the step is sharded by DeepSpeed's ZeRO-3 (its hooks on every module break a compiled block)."""
    shard = next((t for t in plan.transforms if t.kind == "shard"), None)
    if shard is None or getattr(shard, "backend", "torch") != "deepspeed":
        return False
    from .shard.deepspeed.config import zero_stage_of

    return zero_stage_of(shard) == 3


def _eager_in_region(block: nn.Module) -> None:
    """In a dry run: the block's forward run eagerly (its modules' hooks with it), its ops counted as a compiled
    region's in the time model."""
    from ..dryrun.timing import compiled_region

    forward = block.forward

    def run(*args: Any, **kwargs: Any) -> Any:
        with compiled_region():
            return forward(*args, **kwargs)

    object.__setattr__(block, "forward", run)


def _dynamo_settings_for_blocks() -> contextlib.AbstractContextManager[Any]:
    """torchtitan's and Accelerate's settings for per-block compile: `.item()` calls stay in the graph, and
    activation checkpointing's recomputation does not replay the forward's side effects. A context: the step
    enters it around its own forward and backward, so that no other compile in the process sees them."""
    config = torch._dynamo.config
    settings: dict[str, Any] = {"capture_scalar_outputs": True}
    if hasattr(config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        settings["skip_fwd_side_effects_in_bwd_under_checkpoint"] = True
    return config.patch(settings)


@attrs.frozen
class Compile(TransformBase):
    options: tuple[tuple[str, Any], ...] = ()
    regions: str | None = None
    kind: str = "compile"

    def describe(self) -> str:
        args = [f"{k}={v!r}" for k, v in self.options]
        if self.regions:
            args.append(f"regions={self.regions!r}")
        return f"compile({', '.join(args)})"

    def lower(self, plan: Plan) -> None:
        if dry_mode.active() is not None:
            self._lower_dry(plan)
            return
        kwargs = dict(self.options)
        eager = _untraceable(plan.module)
        shard = next((t for t in plan.transforms if t.kind == "shard"), None)
        fsdp = (
            getattr(shard, "strategy", None) in ("fsdp", "hsdp")
            and getattr(shard, "backend", "torch") == "torch"
        )
        pipeline = any(t.kind == "pipeline" for t in plan.transforms)
        remat_tp = _holds_dtensors(plan.module) and any(
            t.kind == "activation_checkpointing" and getattr(t, "memory_budget", None) is None
            for t in plan.transforms
        )  # a whole-step graph would hold the checkpoints (`_checkpoint_outside`)
        if (fsdp or pipeline or remat_tp) and self.regions is None:
            why = "a pipeline" if pipeline else "fsdp" if fsdp else "remat with tensor parallel"
            plan.notes.append(f"compile per block under {why}")
            Compile(self.options, "blocks").lower(plan)
            return
        if self.regions == "blocks":
            plan.forward_contexts.append(_dynamo_settings_for_blocks)
            plan.backward_contexts.append(_dynamo_settings_for_blocks)
            name, blocks = model_blocks(plan.module)
            compiled = inside = 0
            for block in blocks:
                if _untraceable(block):
                    continue
                inside += _checkpoint_outside(block)
                _compile_block(block, kwargs)
                compiled += 1
            plan.notes.append(f"compiled {compiled}/{len(blocks)} blocks of {name or 'the model'}")
            if _under_zero3(plan):
                plan.notes.append("ZeRO-3's module hooks break each block's graph at every module")
            if inside:
                plan.notes.append(f"{inside} compiled inside their remat checkpoint (tensor parallel)")
            if compiled < len(blocks):
                warnings.warn(
                    "af.compile: blocks holding Transformer Engine modules stay eager (TE layers are graph "
                    "breaks under torch.compile)",
                    stacklevel=2,
                )
            return
        if eager:
            msg = (
                f"af.compile: the model holds Transformer Engine modules ({eager[0]}, ...), which torch.compile "
                "cannot trace; falling back to compiling each block without them (regions='blocks')"
            )
            warnings.warn(msg, stacklevel=2)
            plan.notes.append("fell back to regional compile: TE modules stay eager")
            Compile(self.options, "blocks").lower(plan)
            return
        fn = plan.loss_call or plan.fn

        def loss_call(module: nn.Module, batch: Any) -> Any:
            return fn(module, batch)

        plan.loss_call = torch.compile(loss_call, **kwargs)

    def _lower_dry(self, plan: Plan) -> None:
        """In a dry run: each block's forward and backward run as the partitioned graphs of a compiled region
        (the partitioner's saved tensors: accelfn/dryrun/compiled.py), the rest of the step eagerly."""
        from ..dryrun.compiled import partition_block
        from ..stages import Skip

        try:
            name, found = model_blocks(plan.module)
        except ValueError:
            found, name = [], ""
        blocks = [b for b in found if not isinstance(b, Skip)]  # a pipeline stage's own blocks
        if _under_zero3(plan):
            # DeepSpeed's ZeRO-3 hooks fetch each module's params inside the block: one traced region over the
            # block would hold its partitions, not its params. The real run's graphs break at every hook.
            for block in blocks:
                _eager_in_region(block)
            plan.notes.append(f"dry run: {len(blocks)} blocks eager under ZeRO-3 (graph breaks at its hooks)")
            dry_mode.note(
                f"af.compile under DeepSpeed ZeRO-3: the {len(blocks)} blocks of {name or 'the model'} run eagerly "
                "with ZeRO-3's hooks (their fetches, releases and collectives as in the real run, where Dynamo breaks "
                "each block's graph at every module's hooks); their ops count as compiled in the time model, their "
                "saved tensors are eager autograd's"
            )
            return
        done = sum(partition_block(b) for b in blocks)
        plan.notes.append(f"dry run: {done}/{len(blocks)} blocks as partitioned graphs, the rest eager")
        dry_mode.note(
            f"af.compile: {done} of {len(blocks)} blocks of {name or 'the model'} run as AOTAutograd's partitioned "
            "forward/backward graphs (the min-cut partitioner's saved tensors), op by op: Inductor's fused "
            "temporaries are counted unfused (an estimate from above); the rest of the step runs eagerly"
        )


@checked
def compile(step: Step, *, regions: str | None = None, **torch_compile_kwargs: Any) -> Step:  # noqa: A001
    """Compile the step with `torch.compile(**torch_compile_kwargs)`; `regions="blocks"` compiles per block.

    Example:
        >>> import accelfn as af
        >>> af.compile(af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1)), regions="blocks")
        Step(train_step(<lambda>) -> compile(regions='blocks'))
    """
    if regions not in (None, "blocks"):
        raise ValueError(f"compile: regions must be None or 'blocks', got {regions!r}")
    return step.with_transform(Compile(tuple(sorted(torch_compile_kwargs.items())), regions))
